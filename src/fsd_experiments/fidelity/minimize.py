"""The minimization study: training task 2 with each estimator as the regularizer."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..benchmarks import Benchmark
from ..plotting import pyplot
from .suite import Suite, accuracy, train_steps


def minimization_study(bench: Benchmark, reference: nn.Module, suite: Suite,
                       names: Sequence[str], *, lams: Sequence[float], steps: int, lr: float,
                       batch_size: int, log_every: int, seed: int, progress: bool = False
                       ) -> dict[str, Any]:
    """Train task 2 from θ1 with ``lam * estimate`` as the penalty, per estimator and λ.

    Logs the true FSD from θ1 (full task-1 training set) and task-1/task-2 test accuracy
    every ``log_every`` steps. The estimators are used as in training (fresh samples per
    call). ``"none"`` (no penalty) is run once. All runs see the same minibatch order.
    """
    runs: list[dict[str, Any]] = []
    for name in names:
        for lam in ([0.0] if name == "none" else lams):
            model = copy.deepcopy(reference)
            penalty = None if name == "none" else suite.estimators[name].distance
            log: dict[str, Any] = {"estimator": name, "lam": lam, "step": [], "true_fsd": [],
                                   "task2_accuracy": [], "task1_accuracy": []}

            def record(step: int, model: nn.Module = model, log: dict = log) -> None:
                if step % log_every and step != steps:
                    return
                model.eval()
                with torch.no_grad():
                    log["true_fsd"].append(float(suite.exact.distance(model)))
                log["step"].append(step)
                log["task2_accuracy"].append(accuracy(model, bench.task2.x_test,
                                                      bench.task2.y_test))
                log["task1_accuracy"].append(accuracy(model, bench.task1.x_test,
                                                      bench.task1.y_test))
                model.train()

            start = time.perf_counter()
            train_steps(model, bench.task2.x_train, bench.task2.y_train, lr=lr, steps=steps,
                        batch_size=batch_size, generator=torch.Generator().manual_seed(seed + 7),
                        penalty=penalty, lam=lam, callback=record)
            log["seconds"] = time.perf_counter() - start
            runs.append(log)
            if progress:
                print(f"  minimize {name} λ={lam:g}: final true FSD {log['true_fsd'][-1]:.4g}, "
                      f"task-2 acc {log['task2_accuracy'][-1]:.4f} ({log['seconds']:.0f}s)",
                      flush=True)
    return {"lams": list(lams), "steps": steps, "lr": lr, "runs": runs}


def format_minimization(result: dict[str, Any]) -> str:
    """Markdown table of the end point of each regularized run."""
    lines = ["| regularizer | λ | final true FSD | mean true FSD over run | task-2 test acc | "
             "task-1 test acc | seconds |", "|---|---:|---:|---:|---:|---:|---:|"]
    for c in result["runs"]:
        lines.append(f"| {c['estimator']} | {c['lam']:g} | {c['true_fsd'][-1]:.4g} | "
                     f"{np.mean(c['true_fsd']):.4g} | {c['task2_accuracy'][-1]:.4f} | "
                     f"{c['task1_accuracy'][-1]:.4f} | {c['seconds']:.1f} |")
    return "\n".join(lines)


def minimization_plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Per λ: true FSD from θ1 vs task-2 test accuracy along training.

    One colour per estimator; the unregularized run is in every panel.
    """
    plt = pyplot()
    lams = result["lams"]
    fig, axes = plt.subplots(1, len(lams), figsize=(5.5 * len(lams), 4.5), squeeze=False)
    names = list(dict.fromkeys(c["estimator"] for c in result["runs"]))
    colours = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
    for ax, lam in zip(axes[0], lams, strict=True):
        for c in result["runs"]:
            if c["estimator"] == "none" or c["lam"] == lam:
                ax.plot(c["task2_accuracy"], c["true_fsd"], "-o", ms=3,
                        color=colours[c["estimator"]], label=c["estimator"])
        ax.set_xlabel("task-2 test accuracy")
        ax.set_ylabel("true FSD from θ1")
        ax.set_title(f"λ = {lam:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title} ({result['steps']} steps, points every few iterations)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
