"""The depth study: correlation with the true FSD as the MLP gets deeper."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..benchmarks import Benchmark
from ..plotting import pyplot, write_figure
from ..stats import bootstrap_spearman_difference
from .pairs import pair_study, summarize_pairs
from .suite import accuracy, fit_suite, make_family, train_reference


def depth_study(bench: Benchmark, *, depths: Sequence[int], names: Sequence[str],
                width: int, epochs: float, lr: float, lrs: Sequence[float],
                iters: Sequence[int], batch_size: int, coreset_size: int, num_samples: int,
                repeats: int, seed: int, references: int = 1, progress: bool = False,
                metric: str = "euclidean") -> dict[str, Any]:
    """Correlation with the truth vs MLP depth.

    ``references`` references and their families per depth; their pairs are pooled.
    """
    rows = []
    for depth in depths:
        start = time.perf_counter()
        pairs, accs = [], []
        for r in range(references):
            reference = train_reference(bench, width=width, depth=depth, epochs=epochs, lr=lr,
                                        batch_size=batch_size, seed=seed + r)
            family = make_family(reference, bench, lrs=lrs, iters=iters,
                                 batch_size=batch_size, seed=seed + r)
            suite = fit_suite(reference, bench, names, coreset_size=coreset_size,
                              num_samples=num_samples, repeats=repeats, seed=seed + r,
                              metric=metric)
            pairs += pair_study(bench, reference, family, suite, reference_id=r)["pairs"]
            accs.append(accuracy(reference, bench.task1.x_test, bench.task1.y_test))
        result = {"pairs": pairs, "summary": summarize_pairs(pairs, list(names))}
        vs_ntk = ({n: bootstrap_spearman_difference(pairs, n, "NTK (coreset)", seed=seed)
                   for n in names if n != "NTK (coreset)"} if "NTK (coreset)" in names else {})
        rows.append({"depth": depth, "task1_accuracy": float(np.mean(accs)),
                     "summary": result["summary"], "spearman_vs_ntk": vs_ntk, "pairs": pairs,
                     "true_range": [min(p["true"] for p in pairs),
                                    max(p["true"] for p in pairs)]})
        if progress:
            sp = ", ".join(f"{n}: {m['spearman']:.3f}" for n, m in result["summary"].items())
            print(f"  depth {depth}: Spearman {sp} ({time.perf_counter() - start:.0f}s)",
                  flush=True)
    return {"depths": rows}


def format_depth(result: dict[str, Any]) -> str:
    """Markdown table: Spearman / Kendall per estimator and depth."""
    rows = result["depths"]
    names = list(rows[0]["summary"])
    versus = [n for n in rows[0].get("spearman_vs_ntk", {}) if n.startswith("LAFTR")]
    lines = ["| depth | task-1 acc | " + " | ".join(f"{n} Spearman / Kendall" for n in names)
             + "".join(f" | {n} − NTK Spearman [90% CI]" for n in versus) + " |",
             "|---:|---:|" + "---:|" * (len(names) + len(versus))]
    for r in rows:
        cells = [f"{r['summary'][n]['spearman']:.3f} / {r['summary'][n]['kendall']:.3f}"
                 for n in names]
        cells += ["{:+.3f} [{:+.3f}, {:+.3f}]".format(*r["spearman_vs_ntk"][n]) for n in versus]
        lines.append(f"| {r['depth']} | {r['task1_accuracy']:.4f} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def depth_plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Spearman (solid) and Kendall (dashed) correlation with the truth vs depth."""
    plt = pyplot()
    rows = result["depths"]
    depths = [r["depth"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, name in enumerate(rows[0]["summary"]):
        colour = plt.get_cmap("tab10")(i)
        for metric, style in (("spearman", "-o"), ("kendall", "--s")):
            ax.plot(depths, [r["summary"][name][metric] for r in rows], style, color=colour,
                    label=f"{name} ({metric.capitalize()})")
    ax.set_xlabel("hidden layers (ReLU MLP)")
    ax.set_ylabel("rank correlation with true FSD")
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    write_figure(fig, path, dpi=130)  # atomically: a full disk leaves no half PNG
