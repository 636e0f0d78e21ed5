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
An ``nn.Conv1d`` is the one-dimensional case: T output positions, patches of (C, k).

Every other parameter tensor p — of a ``LayerNorm``, an ``Embedding``, attention, a recurrent
layer, a parameter read directly in ``forward`` (a positional embedding), a parametrized
layer, or a Linear or convolution that K-FAC cannot factor (called other than once, on
inputs of another rank, grouped or non-zero-padded convolutions) — gets a diagonal
Gauss–Newton block: the diagonal of F restricted to p,

    D_p = E_x[Σ_k (J_pᵀ h_k)²],

taken with the same exact Hessian factors h_k as G, from per-example gradients
(:func:`fsd.model.autodiff.squared_gradients`). Its penalty is ½ Σ D_p ⊙ Δp², EWC's form; the
blocks between parameters are dropped as between layers.

A block measures what moves: the model's registered parameters (``named_parameters``), which
θ0 and Δθ are. A layer is factored only when its ``weight`` and ``bias`` are its own
registered parameters. ``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``)
registers ``parametrizations.weight.original*``; the hook-based ``torch.nn.utils.weight_norm``,
``spectral_norm`` and ``prune`` delete ``weight`` and recompute it as a plain attribute in a
forward pre-hook from ``weight_g`` and ``weight_v``, ``weight_orig``, or ``weight_orig`` and a
``weight_mask`` buffer. Either way the layer's registered parameters (its ``bias`` with them)
get diagonal blocks, taken through the reparametrization.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from ..metrics import check_metric, output_hessian_factors
from ..model import autodiff, support
from ..statistics import distributed
from ..validation import (
    SummaryFormatError,
    require,
    require_nonnegative,
    require_psd,
    require_shape,
)
from . import probe
from .base import Estimator
from .batches import Data, iter_batches

_DIAGONAL = "kfac_diag."  # the prefix of a diagonal block's field, then the parameter's name


