"""Batched covariance representations used by the moment-based estimators.

A batch of G covariances (one per mixture component) is stored in one of three forms:

- full: a tensor (G, d, d);
- diagonal: a tensor (G, d) of variances (the paper's "Var" variant);
- low rank + diagonal: a pair ``(factor (G, d, r), residual (G, d))`` meaning
  F Fᵀ + diag(residual) — the top-r eigenpairs of the data covariance plus the variance they
  leave unexplained (memory d·(r + 1) instead of d²).

Every function here accepts all three, so estimators never branch on the form.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor

Covariance = Union[Tensor, tuple[Tensor, Tensor]]


def sandwich(weight: Tensor, cov: Covariance) -> Tensor:
    """W C Wᵀ for each component, returned full (G, o, o)."""
    if isinstance(cov, tuple):
        factor, residual = cov
        projected = weight @ factor
        return projected @ projected.transpose(-1, -2) + (weight * residual.unsqueeze(1)) @ weight.T
    if cov.dim() == 2:
        return (weight * cov.unsqueeze(1)) @ weight.T
    return weight @ cov @ weight.T


def _fold_shared(rows: Tensor, rows_dim: int | None, cov: Tensor, cov_dim: int | None
                 ) -> tuple[Tensor, Tensor, int]:
    """Multiply rows by cov per component for vmap rules; returns (rows, rows @ cov, dim).

    With rows batched and cov shared, the batch is folded into rows' k: one (G, B·k, d) ×
    (G, d, d) product. Broadcasting matmul would instead copy cov once per batch element
    (for a 30-component mixture that copy was most of a batched PBRF step).
    """
    if cov_dim is None and rows_dim is not None:
        rows = rows.movedim(rows_dim, 1)  # (G, B, k, d)
        groups, batch, k, d = rows.shape
        return rows, torch.bmm(rows.reshape(groups, batch * k, d), cov).reshape(rows.shape), 1
    rows = rows.movedim(rows_dim, 0) if rows_dim is not None else rows.unsqueeze(0)
    cov = cov.movedim(cov_dim, 0) if cov_dim is not None else cov.unsqueeze(0)
    return rows, rows @ cov, 0


class _RowsTimesCovariance(torch.autograd.Function):
    """P C for a fixed symmetric C, differentiable in P, with the folding vmap rule."""

    @staticmethod
    def forward(rows: Tensor, cov: Tensor) -> Tensor:
        return rows @ cov

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        cov, = ctx.saved_tensors
        return _RowsTimesCovariance.apply(grad, cov), None  # C symmetric

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, int | None], rows: Tensor, cov: Tensor
             ) -> tuple[Tensor, int]:
        _, rows_cov, dim = _fold_shared(rows, in_dims[0], cov, in_dims[1])
        return rows_cov, dim


class _SymmetricQuadraticTrace(torch.autograd.Function):
    """tr(P C Pᵀ) for a fixed symmetric C, with a backward pass that reuses P C.

    The gradient 2 P C reuses the forward's P C, so the backward pass does not multiply by
    the (G, d, d) covariance a second time.

    Written in the ``setup_context`` form with its own vmap rule, so it also runs under
    ``torch.func`` transforms (batched PBRF solves vmap ``grad`` over stacked parameters),
    without copying C per batch element (:func:`_fold_shared`).
    """

    @staticmethod
    def forward(rows: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
        rows_cov = rows @ cov
        return (rows_cov * rows).sum((-1, -2)), rows_cov

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: tuple[Tensor, Tensor]
                      ) -> None:
        rows, cov = inputs
        rows_cov = output[1]
        ctx.mark_non_differentiable(rows_cov)
        ctx.save_for_backward(rows, cov, rows_cov)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _unused: Tensor | None) -> tuple[Tensor, None]:
        rows, cov, rows_cov = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward (torch.func.grad always asks for it)
            rows_cov = _RowsTimesCovariance.apply(rows, cov)  # keeps the graph through rows
        return 2 * grad[..., None, None] * rows_cov, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, int | None], rows: Tensor, cov: Tensor
             ) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
        rows, rows_cov, dim = _fold_shared(rows, in_dims[0], cov, in_dims[1])
        return ((rows_cov * rows).sum((-1, -2)), rows_cov), (dim, dim)


def quadratic_trace(rows: Tensor, cov: Covariance) -> Tensor:
    """tr(P C Pᵀ) per component for P of shape (G, k, d); returns (G,).

    The output variance that the directions in P pick up from C. C must be symmetric (a
    covariance), in any of the three forms.
    """
    if isinstance(cov, tuple):
        factor, residual = cov
        return (rows @ factor).pow(2).sum((-1, -2)) + (rows.pow(2) * residual.unsqueeze(1)).sum(
            (-1, -2))
    if cov.dim() == 2:
        return (rows.pow(2) * cov.unsqueeze(1)).sum((-1, -2))
    if cov.requires_grad or rows.dim() != 3:
        return ((rows @ cov) * rows).sum((-1, -2))
    return _SymmetricQuadraticTrace.apply(rows, cov)[0]


def gate(cov: Tensor, mu: Tensor) -> Tensor:
    """μμᵀ ⊙ C = diag(μ) C diag(μ) for full (G, o, o) covariances and means μ (G, o)."""
    return cov * (mu.unsqueeze(-1) * mu.unsqueeze(-2))


def sampling_factor(covariance: Tensor) -> Tensor:
    """A d × r matrix L with L Lᵀ = covariance, r = numerical rank.

    Data covariances are often singular (MNIST has constant pixels), so Cholesky fails.
    The symmetric eigendecomposition never does: negative round-off eigenvalues are clamped
    to zero and null directions dropped, so mean + L z, z ~ N(0, I_r), samples exactly the
    Gaussian on its support (and costs r instead of d per sample).
    """
    values, vectors = torch.linalg.eigh(covariance.to(torch.float64))
    values = values.clamp_min(0)
    # directions below the stored dtype's resolution are noise, not variance
    tol = values.max() * covariance.shape[-1] * torch.finfo(covariance.dtype).eps
    keep = values > tol
    if not keep.any():
        return covariance.new_zeros(covariance.shape[-1], 1)
    return (vectors[:, keep] * values[keep].sqrt()).to(covariance.dtype)


def low_rank_plus_diagonal(covariance: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of each (G, d, d) covariance, plus the diagonal they miss.

    Returns the factor F (G, d, r) of the eigenpairs and the diagonal residual
    diag(C − F Fᵀ) ≥ 0 (G, d), so the variance of every feature is kept.
    """
    values, vectors = torch.linalg.eigh(covariance.to(torch.float64))
    values = values.clamp_min(0)
    r = min(rank, covariance.shape[-1])
    top_values, top_vectors = values[..., -r:], vectors[..., -r:]
    factor = top_vectors * top_values.sqrt().unsqueeze(-2)
    residual = (covariance.diagonal(dim1=-2, dim2=-1) - factor.pow(2).sum(-1)).clamp_min(0)
    return factor.to(covariance.dtype), residual.to(covariance.dtype)


def sample(mean: Tensor, cov: Covariance | Tensor, n: int, generator: torch.Generator,
           full_factor: Tensor | None = None) -> Tensor:
    """Draw n Gaussian samples (n, d) of one component.

    Args:
        mean: (d,).
        cov: that component's covariance in any form above (without the G dimension).
        n: number of samples.
        generator: the random stream the samples come from.
        full_factor: for a full covariance, its :func:`sampling_factor` (callers cache it).
    """
    def normal(width: int) -> Tensor:
        return torch.randn(n, width, generator=generator, device=mean.device, dtype=mean.dtype)

    if isinstance(cov, tuple):
        factor, residual = cov
        return mean + normal(factor.shape[-1]) @ factor.T + normal(mean.shape[0]) * residual.sqrt()
    if cov.dim() == 1:
        return mean + normal(mean.shape[0]) * cov.sqrt()
    factor = sampling_factor(cov) if full_factor is None else full_factor
    return mean + normal(factor.shape[-1]) @ factor.T
