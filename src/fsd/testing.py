"""Reference implementations that tests and benchmarks check the library against.

Each one is written directly from the paper's definitions, slowly and densely, and uses none
of the library's own machinery (no :mod:`fsd.model.linearize`, no :mod:`fsd.moments`, no
:mod:`fsd.covariance`), so an error in the library cannot hide in its reference:

- :func:`dense_algorithm2` — BGLN-D, paper Algorithm 2, line by line in float64 with the
  covariances pushed forwards as dense matrices.
- :func:`dense_algorithm2_cnn` — the same for any chain (convolutions, BatchNorm, pooling,
  smooth activations) with every layer as a dense matrix built from torch's own functional
  form, for tiny networks.
- :func:`dense_bgln_cnn` — the exact moments of BGLN (gates' own variance, Cov(a0, Δa) and
  a max-pool's random one-hot routing kept) for any chain, with the joint raw second moments
  of (a0, Δa) as dense matrices, for tiny networks.
- :func:`enumerated_gates` / :func:`enumerated_gate_pairs` — the exact expectation of BGLN's
  ½‖Δz‖² (what BGLN-S estimates and exact-moment BGLN-D computes), by enumerating every
  configuration of the gates of a small network (Bernoulli gates, or any discrete law of a
  smooth activation's gate pairs): with the gates fixed the network is affine in x, so the
  expectation over Gaussian-moment inputs is a closed form.
- :func:`linearized_outputs` — LAFTR's linearized network (paper eqs. 4–7) for one example:
  the reference network θ0 runs as usual; the network θ runs with every ReLU replaced by the
  reference's gate 1{s0 > 0} and every max-pool routed by the reference's argmax, window by
  window.
- :func:`one_point_at_a_time` — PBRF self-influence (:mod:`fsd.uses.influence`) solved by plain
  autograd SGD on a copy of the module, one training point after another: the arithmetic
  that :class:`fsd.uses.influence.PBRF` batches with ``vmap``.

They are slow on purpose; nothing in the library calls them.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from .uses.influence import pointwise_loss


def _leaves(model: nn.Module) -> Iterator[nn.Module]:
    """The leaf layers of (nested) ``nn.Sequential`` containers, in order, repeats included."""
    if isinstance(model, nn.Sequential):
        for child in model:  # iterating a Sequential keeps a module used at two positions
            yield from _leaves(child)
    else:
        yield model


def _linear_layers(model0: nn.Module, model1: nn.Module, gates: int, what: str
                   ) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """Both models' Linear layers, checked to be L each with L − 1 gates between them."""
    linear0 = [m for m in _leaves(model0) if isinstance(m, nn.Linear)]
    linear1 = [m for m in _leaves(model1) if isinstance(m, nn.Linear)]
    if len(linear0) != len(linear1) or gates != len(linear0) - 1:
        raise ValueError(f"{len(linear0)} and {len(linear1)} Linear layers with "
                         f"{gates} {what}: expected L, L and L - 1")
    return linear0, linear1


def _float64(value: Any) -> Tensor:
    return torch.as_tensor(value).to(torch.float64)


def _linear64(layer: nn.Linear) -> tuple[Tensor, Tensor]:
    """A Linear layer's weight and bias in float64 (a zero bias when it has none)."""
    weight = _float64(layer.weight)
    bias = torch.zeros(weight.shape[0], dtype=torch.float64) if layer.bias is None \
        else _float64(layer.bias)
    return weight, bias


