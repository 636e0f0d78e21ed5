"""Exact moment propagation for BGLN (beyond the paper's Algorithm 2).

Algorithm 2 drops Cov(a0, Δa) and gates covariances by μμᵀ, ignoring the gates' own
variance. Neither is needed: with one Bernoulli mask m shared by a0 and Δa and drawn
independently of the inputs, E[(m⊙u)(m⊙v)ᵀ] = Q ⊙ E[u vᵀ] with Q = E[m mᵀ] = μμᵀ + diag(μ(1−μ)),
and affine layers map raw second moments linearly. So the joint raw second moments of the
homogeneous reference activations ã0 = [a0; 1] and of Δa propagate *exactly*:

    s0 = W̃0 ã0,  Δs = ΔW̃ ã0 + W1 Δa       (W̃ = [W b], ΔW̃ = W̃1 − W̃0)
    E[s0 Δsᵀ] = W̃0 R00 ΔW̃ᵀ + W̃0 R0Δ W1ᵀ
    E[Δs Δsᵀ] = ΔW̃ R00 ΔW̃ᵀ + ΔW̃ R0Δ W1ᵀ + W1 R0Δᵀ ΔW̃ᵀ + W1 RΔΔ W1ᵀ

with R00 = E[ã0 ã0ᵀ], R0Δ = E[ã0 Δaᵀ], RΔΔ = E[Δa Δaᵀ]. The result, ½ tr E[Δz Δzᵀ], equals
the expectation of BGLN-S with Gaussian inputs to machine precision, with no sampling.

A smooth activation's gate is a pair (r, g) — a0 = r·s0 + φ(0), Δa = g·Δs
(:class:`fsd.model.rules.GateMoments`) — and gates R00, R0Δ, RΔΔ by Q_rr, Q_rg, Q_gg; for a ReLU
all three are Q. The constant φ(0) is folded into the next affine layer's bias column
(W̃ → [W, b + φ(0)·W1], and ΔW̃ likewise), so the recursion itself is unchanged.

The reference blocks R00 depend only on θ0 and the stored statistics — computed once. With
``layerwise`` statistics they are not propagated at all but the reference network's real
input moments at every affine layer, collected at ``fit``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from ..covariance import Covariance, sampling_factor
from ..model.rules import (
    GateMoments,
    GateRule,
    TracedLayer,
    UnsupportedModuleError,
    is_affine,
    is_gate,
)
from .algorithm2 import affine_rule


def _homogeneous(weight: Tensor, bias: Tensor | None) -> Tensor:
    """W̃ = [W b] (o, in + 1); a missing bias is a zero column."""
    column = weight.new_zeros(weight.shape[:-1]) if bias is None else bias
    return torch.cat([weight, column.unsqueeze(-1)], dim=-1)


def _gate(layer: TracedLayer, rule: GateRule, gate_means: Mapping[str, Tensor]) -> GateMoments:
    """The moments of the gate layer ``layer``'s gate pair from its stored statistics."""
    return rule.gate_moments(layer.module, gate_means[layer.path])


def input_offsets(layers: list[TracedLayer]) -> list[float]:
    """Per layer, the constant φ(0) that a smooth gate adds to the input of an affine layer.

    0 everywhere except at the affine layer after a gate with φ(0) ≠ 0 (Sigmoid, Softplus),
    with only parameter-free layers (the identity on flat vectors) in between.
    """
    offsets, pending = [], 0.0
    for layer in layers:
        rule = layer.rule
        offsets.append(pending if is_affine(rule) else 0.0)
        if is_gate(rule):
            pending = rule.gate_offset(layer.module)
        elif is_affine(rule):
            pending = 0.0
    return offsets


def _homogeneous_layer(layer: TracedLayer, params: Mapping[str, Tensor], offset: float
                       ) -> tuple[Tensor, Tensor]:
    """(W̃, W) of an affine layer whose input is shifted by ``offset``: W̃ = [W, b + offset·W1]."""
    weight, bias = affine_rule(layer).affine_matrix(layer.module, params, layer.path)
    return _shifted(_homogeneous(weight, bias), weight, offset), weight


