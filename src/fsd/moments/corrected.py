"""The corrected recursion for BGLN-D on MLP chains, and the dense ablations it came from.

``fsd.BGLN(deterministic=True, moments="corrected")`` walks MLP chains by
:func:`corrected_second_moment` (the evaluator ``"corrected"``); the ablations below are run
by ``fsd_experiments.ablations``. Algorithm 2
(:func:`fsd.moments.algorithm2.delta_moments`) differs from exact moments
(:mod:`fsd.moments.exact`) in two places: it gates second moments by μμᵀ instead of
Q = μμᵀ + diag(μ(1−μ)) (it drops the gates' own variance), and it drops Cov(a0, Δa).

**Ablations** (:func:`ablated_second_moment`): the exact recursion on the joint raw second
moments of ([a0; 1], Δa) with either omission switched on — ``gate_variance=False`` gates by
E[r]E[g]ᵀ on both sides, ``cross_covariance=False`` replaces E[a0 Δaᵀ] after every gate by
E[a0]E[Δa]ᵀ. Both together are Algorithm 2; neither is the exact recursion. Dense and
O(o²·d): for measuring which omission matters, not for training.

**Corrected moments** (:func:`corrected_second_moment`): write each gate as its mean plus a
centred part, m = E[m] + ε. Then a gated layer is the mean-gate layer plus an injected
"noise" pair n = (ε_r ⊙ s0, ε_g ⊙ Δs), and

* n has zero mean and is uncorrelated with everything upstream (ε is centred and
  independent of it) and with every later injection;
* its covariance is *diagonal* over units, with the 2×2 block per unit
  [[Var r·E s0², Cov(r,g)·E[s0 Δs]], [·, Var g·E Δs²]] (raw second moments of the
  pre-activations, *including* what earlier injections added to them).

So the BGLN is exactly a mean-gate linear network driven by the input and by uncorrelated
injections at every gate, and

    E‖PΔz‖² = E‖P Δz̄‖²  +  Σ_gates Σ_i ‖M0_i‖² n00_i + 2 M0_i·MΔ_i n0Δ_i + ‖MΔ_i‖² nΔΔ_i

where Δz̄ is the mean-gate network's output (linear in x̃ = [x; 1]: Δz̄ = A x̃, with
Cov(a0, Δa) of that network kept) and M0, MΔ (k × o) are the rows that carry a change of a0,
Δa after the gate to PΔz through the mean-gate network — the rows Algorithm 2 pulls back
(MΔ), and their reference-side twins (M0 = Σ_later MΔ ΔW ∂a0/∂a0). Both terms cost what
Algorithm 2 costs (k rows pulled back through every layer) *except* the diagonals E s0_i²,
E[s0_i Δs_i], E Δs_i² at each gate, which are pushed forward:

* the part of the pre-activations driven by the input factor Φ (E[x̃x̃ᵀ] = ΦΦᵀ + diag(D))
  exactly, as factors (o × q): o·d·q at the first layer, o²·q at the others;
* the part driven by the diagonal residual D and by earlier injections — both with diagonal
  covariance where they enter — *carried diagonally*: through a gate by E[r]², E[r]E[g],
  E[g]², through an affine layer by the squared weights (W0², W0⊙ΔW, …), dropping the
  off-diagonal covariance that an affine layer creates. That is the approximation.

It is exact (float64 round-off) for one gated layer, and for two gated layers when the input
covariance has no diagonal residual (full, or low rank of full rank): there the only
carried covariance is one injection's (diagonal) through one affine layer. With
``injection_rank`` (:func:`truncated_input`) the injections are sized from a cut covariance
that has a diagonal residual, so these hold for that covariance's injections only. With all
μ ∈ {0, 1} the injections vanish and it equals exact moments; without its injections it
is exact moments without the gate variance (the mean-gate network).

Its derivative is a hand-written reverse pass of that forward pass (:class:`_CorrectedAdjoint`):
at MLP sizes a penalty call costs the operations and fresh first-layer buffers it makes, and
autograd would record every one of them. Autograd through the same forward pass
(``adjoint=False``) is the reference the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from ..covariance import Covariance
from ..model.rules import GateMoments, TracedLayer, UnsupportedModuleError, is_affine, is_gate
from .algorithm2 import affine_rule
from .exact import (
    _homogeneous_delta,
    _homogeneous_layer,
    input_factor,
    input_offsets,
)


@dataclass(frozen=True)
class _Step:
    """An affine layer, the offset φ(0) its input carries, and the gate right before it."""

    layer: TracedLayer
    offset: float
    gate: GateMoments | None  # None: the first layer, or an affine layer right before


def _affine_steps(layers: list[TracedLayer], gate_means: Mapping[str, Tensor]) -> list[_Step]:
    steps: list[_Step] = []
    gate: GateMoments | None = None
    trailing = False
    for layer, offset in zip(layers, input_offsets(layers), strict=True):
        rule = layer.rule
        if is_affine(rule):
            steps.append(_Step(layer, offset, gate))
            gate, trailing = None, False
        elif is_gate(rule):
            if not steps:
                raise UnsupportedModuleError(
                    f"moment variants need an affine layer before the gate at '{layer.path}'")
            gate, trailing = rule.gate_moments(layer.module, gate_means[layer.path]), True
    if not steps:
        raise UnsupportedModuleError("the model has no parameterized layer")
    if trailing:
        raise UnsupportedModuleError("moment variants need the model to end with an affine layer")
    return steps


def _homogeneous_second(second: Tensor, mean: Tensor) -> Tensor:
    """[[E aaᵀ, E a], [E aᵀ, 1]] from a raw second moment (G, o, o) and a mean (G, o)."""
    top = torch.cat([second, mean.unsqueeze(-1)], dim=-1)
    bottom = torch.cat([mean, mean.new_ones((*mean.shape[:-1], 1))], dim=-1).unsqueeze(-2)
    return torch.cat([top, bottom], dim=-2)


def _matrices(step: _Step, params0: Mapping[str, Tensor], params1: Mapping[str, Tensor]
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(W̃0, W1, ΔW̃) of an affine step; ΔW̃ formed first (:meth:`AffineRule.affine_delta`)."""
    w0h = _homogeneous_layer(step.layer, params0, step.offset)[0]
    w1 = _homogeneous_layer(step.layer, params1, 0.0)[1]
    return w0h, w1, _homogeneous_delta(step.layer, params0, params1, step.offset)


