"""No silent wrong numbers at fit and in the uses of a summary (reliability round 3).

Half-precision models (their sums overflowed), non-finite or ``meta`` parameters at ``fit``,
``fsd.calibrate`` arguments that made λ NaN, and ContinualRegularizer strengths and files.
The distributed cases (an empty shard, ranks with different θ0) are in test_distributed.py.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

import fsd
from conftest import cnn, mlp, perturbed

# every estimator of README.md's table
ESTIMATORS = {
    "exact": fsd.ExactFSD,
    "laftr": fsd.LAFTR,
    "bgln-s": fsd.BGLN,
    "bgln-d": lambda: fsd.BGLN(deterministic=True),
    "bgln-d-exact": lambda: fsd.BGLN(deterministic=True, moments="exact"),
    "ntk": fsd.NTK,
    "ewc": fsd.EWC,
    "ewc-kl": lambda: fsd.EWC(metric="kl"),
    "kfac": fsd.KFAC,
}
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _pixels(n: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Raw 0–255 pixel values: their squares (up to 65025) sum past float16's 65504."""
    return torch.rand((n, *shape), generator=torch.Generator().manual_seed(seed)) * 255


# ----- 4: float16 / bfloat16 models ------------------------------------------------------

def _check_half(make, model32: nn.Module, x: torch.Tensor, dtype: torch.dtype, tmp_path
                ) -> None:
    half = copy.deepcopy(model32).to(dtype)
    moved = perturbed(half, scale=1e-2)
    estimator = make().fit(half, x.to(dtype))
    distance = estimator.distance(moved)
    # the reference: the same estimator on the float32 copy of the half-precision model (every
    # float16/bfloat16 number is a float32 one). Both compute the same float32 operations on
    # the same values, so they agree to float32 round-off (rtol 1e-6 leaves room for any
    # reordering); against the float32 original the half model differs by its own rounding
    # of the weights (~1e-3 relative), which is no error of the estimator.
    copy32, moved32 = copy.deepcopy(half).float(), copy.deepcopy(moved).float()
    expected = make().fit(copy32, x.to(dtype).float()).distance(moved32)
    assert distance.dtype == torch.float32 and bool(torch.isfinite(distance))
    torch.testing.assert_close(distance, expected, rtol=1e-6, atol=0)
    # the gradient reaches the half-precision parameters, as the float32 copy's does
    distance.backward()
    expected.backward()
    for (name, p), q in zip(moved.named_parameters(), moved32.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == dtype, name
        torch.testing.assert_close(p.grad, q.grad.to(dtype), rtol=0, atol=0, msg=name)
    # whatever is saved loads, and measures alike
    estimator.save(tmp_path / "half.fsd")
    loaded = fsd.load(tmp_path / "half.fsd")
    torch.testing.assert_close(loaded.distance(moved).detach(), expected.detach(), rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_a_half_precision_model_measures_as_its_float32_copy(name, dtype, tmp_path):
    # before: EWC's Fisher and KFAC's factors overflowed float16 (inf, NaN), were saved,
    # and fsd.load refused the file
    _check_half(ESTIMATORS[name], mlp([6, 16, 16, 3], dtype=torch.float32), _pixels(64, (6,)),
                dtype, tmp_path)


@pytest.mark.parametrize("name", ["exact", "bgln-d", "kfac", "ewc"])
def test_a_half_precision_cnn_measures_as_its_float32_copy(name, tmp_path):
    _check_half(ESTIMATORS[name], cnn(dtype=torch.float32), _pixels(16, (1, 8, 8)),
                torch.float16, tmp_path)


def test_statistics_recorded_on_a_half_precision_model_fit_in_float32():
    model = mlp([6, 16, 3], dtype=torch.float32).half()
    x = _pixels(64, (6,)).half()
    collector = fsd.StatisticsCollector(model)
    with collector, collector.record():
        model(x)
    recorded = fsd.BGLN(deterministic=True).fit(model, statistics=collector)
    direct = fsd.BGLN(deterministic=True).fit(model, x)
    moved = perturbed(model, scale=1e-2)
    assert bool(torch.isfinite(recorded.distance(moved)))
    torch.testing.assert_close(recorded.distance(moved), direct.distance(moved), rtol=1e-5,
                               atol=0)


def test_a_half_precision_penalty_is_float32_and_finite():
    model = mlp([6, 16, 3], dtype=torch.float32).half()
    reg = fsd.ContinualRegularizer(fsd.EWC, strength=2.0)
    assert reg.penalty(model).dtype == torch.float32  # no task yet: a float32 zero
    reg.end_task(model, _pixels(64, (6,)))
    reg.end_task(model, _pixels(64, (6,), seed=1))
    moved = perturbed(model, scale=1e-2)
    penalty = reg.penalty(moved)
    assert penalty.dtype == torch.float32 and bool(torch.isfinite(penalty))
    expected = 2.0 * sum(s.distance(moved) for s in reg.summaries)
    torch.testing.assert_close(penalty, expected, rtol=1e-6, atol=0)


def test_float32_and_float64_models_keep_their_dtype():
    for dtype in (torch.float32, torch.float64):
        model = mlp([6, 16, 3], dtype=dtype)
        estimator = fsd.KFAC().fit(model, torch.randn(32, 6, dtype=dtype))
        assert estimator._stored["kfac.0.A"].dtype == dtype
        assert estimator.distance(perturbed(model)).dtype == dtype


# ----- 10: non-finite and meta parameters at fit ------------------------------------------

@pytest.mark.parametrize("name", ["exact", "bgln-d", "ntk", "ewc", "kfac"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_fit_refuses_non_finite_parameters_naming_the_first(name, value):
    model = mlp([4, 8, 3])
    with torch.no_grad():
        model[2].weight[1, 3] = value
    with pytest.raises(ValueError, match=r"^parameter '2\.weight' has NaN or infinite") as error:
        ESTIMATORS[name]().fit(model, torch.randn(16, 4, dtype=torch.float64))
    assert "\n" not in str(error.value)


def test_fit_refuses_a_diverged_training_run():
    # `fsd cl --lr 1e30`: the task's model is NaN after its first step; before, fit stored
    # it, and the next task failed to load the "not a valid summary" file
    model = mlp([4, 8, 3], dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e30)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    with pytest.raises(ValueError, match="has NaN or infinite values"):
        fsd.BGLN(deterministic=True, moments="exact").fit(model, x)


def test_fit_refuses_non_finite_buffers():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    model.eval()
    model[1].running_var[2] = math.inf
    with pytest.raises(ValueError, match=r"^buffer '1\.running_var' has NaN or infinite"):
        fsd.ExactFSD().fit(model, torch.randn(16, 4, dtype=torch.float64))


@pytest.mark.parametrize("name", ["exact", "bgln-d", "ewc"])
def test_fit_refuses_a_meta_device_model_in_one_line(name):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"^parameter '0\.weight' is on the meta device") \
            as error:
        ESTIMATORS[name]().fit(model, torch.randn(16, 4))
    assert "\n" not in str(error.value)


# ----- 7: calibrate and scale_lambda -----------------------------------------------------

def _calibration_setup():
    model = mlp([4, 16, 3], dtype=torch.float32)
    train = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    held_out = torch.randn(100, 4, generator=torch.Generator().manual_seed(1))
    return model, fsd.EWC().fit(model, train), held_out


@pytest.mark.parametrize("scale", [0.0, -0.1, math.nan, math.inf, 1e30, 1e-30])
def test_calibrate_refuses_a_scale_that_leaves_no_finite_ratio(scale):
    # before: a Calibration whose median ratio (and so λ) was NaN
    model, estimator, held_out = _calibration_setup()
    with pytest.raises(ValueError, match=r"scale") as error:
        fsd.calibrate(estimator, model, held_out, scale=scale)
    assert "\n" not in str(error.value)


def test_calibrate_refuses_no_moved_network():
    model, estimator, held_out = _calibration_setup()
    with pytest.raises(ValueError, match=r"^moved is empty"):
        fsd.calibrate(estimator, model, held_out, moved=[])


def test_calibrate_refuses_an_unmoved_network_naming_it():
    model, estimator, held_out = _calibration_setup()
    moved = [perturbed(model), copy.deepcopy(model)]
    with pytest.raises(ValueError, match=r"^moved\[1\]: the true FSD is 0"):
        fsd.calibrate(estimator, model, held_out, moved=moved)


def test_calibrate_refuses_a_zero_true_fsd_of_a_network_that_moved():
    # the summary covers output 0; the network moved only the weights of output 2
    model = mlp([4, 16, 3], dtype=torch.float32)
    x = torch.randn(100, 4)
    estimator = fsd.EWC().fit(model, x, outputs=[0])
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved[2].weight[2] += 1.0
    with pytest.raises(ValueError, match=r"^moved\[0\]: the true FSD is 0"):
        fsd.calibrate(estimator, model, x, moved=[moved])


def test_calibrate_refuses_a_moved_network_with_nan_parameters():
    model, estimator, held_out = _calibration_setup()
    moved = perturbed(model)
    with torch.no_grad():
        moved[0].bias[0] = math.nan
    with pytest.raises(ValueError, match=r"^moved\[0\]: parameter '0\.bias' has NaN"):
        fsd.calibrate(estimator, model, held_out, moved=[moved])


def test_scale_lambda_refuses_a_zero_estimate():
    # before: ZeroDivisionError (a median ratio of 0)
    calibration = fsd.uses.calibration.Calibration("EWC()", (0.0, 0.0, 0.0), (0.1, 0.2, 0.3))
    with pytest.raises(ValueError, match="median estimate/exact ratio is 0"):
        calibration.scale_lambda(1.0)


@pytest.mark.parametrize("exact_lambda", [math.nan, math.inf, -1.0, "2", True])
def test_scale_lambda_refuses_a_lambda_that_is_not_a_finite_number(exact_lambda):
    calibration = fsd.uses.calibration.Calibration("EWC()", (0.1, 0.2), (0.2, 0.4))
    with pytest.raises(ValueError, match="exact_lambda must be a finite number"):
        calibration.scale_lambda(exact_lambda)


def test_scale_lambda_refuses_an_overflowing_lambda():
    calibration = fsd.uses.calibration.Calibration("EWC()", (1e-300, 1e-300), (1.0, 1.0))
    with pytest.raises(ValueError, match="overflows"):
        calibration.scale_lambda(1e300)


def test_calibrate_still_scales_lambda():
    model, estimator, held_out = _calibration_setup()
    calibration = fsd.calibrate(estimator, model, held_out)
    assert math.isfinite(calibration.scale_lambda(1.0)) and calibration.scale_lambda(1.0) > 0


# ----- 11: ContinualRegularizer strengths and files ----------------------------------------

@pytest.mark.parametrize("strength", [1e308, 1e13, math.inf, "2", True, None])
def test_the_regularizer_refuses_a_strength_out_of_range_or_not_a_number(strength):
    with pytest.raises(ValueError, match="strength must be a finite non-negative number at "
                                         "most 1e\\+12"):
        fsd.ContinualRegularizer(fsd.EWC, strength=strength)


def test_the_regularizer_accepts_its_bounds():
    assert fsd.ContinualRegularizer(fsd.EWC, strength=0).strength == 0.0
    assert fsd.ContinualRegularizer(fsd.EWC, strength=1e12).strength == 1e12


def _saved_regularizer(tmp_path):
    model = mlp([4, 8, 3])
    reg = fsd.ContinualRegularizer(fsd.LAFTR, strength=2.0)
    reg.end_task(model, torch.randn(32, 4, dtype=torch.float64))
    reg.save(tmp_path / "reg.fsd")
    return torch.load(tmp_path / "reg.fsd", weights_only=True)


@pytest.mark.parametrize("strength", ["2", True, 1e308, [2.0]])
def test_a_regularizer_file_with_a_bad_strength_is_refused(tmp_path, strength):
    payload = _saved_regularizer(tmp_path)
    payload["strength"] = strength
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match=r"bad settings.*strength must be"):
        fsd.ContinualRegularizer.load(tmp_path / "bad.fsd")


def test_a_regularizer_file_naming_a_private_estimator_is_refused(tmp_path):
    payload = _saved_regularizer(tmp_path)
    payload["summaries"][0]["estimator"] = "_LinearizedEstimator"
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError,
                       match=r"\(task 0\): unknown estimator '_LinearizedEstimator'"):
        fsd.ContinualRegularizer.load(tmp_path / "bad.fsd")


# ----- outputs fsd cannot measure, refused at fit; a failed fit loses nothing -------------

class _Squeezed(nn.Module):
    """A regression net returning (N,): the metrics would reduce over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).squeeze(-1)


class _PerToken(nn.Module):
    """(N, T, C) outputs: the metrics would reduce over C only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x.view(x.shape[0], 5, 4))))