def dense_algorithm2(model0: nn.Module, model1: nn.Module, mean: Any, cov: Any,
                     gate_means: Sequence[Any], outputs: Sequence[int] | None = None
                     ) -> Tensor:
    """BGLN-D's ½‖E Δz‖² + ½ tr Cov(Δz) by paper Algorithm 2, dense, in float64.

    Only the models' ``nn.Linear`` layers are read (in order); between consecutive ones the
    network is assumed to have one ReLU, gated by Bernoulli means. Anything parameter-free
    before the first layer (e.g. ``nn.Flatten``) is taken to be absorbed in ``mean``/``cov``.

    Args:
        model0: the reference network θ0.
        model1: the network θ (the result is differentiable in its parameters).
        mean: mean of the (flattened) inputs, shape (d,).
        cov: their covariance, shape (d, d).
        gate_means: Bernoulli means μ of the hidden ReLUs, one (units,) vector per hidden
            layer; for a smooth activation a triple (E[r], E[g], φ(0)): the reference side
            is gated by E[r] and shifted by φ(0), the difference side gated by E[g].
        outputs: restrict Δz to these output units.

    Returns:
        A 0-dim float64 tensor.
    """
    linear0, linear1 = _linear_layers(model0, model1, len(gate_means), "gate vectors")
    e_a0, c_a0 = _float64(mean), _float64(cov)
    e_da, c_da = torch.zeros_like(e_a0), torch.zeros_like(c_a0)
    for index, (l0, l1) in enumerate(zip(linear0, linear1, strict=True)):
        (w0, b0), (w1, b1) = _linear64(l0), _linear64(l1)
        dw, db = w1 - w0, b1 - b0
        e_s0, e_ds = w0 @ e_a0 + b0, dw @ e_a0 + w1 @ e_da + db
        c_s0, c_ds = w0 @ c_a0 @ w0.T, dw @ c_a0 @ dw.T + w1 @ c_da @ w1.T
        if index == len(linear0) - 1:
            if outputs is not None:
                rows = torch.as_tensor(list(outputs), dtype=torch.long)
                e_ds, c_ds = e_ds[rows], c_ds[rows][:, rows]
            return 0.5 * e_ds @ e_ds + 0.5 * torch.trace(c_ds)
        gate = gate_means[index]
        if isinstance(gate, tuple):  # a smooth gate: (E[r], E[g], φ(0))
            r, g, offset = _float64(gate[0]), _float64(gate[1]), float(gate[2])
        else:
            r = g = _float64(gate)
            offset = 0.0
        e_a0, c_a0 = r * e_s0 + offset, torch.outer(r, r) * c_s0
        e_da, c_da = g * e_ds, torch.outer(g, g) * c_ds
    raise ValueError("the models have no nn.Linear layer")


def _dense_layer(module: nn.Module, shape: tuple[int, ...]
                 ) -> tuple[Tensor | None, Tensor | None, tuple[int, ...]]:
    """(matrix, bias, output shape) of one layer on flattened float64 vectors.

    Convolutions and average pools become dense matrices by applying torch's own functional
    form to every basis vector; BatchNorm (evaluation) is a diagonal. Written out by module
    type, independently of :mod:`fsd.model.rules`; ``None`` for the matrix of a layer that is not
    linear (a max-pool or an activation).
    """
    d = int(np.prod(shape))
    basis = torch.eye(d, dtype=torch.float64).reshape(d, *shape)
    if isinstance(module, nn.Linear):
        weight, bias = _linear64(module)
        return weight, bias, (weight.shape[0],)
    if isinstance(module, nn.Conv2d):
        weight = _float64(module.weight)
        out = module._conv_forward(basis, weight, None)  # its own padding_mode too
        bias = torch.zeros(out.shape[1], dtype=torch.float64) if module.bias is None \
            else _float64(module.bias)
        return (out.reshape(d, -1).T, bias.repeat_interleave(out[0, 0].numel()),
                tuple(out.shape[1:]))
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        assert module.running_var is not None and module.running_mean is not None
        scale = 1 / torch.sqrt(_float64(module.running_var) + module.eps)
        if module.affine:
            scale = _float64(module.weight) * scale
        shift = -scale * _float64(module.running_mean)
        if module.affine:
            shift = _float64(module.bias) + shift
        per_unit = d // scale.numel()
        return (torch.diag(scale.repeat_interleave(per_unit)),
                shift.repeat_interleave(per_unit), shape)
    if isinstance(module, nn.AvgPool2d):
        out = torch.nn.functional.avg_pool2d(basis, module.kernel_size, module.stride,
                                             module.padding, module.ceil_mode,
                                             module.count_include_pad, module.divisor_override)
        return out.reshape(d, -1).T, None, tuple(out.shape[1:])
    if isinstance(module, nn.MaxPool2d):
        out = torch.nn.functional.max_pool2d(basis[:1], module.kernel_size, module.stride,
                                             module.padding, module.dilation)
        return None, None, tuple(out.shape[1:])
    if isinstance(module, (nn.Flatten, nn.Dropout, nn.Identity)):
        return torch.eye(d, dtype=torch.float64), None, (d,) if isinstance(
            module, nn.Flatten) else shape
    return None, None, shape