def _delta_matrices(step: _Step, params0: Mapping[str, Tensor], params1: Mapping[str, Tensor]
                    ) -> tuple[Tensor, Tensor | None, Tensor]:
    """(ΔW, Δb̃, W1) of an affine step, ΔW formed first; W̃0 comes from the reference.

    ΔW̃ = [ΔW, Δb̃] is kept in its two parts, Δb̃ = Δb + φ(0)·ΔW1 (``None``: no bias and no
    offset), so that no call copies ΔW into a wider matrix.
    """
    rule = affine_rule(step.layer)
    w1 = rule.affine_matrix(step.layer.module, params1, step.layer.path)[0]
    dw, db = rule.affine_delta_matrix(step.layer.module, params0, params1, step.layer.path)
    if step.offset != 0.0:
        shift = step.offset * dw.sum(-1)
        db = shift if db is None else db + shift
    return dw, db, w1


def _trace_rows(rows: Tensor, second: Tensor) -> Tensor:
    """tr(P S Pᵀ) per component for rows P ((G,) k', k) and S (G, k, k)."""
    rows = rows.to(second.dtype)
    return ((rows @ second) * rows).sum((-1, -2))


def ablated_second_moment(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    params1: Mapping[str, Tensor],
    mean: Tensor,
    cov: Covariance,
    gate_means: Mapping[str, Tensor],
    output_rows: Tensor,
    *,
    gate_variance: bool = True,
    cross_covariance: bool = True,
) -> Tensor:
    """tr(P E[Δz Δzᵀ] Pᵀ) (G,) by the exact forward recursion with terms switched off.

    Args:
        layers: the traced chain (:func:`fsd.trace`).
        params0: θ0 by name.
        params1: θ by name (differentiable).
        mean: input means (G, d).
        cov: input covariances in any form of :mod:`fsd.covariance`.
        gate_means: stored gate statistics per gate path.
        output_rows: (k', k) or (G, k', k) rows selecting outputs.
        gate_variance: ``False`` gates every second moment by E[r]E[g]ᵀ (Algorithm 2's μμᵀ)
            instead of Q, on the reference and the difference side.
        cross_covariance: ``False`` sets Cov(a0, Δa) = 0 after every gate (Algorithm 2).

    Both ``True``: :func:`fsd.moments.exact.delta_second_moment`; both ``False``: Algorithm 2.
    """
    steps = _affine_steps(layers, gate_means)
    phi, residual = input_factor(mean, cov)
    r00 = phi @ phi.mT
    if residual is not None:
        r00 = r00 + torch.diag_embed(residual)
    r0d: Tensor | None = None  # E[ã0 Δaᵀ]: its last row is E[Δa]
    rdd: Tensor | None = None  # E[Δa Δaᵀ]
    pending: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None
    for index, step in enumerate(steps):
        if index > 0:
            assert pending is not None  # set by the previous affine layer
            s00, s0d, sdd, m0, md = pending
            gate = step.gate
            if gate is None:  # affine after affine: the identity gate
                a00, a0d, add, am0, amd = s00, s0d, sdd, m0, md
            else:
                er, eg = gate.reference_mean, gate.delta_mean
                if gate_variance:
                    q_rr, q_rg, q_gg = gate.second_moments()
                else:
                    q_rr = er.unsqueeze(-1) * er.unsqueeze(-2)
                    q_rg = er.unsqueeze(-1) * eg.unsqueeze(-2)
                    q_gg = eg.unsqueeze(-1) * eg.unsqueeze(-2)
                a00, a0d, add, am0, amd = q_rr * s00, q_rg * s0d, q_gg * sdd, er * m0, eg * md
                if not cross_covariance:  # E[a0 Δaᵀ] = E[a0] E[Δa]ᵀ: no covariance
                    a0d = am0.unsqueeze(-1) * amd.unsqueeze(-2)
            r00 = _homogeneous_second(a00, am0)
            r0d = torch.cat([a0d, amd.unsqueeze(-2)], dim=-2)
            rdd = add
        w0h, w1, dwh = _matrices(step, params0, params1)
        w0r = w0h @ r00
        dr = dwh @ r00
        s00, m0 = w0r @ w0h.mT, w0r[..., -1]  # the last column of R00 is E[ã0]
        s0d, sdd, md = w0r @ dwh.mT, dr @ dwh.mT, dr[..., -1]
        if r0d is not None:
            assert rdd is not None  # set together with r0d
            s0d = s0d + w0h @ r0d @ w1.mT
            cross = dwh @ r0d @ w1.mT
            sdd = sdd + cross + cross.mT + w1 @ rdd @ w1.mT
            md = md + r0d[..., -1, :] @ w1.mT
        pending = (s00, s0d, sdd, m0, md)
    assert pending is not None  # _affine_steps found an affine layer
    return _trace_rows(output_rows, pending[2])