class _SqrtInput(nn.Module):
    """NaN outputs on finite inputs at θ0 (the square root of negative inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.sqrt(x))))


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("model, features, shape", [
    (_Squeezed, 6, "(1,)"), (_PerToken, 20, "(1, 5, 3)")], ids=["squeezed", "per-token"])
def test_fit_refuses_outputs_that_are_not_one_row_per_example(name, model, features, shape):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=rf"shape {re.escape(shape)}; fsd measures \(N, K\)"):
        ESTIMATORS[name]().fit(model(), torch.randn(16, features))


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_fit_refuses_a_model_whose_reference_output_is_not_finite(name):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="NaN or infinite at the reference parameters"):
        ESTIMATORS[name]().fit(_SqrtInput(), -torch.rand(16, 6))


@pytest.mark.parametrize("make", [fsd.ExactFSD, fsd.LAFTR, fsd.BGLN, fsd.NTK, fsd.EWC,
                                  fsd.KFAC])
@pytest.mark.parametrize("metric", ["kl", "softmax_euclidean"])
def test_a_softmax_metric_over_one_output_is_refused(make, metric):
    # a softmax over one unit is constant: every distance would be exactly 0
    x = torch.randn(16, 6)
    with pytest.raises(ValueError, match="softmax over one output is always 1"):
        make(metric=metric).fit(mlp([6, 8, 1]), x)
    with pytest.raises(ValueError, match="softmax over one output is always 1"):
        make(metric=metric).fit(mlp([6, 8, 3]), x, outputs=[2])
    make(metric=metric).fit(mlp([6, 8, 3]), x, outputs=[1, 2])  # two outputs are fine


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_a_failed_refit_keeps_the_summary_fitted_before(name, tmp_path):
    model, x = mlp([6, 8, 3]), torch.randn(16, 6)
    moved = perturbed(model, scale=0.05)
    estimator = ESTIMATORS[name]().fit(model, x)
    fitted = {k: v.clone() for k, v in estimator._stored.items()}
    estimator.distance(moved)
    for bad in (dict(data=torch.randn(8, 5)), dict(data=x, outputs=[7]),
                dict(data=[])):
        with pytest.raises(ValueError):
            estimator.fit(model, **bad)
        assert estimator._meta["fitted"]
        torch.testing.assert_close(estimator._stored, fitted, rtol=0, atol=0)
        assert bool(torch.isfinite(estimator.distance(moved)))
    estimator.save(tmp_path / "kept.fsd")
    torch.testing.assert_close(fsd.load(tmp_path / "kept.fsd")._stored, fitted, rtol=0, atol=0)


def test_ntk_refuses_a_model_that_computes_another_function_at_theta0(tmp_path):
    # the same parameters under another activation: J·Δθ = 0 would read a distance of 0
    torch.manual_seed(0)
    x = torch.randn(32, 6)
    relu = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    gelu = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    gelu.load_state_dict(relu.state_dict())
    estimator = fsd.NTK().fit(relu, x)
    with pytest.raises(fsd.ArchitectureMismatchError, match="another function"):
        estimator.distance(gelu)
    moved = perturbed(relu, scale=0.05)
    value = estimator.distance(moved)
    # a summary saved without f(x, θ0) (before it was stored) still loads and measures
    del estimator._stored["coreset.f0"]
    estimator.save(tmp_path / "old.fsd")
    torch.testing.assert_close(fsd.load(tmp_path / "old.fsd").distance(moved), value)


@pytest.mark.parametrize("covariance", ["full", "lowrank", "diag"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_recorded_non_finite_inputs_are_refused_at_fit(covariance, value):
    # fit with data refuses such a batch; recorded batches are checked when fit reads them
    torch.manual_seed(0)
    x = torch.randn(48, 6, dtype=torch.float64)
    x[5, 0] = value
    model = mlp([6, 8, 3])
    estimator = fsd.BGLN(deterministic=True, covariance=covariance)
    collector = estimator.statistics_collector(model)
    for i in range(0, 48, 16):
        with collector.record():
            model(x[i:i + 16])
    with pytest.raises(ValueError, match="recorded inputs contain NaN or infinite values"):
        estimator.fit(model, statistics=collector)


# ----- EWC's empirical Fisher: labels and targets it can use -----------------------------

def _ewc_data(classes: int = 4):
    torch.manual_seed(0)
    x = torch.randn(48, 6, dtype=torch.float64)
    return mlp([6, 8, classes]), x, torch.randint(0, classes, (48,))


def test_empirical_fisher_takes_labels_as_a_column_too():
    model, x, y = _ewc_data()
    flat = fsd.EWC(fisher="empirical", metric="kl").fit(model, (x, y))
    column = fsd.EWC(fisher="empirical", metric="kl").fit(model, (x, y[:, None]))
    torch.testing.assert_close(column._stored, flat._stored, rtol=0, atol=0)


@pytest.mark.parametrize("labels, outputs, message", [
    (lambda y: y.double() + 0.5, None, "one integer class label per example"),
    (lambda y: torch.stack([y, y], 1), None, "one integer class label per example"),
    (lambda y: y + 2, [2, 3], r"label \d is not an index of the 2 selected outputs"),
    (lambda y: -y - 1, None, r"label -\d is not an index of the 4 selected outputs"),
])
def test_empirical_fisher_refuses_labels_it_cannot_use(labels, outputs, message):
    model, x, y = _ewc_data()
    if outputs is not None:
        y = y % 2
    with pytest.raises(ValueError, match=message):
        fsd.EWC(fisher="empirical", metric="kl").fit(model, (x, labels(y)), outputs=outputs)


def test_empirical_fisher_with_the_euclidean_metric_takes_targets_not_labels():
    model, x, y = _ewc_data()
    with pytest.raises(ValueError, match=r"targets of the selected outputs' shape \(48, 4\), "
                                         r"got \(48,\) \(class labels: use metric='kl'\)"):
        fsd.EWC(fisher="empirical").fit(model, (x, y))
    targets = torch.randn(48, 4, dtype=torch.float64)
    targets[3, 1] = float("nan")
    with pytest.raises(ValueError, match="targets contain NaN or infinite values"):
        fsd.EWC(fisher="empirical").fit(model, (x, targets))
    # one output: (n,) targets are its column
    single = mlp([6, 8, 1])
    t = torch.randn(48, dtype=torch.float64)
    a = fsd.EWC(fisher="empirical").fit(single, (x, t))
    b = fsd.EWC(fisher="empirical").fit(single, (x, t[:, None]))
    torch.testing.assert_close(a._stored, b._stored, rtol=0, atol=0)


@pytest.mark.parametrize("outputs, message", [
    (3, r"got 3 \(outputs=\[3\] selects one output\)"),
    (torch.tensor(2), r"outputs=\[2\] selects one output"),
    ([0, 0], r"repeats an index \(\[0, 0\]\): that output would count twice"),
    ([True], "non-negative integer output indices"),
    ([1.0], "non-negative integer output indices"),
    ([-1], "non-negative integer output indices"),
    ([], "non-empty list"),
    (slice(None, None, -1), "needs a positive step"),
])
def test_outputs_that_are_not_distinct_indices_are_refused_in_one_line(outputs, message):
    with pytest.raises(ValueError, match=message):
        fsd.LAFTR().fit(mlp([6, 8, 4]), torch.randn(16, 6), outputs=outputs)


@pytest.mark.parametrize("outputs", [np.array([1, 3]), range(1, 3), (0, 2), [np.int64(2)],
                                     torch.tensor([0, 3])])
def test_outputs_take_any_sequence_of_integers(outputs):
    model, x = mlp([6, 8, 4]), torch.randn(16, 6)
    expected = fsd.ExactFSD().fit(model, x, outputs=[int(i) for i in outputs])
    got = fsd.ExactFSD().fit(model, x, outputs=outputs)
    moved = perturbed(model, scale=0.1)
    torch.testing.assert_close(got.distance(moved), expected.distance(moved))


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0])
def test_combine_refuses_weights_that_are_not_finite_and_non_negative(weight):
    estimator = fsd.LAFTR().fit(mlp([6, 8, 4]), torch.randn(16, 6))
    with pytest.raises(ValueError, match="weights must be finite and non-negative"):
        fsd.combine([estimator, estimator], [1.0, weight])


class _Tied(nn.Module):
    """One weight under two names, as language models tie their embedding and output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("name", ["laftr", "bgln-s", "bgln-d", "bgln-d-exact", "ewc", "kfac"])
