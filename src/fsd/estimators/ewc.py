"""EWC baseline: ½ Δθᵀ diag(F) Δθ with a diagonal Fisher collected at ``fit``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..metrics import check_metric, output_hessian_factors
from ..model import autodiff, support
from ..model.hooks import forward_hooks
from ..statistics import distributed
from ..validation import positive_int, require_nonnegative, require_shape
from . import probe
from .base import Estimator
from .batches import Data, iter_batches

FISHERS = ("true", "sampled", "empirical")



def _class_labels(y: Tensor | None, z0: Tensor) -> Tensor:
    """The empirical Fisher's labels: one integer per example, indexing the selected outputs."""
    if y is None:
        raise ValueError("fisher='empirical' needs (x, y) batches")
    n, classes = z0.shape
    labels = y.reshape(n) if y.dim() == 2 and y.shape == (n, 1) else y
    if labels.shape != (n,) or (labels.is_floating_point()
                                and not bool((labels == labels.round()).all())):
        raise ValueError(f"fisher='empirical' with metric='kl' needs one integer class label per "
                         f"example, got shape {tuple(y.shape)} and dtype {y.dtype}")
    if bool((labels < 0).any()) or bool((labels >= classes).any()):
        bad = int(labels[(labels < 0) | (labels >= classes)][0])
        raise ValueError(f"label {bad} is not an index of the {classes} selected outputs: "
                         f"labels index the selected outputs (map outputs[i] to i)")
    return labels.long()


def _regression_targets(y: Tensor | None, z0: Tensor) -> Tensor:
    """The empirical Fisher's targets for the Euclidean metric: finite, one per output."""
    if y is None:
        raise ValueError("fisher='empirical' needs (x, y) batches with regression targets")
    if y.numel() != z0.numel() or (y.dim() > 1 and y.shape != z0.shape):
        raise ValueError(f"fisher='empirical' with metric={'euclidean'!r} takes regression "
                         f"targets of the selected outputs' shape {tuple(z0.shape)}, got "
                         f"{tuple(y.shape)} (class labels: use metric='kl')")
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise ValueError("fisher='empirical' regression targets contain NaN or infinite values")
    return y.to(z0.dtype).reshape(z0.shape)

