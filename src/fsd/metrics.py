"""Output-space distances ρ(f(x, θ0), f(x, θ)) used by every estimator.

All metrics are per-example; estimators average them over (real or modelled) inputs.
``"euclidean"`` carries the ½ of the paper's eq. 8, so that for a network linear in its
inputs FSD = ½ E‖Δz‖² = ½‖E Δz‖² + ½ tr Cov(Δz).
"""

from __future__ import annotations

import torch
from torch import Tensor

METRICS: tuple[str, ...] = ("euclidean", "softmax_euclidean", "kl")


def check_metric(metric: str) -> str:
    """Return ``metric`` if it names a known metric, else raise ``ValueError`` listing them."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    return metric


def pointwise_distance(metric: str, reference: Tensor, difference: Tensor) -> Tensor:
    """Per-example distance between reference outputs z0 and outputs z0 + Δz.

    Estimators produce the difference Δz directly (often far more accurately than z − z0),
    so it is what this function takes.

    Args:
        metric: ``"euclidean"`` (½‖Δz‖² on logits), ``"softmax_euclidean"``
            (½‖softmax(z0 + Δz) − softmax z0‖²) or ``"kl"`` (KL(p_θ0 ‖ p_θ) of the softmax
            distributions).
        reference: outputs z0 of the reference network, shape (n, k).
        difference: Δz, shape (n, k).

    Returns:
        Tensor of shape (n,).
    """
    if metric == "euclidean":
        return 0.5 * difference.pow(2).sum(-1)
    other = reference + difference
    if metric == "softmax_euclidean":
        return 0.5 * (other.softmax(-1) - reference.softmax(-1)).pow(2).sum(-1)
    if metric == "kl":
        log_p0 = reference.log_softmax(-1)
        return (log_p0.exp() * (log_p0 - other.log_softmax(-1))).sum(-1)
    raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")


def output_hessian_factors(metric: str, reference: Tensor) -> Tensor:
    """Factors h_k with Σ_k h_k h_kᵀ = ∇²_z ρ(z0, z) at z = z0, per example.

    These give the (generalized Gauss-Newton) Fisher of the metric: for ``"kl"`` it is the
    Fisher of the softmax predictive distribution, h_y = √p_y (e_y − p); for
    ``"euclidean"`` the identity; for ``"softmax_euclidean"`` the rows of the softmax
    Jacobian. Returns shape (n, k, k): factor index, then output index.
    """
    n, k = reference.shape
    if metric == "euclidean":
        return torch.eye(k, dtype=reference.dtype, device=reference.device).expand(n, k, k)
    probs = reference.softmax(-1)
    # softmax Jacobian ∂p/∂z = diag(p) − p pᵀ (symmetric)
    jac = torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
    if metric == "softmax_euclidean":
        return jac
    if metric == "kl":
        # row y: √p_y (e_y − p), so Σ_y h_y h_yᵀ = diag(p) − p pᵀ
        eye = torch.eye(k, dtype=reference.dtype, device=reference.device)
        return probs.sqrt().unsqueeze(-1) * (eye - probs.unsqueeze(-2))
    raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
