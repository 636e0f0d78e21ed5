"""``fsd compare-estimators``: every estimator against the true FSD on a real MNIST pair.

Trains a small MLP on digits 0/1 (θ0), fine-tunes a copy on 2/3 (θ), fits every estimator
on the 0/1 training data at θ0 and reports its estimate of the FSD between θ0 and θ next to
the true empirical FSD over the same 0/1 training images.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from fsd.estimators.base import Estimator
from fsd.estimators.exact_fsd import ExactFSD

from .data import TensorBatches, load_mnist, split_by_classes
from .models import mlp
from .presets import by_title
from .training import cross_entropy, train

#: the estimators compared, in table order (display names of :mod:`fsd_experiments.presets`)
COMPARED: tuple[str, ...] = (
    "LAFTR (coreset)", "LAFTR (gaussian)", "BGLN-S", "BGLN-S-Var", "BGLN-S-CW",
    "BGLN-S (coreset)", "BGLN-D", "BGLN-D-Var", "BGLN-D-CW", "NTK (coreset)", "EWC")


def default_estimators(coreset_size: int = 40, num_samples: int = 128
                       ) -> dict[str, Callable[[], Estimator]]:
    """The estimators compared, by display name (factories, so each run is fresh).

    Coreset methods keep ``coreset_size`` points; the ones sampling Gaussian inputs draw
    ``num_samples`` per call; everything else keeps its preset's defaults.
    """
    def factory(title: str) -> Callable[[], Estimator]:
        preset = by_title(title)
        options: dict[str, int] = ({"coreset_size": coreset_size} if preset.coreset else
                                   {"num_samples": num_samples} if preset.sampled else {})
        return lambda: preset.make(**options)

    return {title: factory(title) for title in COMPARED}


@dataclass
class Row:
    """One line of the comparison table."""

    estimator: str
    estimate: float
    true_fsd: float
    relative_error: float
    nbytes: int
    ms_per_call: float


def time_distance(estimator: Estimator, model: nn.Module, repeats: int) -> tuple[float, float]:
    """First estimate and median milliseconds of ``distance`` + backward over ``repeats``."""
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        d = estimator.distance(model)
        d.backward()
        times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad()
        value = float(d.detach()) if value is None else value
    if value is None:
        raise ValueError(f"repeats must be positive, got {repeats}")
    times.sort()
    return value, times[len(times) // 2]


def mnist_pair(data_dir: str | None = None, *, width: int = 100, depth: int = 2,
               epochs: int = 1, finetune_epochs: int = 1, lr: float = 1e-3,
               batch_size: int = 64, seed: int = 0, progress: bool = True
               ) -> tuple[nn.Module, nn.Module, tuple[torch.Tensor, torch.Tensor],
                          tuple[torch.Tensor, torch.Tensor]]:
    """The compared pair: an MLP trained on MNIST 0/1 (θ0) and a copy fine-tuned on 2/3.

    Returns ``(reference, moved, (x01, y01), (x23, y23))`` with the training images of each
    pair of digits.
    """
    torch.manual_seed(seed)
    x, y = load_mnist(data_dir, "train")
    x01, y01 = split_by_classes(x, y, [0, 1])
    x23, y23 = split_by_classes(x, y, [2, 3])
    generator = torch.Generator().manual_seed(seed)
    model = mlp(28 * 28, width, depth, 2)
    # plain Adam + cross-entropy makes the reference and the moved network
    train(model, TensorBatches(x01, y01, batch_size, shuffle=True, generator=generator),
          cross_entropy, torch.optim.Adam(model.parameters(), lr=lr), epochs=epochs,
          desc="task 0/1", progress=progress)
    moved = copy.deepcopy(model)
    train(moved, TensorBatches(x23, y23, batch_size, shuffle=True, generator=generator),
          cross_entropy, torch.optim.Adam(moved.parameters(), lr=lr), epochs=finetune_epochs,
          desc="task 2/3", progress=progress)
    return model, moved, (x01, y01), (x23, y23)


def compare_estimators(data_dir: str | None = None, *, width: int = 100, depth: int = 2,
                       epochs: int = 1, finetune_epochs: int = 1, lr: float = 1e-3,
                       batch_size: int = 64, seed: int = 0, repeats: int = 5,
                       progress: bool = True) -> list[Row]:
    """Run the comparison; returns one :class:`Row` per estimator (first row: ExactFSD)."""
    model, moved, (x01, y01), _ = mnist_pair(
        data_dir, width=width, depth=depth, epochs=epochs, finetune_epochs=finetune_epochs,
        lr=lr, batch_size=batch_size, seed=seed, progress=progress)

    reference_data = TensorBatches(x01, y01, 1024)
    exact = ExactFSD().fit(model, reference_data)
    true_fsd, exact_ms = time_distance(exact, moved, repeats)
    rows = [Row("ExactFSD (all 0/1 images)", true_fsd, true_fsd, 0.0, exact.nbytes, exact_ms)]
    for name, make in tqdm(default_estimators().items(), desc="estimators", leave=False,
                           disable=not progress):
        estimator = make().fit(model, reference_data)
        estimate, ms = time_distance(estimator, moved, repeats)
        rows.append(Row(name, estimate, true_fsd, abs(estimate - true_fsd) / true_fsd,
                        estimator.nbytes, ms))
    return rows


def format_rows(rows: list[Row]) -> str:
    """Markdown table of the comparison."""
    lines = ["| estimator | estimated FSD | true FSD | rel. error | bytes stored | ms / call |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.estimator} | {r.estimate:.4g} | {r.true_fsd:.4g} | "
                     f"{r.relative_error:.3f} | {r.nbytes:,} | {r.ms_per_call:.2f} |")
    return "\n".join(lines)
