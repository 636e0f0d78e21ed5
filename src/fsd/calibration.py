"""How an estimator's scale compares with the true FSD, to choose λ per estimator.

Estimators differ in scale by orders of magnitude on the same pair of networks (EWC's
diagonal quadratic, BGLN-D's moment propagation, NTK's coreset), so a penalty weight λ tuned
for one does not carry over to another. :func:`calibrate` measures the ratio
estimate / ExactFSD on held-out data, for moved copies of the reference network — random
perturbations of θ0, or networks the user supplies (e.g. checkpoints of a later task) —
and :meth:`Calibration.scale_lambda` turns a λ chosen for the true FSD into one for the
estimator. Ratios on random perturbations say nothing about how an estimator behaves under
optimisation (Algorithm 2's BGLN-D reads well near θ0 and collapses during training): give
``moved`` networks from real training where that matters.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .estimator import Data, Estimator
from .exact import ExactFSD


@dataclass(frozen=True)
class Calibration:
    """Estimates of one estimator against the true FSD on the same moved networks.

    Attributes:
        estimator: the estimator's description (its ``repr``).
        estimates: the estimator's distance for each moved network.
        exact: ExactFSD on the held-out data for each moved network.
    """

    estimator: str
    estimates: tuple[float, ...]
    exact: tuple[float, ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """The ratio estimate / exact for each moved network."""
        return tuple(e / t if t > 0 else math.nan for e, t in zip(self.estimates, self.exact,
                                                                   strict=True))

    @property
    def median_ratio(self) -> float:
        """The typical estimate / exact ratio."""
        return float(torch.tensor(self.ratios, dtype=torch.float64).nanmedian())

    @property
    def spread(self) -> float:
        """Standard deviation of log10(ratio): 0.3 means a factor of 2 either way."""
        logs = torch.tensor(self.ratios, dtype=torch.float64).log10()
        logs = logs[torch.isfinite(logs)]
        return float(logs.std()) if logs.numel() > 1 else 0.0

    def scale_lambda(self, exact_lambda: float) -> float:
        """λ for this estimator that weighs like ``exact_lambda`` on the true FSD."""
        return exact_lambda / self.median_ratio

    def __str__(self) -> str:
        return (f"{self.estimator}: estimate/exact median {self.median_ratio:.3g} "
                f"(log10 spread {self.spread:.2f}, {len(self.ratios)} networks)")


def perturbed_copies(model: nn.Module, count: int, scale: float, seed: int = 0
                     ) -> list[nn.Module]:
    """``count`` copies of ``model``, each parameter tensor p moved by ``scale``·‖p‖.

    The step's direction is Gaussian; its size is relative, so layers of any size move alike.
    """
    generator = torch.Generator().manual_seed(seed)
    copies = []
    for _ in range(count):
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for p in moved.parameters():
                step = torch.randn(p.shape, generator=generator, dtype=torch.float64)
                step = step / step.norm().clamp_min(1e-300) * float(p.norm()) * scale
                p.add_(step.to(dtype=p.dtype, device=p.device))
        copies.append(moved)
    return copies


def calibrate(estimator: Estimator, model: nn.Module, data: Data, *,
              moved: Sequence[nn.Module] | None = None, num_perturbations: int = 8,
              scale: float = 0.05, seed: int = 0) -> Calibration:
    """Compare a fitted estimator with ExactFSD on held-out ``data``.

    Args:
        estimator: a fitted estimator (its reference network is θ0).
        model: a network of the reference's architecture (its parameters are not used: the
            reference is rebuilt from the estimator's θ0).
        data: held-out inputs (any form ``fit`` reads) for the true FSD.
        moved: networks to compare at; default ``num_perturbations`` random relative
            perturbations of θ0 of size ``scale`` (:func:`perturbed_copies`).
        num_perturbations: how many random perturbations (when ``moved`` is not given).
        scale: their size relative to each parameter tensor's norm.
        seed: their random seed.

    Returns:
        A :class:`Calibration`; ``str()`` of it is a one-line report.
    """
    reference = copy.deepcopy(model)
    reference.load_state_dict(estimator.reference_state_dict())
    if moved is None:
        if num_perturbations < 2:
            raise ValueError(f"num_perturbations must be at least 2, got {num_perturbations}")
        moved = perturbed_copies(reference, num_perturbations, scale, seed)
    exact = ExactFSD(metric=estimator.config.get("metric", "euclidean"))
    exact.fit(reference, data, outputs=estimator.output_units())
    estimates, truths = [], []
    for network in moved:
        with torch.no_grad():
            estimates.append(float(estimator.distance(network)))
            truths.append(float(exact.distance(network)))
    return Calibration(repr(estimator), tuple(estimates), tuple(truths))
