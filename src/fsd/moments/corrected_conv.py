"""The corrected recursion (:mod:`fsd.moments.corrected`) on chains with convolutions and pools.

``fsd.BGLN(deterministic=True, moments="corrected")`` on CNN chains (the evaluator
``"corrected-conv"``). BGLN on a chain of affine runs (Conv2d, BatchNorm in
evaluation, Linear, with parameter-free linear layers between them), gates and max-pools is
the *mean-gate network* — every gate replaced by its mean, every max-pool routed by its
expected routing (:func:`fsd.model.rules.expected_routing`), as
:mod:`fsd.moments.algorithm2_conv` walks it — driven by the input and by zero-mean injections:

- at a gate, n = ((r − E r) ⊙ s0, (g − E g) ⊙ Δs), with per unit the 2×2 covariance
  [[Var r·E s0², Cov(r,g)·E[s0 Δs]], [·, Var g·E Δs²]];
- at a max-pool, whose routing is a random one-hot choice R per window with E[R] = π (the
  linearized network routes a0 and Δa alike), n = ((R − π)·s0, (R − π)·Δs) per window, with
  covariance Σ_p π_p E[x_p y_p] − Σ_{p,q} π_p π_q E[x_p y_q] for x, y ∈ {s0, Δs}: it needs the
  second moments *between* a window's positions.

Injections are uncorrelated with everything upstream and with each other, and diagonal over
units (a max-pool's windows are routed independently), so

    E‖PΔz‖² = ‖P E[Δz]‖² + ‖A L‖² + Σ_i D_i ‖A_{:,i}‖²
              + Σ_injections Σ_units ‖M0‖² n00 + 2 M0·MΔ n0Δ + ‖MΔ‖² nΔΔ,

with C_in = L Lᵀ + diag(D), A the k rows of the mean-gate network's map from the input to PΔz
(Cov(a0, Δa) kept), and M0, MΔ the rows carrying a change of a0, Δa at the injection to PΔz.
All rows come from one backward pass of k rows through both sides (vector-Jacobian products of
the layers' own functions), as Algorithm 2 pulls its rows back.

The injections' sizes need, at every gate and pool input, the raw second moments of (s0, Δs)
per unit (and, at a pool, between a window's positions). They are pushed forward as

- the part driven by the input's mean and factor L: exactly, as 1 + q images through the
  mean-gate network (the reference side at fit, the difference side per call), which also
  gives a pool its within-window products;
- the part driven by D and by earlier injections (each diagonal where it enters): *carried
  diagonally*, layer by layer — an affine layer by its squared coefficients (``apply`` with
  W0², W0⊙ΔW, ΔW²: one coefficient per input in every output, true of Linear, Conv2d and
  BatchNorm), a parameter-free layer by its rule's :attr:`fsd.model.rules.FixedRule.squared`,
  a gate by E[r]², E[r]E[g], E[g]², a pool by π². The covariance a layer creates between
  units is dropped (and, at a pool, the carried part's within-window products taken as 0):
  that is the approximation, the MLP version's.

It is exact for one gated layer, with or without a max-pool after it, when the input
covariance has no diagonal part; on flat layers it equals :mod:`fsd.moments.corrected` (tested
against both, in float64, and against :func:`fsd.testing.dense_bgln_cnn`).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
from torch import Tensor
from torch.func import vjp

from ..covariance import Covariance
from ..model.rules import (
    TracedLayer,
    UnsupportedModuleError,
    expected_routing,
    is_affine,
    is_fixed,
    is_gate,
    is_pool,
)
from .algorithm2_conv import Step, input_factor, is_run
from .corrected import truncated_input


# ----- one layer's maps on (G, n, *shape) tensors ---------------------------------------------
def _batched(fn: Any, x: Tensor) -> Tensor:
    y = fn(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))
    return y.view(*x.shape[:2], *y.shape[1:])


def _affine(layer: TracedLayer, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _batched(lambda v: layer.rule.apply(layer.module, v, weight, bias), x)


def _fixed(layer: TracedLayer, x: Tensor) -> Tensor:
    return _batched(lambda v: layer.rule.apply(layer.module, v), x)


def _fixed_squared(layer: TracedLayer, x: Tensor) -> Tensor:
    squared = getattr(layer.rule, "squared", None)
    assert squared is not None  # check_squared refused the model at fit
    return _batched(lambda v: squared(layer.module, v), x)


def image_input(cov: Covariance, groups: int, input_shape: tuple[int, ...],
                injection_rank: int | None) -> tuple[Tensor, Tensor | None, Tensor,
                                                     Tensor | None]:
    """The input's factor and diagonal that size the injections, and the whole ones as images.

    The factor (G, r, d) and diagonal (G, d) are cut to ``injection_rank`` directions plus the
    diagonal they miss (:func:`fsd.moments.corrected.truncated_input`) when it is given; the
    whole factor and diagonal, as images (G, r, *input_shape) and (G, 1, *input_shape), give
    the mean-gate network's term.
    """
    factor, residual = input_factor(cov, groups)
    signal_factor = factor.reshape(groups, factor.shape[1], *input_shape)
    signal_residual = None if residual is None else residual.reshape(groups, 1, *input_shape)
    if injection_rank is not None:
        phi = torch.cat([factor.transpose(-1, -2), factor.new_zeros(groups, factor.shape[-1], 1)],
                        -1)
        phi, residual = truncated_input(phi, residual, injection_rank)
        factor = phi[..., :-1].transpose(-1, -2)
    return factor, residual, signal_factor, signal_residual


def check_squared(layers: list[TracedLayer]) -> None:
    """Refuse a layer whose variances the squared coefficients do not carry.

    A parameter-free layer needs its rule's squared map; a Conv2d must pad with zeros (a
    reflected or wrapped border puts one input twice in a window, so Σ_i J_ji² v_i is not
    the convolution with W²).
    """
    for layer in layers:
        mode = getattr(layer.module, "padding_mode", "zeros")
        if is_affine(layer.rule) and mode != "zeros":
            raise UnsupportedModuleError(
                f"the corrected recursion carries variances by squared weights, which a "
                f"{type(layer.module).__name__} with padding_mode={mode!r} at '{layer.path}' "
                f"does not allow (an input can fall twice in one window): use "
                f"BGLN(deterministic=True) (Algorithm 2) or padding_mode='zeros'")
        if is_fixed(layer.rule) and getattr(layer.rule, "squared", None) is None:
            raise UnsupportedModuleError(
                f"the corrected recursion carries variances through every layer, and the rule "
                f"of {type(layer.module).__name__} at '{layer.path}' has no squared map: "
                f"register it with fsd.FixedRule(..., squared=...) (Σ_i J_ji² v_i), or use "
                f"BGLN(deterministic=True) (Algorithm 2)")


def _parameters(layer: TracedLayer, params0: Mapping[str, Tensor],
                params1: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None, Tensor,
                                                        Tensor, Tensor | None]:
    """(W0, b0, W1, ΔW, Δb) of an affine layer, ΔW formed first."""
    rule, module = layer.rule, layer.module
    assert is_affine(rule)
    w0, b0 = rule.affine_parameters(module, params0, layer.path)
    w1 = rule.affine_parameters(module, params1, layer.path)[0]
    dw, db = rule.affine_delta(module, params0, params1, layer.path)
    return w0, b0, w1, dw, db


def _run_forward(run: Step, params0: Mapping[str, Tensor], params1: Mapping[str, Tensor],
                 a0: Tensor, da: Tensor | None, bias: bool) -> Tensor:
    """Δ of a run: ΔW a0 + W1 Δa layer by layer (+ Δb with ``bias``); a0 carried along."""
    last = max(i for i, layer in enumerate(run) if is_affine(layer.rule))
    s0, ds = a0, da
    for index, layer in enumerate(run):
        if not is_affine(layer.rule):
            s0 = _fixed(layer, s0) if index < last else s0
            ds = None if ds is None else _fixed(layer, ds)
            continue
        w0, b0, w1, dw, db = _parameters(layer, params0, params1)
        step = _affine(layer, s0, dw, db if bias else None)
        ds = step if ds is None else step + _affine(layer, ds, w1, None)
        if index < last:  # the reference is needed only by a later affine layer of the run
            s0 = _affine(layer, s0, w0, b0 if bias else None)
    assert ds is not None  # a run holds an affine layer
    return ds


def _run_reference(run: Step, params0: Mapping[str, Tensor], x: Tensor, bias: bool) -> Tensor:
    for layer in run:
        if is_affine(layer.rule):
            w0, b0 = layer.rule.affine_parameters(layer.module, params0, layer.path)
            x = _affine(layer, x, w0, b0 if bias else None)
        else:
            x = _fixed(layer, x)
    return x


def _run_rows_map(run: Step, params0: Mapping[str, Tensor], params1: Mapping[str, Tensor],
                  reference: bool, x0: Tensor, xd: Tensor | None = None
                  ) -> Tensor | tuple[Tensor, Tensor]:
    """The run's linear maps that rows are pulled back through.

    Δs from (a0, Δa), and with ``reference`` also s0 from a0 (once the reference side has rows).
    """
    ds = _run_forward(run, params0, params1, x0, xd, bias=False)
    return (_run_reference(run, params0, x0, bias=False), ds) if reference else ds


def _carry_reference(run: Step, params0: Mapping[str, Tensor], t00: Tensor) -> Tensor:
    """The diagonally carried part of E s0² through a run (squared coefficients)."""
    for layer in run:
        if is_affine(layer.rule):
            w0 = layer.rule.affine_parameters(layer.module, params0, layer.path)[0]
            t00 = _affine(layer, t00, w0.pow(2), None)
        else:
            t00 = _fixed_squared(layer, t00)
    return t00


def _carry_delta(run: Step, params0: Mapping[str, Tensor], params1: Mapping[str, Tensor],
                 t00: Tensor, t0d: Tensor | None, tdd: Tensor | None
                 ) -> tuple[Tensor, Tensor]:
    """The carried parts of E[s0 Δs], E Δs² through a run, from those at its input.

    With W1 = W0 + ΔW, A = W0⊙ΔW and B = ΔW² (no difference of squares):
    t0d' = A(t00 + t0d) + W0² t0d and tdd' = B(t00 + 2 t0d + tdd) + 2A(t0d + tdd) + W0² tdd.
    """
    zero = torch.zeros_like(t00)
    t0d = zero if t0d is None else t0d
    tdd = zero if tdd is None else tdd
    for layer in run:
        if not is_affine(layer.rule):
            t00, t0d, tdd = (_fixed_squared(layer, t) for t in (t00, t0d, tdd))
            continue
        w0, _, _, dw, _ = _parameters(layer, params0, params1)
        w0sq = w0.pow(2)
        by_a = _affine(layer, torch.cat([t00 + t0d, 2 * (t0d + tdd)], 1), w0 * dw, None)
        by_w0 = _affine(layer, torch.cat([t0d, tdd, t00], 1), w0sq, None)
        by_b = _affine(layer, t00 + 2 * t0d + tdd, dw.pow(2), None)
        t0d = by_a[:, :1] + by_w0[:, :1]
        tdd = by_b + by_a[:, 1:] + by_w0[:, 1:2]
        t00 = by_w0[:, 2:]
    return t0d, tdd


def _square_routed(layer: TracedLayer, x: Tensor, statistics: Mapping[str, Tensor]) -> Tensor:
    """A max-pool's expected routing with the frequencies squared: Σ_p π_p² x_p."""
    frequencies = statistics[layer.path].to(x.dtype)
    return expected_routing(layer.module, x, frequencies.pow(2))  # type: ignore[arg-type]


