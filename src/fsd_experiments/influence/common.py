"""What both influence studies share: method checks, their titles, SGD training of θ0."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from fsd.uses.influence import pointwise_loss

from ..data import TensorBatches
from ..io import read_json
from ..training import train

METHOD_TITLES = {"exact": "PBRF (exact)", "ewc": "EWC", "cg": "CG", "bgln-d": "BGLN-D",
                 "random": "random"}


def recorded_experiment(path: Path) -> str | None:
    """The ``experiment`` a results.json records (``"uci"``, ``"mislabeled"``), else ``None``.

    ``None`` too for a file that cannot be read or is not a results object.
    """
    try:
        raw = read_json(path)
    except (OSError, ValueError):
        return None
    experiment = raw.get("experiment") if isinstance(raw, dict) else None
    return experiment if isinstance(experiment, str) else None


def _check_methods(methods: Sequence[str], allowed: Sequence[str]) -> list[str]:
    methods = list(methods)
    unknown = [m for m in methods if m not in allowed]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown or methods!r}; expected any of "
                         f"{', '.join(allowed)}")
    return methods


def train_sgd(model: nn.Module, x: Tensor, y: Tensor, *, loss: str, epochs: int, lr: float,
              batch_size: int = 128, seed: int = 0, desc: str = "training",
              progress: bool = True) -> bool:
    """Plain SGD on the mean loss; returns ``False`` if the loss became non-finite."""
    batches = TensorBatches(x, y, batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))

    def mean_pointwise(model: nn.Module, xb: Tensor, yb: Tensor) -> Tensor:
        return pointwise_loss(loss, model(xb), yb).mean()

    return train(model, batches, mean_pointwise, torch.optim.SGD(model.parameters(), lr=lr),
                 epochs=epochs, stop_on_nonfinite=True, progress=progress, desc=desc,
                 bar="epochs")


def mean_loss(model: nn.Module, x: Tensor, y: Tensor, loss: str) -> float:
    """Mean loss over (x, y) without gradients."""
    with torch.no_grad():
        return float(pointwise_loss(loss, model(x), y).mean())