class KFAC(Estimator):
    """Kronecker-factored Gauss-Newton penalty; a diagonal block for every other parameter.

    Each ``nn.Linear`` called once on (batch, features) inputs and each ``nn.Conv1d`` /
    ``nn.Conv2d`` called once on (batch, channels, *spatial) inputs with zero padding and
    one group gets a Kronecker block A ⊗ G (convolutions: KFC's factors, module docstring).
    Every other parameter tensor — LayerNorm, Embedding, attention, recurrent layers,
    positional parameters, those Linear and convolution layers, and layers whose weight is
    not their own registered parameter (``weight_norm``, ``spectral_norm``, ``prune``: their
    ``weight_g``, ``weight_v``, ``weight_orig`` and ``bias``) — gets the diagonal of its
    Gauss–Newton block (:attr:`diagonal_parameters`). The forward itself may be any graph.
    The factors are the exact expectations over the data and over the metric's Hessian
    factors (EWC's ``fisher="true"``), one backward pass per factor and batch, plus one
    per-example gradient pass per batch when there are diagonal blocks.

    Args:
        metric: output metric whose Hessian H defines the Gauss-Newton matrix:
            ``"euclidean"`` (H = I), ``"kl"`` (the softmax Fisher) or ``"softmax_euclidean"``.

    The distance is a sum of one term ½ tr(ΔW̄ᵀ G ΔW̄ A) per Kronecker layer and one term
    ½ Σ D ⊙ Δp² per module holding diagonal parameters (:meth:`layer_terms`).
    """

    splits_by_layer = True

    def __init__(self, metric: str = "euclidean") -> None:
        super().__init__(metric=check_metric(metric))

    @property
    def diagonal_parameters(self) -> list[str]:
        """The parameters with a diagonal Gauss–Newton block (the others are in Kronecker ones)."""
        self.require_fitted()
        return list(self._meta.get("diagonal", []))

    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        with autodiff.gradients_of_the_forward("KFAC"):
            self._fit_from_gradients(model, data, dtype=dtype, device=device, progress=progress)

    def _fit_from_gradients(self, model: nn.Module, data: Data | None, *, dtype: torch.dtype,
                            device: torch.device, progress: bool) -> None:
        params = {k: v.detach().requires_grad_(True)
                  for k, v in self.reference_parameters().items()}
        # a block covers parameters of θ0 by name: a layer whose weight or bias is not one
        # (a hook computes it) leaves the parameters it does hold to diagonal blocks
        candidates = {p: layer for p, layer in _kronecker_candidates(model).items()
                      if all(name in params for name in layer.names())}
        layers: dict[str, _LinearLayer] | None = None  # the Kronecker layers, from batch 1
        buffers = {k[len("buffer0."):]: v for k, v in self._state.items()
                   if k.startswith("buffer0.")}
        inputs_sq: dict[str, Tensor] = {}
        grads_sq: dict[str, Tensor] = {}
        diagonal: dict[str, Tensor] = {}
        looped = False  # vmap could not batch the model: per-example loop from then on
        count = 0
        for x, _ in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                 desc="KFAC: factors"):
            if "probe.x" not in self._state and x.shape[0]:  # distance's check of the function
                probe.record(self._state, model, {**params, **buffers}, x)
            hooked = candidates if layers is None else layers
            seen: dict[str, list[tuple[Tensor, Tensor]]] = {path: [] for path in hooked}
            handles = [layer.module.register_forward_hook(_recorder(seen[p]))
                       for p, layer in hooked.items()]
            try:
                z = self._select(functional_call(model, {**params, **buffers}, (x,)))
            finally:
                for handle in handles:
                    handle.remove()
            if layers is None:
                # the first batch decides: a layer called once on inputs of its rank is
                # factored, any other gets diagonal blocks
                layers = {p: layer for p, layer in candidates.items()
                          if len(seen[p]) == 1 and seen[p][0][0].dim() == layer.dims}
                # sums over examples, zero-initialised so every rank reduces the same tensors
                inputs_sq = {p: torch.zeros(layer.fan_in + 1, layer.fan_in + 1, dtype=dtype,
                                            device=device) for p, layer in layers.items()}
                grads_sq = {p: torch.zeros(layer.fan_out, layer.fan_out, dtype=dtype,
                                           device=device) for p, layer in layers.items()}
                factored = {name for p, layer in layers.items() for name in layer.names()}
                diagonal = {k: torch.zeros_like(v, dtype=torch.float64)
                            for k, v in params.items() if k not in factored}
            calls = {p: len(seen[p]) for p in layers if len(seen[p]) != 1}
            if calls:
                raise ValueError(f"KFAC needs each layer called once by the forward; calls "
                                 f"per layer: {calls}")
            for path, layer in layers.items():  # first: input_rows checks the input's shape
                rows = layer.input_rows(seen[path][0][0])
                rows = torch.cat([rows, torch.ones_like(rows[:, :1])], dim=1)  # ā = [a; 1]
                inputs_sq[path] += rows.T @ rows
            hs = output_hessian_factors(self.config["metric"], z.detach())
            outputs = [seen[p][0][1] for p in layers]
            if outputs:
                for j in range(hs.shape[1]):
                    gs = torch.autograd.grad((z * hs[:, j]).sum(), outputs,
                                             retain_graph=j < hs.shape[1] - 1,
                                             allow_unused=True)
                    for (path, layer), g in zip(layers.items(), gs, strict=True):
                        if g is not None:  # None: the selected outputs do not use this layer
                            grads_sq[path] += layer.grad_gram(g)
            if diagonal:
                batch, looped = self._diagonal(model, params, buffers, list(diagonal), x, hs,
                                               looped)
                for k in diagonal:
                    diagonal[k] += batch[k]
            count += x.shape[0]
        assert layers is not None  # iter_batches raises for data without an example
        sums, count = distributed.sum_tensors(
            {**{f"A:{p}": v for p, v in inputs_sq.items()},
             **{f"G:{p}": v for p, v in grads_sq.items()},
             **{f"D:{k}": v for k, v in diagonal.items()}}, count)
        probe.share_rank_zeros(self._state)
        for path in layers:
            key = f"{path}." if path else ""
            for factor in "AG":
                # a float32 Gram over millions of patches is symmetric only to round-off,
                # which fsd.load's check can exceed: store the symmetric part
                total = sums[f"{factor}:{path}"]
                self._state[f"kfac.{key}{factor}"] = (total + total.T) / (2 * count)
        for name in diagonal:
            self._state[f"{_DIAGONAL}{name}"] = (sums[f"D:{name}"] / count).to(dtype)
        self._meta["layers"] = [[path, layer.module.bias is not None]
                                for path, layer in layers.items()]
        if diagonal:  # absent from summaries with Kronecker blocks only, as before
            self._meta["diagonal"] = list(diagonal)

    def _diagonal(self, model: nn.Module, params: dict[str, Tensor],
                  buffers: dict[str, Tensor], names: list[str], x: Tensor, hs: Tensor,
                  looped: bool) -> tuple[dict[str, Tensor], bool]:
        """Σ over the batch of Σ_k (J_pᵀ h_k)² for the diagonal parameters p (float64)."""
        fixed = {k: v.detach() for k, v in params.items()}
        select = self._select

        def forward(p: dict[str, Tensor], x: Tensor) -> Tensor:
            return select(functional_call(model, {**fixed, **p, **buffers}, (x,)))

        try:
            return autodiff.squared_gradients(forward, {k: fixed[k] for k in names}, x, hs,
                                              16, loop=looped)
        except Exception as error:  # the per-example loop failed too: the model's forward
            use = support.advice(support.KFAC, support.Feature.NO_PER_EXAMPLE_GRADIENTS)
            raise ValueError(f"KFAC cannot take per-example gradients of this model's "
                             f"parameters {names[:3]} for their diagonal blocks "
                             f"({autodiff.one_line(error)}); {use}") from None

    def _check_summary(self) -> None:
        layers = self._meta.get("layers")
        if not isinstance(layers, list) or not all(
                isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                and isinstance(e[1], bool) for e in layers):
            raise SummaryFormatError("meta 'layers': expected a list of [path, has_bias]")
        diagonal = self._meta.get("diagonal", [])  # absent: a summary of Kronecker blocks only
        if not isinstance(diagonal, list) or not all(isinstance(n, str) for n in diagonal):
            raise SummaryFormatError("meta 'diagonal': expected a list of parameter names")
        # every parameter belongs to exactly one recorded block: a parameter missing from the
        # lists would have its term dropped from the distance
        covered: list[str] = list(diagonal)
        theta0 = sorted(k[len("theta0."):] for k in self._stored if k.startswith("theta0."))
        for path, has_bias in layers:
            key = f"{path}." if path else ""
            names = [f"{key}weight"] + ([f"{key}bias"] if has_bias else [])
            missing = [name for name in names if name not in theta0]
            if missing:
                # what KFAC wrote before it left layers whose weight a forward pre-hook
                # computes (torch.nn.utils.weight_norm, spectral_norm, prune) to diagonal
                # blocks: their distance raised KeyError, so no penalty was ever taken
                raise SummaryFormatError(
                    f"meta 'layers': the Kronecker block of '{path or '<root>'}' covers "
                    f"{missing[0]!r}, which is not a parameter of the summary's model (a "
                    f"weight that a hook computes, as weight_norm, spectral_norm and prune "
                    f"do?); refit it with this version of KFAC")
            covered += names
        if sorted(covered) != theta0:
            raise SummaryFormatError(f"meta 'layers' and 'diagonal': cover the parameters "
                                     f"{sorted(covered)}, the summary holds {theta0}")
        factors = {f"kfac.{path}.{f}" if path else f"kfac.{f}" for path, _ in layers
                   for f in "AG"}
        extra = sorted(k for k in self._stored if k.startswith("kfac.") and k not in factors)
        if extra:
            raise SummaryFormatError(f"field {extra[0]!r}: a factor of no recorded layer")
        blocks = {f"{_DIAGONAL}{name}" for name in diagonal}
        extra = sorted(k for k in self._stored if k.startswith(_DIAGONAL) and k not in blocks)
        if extra:
            raise SummaryFormatError(f"field {extra[0]!r}: the block of no diagonal parameter")
        for path, _ in layers:
            key = f"{path}." if path else ""
            weight = require(self._stored, f"theta0.{key}weight")
            # Linear (out, in), Conv1d (out, in, k) or Conv2d (out, in, kh, kw)
            if weight.dim() not in (2, 3, 4):
                raise SummaryFormatError(f"field 'theta0.{key}weight': shape "
                                         f"{tuple(weight.shape)}, expected 2 to 4 dimensions")
            out_features, in_features = weight.shape[0], weight[0].numel()
            require_shape(self._stored, f"kfac.{key}A", [in_features + 1, in_features + 1])
            require_shape(self._stored, f"kfac.{key}G", [out_features, out_features])
            require_psd(self._stored, f"kfac.{key}A")
            require_psd(self._stored, f"kfac.{key}G")
        for name in diagonal:
            require_shape(self._stored, f"{_DIAGONAL}{name}",
                          list(self._stored[f"theta0.{name}"].shape))
            require_nonnegative(self._stored, f"{_DIAGONAL}{name}")
        if not layers and not diagonal:
            raise SummaryFormatError("meta 'layers': no layer recorded")

    def _layer_terms(self, model: nn.Module) -> dict[str, Tensor]:
        # same parameters, another function (an activation swapped) would read 0 at θ0
        probe.check_probe(self._cache, model, self._state, self.reference_state)
        theta0 = self.reference_parameters()
        current = dict(model.named_parameters())
        terms = {}
        for path, has_bias in self._meta["layers"]:
            key = f"{path}." if path else ""
            delta = current[f"{key}weight"] - theta0[f"{key}weight"]
            delta = delta.reshape(delta.shape[0], -1)  # a convolution's rows in patch order
            bias = (current[f"{key}bias"] - theta0[f"{key}bias"] if has_bias
                    else delta.new_zeros(delta.shape[0]))
            delta = torch.cat([delta, bias.unsqueeze(1)], dim=1)  # ΔW̄ = [ΔW, Δb]
            # ≥ 0 for PSD factors; fsd.load admits eigenvalues down to −(round-off), which
            # with round-off in the products can leave a tiny negative term: clamp it
            terms[path] = 0.5 * _KroneckerQuadratic.apply(
                delta, self._state[f"kfac.{key}G"], self._state[f"kfac.{key}A"])[0].clamp_min(0)
        for name in self._meta.get("diagonal", []):
            path = name.rpartition(".")[0]  # the module that holds the parameter
            term = 0.5 * (self._state[f"{_DIAGONAL}{name}"]
                          * (current[name] - theta0[name]).pow(2)).sum()
            terms[path] = terms[path] + term if path in terms else term
        return terms

    def _distance(self, model: nn.Module) -> Tensor:
        self._warn_moved_buffers(model, support.KFAC)
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