def _routing_matrix(module: nn.MaxPool2d, shape: tuple[int, ...], frequencies: Tensor
                    ) -> Tensor:
    """The expected routing of a max-pool as a dense matrix, window by window.

    Output cell (c, i, j) takes input (c, i·s − p + a·d, j·s − p + b·d) with the frequency of
    kernel position t = a·k + b.
    """
    def pair(v: Any) -> tuple[int, int]:
        return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))

    (kh, kw), (sh, sw) = pair(module.kernel_size), pair(module.stride or module.kernel_size)
    (ph, pw), (dh, dw) = pair(module.padding), pair(module.dilation)
    channels, height, width = shape
    pi = _float64(frequencies)
    out_h, out_w = pi.shape[1:3]
    matrix = torch.zeros(channels * out_h * out_w, channels * height * width,
                         dtype=torch.float64)
    for c, i, j, a, b in itertools.product(range(channels), range(out_h), range(out_w),
                                           range(kh), range(kw)):
        h, w = i * sh - ph + a * dh, j * sw - pw + b * dw
        if 0 <= h < height and 0 <= w < width:
            matrix[(c * out_h + i) * out_w + j, (c * height + h) * width + w] += \
                pi[c, i, j, a * kw + b]
    return matrix


def dense_algorithm2_cnn(model0: nn.Module, model1: nn.Module, input_shape: Sequence[int],
                         mean: Any, cov: Any, gates: Sequence[tuple[Any, Any, float]],
                         routings: Sequence[Any], outputs: Sequence[int] | None = None
                         ) -> Tensor:
    """BGLN-D (paper Algorithm 2) of any chain of layers, with dense matrices, in float64.

    Every layer of the (nested ``nn.Sequential``) models is written as a dense matrix on
    flattened vectors (:func:`_dense_layer`); consecutive affine and parameter-free layers
    are multiplied into one affine map (Algorithm 2 drops Cov(a0, Δa) at gates only), and
    means and covariances are pushed forwards as in :func:`dense_algorithm2`. Activations
    scale the reference side by E[r] (plus φ(0)) and the difference side by E[g]; max-pools
    route both by their expected routing. Feasible only for tiny networks (an 8×8 image).

    Args:
        model0: the reference network θ0.
        model1: the network θ (the result is differentiable in its parameters).
        input_shape: shape of one input.
        mean: (d,) mean of the flattened inputs.
        cov: (d, d) their covariance.
        gates: per activation, in order, (E[r], E[g], φ(0)) over its flattened units (a
            ReLU: (μ, μ, 0)).
        routings: per MaxPool2d, in order, its routing frequencies (C, H', W', k·k).
        outputs: restrict Δz to these output units.

    Returns:
        A 0-dim float64 tensor.
    """
    leaves0, leaves1 = list(_leaves(model0)), list(_leaves(model1))
    shape = tuple(input_shape)
    e_a0, c_a0 = _float64(mean), _float64(cov)
    e_da, c_da = torch.zeros_like(e_a0), torch.zeros_like(c_a0)
    gate_index = pool_index = 0
    run: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # (W0, b0, W1, b1) not yet applied

    def apply_run() -> None:
        nonlocal e_a0, c_a0, e_da, c_da
        w0 = w1 = torch.eye(e_a0.shape[0], dtype=torch.float64)
        b0 = b1 = torch.zeros(e_a0.shape[0], dtype=torch.float64)
        for v0, c0, v1, c1 in run:
            w0, b0, w1, b1 = v0 @ w0, v0 @ b0 + c0, v1 @ w1, v1 @ b1 + c1
        dw, db = w1 - w0, b1 - b0
        e_a0, e_da = w0 @ e_a0 + b0, dw @ e_a0 + w1 @ e_da + db
        c_a0, c_da = w0 @ c_a0 @ w0.T, dw @ c_a0 @ dw.T + w1 @ c_da @ w1.T
        run.clear()

    for m0, m1 in zip(leaves0, leaves1, strict=True):
        matrix0, bias0, out_shape = _dense_layer(m0, shape)
        if matrix0 is not None:  # affine or parameter-free: part of a run
            matrix1, bias1, _ = _dense_layer(m1, shape)
            assert matrix1 is not None
            zero = torch.zeros(matrix0.shape[0], dtype=torch.float64)
            run.append((matrix0, zero if bias0 is None else bias0,
                        matrix1, zero if bias1 is None else bias1))
        else:
            if run:
                apply_run()
            if isinstance(m0, nn.MaxPool2d):
                route = _routing_matrix(m0, shape, routings[pool_index])
                pool_index += 1
                e_a0, e_da = route @ e_a0, route @ e_da
                c_a0, c_da = route @ c_a0 @ route.T, route @ c_da @ route.T
            else:
                r, g, offset = gates[gate_index]
                gate_index += 1
                r, g = _float64(r).reshape(-1), _float64(g).reshape(-1)
                e_a0, c_a0 = r * e_a0 + offset, torch.outer(r, r) * c_a0
                e_da, c_da = g * e_da, torch.outer(g, g) * c_da
        shape = out_shape
    if run:
        apply_run()
    if outputs is not None:
        rows = torch.as_tensor(list(outputs), dtype=torch.long)
        e_da, c_da = e_da[rows], c_da[rows][:, rows]
    return 0.5 * e_da @ e_da + 0.5 * torch.trace(c_da)