def test_estimators_reading_each_layers_parameters_refuse_tied_weights_at_fit(name):
    # they failed at distance (or fit) with a raw KeyError
    with pytest.raises(ValueError, match=r"ties parameters \('b.weight' is 'a.weight'\).*use "
                                         r"ExactFSD or NTK"):
        ESTIMATORS[name]().fit(_Tied(), torch.randn(16, 8))


@pytest.mark.parametrize("name", ["exact", "ntk"])
def test_exact_fsd_and_ntk_measure_tied_weights(name, tmp_path):
    torch.manual_seed(0)
    model, x = _Tied(), torch.randn(32, 8)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.a.weight.add_(0.01 * torch.randn(8, 8))  # moves both uses
    estimator = ESTIMATORS[name]().fit(model, x)
    value = estimator.distance(moved)
    with torch.no_grad():
        truth = 0.5 * (moved(x) - model(x)).pow(2).sum(-1).mean()
    # ExactFSD is the truth; NTK its linearization, close for a small move
    torch.testing.assert_close(value, truth, rtol=1e-6 if name == "exact" else 0.05, atol=0)
    estimator.save(tmp_path / "tied.fsd")
    torch.testing.assert_close(fsd.load(tmp_path / "tied.fsd").distance(moved), value)


class _NoGradBackbone(nn.Module):
    """A frozen backbone run under torch.no_grad() inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = torch.relu(self.a(x))
        return self.b(h)


@pytest.mark.parametrize("make", [fsd.EWC, fsd.KFAC])
def test_gradient_based_summaries_name_a_forward_that_blocks_its_gradients(make):
    with pytest.raises(ValueError, match=rf"^{make.__name__} differentiates the model's outputs"
                                         r".*torch.no_grad\(\) in forward\?.*requires_grad_"):
        make().fit(_NoGradBackbone(), torch.randn(16, 6))
    # the advice works: the same backbone frozen by requires_grad_(False)
    frozen = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    frozen[0].requires_grad_(False)
    assert float(make().fit(frozen, torch.randn(16, 6)).distance(frozen)) == 0.0


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(8, 2)

    def forward(self, x, z):
        return self.out(torch.relu(self.a(x) + self.b(z)))


class _Joined(nn.Module):
    """user-guide.md's recipe: the two inputs side by side in one tensor, sliced apart."""

    def __init__(self, model: nn.Module, x_features: int) -> None:
        super().__init__()
        self.model, self.x_features = model, x_features

    def forward(self, xz):
        return self.model(xz[:, :self.x_features], xz[:, self.x_features:])