def _kronecker_candidates(model: nn.Module) -> dict[str, _LinearLayer]:
    """The layers K-FAC may factor, by path: Linear, Conv1d and Conv2d that unfold can cut.

    Whether each is called once, on inputs of its rank, is seen on the first batch.
    """
    layers: dict[str, _LinearLayer] = {}
    for path, module in model.named_modules():
        if not _holds_its_parameters(module):
            continue  # a hook computes its weight or bias: diagonal blocks for what it holds
        if type(module) is nn.Linear:
            layers[path] = _LinearLayer(module, path)
        elif type(module) in (nn.Conv1d, nn.Conv2d):
            padding = _unfold_padding(module)  # type: ignore[arg-type]
            if padding is not None:
                layers[path] = _ConvLayer(module, path, padding)  # type: ignore[arg-type]
    return layers


def _holds_its_parameters(module: nn.Module) -> bool:
    """Whether ``module.weight`` and ``module.bias`` are its own registered parameters.

    A Kronecker block covers ``<path>.weight`` and ``<path>.bias``, the names θ0 and Δθ are
    read under. The hook-based ``torch.nn.utils.weight_norm``, ``spectral_norm`` and ``prune``
    delete the registered ``weight`` (or ``bias``) and recompute a plain tensor attribute of
    that name in a forward pre-hook from ``weight_g`` / ``weight_v``, ``weight_orig`` (and a
    ``weight_mask`` buffer): what moves is those parameters, which get diagonal blocks.
    (``torch.nn.utils.parametrize`` changes the module's class, so it is never a candidate.)
    """
    registered = module._parameters
    # "bias" is registered as None for bias=False, and absent when a hook computes it
    return registered.get("weight") is not None and "bias" in registered


