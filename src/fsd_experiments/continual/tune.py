"""``fsd cl tune``: the paper's tuning protocol for the penalty weight λ.

The appendix: run a grid of settings on seed 42, keep the one with the best final average
accuracy, then report seeds 20, 21 and 22 with it. The grid is scored on a validation split
(``Hyperparameters.validation``: that fraction of each task's training examples held out,
``fsd cl tune --validation``, 0.1 by default), not on the test sets the reported seeds are
measured on; the final run trains on the full training sets and reports the test sets.
Each grid point and the final run are ordinary ``fsd cl`` runs in sub-directories of the
output (``grid/lambda-<λ>`` and ``final``), so a stopped tuning resumes where it stopped,
point by point and task by task. ``tune.json`` and ``tune.md`` hold the grid's table, the
split it was scored on and the chosen λ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..io import atomic_write_text, versioned, write_json
from .results import RunResults
from .runner import run
from .settings import RunSettings

#: 2: ``validation``, the split the grid was scored on
TUNE_SCHEMA_VERSION = 2


@dataclass(frozen=True)
class TuneResult:
    """The grid on the tuning seed, the λ it chose, and the final run's results.

    Attributes:
        grid: one row per λ: ``{"fsd_scale", "avg_accuracy", "backward_transfer"}``, on the
            held-out examples when ``validation`` is set.
        chosen: the λ with the best final average accuracy on the tuning seed.
        tuning_seed: the seed of the grid (the paper's 42).
        final: the run with the chosen λ on the reported seeds (test sets).
        validation: the fraction of each task's training examples the grid held out and
            was scored on; ``None``: the grid was scored on the test sets.
    """

    grid: list[dict[str, float]]
    chosen: float
    tuning_seed: int
    final: RunResults
    validation: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON written to ``tune.json``."""
        return versioned({
                "tuning_seed": self.tuning_seed, "validation": self.validation,
                "grid": self.grid, "chosen": self.chosen,
                "final_seeds": self.final.seeds,
                "final_avg_accuracy": self.final.avg_accuracy,
                "final_backward_transfer": self.final.backward_transfer},
            TUNE_SCHEMA_VERSION, self.final.device)

    def markdown(self, settings: RunSettings) -> str:
        """The grid's table, the chosen λ and the final seeds' accuracy."""
        if self.validation is None:
            split, scored = "on the test sets", "avg accuracy (%)"
        else:
            split = (f"on a validation split: {100 * self.validation:g} % of each task's training "
                     f"examples held out, the runs trained on the rest")
            scored = "avg validation accuracy (%)"
        lines = [f"# Tuning λ for {settings.method} on {settings.benchmark}", "",
                 f"Grid on seed {self.tuning_seed}, {split}; the best final average accuracy "
                 f"chose λ = {self.chosen:g}.", "",
                 f"| λ | {scored} | BWT (%) |", "|---:|---:|---:|"]
        for row in self.grid:
            mark = " **(chosen)**" if row["fsd_scale"] == self.chosen else ""
            lines.append(f"| {row['fsd_scale']:g}{mark} | {row['avg_accuracy']:.2f} | "
                         f"{row['backward_transfer']:.2f} |")
        avg, bwt = self.final.avg_accuracy, self.final.backward_transfer
        lines += ["", f"Seeds {', '.join(map(str, self.final.seeds))} at λ = {self.chosen:g}, "
                      f"full training sets: {avg['mean']:.2f} ± {avg['std']:.2f} average test "
                      f"accuracy, BWT "
                      f"{bwt['mean']:.2f} ± {bwt['std']:.2f}."]
        return "\n".join(lines) + "\n"


def tune(settings: RunSettings, grid: Sequence[float], tuning_seed: int = 42) -> TuneResult:
    """Run the protocol; ``settings.seeds`` are the reported seeds, ``settings.out`` the root.

    The grid's runs hold out ``settings.hyperparameters.validation`` of each task's training
    examples and are scored on them (``None``: on the test sets); the final run at the
    chosen λ has ``validation`` ``None``: the full training sets, the test sets.

    Raises ``ValueError`` for an empty grid or one that repeats a λ.
    """
    grid = [float(v) for v in grid]
    if not grid or len(set(grid)) != len(grid):
        raise ValueError(f"the grid needs distinct values of λ, got {grid}")
    root = Path(settings.out)
    rows = []
    for scale in grid:
        point = dataclasses.replace(
            settings, seeds=(tuning_seed,), out=root / "grid" / f"lambda-{scale:g}",
            plots=False,
            hyperparameters=dataclasses.replace(settings.hyperparameters, fsd_scale=scale))
        result = run(point)
        rows.append({"fsd_scale": scale,
                     "avg_accuracy": float(result.avg_accuracy["mean"]),
                     "backward_transfer": float(result.backward_transfer["mean"])})
    # the first of equal accuracies: the grid's order decides a tie
    chosen = max(rows, key=lambda r: r["avg_accuracy"])["fsd_scale"]
    final = run(dataclasses.replace(
        settings, out=root / "final",
        hyperparameters=dataclasses.replace(settings.hyperparameters, fsd_scale=chosen,
                                            validation=None)))
    result = TuneResult(rows, chosen, tuning_seed, final, settings.hyperparameters.validation)
    write_json(root / "tune.json", result.to_json())
    atomic_write_text(root / "tune.md", result.markdown(settings))
    return result
