"""The oracle: empirical FSD over the data given to ``fit`` (paper eq. 2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .estimator import Data, Estimator, iter_batches
from .metrics import check_metric, pointwise_distance


class ExactFSD(Estimator):
    """Empirical FSD (1/N) Σ_i ρ(f(x_i, θ0), f(x_i, θ)) over all data seen by ``fit``.

    Nonparametric by definition: it keeps the data. Works with any ``nn.Module``.

    Args:
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"`` (see :mod:`fsd.metrics`).
        batch_size: examples per forward pass inside ``distance`` (memory vs speed only).
    """

    def __init__(self, metric: str = "euclidean", batch_size: int = 4096) -> None:
        super().__init__(metric=check_metric(metric), batch_size=int(batch_size))

    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        xs = [x for x, _ in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                         desc="ExactFSD: storing data")]
        self._state["data.x"] = torch.cat(xs)

    def _reference_outputs(self, model: nn.Module) -> list[Tensor]:
        # f(x, θ0) is fixed after fit: compute once per placement and reuse.
        if "f0" not in self._cache:
            reference = self._reference_state()
            with torch.no_grad():
                self._cache["f0"] = [functional_call(model, reference, (chunk,))
                                     for chunk in self._chunks()]
        return self._cache["f0"]

    def _chunks(self) -> tuple[Tensor, ...]:
        return torch.split(self._state["data.x"], self.config["batch_size"])

    def _distance(self, model: nn.Module) -> Tensor:
        total = 0.0
        for chunk, f0 in zip(self._chunks(), self._reference_outputs(model), strict=True):
            f1 = model(chunk)
            reference = self._select(f0)
            total = total + pointwise_distance(
                self.config["metric"], reference, self._select(f1) - reference).sum()
        assert isinstance(total, Tensor)  # fit refuses empty data
        return total / self._state["data.x"].shape[0]