class EWC(Estimator):
    """Elastic weight consolidation as an FSD estimator.

    F is the Fisher of the model's own predictive distribution, which equals the
    Gauss-Newton matrix of the output metric: F = E_x[Jᵀ H J], H = ∇²_z ρ(z0, z) at z0.
    Its diagonal is Σ_k (Jᵀ h_k)² for factors Σ_k h_k h_kᵀ = H, accumulated per example.

    Args:
        fisher: ``"true"`` — exact expectation over the predictive distribution (all
            classes; for ``"euclidean"`` the unit-variance Gaussian); ``"sampled"`` — one
            label drawn from the model per example (Monte Carlo); ``"empirical"`` — the
            gradients at the data's own labels/targets (the empirical Fisher, which is *not*
            the Fisher; Kunstner et al. 2019). Labels must index the selected outputs.
        metric: output metric that F is the Hessian of (default ``"euclidean"``, the default
            of every estimator): ``"kl"`` (categorical likelihood),
            ``"euclidean"`` (Gaussian likelihood, unit variance) or ``"softmax_euclidean"``
            (``fisher="true"`` only).
        chunk_size: examples per vectorized per-example-gradient pass (memory only).
        seed: seed for ``fisher="sampled"``.

    The distance is a sum of one term per module that holds parameters (:meth:`layer_terms`).

    Per-example gradients are vectorized with ``torch.func.vmap``; on a model that ``vmap``
    cannot batch (``nn.GRU``'s in-place hidden state) ``fit`` takes one example at a time
    instead (:func:`fsd.model.autodiff.squared_gradients`): the same Fisher, more slowly.
    """

    splits_by_layer = True

    def __init__(self, fisher: str = "true", metric: str = "euclidean", chunk_size: int = 16,
                 seed: int = 0) -> None:
        if fisher not in FISHERS:
            raise ValueError(f"unknown fisher {fisher!r}; expected one of {', '.join(FISHERS)}")
        check_metric(metric)
        if fisher != "true" and metric == "softmax_euclidean":
            raise ValueError("softmax_euclidean has no likelihood to sample from: use "
                             "fisher='true'")
        super().__init__(fisher=fisher, metric=metric,
                         chunk_size=positive_int("chunk_size", chunk_size), seed=seed)

    def _factors(self, z0: Tensor, y: Tensor | None, generator: torch.Generator) -> Tensor:
        """Output-space vectors h (n, K, k) whose outer products average to the Fisher's H."""
        metric, fisher = self.config["metric"], self.config["fisher"]
        if fisher == "true":
            return output_hessian_factors(metric, z0)
        if metric == "kl":
            probs = z0.softmax(-1)
            if fisher == "sampled":
                labels = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1)
            else:
                labels = _class_labels(y, z0)
            onehot = torch.nn.functional.one_hot(labels.to(z0.device), z0.shape[-1])
            return (onehot.to(z0.dtype) - probs).unsqueeze(1)  # ∇_z −log p(y)
        # euclidean: Gaussian likelihood N(z, I)
        if fisher == "sampled":
            noise = torch.randn(z0.shape, generator=generator, dtype=z0.dtype).to(z0.device)
            return noise.unsqueeze(1)
        return (z0 - _regression_targets(y, z0)).unsqueeze(1)

    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        with autodiff.gradients_of_the_forward("EWC"):
            self._fit_from_gradients(model, data, dtype=dtype, device=device, progress=progress)

    def _fit_from_gradients(self, model: nn.Module, data: Data | None, *, dtype: torch.dtype,
                            device: torch.device, progress: bool) -> None:
        params = {k: v for k, v in self.reference_parameters().items()}
        buffers = {k[len("buffer0."):]: v for k, v in self._state.items()
                   if k.startswith("buffer0.")}
        generator = torch.Generator().manual_seed(self.config["seed"])
        select = self._select

        def forward(p: dict[str, Tensor], x: Tensor) -> Tensor:
            return select(functional_call(model, {**p, **buffers}, (x,)))

        looped = False  # vmap could not batch this model: every later batch loops directly

        def generic(x: Tensor, hs: Tensor) -> dict[str, Tensor]:
            nonlocal looped
            try:
                out, looped = autodiff.squared_gradients(forward, params, x, hs,
                                                         self.config["chunk_size"], loop=looped)
            except Exception as error:  # the per-example loop failed too: the model's forward
                use = support.advice(support.EWC, support.Feature.NO_PER_EXAMPLE_GRADIENTS)
                raise ValueError(f"EWC cannot take per-example gradients of this model "
                                 f"({autodiff.one_line(error)}); {use}") from None
            return out

        linear_layers = _linear_layers(model)
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
        count = 0
        for x, y in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                 desc="EWC: Fisher"):
            if "probe.x" not in self._state and x.shape[0]:  # distance's check of the function
                probe.record(self._state, model, {**params, **buffers}, x)
            with torch.no_grad():
                z0 = select(functional_call(model, {**params, **buffers}, (x,)))
            hs = self._factors(z0, y, generator).detach()
            batch = None
            if linear_layers is not None:
                batch = _linear_fisher_diagonal(model, linear_layers, params, buffers, select,
                                                x, hs)
            if batch is None:
                batch = generic(x, hs)
            for k in total:
                total[k] += batch[k].to(torch.float64)
            count += x.shape[0]
        total, count = distributed.sum_tensors(total, count)  # all ranks' shards
        probe.share_rank_zeros(self._state)
        for k, v in total.items():
            self._state[f"fisher.{k}"] = (v / count).to(dtype)

    def _check_summary(self) -> None:
        for key, value in list(self._stored.items()):
            if key.startswith("theta0."):
                name = f"fisher.{key[len('theta0.'):]}"
                require_shape(self._stored, name, list(value.shape))
                require_nonnegative(self._stored, name)

    def _distance(self, model: nn.Module) -> Tensor:
        self._warn_moved_buffers(model, support.EWC)
        return torch.stack(list(self._layer_terms(model).values())).sum()

    def _layer_terms(self, model: nn.Module) -> dict[str, Tensor]:
        # same parameters, another function (an activation swapped) would read 0 at θ0
        probe.check_probe(self._cache, model, self._state, self.reference_state)
        theta0 = self.reference_parameters()
        terms: dict[str, Tensor] = {}
        for name, p in model.named_parameters():
            path = name.rpartition(".")[0]  # the module that holds the parameter
            term = 0.5 * (self._state[f"fisher.{name}"] * (p - theta0[name]).pow(2)).sum()
            terms[path] = terms[path] + term if path in terms else term
        return terms


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear] | None:
    """The model's ``nn.Linear`` modules by path if they hold every parameter, else ``None``."""
    layers = {}
    for path, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if own:
            # weight and bias must be the layer's own parameters: a hook-based weight_norm or
            # prune holds weight_g/weight_orig and rebuilds weight, which the fast path misses
            if type(module) is not nn.Linear or "weight" not in own or (
                    module.bias is not None and "bias" not in own):
                return None
            layers[path] = module
    return layers or None


