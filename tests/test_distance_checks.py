"""What ``distance`` checks about the model it is given, and one-line errors at ``fit``.

- ``distance`` refuses what ``fit`` refuses about the model's tensors (NaN, infinite, on the
  meta device), once per model state (:mod:`fsd.estimators.model_state`), for every
  estimator configuration and through ``fsd.combine``;
- EWC and KFAC refuse a model with θ0's parameters that computes another function (an
  activation swapped, a chain rewritten as a residual block), as NTK, LAFTR and BGLN do;
- a later batch of another shape per example, bad ``fsd.calibrate`` arguments and a
  distributed rank that never joins are one line each.
"""

from __future__ import annotations

import copy
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fsd
from conftest import mlp
from fsd.estimators import model_state
from fsd.statistics.distributed import DistributedFitError

CONFIGURATIONS = {
    "exact": fsd.ExactFSD,
    "ntk": fsd.NTK,
    "ewc": fsd.EWC,
    "kfac": fsd.KFAC,
    "laftr-coreset": fsd.LAFTR,
    "laftr-gaussian": lambda: fsd.LAFTR(inputs="gaussian", num_samples=8),
    "bgln-s": lambda: fsd.BGLN(num_samples=8),
    "bgln-s-coreset": lambda: fsd.BGLN(inputs="coreset", num_samples=8),
    "bgln-d": lambda: fsd.BGLN(deterministic=True),
    "bgln-d-exact": lambda: fsd.BGLN(deterministic=True, moments="exact"),
    "bgln-d-classwise": lambda: fsd.BGLN(deterministic=True, classwise=True),
}