def _homogeneous_delta(layer: TracedLayer, params0: Mapping[str, Tensor],
                       params1: Mapping[str, Tensor], offset: float) -> Tensor:
    """ΔW̃ = [ΔW, Δb + offset·ΔW1], with ΔW formed first (:meth:`AffineRule.affine_delta`)."""
    dw, db = affine_rule(layer).affine_delta_matrix(layer.module, params0, params1, layer.path)
    return _shifted(_homogeneous(dw, db), dw, offset)


def _shifted(homogeneous: Tensor, weight: Tensor, offset: float) -> Tensor:
    if offset == 0.0:
        return homogeneous
    column = homogeneous[..., -1:] + offset * weight.sum(-1, keepdim=True)
    return torch.cat([homogeneous[..., :-1], column], dim=-1)


def input_factor(mean: Tensor, cov: Covariance) -> tuple[Tensor, Tensor | None]:
    """(Φ, D): E[x̃ x̃ᵀ] = Φ Φᵀ + diag(D) for x̃ = [x; 1], Φ = [[L, m], [0, 1]] (G, d + 1, q).

    A full covariance goes into L (L Lᵀ = Cov, D = None). Diagonal and low-rank-plus-diagonal
    covariances keep their diagonal part in D (G, d + 1) (zero on the constant coordinate)
    instead of d extra columns of Φ, so a layer costs o·d·(r + 1) + o²·d, not o·d².
    """
    residual: Tensor | None = None
    if isinstance(cov, tuple):
        root, residual = cov
    elif cov.dim() == 2:
        root, residual = cov.new_zeros(*cov.shape, 0), cov
    else:
        factors = [sampling_factor(c) for c in cov]
        width = max(f.shape[1] for f in factors)
        root = torch.stack([torch.nn.functional.pad(f, (0, width - f.shape[1])) for f in factors])
    groups, _, q = root.shape
    top = torch.cat([root, mean.unsqueeze(-1)], dim=-1)
    bottom = torch.cat([root.new_zeros(groups, 1, q), root.new_ones(groups, 1, 1)], dim=-1)
    if residual is not None:
        residual = torch.nn.functional.pad(residual, (0, 1))
    return torch.cat([top, bottom], dim=1), residual


def raw_second_moment(mean: Tensor, cov: Tensor) -> Tensor:
    """E[ã ãᵀ] (G, o + 1, o + 1) for ã = [a; 1] from a mean (G, o) and covariance (G, o, o)."""
    second = cov + mean.unsqueeze(-1) * mean.unsqueeze(-2)
    top = torch.cat([second, mean.unsqueeze(-1)], dim=-1)
    bottom = torch.cat([mean, mean.new_ones(mean.shape[0], 1)], dim=-1).unsqueeze(1)
    return torch.cat([top, bottom], dim=1)


def _gated_homogeneous(second: Tensor, mean: Tensor, gate: GateMoments | None) -> Tensor:
    """R00 of [r ⊙ s; 1] after a gate, or of [s; 1] directly after an affine layer (``None``).

    R00 = [[Q_rr ⊙ E[s sᵀ], E[r] ⊙ E s], [(E[r] ⊙ E s)ᵀ, 1]]; a smooth gate's φ(0) is
    added by the next layer (:func:`input_offsets`).
    """
    if gate is not None:
        second, mean = gate.second_moments()[0] * second, gate.reference_mean * mean
    return raw_second_moment(mean, second - mean.unsqueeze(-1) * mean.unsqueeze(-2))


