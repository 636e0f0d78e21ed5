"""One ``fsd cl`` run's results: the accuracy metrics, results.json / results.md and the plots."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence, TypeGuard

import numpy as np
import torch

from fsd import __version__

from ..benchmarks import CL_BENCHMARKS
from ..compat import CL_RESULTS_SCHEMA, cl_results
from ..devices import cpu_name, device_name
from ..io import atomic_write_text, read_json, write_json
from ..plotting import pyplot, write_figure
from ..presets import CL_METHODS
from .settings import Hyperparameters


@dataclass
class SeedResult:
    """Outcome of one seed: accuracy matrix rows, wall time and summary sizes."""

    seed: int
    matrix: list[list[float]] = field(default_factory=list)
    wall_seconds: float = 0.0
    summary_bytes: list[int] = field(default_factory=list)


def average_accuracy(matrix: Sequence[Sequence[float]]) -> float:
    """Mean accuracy over all tasks after the last one: mean_j R[T-1][j]."""
    return float(np.mean(np.asarray(matrix, dtype=float)[-1]))


def backward_transfer(matrix: Sequence[Sequence[float]]) -> float:
    """(1/(T−1)) Σ_{i<T-1} (R[T-1][i] − R[i][i]); 0 for a single task."""
    r = np.asarray(matrix, dtype=float)
    t = r.shape[0]
    if t < 2:
        return 0.0
    return float(np.mean([r[-1, i] - r[i, i] for i in range(t - 1)]))


def accuracy_summary(values: Sequence[float]) -> dict[str, Any]:
    """``{"per_seed": [...], "mean": m, "std": s}`` (population std, 0 for one seed)."""
    arr = np.asarray(values, dtype=float)
    return {"per_seed": [float(v) for v in arr], "mean": float(arr.mean()) if arr.size else
            math.nan, "std": float(arr.std()) if arr.size else math.nan}


@dataclass(frozen=True)
class RunResults:
    """The results of one ``fsd cl`` run (results.json), over the seeds finished so far.

    Attributes:
        benchmark: the benchmark.
        method: the method.
        seeds: the finished seeds, in order.
        seeds_requested: every seed the run was asked for.
        complete: all requested seeds are finished.
        accuracy_matrix: per seed (as a string), R[i][j] = test accuracy (%) on task j
            after training task i.
        avg_accuracy: :func:`accuracy_summary` of the average final accuracy per seed.
        backward_transfer: :func:`accuracy_summary` of the backward transfer per seed.
        wall_seconds: ``{"per_seed": [...], "total": t}``.
        summary_bytes_per_task: mean ``Estimator.nbytes`` of a task's summary.
        hyperparameters: the run's settings.
        torch_threads: torch CPU threads (``None`` in files that did not record them).
        device: the device the seeds ran on (merged runs: every device, joined by " + ").
        devices: merged runs: each seed's device.
        merged_from: merged runs: the run directories combined.
        schema_version: the results.json layout (see :mod:`fsd_experiments.compat`).
        fsd_version: the version of fsd that wrote the file (``None``: unrecorded).
        torch_version: the version of torch that ran it (``None``: unrecorded).
        cpu: the CPU model and the vector instructions torch's kernels used
            (:func:`fsd_experiments.devices.cpu_name`; merged runs: each distinct one,
            joined by " + "; ``None``: unrecorded). CPU runs repeat to the digit only on
            the same one.
    """

    benchmark: str
    method: str
    seeds: list[int]
    seeds_requested: list[int]
    complete: bool
    accuracy_matrix: dict[str, list[list[float]]]
    avg_accuracy: dict[str, Any]
    backward_transfer: dict[str, Any]
    wall_seconds: dict[str, Any]
    summary_bytes_per_task: float
    hyperparameters: Hyperparameters
    torch_threads: int | None
    device: str
    devices: dict[str, str] | None = None
    merged_from: list[str] | None = None
    schema_version: int = CL_RESULTS_SCHEMA
    fsd_version: str | None = __version__
    torch_version: str | None = torch.__version__
    cpu: str | None = None

    @classmethod
    def collect(cls, benchmark: str, method: str, hp: Hyperparameters, seeds: Sequence[int],
                done: Sequence[SeedResult], device: str | torch.device = "cpu") -> RunResults:
        """The results of the finished seeds ``done`` of a run asked for ``seeds``."""
        matrices = [r.matrix for r in done]
        bytes_per_task = [float(np.mean(r.summary_bytes)) if r.summary_bytes else 0.0
                          for r in done]
        return cls(
            benchmark=benchmark,
            method=method,
            seeds=[r.seed for r in done],
            seeds_requested=list(seeds),
            complete=len(done) == len(seeds),
            accuracy_matrix={str(r.seed): r.matrix for r in done},
            avg_accuracy=accuracy_summary([average_accuracy(m) for m in matrices]),
            backward_transfer=accuracy_summary([backward_transfer(m) for m in matrices]),
            wall_seconds={"per_seed": [r.wall_seconds for r in done],
                          "total": float(sum(r.wall_seconds for r in done))},
            summary_bytes_per_task=float(np.mean(bytes_per_task)) if bytes_per_task else 0.0,
            hyperparameters=hp,
            torch_threads=torch.get_num_threads(),
            device=device_name(device),
            cpu=cpu_name(),
        )

    def to_json(self) -> dict[str, Any]:
        """The results.json dictionary (``devices`` and ``merged_from`` only when merged)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hyperparameters"] = self.hyperparameters.to_dict()
        for key in ("devices", "merged_from"):
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any],
                  source: str | os.PathLike = "results.json") -> RunResults:
        """Read a results.json dictionary, also one written by an older version.

        Raises:
            ResultsFormatError: what :func:`check_results` refuses, naming ``source``.
        """
        check_results(raw, source)
        current = cl_results(raw)
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in current.items() if k in names}
        try:
            values["hyperparameters"] = Hyperparameters.from_dict(current["hyperparameters"])
        except (ValueError, TypeError) as error:
            raise ResultsFormatError(f"{source}: not a valid fsd cl results file: "
                                     f"{error}") from None
        return cls(**values)

    @classmethod
    def read(cls, path: str | os.PathLike) -> RunResults:
        """Read a results.json file (refused, naming it, if it is not valid JSON or results)."""
        return cls.from_json(read_json(path), path)


