"""The minimization study: training task 2 with each estimator as the regularizer."""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..benchmarks import Benchmark
from ..plotting import pyplot, write_figure
from .suite import Suite, accuracy, train_steps


def minimization_study(bench: Benchmark, reference: nn.Module, suite: Suite,
                       names: Sequence[str], *, lams: Sequence[float], steps: int, lr: float,
                       batch_size: int, log_every: int, seed: int, progress: bool = False
                       ) -> dict[str, Any]:
    """Train task 2 from θ1 with ``lam * estimate`` as the penalty, per estimator and λ.

    Logs the true FSD from θ1 (full task-1 training set), the regularizer's own estimate
    (``None`` for ``"none"``) and task-1/task-2 test accuracy every ``log_every`` steps, so
    an estimate that the optimizer drives far below the truth shows up as a falling ratio.
    The estimators are used as in training (fresh samples per call). ``"none"`` (no
    penalty) is run once. All runs see the same minibatch order.
    """
    runs: list[dict[str, Any]] = []
    for name in names:
        for lam in ([0.0] if name == "none" else lams):
            model = copy.deepcopy(reference)
            penalty = None if name == "none" else suite.estimators[name].distance
            log: dict[str, Any] = {"estimator": name, "lam": lam, "step": [], "true_fsd": [],
                                   "estimate": [], "task2_accuracy": [], "task1_accuracy": []}

            def record(step: int, model: nn.Module = model, log: dict = log,
                       penalty: Callable[[nn.Module], Tensor] | None = penalty) -> None:
                if step % log_every and step != steps:
                    return
                model.eval()
                with torch.no_grad():
                    log["true_fsd"].append(float(suite.exact.distance(model)))
                # outside no_grad: some estimators (NTK's JVPs) differentiate inside
                log["estimate"].append(None if penalty is None
                                       else float(penalty(model).detach()))
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
    """Markdown table of the end point of each regularized run.

    "final est. / true" is the regularizer's estimate over the true FSD at the last step:
    far below 1, the optimizer has found directions the estimate does not see.
    """
    lines = ["| regularizer | λ | final true FSD | mean true FSD over run | final est. / true | "
             "task-2 test acc | task-1 test acc | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in result["runs"]:
        estimate = (c.get("estimate") or [None])[-1]
        ratio = "–" if estimate is None else f"{estimate / c['true_fsd'][-1]:.3g}"
        lines.append(f"| {c['estimator']} | {c['lam']:g} | {c['true_fsd'][-1]:.4g} | "
                     f"{np.mean(c['true_fsd']):.4g} | {ratio} | {c['task2_accuracy'][-1]:.4f} | "
                     f"{c['task1_accuracy'][-1]:.4f} | {c['seconds']:.1f} |")
    return "\n".join(lines)


def minimization_plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Per λ (columns): true FSD vs task-2 accuracy (top), estimate / true FSD vs step (bottom).

    The true FSD is from θ1 along training; the ratio's axis is logarithmic. One colour per
    estimator; the unregularized run is in every top panel.
    """
    plt = pyplot()
    lams = result["lams"]
    fig, axes = plt.subplots(2, len(lams), figsize=(5.5 * len(lams), 9), squeeze=False)
    names = list(dict.fromkeys(c["estimator"] for c in result["runs"]))
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    # 0 at θ1 and regularized runs span decades: linear only below the smallest value logged
    positive = [t for c in result["runs"] for t in c["true_fsd"] if t > 0] or [1.0]
    linthresh = 10.0 ** math.floor(math.log10(min(positive)))
    for column, lam in enumerate(lams):
        top, bottom = axes[0][column], axes[1][column]
        for c in result["runs"]:
            if c["estimator"] == "none" or c["lam"] == lam:
                top.plot(c["task2_accuracy"], c["true_fsd"], "-o", ms=3,
                         color=colours[c["estimator"]], label=c["estimator"])
            if c["lam"] == lam and c["estimator"] != "none" and c.get("estimate"):
                # step 0 is θ1 itself, where both are 0
                points = [(s, e / t) for s, e, t in zip(c["step"], c["estimate"], c["true_fsd"],
                                                         strict=True) if t > 0 and e is not None]
                if points:
                    steps, ratios = zip(*points, strict=True)
                    bottom.plot(steps, [max(r, 1e-12) for r in ratios], "-o", ms=3,
                                color=colours[c["estimator"]], label=c["estimator"])
        top.set_yscale("symlog", linthresh=linthresh)
        top.set_xlabel("task-2 test accuracy")
        top.set_ylabel("true FSD from θ1")
        top.set_title(f"λ = {lam:g}")
        bottom.axhline(1.0, color="grey", lw=0.8, ls="--")
        bottom.set_yscale("log")
        bottom.set_xlabel("step")
        bottom.set_ylabel("estimate / true FSD")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle(f"{title}\n({result['steps']} steps, points every few iterations)")
    fig.tight_layout()
    write_figure(fig, path, dpi=130)  # atomically: a full disk leaves no half PNG
