"""NTK baseline: FSD of the network linearized in parameter space on a stored coreset."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp

from .estimator import Data, Estimator, Reservoir, iter_batches
from .metrics import check_metric, pointwise_distance
from .validation import SummaryFormatError, positive_int, require


class NTK(Estimator):
    """ρ(f(x, θ0), f(x, θ0) + J(x, θ0)(θ − θ0)) averaged over a coreset.

    The Jacobian-vector product is computed by forward-mode AD (``torch.func.jvp``), which
    stays differentiable w.r.t. θ. Works with any ``nn.Module``.

    Args:
        coreset_size: number of stored inputs (uniform random subset); ``None`` keeps all.
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"``.
        seed: seed of the coreset selection.
    """

    def __init__(self, coreset_size: int | None = None, metric: str = "euclidean",
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

    def _check_summary(self) -> None:
        x = require(self._stored, "coreset.x")
        if x.dim() < 2 or x.shape[0] == 0:
            raise SummaryFormatError(f"field 'coreset.x': shape {tuple(x.shape)}, expected "
                                     f"(examples, *features)")

    def _distance(self, model: nn.Module) -> Tensor:
        theta0 = self.reference_parameters()
        names = list(theta0)
        current = dict(model.named_parameters())
        buffers = {k[len("buffer0."):]: v for k, v in self._state.items()
                   if k.startswith("buffer0.")}
        x = self._state["coreset.x"]

        def f(*params: Tensor) -> Tensor:
            state = {**dict(zip(names, params, strict=True)), **buffers}
            return functional_call(model, state, (x,))

        primals = tuple(theta0[n] for n in names)
        tangents = tuple(current[n] - theta0[n] for n in names)
        # torch's annotation of jvp does not tie the tuple's length to has_aux (False here)
        f0, jv = jvp(f, primals, tangents)  # pyright: ignore[reportAssignmentType]
        reference = self._select(f0).detach()
        return pointwise_distance(self.config["metric"], reference, self._select(jv)).mean()