def dense_bgln_cnn(model0: nn.Module, model1: nn.Module, input_shape: Sequence[int],
                   mean: Any, cov: Any,
                   gates: Sequence[tuple[Any, Any, Any, Any, Any, float]],
                   routings: Sequence[Any], outputs: Sequence[int] | None = None) -> Tensor:
    """E[½‖Δz‖²] of BGLN on any chain of layers, exactly, with dense matrices, in float64.

    The joint raw second moments of ([a0; 1], Δa) are pushed forwards (no omission): an
    affine run maps them exactly; an activation a0 = r·s0 + φ(0), Δa = g·Δs with
    independent per-unit gate pairs multiplies them by E[r]E[g]ᵀ-style outer products and
    adds the pairs' own (co)variances on the diagonal; a max-pool routes each window by an
    independent random one-hot choice R with E[R] = π, so E[R X Rᵀ] = Π X Πᵀ plus, on the
    diagonal, Σ_p π_p X_pp − (Π X Πᵀ)_ww. Layers are dense matrices as in
    :func:`dense_algorithm2_cnn`. This is what BGLN-S estimates by sampling. Feasible only for
    tiny networks.

    Args:
        model0: the reference network θ0.
        model1: the network θ (the result is differentiable in its parameters).
        input_shape: shape of one input.
        mean: (d,) mean of the flattened inputs.
        cov: (d, d) their covariance.
        gates: per activation, in order, (E[r], E[g], Var r, Cov(r, g), Var g, φ(0)) over
            its flattened units (a ReLU with firing frequencies μ: (μ, μ, v, v, v, 0) with
            v = μ(1 − μ)).
        routings: per MaxPool2d, in order, its routing frequencies (C, H', W', k·k).
        outputs: restrict Δz to these output units.

    Returns:
        A 0-dim float64 tensor.
    """
    leaves0, leaves1 = list(_leaves(model0)), list(_leaves(model1))
    shape = tuple(input_shape)
    m = _float64(mean).reshape(-1)
    d = m.shape[0]
    # raw moments of ã0 = [a0; 1] (d+1, d+1), E[ã0 Δaᵀ] (d+1, d) and E[Δa Δaᵀ] (d, d)
    m00 = torch.zeros(d + 1, d + 1, dtype=torch.float64)
    m00[:d, :d] = _float64(cov) + torch.outer(m, m)
    m00[:d, d] = m00[d, :d] = m
    m00[d, d] = 1.0
    m0d = torch.zeros(d + 1, d, dtype=torch.float64)
    mdd = torch.zeros(d, d, dtype=torch.float64)
    gate_index = pool_index = 0
    run: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []

    def last_row(size: int) -> Tensor:
        """[0 … 0 1] of length size + 1: the constant coordinate."""
        row = torch.zeros(1, size + 1, dtype=torch.float64)
        row[0, size] = 1.0
        return row

    def homogeneous(w: Tensor, b: Tensor) -> Tensor:
        return torch.cat([torch.cat([w, b[:, None]], 1), last_row(w.shape[1])], 0)

    def apply_run() -> None:
        nonlocal m00, m0d, mdd
        size = mdd.shape[0]
        w0 = w1 = torch.eye(size, dtype=torch.float64)
        b0 = b1 = torch.zeros(size, dtype=torch.float64)
        for v0, c0, v1, c1 in run:
            w0, b0, w1, b1 = v0 @ w0, v0 @ b0 + c0, v1 @ w1, v1 @ b1 + c1
        w0t = homogeneous(w0, b0)
        dwt = torch.cat([w1 - w0, (b1 - b0)[:, None]], 1)
        cross = dwt @ m0d @ w1.T
        m0d, mdd = (w0t @ (m00 @ dwt.T + m0d @ w1.T),
                    dwt @ m00 @ dwt.T + cross + cross.T + w1 @ mdd @ w1.T)
        m00 = w0t @ m00 @ w0t.T
        run.clear()

    def routed(route: Tensor, x: Tensor) -> Tensor:
        """E[R X Rᵀ] for one-hot rows R drawn window by window with E[R] = ``route``."""
        mean_part = route @ x @ route.T
        own = route @ torch.diagonal(x)  # Σ_p π_wp X_pp
        return mean_part + torch.diag(own - torch.diagonal(mean_part))

    for l0, l1 in zip(leaves0, leaves1, strict=True):
        matrix0, bias0, out_shape = _dense_layer(l0, shape)
        if matrix0 is not None:
            matrix1, bias1, _ = _dense_layer(l1, shape)
            assert matrix1 is not None
            zero = torch.zeros(matrix0.shape[0], dtype=torch.float64)
            run.append((matrix0, zero if bias0 is None else bias0,
                        matrix1, zero if bias1 is None else bias1))
        else:
            if run:
                apply_run()
            size = mdd.shape[0]
            if isinstance(l0, nn.MaxPool2d):
                route = _routing_matrix(l0, shape, routings[pool_index])
                pool_index += 1
                route_h = torch.block_diag(route, torch.ones(1, 1, dtype=torch.float64))
                top = routed(route, m00[:size, :size])
                m00 = route_h @ m00 @ route_h.T
                m00[:-1, :-1] = top
                top = routed(route, m0d[:size])
                m0d = route_h @ m0d @ route.T
                m0d[:-1] = top
                mdd = routed(route, mdd)
            else:
                er, eg, vr, crg, vg, offset = gates[gate_index]
                gate_index += 1
                er, eg, vr, crg, vg = (_float64(v).reshape(-1) for v in (er, eg, vr, crg, vg))
                gate_h = torch.cat([torch.cat([torch.diag(er), float(offset) * torch.ones(
                    size, 1, dtype=torch.float64)], 1), last_row(size)], 0)
                own00 = vr * torch.diagonal(m00)[:size]
                own0d = crg * torch.diagonal(m0d[:size])
                own_dd = vg * torch.diagonal(mdd)
                m00 = gate_h @ m00 @ gate_h.T
                m00[:size, :size] += torch.diag(own00)
                m0d = gate_h @ m0d * eg
                m0d[:size] += torch.diag(own0d)
                mdd = torch.outer(eg, eg) * mdd + torch.diag(own_dd)
        shape = out_shape
    if run:
        apply_run()
    if outputs is not None:
        rows = torch.as_tensor(list(outputs), dtype=torch.long)
        mdd = mdd[rows][:, rows]
    return 0.5 * torch.trace(mdd)