def _one_input_twin(joined: _Joined) -> nn.Sequential:
    """The same function with one input layer: [W_a W_b] and b_a + b_b."""
    two = joined.model
    first = nn.Linear(7, 8).to(two.a.weight.dtype)
    out = copy.deepcopy(two.out)
    with torch.no_grad():
        first.weight.copy_(torch.cat([two.a.weight, two.b.weight], dim=1))
        first.bias.copy_(two.a.bias + two.b.bias)
    return nn.Sequential(first, nn.ReLU(), out)


@pytest.mark.parametrize("name", ["exact", "laftr", "bgln-s", "bgln-d", "bgln-d-exact", "ntk",
                                  "ewc", "kfac"])
def test_a_tuple_input_is_refused_with_the_joining_recipe(name):
    # Algorithm 2 reads the forward's signature before the data: either message says it
    x, z = torch.randn(16, 4), torch.randn(16, 3)
    with pytest.raises((ValueError, TypeError),
                       match=r"^(batch 0's input is a tuple of 2: |_TwoInputs.forward takes 2 "
                             r"inputs).*join the inputs"):
        ESTIMATORS[name]().fit(_TwoInputs(), [((x, z), torch.zeros(16, dtype=torch.long))])


def test_a_forward_missing_its_second_input_is_refused_with_the_joining_recipe():
    with pytest.raises(ValueError, match=r"missing 1 required positional argument.*"
                                         r"forward_kwargs=.*same for every example.*join"):
        fsd.ExactFSD().fit(_TwoInputs(), torch.randn(16, 4))


