"""Continual learning with FSD regularization (paper §5.1, eq. 3): the ``fsd cl`` harness.

Training on task t minimizes ``loss_t(θ) + λ · Σ_{i<t} D_i(θ)``, where ``D_i`` is an FSD
estimator fitted at the end of task i (a snapshot θ_i plus its summary of task i's data).

Benchmarks (paper appendix "Continual Learning — Experimental Details"):

- ``split-mnist``: 5 binary tasks (0/1, 2/3, 4/5, 6/7, 8/9), multi-head: one model with 2
  outputs per task (10 in all); task i is trained and evaluated on outputs ``2i, 2i+1`` and its
  sampled and coreset summaries are fitted with ``outputs=[2i, 2i+1]``; BGLN-D's covers all
  10 logits, as the authors' ``determ_fsd`` (``penalty_outputs``). Default hidden width 256
  (the FROMP protocol; the authors' example settings use 512, which gave no better BGLN-D
  here, docs/results.md).
- ``split-fashion-mnist``: the same on Fashion-MNIST.
- ``permuted-mnist``: 10 tasks, each a fixed pixel permutation drawn from the seed (task 1 is
  the identity), single head over 10 classes. Default hidden width 512: the authors' example
  settings for this benchmark (``cl_pmnist_cw`` in their ``hp.py``); at FROMP's width 100 no
  BGLN method came near the paper's accuracy (docs/results.md).

The model is an MLP with two hidden ReLU layers. One Adam optimizer trains the whole task
stream, its moment estimates carried from task to task, as the authors' code does
(``optimizer="shared"``; ``"per-task"`` starts a fresh Adam at every task). The penalty is
λ times the *mean* of the previous tasks' distances, again as the authors' code
(``fsd /= tid``), which is what the paper's λ values were tuned for; ``penalty="sum"`` gives
eq. 3's plain sum. The Monte Carlo methods (LAFTR, BGLN-S and their variants) measure the
Euclidean distance between *softmax* outputs by default, as the authors' BGLN-S code does
(the paper's text says logits; its λ was tuned with the code); ``metric="euclidean"`` uses
logits. BGLN-D always uses logits. A checkpoint holds the model, the optimizer, the finished
accuracy rows, the shuffling generator's state and the saved summaries. After every task the run writes
``DIR/checkpoints/seed<S>/state.pt`` atomically (temporary file + ``os.replace``); the same
command again resumes after the last finished task.

Metrics: ``R[i][j]`` = test accuracy (%) on task j after training task i; average final
accuracy = mean_j R[T-1][j]; backward transfer = 1/(T-1) Σ_{i<T-1} (R[T-1][i] − R[i][i]).
Across seeds we report mean and population standard deviation (``numpy.std``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fsd.estimator import Estimator, atomic_torch_save, load
from fsd.exact import ExactFSD
from fsd.metrics import METRICS, check_metric
from fsd.statistics import StatisticsCollector
from fsd.summary_set import combine

from .benchmarks import CL_BENCHMARKS, Task, make_tasks
from .data import TensorBatches
from .devices import device_name, resolve_device
from .io import atomic_write_text, write_json
from .models import mlp
from .plotting import pyplot
from .presets import CL_METHODS, PRESETS, SOFTMAX_FAMILIES, Preset, default_hyperparameters
from .training import LossFn, train

__all__ = [
    "BENCHMARKS", "METHODS", "PAPER", "Task", "accuracy_summary", "add_cli",
    "average_accuracy", "backward_transfer", "default_hyperparameters", "gap_markdown",
    "make_tasks", "merge_runs", "penalty_gap", "penalty_weights", "report", "resolve_device",
    "results_markdown", "run_continual", "run_seed", "write_results",
]

BENCHMARKS: tuple[str, ...] = CL_BENCHMARKS
CHECKPOINT_VERSION = 2
OPTIMIZER_MODES: tuple[str, ...] = ("shared", "per-task")
PENALTY_MODES: tuple[str, ...] = ("mean", "sum")
PENALTY_OUTPUTS: tuple[str, ...] = ("head", "all")


class CheckpointMismatchError(RuntimeError):
    """A run directory holds a checkpoint written with other settings than those asked for."""


# ------------------------------------------------------------------------------------------
# Methods
# ------------------------------------------------------------------------------------------


#: the methods of ``fsd cl``, by name (see :mod:`fsd_experiments.presets`)
METHODS: dict[str, Preset] = {name: PRESETS[name] for name in CL_METHODS}


# ------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------
# Training loop
# ------------------------------------------------------------------------------------------


def _head(logits: Tensor, task: Task) -> Tensor:
    return logits if task.outputs is None else logits[:, task.outputs]


@torch.no_grad()
def _accuracy(model: nn.Module, task: Task, device: torch.device) -> float:
    model.eval()
    correct = 0
    for i in range(0, task.x_test.shape[0], 2048):
        x = task.x_test[i:i + 2048].to(device)
        y = task.y_test[i:i + 2048].to(device)
        correct += int((_head(model(x), task).argmax(-1) == y).sum())
    model.train()
    return 100.0 * correct / task.x_test.shape[0]


def _fit_summary(method: str, hp: dict, model: nn.Module, task: Task,
                 collector: StatisticsCollector | None, seed: int) -> Estimator:
    """Fit task ``task``'s estimator at the model's current parameters."""
    spec = METHODS[method]
    estimator = spec.continual_estimator(hp, seed)
    gen = torch.Generator().manual_seed(seed)  # coreset / Fisher subset of this task
    data: Any = None
    if method == "exact-coreset":
        # a random coreset of the task's training inputs, stored in full by ExactFSD
        idx = torch.randperm(task.x_train.shape[0], generator=gen)[:hp["coreset_size"]]
        data = task.x_train[idx]
    elif method == "ewc":
        # the Fisher needs per-example gradients: a random subset keeps fit time bounded
        idx = torch.randperm(task.x_train.shape[0], generator=gen)[:hp["fisher_samples"]]
        data = TensorBatches(task.x_train[idx], task.y_train[idx], 256)
    elif spec.needs_data:
        data = TensorBatches(task.x_train, task.y_train, 1024)
    return estimator.fit(model, data, outputs=summary_outputs(task, hp),
                         statistics=collector)


class _LastEpochRecorder:
    """The data loss of one task, recording the summary's statistics in the last epoch."""

    def __init__(self, collector: StatisticsCollector | None, epochs: int,
                 classwise: bool) -> None:
        self.collector, self.epochs, self.classwise = collector, epochs, classwise
        self.recording = False

    def start_epoch(self, epoch: int) -> None:
        """Record during the last epoch only (when there is a collector)."""
        self.recording = self.collector is not None and epoch == self.epochs - 1

    def head_loss(self, task: Task) -> LossFn:
        """Cross-entropy on ``task``'s head; the forward pass is recorded when asked."""
        def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            if self.recording and self.collector is not None:
                with self.collector.record(labels=y if self.classwise else None):
                    logits = model(x)
            else:
                logits = model(x)
            return nn.functional.cross_entropy(_head(logits, task), y)
        return loss


