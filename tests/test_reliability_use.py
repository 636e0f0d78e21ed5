"""No silent wrong numbers in how users call fit, distance and the regularizer (probe round 4).

Each case was found by trying reasonable uses against the oracle (ExactFSD, an unmoved model
reading 0, the same function written two ways): regularizer factories and edits, inputs with
autograd history, batches of the wrong form, probabilities under a softmax metric, autocast,
models changed in place, wrappers, and statistics recorded on another model.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import fsd
from conftest import mlp, perturbed

DTYPE = torch.float64


def _x(n: int = 64, d: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


# ----- ContinualRegularizer ---------------------------------------------------------------

def test_a_factory_returning_one_estimator_for_every_task_is_refused():
    model, shared = mlp([4, 8, 3]), fsd.ExactFSD()
    reg = fsd.ContinualRegularizer(lambda: shared)
    reg.end_task(model, _x())
    # the second task would refit the first task's summary in place
    with pytest.raises(ValueError, match="already holds: it must build a new one"):
        reg.end_task(perturbed(model), _x(seed=1))
    assert len(reg) == 1


@pytest.mark.parametrize("edit", ["pop", "reduction", "replace"])
def test_the_penalty_follows_edits_of_the_summaries_and_the_reduction(edit):
    model = mlp([4, 8, 3])
    reg = fsd.ContinualRegularizer(fsd.ExactFSD, reduction="mean")
    for t in range(3):
        reg.end_task(perturbed(model, 0.1, seed=10 + t), _x(seed=t))
    moved = perturbed(model, 0.2, seed=5)
    float(reg.penalty(moved))  # builds and caches the batched set
    if edit == "pop":
        reg.summaries.pop(0)
    elif edit == "reduction":
        reg.reduction = "sum"
    else:
        reg.summaries[1] = fsd.ExactFSD().fit(model, _x(seed=7))
    weights = reg.weights()
    expected = sum(w * float(s.distance(moved)) for w, s in zip(weights, reg.summaries,
                                                                 strict=True))
    assert float(reg.penalty(moved)) == pytest.approx(expected, rel=1e-12)


# ----- data forms ---------------------------------------------------------------------------

ESTIMATORS = {
    "exact": fsd.ExactFSD,
    "laftr-coreset": lambda: fsd.LAFTR(inputs="coreset"),
    "bgln-coreset": lambda: fsd.BGLN(inputs="coreset"),
    "ntk": fsd.NTK,
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_inputs_with_autograd_history_are_stored_detached(name):
    # fit(head, encoder(x)): the summary must not hold the encoder's graph
    encoder, head = nn.Linear(5, 4).double(), mlp([4, 8, 3])
    est = ESTIMATORS[name]().fit(head, encoder(_x(d=5)))
    assert not any(t.requires_grad for t in est._state.values())
    moved = perturbed(head)
    for _ in range(2):  # a second backward through a kept graph would fail
        est.distance(moved).backward()
    assert encoder.weight.grad is None


def test_a_list_of_x_and_y_with_other_shapes_is_refused_as_one_batch_in_a_list():
    x, y = _x(), torch.randint(0, 3, (64,))
    with pytest.raises(ValueError, match=r"one \(x, y\) batch .* is passed as a tuple"):
        fsd.ExactFSD().fit(mlp([4, 8, 3]), [x, y])


def test_a_list_of_two_tensors_of_one_shape_warns_that_it_reads_two_batches():
    # [x, y] of a 1-D regression: x and y both (N, 1)
    x, y = _x(d=1), _x(d=1, seed=1)
    with pytest.warns(UserWarning, match="read as 2 batches of inputs"):
        two = fsd.ExactFSD().fit(mlp([1, 8, 1]), [x, y])
    assert two._state["data.x"].shape[0] == 128


def test_examples_instead_of_batches_are_refused_in_one_line():
    x, y = _x(), torch.randint(0, 3, (64,))
    with pytest.raises(ValueError, match="label is a scalar: data is an iterable of batches"):
        fsd.ExactFSD().fit(nn.Sequential(nn.Flatten(), mlp([4, 8, 3])),
                           list(zip(x.view(64, 2, 2), y, strict=True)))


# ----- outputs and metrics ------------------------------------------------------------------

@pytest.mark.parametrize("metric", ["kl", "softmax_euclidean"])
@pytest.mark.parametrize("make", [fsd.ExactFSD, fsd.NTK, fsd.LAFTR, fsd.BGLN])
def test_probabilities_under_a_softmax_metric_are_refused(make, metric):
    model = nn.Sequential(mlp([4, 8, 3]), nn.Softmax(dim=-1))
    with pytest.raises(ValueError, match="already probabilities"):
        make(metric=metric).fit(model, _x())


def test_log_probabilities_under_kl_are_the_logits_distance():
    # softmax(log p) = p: LogSoftmax outputs measure as the logits they come from
    logits = mlp([4, 8, 3])
    log_probs = nn.Sequential(logits, nn.LogSoftmax(dim=-1))
    moved = perturbed(log_probs)
    a = fsd.ExactFSD(metric="kl").fit(log_probs, _x()).distance(moved)
    b = fsd.ExactFSD(metric="kl").fit(logits, _x()).distance(moved[0])
    assert float(a) == pytest.approx(float(b), rel=1e-10)


# ----- the model's state at distance --------------------------------------------------------

@pytest.mark.parametrize("make", [fsd.ExactFSD, fsd.NTK, fsd.LAFTR, fsd.EWC])
def test_a_penalty_inside_a_bfloat16_autocast_is_the_one_outside(make):
    model = mlp([4, 16, 3], dtype=torch.float32)
    x = _x().float()
    est = make().fit(model, x)
    moved = perturbed(model)
    outside = float(est.distance(moved))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float(est.distance(model)) == 0.0
        assert float(est.distance(moved)) == outside


def test_ntk_refuses_a_model_changed_in_place_after_a_first_distance():
    model = mlp([4, 8, 3])
    est = fsd.NTK().fit(model, _x())
    same = copy.deepcopy(model)
    assert float(est.distance(same)) == 0.0
    same[1] = nn.GELU()  # the same object now computes another function at θ0
    with pytest.raises(fsd.ArchitectureMismatchError, match="another function"):
        est.distance(same)


def test_ntk_fits_under_warnings_as_errors():
    # torch's first forward-mode product warns about torch.jit.script; a fresh process
    code = ("import torch, fsd; m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), "
            "torch.nn.Linear(8, 3)); fsd.NTK().fit(m, torch.randn(16, 4)); print('fitted')")
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "fitted" in done.stdout, done.stderr[-500:]


@pytest.mark.parametrize("make", [fsd.LAFTR, fsd.BGLN, lambda: fsd.BGLN(deterministic=True)])
def test_an_averaged_model_measures_as_the_model_it_averages(make):
    model = mlp([4, 8, 3])
    averaged = torch.optim.swa_utils.AveragedModel(model)
    moved = perturbed(model)
    torch.manual_seed(0)
    a = float(make().fit(averaged, _x()).distance(torch.optim.swa_utils.AveragedModel(moved)))
    torch.manual_seed(0)
    b = float(make().fit(model, _x()).distance(moved))
    assert a == pytest.approx(b, rel=1e-12) and b > 0


def test_a_head_added_after_fit_is_named():
    model = nn.ModuleDict({"body": mlp([4, 8, 3])})
    est = fsd.EWC().fit(model["body"], _x())
    model["body"].append(nn.Linear(3, 2).double())
    with pytest.raises(fsd.ArchitectureMismatchError, match=r"added: \['3.weight', '3.bias'\]"):
        est.distance(model["body"])


# ----- statistics -----------------------------------------------------------------------------

def test_a_coreset_summary_from_statistics_alone_asks_for_the_data():
    model = mlp([4, 8, 3])
    est = fsd.BGLN(inputs="coreset")
    collector = est.statistics_collector(model)
    with torch.no_grad(), collector.record():
        model(_x())
    with pytest.raises(ValueError, match="keeps a coreset of the training inputs: pass the "
                                         "task's data as well"):
        est.fit(model, statistics=collector)


@pytest.mark.parametrize("make", [fsd.BGLN, lambda: fsd.BGLN(deterministic=True),
                                  lambda: fsd.BGLN(deterministic=True, moments="exact")])
def test_statistics_recorded_on_a_model_of_another_width_are_refused_at_fit(make):
    other = mlp([4, 6, 3])
    collector = make().statistics_collector(other)
    with torch.no_grad(), collector.record():
        other(_x())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="statistics= do not fit this model"):
            make().fit(mlp([4, 8, 3]), statistics=collector)


class _PlainTensorAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer, self.scale = nn.Linear(4, 3).double(), torch.ones(3, dtype=DTYPE)

    def forward(self, x):
        return torch.relu(self.layer(x)) * self.scale


@pytest.mark.parametrize("make", [fsd.LAFTR, fsd.BGLN])
def test_a_tensor_attribute_that_is_not_a_buffer_is_named_at_fit(make):
    # θ0 holds parameters and buffers: a plain tensor attribute has no reference value
    with pytest.raises(ValueError, match=r"reads 'scale', a tensor that is neither a parameter "
                                         r"nor a buffer .*self\.register_buffer"):
        make().fit(_PlainTensorAttribute(), _x())
