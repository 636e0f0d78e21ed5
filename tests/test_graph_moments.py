"""BGLN-D with exact moments on graphs that are not chains (:mod:`fsd.moments.exact_graph`).

Ground truth:
- the residual network of ``test_bgln_graph``, whose BGLN expectation is written out there by
  hand and summed over every gate configuration (``_closed_form``), for ReLU gates
  (Bernoulli laws of the stored firing frequencies) and smooth ones (four-point laws with
  the stored moments): the exact-moment distance must equal it to round-off;
- on chains, the specialised chain recursion (:mod:`fsd.moments.exact`), an independent
  implementation: equal to round-off in value and gradient;
- on graphs with concatenations, slicing and scaled skips, the Monte-Carlo mean of BGLN-S
  within 5 standard errors.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsd
from conftest import DTYPE, perturbed
from fsd.model.signature import model_state
from fsd.moments.exact_graph import graph_plan, graph_second_moment
from test_bgln_graph import (
    Residual,
    _bernoulli_law,
    _closed_form,
    _data,
    _four_point_law,
    _moments,
    _stacked,
)
from test_linearize import ZOO, _build, _moved

pytestmark = pytest.mark.usefixtures("single_thread")


def _expected(model: Residual, moved: Residual, est: fsd.BGLN, data, classwise: bool,
              smooth: bool) -> torch.Tensor:
    """Σ_c p_c · the closed form under component c's input moments and gate laws."""
    xs, ys = _stacked(data)
    groups = [ys == c for c in range(3)] if classwise else [torch.ones_like(ys, dtype=bool)]
    stored = est._gate_means()
    total = torch.zeros((), dtype=DTYPE)
    for g, members in enumerate(groups):
        laws = []
        for path, module in ((("gelu" if smooth else "relu"), None), ("act", model.act)):
            statistics = stored[path][g]
            if not smooth:
                laws.append(_bernoulli_law(statistics))
                continue
            rule = fsd.model.rules.RULES[nn.GELU if module is None else type(module)]
            laws.append(_four_point_law(rule.gate_moments(module or nn.GELU(), statistics)))
        total = total + members.to(DTYPE).mean() * _closed_form(
            model, moved, *_moments(xs[members]), laws)
    return total


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("classwise", [False, True])
def test_exact_moments_on_a_residual_network_equal_the_enumerated_closed_form(smooth,
                                                                              classwise):
    model = Residual(smooth=smooth).to(DTYPE)
    if smooth:
        with torch.no_grad():  # secant and slope differ on many examples
            model.fc1.weight.mul_(3)
            model.fc3.weight.mul_(3)
    moved = perturbed(model, 0.3, seed=2)
    data = _data(1000)
    est = fsd.BGLN(deterministic=True, moments="exact", covariance="full",
                   classwise=classwise).fit(model, data)
    assert est._meta["evaluator"] == "exact-graph"
    with torch.no_grad():
        expected = _expected(model, moved, est, data, classwise, smooth)
    got = est.distance(moved)
    torch.testing.assert_close(got.detach(), expected, rtol=1e-10, atol=0)
    assert float(est.distance(model)) == pytest.approx(0.0, abs=1e-15)


def test_the_gradient_on_a_residual_network_is_the_closed_forms():
    model = Residual().to(DTYPE)
    moved = perturbed(model, 0.3, seed=2)
    data = _data(1000)
    est = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, data)
    value = est.distance(moved)
    (grad,) = torch.autograd.grad(value, moved.fc1.weight)
    # central differences of the closed form along a random direction (it is quadratic in
    # the parameters of one layer, so the difference quotient is exact up to round-off)
    direction = torch.randn(moved.fc1.weight.shape, generator=torch.Generator().manual_seed(5),
                            dtype=DTYPE)
    step = 1e-3
    values = []
    for sign in (1, -1):
        shifted = copy.deepcopy(moved)
        with torch.no_grad():
            shifted.fc1.weight.add_(sign * step * direction)
            values.append(_expected(model, shifted, est, data, False, False))
    numeric = (values[0] - values[1]) / (2 * step)
    torch.testing.assert_close((grad * direction).sum(), numeric, rtol=1e-8, atol=0)