def _unfold_padding(module: nn.Conv1d | nn.Conv2d) -> tuple[int, ...] | None:
    """The zero padding on each side that unfold takes, or ``None`` if it cannot cut patches.

    Grouped convolutions, other padding modes, and ``padding="same"`` with an even kernel
    extent (torch pads one more on one side) get diagonal blocks instead.
    """
    if module.groups != 1 or module.padding_mode != "zeros":
        return None
    if module.padding == "valid":
        return (0,) * len(module.kernel_size)
    if module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
        if any(t % 2 for t in totals):
            return None
        return tuple(t // 2 for t in totals)
    return tuple(int(p) for p in module.padding)


class _LinearLayer:
    """What K-FAC reads from an ``nn.Linear``: one row of ā and of g per example."""

    dims = 2

    def __init__(self, module: nn.Linear | nn.Conv1d | nn.Conv2d, path: str) -> None:
        self.module, self.path = module, path
        self.fan_in, self.fan_out = module.weight[0].numel(), module.weight.shape[0]

    def names(self) -> list[str]:
        """The names of the parameters this layer's block covers."""
        key = f"{self.path}." if self.path else ""
        return [f"{key}weight"] + ([f"{key}bias"] if self.module.bias is not None else [])

    def _check(self, x: Tensor) -> None:
        if x.dim() != self.dims:
            raise ValueError(f"KFAC factored {type(self.module).__name__} at "
                             f"'{self.path or '<root>'}' on inputs of {self.dims} dimensions; "
                             f"a later batch gave it shape {tuple(x.shape)}")

    def input_rows(self, x: Tensor) -> Tensor:
        """The layer's inputs as rows a (without the bias's 1), Σ ā āᵀ summing over them."""
        self._check(x)
        return x

    def grad_gram(self, g: Tensor) -> Tensor:
        """Σ g gᵀ over the batch, g the gradient of the layer's output."""
        return g.T @ g


class _ConvLayer(_LinearLayer):
    """An ``nn.Conv2d`` or ``nn.Conv1d``: a Linear on the patch at each of its T output locations.

    A Conv1d's patches are cut as a Conv2d's of height 1 (KFC's factors either way).
    """

    def __init__(self, module: nn.Conv1d | nn.Conv2d, path: str,
                 padding: tuple[int, ...]) -> None:
        super().__init__(module, path)
        self.conv = module
        self.dims = module.weight.dim()  # (batch, channels, *spatial) inputs
        flat = self.dims == 3  # Conv1d: unfold a height-1 image
        self.kernel = (1, *module.kernel_size) if flat else tuple(module.kernel_size)
        self.dilation = (1, *module.dilation) if flat else tuple(module.dilation)
        self.stride = (1, *module.stride) if flat else tuple(module.stride)
        self.padding = (0, *padding) if flat else padding

    def input_rows(self, x: Tensor) -> Tensor:
        """One row per (example, output location): the patch, in the weight's (C, k…) order."""
        self._check(x)
        if self.dims == 3:
            x = x.unsqueeze(2)
        patches = F.unfold(x, self.kernel, dilation=self.dilation, padding=self.padding,
                           stride=self.stride)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def grad_gram(self, g: Tensor) -> Tensor:
        """Σ over the batch of the mean over output locations of g_t g_tᵀ."""
        locations = g[0, 0].numel()
        g = g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])
        return g.T @ g / locations