def _gate_parts(layer: TracedLayer, statistics: Mapping[str, Tensor], like: Tensor
                ) -> tuple[Tensor, ...]:
    """(E r, E g, Var r, Cov(r, g), Var g) per unit, broadcastable to (G, n, *units)."""
    assert is_gate(layer.rule)
    moments = layer.rule.gate_moments(layer.module, statistics[layer.path])
    return tuple(v.unsqueeze(1).to(like.dtype) for v in (
        moments.reference_mean, moments.delta_mean, moments.reference_variance,
        moments.covariance, moments.delta_variance))


def _cross(x: Tensor, y: Tensor) -> Tensor:
    """Σ over the n images of x ⊙ y, kept as one image (G, 1, *shape)."""
    return (x * y).sum(1, keepdim=True)


def _pool_injection(layer: TracedLayer, statistics: Mapping[str, Tensor],
                    columns_x: Tensor, columns_y: Tensor, routed_x: Tensor, routed_y: Tensor,
                    carried: Tensor | None) -> Tensor:
    """Σ_p π_p E[x_p y_p] − Σ_{p,q} π_p π_q E[x_p y_q] per window.

    The images (mean and factor columns) give E[x_p y_q] exactly; the carried part only its
    diagonal (p = q), so it adds Σ_p (π_p − π_p²) t_p.
    """
    routed = layer.rule.expected_reference(layer, _cross(columns_x, columns_y), statistics,
                                           offset=False)
    value = routed - _cross(routed_x, routed_y)
    if carried is not None:
        value = value + layer.rule.expected_reference(layer, carried, statistics, offset=False) \
            - _square_routed(layer, carried, statistics)
    return value


