"""BGLN-D (paper Algorithm 2) on convolutional networks, without (C·H·W)² covariances.

The MLP path (:func:`fsd.moments.algorithm2.reference_moments` /
:func:`~fsd.moments.algorithm2.delta_moments`) pushes o × o covariances forwards. A convolutional
layer's o = C·H·W makes that impossible at image sizes (32·32·32 units: a 4 GB matrix per layer), so
here every covariance stays in the factored form of the input, C_in = L Lᵀ + diag(D), and every map
is applied as the layer's own operation (a convolution, never its dense matrix):

- the reference side: C_l = P_l C_in P_lᵀ, with P_l the reference network's *linear* map
  from the input to layer l's input (weights W0 without biases, gates scaled by their mean
  E[r], max-pools routed by their expected routing). Its factor P_l L — r "images" — is
  propagated once at fit; the diagonal part D is never propagated;
- the difference side, as Algorithm 2: E[Δz] forwards, and tr Cov(Δz) = Σ_l tr(M_l ΔW_l C_l
  ΔW_lᵀ M_lᵀ), where M_l, the map from layer l's Δs to the k selected outputs, is k rows
  propagated backwards (vector-Jacobian products through W1 and the mean gates E[g]):
  tr(M ΔW P L Lᵀ Pᵀ ΔWᵀ Mᵀ) = ‖(M ΔW)(P L)‖² and tr(M ΔW P D Pᵀ ΔWᵀ Mᵀ) = Σ_i D_i ‖(M ΔW P)_{:,i}‖²,
  the latter by pulling the k rows back through ΔW and P to the input.

Runs of affine layers with no gate between them (Conv2d then BatchNorm2d, Conv then Flatten
then Linear) are one affine map, as in the MLP path. Every other layer is its rule's map with
the random gates replaced by their expectations (:meth:`fsd.model.rules.Rule.expected_reference`,
:meth:`~fsd.model.rules.Rule.expected_delta`): a gate scales by its mean gate, and a MaxPool2d is
treated as Algorithm 2 treats a gate — its routing is replaced by its expectation, each
window taking each of its positions with the frequency that position was the window's argmax
on the data (:func:`fsd.model.rules.routing_statistics`), applied to means and factors alike. With
MLPs the result is the MLP path's, to round-off; on a tiny CNN it equals a dense transcription
(:func:`fsd.testing.dense_algorithm2_cnn`).

Cost per evaluation: r images through ΔW at every run, and for a diagonal part D, k rows
pulled back from every run to the input (Σ_l l backward passes).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vjp

from ..covariance import Covariance, sampling_factor
from ..model.rules import TracedLayer, is_affine, is_fixed

Step = tuple[TracedLayer, ...]
"""One step of the walk: a run of affine and parameter-free layers holding an affine one
(:func:`is_run`), or a single layer (a gate, a max-pool, a parameter-free layer outside runs)."""


def is_run(step: Step) -> bool:
    """Whether ``step`` is a run of layers holding an affine one (else a single layer)."""
    return any(is_affine(layer.rule) for layer in step)


def moment_steps(layers: list[TracedLayer]) -> list[Step]:
    """The chain grouped as Algorithm 2 walks it: runs of affine layers, gates, max-pools."""
    steps: list[Step] = []
    segment: list[TracedLayer] = []

    def close() -> None:
        if any(is_affine(layer.rule) for layer in segment):
            steps.append(tuple(segment))
        else:
            steps.extend((layer,) for layer in segment)
        segment.clear()

    for layer in layers:
        if is_affine(layer.rule) or is_fixed(layer.rule):
            segment.append(layer)
        else:
            close()
            steps.append((layer,))
    close()
    return steps


# ----- the maps of one step, on (G, n, *shape) tensors ---------------------------------------
def _unfold(x: Tensor, y: Tensor) -> Tensor:
    """Restore the (G, n) leading dimensions of x on a layer output y of shape (G·n, …)."""
    return y.view(*x.shape[:2], *y.shape[1:])


def _fold(x: Tensor) -> Tensor:
    """(G, n, *shape) → (G·n, *shape): the batch a layer function takes."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _affine(layer: TracedLayer, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """An affine layer's function with the given weight and bias, on (G, n, *shape)."""
    return _unfold(x, layer.rule.apply(layer.module, _fold(x), weight, bias))


