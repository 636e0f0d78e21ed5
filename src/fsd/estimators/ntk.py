"""NTK baseline: FSD of the network linearized in parameter space on a stored coreset."""

from __future__ import annotations

import contextlib
import types
from typing import Any, ClassVar, Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..metrics import check_metric, pointwise_distance
from ..model import autodiff, support
from ..statistics.coreset import Reservoir
from ..validation import SummaryFormatError, positive_int, require, require_shape
from . import probe
from .base import Estimator
from .batches import Data, iter_batches


class NTK(Estimator):
    """ρ(f(x, θ0), f(x, θ0) + J(x, θ0)(θ − θ0)) averaged over a coreset.

    The Jacobian-vector product is computed by forward-mode AD (``torch.func.jvp``), which
    stays differentiable w.r.t. θ. Works with any ``nn.Module``: attention runs its
    differentiable kernels (:func:`fsd.model.autodiff.differentiable_kernels`), and a model with an
    operation that has no forward-mode derivative (``weight_norm``, oneDNN's LSTM) takes the
    product as two reverse-mode ones instead (:func:`fsd.model.autodiff.double_vjp`, same value).
    ``fit`` takes the product once on a stored input and raises ``ValueError`` in one line if
    neither mode can differentiate the model. ``distance`` works under ``torch.no_grad()`` and
    ``torch.inference_mode()`` too (returning the value without a graph).

    Args:
        coreset_size: number of stored inputs (uniform random subset; default 40,
            the paper's coreset for MNIST-sized tasks); ``None`` keeps all the data.
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"``.
        seed: seed of the coreset selection.
    """

    takes_tied_parameters: ClassVar[bool] = True

    def __init__(self, coreset_size: int | None = 40, metric: str = "euclidean",
                 seed: int = 0) -> None:
        positive_int("coreset_size", coreset_size, allow_none=True)
        super().__init__(coreset_size=coreset_size, metric=check_metric(metric), seed=seed)

    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        reservoir = Reservoir(self.config["coreset_size"],
                              torch.Generator().manual_seed(self.config["seed"]))
        for x, y in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                 desc="NTK: coreset"):
            reservoir.add(x, y)
        self._state["coreset.x"] = reservoir.tensors()[0]
        self._check_differentiable(model)
        # f(x, θ0) as fitted: distance recomputes it from the model it is given, and a model
        # that computes another function at θ0 (an activation swapped) would read 0
        with torch.no_grad():
            self._state["coreset.f0"] = functional_call(model, self.reference_state(),
                                                        (self._state["coreset.x"],)).detach()

    def _check_differentiable(self, model: nn.Module) -> None:
        """Take J·v once on one stored input: a model neither mode differentiates fails here."""
        reference = self.reference_state()
        tangents = {n: torch.ones_like(v) for n, v in reference.items() if v.is_floating_point()}
        try:
            with torch.no_grad():
                self._products(model, self._state["coreset.x"][:1], tangents)
        except Exception as error:  # of any kind: distance() would raise it on every call
            raise ValueError(f"NTK cannot take Jacobian-vector products through this model "
                             f"({autodiff.one_line(error)}), by forward mode or by two "
                             f"reverse-mode products; "
                             f"{support.advice(support.NTK, support.Feature.NOT_DIFFERENTIABLE)}"
                             ) from None

    def _check_summary(self) -> None:
        x = require(self._stored, "coreset.x")
        if x.dim() < 2 or x.shape[0] == 0:
            raise SummaryFormatError(f"field 'coreset.x': shape {tuple(x.shape)}, expected "
                                     f"(examples, *features)")
        if "coreset.f0" in self._stored:  # absent from summaries saved before it was kept
            require_shape(self._stored, "coreset.f0", [x.shape[0], None])

    def _distance(self, model: nn.Module) -> Tensor:
        # θ0 and the floating buffers (BatchNorm's running statistics) are linearized alike:
        # a network whose only change is its running statistics has moved too
        reference = self.reference_state()
        current = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        tangents = {n: current[n] - v for n, v in reference.items() if v.is_floating_point()}
        f0, jv = self._products(model, self._state["coreset.x"], tangents)
        probe.check_same_function(self._cache, model, lambda: f0,
                                  self._state.get("coreset.f0"))
        reference = self._select(f0).detach()
        return pointwise_distance(self.config["metric"], reference, self._select(jv)).mean()

    def _products(self, model: nn.Module, x: Tensor, tangents: dict[str, Tensor]
                  ) -> tuple[Tensor, Tensor]:
        """f(x, θ0) and J(x, θ0)·tangents (by parameter and floating buffer name)."""
        reference = self.reference_state()
        names = list(tangents)
        fixed = {n: v for n, v in reference.items() if n not in tangents}

        def f(*values: Tensor) -> Tensor:
            state = {**dict(zip(names, values, strict=True)), **fixed}
            return functional_call(model, state, (x,))

        primals = tuple(reference[n] for n in names)
        # torch's kernel has no derivative in BatchNorm's statistics; fused attention none
        with explicit_batch_norm(model), autodiff.differentiable_kernels():
            # forward mode unless it failed on this model before (then two vjps directly)
            f0, jv, reverse = autodiff.jvp(f, primals, tuple(tangents.values()),
                                           reverse=self._cache.get("reverse_jvp", False))
        self._cache["reverse_jvp"] = reverse
        return f0, jv


@contextlib.contextmanager
def explicit_batch_norm(model: nn.Module) -> Iterator[None]:
    """Evaluate BatchNorm layers in evaluation mode by their formula, inside the block.

    (x − running_mean) / √(running_var + eps) · weight + bias, written with elementary
    operations, is differentiable in the running statistics — forward-mode included —
    where ``torch.batch_norm`` is not. An InstanceNorm with running statistics computes the
    same map in evaluation mode, and gets the same formula.
    """
    patched = [m for m in model.modules()
               if isinstance(m, (nn.modules.batchnorm._BatchNorm,
                                 nn.modules.instancenorm._InstanceNorm)) and not m.training
               and m.running_mean is not None and m.running_var is not None]
    for m in patched:
        m.forward = types.MethodType(_batch_norm_formula, m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def _batch_norm_formula(self: nn.modules.batchnorm._NormBase, x: Tensor) -> Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    assert self.running_mean is not None and self.running_var is not None
    y = (x - self.running_mean.view(shape)) * (self.running_var + self.eps).rsqrt().view(shape)
    if self.weight is not None:
        y = y * self.weight.view(shape)
    if self.bias is not None:
        y = y + self.bias.view(shape)
    return y