def enumerated_gates(model0: nn.Module, model1: nn.Module, mean: Any, cov: Any,
                     firing: Sequence[Any], outputs: Sequence[int] | None = None) -> Tensor:
    """E[½‖Δz‖²] of the Bernoulli-gated linear network (BGLN), by enumerating all gates.

    Reads the models' ``nn.Linear`` layers and, between consecutive ones, one ``nn.ReLU`` or
    ``nn.LeakyReLU`` (slope α): unit i's gate is 1 with probability ``firing[l][i]`` and α
    otherwise, independently (:func:`enumerated_gate_pairs` with r = g on two points).

    Args:
        model0: the reference network θ0.
        model1: the network θ (the result is differentiable in its parameters).
        mean: mean of the (flattened) inputs, shape (d,).
        cov: their covariance, shape (d, d).
        firing: per hidden layer, the units' probabilities of the gate 1, (units,) each.
        outputs: restrict Δz to these output units.

    Returns:
        A 0-dim float64 tensor.
    """
    slopes = [float(getattr(m, "negative_slope", 0.0)) for m in _leaves(model0)
              if isinstance(m, (nn.ReLU, nn.LeakyReLU))]
    if len(slopes) != len(firing):
        raise ValueError("expected L Linear layers in each model with one ReLU or LeakyReLU "
                         "and one firing vector between consecutive ones")
    laws = []
    for slope, on in zip(slopes, firing, strict=True):
        on = _float64(on)
        points = torch.tensor([slope, 1.0], dtype=torch.float64).expand(len(on), 2)
        laws.append(GateLaw(points, points, torch.stack([1 - on, on], dim=-1)))
    return enumerated_gate_pairs(model0, model1, mean, cov, laws, outputs)