def _data(n: int = 48, d: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return [(x, torch.randint(0, 3, (n,), generator=g))]


@pytest.fixture(scope="module")
def fitted() -> dict[str, fsd.Estimator]:
    model = mlp([4, 8, 3])
    return {name: make().fit(model, _data()) for name, make in CONFIGURATIONS.items()}


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_distance_refuses_non_finite_parameters(fitted, name, value):
    # before: NaN or inf came back as the distance
    moved = mlp([4, 8, 3])
    assert torch.isfinite(fitted[name].distance(moved))
    with torch.no_grad():
        moved[2].weight[1, 3] = value  # changed in place after a distance that passed
    with pytest.raises(ValueError, match=r"^parameter '2\.weight' has NaN or infinite values: "
                                         r"distance measures the model's current parameters"):
        fitted[name].distance(moved)


@pytest.mark.parametrize("name", ["ewc", "kfac", "bgln-d"])
def test_layer_terms_and_combine_refuse_them_too(fitted, name):
    moved = mlp([4, 8, 3])
    with torch.no_grad():
        moved[0].bias[0] = float("nan")
    with pytest.raises(ValueError, match=r"^parameter '0\.bias' has NaN"):
        fsd.combine([fitted[name], fitted["bgln-d-exact"]]).distance(moved)
    if fitted[name].splits_by_layer:
        with pytest.raises(ValueError, match=r"^parameter '0\.bias' has NaN"):
            fitted[name].layer_terms(moved)


@pytest.mark.parametrize("name", ["exact", "ewc", "bgln-d"])
def test_distance_refuses_a_model_on_the_meta_device(fitted, name):
    # before: a raw torch error from inside the estimator
    with torch.device("meta"):
        empty = mlp([4, 8, 3])
    with pytest.raises(ValueError, match=r"^parameter '0\.weight' is on the meta device and "
                                         r"holds no values: distance needs the model's weights"):
        fitted[name].distance(empty)


def test_a_non_finite_buffer_is_named():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model = model.double().eval()
    est = fsd.ExactFSD().fit(model, _data())
    model[1].running_mean[2] = float("nan")
    with pytest.raises(ValueError, match=r"^buffer '1\.running_mean' has NaN"):
        est.distance(model)


def test_a_finite_distance_costs_no_pass_over_the_parameters(monkeypatch, fitted):
    # the hot path: the distance's own value is checked, the parameters only when it is not
    model = mlp([4, 8, 3])
    passes = []
    original = model_state._named_tensors
    monkeypatch.setattr(model_state, "_named_tensors",
                        lambda m: (passes.append(1), original(m))[1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = fitted["bgln-d"].distance(model) + model(_data()[0][0]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert passes == []
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="has NaN"):
        fitted["bgln-d"].distance(model)
    assert passes == [1]


def test_a_parameter_the_summary_does_not_measure_may_be_anything():
    # another task's head: its NaN changes no distance, so the distance stands
    model = mlp([4, 8, 6])
    est = fsd.EWC().fit(model, _data(), outputs=[0, 1, 2])
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved[2].weight.add_(0.1)
    before = est.distance(moved).item()
    with torch.no_grad():
        moved[2].weight[4] = float("nan")  # a row of the unmeasured outputs 3-5
    with pytest.raises(ValueError, match=r"^parameter '2\.weight' has NaN"):
        est.distance(moved)  # EWC's Fisher of that row is 0, and 0 · NaN is NaN
    ntk = fsd.NTK().fit(model, _data(), outputs=[0, 1, 2])
    assert ntk.distance(moved).isfinite()
    assert before > 0


def test_a_float16_model_is_checked_without_overflowing_its_sums():
    model = mlp([4, 8, 3], dtype=torch.float32)
    est = fsd.EWC().fit(model, _data()[0][0].float())
    half = copy.deepcopy(model).half()
    with torch.no_grad():
        for p in half.parameters():
            p.fill_(60000.0)  # finite in float16, a float16 sum overflows
    est.distance(half)  # no refusal


# ----- another function with the same parameters ------------------------------------------

class _Residual(nn.Module):
    """The chain 4 → 8 → 8 → 3 with its middle layer as a residual branch: same parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                                 nn.Linear(8, 3))

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        return self.net[4](h + self.net[3](self.net[2](h)))


class _Chain(_Residual):
    def forward(self, x):
        return self.net(x)


def _swapped(activation: nn.Module) -> tuple[nn.Module, nn.Module]:
    reference = mlp([4, 8, 3])
    other = copy.deepcopy(reference)
    other[1] = activation
    return reference, other


OTHER_FUNCTIONS = {
    "tanh": lambda: _swapped(nn.Tanh()),
    "identity": lambda: _swapped(nn.Identity()),
    "residual": lambda: (lambda chain: (chain, _copy_into(_Residual(), chain)))(
        _Chain().double()),
}


def _copy_into(target: nn.Module, source: nn.Module) -> nn.Module:
    target = target.to(torch.float64)
    target.load_state_dict(source.state_dict())
    return target


@pytest.mark.parametrize("make", [fsd.EWC, fsd.KFAC,
                                  lambda: fsd.EWC(fisher="empirical", metric="kl")])
@pytest.mark.parametrize("case", sorted(OTHER_FUNCTIONS))
def test_ewc_and_kfac_refuse_another_function_with_the_same_parameters(make, case):
    # before: 0 at θ0 while the true FSD is far from 0
    reference, other = OTHER_FUNCTIONS[case]()
    data = _data()
    with torch.no_grad():
        truth = float(fsd.ExactFSD().fit(reference, data).distance(other))
    assert truth > 1e-3
    est = make().fit(reference, data)
    assert est.distance(copy.deepcopy(reference)).item() == 0.0
    with pytest.raises(fsd.ArchitectureMismatchError, match="another function"):
        est.distance(other)


@pytest.mark.parametrize("make", [fsd.EWC, fsd.KFAC])
def test_the_function_check_survives_save_and_load_and_keeps_no_data(make, tmp_path):
    reference, other = _swapped(nn.Tanh())
    x = _data()[0][0]
    est = make().fit(reference, x)
    probe = est._stored["probe.x"]
    # synthetic inputs: none of the data's rows is kept
    assert not any(torch.equal(row, r) for row in probe for r in x)
    est.save(tmp_path / "s.fsd")
    loaded = fsd.load(tmp_path / "s.fsd")
    assert loaded.distance(copy.deepcopy(reference)).item() == 0.0
    with pytest.raises(fsd.ArchitectureMismatchError, match="another function"):
        loaded.distance(other)


def test_token_inputs_get_token_probes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 6), nn.Flatten(), nn.Linear(18, 3)).double()
    tokens = torch.randint(3, 17, (32, 3))
    est = fsd.EWC().fit(model, tokens)
    probe = est._stored["probe.x"]
    assert probe.dtype == tokens.dtype and probe.min() >= 3 and probe.max() <= 16
    other = copy.deepcopy(model)
    other[1] = nn.Sequential(nn.Tanh(), nn.Flatten())
    with pytest.raises(fsd.ArchitectureMismatchError, match="another function"):
        est.distance(other)


# ----- one-line errors at fit, calibrate and across ranks ----------------------------------

@pytest.mark.parametrize("name", ["exact", "ewc", "kfac", "laftr-coreset", "ntk", "bgln-d"])
def test_a_later_batch_of_another_width_is_one_line(name):
    # before: torch's error from inside the model (or from concatenating stored inputs)
    batches = [(torch.randn(8, d, dtype=torch.float64), torch.randint(0, 3, (8,)))
               for d in (4, 5)]
    with pytest.raises(ValueError, match=r"^batch 1 has inputs of shape \(5,\) per example, "
                                         r"the batches before it \(4,\)"):
        CONFIGURATIONS[name]().fit(mlp([4, 8, 3]), batches)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seed": "a"}, r"^seed must be an integer in \[0, 2\*\*64\), got 'a'$"),
    ({"seed": 2 ** 70}, r"^seed must be an integer in \[0, 2\*\*64\)"),
    ({"seed": -1}, r"^seed must be an integer"),
    ({"model": None}, r"^model must be an nn\.Module .* got NoneType$"),
])
def test_calibrate_refuses_bad_arguments_in_one_line(fitted, kwargs, message):
    # before: TypeError / RuntimeError from torch.Generator, AttributeError from deepcopy
    arguments = {"model": mlp([4, 8, 3]), **kwargs}
    with pytest.raises(ValueError, match=message):
        fsd.calibrate(fitted["laftr-coreset"], data=_data(), **arguments)


def test_calibrate_refuses_another_architecture_in_one_line(fitted):
    # before: load_state_dict's many lines of missing and unexpected keys
    with pytest.raises(fsd.ArchitectureMismatchError) as error:
        fsd.calibrate(fitted["ewc"], mlp([4, 9, 3]), _data())
    assert "\n" not in str(error.value)


def _stalled_rank(rank: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=3))
    torch.set_num_threads(1)
    try:
        if rank == 1:
            time.sleep(8)  # never calls fit: rank 0 waits until the group's timeout
            return
        try:
            fsd.EWC().fit(mlp([4, 8, 3]), _data())
        except DistributedFitError as error:
            message = str(error)
        except Exception as error:
            message = f"UNEXPECTED {type(error).__name__}: {error}"
        else:
            message = "UNEXPECTED: fitted"
        with open(os.path.join(directory, "message"), "w") as handle:
            handle.write(message)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_never_joins_is_one_line(tmp_path):
    # before: gloo's timeout, many lines about sockets
    mp.spawn(_stalled_rank, args=(str(tmp_path),), nprocs=2, join=True)
    message = (tmp_path / "message").read_text()
    assert message.startswith("rank 0 of 2: a collective of fit failed ("), message
    assert "\n" not in message and "never joins" in message


def test_a_strength_beyond_floats_range_is_one_line():
    # before: OverflowError (int too large to convert to float)
    with pytest.raises(ValueError, match=r"^strength must be a finite non-negative number at "
                                         r"most 1e\+12, got 100000000000… \(401 characters\)"):
        fsd.ContinualRegularizer(strength=10 ** 400)