def _gate_parts(gate: GateMoments | None, like: Tensor) -> tuple[Tensor, ...]:
    """(E r, E g, Var r, Cov(r, g), Var g); the identity gate for ``None``."""
    if gate is None:
        one, zero = like.new_ones(()), like.new_zeros(())
        return one, one, zero, zero, zero
    return (gate.reference_mean, gate.delta_mean, gate.reference_variance, gate.covariance,
            gate.delta_variance)


def truncated_input(phi: Tensor, residual: Tensor | None, rank: int
                    ) -> tuple[Tensor, Tensor | None]:
    """(Φ', D'): the ``rank`` largest columns of Φ's covariance part, the rest as a diagonal.

    Φ = [[L, m], [0, 1]] (G, d + 1, q) and D from :func:`fsd.moments.exact.input_factor`. Φ'
    keeps, per component, the ``rank`` columns of L with the largest norms (the top
    eigen-directions) and the mean column; D' = D + the dropped columns' squares, so
    Φ'Φ'ᵀ + diag(D') has the same diagonal as ΦΦᵀ + diag(D): every input keeps its variance,
    the dropped directions lose their correlations. ``(phi, residual)`` itself when L has at
    most ``rank`` columns.
    """
    root = phi[..., :-1]
    if root.shape[-1] <= rank:
        return phi, residual
    order = root.pow(2).sum(-2).topk(rank, dim=-1).indices.sort(dim=-1).values
    kept = root.gather(-1, order.unsqueeze(-2).expand(*root.shape[:-1], rank))
    # the dropped columns' squares summed directly (not total − kept: no cancellation)
    keep = torch.zeros(root.shape[0], root.shape[-1], dtype=torch.bool, device=root.device)
    keep.scatter_(-1, order, True)
    dropped = (root.pow(2) * (~keep).unsqueeze(-2)).sum(-1)
    return (torch.cat([kept, phi[..., -1:]], dim=-1),
            dropped if residual is None else residual + dropped)