def _linear_fisher_diagonal(model: nn.Module, layers: dict[str, nn.Linear],
                            params: dict[str, Tensor], buffers: dict[str, Tensor],
                            select: Any, x: Tensor, hs: Tensor) -> dict[str, Tensor] | None:
    """Σ over examples and factors of (Jᵀh)² for a model whose parameters are all in Linears.

    An example's gradient of h·z with respect to a Linear's weight is the outer product of
    g = ∂(h·z)/∂s (s the layer's output) and the layer's input a, so the squared gradient
    summed over examples is (g²)ᵀ(a²): one backward pass per factor for the whole batch, no
    per-example gradient held. Returns ``None`` (use the generic path) when a Linear is not
    called exactly once on a (batch, features) input, where that identity does not hold.
    """
    if forward_hooks(model):
        return None  # a user's hook may change the outputs recorded here: generic path
    inputs: dict[str, list[Tensor]] = {path: [] for path in layers}
    outputs: dict[str, list[Tensor]] = {path: [] for path in layers}
    versions: dict[str, int] = {}

    def record(path: str):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            inputs[path].append(args[0])
            versions[path] = args[0]._version
            outputs[path].append(output)
            # the rest of the forward gets a copy, so an in-place op after the layer (e.g.
            # ReLU(inplace=True)) cannot turn `output` into its own result
            return output.clone()
        return hook

    handles = [m.register_forward_hook(record(path)) for path, m in layers.items()]
    try:
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        z = select(functional_call(model, {**live, **buffers}, (x,)))
    finally:
        for handle in handles:
            handle.remove()
    if any(len(inputs[p]) != 1 or inputs[p][0].dim() != 2 or outputs[p][0].dim() != 2
           or inputs[p][0].shape[0] != x.shape[0] for p in layers):
        return None
    if any(inputs[p][0]._version != versions[p] for p in layers):
        return None  # a layer's input was overwritten in place after the layer read it
    paths = list(layers)
    acts_sq = {p: inputs[p][0].detach().pow(2) for p in paths}
    out = {k: torch.zeros_like(v) for k, v in params.items()}
    factors = hs.shape[1]
    for j in range(factors):
        grads = torch.autograd.grad((z * hs[:, j]).sum(), [outputs[p][0] for p in paths],
                                    retain_graph=j < factors - 1, allow_unused=True)
        for path, g in zip(paths, grads, strict=True):
            if g is None:
                continue
            prefix = f"{path}." if path else ""
            g_sq = g.pow(2)
            out[f"{prefix}weight"] += g_sq.T @ acts_sq[path]
            if f"{prefix}bias" in out:
                out[f"{prefix}bias"] += g_sq.sum(0)
    return out