def reference_blocks(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    mean: Tensor,
    cov: Covariance,
    gate_means: Mapping[str, Tensor],
    layer_moments: Mapping[str, tuple[Tensor, Tensor]] | None = None,
) -> list[dict[str, Tensor]]:
    """Per affine layer, the fixed reference quantities the Δ-side needs.

    Args:
        layers: the traced model (:func:`fsd.trace`).
        params0: reference parameters θ0 by name.
        mean: input means, (G, d) for G mixture components.
        cov: input covariances in any form of :mod:`fsd.covariance`.
        gate_means: stored gate statistics per gate path (firing frequencies μ (G, units),
            or a smooth gate's moments (G, units, 5)).
        layer_moments: optional real (mean, covariance) of the reference network's input to
            each affine layer after the first (``reference="layerwise"``); without it the
            reference moments are propagated through the Bernoulli-gated network.

    Returns:
        For each affine layer a dict with either ``"factor"`` Φ (first layer, R00 = ΦΦᵀ +
        diag(D)), ``"p0"`` = W̃0 Φ and, for a diagonal part D, ``"residual"`` D and ``"w0d"``
        = W̃0 diag(D), or ``"r00"`` (dense R00) and ``"w0r00"`` = W̃0 R00; plus ``"mean"``
        = E[ã0] (G, in + 1).
    """
    out: list[dict[str, Tensor]] = []
    phi, residual = input_factor(mean, cov)
    r00: Tensor | None = None
    pending: tuple[Tensor, Tensor] | None = None  # (E[s0 s0ᵀ], E[s0]) not yet gated
    for layer, offset in zip(layers, input_offsets(layers), strict=True):
        rule = layer.rule
        if is_affine(rule):
            if pending is not None:  # affine after affine: no gate in between
                r00, pending = _gated_homogeneous(*pending, None), None
            if out and layer_moments is not None:
                # the real input a0 = r·s0 + φ(0); the layer adds φ(0) back (W̃ shifted)
                real_mean, real_cov = layer_moments[layer.path]
                r00 = raw_second_moment(real_mean - offset, real_cov)
            w0 = _homogeneous_layer(layer, params0, offset)[0]
            if phi is not None:
                p0 = w0 @ phi
                # Φ = [[L, m], [0, 1]]: its last column is E[ã0] = [m; 1]
                block = {"factor": phi, "p0": p0, "mean": phi[..., :, -1]}
                if residual is None:  # full covariance: also R00 itself, for wide factors
                    block["r00"] = phi @ phi.transpose(-1, -2)
                    block["w0r00"] = p0 @ phi.transpose(-1, -2)
                second = p0 @ p0.transpose(-1, -2)
                if residual is not None:  # + W̃0 diag(D) W̃0ᵀ
                    block["residual"] = residual
                    block["w0d"] = w0 * residual.unsqueeze(-2)
                    second = second + block["w0d"] @ w0.transpose(-1, -2)
                out.append(block)
                pending = (second, p0[..., -1])
                phi = None
            else:
                assert r00 is not None  # set by the gate (or affine layer) before this one
                w0r00 = w0 @ r00
                out.append({"r00": r00, "w0r00": w0r00, "mean": r00[..., -1, :]})
                pending = (w0r00 @ w0.T, w0r00[..., -1])
        elif is_gate(rule):
            if pending is None:
                raise UnsupportedModuleError(
                    f"exact moments need an affine layer right before the gate at '{layer.path}'")
            r00, pending = _gated_homogeneous(*pending, _gate(layer, rule, gate_means)), None
    return out