def corrected_reference(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    mean: Tensor,
    cov: Covariance,
    gate_means: Mapping[str, Tensor],
    injection_rank: int | None = None,
) -> list[dict[str, Tensor]]:
    """The θ-independent part of :func:`corrected_second_moment`, per affine layer.

    Per affine layer: ``"factor"`` — the factor of [a0; 1] at its input (mean-gate network,
    (G, in + 1, q)); ``"f0"`` — that of s0 at its output; ``"t00"`` — the diagonally carried
    part of E s0² (residual and injections); ``"e00"`` — the factor part of E s0²; and
    ``"residual"`` (first layer, if any) — D, and for one component ``"w0d"`` = W0⊙D (rows
    of W0 scaled by D), which spares every call a first-layer-sized product.

    With ``injection_rank`` the diagonals that size the injections are pushed forward from the
    input covariance cut to that rank plus its diagonal (:func:`truncated_input`), so the
    correction's forward pass costs o·(rank + 1) per output unit instead of o·q; the first
    layer's block then also holds the full input, ``"signal_factor"`` (and
    ``"signal_residual"`` when the input has a diagonal part), from which the mean-gate
    network's term is computed exactly.
    """
    steps = _affine_steps(layers, gate_means)
    phi, residual = input_factor(mean, cov)
    signal: dict[str, Tensor] = {}
    if injection_rank is not None:
        signal["signal_factor"] = phi
        if residual is not None:
            signal["signal_residual"] = residual
        phi, residual = truncated_input(phi, residual, injection_rank)
    constant = phi[..., -1:, :]  # the row of the constant coordinate, [0 … 0 1]
    out: list[dict[str, Tensor]] = []
    factor, carried = phi, None
    for index, step in enumerate(steps):
        w0h = _homogeneous_layer(step.layer, params0, step.offset)[0]
        if index > 0:
            prev = out[-1]
            er, _, vr, _, _ = _gate_parts(step.gate, phi)
            injected = vr * (prev["e00"] + prev["t00"])
            carried = er.pow(2) * prev["t00"] + injected
            factor = torch.cat([er.unsqueeze(-1) * prev["f0"], constant], dim=-2)
        f0 = w0h @ factor
        # W̃0, W0 and W0² are θ-independent: kept for every call of the Δ side
        w0 = w0h[..., :-1].contiguous()
        block = {"factor": factor, "f0": f0, "e00": f0.pow(2).sum(-1), "w0h": w0h, "w0": w0,
                 "w0sq": w0.pow(2)}
        if index == 0:
            block.update(signal)
            t00 = f0.new_zeros(f0.shape[:-1])
            if residual is not None:
                block["residual"] = residual
                t00 = t00 + residual @ w0h.pow(2).mT
                if residual.shape[0] == 1:  # one component: W0⊙D for row-wise products
                    block["w0d"] = w0 * residual[..., None, :-1]
        else:
            assert carried is not None
            t00 = carried @ block["w0sq"].mT
        block["t00"] = t00
        out.append(block)
    return out


def corrected_second_moment(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    params1: Mapping[str, Tensor],
    reference: list[dict[str, Tensor]],
    gate_means: Mapping[str, Tensor],
    output_rows: Tensor,
    *,
    gate_variance: bool = True,
    parts: bool = False,
    adjoint: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """tr(P E[Δz Δzᵀ] Pᵀ) (G,) by the mean-gate network plus the carried gate variance.

    See the module's docstring for the derivation and where it is exact. ``reference`` is
    :func:`corrected_reference`'s output for the same ``params0`` (its blocks hold θ0's
    matrices, which are not read from ``params0`` again). ``gate_variance=False`` leaves the
    correction out: the mean-gate network alone, which is exact moments without the gate
    variance (:func:`ablated_second_moment`), at Algorithm 2's cost (rows pulled back only). With
    ``parts=True`` returns the two terms (mean-gate network, correction) separately.

    ``adjoint`` (the default) differentiates the whole value by a hand-written reverse pass
    (:class:`_CorrectedAdjoint`) instead of recording every operation for autograd: the same
    arithmetic with fewer passes over the first layer's matrices and their gradients kept in
    one buffer each, which is what a call costs at these sizes. It applies to the whole
    value with the correction and a 2-D W1 (θ0 one network, or one per component: summaries
    stacked by :mod:`fsd.moments.evaluators`), outside
    ``torch.func`` transforms; otherwise, and with ``adjoint=False``, autograd differentiates
    the same forward pass. The hand-written pass gives first derivatives only.
    """
    steps = _affine_steps(layers, gate_means)
    mats = [_delta_matrices(step, params0, params1) for step in steps]
    gates = [_gate_parts(step.gate, mats[0][0]) for step in steps]
    rows = output_rows.to(reference[0]["factor"].dtype)
    if adjoint and gate_variance and not parts and not _transformed() and all(
            _adjoint_shapes(*mat) for mat in mats):
        problem = _Problem(reference, gates, rows, len(steps))
        return _CorrectedAdjoint.apply(problem, *(m for mat in mats for m in mat))[0]
    tape = _recursion(reference, gates, mats, rows, gate_variance)
    if parts:
        return tape["signal"], tape["correction"]
    return tape["signal"] + tape["correction"]


def _adjoint_shapes(dw: Tensor, db: Tensor | None, w1: Tensor) -> bool:
    """Whether the hand-written pass takes these: W1 one matrix, ΔW one or one per component."""
    return w1.dim() == 2 and dw.dim() in (2, 3) and (db is None or db.dim() == dw.dim() - 1)


def _transformed() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap) is running: autograd's path then."""
    return torch._C._are_functorch_transforms_active()