@pytest.mark.parametrize("name", ["exact", "laftr", "bgln-s", "bgln-d-exact", "ntk"])
def test_a_joined_two_input_model_measures_as_its_one_input_twin(name):
    # the function-space estimators see one function of xz, whichever way it is written
    torch.manual_seed(0)
    joined = _Joined(_TwoInputs(), 4).double()
    moved = perturbed(joined, 0.1, seed=1)
    twin, moved_twin = _one_input_twin(joined), _one_input_twin(moved)
    xz = torch.randn(256, 7, dtype=torch.float64)
    values = []
    for model, other in ((joined, moved), (twin, moved_twin)):
        est = ESTIMATORS[name]().fit(model, xz)
        torch.manual_seed(3)  # BGLN-S samples gates and inputs: the same draws for both
        values.append(float(est.distance(other)))
    assert values[0] > 1e-4
    assert values[0] == pytest.approx(values[1], rel=1e-9)


@pytest.mark.parametrize("name", ["ewc", "kfac"])
def test_parameter_space_estimators_take_a_joined_two_input_model(name):
    joined = _Joined(_TwoInputs(), 4)
    xz = torch.randn(256, 7)
    est = ESTIMATORS[name]().fit(joined, (xz, torch.randint(0, 2, (256,))))
    assert float(est.distance(perturbed(joined, 0.1, seed=1))) > 0