def delta_second_moment(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    params1: Mapping[str, Tensor],
    reference: list[dict[str, Tensor]],
    gate_means: Mapping[str, Tensor],
    output_rows: Tensor,
) -> Tensor:
    """tr(P E[Δz Δzᵀ] Pᵀ) per component (G,) for output-selecting rows P ((G,) k', k).

    Half of it is E[½‖Δz‖²] under the Bernoulli-gated linear network, exactly. ``params0``
    may carry a leading component dimension (G, o, i): several reference networks (e.g. one
    per previous task, :class:`fsd.SummarySet`) are then evaluated in one pass.
    """
    r0d: Tensor | None = None  # E[ã0 Δaᵀ] at the current affine layer's input
    rdd: Tensor | None = None  # E[Δa Δaᵀ]
    mean_d: Tensor | None = None  # E[Δa]
    pending: tuple[Tensor, Tensor, Tensor] | None = None  # (E[s0 Δsᵀ], E[Δs Δsᵀ], E[Δs])

    def gated(gate: GateMoments | None) -> tuple[Tensor, Tensor, Tensor]:
        assert pending is not None  # called right after an affine layer
        s0d, sdd, ed = pending
        if gate is None:
            mean = ed
        else:
            _, q_rg, q_gg = gate.second_moments()
            s0d, sdd, mean = q_rg * s0d, q_gg * sdd, gate.delta_mean * ed
        return torch.cat([s0d, mean.unsqueeze(-2)], dim=-2), sdd, mean

    index = 0
    for layer, offset in zip(layers, input_offsets(layers), strict=True):
        rule = layer.rule
        if is_affine(rule):
            if pending is not None:  # affine after affine: no gate in between
                r0d, rdd, mean_d = gated(None)
            block = reference[index]
            index += 1
            w1 = rule.affine_matrix(layer.module, params1, layer.path)[0]
            w0h = _homogeneous_layer(layer, params0, offset)[0]
            dwh = _homogeneous_delta(layer, params0, params1, offset)
            if "factor" in block:
                projected = dwh @ block["factor"]
                s0d = block["p0"] @ projected.transpose(-1, -2)
                sdd = projected @ projected.transpose(-1, -2)
                if "residual" in block:  # the diagonal part of E[x̃ x̃ᵀ]
                    s0d = s0d + block["w0d"] @ dwh.transpose(-1, -2)
                    sdd = sdd + (dwh * block["residual"].unsqueeze(-2)) @ dwh.transpose(-1, -2)
            else:
                s0d = block["w0r00"] @ dwh.transpose(-1, -2)
                sdd = dwh @ block["r00"] @ dwh.transpose(-1, -2)
            ed = torch.einsum("...oi,...i->...o", dwh, block["mean"])
            if r0d is not None:
                assert rdd is not None and mean_d is not None  # set together with r0d
                cross = dwh @ r0d @ w1.T
                s0d = s0d + w0h @ r0d @ w1.T
                sdd = sdd + cross + cross.transpose(-1, -2) + w1 @ rdd @ w1.T
                ed = ed + mean_d @ w1.T
            pending, r0d, rdd, mean_d = (s0d, sdd, ed), None, None, None
        elif is_gate(rule) and pending is not None:
            r0d, rdd, mean_d = gated(_gate(layer, rule, gate_means))
            pending = None
    final = pending[1] if pending is not None else rdd
    assert final is not None  # the model has an affine layer
    rows = output_rows.to(final.dtype)
    return ((rows @ final) * rows).sum((-1, -2))