def _with_legacy_outputs(hp: dict, benchmark: str, method: str) -> dict:
    # settings written before ``penalty_outputs`` existed: every summary covered its task's
    # head, which on a single-head benchmark is every logit, whatever the setting says
    legacy = ("head" if benchmark.startswith("split")
              else default_hyperparameters(benchmark, method)["penalty_outputs"])
    return {"penalty_outputs": legacy, **hp}


def summary_outputs(task: Task, hp: dict[str, Any]) -> list[int] | None:
    """The output units task ``task``'s summary covers: its head, or all (``penalty_outputs``)."""
    return None if hp["penalty_outputs"] == "all" else task.outputs


@dataclass
class SeedResult:
    """Outcome of one seed: accuracy matrix rows, wall time and summary sizes."""

    seed: int
    matrix: list[list[float]] = field(default_factory=list)
    wall_seconds: float = 0.0
    summary_bytes: list[int] = field(default_factory=list)


def penalty_weights(num_previous: int, mode: str) -> list[float]:
    """Weights of the previous tasks' distances: ``"mean"`` 1/t each, ``"sum"`` 1 each."""
    if mode not in PENALTY_MODES:
        raise ValueError(f"penalty must be one of {PENALTY_MODES}, got {mode!r}")
    return [1.0 / max(num_previous, 1) if mode == "mean" else 1.0] * num_previous


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_seed(benchmark: str, method: str, hp: dict, seed: int, out: Path,
             data_dir: str | None = None, device: str = "cpu",
             progress: bool = True) -> SeedResult:
    """Train the task stream for one seed, resuming from ``out``'s checkpoint if any."""
    spec = METHODS[method]
    dev = resolve_device(device)
    tasks, n_out = make_tasks(benchmark, data_dir, seed, train_subset=hp["train_subset"],
                              test_subset=hp["test_subset"], num_tasks=hp["tasks"])
    ckpt_dir = out / "checkpoints" / f"seed{seed}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state_path = ckpt_dir / "state.pt"
    torch.manual_seed(seed)
    model = mlp(28 * 28, hp["width"], hp["depth"], n_out).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=hp["lr"])
    shuffle = torch.Generator().manual_seed(seed)
    result = SeedResult(seed)
    start_task = 0
    if state_path.exists():
        # map_location: a run started on a GPU can be resumed on a CPU-only machine
        state = torch.load(state_path, map_location=dev, weights_only=True)
        saved_hp = _with_legacy_outputs(json.loads(state["hyperparameters"]), benchmark,
                                        method)
        if saved_hp != _comparable(hp, benchmark, method):
            raise CheckpointMismatchError(
                f"{state_path} was written with other settings ({saved_hp}); use another --out "
                f"or delete {ckpt_dir} to start over")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        shuffle.set_state(state["shuffle_state"].cpu())
        result.matrix = [list(map(float, row)) for row in state["matrix"].tolist()]
        result.wall_seconds = float(state["wall_seconds"])
        result.summary_bytes = [int(b) for b in state["summary_bytes"].tolist()]
        start_task = len(result.matrix)
        if start_task < len(tasks):
            _log(f"[{method} seed {seed}] resuming after task {start_task}/{len(tasks)}")
    for t in range(start_task, len(tasks)):
        task = tasks[t]
        began = time.perf_counter()
        # summaries are always read back from disk, also in an uninterrupted run, so that a
        # resumed run sees estimators in exactly the same state (their sampling RNG included)
        previous = [load(ckpt_dir / f"task{i}.fsd", map_location=dev) for i in range(t)] \
            if spec.estimator is not None else []
        # one penalty object: BGLN-D summaries of all previous tasks evaluate in one pass
        penalty = combine(previous, penalty_weights(len(previous), hp["penalty"]))
        last_task = t == len(tasks) - 1
        collector = None
        if spec.estimator is not None and not last_task and (spec.moments or spec.gates):
            collector = StatisticsCollector(model, moments=spec.moments, gates=spec.gates,
                                            momentum=hp["momentum"],
                                            layer_moments=spec.layer_moments)
        if hp["optimizer"] == "per-task":
            optimizer = torch.optim.Adam(model.parameters(), lr=hp["lr"])
        batches = TensorBatches(task.x_train, task.y_train, hp["batch_size"], shuffle=True,
                                generator=shuffle)
        recording = _LastEpochRecorder(collector, hp["epochs"], spec.classwise)
        train(model, batches, recording.head_loss(task), optimizer, epochs=hp["epochs"],
              penalty=penalty.distance if previous else None, weight=hp["fsd_scale"],
              on_epoch=recording.start_epoch, device=dev, progress=progress,
              desc=f"{method} seed {seed} task {t + 1}/{len(tasks)}", mininterval=2.0)
        row = [_accuracy(model, other, dev) for other in tasks]
        if spec.estimator is not None and not last_task:
            estimator = _fit_summary(method, hp, model, task, collector, seed * 100 + t)
            estimator.save(ckpt_dir / f"task{t}.fsd")
            result.summary_bytes.append(int(estimator.nbytes))
        if collector is not None:
            collector.remove()
        result.matrix.append(row)
        result.wall_seconds += time.perf_counter() - began
        atomic_torch_save({
            "version": CHECKPOINT_VERSION,
            "hyperparameters": json.dumps(_comparable(hp, benchmark, method)),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "shuffle_state": shuffle.get_state(),
            "matrix": torch.tensor(result.matrix, dtype=torch.float64),
            "wall_seconds": torch.tensor(result.wall_seconds, dtype=torch.float64),
            "summary_bytes": torch.tensor(result.summary_bytes, dtype=torch.int64),
        }, state_path)
        _log(f"[{method} seed {seed}] task {t + 1}/{len(tasks)} ({task.name}) "
             f"{time.perf_counter() - began:.0f}s: acc " + " ".join(
                 f"{a:.2f}" for a in row[:t + 1]))
    return result