def _fixed(layer: TracedLayer, x: Tensor) -> Tensor:
    """A parameter-free layer on (G, n, *shape)."""
    return _unfold(x, layer.rule.apply(layer.module, _fold(x)))


def _run_reference(run: tuple[TracedLayer, ...], params0: Mapping[str, Tensor], x: Tensor,
                   bias: bool) -> Tensor:
    """The run at θ0: affine (with biases) or linear (without)."""
    for layer in run:
        rule = layer.rule
        if is_affine(rule):
            weight, b = rule.affine_parameters(layer.module, params0, layer.path)
            x = _affine(layer, x, weight, b if bias else None)
        else:
            x = _fixed(layer, x)
    return x


def _run_delta(run: tuple[TracedLayer, ...], params0: Mapping[str, Tensor],
               params1: Mapping[str, Tensor], a0: Tensor, da: Tensor | None, bias: bool
               ) -> Tensor:
    """Δ(run) = run(θ)(a0 + Δa) − run(θ0)(a0) with ΔW formed first at every layer.

    Without ``bias`` it is the linear map ΔW_run a0 + W1_run Δa of the run's linear parts.
    """
    s0, ds = a0, da
    for layer in run:
        rule, module = layer.rule, layer.module
        if is_affine(rule):
            w0, b0 = rule.affine_parameters(module, params0, layer.path)
            w1 = rule.affine_parameters(module, params1, layer.path)[0]
            dw, db = rule.affine_delta(module, params0, params1, layer.path)
            step = _affine(layer, s0, dw, db if bias else None)
            if ds is not None:
                step = step + _affine(layer, ds, w1, None)
            ds = step
            s0 = _affine(layer, s0, w0, b0 if bias else None)
        else:
            s0 = _fixed(layer, s0)
            ds = None if ds is None else _fixed(layer, ds)
    assert ds is not None  # a run holds an affine layer
    return ds