# ----- the same quantity by the adjoint recursion ------------------------------------------
#
# delta_second_moment pushes the θ-dependent blocks R0Δ, RΔΔ forward through every layer
# (dense (o + 1) × o products at each). The map from them to the output is linear, so the
# value can be accumulated backwards instead: with (Bx, Cy) the adjoints of
# X = E[s̃0 Δsᵀ] (s̃0 = [s0; 1]) and Y = E[Δs Δsᵀ] at an affine layer's output,
#
#     ⟨Bx, X⟩ + ⟨Cy, Y⟩ = source + ⟨B_in, R0Δ⟩ + ⟨C_in, RΔΔ⟩,
#     source = ⟨Bx, W̃0ext R00 ΔW̃ᵀ⟩ + ⟨Cy, ΔW̃ R00 ΔW̃ᵀ⟩       (W̃0ext = [W̃0; e_lastᵀ])
#     B_in = W̃0extᵀ Bx W1 + 2 ΔW̃ᵀ Cy W1,   C_in = W1ᵀ Cy W1,
#
# and a gate maps the adjoints by the same Hadamard products as the moments (self-adjoint):
# Cy ← Q ⊙ C_in, Bx ← [Q; μᵀ] ⊙ B_in. Starting from Cy = PᵀP, Bx = 0 at the output, the
# value tr(P E[ΔzΔzᵀ] Pᵀ) is the sum of the sources; R00 (θ-independent) is the cached
# reference block. Near the output the adjoints are low rank plus diagonal — Cy = U Uᵀ +
# diag(c), Bx = V Uᵀ + [diag(β); 0] with U = Pᵀ at first — and kept in that form until an
# affine layer turns the diagonals dense, so the last hidden layer costs O(o²·k + o³), and
# the first layer needs only products of ΔW̃ with the cached input factor.


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Frobenius inner product per component: Σ over the last two dims."""
    return (a * b).sum((-1, -2))


def _dense_is_cheaper(block: dict[str, Tensor], outputs: int) -> bool:
    """Whether a first layer that also has its dense R00 (full covariances) is cheaper with it.

    Value and gradient cost (d + 1)² + 4·o·(d + 1) per output unit dense against
    2·(d + 1)·q + 4·o·q (+ 4·o·(d + 1) for a diagonal part) with the width-q factor.
    """
    if "r00" not in block:
        return False
    width, q = block["factor"].shape[-2:]
    factor_cost = 2 * width * q + 4 * outputs * q + (4 * outputs * width if "residual" in block
                                                     else 0)
    return width * width + 4 * outputs * width < factor_cost


def _factor_source_parts(bx: Tensor, cy: Tensor, dwh: Tensor, factor: Tensor, p0: Tensor,
                         w0d: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
    """The source of a first layer (R00 = ΦΦᵀ + diag(D)) with dense adjoints.

    Also returns the products its gradient reuses: N = ΔW̃Φ, Bsᵀ p0, Cy N, Bsᵀ W̃0 diag(D),
    Cy ΔW̃ diag(D) and ΔW̃ diag(D).
    """
    bs, be = bx[..., :-1, :], bx[..., -1, :]
    n = dwh @ factor
    a1, a2 = bs.mT @ p0, cy @ n
    value = (be * n[..., -1]).sum(-1) + _dot(a1 + a2, n)
    if residual.dim() == 0:  # no diagonal part
        return value, n, a1, a2, *(n.new_zeros(()) for _ in range(3))
    scaled = dwh * residual.unsqueeze(-2)
    b1, b2 = bs.mT @ w0d, cy @ scaled
    return value + _dot(b1 + b2, dwh), n, a1, a2, b1, b2, scaled


class _SourceFunction(torch.autograd.Function):
    """The setup both source Functions share.

    ``forward`` returns the value, then the products its ``backward`` reuses; those are
    saved and are not differentiable.
    """

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, ...]) -> None:
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zero gradients for the non-differentiable parts
        ctx.save_for_backward(*inputs, *output[1:])


class _FactorSource(_SourceFunction):
    """⟨Bx, W̃0ext R00 ΔW̃ᵀ⟩ + ⟨Cy, ΔW̃ R00 ΔW̃ᵀ⟩ at the first layer, R00 = ΦΦᵀ + diag(D).

    The value is ⟨A, N⟩ + ⟨B, ΔW̃⟩ with A = Bsᵀp0 + Cy N, B = Bsᵀ W̃0 D + Cy ΔW̃ D: the
    gradient in ΔW̃ reuses A and B (Cy symmetric), so it costs one product with Φᵀ, and the
    gradients in Bx and Cy are W̃0 R00 ΔW̃ᵀ and ΔW̃ R00 ΔW̃ᵀ: four o × o × (d + 1) products
    for value and gradient where autograd takes five. ``w0d`` and ``residual`` are 0-dim
    when there is no diagonal part.
    """


    @staticmethod
    def forward(bx: Tensor, cy: Tensor, dwh: Tensor, factor: Tensor, p0: Tensor, w0d: Tensor,
                residual: Tensor) -> tuple[Tensor, ...]:
        return _factor_source_parts(bx, cy, dwh, factor, p0, w0d, residual)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *unused: Tensor) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * 7
        bx, cy, dwh, factor, p0, w0d, residual, *parts = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: rebuild the products with a graph
            parts = _factor_source_parts(bx, cy, dwh, factor, p0, w0d, residual)[1:]
        n, a1, a2, b1, b2, scaled = parts
        diagonal = residual.dim() > 0
        g = grad[..., None, None]
        grad_n = a1 + 2 * a2
        grad_n = torch.cat([grad_n[..., :-1], grad_n[..., -1:] + bx[..., -1, :].unsqueeze(-1)],
                           dim=-1)
        grad_dwh = (g * grad_n) @ factor.mT
        grad_bs = p0 @ n.mT
        grad_cy = n @ n.mT
        if diagonal:
            grad_dwh = grad_dwh + g * (b1 + 2 * b2)
            grad_bs = grad_bs + w0d @ dwh.mT
            grad_cy = grad_cy + dwh @ scaled.mT
        grad_bx = g * torch.cat([grad_bs, n[..., -1].unsqueeze(-2)], dim=-2)
        if grad_dwh.dim() > dwh.dim():  # ΔW̃ shared by the components
            grad_dwh = grad_dwh.sum(0)
        return grad_bx, g * grad_cy, grad_dwh, None, None, None, None


def _dense_source_parts(bx: Tensor, cy: Tensor, dwh: Tensor, r00: Tensor, w0r00: Tensor
                        ) -> tuple[Tensor, ...]:
    """The source for a dense R00 with dense adjoints.

    ⟨Bsᵀ W̃0 R00 + Cy ΔW̃ R00, ΔW̃⟩ + be · ΔW̃ E[ã0], and the products its gradient reuses
    (ΔW̃ R00, Bsᵀ W̃0 R00, Cy ΔW̃ R00).
    """
    bs, be = bx[..., :-1, :], bx[..., -1, :]
    m = dwh @ r00  # its last column is ΔW̃ E[ã0] (the last row of R00 is E[ã0]ᵀ)
    a1 = bs.mT @ w0r00
    a2 = cy @ m
    return (be * m[..., -1]).sum(-1) + _dot(a1 + a2, dwh), m, a1, a2


class _DenseSource(_SourceFunction):
    """The source with a dense R00 (hidden layers; a first layer with a wide factor).

    The gradient in ΔW̃ is Bsᵀ W̃0 R00 + 2 Cy ΔW̃ R00 (+ the mean term), reusing the value's
    products, and those in Bs, Cy are W̃0 R00 ΔW̃ᵀ, ΔW̃ R00 ΔW̃ᵀ: one (d + 1)² product fewer
    than autograd.
    """


    @staticmethod
    def forward(bx: Tensor, cy: Tensor, dwh: Tensor, r00: Tensor, w0r00: Tensor
                ) -> tuple[Tensor, ...]:
        return _dense_source_parts(bx, cy, dwh, r00, w0r00)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *unused: Tensor) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * 5
        bx, cy, dwh, r00, w0r00, *parts = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: rebuild the products with a graph
            parts = _dense_source_parts(bx, cy, dwh, r00, w0r00)[1:]
        m, a1, a2 = parts
        g = grad[..., None, None]
        be = bx[..., -1, :]
        grad_dwh = g * (a1 + 2 * a2 + be.unsqueeze(-1) * r00[..., -1, :].unsqueeze(-2))
        grad_bx = g * torch.cat([w0r00 @ dwh.mT, m[..., -1].unsqueeze(-2)], dim=-2)
        if grad_dwh.dim() > dwh.dim():  # ΔW̃ shared by the components
            grad_dwh = grad_dwh.sum(0)
        return grad_bx, g * (m @ dwh.mT), grad_dwh, None, None


class _Adjoint:
    """(Bx, Cy) at an affine layer's output, structured (U, V, c, β) or dense (bx, cy)."""

    def __init__(self, u: Tensor | None = None, v: Tensor | None = None,
                 c: Tensor | None = None, beta: Tensor | None = None,
                 bx: Tensor | None = None, cy: Tensor | None = None) -> None:
        self.u, self.v, self.c, self.beta, self.bx, self.cy = u, v, c, beta, bx, cy

    def _structured(self) -> Tensor:
        """U of a structured adjoint (every adjoint is dense or has U)."""
        assert self.u is not None
        return self.u

    def gated(self, gate: GateMoments) -> "_Adjoint":
        """Hadamard by Q_gg (Cy), Q_rg (Bx's top block) and E[g]ᵀ (Bx's last row).

        For a ReLU, Q_rg = Q_gg = μμᵀ + diag(μ(1 − μ)) and E[g] = μ.
        """
        mu_r, mu_g = gate.reference_mean, gate.delta_mean
        if self.bx is not None and self.cy is not None:
            _, q_rg, q_gg = gate.second_moments()
            bx = torch.cat([q_rg * self.bx[..., :-1, :], mu_g.unsqueeze(-2) * self.bx[..., -1:, :]],
                           dim=-2)
            return _Adjoint(bx=bx, cy=q_gg * self.cy)
        u = self._structured()
        # Q_gg ⊙ UUᵀ = (μ_g U)(μ_g U)ᵀ + diag(Var g ‖U_i‖²);  Q_gg ⊙ diag(c) =
        # diag((μ_g² + Var g) c);  Q_rg ⊙ diag(β) = diag((μ_r μ_g + Cov(r, g)) β)
        c = gate.delta_variance * u.pow(2).sum(-1)
        if self.c is not None:
            c = c + (mu_g.pow(2) + gate.delta_variance) * self.c
        beta = None if self.beta is None else (mu_r * mu_g + gate.covariance) * self.beta
        v = None
        if self.v is not None:
            # Q_rg ⊙ V_top Uᵀ = (μ_r V_top)(μ_g U)ᵀ + diag(Cov(r, g) Σ_k V_ik U_ik)
            top = self.v[..., :-1, :]
            beta = gate.covariance * (top * u).sum(-1) + (0 if beta is None else beta)
            v = torch.cat([mu_r.unsqueeze(-1) * top, self.v[..., -1:, :]], dim=-2)
        return _Adjoint(u=mu_g.unsqueeze(-1) * u, v=v, c=c, beta=beta)

    def source(self, block: dict[str, Tensor], dwh: Tensor) -> Tensor:
        """⟨Bx, W̃0ext R00 ΔW̃ᵀ⟩ + ⟨Cy, ΔW̃ R00 ΔW̃ᵀ⟩ per component, from the cached block."""
        factor = "factor" in block
        mean = block["mean"]
        residual = block.get("residual")
        if self.bx is not None and self.cy is not None:
            if factor and not _dense_is_cheaper(block, dwh.shape[-2]):
                empty = dwh.new_zeros(())
                return _FactorSource.apply(
                    self.bx, self.cy, dwh, block["factor"], block["p0"],
                    empty if residual is None else block["w0d"],
                    empty if residual is None else residual)[0]
            return _DenseSource.apply(self.bx, self.cy, dwh, block["r00"], block["w0r00"])[0]
        z = self._structured().mT @ dwh  # Uᵀ ΔW̃ (G, k, in + 1)
        if factor:
            zf = z @ block["factor"]
            total = zf.pow(2).sum((-1, -2))
            if residual is not None:
                total = total + _dot(z.pow(2), residual.unsqueeze(-2))
        else:
            total = _dot(z @ block["r00"], z)
        if self.v is not None:  # ⟨V Uᵀ, W̃0ext R00 ΔW̃ᵀ⟩ = ⟨V_topᵀ W̃0 R00 + v_lastᵀ E[ã0]ᵀ, Z⟩
            top, last = self.v[..., :-1, :], self.v[..., -1, :]
            if factor:
                total = total + _dot(top.mT @ block["p0"], zf)
                if residual is not None:
                    total = total + _dot(top.mT @ block["w0d"], z)
            else:
                total = total + _dot(top.mT @ block["w0r00"], z)
            total = total + (last * torch.einsum("...ki,...i->...k", z, mean)).sum(-1)
        if self.beta is not None or self.c is not None:
            # diag(β): Σ_i β_i (W̃0 R00 ΔW̃ᵀ)_ii;  diag(c): Σ_i c_i (ΔW̃ R00 ΔW̃ᵀ)_ii
            if factor:
                n = dwh @ block["factor"]  # ΔW̃ Φ
                cross = (block["p0"] * n).sum(-1)
                quad = n.pow(2).sum(-1)
                if residual is not None:
                    cross = cross + (block["w0d"] * dwh).sum(-1)
                    quad = quad + (dwh.pow(2) * residual.unsqueeze(-2)).sum(-1)
                if self.beta is not None:
                    total = total + (self.beta * cross).sum(-1)
                if self.c is not None:
                    total = total + (self.c * quad).sum(-1)
            else:
                if self.beta is not None:
                    total = total + (self.beta * (block["w0r00"] * dwh).sum(-1)).sum(-1)
                if self.c is not None:
                    total = total + _dot((self.c.unsqueeze(-1) * dwh) @ block["r00"], dwh)
        return total

    def through(self, w0h: Tensor, dwh: Tensor, w1: Tensor) -> "_Adjoint":
        """The adjoints at the layer's input: B_in = W̃0extᵀ Bx W1 + 2ΔW̃ᵀ Cy W1, C_in = W1ᵀ Cy W1."""
        if self.bx is not None and self.cy is not None:
            cw = self.cy @ w1
            bw = self.bx @ w1
            cy = w1.mT @ cw
            bx = w0h.mT @ bw[..., :-1, :] + 2 * (dwh.mT @ cw)
            bx = torch.cat([bx[..., :-1, :], bx[..., -1:, :] + bw[..., -1:, :]], dim=-2)
            return _Adjoint(bx=bx, cy=cy)
        u = w1.mT @ self._structured()
        v = 2 * (dwh.mT @ self._structured())
        if self.v is not None:
            top, last = self.v[..., :-1, :], self.v[..., -1:, :]
            v = w0h.mT @ top + v
            v = torch.cat([v[..., :-1, :], v[..., -1:, :] + last], dim=-2)
        if self.c is None and self.beta is None:
            return _Adjoint(u=u, v=v)
        # W1ᵀ diag(c) W1 and (W̃0ᵀ diag(β) + 2ΔW̃ᵀ diag(c)) W1 are dense: fold everything in
        cy = u @ u.mT
        left = []  # W̃0ᵀ diag(β) + 2ΔW̃ᵀ diag(c), transposed
        if self.c is not None:
            cy = cy + w1.mT @ (self.c.unsqueeze(-1) * w1)
            left.append(2 * self.c.unsqueeze(-1) * dwh)
        if self.beta is not None:
            left.append(self.beta.unsqueeze(-1) * w0h)
        bx = v @ u.mT + sum(left[1:], left[0]).mT @ w1
        return _Adjoint(bx=bx, cy=cy)