def _vector(value: Tensor) -> Tensor:
    """A per-unit vector (G, o) as (G, 1, o) against rows; the identity gate's scalars as is."""
    return value.unsqueeze(-2) if value.dim() else value


def _column(value: Tensor) -> Tensor:
    """A per-unit vector (G, o) as (G, o, 1) against factors; scalars as is."""
    return value.unsqueeze(-1) if value.dim() else value


def _vector_times(vector: Tensor, matrix: Tensor) -> Tensor:
    """A per-unit vector (G, i) times a matrix (i, o), or one matrix per component (G, i, o)."""
    if matrix.dim() == 2:
        return vector @ matrix
    return (vector.unsqueeze(-2) @ matrix).squeeze(-2)


def _outer_sum(pairs: list[tuple[Tensor, Tensor]], per_component: bool) -> Tensor:
    """Σ_pairs uᵀ v over components, (G, o) and (G, i) → (o, i); (G, o, i) ``per_component``."""
    if per_component:  # one product, one buffer: the pairs stacked along the inner dimension
        return (torch.stack([u for u, _ in pairs], -1)
                @ torch.stack([v for _, v in pairs], -2))
    return torch.cat([u for u, _ in pairs]).mT @ torch.cat([v for _, v in pairs])


def _rows_times(rows: Tensor, dw: Tensor, db: Tensor | None) -> Tensor:
    """The rows times [ΔW, Δb̃] (…, k, in + 1), without forming [ΔW, Δb̃]."""
    last = rows.new_zeros(rows.shape[:-1]) if db is None else (
        rows @ db.unsqueeze(-1)).squeeze(-1)
    return torch.cat([rows @ dw, last.unsqueeze(-1)], dim=-1)


def _times_factor(dw: Tensor, db: Tensor | None, factor: Tensor) -> Tensor:
    """[ΔW, Δb̃] @ factor (…, o, q) for a factor of [a; 1] (…, in + 1, q)."""
    product = dw @ factor[..., :-1, :]
    if db is None:
        return product
    return product + db.unsqueeze(-1) * factor[..., -1:, :]