@dataclass(frozen=True)
class GateLaw:
    """A discrete law of one hidden layer's gate pairs (r, g), a0 = r·s0 + offset, Δa = g·Δs.

    Unit i takes the pair (``reference[i, k]``, ``delta[i, k]``) with probability
    ``probabilities[i, k]``, independently of the other units.
    """

    reference: Tensor
    delta: Tensor
    probabilities: Tensor
    offset: float = 0.0


def enumerated_gate_pairs(model0: nn.Module, model1: nn.Module, mean: Any, cov: Any,
                          laws: Sequence[GateLaw], outputs: Sequence[int] | None = None
                          ) -> Tensor:
    """E[½‖Δz‖²] of a gated linear network with discrete gate pairs, by enumeration.

    Reads the models' ``nn.Linear`` layers; between consecutive ones the activation is
    replaced by the gates of ``laws[l]``. For one configuration the gated network is affine
    in x, Δz = D x + e, so E_x[½‖Δz‖²] = ½ tr(D Σ Dᵀ) + ½‖D m + e‖² with the input mean m
    and covariance Σ; the result is the probability-weighted sum over every configuration
    (Π K_i of them: keep the network small).

    Args:
        model0: the reference network θ0.
        model1: the network θ (the result is differentiable in its parameters).
        mean: mean of the (flattened) inputs, shape (d,).
        cov: their covariance, shape (d, d).
        laws: one :class:`GateLaw` per hidden layer.
        outputs: restrict Δz to these output units.

    Returns:
        A 0-dim float64 tensor.
    """
    linear0, linear1 = _linear_layers(model0, model1, len(laws), "gate laws")
    choices = [range(law.probabilities.shape[-1]) for law in laws
               for _ in range(law.probabilities.shape[0])]
    m, sigma = _float64(mean), _float64(cov)
    d = m.shape[0]
    total = torch.zeros((), dtype=torch.float64)
    for config in itertools.product(*choices):
        weight = torch.ones((), dtype=torch.float64)
        # a0 = A x + c (reference), Δa = D x + e (difference), starting from a0 = x, Δa = 0
        a_map, a_off = torch.eye(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        d_map, d_off = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        start = 0
        for index, (l0, l1) in enumerate(zip(linear0, linear1, strict=True)):
            (w0, b0), (w1, b1) = _linear64(l0), _linear64(l1)
            # Δs = (W1 − W0) a0 + W1 Δa + (b1 − b0)
            d_map, d_off = ((w1 - w0) @ a_map + w1 @ d_map,
                            (w1 - w0) @ a_off + w1 @ d_off + (b1 - b0))
            a_map, a_off = w0 @ a_map, w0 @ a_off + b0
            if index == len(linear0) - 1:
                break
            law = laws[index]
            units = law.probabilities.shape[0]
            pick = torch.tensor(config[start:start + units]).unsqueeze(-1)
            start += units
            weight = weight * _float64(law.probabilities).gather(-1, pick).prod()
            r = _float64(law.reference).gather(-1, pick).squeeze(-1)
            g = _float64(law.delta).gather(-1, pick).squeeze(-1)
            a_map, a_off = r[:, None] * a_map, r * a_off + law.offset
            d_map, d_off = g[:, None] * d_map, g * d_off
        if outputs is not None:
            rows = torch.as_tensor(list(outputs), dtype=torch.long)
            d_map, d_off = d_map[rows], d_off[rows]
        centre = d_map @ m + d_off
        total = total + weight * 0.5 * (torch.trace(d_map @ sigma @ d_map.T) + centre @ centre)
    return total


def _routed_max_pool(a0: Tensor, a1: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Max-pool one example (C, H, W) with kernel = stride = k, window by window.

    ``a0`` is pooled by its maximum, ``a1`` taken at the reference's argmax (the first
    occurrence of the maximum).
    """
    c, h, w = a0.shape
    out0 = a0.new_empty(c, h // k, w // k)
    out1 = a1.new_empty(c, h // k, w // k)
    for ch in range(c):
        for i in range(h // k):
            for j in range(w // k):
                win0 = a0[ch, i * k:(i + 1) * k, j * k:(j + 1) * k].reshape(-1)
                win1 = a1[ch, i * k:(i + 1) * k, j * k:(j + 1) * k].reshape(-1)
                best = int(torch.argmax(win0))  # torch returns the first maximal index
                out0[ch, i, j], out1[ch, i, j] = win0[best], win1[best]
    return out0, out1


def linearized_outputs(model0: nn.Module, model1: nn.Module, x: Tensor
                       ) -> tuple[Tensor, Tensor]:
    """LAFTR's linearized forward pass for one example (paper eqs. 4–7).

    The linearized network differs from the network θ only at the nonlinearities, so Linear,
    Conv2d, AvgPool2d and Flatten layers are each network's own modules; every ReLU becomes
    its gate 1{s0 > 0} at the reference, every MaxPool2d (kernel = stride, no padding) takes
    the reference's argmax window by window, and Dropout and Identity are the identity
    (evaluation). Anything else raises ``NotImplementedError``.

    Args:
        model0: the reference network θ0 (nested ``nn.Sequential`` containers are walked).
        model1: the network θ, same architecture.
        x: one input, without a batch dimension.

    Returns:
        ``(z0, z1)``: the reference outputs f(x, θ0) and the linearized network's outputs.
    """
    a0, a1 = x[None], x[None]
    for l0, l1 in zip(_leaves(model0), _leaves(model1), strict=True):
        if type(l0) is not type(l1):
            raise ValueError(f"the architectures differ: {type(l0).__name__} and "
                             f"{type(l1).__name__}")
        if isinstance(l0, (nn.Linear, nn.Conv2d, nn.AvgPool2d, nn.Flatten)):
            a0, a1 = l0(a0), l1(a1)
        elif isinstance(l0, nn.ReLU):
            # a1 = relu(s0) + 1{s0 > 0}(s1 − s0): the ReLU replaced by its gate at the reference
            s0, s1 = a0, a1
            a0 = torch.clamp(s0, min=0)
            a1 = torch.clamp(s0, min=0) + (s0 > 0).to(s0.dtype) * (s1 - s0)
        elif isinstance(l0, nn.MaxPool2d):
            k = l0.kernel_size
            if not (isinstance(k, int) and l0.stride in (k, (k, k)) and l0.padding == 0
                    and l0.dilation == 1 and not l0.ceil_mode):
                raise NotImplementedError(f"MaxPool2d other than kernel = stride: {l0}")
            o0, o1 = _routed_max_pool(a0[0], a1[0], k)
            a0, a1 = o0[None], o1[None]
        elif isinstance(l0, (nn.Dropout, nn.Identity)):
            continue
        else:
            raise NotImplementedError(f"no reference for {type(l0).__name__}")
    return a0[0], a1[0]


def one_point_at_a_time(model: nn.Module, term: Callable[[nn.Module], Tensor], n: int,
                        x: Tensor, y: Tensor, *, damping: float, steps: int, lr: float,
                        point_term: bool) -> np.ndarray:
    """Squared-error PBRF self-influence of each point (x[i], y[i]), one solve after another.

    Each solve copies the module, minimizes
    −(1/n)·L(f(x_i, θ), y_i) + term(θ) + (λ/2)‖θ − θ0‖² (+ (1/2n)‖f(x_i, θ) − f(x_i, θ0)‖²
    with ``point_term``) by ``steps`` steps of plain SGD (autograd, parameters updated in
    place), and scores L(f(x_i, θ₋), y_i) − L(f(x_i, θ0), y_i). The term is ``reset()``
    before every solve when it has that method, as :class:`fsd.uses.influence.PBRF` does.

    Args:
        model: the trained network θ0 (not modified).
        term: the distance term D, ``term(module) -> 0-dim tensor``.
        n: the training-set size N.
        x: the points' inputs, (B, ...).
        y: their targets, (B, k).
        damping: λ.
        steps: SGD steps per point.
        lr: SGD learning rate.
        point_term: add the removed point's own exact term.

    Returns:
        The B scores, float64.
    """
    scores = []
    for i in range(x.shape[0]):
        work = copy.deepcopy(model)
        theta0 = [p.detach().clone() for p in work.parameters()]
        xi, yi = x[i:i + 1], y[i:i + 1]
        with torch.no_grad():
            reference = work(xi)
            before = pointwise_loss("squared", reference, yi).sum()
        reset = getattr(term, "reset", None)
        if reset is not None:
            reset()
        for _ in range(steps):
            out = work(xi)
            value = (-pointwise_loss("squared", out, yi).sum() / n + term(work)
                     + 0.5 * damping * sum((p - p0).pow(2).sum()
                                           for p, p0 in zip(work.parameters(), theta0,
                                                            strict=True)))
            if point_term:
                value = value + 0.5 * (out - reference).pow(2).sum() / n
            grads = torch.autograd.grad(value, list(work.parameters()))
            with torch.no_grad():
                for p, g in zip(work.parameters(), grads, strict=True):
                    p.sub_(lr * g)
        with torch.no_grad():
            scores.append(float(pointwise_loss("squared", work(xi), yi).sum() - before))
    return np.array(scores, dtype=np.float64)
