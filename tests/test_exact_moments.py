"""Exact-moment BGLN-D and layer-wise reference statistics against ground truths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsd


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
