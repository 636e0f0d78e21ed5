"""Exact-moment BGLN-D and layer-wise reference statistics against ground truths."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsd
from fsd.moments.exact import delta_second_moment
from fsd.testing import dense_algorithm2, enumerated_gates


def _mlp(seed=0, d=5, width=6, outputs=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, outputs)).double()


def _moved(model, scale=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    moved = _mlp()
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return moved


def _data(n=400, d=5, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(
        d, d, generator=g, dtype=torch.float64) + 0.5
    return [(x, torch.randint(0, classes, (n,), generator=g))]


@pytest.mark.parametrize("covariance,classwise", [("full", False), ("diag", False),
                                                   ("lowrank", False), ("full", True)])
def test_exact_moments_equal_the_expectation_of_bgln_s(covariance, classwise):
    model, data = _mlp(), _data()
    moved = _moved(model)
    exact = fsd.BGLN(deterministic=True, moments="exact", covariance=covariance, rank=2,
                     classwise=classwise).fit(model, data)
    sampled = fsd.BGLN(num_samples=50_000, covariance=covariance, rank=2,
                       classwise=classwise, seed=3).fit(model, data)
    with torch.no_grad():
        draws = torch.stack([sampled.distance(moved) for _ in range(12)])
    standard_error = float(draws.std() / len(draws) ** 0.5)
    # BGLN-S is unbiased for the exact expectation: the gap is sampling noise only
    assert abs(float(exact.distance(moved)) - float(draws.mean())) < 5 * standard_error
    assert standard_error < 0.02 * float(draws.mean())  # the test has power


def test_exact_moments_low_rank_of_full_rank_and_diag_match_dense_references():
    # rank = d leaves a zero residual: the factored first layer must equal the full one; a
    # diagonal covariance must equal the full path fed the same covariance as a dense matrix
    model, data = _mlp(), _data()
    moved = _moved(model)
    full = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, data)
    low = fsd.BGLN(deterministic=True, moments="exact", covariance="lowrank", rank=5).fit(
        model, data)
    torch.testing.assert_close(low.distance(moved), full.distance(moved), rtol=1e-9, atol=0)
    # diagonal data: full and diag covariance describe the same Gaussian
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5000, 5, generator=g, dtype=torch.float64) * torch.arange(1, 6) + 0.2
    diag_data = [(x, torch.zeros(5000, dtype=torch.long))]
    diag = fsd.BGLN(deterministic=True, moments="exact", covariance="diag").fit(model, diag_data)
    dense = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, diag_data)
    dense._state["input.cov"] = torch.diag_embed(
        torch.diagonal(dense._state["input.cov"], dim1=-2, dim2=-1))
    dense._cache.clear()
    torch.testing.assert_close(diag.distance(moved), dense.distance(moved), rtol=1e-9, atol=0)


def test_exact_and_paper_agree_where_both_are_exact():
    # one repeated input: zero covariance, and every unit's gate is always 0 or always 1
    model = _mlp()
    x = torch.randn(1, 5, dtype=torch.float64).repeat(50, 1)
    moved = _moved(model)
    paper = fsd.BGLN(deterministic=True).fit(model, x)
    exact = fsd.BGLN(deterministic=True, moments="exact").fit(model, x)
    laftr = fsd.LAFTR(inputs="coreset").fit(model, x)
    assert set(torch.cat([v.flatten() for k, v in exact._state.items()
                          if k.startswith("gate.")]).tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(exact.distance(moved), paper.distance(moved), rtol=1e-10, atol=0)
    torch.testing.assert_close(exact.distance(moved), laftr.distance(moved), rtol=1e-10, atol=0)


def test_exact_moments_are_exact_for_linear_networks():
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 4), nn.Dropout(0.5),
                           nn.Linear(4, 3)).double()
    moved = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 4), nn.Dropout(0.5),
                          nn.Linear(4, 3)).double()
    data = _data()
    exact = fsd.BGLN(deterministic=True, moments="exact").fit(linear, data)
    truth = fsd.ExactFSD().fit(linear, data)
    torch.testing.assert_close(exact.distance(moved), truth.distance(moved), rtol=1e-10, atol=0)


def test_exact_moments_zero_at_reference_and_gradcheck():
    model, data = _mlp(), _data()
    est = fsd.BGLN(deterministic=True, moments="exact", classwise=True).fit(model, data)
    d = est.distance(model)
    grads = torch.autograd.grad(d, list(model.parameters()))
    assert float(d) == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads)

    # directional finite differences (what gradcheck does) in float64, 4 random directions
    moved = _moved(model)
    grads = torch.autograd.grad(est.distance(moved), list(moved.parameters()))
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        direction = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in moved.parameters()]
        eps = 1e-6
        values = []
        for sign in (1, -1):
            with torch.no_grad():
                for p, v in zip(moved.parameters(), direction, strict=True):
                    p.add_(sign * eps * v)
                values.append(float(est.distance(moved)))
                for p, v in zip(moved.parameters(), direction, strict=True):
                    p.sub_(sign * eps * v)
        numeric = (values[0] - values[1]) / (2 * eps)
        analytic = sum(float((gr * v).sum()) for gr, v in zip(grads, direction, strict=True))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic))


def test_layerwise_statistics_are_the_reference_networks_real_moments():
    model, data = _mlp(), _data()
    est = fsd.BGLN(deterministic=True, moments="exact", reference="layerwise").fit(model, data)
    x = data[0][0]
    with torch.no_grad():
        h1 = model[1](model[0](x))
        h2 = model[3](model[2](h1))
    for path, h in (("2", h1), ("4", h2)):
        mean = h.mean(0)
        cov = (h - mean).T @ (h - mean) / h.shape[0]
        torch.testing.assert_close(est._state[f"layer.{path}.mean"][0], mean)
        torch.testing.assert_close(est._state[f"layer.{path}.cov"][0], cov)
    assert est.nbytes > fsd.BGLN(deterministic=True, moments="exact").fit(model, data).nbytes


def test_moment_options_are_for_bgln_d_only():
    with pytest.raises(ValueError, match="BGLN-D"):
        fsd.BGLN(moments="exact")
    with pytest.raises(ValueError):
        fsd.BGLN(deterministic=True, moments="approximate")


# ----------------------------------------------------------------------------------------
# gates with a negative slope (LeakyReLU): every BGLN form against enumerated gates
# ----------------------------------------------------------------------------------------
def _gated_mlp(activation: nn.Module, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 3), activation, nn.Linear(3, 3), copy.deepcopy(activation),
                         nn.Linear(3, 2)).double()


ACTIVATIONS = {"relu": nn.ReLU(), "leaky-0.2": nn.LeakyReLU(0.2), "leaky-default": nn.LeakyReLU()}


def _fitted_statistics(est: fsd.BGLN) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return (est._state["input.mean"][0], est._state["input.cov"][0],
            [est._state["gate.1"][0], est._state["gate.3"][0]])


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_exact_moments_equal_the_enumerated_gate_expectation(name):
    # 6 hidden units: all 64 gate configurations, each a closed form over Gaussian moments
    model = _gated_mlp(ACTIVATIONS[name])
    moved = _gated_mlp(ACTIVATIONS[name], seed=1)
    est = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(
        model, _data(d=3))
    expected = enumerated_gates(model, moved, *_fitted_statistics(est))
    value = est.distance(moved)
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=0)
    # the forward recursion (the adjoint's test reference) agrees too
    layers = fsd.trace(moved)
    parts = est.moment_parts(layers, est.reference_parameters())
    forward = 0.5 * delta_second_moment(layers, est.reference_parameters(),
                                        dict(moved.named_parameters()), parts["reference"],
                                        parts["gate_means"], parts["output_rows"])
    torch.testing.assert_close(forward.sum(), expected, rtol=1e-10, atol=0)
    # and the gradient
    grads = torch.autograd.grad(value, list(moved.parameters()))
    truth = torch.autograd.grad(enumerated_gates(model, moved, *_fitted_statistics(est)),
                                list(moved.parameters()))
    for got, want in zip(grads, truth, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-13)


def test_bgln_s_on_a_leaky_network_is_unbiased_for_the_enumerated_expectation():
    activation = nn.LeakyReLU(0.2)
    model, moved = _gated_mlp(activation), _gated_mlp(activation, seed=1)
    sampled = fsd.BGLN(num_samples=50_000, covariance="full", metric="euclidean",
                       seed=3).fit(model, _data(d=3))
    expected = float(enumerated_gates(model, moved, *_fitted_statistics(sampled)))
    with torch.no_grad():
        draws = torch.stack([sampled.distance(moved) for _ in range(12)])
    standard_error = float(draws.std() / len(draws) ** 0.5)
    assert abs(expected - float(draws.mean())) < 5 * standard_error
    assert standard_error < 0.02 * expected  # the test has power


def test_algorithm2_on_a_leaky_network_scales_by_the_gates_mean():
    # Algorithm 2 with a gate of mean E[g] = α + (1 − α)μ in place of the Bernoulli mean μ
    slope = 0.2
    model = _gated_mlp(nn.LeakyReLU(slope))
    moved = _gated_mlp(nn.LeakyReLU(slope), seed=1)
    est = fsd.BGLN(deterministic=True, covariance="full").fit(model, _data(d=3))
    mean, cov, firing = _fitted_statistics(est)
    expected = dense_algorithm2(model, moved, mean, cov,
                                [slope + (1 - slope) * f for f in firing])
    torch.testing.assert_close(est.distance(moved), expected, rtol=1e-10, atol=0)