def test_algorithm_2_refuses_a_joined_two_input_model_at_fit():
    with pytest.raises(fsd.UnsupportedModuleError):
        fsd.BGLN(deterministic=True).fit(_Joined(_TwoInputs(), 4), torch.randn(64, 7))


# ----- CNN walks that failed at distance with torch's own messages ---------------------------
@pytest.mark.parametrize("first", [nn.ReLU(), nn.MaxPool2d(2)])
def test_algorithm2_refuses_a_chain_that_starts_with_a_gate_at_fit(first):
    # it raised a shape mismatch inside a vector-Jacobian product at every distance
    size = 32 if isinstance(first, nn.ReLU) else 2
    model = nn.Sequential(first, nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(size, 3))
    x = torch.randn(40, 1, 6, 6)
    with pytest.raises(NotImplementedError, match=f"{type(first).__name__} at '0' comes first"):
        fsd.BGLN(deterministic=True).fit(model, x)
    assert math.isfinite(float(fsd.BGLN().fit(model, x).distance(perturbed(model, 0.1))))


def test_distance_by_a_graph_walk_on_a_cnn_is_refused_in_one_line():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
    est = fsd.BGLN(deterministic=True).fit(model, torch.randn(40, 1, 6, 6))
    with pytest.raises(NotImplementedError, match=r"needs flat inputs \(got examples of shape"):
        est.distance_by(perturbed(model, 0.1), "exact-graph")


