"""BGLN-D's paper Algorithm 2 on a chain of rule-tagged layers.

:func:`reference_moments` / :func:`delta_moments` give the moments of the Bernoulli-gated
linear network, batched over mixture components. The reference side depends only on θ0 and
the stored statistics, so callers compute it once and reuse it; the difference side is
accumulated backwards from the outputs.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from ..covariance import Covariance, quadratic_trace, sandwich
from ..model import support
from ..model.rules import (
    AffineRule,
    TracedLayer,
    UnsupportedModuleError,
    is_affine,
    is_fixed,
    is_gate,
)


def check_moment_support(layers: list[TracedLayer], input_shape: tuple[int, ...],
                         exact: bool = False, layerwise: bool = False) -> bool:
    """Whether BGLN-D takes the flat (MLP) path; raise ``NotImplementedError`` if it cannot run.

    The flat path (:func:`reference_moments`, :mod:`fsd.moments.exact`) needs flat feature
    vectors at every affine layer; anything else with convolutions, pooling or images takes
    :mod:`fsd.moments.algorithm2_conv` (Algorithm 2 only: exact moments and layer-wise statistics
    would carry (C·H·W)² second moments). Exact moments need an affine layer before every gate. The
    flat path knows affine, parameter-free and gate layers only; a layer of any other rule (a user's
    own :class:`~fsd.model.rules.Rule` subclass) takes the other path too.
    """
    flat = len(input_shape) == 1
    supported = True
    for layer in layers:
        if not (layer.rule.flat_moments(layer.module)
                and (is_affine(layer.rule) or is_fixed(layer.rule) or is_gate(layer.rule))):
            supported = False
        elif is_fixed(layer.rule):
            _check_identity(layer)
        if isinstance(layer.module, nn.Flatten):
            flat = True
        elif is_affine(layer.rule) and not flat:
            supported = False
    if not supported:
        what = "moments='exact'" if exact else "reference='layerwise'" if layerwise else None
        if what is not None:
            failing = support.BGLN_D_EXACT if exact else support.BGLN_D_LAYERWISE
            raise NotImplementedError(
                f"BGLN-D with {what} is implemented for MLPs only: on layers over images or "
                f"sequences (inputs that are not flat vectors) it would carry (C·H·W)² second "
                f"moments; "
                f"{support.advice(failing, support.Feature.UNFLAT)}")
        for layer in layers:
            if isinstance(layer.module, nn.MaxPool2d) and layer.module.ceil_mode:
                raise NotImplementedError(
                    f"BGLN-D does not support MaxPool2d with ceil_mode=True (at "
                    f"'{layer.path}'); set ceil_mode=False, or "
                    f"{support.advice(support.BGLN_D, support.Feature.CEIL_POOL)}")
        return False
    if exact:
        previous: TracedLayer | None = None  # the last layer that is not parameter-free
        for layer in layers:
            if is_gate(layer.rule) and (previous is None or not is_affine(previous.rule)):
                name = f"{type(layer.module).__name__} at '{layer.path}'"
                after = "the input" if previous is None else \
                    f"{type(previous.module).__name__} at '{previous.path}'"
                use = support.advice(support.BGLN_D_EXACT,
                                     support.Feature.GATE_AFTER_NON_AFFINE)
                raise NotImplementedError(
                    f"BGLN-D with exact moments needs an affine layer (Linear, BatchNorm1d) "
                    f"before every activation; {name} follows {after}; {use}")
            if not is_fixed(layer.rule):
                previous = layer
    return True


def _check_identity(layer: TracedLayer) -> None:
    """The flat path takes a parameter-free layer as the identity: refuse one that is not."""
    # multiples of 1/8 in [-8, 8): exact in every floating dtype, so a cast (x.float(), whose
    # walk runs in the model's dtype anyway) passes and any map that changes a value does not
    probe = torch.randint(-64, 64, (2, 7), generator=torch.Generator().manual_seed(0)) / 8.0
    probe = probe.to(torch.float64)
    try:
        same = bool(torch.equal(layer.rule.apply(layer.module, probe).to(probe.dtype), probe))
    except Exception:  # a map defined on other shapes only: not the identity either
        same = False
    if not same:
        raise UnsupportedModuleError(
            f"the rule of {type(layer.module).__name__} at '{layer.path}' has "
            f"flat_moments=True, but its map is not the identity on flat feature vectors, "
            f"which is how BGLN-D's MLP path takes a parameter-free layer; leave "
            f"flat_moments off (BGLN-D then applies the map)")


def _moment_steps(layers: list[TracedLayer]) -> list[TracedLayer | tuple[TracedLayer, ...]]:
    """The layers Algorithm 2 walks: gates, and runs of affine layers with no gate between.

    A run (e.g. Linear then BatchNorm) is one affine map, composed before the moments are
    propagated: Algorithm 2 drops Cov(a0, Δa), which is only its approximation at a gate;
    between two affine layers it would also drop a correlation that the composed layer
    keeps. Parameter-free layers are the identity on the flat vectors BGLN-D works on
    (what :attr:`fsd.model.rules.Rule.flat_moments` promises for a
    :class:`~fsd.model.rules.FixedRule`), so they are left out; the path holds no other layers
    (:func:`check_moment_support`).
    """
    steps: list[TracedLayer | tuple[TracedLayer, ...]] = []
    run: list[TracedLayer] = []
    for layer in layers:
        if is_affine(layer.rule):
            run.append(layer)
        elif is_gate(layer.rule):
            if run:
                steps.append(tuple(run))
                run = []
            steps.append(layer)
    if run:
        steps.append(tuple(run))
    return steps


def affine_rule(layer: TracedLayer) -> AffineRule:
    """The rule of a layer that a walker has grouped with the affine layers (a run)."""
    rule = layer.rule
    assert is_affine(rule), layer.path
    return rule


def _bias(bias: Tensor | None, weight: Tensor) -> Tensor:
    return weight.new_zeros(weight.shape[:-1]) if bias is None else bias


def _composed(run: tuple[TracedLayer, ...], params: Mapping[str, Tensor]
              ) -> tuple[Tensor, Tensor | None]:
    """(W, b) of a run of affine layers applied in order, as dense matrices."""
    first = run[0]
    weight, bias = affine_rule(first).affine_matrix(first.module, params, first.path)
    for layer in run[1:]:
        w, b = affine_rule(layer).affine_matrix(layer.module, params, layer.path)
        bias = torch.einsum("...oi,...i->...o", w, _bias(bias, weight)) + _bias(b, w)
        weight = w @ weight
    return weight, bias


def _composed_delta(run: tuple[TracedLayer, ...], params0: Mapping[str, Tensor],
                    params1: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None, Tensor]:
    """(ΔW, Δb, W1) of a run of affine layers, with ΔW formed first at every layer.

    For y = W_b(W_a x + b_a) + b_b: ΔW = ΔW_b W0_a + W1_b ΔW_a and
    Δb = ΔW_b b0_a + W1_b Δb_a + Δb_b — never a difference of two products.
    """
    first, rule = run[0], affine_rule(run[0])
    w0, b0 = rule.affine_matrix(first.module, params0, first.path)
    w1 = rule.affine_matrix(first.module, params1, first.path)[0]
    # (o, in), or (G, o, in) for stacked reference networks
    dw, db = rule.affine_delta_matrix(first.module, params0, params1, first.path)
    for layer in run[1:]:
        rule = affine_rule(layer)
        v0, c0 = rule.affine_matrix(layer.module, params0, layer.path)
        v1 = rule.affine_matrix(layer.module, params1, layer.path)[0]
        dv, dc = rule.affine_delta_matrix(layer.module, params0, params1, layer.path)
        db = (torch.einsum("...oi,...i->...o", dv, _bias(b0, w0))
              + (0 if db is None else torch.einsum("...oi,...i->...o", v1, db))
              + (0 if dc is None else dc))
        dw = dv @ w0 + v1 @ dw
        b0 = torch.einsum("...oi,...i->...o", v0, _bias(b0, w0)) + _bias(c0, v0)
        w0, w1 = v0 @ w0, v1 @ w1
    return dw, db, w1


def reference_moments(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    mean: Tensor,
    cov: Covariance,
    gate_means: Mapping[str, Tensor],
    layer_moments: Mapping[str, tuple[Tensor, Tensor]] | None = None,
) -> list[tuple[Tensor, Covariance, Tensor]]:
    """Mean and covariance of the reference activations a0 entering every affine map.

    Args:
        layers: output of :func:`fsd.trace`.
        params0: reference parameters θ0 (and buffers) by name.
        mean: input means, (G, d) for G mixture components.
        cov: input covariances in any form of :mod:`fsd.covariance`.
        gate_means: stored gate statistics per gate path: firing frequencies μ (G, units),
            or a smooth gate's moments (G, units, 5)
            (:meth:`fsd.model.rules.GateRule.gate_moments`).
        layer_moments: optional real (mean, covariance) at each affine layer after the
            first, used instead of propagating (``reference="layerwise"``).

    Returns:
        One ``(mean, cov, preactivation_mean)`` per affine map — a run of affine layers
        without a gate between them counts once (:func:`_moment_steps`) — in order: the
        moments of its input (the first keeps the input's form, later ones are full) and
        E[s0] (G, o).
    """
    out = []
    for step in _moment_steps(layers):
        if isinstance(step, tuple):
            if out and layer_moments is not None:
                mean, cov = layer_moments[step[0].path]
            w0, b0 = _composed(step, params0)
            s0_mean = mean @ w0.T + (0 if b0 is None else b0)
            out.append((mean, cov, s0_mean))
            mean, cov = s0_mean, sandwich(w0, cov)
        else:
            rule = step.rule
            assert is_gate(rule)  # _moment_steps gives runs and gates
            # Algorithm 2 gates means by E[r] (μ for a ReLU) and covariances by E[r]E[r]ᵀ; a
            # gate follows an affine layer, whose sandwich() made the covariance full
            mean, cov = rule.reference_moments(step.module, gate_means[step.path], mean,
                                               cov)  # pyright: ignore[reportArgumentType]
    return out


def _per_reference_rows(rows: Tensor, matrix: Tensor) -> Tensor:
    """Multiply rows (G, k, o) by each component's (o, i) matrix.

    ``matrix`` is (o, i), shared by all components, or (R, o, i), one per reference network,
    with G = R·C and each reference's C components consecutive.

    Folding the C components into the rows multiplies each reference's matrix once, where
    a per-component copy of it would cost C times the memory traffic (class-wise summaries
    of many tasks: C = classes).
    """
    if matrix.dim() == 2:
        return rows @ matrix
    groups, k = rows.shape[0], rows.shape[-2]
    references = matrix.shape[0]
    folded = rows.reshape(references, (groups // references) * k, rows.shape[-1]) @ matrix
    return folded.reshape(groups, k, matrix.shape[-1])


def _per_component(vectors: Tensor, groups: int) -> Tensor:
    """(R, o) per-reference vectors repeated for each of the R's consecutive components."""
    if vectors.dim() == 1 or vectors.shape[0] == groups:
        return vectors
    return vectors.repeat_interleave(groups // vectors.shape[0], dim=0)


def delta_moments(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    params1: Mapping[str, Tensor],
    reference: list[tuple[Tensor, Covariance, Tensor]],
    gate_means: Mapping[str, Tensor],
    output_rows: Tensor,
) -> tuple[Tensor, Tensor]:
    """BGLN-D (paper Algorithm 2): E[Δz] and tr Cov(Δz) on the selected outputs.

    Algorithm 2 is linear in the covariances (μμᵀ ⊙ C = diag(μ) C diag(μ)), so with
    Cov(a0, Δa) = 0 as in the paper,
    tr Cov(Δz) = Σ_l tr(M_l ΔW_l C0_l ΔW_lᵀ M_lᵀ), M_l = W1_L diag(μ) ⋯ W1_{l+1} diag(μ_l)
    the map from layer l's Δs to the outputs. Accumulating M_l backwards from the k selected
    outputs costs O(k·Σ o_l²) instead of pushing o×o covariances forwards — the same number,
    far cheaper for few outputs. Runs of affine layers without a gate between them (Linear
    then BatchNorm) are composed into one map first (:func:`_moment_steps`).

    Args:
        layers: output of :func:`fsd.trace`.
        params0: reference parameters (and buffers); each may carry a leading dimension R
            of reference networks, so summaries of several reference networks are evaluated
            in one batched pass. R must divide the number of components G, and each
            reference's G / R components must be consecutive (R = G: one per component).
        params1: parameters θ (and buffers) of the other network (differentiable).
        reference: output of :func:`reference_moments` (fixed after fit).
        gate_means: stored gate statistics per gate path (firing frequencies μ (G, units),
            or a smooth gate's moments); a difference is scaled by the mean slope E[g]
            (μ for a ReLU).
        output_rows: (k', k) or per component (G, k', k) matrix selecting outputs (rows of
            the identity; zero rows pad components with fewer outputs).

    Returns:
        ``(mean (G, k'), trace (G,))``.
    """
    if not any(is_affine(layer.rule) for layer in layers):
        raise UnsupportedModuleError("the model has no parameterized layer")
    # ΔW = W1 − W0 is formed first and multiplied by the reference quantities: subtracting
    # two products instead, (m W1ᵀ + b1) − m W0ᵀ, loses the digits the products share (in
    # float32 at a relative perturbation of 1e-4: errors of 1e-4 to 1e-2 in value and
    # gradient). ΔW is exactly 0 at θ = θ0.
    steps = _moment_steps(layers)
    deltas: dict[int, tuple[Tensor, Tensor]] = {}
    gate_mean = {layer.path: layer.rule.gate_moments(layer.module,
                                                     gate_means[layer.path]).delta_mean
                 for layer in layers if is_gate(layer.rule)}
    mean_d: Tensor | None = None
    index = 0
    for position, step in enumerate(steps):
        if isinstance(step, tuple):
            mean0 = reference[index][0]
            index += 1
            dw, db, w1 = _composed_delta(step, params0, params1)
            deltas[position] = (dw, w1)
            new_mean = _per_reference_rows(mean0.unsqueeze(-2), dw.transpose(-1, -2))
            new_mean = new_mean.squeeze(-2)
            if db is not None:
                new_mean = new_mean + _per_component(db, new_mean.shape[0])
            if mean_d is not None:
                new_mean = new_mean + mean_d @ w1.T
            mean_d = new_mean
        elif mean_d is not None:
            mean_d = mean_d * gate_mean[step.path]
    assert mean_d is not None  # there is an affine layer (checked above)
    groups = mean_d.shape[0]
    output_rows = output_rows.to(mean_d.dtype)
    rows = output_rows.expand(groups, *output_rows.shape[-2:])
    trace = mean_d.new_zeros(groups)
    for position in range(len(steps) - 1, -1, -1):
        step = steps[position]
        if not isinstance(step, tuple):
            rows = rows * gate_mean[step.path].unsqueeze(-2)
        else:
            index -= 1
            dw, w1 = deltas[position]
            trace = trace + quadratic_trace(_per_reference_rows(rows, dw), reference[index][1])
            if index > 0:
                rows = rows @ w1
    selected = (output_rows.expand(groups, *output_rows.shape[-2:])
                @ mean_d.unsqueeze(-1)).squeeze(-1)
    return selected, trace
