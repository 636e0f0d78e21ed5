"""What the fidelity studies share: the networks θ1 and θ_j, and the estimators fitted at θ1."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, cast

import torch
from torch import Tensor, nn

from fsd.estimators.base import Estimator
from fsd.estimators.exact_fsd import ExactFSD
from fsd.statistics.collector import StatisticsCollector

from ..benchmarks import FIDELITY_BENCHMARKS, Benchmark
from ..data import TensorBatches
from ..models import mlp
from ..presets import PRESETS, Preset, by_title
from ..training import cross_entropy, minibatch_stream, train

BENCHMARKS: tuple[str, ...] = FIDELITY_BENCHMARKS

STUDIES: tuple[str, ...] = ("pairs", "depth", "minimize")

#: every estimator of the pairs study, in table order
ALL_ESTIMATORS: tuple[str, ...] = (
    "LAFTR (coreset)", "BGLN-S (coreset)", "NTK (coreset)", "LAFTR (gaussian)",
    "BGLN-S", "BGLN-S-Var", "BGLN-S-CW", "BGLN-D", "BGLN-D-Var", "BGLN-D-CW", "EWC",
)

#: beyond the paper: BGLN-D with exact moments / layer-wise reference statistics
MOMENT_VARIANTS: tuple[str, ...] = (
    "BGLN-D", "BGLN-D (exact)", "BGLN-D (layerwise)", "BGLN-D (exact+layerwise)")

DEPTH_ESTIMATORS: tuple[str, ...] = ("LAFTR (coreset)", "NTK (coreset)", "BGLN-D", "BGLN-S")

#: the regularizers of the minimization study ("none": unregularized); LAFTR (gaussian) and
#: BGLN-D (exact) because the continual-learning runs single them out (a weak row; the
#: recommended BGLN-D)
MINIMIZE_ESTIMATORS: tuple[str, ...] = (
    "none", "LAFTR (coreset)", "LAFTR (gaussian)", "NTK (coreset)", "BGLN-S", "BGLN-D",
    "BGLN-D (exact)", "BGLN-D-CW", "EWC")

#: estimators whose ``distance`` draws random samples (inputs and/or gates)
SAMPLED = {p.title for p in PRESETS.values() if p.sampled}


def train_steps(model: nn.Module, x: Tensor, y: Tensor, *, lr: float, steps: int,
                batch_size: int, generator: torch.Generator,
                penalty: Callable[[nn.Module], Tensor] | None = None, lam: float = 0.0,
                callback: Callable[[int], None] | None = None,
                snapshots: Sequence[int] = ()) -> dict[int, nn.Module]:
    """Adam on cross-entropy (+ ``lam * penalty(model)``) for ``steps`` minibatch iterations.

    ``callback(step)`` is called before the first step and after every step; copies of the
    model after each step count in ``snapshots`` are returned (one run gives a whole row of
    the learning-rate × iterations grid).
    """
    wanted, out = set(snapshots), {}

    def after(step: int) -> None:
        if step in wanted:
            out[step] = copy.deepcopy(model).eval()
        if callback is not None:
            callback(step)

    model.train()
    if callback is not None:
        callback(0)
    train(model, minibatch_stream(x, y, batch_size, steps, generator), cross_entropy,
          torch.optim.Adam(model.parameters(), lr=lr), penalty=penalty, weight=lam,
          on_step=after, bar=None)
    return out


def train_reference(bench: Benchmark, *, width: int, depth: int, epochs: float, lr: float,
                    batch_size: int, seed: int) -> nn.Module:
    """θ1: a ReLU MLP trained on task 1 for ``epochs`` passes (Adam)."""
    torch.manual_seed(seed)
    model = mlp(bench.input_dim, width, depth, bench.outputs)
    steps = max(1, math.ceil(epochs * bench.task1.x_train.shape[0] / batch_size))
    train_steps(model, bench.task1.x_train, bench.task1.y_train, lr=lr, steps=steps,
                batch_size=batch_size, generator=torch.Generator().manual_seed(seed))
    return model


def make_family(reference: nn.Module, bench: Benchmark, *, lrs: Sequence[float],
                iters: Sequence[int], batch_size: int, seed: int
                ) -> list[tuple[dict[str, float], nn.Module]]:
    """θ_j: copies of θ1 fine-tuned on task 2, one per (learning rate, iterations) pair."""
    family = []
    for k, lr in enumerate(lrs):
        model = copy.deepcopy(reference)
        snaps = train_steps(model, bench.task2.x_train, bench.task2.y_train, lr=lr,
                            steps=max(iters), batch_size=batch_size,
                            generator=torch.Generator().manual_seed(seed + 1000 + k),
                            snapshots=iters)
        family += [({"lr": lr, "steps": s}, snaps[s]) for s in sorted(iters)]
    return family


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Classification accuracy of ``model`` on ``(x, y)``."""
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