class _BatchStatisticsGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2, track_running_stats=False)
        self.fc = nn.Linear(72, 3)

    def forward(self, x):
        h = self.conv(x)
        return self.fc((torch.relu(self.bn(h)) + h).flatten(1))


@pytest.mark.parametrize("make", [fsd.LAFTR, fsd.BGLN])
def test_batch_norm_without_running_statistics_in_a_graph_is_named(make):
    # was: "cannot linearize this model's graph ('running_mean')"
    with pytest.raises(fsd.UnsupportedModuleError, match="BatchNorm2d at 'bn' without running"):
        make().fit(_BatchStatisticsGraph().eval(), torch.randn(20, 1, 6, 6))


class _ShapeUnpacking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(2, 3)

    def forward(self, x):
        h = self.conv(x)
        b, c, height, width = h.shape
        return self.fc(torch.relu(h.reshape(b, c, height * width).transpose(1, 2))).mean(1)


def test_a_chain_broken_by_a_shape_read_says_so():
    # was: "it reads no instead of the previous step 'conv'"
    with pytest.raises(fsd.UnsupportedModuleError, match="does not read the previous step 'conv'"):
        fsd.BGLN(deterministic=True).fit(_ShapeUnpacking(), torch.randn(10, 1, 4, 4))


def test_an_untraceable_forward_gives_its_advice_once():
    class Setitem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            h = self.fc(x)
            h[:, 0] = 0
            return h

    with pytest.raises(ValueError, match="cannot trace") as caught:
        fsd.LAFTR().fit(Setitem(), torch.randn(10, 4))
    assert str(caught.value).count("on any model") == 1
