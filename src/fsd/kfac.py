"""K-FAC Laplace penalty (the OSLA baseline): ½ Δθᵀ (A ⊗ G) Δθ per layer.

The Gauss-Newton matrix of the output metric, F = E_x[Jᵀ H J], restricted to one ``nn.Linear``
layer is E_x[ā āᵀ ⊗ Σ_k g_k g_kᵀ], where ā = [a; 1] is the layer's input with the bias
folded in and g_k = ∂(h_k · z)/∂s is the gradient of the k-th factor of H (Σ_k h_k h_kᵀ = H,
:func:`fsd.metrics.output_hessian_factors`) with respect to the layer's output s. K-FAC
(Martens & Grosse 2015) takes the expectation of each Kronecker factor apart::

    F_l ≈ A_l ⊗ G_l,   A_l = E[ā āᵀ],   G_l = E[Σ_k g_k g_kᵀ],

and drops the blocks between layers. With ΔW̄ = [ΔW, Δb] the penalty of one layer is
½ vec(ΔW̄)ᵀ (A ⊗ G) vec(ΔW̄) = ½ tr(ΔW̄ᵀ G ΔW̄ A). Summed over tasks it is the online
structured Laplace approximation (OSLA, Ritter et al. 2018) of the paper's tables.

The factorisation is exact when either factor does not vary with x: a single example, or a
one-layer network under the Euclidean metric (H = I, so G = I). Then the penalty equals the
dense Gauss-Newton quadratic, and for a linear network the exact FSD.

An ``nn.Conv2d`` is a Linear applied to every input patch at each of its T output locations.
Its factors are KFC's (Grosse & Martens 2016), which assume derivatives uncorrelated across
locations and independent of the patches::

    A_l = E[Σ_t ā_t ā_tᵀ],   G_l = E[(1/T) Σ_t Σ_k g_kt g_ktᵀ],

with ā_t = [patch_t; 1] in the order of ``weight.reshape(out_channels, -1)``. They are exact
for a one-layer network under the Euclidean metric (Σ_k g_kt g_kt'ᵀ = δ_tt' I there) and, as
for a Linear, on one example when T = 1. BackPACK's KFLR puts the 1/T on neither factor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from . import distributed
from .estimator import Data, Estimator, iter_batches
from .metrics import check_metric, output_hessian_factors
from .validation import SummaryFormatError, require, require_psd, require_shape


class KFAC(Estimator):
    """Kronecker-factored Gauss-Newton penalty of every ``nn.Linear`` and ``nn.Conv2d`` layer.

    Every parameter of the model must belong to an ``nn.Linear`` (called on (batch, features)
    inputs) or an ``nn.Conv2d`` (on (batch, channels, height, width) inputs, zero padding, one
    group), each called once by the forward; the forward itself may be any graph. Anything
    else raises ``ValueError`` at ``fit``. The factors are the exact expectations over the data
    and over the metric's Hessian factors (EWC's ``fisher="true"``), one backward pass per
    factor and batch; convolutions take KFC's factors (module docstring).

    Args:
        metric: output metric whose Hessian H defines the Gauss-Newton matrix:
            ``"euclidean"`` (H = I), ``"kl"`` (the softmax Fisher) or ``"softmax_euclidean"``.

    The distance is a sum of one term ½ tr(ΔW̄ᵀ G ΔW̄ A) per layer (:meth:`layer_terms`).
    """

    splits_by_layer = True

    def __init__(self, metric: str = "euclidean") -> None:
        super().__init__(metric=check_metric(metric))

    def _layers(self, model: nn.Module) -> dict[str, _LinearLayer]:
        layers: dict[str, _LinearLayer] = {}
        others = []
        for path, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            if type(module) is nn.Linear:
                layers[path] = _LinearLayer(module, path)
            elif type(module) is nn.Conv2d:
                layers[path] = _ConvLayer(module, path)  # refuses what unfold cannot cut
            else:
                others.append(f"{type(module).__name__} at '{path or '<root>'}'")
        if others or not layers:
            raise ValueError("KFAC needs a model whose parameters all belong to nn.Linear or "
                             "nn.Conv2d layers; this one has "
                             f"{', '.join(others) or 'no Linear or Conv2d layer'} "
                             "(EWC, NTK and ExactFSD take any model)")
        return layers

    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        layers = self._layers(model)
        params = {k: v.detach().requires_grad_(True)
                  for k, v in self.reference_parameters().items()}
        buffers = {k[len("buffer0."):]: v for k, v in self._state.items()
                   if k.startswith("buffer0.")}
        # sums over examples, zero-initialised so every rank reduces the same tensors
        inputs_sq = {p: torch.zeros(layer.fan_in + 1, layer.fan_in + 1, dtype=dtype,
                                    device=device) for p, layer in layers.items()}
        grads_sq = {p: torch.zeros(layer.fan_out, layer.fan_out, dtype=dtype, device=device)
                    for p, layer in layers.items()}
        count = 0
        for x, _ in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                 desc="KFAC: factors"):
            seen: dict[str, list[tuple[Tensor, Tensor]]] = {path: [] for path in layers}
            handles = [layer.module.register_forward_hook(_recorder(seen[p]))
                       for p, layer in layers.items()]
            try:
                z = self._select(functional_call(model, {**params, **buffers}, (x,)))
            finally:
                for handle in handles:
                    handle.remove()
            calls = {p: len(v) for p, v in seen.items() if len(v) != 1}
            if calls:
                raise ValueError(f"KFAC needs each layer called once by the forward; calls "
                                 f"per layer: {calls}")
            for path, layer in layers.items():  # first: input_rows checks the input's shape
                rows = layer.input_rows(seen[path][0][0])
                rows = torch.cat([rows, torch.ones_like(rows[:, :1])], dim=1)  # ā = [a; 1]
                inputs_sq[path] += rows.T @ rows
            hs = output_hessian_factors(self.config["metric"], z.detach())
            outputs = [seen[p][0][1] for p in layers]
            for j in range(hs.shape[1]):
                gs = torch.autograd.grad((z * hs[:, j]).sum(), outputs,
                                         retain_graph=j < hs.shape[1] - 1, allow_unused=True)
                for (path, layer), g in zip(layers.items(), gs, strict=True):
                    if g is not None:  # None: the selected outputs do not use this layer
                        grads_sq[path] += layer.grad_gram(g)
            count += x.shape[0]
        sums, count = distributed.sum_tensors(
            {**{f"A:{p}": v for p, v in inputs_sq.items()},
             **{f"G:{p}": v for p, v in grads_sq.items()}}, count)
        for path in layers:
            key = f"{path}." if path else ""
            for factor in "AG":
                # a float32 Gram over millions of patches is symmetric only to round-off,
                # which fsd.load's check can exceed: store the symmetric part
                total = sums[f"{factor}:{path}"]
                self._state[f"kfac.{key}{factor}"] = (total + total.T) / (2 * count)
        self._meta["layers"] = [[path, layer.module.bias is not None]
                                for path, layer in layers.items()]

    def _check_summary(self) -> None:
        layers = self._meta.get("layers")
        if not isinstance(layers, list) or not all(
                isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                and isinstance(e[1], bool) for e in layers):
            raise SummaryFormatError("meta 'layers': expected a list of [path, has_bias]")
        # every parameter belongs to exactly one recorded layer: a layer missing from the
        # list would have its term dropped from the distance
        covered: list[str] = []
        for path, has_bias in layers:
            key = f"{path}." if path else ""
            covered += [f"{key}weight"] + ([f"{key}bias"] if has_bias else [])
        theta0 = sorted(k[len("theta0."):] for k in self._stored if k.startswith("theta0."))
        if sorted(covered) != theta0:
            raise SummaryFormatError(f"meta 'layers': covers the parameters {sorted(covered)}, "
                                     f"the summary holds {theta0}")
        factors = {f"kfac.{path}.{f}" if path else f"kfac.{f}" for path, _ in layers
                   for f in "AG"}
        extra = sorted(k for k in self._stored if k.startswith("kfac.") and k not in factors)
        if extra:
            raise SummaryFormatError(f"field {extra[0]!r}: a factor of no recorded layer")
        for path, _ in layers:
            key = f"{path}." if path else ""
            weight = require(self._stored, f"theta0.{key}weight")
            if weight.dim() not in (2, 4):  # Linear (out, in) or Conv2d (out, in, kh, kw)
                raise SummaryFormatError(f"field 'theta0.{key}weight': shape "
                                         f"{tuple(weight.shape)}, expected 2 or 4 dimensions")
            out_features, in_features = weight.shape[0], weight[0].numel()
            require_shape(self._stored, f"kfac.{key}A", [in_features + 1, in_features + 1])
            require_shape(self._stored, f"kfac.{key}G", [out_features, out_features])
            require_psd(self._stored, f"kfac.{key}A")
            require_psd(self._stored, f"kfac.{key}G")
        if not self._meta.get("layers"):
            raise SummaryFormatError("meta 'layers': no layer recorded")

    def _layer_terms(self, model: nn.Module) -> dict[str, Tensor]:
        theta0 = self.reference_parameters()
        current = dict(model.named_parameters())
        terms = {}
        for path, has_bias in self._meta["layers"]:
            key = f"{path}." if path else ""
            delta = current[f"{key}weight"] - theta0[f"{key}weight"]
            delta = delta.reshape(delta.shape[0], -1)  # a Conv2d's rows in patch order
            bias = (current[f"{key}bias"] - theta0[f"{key}bias"] if has_bias
                    else delta.new_zeros(delta.shape[0]))
            delta = torch.cat([delta, bias.unsqueeze(1)], dim=1)  # ΔW̄ = [ΔW, Δb]
            # ≥ 0 for PSD factors; fsd.load admits eigenvalues down to −(round-off), which
            # with round-off in the products can leave a tiny negative term: clamp it
            terms[path] = 0.5 * _KroneckerQuadratic.apply(
                delta, self._state[f"kfac.{key}G"], self._state[f"kfac.{key}A"])[0].clamp_min(0)
        return terms

    def _distance(self, model: nn.Module) -> Tensor:
        return torch.stack(list(self._layer_terms(model).values())).sum()


class _KroneckerQuadratic(torch.autograd.Function):
    """tr(Dᵀ G D A) for fixed symmetric G and A, with a backward pass that reuses G D A.

    The gradient 2 G D A is the forward's product, so a penalized step multiplies by each
    factor once instead of twice (autograd through ``(G @ D) * (D @ A)`` multiplies by each
    again in the backward pass). Double backward rebuilds the product with a graph, so
    Hessian-vector products stay exact; forward mode has its own rule, and
    ``generate_vmap_rule`` lets ``torch.func`` transforms batch it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(delta: Tensor, g: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        product = g @ delta @ a
        return (product * delta).sum((-1, -2)), product

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor],
                      output: tuple[Tensor, Tensor]) -> None:
        delta, g, a = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(delta, g, a, output[1])
        ctx.save_for_forward(delta, g, a, output[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _unused: Tensor | None
                 ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        delta, g, a, product = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: rebuild the product with a graph
            product = g @ delta @ a
        grad = grad[..., None, None]
        # the factors are summary tensors and rarely need a gradient; when they do, these are
        # d/dG = D A Dᵀ and d/dA = Dᵀ G D (both symmetric)
        grad_g = grad * (delta @ a @ delta.mT) if ctx.needs_input_grad[1] else None
        grad_a = grad * (delta.mT @ g @ delta) if ctx.needs_input_grad[2] else None
        return 2 * grad * product, grad_g, grad_a

    @staticmethod
    def jvp(ctx: Any, tangent_delta: Tensor | None, tangent_g: Tensor | None,
            tangent_a: Tensor | None) -> tuple[Tensor, None]:
        # forward mode (torch.func.jvp, jacfwd, hessian): the same three derivatives
        delta, g, a, product = ctx.saved_tensors
        tangent = torch.zeros_like(product.sum((-1, -2)))
        if tangent_delta is not None:
            tangent = tangent + 2 * (product * tangent_delta).sum((-1, -2))
        if tangent_g is not None:
            tangent = tangent + ((delta @ a @ delta.mT) * tangent_g).sum((-1, -2))
        if tangent_a is not None:
            tangent = tangent + ((delta.mT @ g @ delta) * tangent_a).sum((-1, -2))
        return tangent, None


def _recorder(calls: list[tuple[Tensor, Tensor]]):
    # forward hook: keep the layer's input and output; the rest of the forward gets a copy of
    # the output, so an in-place op after the layer cannot rebase the tensor kept here
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        calls.append((args[0].detach(), output))
        return output.clone()
    return hook


class _LinearLayer:
    """What K-FAC reads from an ``nn.Linear``: one row of ā and of g per example."""

    dims, layout = 2, "(batch, features)"

    def __init__(self, module: nn.Linear | nn.Conv2d, path: str) -> None:
        self.module, self.path = module, path
        self.fan_in, self.fan_out = module.weight[0].numel(), module.weight.shape[0]

    def _check(self, x: Tensor) -> None:
        if x.dim() != self.dims:
            raise ValueError(f"KFAC needs {type(self.module).__name__} at "
                             f"'{self.path or '<root>'}' called on {self.layout} inputs; it "
                             f"got shape {tuple(x.shape)}")

    def input_rows(self, x: Tensor) -> Tensor:
        """The layer's inputs as rows a (without the bias's 1), Σ ā āᵀ summing over them."""
        self._check(x)
        return x

    def grad_gram(self, g: Tensor) -> Tensor:
        """Σ g gᵀ over the batch, g the gradient of the layer's output."""
        return g.T @ g


class _ConvLayer(_LinearLayer):
    """An ``nn.Conv2d``: a Linear on the patch at each of its T output locations (KFC)."""

    dims, layout = 4, "(batch, channels, height, width)"

    def __init__(self, module: nn.Conv2d, path: str) -> None:
        super().__init__(module, path)
        where = f"Conv2d at '{path or '<root>'}'"
        if module.groups != 1 or module.padding_mode != "zeros":
            raise ValueError(f"KFAC needs Conv2d layers with groups=1 and padding_mode='zeros'"
                             f"; {where} has groups={module.groups}, "
                             f"padding_mode={module.padding_mode!r}")
        self.conv = module
        if module.padding == "valid":
            self.padding = (0, 0)
        elif module.padding == "same":
            totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size,
                                                  strict=True)]
            if any(t % 2 for t in totals):  # torch pads one more on one side: unfold cannot
                raise ValueError(f"KFAC cannot take padding='same' with an even kernel extent "
                                 f"({where}); give the padding as numbers")
            self.padding = (totals[0] // 2, totals[1] // 2)
        else:
            self.padding = (int(module.padding[0]), int(module.padding[1]))

    def input_rows(self, x: Tensor) -> Tensor:
        """One row per (example, output location): the patch, in the weight's (C, kh, kw) order."""
        self._check(x)
        patches = F.unfold(x, self.conv.kernel_size, dilation=self.conv.dilation,
                           padding=self.padding, stride=self.conv.stride)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def grad_gram(self, g: Tensor) -> Tensor:
        """Σ over the batch of the mean over output locations of g_t g_tᵀ."""
        locations = g.shape[2] * g.shape[3]
        g = g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])
        return g.T @ g / locations
