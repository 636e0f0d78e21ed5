"""``fsd cl tune``: the paper's tuning protocol for the penalty weight λ.

The appendix: run a grid of settings on seed 42, keep the one with the best final average
accuracy, then report seeds 20, 21 and 22 with it. Each grid point and the final run are
ordinary ``fsd cl`` runs in sub-directories of the output (``grid/lambda-<λ>`` and
``final``), so a stopped tuning resumes where it stopped, point by point and task by task.
``tune.json`` and ``tune.md`` hold the grid's table and the chosen λ.
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

TUNE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class TuneResult:
    """The grid on the tuning seed, the λ it chose, and the final run's results.

    Attributes:
        grid: one row per λ: ``{"fsd_scale", "avg_accuracy", "backward_transfer"}``.
        chosen: the λ with the best final average accuracy on the tuning seed.
        tuning_seed: the seed of the grid (the paper's 42).
        final: the run with the chosen λ on the reported seeds.
    """

    grid: list[dict[str, float]]
    chosen: float
    tuning_seed: int
    final: RunResults

    def to_json(self) -> dict[str, Any]:
        """The JSON written to ``tune.json``."""
        return versioned({
                "tuning_seed": self.tuning_seed, "grid": self.grid, "chosen": self.chosen,
                "final_seeds": self.final.seeds,
                "final_avg_accuracy": self.final.avg_accuracy,
                "final_backward_transfer": self.final.backward_transfer},
            TUNE_SCHEMA_VERSION, self.final.device)

    def markdown(self, settings: RunSettings) -> str:
        """The grid's table, the chosen λ and the final seeds' accuracy."""
        lines = [f"# Tuning λ for {settings.method} on {settings.benchmark}", "",
                 f"Grid on seed {self.tuning_seed}; the best final average accuracy chose "
                 f"λ = {self.chosen:g}.", "",
                 "| λ | avg accuracy (%) | BWT (%) |", "|---:|---:|---:|"]
        for row in self.grid:
            mark = " **(chosen)**" if row["fsd_scale"] == self.chosen else ""
            lines.append(f"| {row['fsd_scale']:g}{mark} | {row['avg_accuracy']:.2f} | "
                         f"{row['backward_transfer']:.2f} |")
        avg, bwt = self.final.avg_accuracy, self.final.backward_transfer
        lines += ["", f"Seeds {', '.join(map(str, self.final.seeds))} at λ = {self.chosen:g}: "
                      f"{avg['mean']:.2f} ± {avg['std']:.2f} average accuracy, BWT "
                      f"{bwt['mean']:.2f} ± {bwt['std']:.2f}."]
        return "\n".join(lines) + "\n"


def tune(settings: RunSettings, grid: Sequence[float], tuning_seed: int = 42) -> TuneResult:
    """Run the protocol; ``settings.seeds`` are the reported seeds, ``settings.out`` the root.

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
        hyperparameters=dataclasses.replace(settings.hyperparameters, fsd_scale=chosen)))
    result = TuneResult(rows, chosen, tuning_seed, final)
    write_json(root / "tune.json", result.to_json())
    atomic_write_text(root / "tune.md", result.markdown(settings))
    return result