class ResultsFormatError(ValueError):
    """A results.json that is not a valid ``fsd cl`` results file; the message names it."""


def _number(value: Any) -> TypeGuard[float]:
    # a finite int or float; bool is an int to Python but not a number here
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _seed_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value)


def _results_problem(raw: Any) -> str | None:
    """What makes ``raw`` not an ``fsd cl`` results dictionary, or ``None``."""
    if not isinstance(raw, Mapping):
        return f"expected a JSON object, got {type(raw).__name__}"
    required = ("benchmark", "method", "seeds", "accuracy_matrix", "avg_accuracy",
                "backward_transfer", "wall_seconds", "hyperparameters")
    missing = [k for k in required if k not in raw]
    if missing:
        return f"missing {', '.join(missing)}"
    if raw["benchmark"] not in CL_BENCHMARKS:
        return f"unknown benchmark {raw['benchmark']!r}"
    if raw["method"] not in CL_METHODS:
        return f"unknown method {raw['method']!r}"
    seeds = raw["seeds"]
    if not _seed_list(seeds) or not seeds:
        return f"seeds must be a non-empty list of integers, got {seeds!r}"
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:  # each would be counted twice in every mean over seeds
        return f"seeds list {', '.join(map(str, repeated))} twice"
    requested = raw.get("seeds_requested", seeds)
    if not _seed_list(requested) or len(set(requested)) != len(requested) \
            or not set(seeds) <= set(requested):
        return f"seeds_requested {requested!r} must list distinct seeds, the finished ones too"
    if not isinstance(raw.get("complete", True), bool):
        return f"complete must be true or false, got {raw['complete']!r}"
    hp = raw["hyperparameters"]
    if not isinstance(hp, Mapping):
        return "hyperparameters must be an object"
    # the settings every version recorded (older files may lack only those compat fills in)
    for key in ("epochs", "batch_size", "width"):
        value = hp.get(key)
        if not (_number(value) and isinstance(value, int) and value >= 1):
            return f"hyperparameters: {key} must be a positive integer, got {value!r}"
    for key in ("fsd_scale", "lr"):
        value = hp.get(key)
        if not (_number(value) and value >= 0):
            return f"hyperparameters: {key} must be a finite number ≥ 0, got {value!r}"
    value = hp.get("validation")  # absent in older files: the test sets
    if value is not None and not (_number(value) and 0 < value < 1):
        return f"hyperparameters: validation must be null or a fraction in (0, 1), got {value!r}"
    matrices = raw["accuracy_matrix"]
    if not isinstance(matrices, Mapping) or set(matrices) != {str(s) for s in seeds}:
        keys = sorted(matrices) if isinstance(matrices, Mapping) else matrices
        return f"accuracy_matrix must have one matrix per seed {seeds}, has {keys!r}"
    sizes = set()
    for key, matrix in matrices.items():
        if not isinstance(matrix, list) or not matrix or not all(
                isinstance(row, list) and len(row) == len(matrix) for row in matrix):
            return (f"accuracy_matrix[{key!r}] must be a square T × T list of rows (T tasks), "
                    f"got {matrix!r}")
        if not all(_number(v) and 0 <= v <= 100 for row in matrix for v in row):
            return (f"accuracy_matrix[{key!r}] holds a value that is not an accuracy in "
                    f"[0, 100] percent (NaN, inf, null or out of range)")
        sizes.add(len(matrix))
    if len(sizes) > 1:
        return f"accuracy_matrix: the seeds' matrices differ in size {sorted(sizes)}"
    for key in ("avg_accuracy", "backward_transfer", "wall_seconds"):
        summary, stats = raw[key], ("total",) if key == "wall_seconds" else ("mean", "std")
        if not isinstance(summary, Mapping) or not isinstance(summary.get("per_seed"), list) \
                or len(summary["per_seed"]) != len(seeds) \
                or not all(_number(v) for v in summary["per_seed"]) \
                or not all(_number(summary.get(stat)) for stat in stats):
            return (f"{key} must hold per_seed (one finite number per seed) and "
                    f"{' and '.join(stats)}, got {summary!r}")
    if not all(v >= 0 for v in raw["wall_seconds"]["per_seed"]):
        return "wall_seconds per_seed must be ≥ 0"
    size = raw.get("summary_bytes_per_task", 0.0)
    if not (_number(size) and size >= 0):
        return f"summary_bytes_per_task must be a finite number ≥ 0, got {size!r}"
    threads = raw.get("torch_threads")
    if threads is not None and not (isinstance(threads, int) and threads >= 1):
        return f"torch_threads must be a positive integer or null, got {threads!r}"
    cpu = raw.get("cpu")
    if cpu is not None and not (isinstance(cpu, str) and cpu):
        return f"cpu must be a non-empty string or null, got {cpu!r}"
    return None