def _recursion(reference: list[dict[str, Tensor]], gates: list[tuple[Tensor, ...]],
               mats: list[tuple[Tensor, Tensor | None, Tensor]], rows: Tensor,
               gate_variance: bool) -> dict[str, Tensor]:
    """The forward pass of :func:`corrected_second_moment`, keeping what its adjoint reads.

    ``mats`` holds (ΔW, Δb̃, W1) per affine layer (:func:`_delta_matrices`). Returns the two
    terms (``"signal"``, ``"correction"``) and, by name and layer, the intermediates: the
    factors ``fd{l}`` of Δs and ``fad{l}`` of Δa, the squared weights ``a{l}`` = W0⊙ΔW and
    ``b{l}`` = ΔW², the carried diagonals ``t0d{l}``, ``tdd{l}``, ``c00{l}``, ``c0d{l}``,
    ``cdd{l}``, the injections ``n00{l}``, ``n0d{l}``, ``ndd{l}`` and the rows ``sd{l}``,
    ``m0{l}``, ``hd{l}``, ``h0``.
    """
    tape: dict[str, Tensor] = {}
    last = len(mats) - 1
    # forward: the diagonals E s0², E[s0 Δs], E Δs² at every gate's input
    for index, (dw, db, w1) in enumerate(mats):
        if not gate_variance:  # no diagonals needed
            break
        block = reference[index]
        if index > 0:
            prev = reference[index - 1]
            fd_prev, t0d_prev, tdd_prev = (tape[f"{n}{index - 1}"] for n in ("fd", "t0d", "tdd"))
            er, eg, vr, crg, vg = gates[index]
            n00 = vr * (prev["e00"] + prev["t00"])
            n0d = crg * ((prev["f0"] * fd_prev).sum(-1) + t0d_prev)
            ndd = vg * (fd_prev.pow(2).sum(-1) + tdd_prev)
            tape.update({f"n00{index}": n00, f"n0d{index}": n0d, f"ndd{index}": ndd})
            if index == last:
                break
            fad = _column(eg) * fd_prev
            c00 = er.pow(2) * prev["t00"] + n00
            c0d = er * eg * t0d_prev + n0d
            cdd = eg.pow(2) * tdd_prev + ndd
            fd = _times_factor(dw, db, block["factor"]) + w1 @ fad
            # the squared weights W0⊙ΔW, ΔW², ΔW⊙W1, W1² by W1 = W0 + ΔW: two products of
            # ΔW per call (A = W0⊙ΔW, B = ΔW²) and the stored W0², no difference of squares
            a, b, w0sq = block["w0"] * dw, dw * dw, block["w0sq"]
            # each matrix read once: the vectors that multiply it stacked as rows
            by_a = torch.stack([c00 + c0d, 2 * (c0d + cdd)], -2) @ a.mT
            by_w0sq = torch.stack([c0d, cdd], -2) @ w0sq.mT
            t0d = by_a[..., 0, :] + by_w0sq[..., 0, :]
            tdd = (_vector_times(c00 + 2 * c0d + cdd, b.mT) + by_a[..., 1, :]
                   + by_w0sq[..., 1, :])
            tape.update({f"fad{index}": fad, f"c00{index}": c00, f"c0d{index}": c0d,
                         f"cdd{index}": cdd, f"a{index}": a, f"b{index}": b})
        else:
            if index == last:
                break
            fd = _times_factor(dw, db, block["factor"])
            t0d = tdd = fd.new_zeros(fd.shape[:-1])
            residual = block.get("residual")
            if residual is not None:  # the residual enters with a diagonal covariance
                # D is 0 on the constant coordinate (input_factor pads it so): ΔW alone
                diagonal = residual[..., :-1]
                if "w0d" in block:  # one component per ΔW: t0d row by row, no temporary
                    t0d = t0d + torch.linalg.vecdot(dw, block["w0d"])
                else:
                    t0d = t0d + _vector_times(diagonal, (block["w0"] * dw).mT)
                tdd = tdd + _vector_times(diagonal, (dw * dw).mT)
        tape.update({f"fd{index}": fd, f"t0d{index}": t0d, f"tdd{index}": tdd})

    # backward: the rows carrying a0 and Δa to PΔz through the mean-gate network
    groups = reference[0]["factor"].shape[0]
    s_d = rows.expand(groups, *rows.shape[-2:])
    s_0: Tensor | None = None
    constant = None
    correction = s_d.new_zeros(groups)
    for index in range(last, 0, -1):
        dw, db, w1 = mats[index]
        tape[f"sd{index}"] = s_d
        h0 = _rows_times(s_d, dw, db)
        if s_0 is not None:
            h0 = h0 + s_0 @ reference[index]["w0h"]
        hd = s_d @ w1
        constant = h0[..., -1] if constant is None else constant + h0[..., -1]
        m0 = h0[..., :-1]
        tape.update({f"m0{index}": m0, f"hd{index}": hd})
        if gate_variance:
            n00, n0d, ndd = (tape[f"{n}{index}"] for n in ("n00", "n0d", "ndd"))
            correction = correction + (m0.pow(2).sum(-2) * n00 + 2 * (m0 * hd).sum(-2) * n0d
                                       + hd.pow(2).sum(-2) * ndd).sum(-1)
        er, eg = gates[index][:2]
        s_0, s_d = m0 * _vector(er), hd * _vector(eg)
    tape["sd0"] = s_d
    h0 = _rows_times(s_d, *mats[0][:2])
    if s_0 is not None:
        h0 = h0 + s_0 @ reference[0]["w0h"]
    if constant is not None:
        h0 = torch.cat([h0[..., :-1], h0[..., -1:] + constant.unsqueeze(-1)], dim=-1)
    tape["h0"] = h0
    factor, residual = _signal_input(reference[0])
    signal = (h0 @ factor).pow(2).sum((-1, -2))
    if residual is not None:
        signal = signal + (h0.pow(2) * residual.unsqueeze(-2)).sum((-1, -2))
    tape.update(signal=signal, correction=correction)
    return tape