@dataclass
class Suite:
    """Estimators fitted at θ1 from shared stored information, plus the truth."""

    exact: ExactFSD
    estimators: dict[str, Estimator]
    repeats: int
    coreset_size: int
    fit_seconds: dict[str, float] = field(default_factory=dict)

    def evaluate(self, name: str, model: nn.Module) -> Tensor:
        """The estimate of ``name`` at ``model`` used for fidelity.

        Sampled estimators are averaged over ``repeats`` calls and restarted from their seed
        for every model (common random numbers, so that differences between models are not
        drowned in sampling noise).
        """
        est = self.estimators[name]
        if name not in SAMPLED:
            return est.distance(model)
        fresh = copy.deepcopy(est)  # seed-state as after fit: same draws for every model
        total = cast(Tensor, sum(fresh.distance(model) for _ in range(self.repeats)))
        return total / self.repeats


#: every estimator :func:`fit_suite` can fit, by display name
FITTABLE: tuple[str, ...] = tuple(p.title for p in PRESETS.values()
                                  if p.estimator is not None and p.estimator is not ExactFSD)


def _preset(name: str) -> Preset:
    if name not in FITTABLE:
        raise ValueError(f"unknown estimator {name!r}; expected one of {', '.join(FITTABLE)}")
    return by_title(name)


def takes_metric(name: str, metric: str) -> bool:
    """Whether estimator ``name`` computes the output ``metric``.

    All take ``"euclidean"``; BGLN-D, EWC and K-FAC take only that one.
    """
    return name == "none" or metric == "euclidean" or _preset(name).metric_applies


def fit_suite(reference: nn.Module, bench: Benchmark, names: Sequence[str], *,
              coreset_size: int = 200, num_samples: int = 2048, repeats: int = 4,
              seed: int = 0, batch_size: int = 1024, ewc_examples: int | None = None,
              metric: str = "euclidean") -> Suite:
    """Fit the truth and the named estimators on task 1 at θ1, both in the output ``metric``.

    All coreset methods get the same random coreset (passed as one tensor batch with
    ``coreset_size=None``); all moment methods read one :class:`fsd.StatisticsCollector`
    pass over the full task-1 training set (diag / class-wise variants derive from it).
    EWC's Fisher averages over the first ``ewc_examples`` examples (``None``: all).
    A metric other than ``"euclidean"`` needs estimators that compute it (:func:`takes_metric`).
    """
    refused = [n for n in names if not takes_metric(n, metric)]
    if refused:
        raise ValueError(f"{', '.join(refused)} compute only the Euclidean metric, not "
                         f"{metric!r}")
    task = bench.task1
    reference.eval()
    times: dict[str, float] = {}
    start = time.perf_counter()
    exact = ExactFSD(metric=metric)
    exact.fit(reference, TensorBatches(task.x_train, task.y_train, batch_size))
    times["ExactFSD"] = time.perf_counter() - start
    index = torch.randperm(task.x_train.shape[0], generator=torch.Generator().manual_seed(seed))
    index = index[:coreset_size]
    coreset = [(task.x_train[index], task.y_train[index])]
    presets = {name: _preset(name) for name in names if name != "none"}
    collector = None
    if any(p.needs_statistics for p in presets.values()):
        start = time.perf_counter()
        collector = StatisticsCollector(reference, moments="full", gates=True,
                                        layer_moments=True)
        with torch.no_grad():
            for x, y in TensorBatches(task.x_train, task.y_train, batch_size):
                with collector.record(labels=y):
                    reference(x)
        collector.remove()
        times["statistics"] = time.perf_counter() - start

    def fit(preset: Preset) -> Estimator:
        if preset.name == "ewc":
            # Fisher of the same Euclidean (unit-variance Gaussian) metric, over task-1 data
            return preset.make(chunk_size=64).fit(
                reference, TensorBatches(task.x_train[:ewc_examples], task.y_train[:ewc_examples],
                                         batch_size))
        options: dict[str, object] = ({"num_samples": num_samples, "seed": seed}
                                      if preset.sampled else {})
        if metric != "euclidean":
            options["metric"] = metric
        estimator = preset.make(**options)
        statistics = collector if preset.needs_statistics else None
        if preset.coreset:
            return estimator.fit(reference, coreset, statistics=statistics)
        return estimator.fit(reference, statistics=statistics)

    estimators = {}
    for name, preset in presets.items():
        start = time.perf_counter()
        estimators[name] = fit(preset)
        times[name] = time.perf_counter() - start
    return Suite(exact, estimators, repeats, len(index), times)