def check_results(raw: Any, source: str | os.PathLike = "results.json") -> None:
    """Refuse a results dictionary that would read into wrong numbers.

    Checked: the keys every layout has, a known benchmark and method, distinct integer seeds
    (a seed listed twice would count twice), one square matrix of finite accuracies in
    [0, 100] per seed and all of one size, finite per-seed summaries of the right length
    (``avg_accuracy: null`` is refused, not printed), non-negative wall times and sizes.

    Raises:
        ResultsFormatError: ``"<source>: not a valid fsd cl results file: <what>"``.
    """
    problem = _results_problem(raw)
    if problem:
        raise ResultsFormatError(f"{source}: not a valid fsd cl results file: {problem}")


def _pm(summary: dict, digits: int = 2) -> str:
    if len(summary["per_seed"]) > 1:
        return f"{summary['mean']:.{digits}f} ± {summary['std']:.{digits}f}"
    return f"{summary['mean']:.{digits}f}"


def _mean_matrix(results: RunResults) -> np.ndarray:
    return np.mean([np.asarray(m, dtype=float) for m in results.accuracy_matrix.values()],
                   axis=0)


def results_markdown(results: RunResults) -> str:
    """A markdown page for one run: summary line, hyper-parameters, mean accuracy matrix."""
    r = _mean_matrix(results)
    hp = results.hyperparameters.to_dict()
    lines = [f"# {results.method} on {results.benchmark}", "",
             f"seeds {results.seeds}" + ("" if results.complete else
                                         f" (of {results.seeds_requested}, running)"),
             "", "| avg accuracy (%) | BWT (%) | summary bytes/task | wall (s) |",
             "|---:|---:|---:|---:|",
             f"| {_pm(results.avg_accuracy)} | {_pm(results.backward_transfer)} | "
             f"{results.summary_bytes_per_task:,.0f} | "
             f"{results.wall_seconds['total']:.0f} |", "",
             "Hyper-parameters: " + ", ".join(f"{k}={v}" for k, v in hp.items()), "",
             "Accuracy matrix R[i][j] (mean over seeds; row: after training task i, column: "
             "task j):", "",
             "| after \\ on | " + " | ".join(str(j + 1) for j in range(r.shape[1])) + " |",
             "|---|" + "---:|" * r.shape[1]]
    for i, row in enumerate(r):
        lines.append(f"| {i + 1} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    return "\n".join(lines) + "\n"


def _plot(results: RunResults, out: Path) -> list[Path]:
    plt = pyplot()
    r = _mean_matrix(results)
    t = r.shape[0]
    title = f"{results.method} on {results.benchmark}"
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * t, 0.8 + 0.6 * t))
    shown = np.where(np.tril(np.ones_like(r)) > 0, r, np.nan)  # future tasks are untrained
    image = ax.imshow(shown, vmin=min(50.0, float(np.nanmin(shown))), vmax=100, cmap="viridis")
    for i in range(t):
        for j in range(i + 1):
            ax.text(j, i, f"{r[i, j]:.1f}", ha="center", va="center", fontsize=7,
                    color="k" if r[i, j] > 85 else "w")  # readable on the yellow end
    ax.set_xticks(range(t), [str(j + 1) for j in range(t)])
    ax.set_yticks(range(t), [str(i + 1) for i in range(t)])
    ax.set_xlabel("evaluated on task")
    ax.set_ylabel("after training task")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    heatmap = out / "accuracy_matrix.png"
    write_figure(fig, heatmap, dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for j in range(t):
        ax.plot(range(j + 1, t + 1), r[j:, j], marker="o", label=f"task {j + 1}")
    ax.plot(range(1, t + 1), [r[i, :i + 1].mean() for i in range(t)], "k--", lw=2,
            label="mean so far")
    ax.set_xticks(range(1, t + 1))
    ax.set_xlabel("tasks trained")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    curves = out / "task_accuracy.png"
    write_figure(fig, curves, dpi=120)
    return [heatmap, curves]


def write_results(results: RunResults, out: str | os.PathLike, plots: bool = True) -> None:
    """Write ``results.json``, ``results.md`` (atomically) and, optionally, the PNG plots."""
    out = Path(out)
    write_json(out / "results.json", results.to_json(), indent=1)
    atomic_write_text(out / "results.md", results_markdown(results))
    if plots:
        _plot(results, out)