def _signal_input(block: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(Φ, D) of the mean-gate term: the full input where the injections were sized from a cut."""
    full = "signal_factor" in block
    return block["signal_factor" if full else "factor"], block.get(
        "signal_residual" if full else "residual")


@dataclass
class _Problem:
    """What :class:`_CorrectedAdjoint` holds fixed: θ0's side, the gates, the output rows."""

    reference: list[dict[str, Tensor]]
    gates: list[tuple[Tensor, ...]]
    rows: Tensor
    layers: int
    names: tuple[str, ...] = ()  # the intermediates the forward pass kept, in order


class _CorrectedAdjoint(torch.autograd.Function):
    """:func:`_recursion` with its derivative by a hand-written reverse pass.

    Inputs: the problem, then (ΔW, Δb̃ or ``None``, W1) of every affine layer. Outputs: the
    value (G,), then the intermediates (saved for the reverse pass, not differentiable).
    """

    @staticmethod
    def forward(problem: _Problem, *flat: Tensor | None) -> tuple[Tensor, ...]:  # type: ignore[override]
        mats = [tuple(flat[3 * i:3 * i + 3]) for i in range(problem.layers)]
        tape = _recursion(problem.reference, problem.gates, mats,  # pyright: ignore[reportArgumentType]
                          problem.rows, True)
        problem.names = tuple(tape)
        return (tape["signal"] + tape["correction"], *tape.values())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        problem, *flat = inputs
        ctx.problem, ctx.names = problem, problem.names
        ctx.biases = [m is not None for m in flat[1::3]]
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # the intermediates get no gradient: no zeros for them
        ctx.save_for_backward(*(m for m in flat if m is not None), *output[1:])

    @staticmethod
    def backward(ctx: Any, grad_value: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        problem: _Problem = ctx.problem
        saved = list(ctx.saved_tensors)
        mats = []
        for bias in ctx.biases:
            dw = saved.pop(0)
            db = saved.pop(0) if bias else None
            mats.append((dw, db, saved.pop(0)))
        tape = dict(zip(ctx.names, saved, strict=True))
        grads = _reverse(problem, mats, tape, grad_value)
        return (None, *(g for layer in grads for g in layer))


def _sum_outer(left: Tensor, right: Tensor) -> Tensor:
    """Σ leftᵀ right over components and rows: (G, n, o), (G, n, i) → (o, i)."""
    return left.flatten(0, -2).mT @ right.flatten(0, -2)


def _reverse(problem: _Problem, mats: list[tuple[Tensor, Tensor | None, Tensor]],
             tape: dict[str, Tensor], grad_value: Tensor) -> list[list[Tensor | None]]:
    """d(grad_value · value)/d(ΔW, Δb̃, W1) per layer: :func:`_recursion` run backwards.

    Every gradient is one buffer per matrix, accumulated in place (``addmm_``,
    ``addcmul_``): at these sizes a call costs what it allocates and passes over memory.
    """
    reference, gates, last = problem.reference, problem.gates, problem.layers - 1
    grads: list[list[Tensor | None]] = [[None, None, None] for _ in mats]

    def add_outer(index: int, which: int, left: Tensor, right: Tensor) -> None:
        held, target = grads[index][which], mats[index][which]
        assert target is not None  # ΔW or W1 (which 0 or 2)
        if target.dim() == 3:  # one ΔW per component (stacked summaries)
            if held is None:
                grads[index][which] = left.mT @ right
            else:
                held.baddbmm_(left.mT, right)
        elif held is None:
            grads[index][which] = _sum_outer(left, right)
        else:
            held.addmm_(left.flatten(0, -2).mT, right.flatten(0, -2))

    def add_bias(index: int, value: Tensor) -> None:
        bias = mats[index][1]
        if bias is not None:
            value = value.sum(-2) if bias.dim() == 2 else value.flatten(0, -2).sum(0)
            held = grads[index][1]
            grads[index][1] = value if held is None else held + value

    def add_homogeneous(index: int, left: Tensor, right: Tensor) -> None:
        """The derivative in [ΔW, Δb̃] of Σ leftᵀ right, right's last column for Δb̃."""
        add_outer(index, 0, left, right[..., :-1])
        add_bias(index, left * right[..., -1:])

    scale = grad_value.unsqueeze(-1).unsqueeze(-1)  # (G, 1, 1) against rows
    # the rows pass, from the input layer up: H0 = Sd ΔW̃ + S0 W̃0, Hd = Sd W1
    factor, residual = _signal_input(reference[0])
    h0 = tape["h0"]
    dh0 = (h0 @ factor) @ factor.mT
    if residual is not None:
        dh0 = dh0 + h0 * residual.unsqueeze(-2)
    dh0 = 2 * scale * dh0
    add_homogeneous(0, tape["sd0"], dh0)

    def rows_back(dh: Tensor, dw: Tensor, db: Tensor | None) -> Tensor:
        """The derivative dH times ΔW̃ᵀ, without forming ΔW̃."""
        back = dh[..., :-1] @ dw.mT
        return back if db is None else back + dh[..., -1:] * db.unsqueeze(-2)

    dconstant = dh0[..., -1:]
    ds_d = rows_back(dh0, *mats[0][:2])
    ds_0 = dh0 @ reference[0]["w0h"].mT
    seeds: dict[int, tuple[Tensor, Tensor]] = {}
    for index in range(1, last + 1):
        dw, db, w1 = mats[index]
        er, eg = gates[index][:2]
        n00, n0d, ndd = (_vector(tape[f"{n}{index}"]) for n in ("n00", "n0d", "ndd"))
        m0, hd = tape[f"m0{index}"], tape[f"hd{index}"]
        dm0 = ds_0 * _vector(er) + 2 * scale * (m0 * n00 + hd * n0d)
        dhd = ds_d * _vector(eg) + 2 * scale * (m0 * n0d + hd * ndd)
        # the correction's derivatives in its injections: where the diagonal pass starts
        seeds[index] = (2 * grad_value.unsqueeze(-1) * (m0 * hd).sum(-2),
                        grad_value.unsqueeze(-1) * hd.pow(2).sum(-2))
        dh = torch.cat([dm0, dconstant.expand(*dm0.shape[:-1], 1)], dim=-1)
        s_d = tape[f"sd{index}"]
        add_homogeneous(index, s_d, dh)
        add_outer(index, 2, s_d, dhd)
        if index < last:
            ds_d = rows_back(dh, dw, db) + dhd @ w1.mT
            ds_0 = dh @ reference[index]["w0h"].mT

    # the diagonal pass, from the output layer down
    dt0d = dtdd = dfd = None  # derivatives in layer index's t0d, tdd and Δs factor
    for index in range(last, 0, -1):
        er, eg, _, crg, vg = gates[index]
        dn0d, dndd = seeds[index]
        dc0d = dcdd = dfad = None
        if index < last:
            assert dt0d is not None and dtdd is not None and dfd is not None
            dw, db, w1 = mats[index]
            block = reference[index]
            c00, c0d, cdd, a, b = (tape[f"{n}{index}"] for n in ("c00", "c0d", "cdd", "a", "b"))
            w0, w0sq = block["w0"], block["w0sq"]
            # t0d = (c00 + c0d) Aᵀ + c0d W0²ᵀ, tdd = (c00 + 2 c0d + cdd) Bᵀ + 2 (c0d + cdd) Aᵀ
            # + cdd W0²ᵀ; A = W0⊙ΔW, B = ΔW²: dΔW = W0⊙dA + 2 ΔW⊙dB
            held = grads[index][0]
            assert held is not None  # the rows pass set it
            per_component = dw.dim() == 3
            held.addcmul_(w0, _outer_sum([(dt0d, c00 + c0d), (dtdd, 2 * (c0d + cdd))],
                                         per_component))
            held.addcmul_(dw, _outer_sum([(dtdd, c00 + 2 * c0d + cdd)], per_component), value=2)
            by_a = torch.stack([dt0d + 2 * dtdd, 2 * dtdd], -2) @ a
            by_w0sq = torch.stack([dt0d, dtdd], -2) @ w0sq
            by_b = _vector_times(dtdd, b)
            dc0d = by_a[..., 0, :] + by_w0sq[..., 0, :] + 2 * by_b
            dcdd = by_b + by_w0sq[..., 1, :] + by_a[..., 1, :]
            # Fd = ΔW̃ Φ + W1 Fad
            factor = block["factor"]
            add_homogeneous(index, dfd.mT, factor.mT)
            add_outer(index, 2, dfd.mT, tape[f"fad{index}"].mT)
            dfad = w1.mT @ dfd
            dn0d, dndd = dn0d + dc0d, dndd + dcdd
        dt0d, dtdd = crg * dn0d, vg * dndd
        if dc0d is not None and dcdd is not None:
            dt0d, dtdd = dt0d + er * eg * dc0d, dtdd + eg.pow(2) * dcdd
        prev = index - 1
        dfd = (_column(crg * dn0d) * reference[prev]["f0"]
               + 2 * _column(vg * dndd) * tape[f"fd{prev}"])
        if dfad is not None:
            dfd = dfd + _column(eg) * dfad
    if dfd is not None:
        assert dt0d is not None and dtdd is not None
        dw = mats[0][0]
        block = reference[0]
        add_homogeneous(0, dfd.mT, block["factor"].mT)
        if "residual" in block:
            # t0d = D (W0⊙ΔW)ᵀ, tdd = D (ΔW²)ᵀ
            held = grads[0][0]
            assert held is not None
            diagonal = block["residual"][..., :-1]
            if "w0d" in block:  # one component per ΔW: (W0⊙dt0d + 2 ΔW⊙dtdd) ⊙ D, one buffer
                if dw.dim() == 2:
                    dt0d, dtdd, diagonal = dt0d[0], dtdd[0], diagonal[0]
                part = dw * (2 * _column(dtdd))
                part.addcmul_(block["w0"], _column(dt0d))
                held.addcmul_(part, diagonal.unsqueeze(-2))
            else:
                per_component = dw.dim() == 3
                held.addcmul_(block["w0"], _outer_sum([(dt0d, diagonal)], per_component))
                held.addcmul_(dw, _outer_sum([(dtdd, diagonal)], per_component), value=2)
    return grads