def _run_delta_linear(run: tuple[TracedLayer, ...], params0: Mapping[str, Tensor],
                      params1: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """ΔW_run x: the run's linear difference map (no biases, no incoming difference)."""
    return _run_delta(run, params0, params1, x, None, bias=False)


def _run_moved(run: tuple[TracedLayer, ...], params1: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """The run's linear part at θ (W1, no biases)."""
    return _run_reference(run, params1, x, bias=False)


def _reference_map(step: Step, statistics: Mapping[str, Tensor], x: Tensor, bias: bool
                   ) -> Tensor:
    """A step that is not a run, on the reference side (``bias``: with its constant part)."""
    (layer,) = step
    return layer.rule.expected_reference(layer, x, statistics, offset=bias)


def _delta_map(step: Step, statistics: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """A step that is not a run, on the difference side."""
    (layer,) = step
    return layer.rule.expected_delta(layer, x, statistics)


# ----- reference side: fixed after fit ------------------------------------------------------
def input_factor(cov: Covariance, groups: int) -> tuple[Tensor, Tensor | None]:
    """(L (G, r, d), D (G, d) or ``None``) with C_in = Lᵀ L + diag(D) per component."""
    if isinstance(cov, tuple):
        factor, residual = cov
        return factor.transpose(-1, -2), residual
    if cov.dim() == 2:
        return cov.new_zeros(groups, 0, cov.shape[-1]), cov
    factors = [sampling_factor(c) for c in cov]
    width = max(f.shape[1] for f in factors)
    stacked = torch.stack([F.pad(f, (0, width - f.shape[1])) for f in factors])
    return stacked.transpose(-1, -2), None


def reference_side(steps: list[Step], params0: Mapping[str, Tensor], mean: Tensor,
                   cov: Covariance, statistics: Mapping[str, Tensor],
                   input_shape: tuple[int, ...]) -> dict[str, Any]:
    """What the difference side needs from θ0 and the statistics (computed once).

    Returns:
        ``{"means", "factors", "residual", "shapes"}``: per run, the mean (G, 1, *shape) and
        factor images (G, r, *shape) of its input a0; D (G, *input_shape) or ``None``; and
        the per-example shape entering every step.
    """
    groups = mean.shape[0]
    factor, residual = input_factor(cov, groups)
    a0 = mean.reshape(groups, 1, *input_shape)
    f0 = factor.reshape(groups, factor.shape[1], *input_shape)
    means, factors, shapes = [], [], []
    for step in steps:
        shapes.append(tuple(a0.shape[2:]))
        if is_run(step):
            means.append(a0)
            factors.append(f0)
            a0 = _run_reference(step, params0, a0, bias=True)
            f0 = _run_reference(step, params0, f0, bias=False)
        else:
            a0 = _reference_map(step, statistics, a0, bias=True)
            f0 = _reference_map(step, statistics, f0, bias=False)
    return {"means": means, "factors": factors, "shapes": shapes,
            "residual": None if residual is None else residual.reshape(groups, *input_shape)}


# ----- difference side ----------------------------------------------------------------------
def _pull_back(fn: Callable[[Tensor], Tensor], rows: Tensor, shape: tuple[int, ...]) -> Tensor:
    """rowsᵀ J for the linear map ``fn`` with inputs of ``shape`` (G, k, *in)."""
    pull = vjp(fn, rows.new_zeros(shape))[1]
    return pull(rows)[0]


def delta_side(steps: list[Step], params0: Mapping[str, Tensor], params1: Mapping[str, Tensor],
               reference: dict[str, Any], statistics: Mapping[str, Tensor],
               output_rows: Tensor, input_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Algorithm 2's E[Δz] on the selected outputs (G, k') and tr Cov(Δz) (G,).

    Args:
        steps: :func:`moment_steps` of the traced model.
        params0: θ0 (with buffers).
        params1: θ (with buffers; differentiable).
        reference: :func:`reference_side`.
        statistics: stored gate statistics and max-pool routing frequencies by path.
        output_rows: (k', k) rows of the identity selecting outputs.
        input_shape: shape of one input.
    """
    means, factors, residual = reference["means"], reference["factors"], reference["residual"]
    groups = means[0].shape[0]
    # E[Δa] forwards
    mean_d: Tensor | None = None
    index = 0
    for step in steps:
        if is_run(step):
            mean_d = _run_delta(step, params0, params1, means[index], mean_d, bias=True)
            index += 1
        elif mean_d is not None:
            mean_d = _delta_map(step, statistics, mean_d)
    assert mean_d is not None  # a chain with an affine layer
    output = mean_d.reshape(groups, -1)
    rows_matrix = output_rows.to(output.dtype)
    selected = output @ rows_matrix.T
    # k' rows backwards: M_l = rows of the map from run l's output difference to the outputs
    rows = rows_matrix.expand(groups, *rows_matrix.shape).reshape(
        groups, rows_matrix.shape[0], *mean_d.shape[2:])
    trace = output.new_zeros(groups)
    for position in range(len(steps) - 1, -1, -1):
        step = steps[position]
        if not is_run(step):
            shape = (groups, rows.shape[1], *reference["shapes"][position])
            rows = _pull_back(lambda v, s=step: _delta_map(s, statistics, v), rows, shape)
            continue
        index -= 1
        run, a0, f0 = step, means[index], factors[index]
        in_shape = (groups, rows.shape[1], *a0.shape[2:])

        delta_map = functools.partial(_run_delta_linear, run, params0, params1)

        if f0.shape[1] > 0:  # ‖(M ΔW)(P L)‖²
            projected = delta_map(f0).reshape(groups, f0.shape[1], -1)
            trace = trace + (rows.reshape(groups, rows.shape[1], -1)
                             @ projected.transpose(-1, -2)).pow(2).sum((-1, -2))
        if residual is not None:  # Σ_i D_i ‖(M ΔW P)_{:, i}‖²
            pulled = _pull_back(delta_map, rows, in_shape)
            pulled = _to_input(steps[:position], params0, statistics, pulled, input_shape)
            trace = trace + (residual.unsqueeze(1) * pulled.pow(2)).sum(
                tuple(range(1, pulled.dim())))
        if index > 0:
            rows = _pull_back(lambda v, run=run: _run_moved(run, params1, v), rows, in_shape)
    return selected, trace


def _to_input(steps: list[Step], params0: Mapping[str, Tensor], statistics: Mapping[str, Tensor],
              rows: Tensor, input_shape: tuple[int, ...]) -> Tensor:
    """rowsᵀ P: pull rows at a run's input back through the reference's linear map P."""
    groups, count = rows.shape[:2]

    def prefix(v: Tensor) -> Tensor:
        for step in steps:
            if is_run(step):
                v = _run_reference(step, params0, v, bias=False)
            else:
                v = _reference_map(step, statistics, v, bias=False)
        return v

    return _pull_back(prefix, rows, (groups, count, *input_shape))