def delta_second_moment_adjoint(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    params1: Mapping[str, Tensor],
    reference: list[dict[str, Tensor]],
    gate_means: Mapping[str, Tensor],
    output_rows: Tensor,
) -> Tensor:
    """:func:`delta_second_moment` by the adjoint recursion (same arguments, same value).

    Cost per hidden layer O(o³) at most (O(o²·k) for the last one, k selected outputs) and,
    for the first layer, products of ΔW̃ with the cached input factor — instead of dense
    (o + 1)² moments pushed forward through every layer.
    """
    affine = [i for i, layer in enumerate(layers) if is_affine(layer.rule)]
    if not affine:
        raise UnsupportedModuleError("the model has no parameterized layer")
    mean = reference[0]["mean"]
    groups = mean.shape[0]
    rows = output_rows.to(mean.dtype)
    adjoint = _Adjoint(u=rows.expand(groups, *rows.shape[-2:]).mT)
    total = mean.new_zeros(groups)
    index = len(reference)
    offsets = input_offsets(layers)
    for position in range(len(layers) - 1, affine[0] - 1, -1):
        layer = layers[position]
        rule = layer.rule
        if is_gate(rule):
            adjoint = adjoint.gated(_gate(layer, rule, gate_means))
        elif is_affine(rule):
            index -= 1
            w1 = rule.affine_matrix(layer.module, params1, layer.path)[0]
            dwh = _homogeneous_delta(layer, params0, params1, offsets[position])
            total = total + adjoint.source(reference[index], dwh)
            if index > 0:
                adjoint = adjoint.through(_homogeneous_layer(layer, params0, offsets[position])[0],
                                          dwh, w1)
    return total