def _comparable(hp: dict, benchmark: str, method: str) -> dict:
    """The settings a checkpoint must agree with to be resumed."""
    return json.loads(json.dumps({"benchmark": benchmark, "method": method, **hp}))


def run_continual(benchmark: str, method: str, seeds: Sequence[int], out: str | os.PathLike,
                  *, data_dir: str | None = None, device: str = "cpu", progress: bool = True,
                  plots: bool = True, **overrides: Any) -> dict:
    """Run ``method`` on ``benchmark`` for each seed; write results into ``out``.

    Keyword overrides replace entries of :func:`default_hyperparameters` (``None`` = keep the
    default). ``DIR/results.json`` and ``results.md`` are rewritten after every finished seed
    (``"complete": false`` until all seeds are done). Returns the results dictionary.
    """
    hp = default_hyperparameters(benchmark, method)
    unknown = set(overrides) - set(hp)
    if unknown:
        raise ValueError(f"unknown hyper-parameters {sorted(unknown)}")
    hp.update({k: v for k, v in overrides.items() if v is not None})
    if hp["optimizer"] not in OPTIMIZER_MODES:
        raise ValueError(f"optimizer must be one of {OPTIMIZER_MODES}, got {hp['optimizer']!r}")
    if hp["penalty"] not in PENALTY_MODES:
        raise ValueError(f"penalty must be one of {PENALTY_MODES}, got {hp['penalty']!r}")
    if hp["penalty_outputs"] not in PENALTY_OUTPUTS:
        raise ValueError(f"penalty_outputs must be one of {PENALTY_OUTPUTS}, "
                         f"got {hp['penalty_outputs']!r}")
    if hp["metric"] is not None and hp["metric"] != default_hyperparameters(benchmark,
                                                                           method)["metric"]:
        sampled = [m for m, spec in METHODS.items() if spec.family in SOFTMAX_FAMILIES]
        if method not in sampled:
            raise ValueError(f"metric applies to the Monte Carlo methods {sorted(sampled)}, "
                             f"not {method!r}")
        check_metric(hp["metric"])
    if hp["rank"] is not None:
        if METHODS[method].moments != "full" or METHODS[method].estimator is None:
            raise ValueError(f"rank applies to BGLN/LAFTR methods with full input moments, "
                             f"not {method!r}")
        if hp["rank"] < 1:
            raise ValueError(f"rank must be positive, got {hp['rank']}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done: list[SeedResult] = []
    results: dict = {}
    for seed in seeds:
        done.append(run_seed(benchmark, method, hp, seed, out, data_dir, device, progress))
        results = _results_dict(benchmark, method, hp, list(seeds), done, device)
        write_results(results, out, plots=plots and len(done) == len(seeds))
    return results


def _results_dict(benchmark: str, method: str, hp: dict, seeds: list[int],
                  done: list[SeedResult], device: str | torch.device = "cpu") -> dict:
    matrices = [r.matrix for r in done]
    bytes_per_task = [float(np.mean(r.summary_bytes)) if r.summary_bytes else 0.0 for r in done]
    return {
        "benchmark": benchmark,
        "method": method,
        "seeds": [r.seed for r in done],
        "seeds_requested": seeds,
        "complete": len(done) == len(seeds),
        "accuracy_matrix": {str(r.seed): r.matrix for r in done},
        "avg_accuracy": accuracy_summary([average_accuracy(m) for m in matrices]),
        "backward_transfer": accuracy_summary([backward_transfer(m) for m in matrices]),
        "wall_seconds": {"per_seed": [r.wall_seconds for r in done],
                         "total": float(sum(r.wall_seconds for r in done))},
        "summary_bytes_per_task": float(np.mean(bytes_per_task)) if bytes_per_task else 0.0,
        "hyperparameters": hp,
        "torch_threads": torch.get_num_threads(),
        "device": device_name(device),
    }


# ------------------------------------------------------------------------------------------
# Output: JSON, markdown, plots
# ------------------------------------------------------------------------------------------


def _pm(summary: dict, digits: int = 2) -> str:
    if len(summary["per_seed"]) > 1:
        return f"{summary['mean']:.{digits}f} ± {summary['std']:.{digits}f}"
    return f"{summary['mean']:.{digits}f}"


def _mean_matrix(results: dict) -> np.ndarray:
    return np.mean([np.asarray(m, dtype=float) for m in results["accuracy_matrix"].values()],
                   axis=0)


def results_markdown(results: dict) -> str:
    """A markdown page for one run: summary line, hyper-parameters, mean accuracy matrix."""
    r = _mean_matrix(results)
    hp = results["hyperparameters"]
    lines = [f"# {results['method']} on {results['benchmark']}", "",
             f"seeds {results['seeds']}" + ("" if results["complete"] else
                                            f" (of {results['seeds_requested']}, running)"),
             "", "| avg accuracy (%) | BWT (%) | summary bytes/task | wall (s) |",
             "|---:|---:|---:|---:|",
             f"| {_pm(results['avg_accuracy'])} | {_pm(results['backward_transfer'])} | "
             f"{results['summary_bytes_per_task']:,.0f} | "
             f"{results['wall_seconds']['total']:.0f} |", "",
             "Hyper-parameters: " + ", ".join(f"{k}={v}" for k, v in hp.items()), "",
             "Accuracy matrix R[i][j] (mean over seeds; row: after training task i, column: "
             "task j):", "",
             "| after \\ on | " + " | ".join(str(j + 1) for j in range(r.shape[1])) + " |",
             "|---|" + "---:|" * r.shape[1]]
    for i, row in enumerate(r):
        lines.append(f"| {i + 1} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    return "\n".join(lines) + "\n"


def _plot(results: dict, out: Path) -> list[Path]:
    plt = pyplot()
    r = _mean_matrix(results)
    t = r.shape[0]
    title = f"{results['method']} on {results['benchmark']}"
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
    fig.savefig(heatmap, dpi=120)
    plt.close(fig)

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
    fig.savefig(curves, dpi=120)
    plt.close(fig)
    return [heatmap, curves]


def write_results(results: dict, out: str | os.PathLike, plots: bool = True) -> None:
    """Write ``results.json``, ``results.md`` (atomically) and, optionally, the PNG plots."""
    out = Path(out)
    write_json(out / "results.json", results, indent=1)
    atomic_write_text(out / "results.md", results_markdown(results))
    if plots:
        _plot(results, out)


def merge_runs(paths: Sequence[str | os.PathLike], out: str | os.PathLike,
               plots: bool = True, partial: bool = False) -> dict:
    """Combine runs of the same benchmark, method and settings made separately (seeds run in
    parallel, on other machines) into one ``out/results.json`` with statistics over all seeds.

    Raises ``ValueError`` if the runs differ in benchmark, method or hyper-parameters (a
    setting absent from an older run's file counts as ``None``, its default), are unfinished,
    or repeat a seed. ``partial=True`` accepts runs stopped before all their requested seeds
    and takes the seeds they finished (a results.json only ever lists finished seeds). Each
    run's device is kept per seed (``devices``).
    """
    runs = []
    for path in paths:
        file = Path(path) / "results.json"
        if not file.is_file():
            raise ValueError(f"{file} not found: merge takes finished run directories")
        runs.append((file, json.loads(file.read_text())))
    if not runs:
        raise ValueError("merge needs at least one run directory")
    first_file, first = runs[0]
    done: list[SeedResult] = []
    devices: list[str] = []
    def settings(results: dict, key: str) -> Any:
        if key != "hyperparameters":
            return results[key]
        # a setting added after a run was made is absent from its file; its default is None
        return {k: v for k, v in results[key].items() if v is not None}

    for file, results in runs:
        for key in ("benchmark", "method", "hyperparameters"):
            if settings(results, key) != settings(first, key):
                raise ValueError(f"{file} differs from {first_file} in {key}: "
                                 f"{results[key]!r} vs {first[key]!r}")
        if not results.get("complete", True) and not partial:
            raise ValueError(f"{file} is unfinished (complete: false); finish it first, or "
                             "take its finished seeds with partial=True (--partial)")
        bytes_per_task = results.get("summary_bytes_per_task", 0.0)
        for seed, wall in zip(results["seeds"], results["wall_seconds"]["per_seed"]):
            if any(r.seed == seed for r in done):
                raise ValueError(f"seed {seed} appears twice (again in {file})")
            # the per-task sizes are not stored per seed; their mean is what results keep
            done.append(SeedResult(seed, results["accuracy_matrix"][str(seed)], float(wall),
                                   [int(bytes_per_task)] if bytes_per_task else []))
            devices.append(results.get("device", "cpu"))
    merged = _results_dict(first["benchmark"], first["method"], first["hyperparameters"],
                           [r.seed for r in done], done, "cpu")
    merged["device"] = " + ".join(sorted(set(devices)))
    merged["devices"] = {str(r.seed): d for r, d in zip(done, devices)}
    merged["merged_from"] = [str(Path(p)) for p in paths]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_results(merged, out, plots=plots)
    return merged


# ------------------------------------------------------------------------------------------
# Report across runs
# ------------------------------------------------------------------------------------------

# The paper's numbers (tables "avg_mnist" and "bwt_mnist"), verbatim; methods/benchmarks the
# tables do not give are absent.
PAPER: dict[str, dict[str, dict[str, str]]] = {
    "avg": {
        "split-mnist": {
            "ntk": "99.50 ± 0.09", "bgln-s-coreset": "99.50 ± 0.03", "ewc": "63.10",
            "bgln-d": "99.72 ± 0.03", "bgln-d-cw": "99.78 ± 0.02", "bgln-s": "99.64 ± 0.04",
            "bgln-s-cw": "99.77 ± 0.05", "bgln-d-var": "99.64 ± 0.04",
            "bgln-s-var": "99.50 ± 0.03"},
        "permuted-mnist": {
            "ntk": "96.46 ± 0.11", "bgln-s-coreset": "96.36 ± 0.13", "ewc": "84.00",
            "bgln-d": "96.03 ± 0.20", "bgln-d-cw": "96.85 ± 0.02", "bgln-s": "96.36 ± 0.12",
            "bgln-s-cw": "96.99 ± 0.07", "bgln-d-var": "94.98 ± 0.18",
            "bgln-s-var": "96.36 ± 0.13"},
    },
    "bwt": {
        "split-mnist": {"bgln-s": "-0.04 ± 0.03", "bgln-d": "-0.09 ± 0.04",
                        "bgln-s-cw": "-0.18 ± 0.06", "bgln-d-cw": "-0.07 ± 0.07"},
        "permuted-mnist": {"bgln-s": "-0.41 ± 0.08", "bgln-d": "-0.56 ± 0.04",
                           "bgln-s-cw": "-0.37 ± 0.14", "bgln-d-cw": "-1.17 ± 0.07"},
    },
}


def _find_results(paths: Sequence[str]) -> list[Path]:
    found: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_file():
            found.append(path)
        elif (path / "results.json").is_file():
            found.append(path / "results.json")
        else:
            found += sorted(Path(f) for f in glob.glob(str(path / "**" / "results.json"),
                                                       recursive=True))
    return found


def _protocol(results: dict) -> str:
    # results written before these settings existed used a fresh Adam per task and the sum
    hp = {"optimizer": "per-task", "penalty": "sum", **_with_legacy_outputs(
        results["hyperparameters"], results["benchmark"], results["method"])}
    paper = default_hyperparameters(results["benchmark"], results["method"])
    parts = [f"{hp['epochs']} ep", f"bs {hp['batch_size']}", f"λ {hp['fsd_scale']:g}",
             f"lr {hp['lr']:g}", f"w {hp['width']}"]
    changed = [k for k in ("epochs", "batch_size", "fsd_scale", "lr", "width", "train_subset",
                           "test_subset", "tasks", "optimizer", "penalty", "rank", "metric",
                           "penalty_outputs")
               if hp.get(k) != paper.get(k)]
    if hp["optimizer"] != paper["optimizer"]:
        parts.append(f"{hp['optimizer']} Adam")
    if hp["penalty"] != paper["penalty"]:
        parts.append(f"penalty {hp['penalty']}")
    if hp["penalty_outputs"] != paper["penalty_outputs"]:
        parts.append(f"{hp['penalty_outputs']} logits")
    if hp.get("rank"):
        parts.append(f"lowrank r={hp['rank']}")
    if hp.get("metric") != paper.get("metric"):
        parts.append(f"metric {hp.get('metric') or 'euclidean'}")
    if hp.get("train_subset"):
        parts.append(f"train {hp['train_subset']}/task")
    if hp.get("tasks"):
        parts.append(f"{hp['tasks']} tasks")
    if results.get("device", "cpu") != "cpu":
        parts.append(f"on {results['device']}")
    return ", ".join(parts) + (" (**not paper protocol**: " + ", ".join(changed) + ")"
                               if changed else "")


def report(paths: Sequence[str]) -> str:
    """One markdown table comparing runs (method × benchmark) next to the paper's numbers."""
    rows = []
    for path in _find_results(paths):
        results = json.loads(path.read_text())
        if not {"benchmark", "method", "accuracy_matrix"} <= set(results):
            continue  # another tool's results.json (e.g. fsd influence) under the same folder
        rows.append((results["benchmark"], results["method"], path, results))
    rows.sort(key=lambda r: (r[0], r[1], str(r[2])))
    lines = [
        "| benchmark | method | seeds | avg acc (%) | paper avg acc | BWT (%) | paper BWT | "
        "summary bytes/task | wall time | protocol | run |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for bench, method, path, res in rows:
        seeds = ",".join(map(str, res["seeds"]))
        if not res.get("complete", True):
            seeds += f" (of {len(res['seeds_requested'])})"
        wall = res["wall_seconds"]
        per = np.mean(wall["per_seed"]) if wall["per_seed"] else 0.0
        lines.append(
            f"| {bench} | {method} | {seeds} | {_pm(res['avg_accuracy'])} | "
            f"{PAPER['avg'].get(bench, {}).get(method, '–')} | "
            f"{_pm(res['backward_transfer'])} | {PAPER['bwt'].get(bench, {}).get(method, '–')} | "
            f"{res['summary_bytes_per_task']:,.0f} | {per / 60:.1f} min/seed | "
            f"{_protocol(res)} | `{path.parent}` |")
    if len(lines) == 2:
        lines.append("| (no results.json found) |||||||||||")
    notes = [
        "", "avg acc: mean test accuracy over all tasks after the last task; BWT: "
        "(1/(T−1)) Σ_{i<T} (R[T,i] − R[i,i]), in accuracy points. ± is the standard deviation "
        "over seeds (numpy.std). Wall time: training + evaluation + summary fitting per seed, "
        "1 CPU thread, or the GPU named in the protocol column (\"on …\"). summary "
        "bytes/task: `Estimator.nbytes` (θ copy + statistics or coreset) per finished task. "
        "Paper numbers: tables `avg_mnist` and `bwt_mnist` of the paper (– = not reported "
        "there)."]
    return "\n".join(lines + notes) + "\n"


def penalty_gap(run_dir: str | os.PathLike, data_dir: str | None = None,
                examples: int = 10_000) -> list[dict[str, Any]]:
    """How well each stored summary tracks the FSD it was meant to bound, at the end of a run.

    For every seed's final model (``checkpoints/seed<S>/state.pt``) and every previous task t,
    compares the summary's estimate D_t(θ_final) with the true FSD between θ_t (the summary's
    reference) and θ_final over task t's first ``examples`` training inputs, in the summary's
    own metric and outputs. An estimate far below the truth means training found directions
    the penalty does not see (e.g. ReLU gates that flip, which a linearization cannot show).

    Returns one row per (seed, task): ``seed, task, true_fsd, estimate, ratio``.
    """
    run = Path(run_dir)
    results = json.loads((run / "results.json").read_text())
    hp, benchmark = results["hyperparameters"], results["benchmark"]
    rows: list[dict[str, Any]] = []
    for seed in results["seeds"]:
        ckpt = run / "checkpoints" / f"seed{seed}"
        tasks, n_out = make_tasks(benchmark, data_dir, int(seed),
                                  train_subset=hp["train_subset"], test_subset=hp["test_subset"],
                                  num_tasks=hp["tasks"])
        final = mlp(28 * 28, hp["width"], hp["depth"], n_out)
        final.load_state_dict(torch.load(ckpt / "state.pt", weights_only=True)["model"])
        for t in range(len(tasks) - 1):
            path = ckpt / f"task{t}.fsd"
            if not path.exists():
                continue
            summary = load(path)
            reference = mlp(28 * 28, hp["width"], hp["depth"], n_out)
            reference.load_state_dict(summary.reference_state_dict())
            x = tasks[t].x_train[:examples]
            outputs = summary_outputs(tasks[t],
                                      _with_legacy_outputs(hp, benchmark, results["method"]))
            truth = ExactFSD(metric=summary.config.get("metric", "euclidean")).fit(
                reference, x, outputs=outputs)
            with torch.no_grad():
                true_fsd = float(truth.distance(final))
                estimate = float(summary.distance(final))
            rows.append({"seed": int(seed), "task": t + 1, "true_fsd": true_fsd,
                         "estimate": estimate,
                         "ratio": estimate / true_fsd if true_fsd > 0 else math.nan})
    return rows


def gap_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of :func:`penalty_gap` rows."""
    lines = ["| seed | task | true FSD | summary's estimate | estimate / true |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['seed']} | {r['task']} | {r['true_fsd']:.3g} | {r['estimate']:.3g} | "
              f"{r['ratio']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.benchmark or not args.method or not args.out:
        print("error: fsd cl needs --benchmark, --method and --out (or: fsd cl report DIR...)",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        results = run_continual(
            args.benchmark, args.method, args.seeds, args.out, data_dir=args.data_dir,
            device=args.device, progress=not args.no_progress, plots=not args.no_plots,
            epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
            fsd_scale=args.fsd_scale, width=args.width, momentum=args.momentum,
            coreset_size=args.coreset_size, num_samples=args.num_samples,
            train_subset=args.train_subset, test_subset=args.test_subset, tasks=args.tasks,
            optimizer=args.optimizer, penalty=args.penalty, rank=args.rank,
            metric=args.metric, penalty_outputs=args.penalty_outputs)
    except CheckpointMismatchError as error:  # a message, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(results_markdown(results))
    print(f"wrote {Path(args.out) / 'results.json'}, results.md"
          + ("" if args.no_plots else ", accuracy_matrix.png, task_accuracy.png"))
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    merged = merge_runs(args.dirs, args.out, plots=not args.no_plots, partial=args.partial)
    print(results_markdown(merged))
    print(f"wrote {Path(args.out) / 'results.json'} (seeds {merged['seeds']})")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    table = report(args.dirs)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = ("# Continual learning results\n\nProduced by `fsd cl report "
                  + " ".join(args.dirs) + "`.\n\n")
        atomic_write_text(out, header + table)
        print(f"wrote {out}")
    return 0


def _cmd_gap(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    print(gap_markdown(penalty_gap(args.dir, args.data_dir, args.examples)))
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fsd cl`` (run a benchmark) and ``fsd cl report`` to the ``fsd`` command."""
    cl = subparsers.add_parser(
        "cl", help="continual learning benchmarks (Split/Permuted MNIST) with FSD penalties",
        description="Run a continual-learning benchmark, or `fsd cl report DIR...`. "
                    "Hyper-parameters default to the paper's for the (benchmark, method).")
    cl.add_argument("--benchmark", choices=BENCHMARKS)
    cl.add_argument("--method", choices=list(METHODS))
    cl.add_argument("--seeds", type=int, nargs="+", default=[20, 21, 22])
    cl.add_argument("--out", help="output directory (results, plots, checkpoints)")
    cl.add_argument("--data-dir", default=None,
                    help="data directory (default: $FSD_DATA_DIR, else ~/.cache/fsd/data)")
    paper = "(default: the paper's for the benchmark and method)"
    for name, kind, what in [
            ("--epochs", int, f"epochs per task {paper}"),
            ("--lr", float, f"Adam learning rate {paper}"),
            ("--batch-size", int, f"batch size {paper}"),
            ("--fsd-scale", float, f"penalty weight λ {paper}"),
            ("--width", int, "hidden width (default: split 256, permuted 512)"),
            ("--momentum", float, "EMA momentum of the gate frequencies, the weight kept on "
             "the past (default: running mean, which is the paper's 1/batch_size)"),
            ("--coreset-size", int, "coreset points per task (default 40)"),
            ("--num-samples", int, "Monte Carlo samples per BGLN-S/LAFTR distance call "
             "(default 32)"),
            ("--train-subset", int, "random training examples kept per task (tiny runs)"),
            ("--test-subset", int, "random test examples kept per task (tiny runs)"),
            ("--tasks", int, "use only the first N tasks"),
            ("--rank", int, "store each task's input covariance as its top-r eigenpairs plus "
             "a diagonal (BGLN methods with full moments; default: full covariance)")]:
        cl.add_argument(name, type=kind, default=None, help=what)
    cl.add_argument("--optimizer", choices=OPTIMIZER_MODES, default=None,
                    help="shared: one Adam for the whole stream (default, the authors' code); "
                         "per-task: a fresh Adam at every task")
    cl.add_argument("--penalty", choices=PENALTY_MODES, default=None,
                    help="mean: λ times the mean of the previous tasks' distances (default, "
                         "the authors' code, what the paper's λ was tuned for); sum: eq. 3")
    cl.add_argument("--penalty-outputs", choices=PENALTY_OUTPUTS, default=None,
                    help="multi-head benchmarks: each summary covers its task's head, or all "
                         "logits (default: all for BGLN-D and its variants, as the authors' "
                         "code; head for the others)")
    cl.add_argument("--metric", default=None, choices=list(METRICS),
                    help="output metric of the Monte Carlo penalties (laftr, bgln-s...; "
                         "default: softmax_euclidean, as the authors' BGLN-S code)")
    cl.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1, so runs can go in parallel)")
    cl.add_argument("--device", default="cpu")
    cl.add_argument("--no-progress", action="store_true", help="no progress bars")
    cl.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    cl.set_defaults(func=_cmd_run)
    cl_sub = cl.add_subparsers(dest="cl_command", metavar="{report,gap,merge}")
    rep = cl_sub.add_parser("report", help="compare finished runs in one markdown table")
    rep.add_argument("dirs", nargs="+", help="run directories (or parents of them)")
    rep.add_argument("--out", default=None, help="write the table here (e.g. docs/results.md)")
    rep.set_defaults(func=_cmd_report)
    gap = cl_sub.add_parser("gap", help="true FSD vs each stored summary's estimate at the "
                                        "end of a finished run")
    gap.add_argument("dir", help="a run directory (with results.json and checkpoints/)")
    gap.add_argument("--data-dir", default=None)
    gap.add_argument("--examples", type=int, default=10_000,
                     help="training inputs per task for the true FSD (10000)")
    gap.add_argument("--threads", type=int, default=1)
    gap.set_defaults(func=_cmd_gap)
    merge = cl_sub.add_parser("merge", help="combine finished runs of the same settings "
                                            "(e.g. seeds run in parallel) into one directory")
    merge.add_argument("dirs", nargs="+", help="finished run directories")
    merge.add_argument("--out", required=True, help="directory for the merged results")
    merge.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    merge.add_argument("--partial", action="store_true",
                       help="accept runs stopped before all their seeds; take the finished ones")
    merge.set_defaults(func=_cmd_merge)
