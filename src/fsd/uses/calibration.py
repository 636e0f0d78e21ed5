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
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..estimators.base import Estimator
from ..estimators.batches import Data
from ..estimators.exact_fsd import ExactFSD


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
        """λ for this estimator that weighs like ``exact_lambda`` on the true FSD.

        Raises:
            ValueError: ``exact_lambda`` is not a finite number ≥ 0; the median ratio is 0 or
                not finite (an estimator that reads 0 where the true FSD does not weighs
                like no λ); or the scaled λ overflows.
        """
        if (isinstance(exact_lambda, bool) or not isinstance(exact_lambda, numbers.Real)
                or not math.isfinite(exact_lambda) or exact_lambda < 0):
            raise ValueError(f"exact_lambda must be a finite number ≥ 0, got {exact_lambda!r}")
        ratio = self.median_ratio
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"cannot scale exact_lambda: the median estimate/exact ratio is "
                             f"{ratio:.3g} (estimates {_short(self.estimates)}); no λ makes "
                             f"a zero or non-finite estimate weigh like the true FSD")
        scaled = exact_lambda / ratio
        if not math.isfinite(scaled):
            raise ValueError(f"exact_lambda={exact_lambda!r} over the median ratio {ratio:.3g} "
                             f"overflows")
        return float(scaled)

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

    Raises:
        ValueError: in one line naming the argument: ``model`` not an ``nn.Module``,
            ``seed`` not an integer in [0, 2**64), and what would leave a ratio — and so
            λ — not a finite number: ``scale`` not finite and > 0, ``num_perturbations``
            below 2, ``moved`` empty, a moved network with non-finite parameters, a true
            FSD of 0 (a network that did not move, or a ``scale`` too small to move the
            parameters) or not finite (a ``scale`` so large the outputs overflow), or an
            ``estimator`` whose distance is not finite.
        fsd.ArchitectureMismatchError: ``model`` is not of the architecture the estimator
            was fitted on.
        fsd.estimators.base.NotFittedError: the estimator was not fitted.
    """
    # every ratio must be finite and positive, or λ / median ratio is not a number: what
    # would break it is refused, naming the argument (the default networks: ``scale``)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module of the reference's architecture, got "
                         f"{type(model).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        # torch.Generator takes a seed in [0, 2**64)
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    estimator.require_fitted()
    # before load_state_dict, whose message for another model is many lines of key names
    estimator.check_architecture(model)
    if moved is None:
        if (isinstance(num_perturbations, bool) or not isinstance(num_perturbations, int)
                or num_perturbations < 2):
            raise ValueError(f"num_perturbations must be at least 2, got {num_perturbations!r}")
        if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    elif len(moved) == 0:
        raise ValueError("moved is empty: give at least one network that moved from the "
                         "reference")
    reference = copy.deepcopy(model)
    reference.load_state_dict(estimator.reference_state_dict())
    perturbed = moved is None
    if moved is None:
        moved = perturbed_copies(reference, num_perturbations, scale, seed)
        names = [f"scale={scale!r} (perturbed copy {i})" for i in range(len(moved))]
    else:
        names = [f"moved[{i}]" for i in range(len(moved))]
    for name, network in zip(names, moved, strict=True):
        bad = next((n for n, p in network.named_parameters()
                    if p.is_floating_point() and not bool(torch.isfinite(p).all())), None)
        if bad is not None:
            raise ValueError(f"{name}: parameter '{bad}' has NaN or infinite values"
                             + ("; use a smaller scale" if perturbed else ""))
    exact = ExactFSD(metric=estimator.config.get("metric", "euclidean"))
    # the estimator's own call of the model: its output and forward arguments
    exact.fit(reference, data, outputs=estimator.output_units(),
              output=estimator._meta.get("output"),
              forward_kwargs=estimator._meta.get("forward_kwargs"))
    estimates, truths = [], []
    for name, network in zip(names, moved, strict=True):
        with torch.no_grad():
            estimate, truth = float(estimator.distance(network)), float(exact.distance(network))
        if not math.isfinite(truth):
            advice = "a smaller scale" if perturbed else "a network nearer the reference"
            raise ValueError(f"{name}: the true FSD is {truth} (the network's outputs "
                             f"overflow); use {advice}")
        if truth == 0:
            advice = ("a larger scale (this one does not move the parameters)" if perturbed
                      else "networks that moved")
            raise ValueError(f"{name}: the true FSD is 0 (the network computes the "
                             f"reference's outputs on data), so no estimate/exact ratio "
                             f"exists; use {advice}")
        if not math.isfinite(estimate):
            raise ValueError(f"estimator: its distance at {name} is {estimate} where the "
                             f"true FSD is {truth:.3g}")
        estimates.append(estimate)
        truths.append(truth)
    return Calibration(repr(estimator), tuple(estimates), tuple(truths))


def _short(values: Sequence[float]) -> str:
    """At most three values, for a message."""
    shown = ", ".join(f"{v:.3g}" for v in values[:3])
    return f"[{shown}{', ...' if len(values) > 3 else ''}]"
