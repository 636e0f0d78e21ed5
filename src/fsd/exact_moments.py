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

The reference blocks R00 depend only on θ0 and the stored statistics — computed once. With
``layerwise`` statistics they are not propagated at all but the reference network's real
input moments at every affine layer, collected at ``fit``.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from .covariance import Covariance, sampling_factor
from .interpreter import TracedLayer
from .rules import UnsupportedModuleError, weight_bias


def _homogeneous(weight: Tensor, bias: Tensor | None) -> Tensor:
    """W̃ = [W b] (o, in + 1); a missing bias is a zero column."""
    column = weight.new_zeros(weight.shape[:-1]) if bias is None else bias
    return torch.cat([weight, column.unsqueeze(-1)], dim=-1)


def gate_second_moment(mu: Tensor) -> Tensor:
    """Q = E[m mᵀ] = μμᵀ + diag(μ(1 − μ)) for independent Bernoulli gates, (G, o, o)."""
    return mu.unsqueeze(-1) * mu.unsqueeze(-2) + torch.diag_embed(mu * (1 - mu))


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


def _gated_homogeneous(second: Tensor, mean: Tensor, mu: Tensor | None) -> Tensor:
    """R00 after a ReLU gate (μ), or directly after an affine layer (μ = None: no gate).

    R00 = [[Q ⊙ E[s sᵀ], μ ⊙ E s], [(μ ⊙ E s)ᵀ, 1]].
    """
    if mu is not None:
        second, mean = gate_second_moment(mu) * second, mu * mean
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
        gate_means: Bernoulli means μ per ReLU path, each (G, units).
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
    for layer in layers:
        kind = layer.rule.kind
        if kind == "affine":
            if pending is not None:  # affine after affine: no gate in between
                r00, pending = _gated_homogeneous(*pending, None), None
            if out and layer_moments is not None:
                r00 = raw_second_moment(*layer_moments[layer.path])
            w0 = _homogeneous(*weight_bias(params0, layer.path))
            if phi is not None:
                p0 = w0 @ phi
                # Φ = [[L, m], [0, 1]]: its last column is E[ã0] = [m; 1]
                block = {"factor": phi, "p0": p0, "mean": phi[..., :, -1]}
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
        elif kind == "gate":
            if pending is None:
                raise UnsupportedModuleError(
                    f"exact moments need an affine layer right before the ReLU at '{layer.path}'")
            r00, pending = _gated_homogeneous(*pending, gate_means[layer.path]), None
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

    def gated(mu: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        assert pending is not None  # called right after an affine layer
        s0d, sdd, ed = pending
        if mu is None:
            mean = ed
        else:
            q = gate_second_moment(mu)
            s0d, sdd, mean = q * s0d, q * sdd, mu * ed
        return torch.cat([s0d, mean.unsqueeze(-2)], dim=-2), sdd, mean

    index = 0
    for layer in layers:
        kind = layer.rule.kind
        if kind == "affine":
            if pending is not None:  # affine after affine: no gate in between
                r0d, rdd, mean_d = gated(None)
            block = reference[index]
            index += 1
            w0, b0 = weight_bias(params0, layer.path)
            w1, b1 = weight_bias(params1, layer.path)
            w0h = _homogeneous(w0, b0)
            dwh = _homogeneous(w1, b1) - w0h
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
        elif kind == "gate" and pending is not None:
            r0d, rdd, mean_d = gated(gate_means[layer.path])
            pending = None
    final = pending[1] if pending is not None else rdd
    assert final is not None  # the model has an affine layer
    rows = output_rows.to(final.dtype)
    return ((rows @ final) * rows).sum((-1, -2))
