"""BGLN-D (paper Algorithm 2) on convolutional networks, without (C·H·W)² covariances.

The MLP path (:func:`fsd.interpreter.reference_moments` / :func:`~fsd.interpreter.delta_moments`)
pushes o × o covariances forwards. A convolutional layer's o = C·H·W makes that impossible
at image sizes (32·32·32 units: a 4 GB matrix per layer), so here every covariance stays in
the factored form of the input, C_in = L Lᵀ + diag(D), and every map is applied as the
layer's own operation (a convolution, never its dense matrix):

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
then Linear) are one affine map, as in the MLP path. A MaxPool2d is treated as Algorithm 2
treats a gate: its routing is replaced by its expectation — each window takes each of its
positions with the frequency that position was the window's argmax on the data
(:func:`routing_statistics`), applied to means and factors alike. With MLPs the result is
the MLP path's, to round-off; on a tiny CNN it equals a dense transcription
(:func:`fsd.testing.dense_algorithm2_cnn`).

Cost per evaluation: r images through ΔW at every run, and for a diagonal part D, k rows
pulled back from every run to the input (Σ_l l backward passes).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vjp
from torch.nn.modules.utils import _pair

from .covariance import Covariance, sampling_factor
from .interpreter import TracedLayer

Step = tuple[str, tuple[TracedLayer, ...]]
"""``("run", layers)`` for a run of affine (and parameter-free) layers holding an affine one;
``("gate" | "maxpool" | "fixed", (layer,))`` otherwise."""


def moment_steps(layers: list[TracedLayer]) -> list[Step]:
    """The chain grouped as Algorithm 2 walks it: runs of affine layers, gates, max-pools."""
    steps: list[Step] = []
    segment: list[TracedLayer] = []

    def close() -> None:
        if any(layer.rule.kind == "affine" for layer in segment):
            steps.append(("run", tuple(segment)))
        else:
            steps.extend(("fixed", (layer,)) for layer in segment)
        segment.clear()

    for layer in layers:
        if layer.rule.kind in ("affine", "fixed"):
            segment.append(layer)
        else:
            close()
            steps.append((layer.rule.kind, (layer,)))
    close()
    return steps


# ----- max-pool routing ----------------------------------------------------------------------
def _pool_geometry(module: nn.MaxPool2d) -> tuple[tuple[int, int], ...]:
    kernel, stride = _pair(module.kernel_size), _pair(module.stride or module.kernel_size)
    return kernel, stride, _pair(module.padding), _pair(module.dilation)


def routing_statistics(module: nn.MaxPool2d, x: Tensor) -> Tensor:
    """Per example, which position of each window is its argmax: one-hot (n, C, H', W', k·k).

    Taken from ``max_pool2d``'s own indices, so ties resolve as the pooling itself does.
    """
    kernel, stride, padding, dilation = _pool_geometry(module)
    _, index = F.max_pool2d(x.detach(), kernel, stride, padding, dilation, module.ceil_mode,
                            return_indices=True)
    width = x.shape[-1]
    row, column = index // width, index % width
    out_h, out_w = index.shape[-2:]
    top = torch.arange(out_h, device=x.device) * stride[0] - padding[0]
    left = torch.arange(out_w, device=x.device) * stride[1] - padding[1]
    offset = ((row - top[:, None]) // dilation[0]) * kernel[1] + (column - left) // dilation[1]
    return F.one_hot(offset, kernel[0] * kernel[1]).to(torch.float64)


def expected_routing(module: nn.MaxPool2d, x: Tensor, frequencies: Tensor) -> Tensor:
    """The max-pool with each window's routing replaced by its expectation (linear in x).

    Args:
        module: the MaxPool2d.
        x: (G, n, C, H, W), G mixture components.
        frequencies: (G, C, H', W', k·k) routing frequencies (each window's sum to 1).

    Returns:
        (G, n, C, H', W'): Σ_t π[…, t] · x[window position t].
    """
    kernel, stride, padding, dilation = _pool_geometry(module)
    groups, n, channels = x.shape[:3]
    windows = F.unfold(x.reshape(groups * n, *x.shape[2:]), kernel, dilation, padding, stride)
    out_h, out_w = frequencies.shape[2:4]
    windows = windows.view(groups, n, channels, kernel[0] * kernel[1], out_h, out_w)
    weights = frequencies.permute(0, 1, 4, 2, 3).unsqueeze(1)  # (G, 1, C, k·k, H', W')
    return (windows * weights).sum(3)


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


def _per_group(statistic: Tensor, x: Tensor) -> Tensor:
    """A per-component (G, *units) statistic broadcast against x (G, n, *units)."""
    return statistic.unsqueeze(1).to(x.dtype)


def _run_reference(run: tuple[TracedLayer, ...], params0: Mapping[str, Tensor], x: Tensor,
                   bias: bool) -> Tensor:
    """The run at θ0: affine (with biases) or linear (without)."""
    for layer in run:
        if layer.rule.kind == "affine":
            weight, b = layer.rule.affine_parameters(layer.module, params0, layer.path)
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
        if rule.kind == "affine":
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


def _gate_means(layer: TracedLayer, statistics: Mapping[str, Tensor]) -> tuple[Tensor, Tensor,
                                                                              float]:
    moments = layer.rule.gate_moments(layer.module, statistics[layer.path])
    return moments.reference_mean, moments.delta_mean, moments.offset


def _map(step: Step, statistics: Mapping[str, Tensor], x: Tensor, side: str, bias: bool
         ) -> Tensor:
    """A gate, max-pool or parameter-free step, on one side of the network.

    ``side``: ``"reference"`` (gates scale by E[r]) or ``"delta"`` (by E[g]); ``bias`` adds a
    smooth gate's φ(0) (means only).
    """
    kind, (layer,) = step
    if kind == "gate":
        r, g, offset = _gate_means(layer, statistics)
        if side == "delta":
            return x * _per_group(g, x)
        return x * _per_group(r, x) + (offset if bias else 0.0)
    if kind == "maxpool":
        return expected_routing(layer.module, x, statistics[layer.path].to(x.dtype))  # type: ignore[arg-type]
    return _fixed(layer, x)


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
        if step[0] == "run":
            means.append(a0)
            factors.append(f0)
            a0 = _run_reference(step[1], params0, a0, bias=True)
            f0 = _run_reference(step[1], params0, f0, bias=False)
        else:
            a0 = _map(step, statistics, a0, "reference", bias=True)
            f0 = _map(step, statistics, f0, "reference", bias=False)
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
        if step[0] == "run":
            mean_d = _run_delta(step[1], params0, params1, means[index], mean_d, bias=True)
            index += 1
        elif mean_d is not None:
            mean_d = _map(step, statistics, mean_d, "delta", bias=False)
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
        if step[0] != "run":
            shape = (groups, rows.shape[1], *reference["shapes"][position])
            rows = _pull_back(lambda v, s=step: _map(s, statistics, v, "delta", bias=False),
                              rows, shape)
            continue
        index -= 1
        run, a0, f0 = step[1], means[index], factors[index]
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
            if step[0] == "run":
                v = _run_reference(step[1], params0, v, bias=False)
            else:
                v = _map(step, statistics, v, "reference", bias=False)
        return v

    return _pull_back(prefix, rows, (groups, count, *input_shape))
