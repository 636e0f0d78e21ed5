"""BGLN on smooth activations (GELU, SiLU, Tanh, Sigmoid, ELU, Softplus) against ground truths.

Every form of BGLN gates a smooth activation by a random pair (r, g) with the moments
stored at fit (:class:`fsd.model.rules.GateMoments`); BGLN-D with exact moments depends on nothing
else, so it must equal the enumerated expectation under any discrete law with those moments.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

import fsd
from conftest import DTYPE, perturbed
from fsd.model.linearize import linearized_outputs
from fsd.model.rules import GateMoments
from fsd.moments.exact import delta_second_moment
from fsd.testing import GateLaw, dense_algorithm2, enumerated_gate_pairs

ACTIVATIONS = {"gelu": nn.GELU(), "gelu-tanh": nn.GELU(approximate="tanh"), "silu": nn.SiLU(),
               "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid(), "elu": nn.ELU(0.7),
               "softplus": nn.Softplus(beta=2.0)}


def _mlp(activation: nn.Module, seed: int = 0, widths=(3, 3, 2, 2)) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(copy.deepcopy(activation))
    return nn.Sequential(*layers).to(DTYPE)


def _moved(model: nn.Module, scale: float = 0.3, seed: int = 1) -> nn.Module:
    return perturbed(model, scale, seed)


def _data(n: int = 300, d: int = 3, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=DTYPE) * 1.5 + 0.2


def _four_point_law(moments: GateMoments) -> GateLaw:
    """A discrete law with the given moments: mean + L·(±1, ±1), L the Cholesky factor."""
    root = moments.reference_variance.clamp_min(0).sqrt()
    lower = torch.where(root > 0, moments.covariance / torch.where(root > 0, root, 1), 0)
    rest = (moments.delta_variance - lower**2).clamp_min(0).sqrt()
    signs = torch.tensor([[1, 1], [1, -1], [-1, 1], [-1, -1]], dtype=DTYPE)
    r = moments.reference_mean[:, None] + root[:, None] * signs[:, 0]
    g = (moments.delta_mean[:, None] + lower[:, None] * signs[:, 0]
         + rest[:, None] * signs[:, 1])
    return GateLaw(r, g, torch.full_like(r, 0.25), moments.offset)


def _laws(est: fsd.BGLN, model: nn.Module) -> list[GateLaw]:
    stored = est._gate_means()
    return [_four_point_law(layer.rule.gate_moments(layer.module, stored[layer.path][0]))
            for layer in fsd.trace(model) if isinstance(layer.rule, fsd.GateRule)]


def _input_moments(est: fsd.BGLN) -> tuple[torch.Tensor, torch.Tensor]:
    return est._state["input.mean"][0], est._state["input.cov"][0]


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_exact_moments_equal_the_enumerated_expectation_of_a_law_with_those_moments(name):
    # 5 hidden units, 4 gate pairs each: 1,024 configurations, each a closed form
    model = _mlp(ACTIVATIONS[name])
    moved = _moved(model)
    est = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, _data())
    expected = enumerated_gate_pairs(model, moved, *_input_moments(est), _laws(est, model))
    got = est.distance(moved)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    # the gradient too (adjoint recursion vs autograd through the enumeration)
    grads = torch.autograd.grad(got, list(moved.parameters()))
    expected_grads = torch.autograd.grad(expected, list(moved.parameters()))
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    # and the dense forward recursion, the adjoint's own reference
    layers = fsd.trace(model)
    parts = est.moment_parts(layers, est.reference_state())
    dense = 0.5 * delta_second_moment(layers, est.reference_state(), dict(moved.named_parameters()),
                                      parts["reference"], parts["gate_means"],
                                      parts["output_rows"])
    torch.testing.assert_close(dense.sum(), expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("name", ["gelu", "sigmoid", "tanh"])
def test_bgln_s_is_unbiased_for_the_exact_moments(name):
    model = _mlp(ACTIVATIONS[name], widths=(3, 6, 5, 2))
    moved = _moved(model)
    exact = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, _data())
    sampled = fsd.BGLN(num_samples=40_000, covariance="full", seed=3).fit(model, _data())
    expected = float(exact.distance(moved))
    with torch.no_grad():
        draws = torch.stack([sampled.distance(moved) for _ in range(12)])
    standard_error = float(draws.std() / math.sqrt(len(draws)))
    assert abs(expected - float(draws.mean())) < 5 * standard_error
    assert standard_error < 0.02 * expected  # the test has power


@pytest.mark.parametrize("name", ["gelu", "sigmoid", "softplus"])
def test_algorithm2_gates_the_reference_by_the_secant_and_differences_by_the_slope(name):
    model = _mlp(ACTIVATIONS[name])
    moved = _moved(model)
    est = fsd.BGLN(deterministic=True, covariance="full").fit(model, _data())
    stored = est._gate_means()
    gates = []
    for layer in fsd.trace(model):
        if isinstance(layer.rule, fsd.GateRule):
            moments = layer.rule.gate_moments(layer.module, stored[layer.path][0])
            gates.append((moments.reference_mean, moments.delta_mean, moments.offset))
    expected = dense_algorithm2(model, moved, *_input_moments(est), gates)
    torch.testing.assert_close(est.distance(moved), expected, rtol=1e-10, atol=0)


def test_stored_gate_moments_are_the_data_averages_of_the_secant_and_slope_pair():
    model = _mlp(nn.Sigmoid(), widths=(3, 5, 4, 2))
    x = _data()
    est = fsd.BGLN(deterministic=True, moments="exact").fit(model, x)
    with torch.no_grad():
        s = model[0](x)  # the pre-activations of the first Sigmoid
    sigma = torch.sigmoid(s)
    r = torch.where(s != 0, (sigma - 0.5) / s, 0.25)
    g = sigma * (1 - sigma)
    expected = torch.stack([r, g, r * r, r * g, g * g], dim=-1).mean(0)
    torch.testing.assert_close(est._state["gate_moments.1"][0], expected, rtol=1e-12, atol=0)
    assert "gate.1" not in est._state


@pytest.mark.parametrize("name", ["gelu", "softplus"])
def test_laftr_on_a_smooth_chain_equals_the_graph_linearization(name):
    # the chain pass (propagate_linearized: φ(s0), φ'(s0) by rule) against the graph pass's JVP
    # of each operation (linearized_outputs)
    model = _mlp(ACTIVATIONS[name], widths=(4, 7, 6, 3))
    moved = _moved(model)
    x = _data(50, 4)
    est = fsd.LAFTR(coreset_size=None).fit(model, x)
    reference = est.reference_state()
    z0, dz = linearized_outputs(moved, reference, x)
    expected = 0.5 * dz.pow(2).sum(-1).mean()
    torch.testing.assert_close(est.distance(moved), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(z0, model(x), rtol=1e-12, atol=1e-12)


def test_functional_smooth_activations_in_a_class_model_are_their_modules():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(3, 5), nn.Linear(5, 4), nn.Linear(4, 2)

        def forward(self, x):
            x = nn.functional.gelu(self.fc1(x), approximate="tanh")
            return self.fc3(torch.sigmoid(self.fc2(x)))

    torch.manual_seed(0)
    net = Net().to(DTYPE)
    twin = nn.Sequential(net.fc1, nn.GELU(approximate="tanh"), net.fc2, nn.Sigmoid(), net.fc3)
    moved_net = _moved(net)
    moved_twin = nn.Sequential(moved_net.fc1, nn.GELU(approximate="tanh"), moved_net.fc2,
                               nn.Sigmoid(), moved_net.fc3)
    x = _data()
    for make in (lambda: fsd.BGLN(deterministic=True, moments="exact"),
                 lambda: fsd.BGLN(deterministic=True), lambda: fsd.LAFTR()):
        torch.testing.assert_close(make().fit(net, x).distance(moved_net),
                                   make().fit(twin, x).distance(moved_twin), rtol=1e-12, atol=0)


def test_a_smooth_summary_survives_save_and_load_and_tampering_is_refused(tmp_path):
    model = _mlp(nn.GELU(), widths=(3, 5, 4, 2))
    moved = _moved(model)
    est = fsd.BGLN(deterministic=True, moments="exact", classwise=True).fit(
        model, [(_data(), torch.arange(300) % 3)])
    path = tmp_path / "gelu.fsd"
    est.save(path)
    loaded = fsd.load(path)
    torch.testing.assert_close(loaded.distance(moved), est.distance(moved), rtol=0, atol=0)
    # a second moment below the squared mean is a negative variance
    payload = torch.load(path, weights_only=True)
    key = next(k for k in payload["tensors"] if k.startswith("gate_moments."))
    payload["tensors"][key][..., 2] = -1.0
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match="gate pair"):
        fsd.load(tmp_path / "bad.fsd")


def test_exact_moments_refuse_two_activations_in_a_row_at_fit():
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)
    with pytest.raises(NotImplementedError, match=r"Tanh at '2' follows GELU at '1'"):
        fsd.BGLN(deterministic=True, moments="exact").fit(model, _data())
    # Algorithm 2 scales by one mean after the other; BGLN-S draws each gate on its own
    for est in (fsd.BGLN(deterministic=True), fsd.BGLN()):
        value = est.fit(model, _data()).distance(_moved(model))
        assert torch.isfinite(value) and float(value) > 0
