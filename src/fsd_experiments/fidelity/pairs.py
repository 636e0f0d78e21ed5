"""The pairs study: every estimator's estimate and gradient against the true FSD."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from scipy import stats as scipy_stats
from torch import Tensor, nn

from ..benchmarks import Benchmark
from ..plotting import pyplot, write_figure
from ..stats import statistic
from .suite import Suite, accuracy


def _flat_grad(value: Tensor, model: nn.Module) -> Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                      for p, g in zip(params, grads, strict=True)])


def _cosine(a: Tensor, b: Tensor) -> float:
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else float("nan")


def fidelity_metrics(true: Sequence[float], estimate: Sequence[float],
                     cosines: Sequence[float] = ()) -> dict[str, float]:
    """Agreement of estimates with the true FSD over pairs.

    Spearman, Kendall and Pearson (raw values) correlations, Pearson of the logs, median
    relative error |est − true| / true, median ratio est / true, and the median / minimum of
    the gradient cosines.
    """
    t, e = np.asarray(true, dtype=float), np.asarray(estimate, dtype=float)
    out: dict[str, float] = {}
    constant = np.ptp(t) == 0 or np.ptp(e) == 0
    out["spearman"] = float("nan") if constant else statistic(scipy_stats.spearmanr(t, e))
    out["kendall"] = float("nan") if constant else statistic(scipy_stats.kendalltau(t, e))
    out["pearson"] = float("nan") if constant else statistic(scipy_stats.pearsonr(t, e))
    positive = (t > 0) & (e > 0)
    out["pearson_log"] = float("nan") if constant or positive.sum() < 3 else statistic(
        scipy_stats.pearsonr(np.log(t[positive]), np.log(e[positive])))
    with np.errstate(divide="ignore", invalid="ignore"):
        out["median_rel_error"] = float(np.median(np.abs(e - t) / t))
        out["median_ratio"] = float(np.median(e / t))
    c = np.asarray(cosines, dtype=float)
    out["median_grad_cosine"] = float(np.median(c)) if c.size else float("nan")
    out["min_grad_cosine"] = float(np.min(c)) if c.size else float("nan")
    return out


def pair_study(bench: Benchmark, reference: nn.Module,
               family: list[tuple[dict[str, float], nn.Module]], suite: Suite,
               progress: bool = False, reference_id: int = 0) -> dict[str, Any]:
    """Estimate vs truth (values and ∇_θj) for every (θ_i, θ_j) pair of the family."""
    pairs = []
    for k, (setting, model) in enumerate(family):
        model.eval()
        true = suite.exact.distance(model)
        true_grad = _flat_grad(true, model)
        row: dict[str, Any] = {"reference": reference_id, **setting,
                               "true": float(true.detach()), "estimates": {}, "cosines": {},
                               "task2_accuracy": accuracy(model, bench.task2.x_test,
                                                          bench.task2.y_test)}
        for name in suite.estimators:
            value = suite.evaluate(name, model)
            row["estimates"][name] = float(value.detach())
            row["cosines"][name] = _cosine(_flat_grad(value, model), true_grad)
        pairs.append(row)
        if progress:
            print(f"  reference {reference_id} pair {k + 1}/{len(family)} lr={setting['lr']:g} "
                  f"steps={setting['steps']} true={row['true']:.4g}", flush=True)
    return {"pairs": pairs, "summary": summarize_pairs(pairs, list(suite.estimators))}


def summarize_pairs(pairs: list[dict[str, Any]], names: Sequence[str]
                    ) -> dict[str, dict[str, float]]:
    """:func:`fidelity_metrics` per estimator over all pairs.

    Also the mean Spearman within each reference (when pairs come from several references).
    """
    summary = {}
    refs = sorted({p.get("reference", 0) for p in pairs})
    for name in names:
        m = fidelity_metrics([p["true"] for p in pairs], [p["estimates"][name] for p in pairs],
                             [p["cosines"][name] for p in pairs])
        within = [fidelity_metrics([p["true"] for p in pairs if p.get("reference", 0) == r],
                                   [p["estimates"][name] for p in pairs
                                    if p.get("reference", 0) == r])["spearman"] for r in refs]
        m["spearman_within_reference"] = float(np.mean(within))
        summary[name] = m
    return summary


def format_summary(summary: dict[str, dict[str, float]], nbytes: dict[str, int] | None = None,
                   versus: dict[str, tuple[float, float, float]] | None = None) -> str:
    """Markdown table of :func:`fidelity_metrics` per estimator.

    ``versus``: per estimator, Spearman difference to a baseline with its bootstrap interval.
    """
    head = ("| estimator | Spearman | Spearman within ref. | Kendall | Pearson | Pearson (log) | "
            "median rel. err. | median est/true | median grad cos | min grad cos |")
    extra = (" ΔSpearman vs NTK [90% CI] |" if versus else "") + (" bytes stored |" if nbytes
                                                                 else "")
    lines = [head + extra, "|---|" + "---:|" * (9 + bool(nbytes) + bool(versus))]
    for name, m in summary.items():
        cells = [f"{m[k]:.4f}" for k in ("spearman", "spearman_within_reference", "kendall",
                                          "pearson", "pearson_log")]
        cells += [f"{m['median_rel_error']:.3g}", f"{m['median_ratio']:.3g}",
                  f"{m['median_grad_cosine']:.4f}", f"{m['min_grad_cosine']:.4f}"]
        if versus:
            v = versus.get(name)
            cells.append("—" if v is None else f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]")
        if nbytes:
            cells.append(f"{nbytes.get(name, 0):,}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scatter_plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Log–log scatter of estimate vs true FSD, one colour per estimator, with y = x."""
    plt = pyplot()
    pairs = result["pairs"]
    names = list(result["summary"])
    fig, ax = plt.subplots(figsize=(7.5, 6))
    cmap = plt.get_cmap("tab20")
    markers = "osD^v<>pPX*h"
    true = np.array([p["true"] for p in pairs])
    lo, hi = true.min(), true.max()
    for i, name in enumerate(names):
        est = np.array([p["estimates"][name] for p in pairs])
        lo, hi = min(lo, est[est > 0].min(initial=lo)), max(hi, est.max())
        rho = result["summary"][name]["spearman"]
        ax.scatter(true, np.clip(est, 1e-12, None), s=22, color=cmap(i % 20),
                   marker=markers[i % len(markers)], alpha=0.8,
                   label=f"{name} (ρ={rho:.3f})")
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("true FSD (ExactFSD, full task-1 training set)")
    ax.set_ylabel("estimated FSD")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    write_figure(fig, path, dpi=130)  # atomically: a full disk leaves no half PNG