# ----- reference side: fixed after fit ----------------------------------------------------------
def conv_reference(steps: list[Step], params0: Mapping[str, Tensor], mean: Tensor,
                   cov: Covariance, statistics: Mapping[str, Tensor],
                   input_shape: tuple[int, ...], injection_rank: int | None = None,
                   injections: bool = True) -> dict[str, Any]:
    """What the difference side needs from θ0 and the statistics (computed once, at fit).

    Returns:
        ``{"states", "signal_factor", "signal_residual"}``: per step, the state at its input
        — ``"columns"`` (G, 1 + q, *shape), the mean then the q factor images of a0 in the
        mean-gate network, ``"carried"`` (G, 1, *shape) or ``None``, the diagonally carried
        part of E a0², and at a gate or pool ``"n00"``, its injection's reference variance —
        and the input's whole factor (G, r, *input_shape) and diagonal (or ``None``) for the
        mean-gate network's term. With ``injection_rank`` the states are pushed from the
        covariance cut to that many directions plus its diagonal
        (:func:`fsd.moments.corrected.truncated_input`). ``injections=False`` (the mean-gate
        network alone) leaves the carried parts and injections out.
    """
    groups = mean.shape[0]
    factor, residual, signal_factor, signal_residual = image_input(cov, groups, input_shape,
                                                                   injection_rank)
    columns = torch.cat([mean.reshape(groups, 1, *input_shape),
                         factor.reshape(groups, factor.shape[1], *input_shape)], 1)
    carried = None if residual is None or not injections else \
        residual.reshape(groups, 1, *input_shape)
    states: list[dict[str, Any]] = []
    for step in steps:
        state: dict[str, Any] = {"columns": columns, "carried": carried}
        states.append(state)
        if is_run(step):
            columns = torch.cat([_run_reference(step, params0, columns[:, :1], bias=True),
                                 _run_reference(step, params0, columns[:, 1:], bias=False)], 1)
            carried = None if carried is None else _carry_reference(step, params0, carried)
            continue
        (layer,) = step
        routed = torch.cat([layer.rule.expected_reference(layer, columns[:, :1], statistics,
                                                          offset=True),
                            layer.rule.expected_reference(layer, columns[:, 1:], statistics,
                                                          offset=False)], 1)
        if not injections:
            pass
        elif is_gate(layer.rule):
            er, _, vr, _, _ = _gate_parts(layer, statistics, columns)
            second = columns.pow(2).sum(1, keepdim=True)
            if carried is not None:
                second = second + carried
            state["n00"] = vr * second
            carried = state["n00"] if carried is None else er.pow(2) * carried + state["n00"]
        elif is_pool(layer.rule):
            state["n00"] = _pool_injection(layer, statistics, columns, columns, routed, routed,
                                           carried)
            carried = state["n00"] if carried is None else \
                _square_routed(layer, carried, statistics) + state["n00"]
        elif carried is not None:
            carried = _fixed_squared(layer, carried)
        columns = routed
    return {"states": states, "signal_factor": signal_factor,
            "signal_residual": signal_residual}


