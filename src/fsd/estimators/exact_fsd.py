"""The oracle: empirical FSD over the data given to ``fit`` (paper eq. 2)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..metrics import check_metric, pointwise_distance
from ..statistics import distributed
from ..validation import SummaryFormatError, positive_int, require, require_shape
from .base import Estimator
from .batches import Data, iter_batches


class ExactFSD(Estimator):
    """Empirical FSD (1/N) Σ_i ρ(f(x_i, θ0), f(x_i, θ)) over all data seen by ``fit``.

    Nonparametric by definition: it keeps the data and the reference outputs f(x, θ0).
    Works with any ``nn.Module``.

    Args:
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"`` (see :mod:`fsd.metrics`).
        batch_size: examples per forward pass inside ``distance`` (memory vs speed only).
    """

    takes_tied_parameters: ClassVar[bool] = True

    def __init__(self, metric: str = "euclidean", batch_size: int = 4096) -> None:
        super().__init__(metric=check_metric(metric),
                         batch_size=positive_int("batch_size", batch_size))

    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        xs = [x for x, _ in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                         desc="ExactFSD: storing data")]
        # under torch.distributed: every rank's shard, in rank order
        self._state["data.x"] = torch.cat(
            [part.to(device) for part in distributed.gather_objects(torch.cat(xs))])
        # f(x, θ0) belongs to the reference network given here, not to whichever model a
        # later distance() call passes (another forward with the same parameter shapes)
        reference = self.reference_state()
        with torch.no_grad():
            self._state["data.f0"] = torch.cat([functional_call(model, reference, (chunk,))
                                                for chunk in self._chunks()])

    def _check_summary(self) -> None:
        x = require(self._stored, "data.x")
        if x.dim() < 2 or x.shape[0] == 0:
            raise SummaryFormatError(f"field 'data.x': shape {tuple(x.shape)}, expected "
                                     f"(examples, *features)")
        if "data.f0" in self._stored:
            require_shape(self._stored, "data.f0", [x.shape[0], None])

    def _reference_outputs(self, model: nn.Module) -> tuple[Tensor, ...]:
        if "data.f0" in self._state:
            return torch.split(self._state["data.f0"], self.config["batch_size"])
        # a summary saved before f(x, θ0) was stored: evaluate it at θ0 for each model object
        key = f"f0:{id(model)}"
        if key not in self._cache:
            reference = self.reference_state()
            with torch.no_grad():
                self._cache[key] = tuple(functional_call(model, reference, (chunk,))
                                         for chunk in self._chunks())
        return self._cache[key]

    def _chunks(self) -> tuple[Tensor, ...]:
        return torch.split(self._state["data.x"], self.config["batch_size"])

    def _distance(self, model: nn.Module) -> Tensor:
        total = 0.0
        for chunk, f0 in zip(self._chunks(), self._reference_outputs(model), strict=True):
            f1 = model(chunk)
            if f1.shape != f0.shape:
                # f(x, θ0) is stored without the model's output shape, which only the model
                # knows: a stored f0 of another width would broadcast against f1
                raise SummaryFormatError(f"field 'data.f0': {tuple(f0.shape[1:])} reference "
                                         f"outputs per example, the model gives "
                                         f"{tuple(f1.shape[1:])}")
            reference = self._select(f0)
            total = total + pointwise_distance(
                self.config["metric"], reference, self._select(f1) - reference).sum()
        assert isinstance(total, Tensor)  # fit refuses empty data
        return total / self._state["data.x"].shape[0]