CHAINS = {
    "relu": lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(),
                                  nn.Linear(5, 4)),
    "batchnorm-gelu": lambda: nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.GELU(),
                                            nn.Linear(5, 5), nn.Sigmoid(), nn.Dropout(0.1),
                                            nn.Linear(5, 4)),
    "leaky": lambda: nn.Sequential(nn.Linear(6, 5), nn.LeakyReLU(0.1), nn.Linear(5, 4)),
}


@pytest.mark.parametrize("covariance", ["full", "lowrank", "diag"])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_on_a_chain_the_graph_walk_equals_the_chain_recursion(name, covariance):
    torch.manual_seed(0)
    model = CHAINS[name]().to(DTYPE).eval()
    if name.startswith("batchnorm"):
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 6, generator=g, dtype=DTYPE)
    y = torch.randint(3, (300,), generator=g)
    est = fsd.BGLN(deterministic=True, moments="exact", covariance=covariance, rank=3,
                   classwise=True).fit(model, [(x, y)])
    assert est._meta["evaluator"] == "exact"  # the chain path
    moved = perturbed(model, 0.2, seed=3)
    if name.startswith("batchnorm"):
        with torch.no_grad():
            moved[1].running_var.mul_(1.2)
    chain = est.distance(moved)
    reference = est.reference_state()
    plan = graph_plan(model, reference, 6)
    per_group = 0.5 * graph_second_moment(
        plan, moved, reference, model_state(moved), est._state["input.mean"],
        est.input_covariance(), est._gate_means(), torch.eye(4, dtype=DTYPE))
    graph = (est._state["weights"] * per_group).sum()
    torch.testing.assert_close(graph, chain, rtol=1e-12, atol=0)
    parameters = list(moved.parameters())
    for a, b in zip(torch.autograd.grad(chain, parameters),
                    torch.autograd.grad(graph, parameters), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


class Branches(nn.Module):
    """Two branches concatenated, a scaled skip, a slice and a view: every linear step kind."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.left, self.right = nn.Linear(4, 3), nn.Linear(4, 2)
        self.mix = nn.Linear(5, 4)
        self.act = nn.LeakyReLU(0.2)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.cat([F.relu(self.left(x)), torch.tanh(self.right(x))], dim=1)
        h = self.act(self.norm(self.mix(h))) + 0.5 * x
        h = h.view(h.size(0), -1)
        return self.out(h) - h[:, :3]


def test_exact_moments_on_a_branching_graph_equal_the_mean_of_bgln_s():
    model = Branches().to(DTYPE).eval()
    with torch.no_grad():
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2.0)
    moved = perturbed(model, 0.3, seed=2)
    with torch.no_grad():
        moved.norm.running_mean.add_(0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 4, generator=g, dtype=DTYPE) * 1.5 + 0.3
    exact = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, x)
    sampled = fsd.BGLN(covariance="full", num_samples=40_000, seed=3).fit(model, x)
    expected = float(exact.distance(moved))
    with torch.no_grad():
        draws = torch.stack([sampled.distance(moved) for _ in range(12)])
    mean, standard_error = float(draws.mean()), float(draws.std() / math.sqrt(12))
    assert abs(mean - expected) < 5 * standard_error
    assert standard_error < 0.02 * expected  # the test has power
    # Algorithm 2 is not defined on this graph: it refuses and names what takes it
    with pytest.raises(fsd.UnsupportedModuleError, match=r"use BGLN-D with moments='exact' on MLP "
                                                           r"chains and graphs"):
        fsd.BGLN(deterministic=True).fit(model, x)


def test_graph_summaries_batch_save_and_load_like_chain_ones(tmp_path):
    model = Residual().to(DTYPE)
    moved = perturbed(model, 0.3, seed=2)
    first = fsd.BGLN(deterministic=True, moments="exact", classwise=True).fit(model, _data(500))
    second = fsd.BGLN(deterministic=True, moments="exact").fit(perturbed(model, 0.1, seed=7),
                                                               _data(500, seed=3))
    combined = fsd.SummarySet([first, second], [1.0, 2.0]).distance(moved)
    torch.testing.assert_close(combined, first.distance(moved) + 2 * second.distance(moved),
                               rtol=1e-12, atol=0)
    first.save(tmp_path / "residual.fsd")
    torch.testing.assert_close(fsd.load(tmp_path / "residual.fsd").distance(moved),
                               first.distance(moved), rtol=1e-12, atol=0)


class WithLayerNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(x + F.relu(self.norm(self.fc(x))))


class Softmaxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(x + torch.softmax(self.fc(x), dim=-1))


class Product(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(F.relu(self.a(x)) * self.b(x))


class ParameterInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(3, 3), nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.out(x + F.relu(self.fc(x)) * self.scale)


class ConvResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(1, 1, 3, padding=1), nn.Linear(16, 2)

    def forward(self, x):
        return self.out((x + F.relu(self.conv(x))).flatten(1))


@pytest.mark.parametrize("model, shape, message", [
    (WithLayerNorm(), (3,), r"LayerNorm has parameters or buffers but no affine rule at "
                            r"graph node 'norm'"),
    (Softmaxed(), (3,), r"not affine in its inputs at graph node 'softmax'"),
    (Product(), (3,), r"not affine in its inputs at graph node 'mul'"),
    (ParameterInForward(), (3,), r"a parameter read in forward at graph node 'mul'"),
    (ConvResidual(), (1, 4, 4), r"needs flat inputs"),
])
def test_what_exact_moments_cannot_propagate_is_refused_in_one_line(model, shape, message):
    model = model.to(DTYPE)
    x = torch.randn(50, *shape, dtype=DTYPE)
    with pytest.raises(NotImplementedError, match=message) as info:
        fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, x)
    assert "\n" not in str(info.value)
    assert "BGLN-S" in str(info.value)
    # BGLN-S takes each of them
    assert float(fsd.BGLN(num_samples=16).fit(model, x).distance(perturbed(model, 0.3))) > 0


def test_layerwise_reference_moments_are_refused_on_a_graph():
    with pytest.raises(fsd.UnsupportedModuleError, match=r"reference='layerwise' takes MLP chains"):
        fsd.BGLN(deterministic=True, moments="exact", reference="layerwise").fit(
            Residual().to(DTYPE), _data(50))


class Chunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(2, 2)

    def forward(self, x):
        left, right = torch.chunk(F.relu(self.fc(x)), 2, dim=1)
        return self.out(left) + right


def test_an_operation_returning_several_tensors_is_refused_not_read_as_a_constant():
    model = Chunked().to(DTYPE)
    with pytest.raises(NotImplementedError, match=r"returning tuple.*graph node 'chunk'"):
        fsd.BGLN(deterministic=True, moments="exact").fit(model, torch.randn(50, 4,
                                                                             dtype=DTYPE))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_on_every_zoo_model_exact_moments_are_bgln_s_mean_or_a_one_line_refusal(name):
    model, _ = _build(name)
    shape = ZOO[name][1]
    x = torch.randn(1000, *shape, generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    moved = _moved(model, 0.2)
    exact = fsd.BGLN(deterministic=True, moments="exact", covariance="full")
    if len(shape) > 1:  # images and token sequences: not flat feature vectors
        # graphs and chains word the refusal differently; both name the non-flat input
        with pytest.raises(NotImplementedError,
                           match=r"needs flat inputs|on layers over images or sequences") as info:
            exact.fit(model, x)
        assert "\n" not in str(info.value)
        return
    expected = float(exact.fit(model, x).distance(moved))
    sampled = fsd.BGLN(covariance="full", num_samples=20_000, seed=1).fit(model, x)
    with torch.no_grad():
        draws = torch.stack([sampled.distance(moved) for _ in range(12)])
    mean, standard_error = float(draws.mean()), float(draws.std() / math.sqrt(12))
    assert abs(mean - expected) < 5 * standard_error
    assert standard_error < 0.03 * expected


class RootOfInput(nn.Module):
    """Finite on positive data, NaN at the affinity check's random probes."""

    def __init__(self, root=torch.sqrt) -> None:
        super().__init__()
        self.root = root
        self.fc, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(self.root(x))))


@pytest.mark.parametrize("root", [torch.sqrt, torch.log], ids=["sqrt", "log"])
def test_an_operation_undefined_at_the_probes_is_refused_not_passed(root):
    # NaN compares False against the tolerance: it used to pass as affine
    x = torch.rand(50, 3, dtype=DTYPE) + 0.5
    with pytest.raises(NotImplementedError,
                       match=rf"not affine in its inputs at graph node '{root.__name__}'"):
        fsd.BGLN(deterministic=True, moments="exact").fit(RootOfInput(root).to(DTYPE), x)