# ----- difference side ------------------------------------------------------------------------
def _injects(step: Step) -> bool:
    return not is_run(step) and (is_gate(step[0].rule) or is_pool(step[0].rule))


def conv_second_moment(steps: list[Step], params0: Mapping[str, Tensor],
                       params1: Mapping[str, Tensor], reference: dict[str, Any],
                       statistics: Mapping[str, Tensor], output_rows: Tensor, *,
                       gate_variance: bool = True, parts: bool = False
                       ) -> Tensor | tuple[Tensor, Tensor]:
    """E‖PΔz‖² (G,) by the mean-gate network plus the injected gate and routing variance.

    Args:
        steps: :func:`fsd.moments.algorithm2_conv.moment_steps` of the traced chain.
        params0: θ0 (with buffers).
        params1: θ (with buffers; differentiable).
        reference: :func:`conv_reference` for the same ``params0``.
        statistics: gate statistics and max-pool routing frequencies by path.
        output_rows: (k', k) rows selecting outputs.
        gate_variance: ``False`` leaves the injections out: the mean-gate network alone, at
            Algorithm 2's cost.
        parts: return (mean-gate network, injections) separately.
    """
    states = reference["states"]
    last_injection = max((i for i, step in enumerate(steps) if _injects(step)), default=-1)
    if not gate_variance:
        last_injection = -1
    # forward: E[Δa] through the whole chain; the diagonals up to the last injection
    mean_d: Tensor | None = None
    factor_d: Tensor | None = None  # the difference side of the factor columns
    t0d = tdd = None
    injections: dict[int, tuple[Tensor, Tensor | None, Tensor | None]] = {}
    for position, step in enumerate(steps):
        state = states[position]
        columns, carried = state["columns"], state["carried"]
        needed = position < last_injection
        if is_run(step):
            mean_d = _run_forward(step, params0, params1, columns[:, :1], mean_d, bias=True)
            if needed:
                factor_d = _run_forward(step, params0, params1, columns[:, 1:], factor_d,
                                        bias=False)
                if carried is not None:
                    t0d, tdd = _carry_delta(step, params0, params1, carried, t0d, tdd)
            continue
        (layer,) = step
        rule = layer.rule
        if mean_d is None:  # before the first affine layer Δa = 0: only a0 gets variance
            if _injects(step) and (needed or position == last_injection):
                injections[position] = (state["n00"], None, None)
            continue
        delta_columns = mean_d if factor_d is None else torch.cat([mean_d, factor_d], 1)
        routed_d = rule.expected_delta(layer, delta_columns, statistics)
        if needed or position == last_injection:
            if is_gate(rule):
                er, eg, _, crg, vg = _gate_parts(layer, statistics, mean_d)
                e0d = _cross(columns[:, :delta_columns.shape[1]], delta_columns)
                edd = delta_columns.pow(2).sum(1, keepdim=True)
                if t0d is not None and tdd is not None:
                    e0d, edd = e0d + t0d, edd + tdd
                n0d, ndd = crg * e0d, vg * edd
                if t0d is not None and tdd is not None:
                    t0d, tdd = er * eg * t0d + n0d, eg.pow(2) * tdd + ndd
                else:
                    t0d, tdd = n0d, ndd
                injections[position] = (state["n00"], n0d, ndd)
            elif is_pool(rule):
                routed0 = rule.expected_reference(layer, columns[:, :delta_columns.shape[1]],
                                                  statistics, offset=False)
                # the mean column's reference side routed without its offset: a pool has none
                n0d = _pool_injection(layer, statistics, columns[:, :delta_columns.shape[1]],
                                      delta_columns, routed0, routed_d, t0d)
                ndd = _pool_injection(layer, statistics, delta_columns, delta_columns,
                                      routed_d, routed_d, tdd)
                if t0d is not None and tdd is not None:
                    t0d = _square_routed(layer, t0d, statistics) + n0d
                    tdd = _square_routed(layer, tdd, statistics) + ndd
                else:
                    t0d, tdd = n0d, ndd
                injections[position] = (state["n00"], n0d, ndd)
            elif t0d is not None and tdd is not None:
                t0d, tdd = _fixed_squared(layer, t0d), _fixed_squared(layer, tdd)
        mean_d = routed_d[:, :1]
        factor_d = routed_d[:, 1:] if factor_d is not None else None
    assert mean_d is not None  # a chain with an affine layer
    groups = mean_d.shape[0]
    output = mean_d.reshape(groups, -1)
    rows_matrix = output_rows.to(output.dtype)
    mean_term = (output @ rows_matrix.T).pow(2).sum(-1)

    # backward: rows of the map from (a0, Δa) at each point to PΔz, through both sides
    s_d: Tensor = rows_matrix.expand(groups, *rows_matrix.shape).reshape(
        groups, rows_matrix.shape[0], *mean_d.shape[2:])
    s_0: Tensor | None = None
    correction = output.new_zeros(groups)
    first_run = min(i for i, step in enumerate(steps) if is_run(step))
    for position in range(len(steps) - 1, -1, -1):
        step = steps[position]
        shape = states[position]["columns"].shape[2:]
        zeros = s_d.new_zeros(groups, s_d.shape[1], *shape)
        if is_run(step):
            if position == first_run:  # Δa = 0 at its input: only a0's rows are needed
                rows_map = functools.partial(_run_rows_map, step, params0, params1,
                                             s_0 is not None)
                pull = vjp(rows_map, zeros)[1]
                s_0 = pull(s_d if s_0 is None else (s_0, s_d))[0]
                continue

            rows_map = functools.partial(_run_rows_map, step, params0, params1, s_0 is not None)
            pull = vjp(rows_map, zeros, zeros)[1]
            s_0, s_d = pull(s_d if s_0 is None else (s_0, s_d))
            continue
        (layer,) = step
        injection = injections.get(position)
        if injection is not None:
            n00, n0d, ndd = injection
            if n0d is None or ndd is None:  # before the first run: a0's rows alone
                assert s_0 is not None
                value = s_0.pow(2).sum(1) * n00.squeeze(1)
            else:
                value = (s_d.pow(2).sum(1) * ndd.squeeze(1))
                if s_0 is not None:
                    value = value + s_0.pow(2).sum(1) * n00.squeeze(1) \
                        + 2 * (s_0 * s_d).sum(1) * n0d.squeeze(1)
            correction = correction + value.flatten(1).sum(-1)
        if position < first_run:  # before the first affine layer only a0 moves
            assert s_0 is not None
            s_0 = vjp(lambda v, ly=layer: ly.rule.expected_reference(
                ly, v, statistics, offset=False), zeros)[1](s_0)[0]
            continue
        s_d = vjp(lambda v, ly=layer: ly.rule.expected_delta(ly, v, statistics), zeros)[1](s_d)[0]
        if s_0 is not None:
            s_0 = vjp(lambda v, ly=layer: ly.rule.expected_reference(
                ly, v, statistics, offset=False), zeros)[1](s_0)[0]
    assert s_0 is not None  # the first run set it
    rows_in = s_0.flatten(2)  # (G, k, d): A
    signal_factor = reference["signal_factor"].flatten(2)
    signal = (rows_in @ signal_factor.transpose(-1, -2)).pow(2).sum((-1, -2))
    if reference["signal_residual"] is not None:
        signal = signal + (rows_in.pow(2) * reference["signal_residual"].flatten(2)).sum((-1, -2))
    signal = mean_term + signal
    if parts:
        return signal, correction
    return signal + correction
