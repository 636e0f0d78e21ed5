"""fsd.covariance: the three covariance forms against dense references, with derivatives."""

from __future__ import annotations

import torch

from fsd.covariance import low_rank_plus_diagonal, quadratic_trace, sample, sandwich

DTYPE = torch.float64


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(3, 6, 6, generator=g, dtype=DTYPE)
    rows = torch.randn(3, 2, 6, generator=g, dtype=DTYPE)
    return rows, a @ a.transpose(-1, -2)


def _dense(rows: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.trace(r @ c @ r.T) for r, c in zip(rows, cov, strict=True)])


def test_full_diag_and_lowrank_match_the_dense_trace():
    rows, cov = _problem()
    torch.testing.assert_close(quadratic_trace(rows, cov), _dense(rows, cov))
    diag = torch.diagonal(cov, dim1=-2, dim2=-1)
    torch.testing.assert_close(quadratic_trace(rows, diag), _dense(rows, torch.diag_embed(diag)))
    factor, residual = low_rank_plus_diagonal(cov, 6)  # full rank: exact
    torch.testing.assert_close(quadratic_trace(rows, (factor, residual)), _dense(rows, cov))


def test_full_covariance_gradients_first_and_second_order():
    rows, cov = _problem(1)
    rows.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r: quadratic_trace(r, cov), (rows,))
    assert torch.autograd.gradgradcheck(lambda r: quadratic_trace(r, cov), (rows,))
    # the gradient equals the dense formula's
    grad, = torch.autograd.grad(quadratic_trace(rows, cov).sum(), rows)
    expected, = torch.autograd.grad(_dense(rows, cov).sum(), rows)
    torch.testing.assert_close(grad, expected)


def test_covariance_that_requires_grad_gets_its_gradient():
    rows, cov = _problem(2)
    cov.requires_grad_(True)
    grad, = torch.autograd.grad(quadratic_trace(rows, cov).sum(), cov)
    expected = torch.einsum("gki,gkj->gij", rows, rows)
    torch.testing.assert_close(grad, expected)


def test_full_covariance_trace_runs_under_vmap_and_func_grad():
    # batched PBRF solves differentiate it with torch.func.grad inside torch.func.vmap
    rows, cov = _problem(3)
    stacked = torch.stack([rows, 2 * rows, -rows])
    batched = torch.func.vmap(lambda r: quadratic_trace(r, cov))(stacked)
    torch.testing.assert_close(batched, torch.stack([_dense(r, cov) for r in stacked]))
    grads = torch.func.vmap(torch.func.grad(lambda r: quadratic_trace(r, cov).sum()))(stacked)
    for r, g in zip(stacked, grads, strict=True):
        r = r.clone().requires_grad_(True)
        expected, = torch.autograd.grad(_dense(r, cov).sum(), r)
        torch.testing.assert_close(g, expected)


def test_trace_under_vmap_with_batched_covariances_and_second_derivatives():
    rows, cov = _problem(4)
    covs = torch.stack([cov, 2 * cov])
    stacked = torch.stack([rows, -rows])
    batched = torch.func.vmap(quadratic_trace)(stacked, covs)  # both batched: no sharing
    expected = torch.stack([_dense(r, c) for r, c in zip(stacked, covs, strict=True)])
    torch.testing.assert_close(batched, expected)
    # reverse-over-reverse under vmap (shared C): the Hessian of Σ tr(P C Pᵀ) in P is 2 C per row
    hess = torch.func.vmap(torch.func.jacrev(torch.func.jacrev(
        lambda r: quadratic_trace(r, cov).sum())))(stacked)
    g, k, d = rows.shape
    for h in hess:
        h = h.reshape(g * k * d, g * k * d)
        expected = torch.block_diag(*[torch.kron(torch.eye(k, dtype=DTYPE), 2 * c) for c in cov])
        torch.testing.assert_close(h, expected)


def test_low_rank_plus_diagonal_keeps_variances_and_is_exact_at_full_rank():
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cov = (a @ a.T).unsqueeze(0)
    factor, residual = low_rank_plus_diagonal(cov, 2)
    approx = factor @ factor.transpose(-1, -2) + torch.diag_embed(residual)
    torch.testing.assert_close(approx.diagonal(dim1=-2, dim2=-1), cov.diagonal(dim1=-2, dim2=-1))
    factor, residual = low_rank_plus_diagonal(cov, 5)
    torch.testing.assert_close(factor @ factor.transpose(-1, -2), cov)
    assert residual.abs().max() < 1e-10
    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    torch.testing.assert_close(sandwich(w, (factor, residual)), w @ cov @ w.T)


def test_low_rank_sampling_has_the_stored_covariance():
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    cov = a @ a.T + torch.eye(4, dtype=torch.float64)
    factor, residual = low_rank_plus_diagonal(cov.unsqueeze(0), 2)
    target = factor[0] @ factor[0].T + torch.diag(residual[0])
    x = sample(torch.zeros(4, dtype=torch.float64), (factor[0], residual[0]), 400_000,
               torch.Generator().manual_seed(0))
    empirical = x.T @ x / x.shape[0]
    # entries' standard error ~ sqrt(2/n)·max variance; 6 standard errors
    tolerance = 6 * (2 / x.shape[0]) ** 0.5 * float(target.diagonal().max())
    assert (empirical - target).abs().max() < tolerance
