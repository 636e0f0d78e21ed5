"""``fsd fidelity``: how close each estimator is to the true FSD, and to its gradient.

Three studies on the first two tasks of a benchmark (paper §5.1, the estimator-comparison
figure and the appendix "Comparing FSD Estimators"):

- **pairs**: a reference θ_i trained on task 1, and a family θ_j = θ_i fine-tuned on task 2
  over a grid of learning rates × iteration counts. For every pair the true FSD
  (:class:`fsd.ExactFSD` over the *full* task-1 training set, Euclidean on logits) is set
  against every estimator's estimate from the same stored information: one coreset shared by
  the coreset methods, one set of moments / gate frequencies shared by the moment methods.
  Reported: Spearman, Kendall, Pearson, median relative error, median ratio estimate/true,
  and the cosine between ∇_θj of the estimate and ∇_θj of the true FSD.
- **depth**: the same with ReLU MLPs of depth 1..6 (correlation with the truth vs depth).
- **minimize**: training task 2 with each estimator as the regularizer, logging the true
  FSD from θ1 and task-2 test accuracy over iterations.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch
from scipy import stats as scipy_stats
from torch import Tensor, nn

from fsd.estimator import Estimator
from fsd.exact import ExactFSD
from fsd.statistics import StatisticsCollector

from .benchmarks import FIDELITY_BENCHMARKS, Benchmark, load_benchmark
from .data import TensorBatches
from .io import atomic_write_text, write_json
from .models import mlp
from .plotting import pyplot
from .presets import PRESETS, Preset, by_title
from .stats import bootstrap_spearman_difference, statistic
from .training import cross_entropy, minibatch_stream, train

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
MINIMIZE_ESTIMATORS: tuple[str, ...] = (
    "none", "LAFTR (coreset)", "NTK (coreset)", "BGLN-S", "BGLN-D", "BGLN-D-CW", "EWC")
#: estimators whose ``distance`` draws random samples (inputs and/or gates)
SAMPLED = {p.title for p in PRESETS.values() if p.sampled}


# ----- training -----------------------------------------------------------------------------
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


# ----- estimators ---------------------------------------------------------------------------
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


def fit_suite(reference: nn.Module, bench: Benchmark, names: Sequence[str], *,
              coreset_size: int = 200, num_samples: int = 2048, repeats: int = 4,
              seed: int = 0, batch_size: int = 1024, ewc_examples: int | None = None
              ) -> Suite:
    """Fit the truth and the named estimators on task 1 at θ1.

    All coreset methods get the same random coreset (passed as one tensor batch with
    ``coreset_size=None``); all moment methods read one :class:`fsd.StatisticsCollector`
    pass over the full task-1 training set (diag / class-wise variants derive from it).
    EWC's Fisher averages over the first ``ewc_examples`` examples (``None``: all).
    """
    task = bench.task1
    reference.eval()
    times: dict[str, float] = {}
    start = time.perf_counter()
    exact = ExactFSD()
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
        estimator = preset.make(**({"num_samples": num_samples, "seed": seed}
                                   if preset.sampled else {}))
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


# ----- pairs study --------------------------------------------------------------------------
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
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----- depth study --------------------------------------------------------------------------
def depth_study(bench: Benchmark, *, depths: Sequence[int], names: Sequence[str],
                width: int, epochs: float, lr: float, lrs: Sequence[float],
                iters: Sequence[int], batch_size: int, coreset_size: int, num_samples: int,
                repeats: int, seed: int, references: int = 1, progress: bool = False
                ) -> dict[str, Any]:
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
                              num_samples=num_samples, repeats=repeats, seed=seed + r)
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
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----- minimization study -------------------------------------------------------------------
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


# ----- orchestration ------------------------------------------------------------------------
@dataclass
class FidelityConfig:
    """Settings of :func:`run_fidelity` (defaults: the ``fsd fidelity`` defaults)."""

    width: int = 100
    depth: int = 2
    epochs: float = 1.0
    lr: float = 1e-3
    batch_size: int = 64
    lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
    iters: tuple[int, ...] = (10, 30, 100, 300)
    references: int = 3
    depth_references: int = 2
    coreset_size: int = 200
    ewc_examples: int | None = None
    num_samples: int = 2048
    repeats: int = 4
    estimators: tuple[str, ...] = ALL_ESTIMATORS
    depths: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    depth_lrs: tuple[float, ...] = (1e-4, 1e-3, 1e-2)
    depth_iters: tuple[int, ...] = (10, 30, 100, 300)
    depth_estimators: tuple[str, ...] = DEPTH_ESTIMATORS
    minimize_estimators: tuple[str, ...] = MINIMIZE_ESTIMATORS
    lams: tuple[float, ...] = (1.0, 10.0)
    minimize_samples: int = 256
    minimize_steps: int = 300
    minimize_lr: float = 1e-3
    log_every: int = 20
    seed: int = 0


def run_fidelity(bench: Benchmark, out: str | Path, config: FidelityConfig | None = None,
                 studies: Sequence[str] = STUDIES, progress: bool = True) -> dict[str, Any]:
    """Run the chosen studies and write JSON, markdown and PNGs into ``out``.

    Files: ``fidelity_<bench>.{json,md}``, ``scatter_<bench>.png``, ``depth_<bench>.png``,
    ``minimize_<bench>.png``. Returns the JSON-able results.
    """
    cfg = config or FidelityConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tag = bench.name
    results: dict[str, Any] = {"benchmark": tag, "config": {
        k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
        "task1_train_size": int(bench.task1.x_train.shape[0])}
    md: list[str] = [f"## {tag}\n"]
    say = print if progress else (lambda *a, **k: None)

    def save() -> None:
        write_json(out / f"fidelity_{tag}.json", results, indent=1)
        atomic_write_text(out / f"fidelity_{tag}.md", "\n".join(md) + "\n")

    reference = suite = None
    if "pairs" in studies or "minimize" in studies:
        start = time.perf_counter()
        reference = train_reference(bench, width=cfg.width, depth=cfg.depth, epochs=cfg.epochs,
                                    lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed)
        results["reference_task1_accuracy"] = accuracy(reference, bench.task1.x_test,
                                                       bench.task1.y_test)
        names = list(dict.fromkeys(
            (list(cfg.estimators) if "pairs" in studies else [])
            + ([n for n in cfg.minimize_estimators if n != "none"]
               if "minimize" in studies else [])))
        suite = fit_suite(reference, bench, names, coreset_size=cfg.coreset_size,
                          num_samples=cfg.num_samples, repeats=cfg.repeats, seed=cfg.seed,
                          ewc_examples=cfg.ewc_examples)
        results["fit_seconds"] = suite.fit_seconds
        results["nbytes"] = {n: e.nbytes for n, e in suite.estimators.items()}
        results["nbytes"]["ExactFSD"] = suite.exact.nbytes
        say(f"reference + fits: {time.perf_counter() - start:.0f}s "
            f"(task-1 test acc {results['reference_task1_accuracy']:.4f})", flush=True)

    if "pairs" in studies:
        assert reference is not None and suite is not None  # fitted above
        start = time.perf_counter()
        pairs = []
        for r in range(cfg.references):
            if r == 0:
                ref_r, suite_r = reference, Suite(
                    suite.exact, {n: suite.estimators[n] for n in cfg.estimators},
                    suite.repeats, suite.coreset_size)
            else:  # further references: other seeds, same recipe
                ref_r = train_reference(bench, width=cfg.width, depth=cfg.depth,
                                        epochs=cfg.epochs, lr=cfg.lr,
                                        batch_size=cfg.batch_size, seed=cfg.seed + r)
                suite_r = fit_suite(ref_r, bench, cfg.estimators,
                                    coreset_size=cfg.coreset_size, num_samples=cfg.num_samples,
                                    repeats=cfg.repeats, seed=cfg.seed + r,
                                    ewc_examples=cfg.ewc_examples)
            family = make_family(ref_r, bench, lrs=cfg.lrs, iters=cfg.iters,
                                 batch_size=cfg.batch_size, seed=cfg.seed + r)
            pairs += pair_study(bench, ref_r, family, suite_r, progress=progress,
                                reference_id=r)["pairs"]
        result = {"pairs": pairs, "summary": summarize_pairs(pairs, list(cfg.estimators))}
        versus = ({n: bootstrap_spearman_difference(pairs, n, "NTK (coreset)", seed=cfg.seed)
                   for n in cfg.estimators if n != "NTK (coreset)"}
                  if "NTK (coreset)" in cfg.estimators else None)
        result["spearman_vs_ntk"] = versus
        results["pairs"] = result
        md += [f"### Pairs: {len(pairs)} pairs ({cfg.references} references θ_i × "
               f"{len(cfg.lrs)} learning rates × {len(cfg.iters)} iteration counts; "
               f"MLP {cfg.depth}×{cfg.width}, coreset N = {cfg.coreset_size}, sampled "
               f"estimators: mean of {cfg.repeats} calls × {cfg.num_samples} samples)\n",
               format_summary(result["summary"], results["nbytes"], versus), "",
               f"True FSD range: {min(p['true'] for p in pairs):.4g} – "
               f"{max(p['true'] for p in pairs):.4g}; ExactFSD stores "
               f"{results['nbytes']['ExactFSD']:,} bytes. Bytes are those of reference 0's "
               f"summaries.\n"]
        scatter_plot(result, out / f"scatter_{tag}.png",
                     f"{tag}: estimated vs true FSD ({len(pairs)} pairs)")
        say(f"pairs: {time.perf_counter() - start:.0f}s", flush=True)
        say(format_summary(result["summary"], None, versus), flush=True)
        save()

    if "minimize" in studies:
        assert reference is not None and suite is not None  # fitted above
        start = time.perf_counter()
        estimators = dict(suite.estimators)
        sampled = [n for n in cfg.minimize_estimators if n in SAMPLED]
        if sampled:  # training-style use: fewer samples per call than the fidelity estimates
            estimators.update(fit_suite(reference, bench, sampled, coreset_size=cfg.coreset_size,
                                        num_samples=cfg.minimize_samples, repeats=1,
                                        seed=cfg.seed).estimators)
        min_suite = Suite(suite.exact, estimators, 1, suite.coreset_size)
        result = minimization_study(bench, reference, min_suite, cfg.minimize_estimators,
                                    lams=cfg.lams, steps=cfg.minimize_steps, lr=cfg.minimize_lr,
                                    batch_size=cfg.batch_size, log_every=cfg.log_every,
                                    seed=cfg.seed, progress=progress)
        results["minimize"] = result
        md += [f"### Minimization: task 2 trained with λ·estimate from θ1 "
               f"({cfg.minimize_steps} Adam steps, lr {cfg.minimize_lr:g}, batch "
               f"{cfg.batch_size}; sampled estimators {cfg.minimize_samples} samples per "
               f"call)\n",
               format_minimization(result), ""]
        minimization_plot(result, out / f"minimize_{tag}.png",
                          f"{tag}: true FSD while training task 2")
        say(f"minimize: {time.perf_counter() - start:.0f}s", flush=True)
        save()

    if "depth" in studies:
        start = time.perf_counter()
        result = depth_study(bench, depths=cfg.depths, names=cfg.depth_estimators,
                             width=cfg.width, epochs=cfg.epochs, lr=cfg.lr, lrs=cfg.depth_lrs,
                             iters=cfg.depth_iters, batch_size=cfg.batch_size,
                             coreset_size=cfg.coreset_size, num_samples=cfg.num_samples,
                             repeats=cfg.repeats, seed=cfg.seed,
                             references=cfg.depth_references, progress=progress)
        results["depth"] = result
        md += [f"### Depth: Spearman / Kendall with the truth, MLP width {cfg.width}, "
               f"{cfg.depth_references * len(cfg.depth_lrs) * len(cfg.depth_iters)} pairs "
               f"per depth ({cfg.depth_references} references)\n",
               format_depth(result), ""]
        depth_plot(result, out / f"depth_{tag}.png",
                   f"{tag}: correlation with true FSD vs depth")
        say(f"depth: {time.perf_counter() - start:.0f}s", flush=True)
        save()
    save()
    return results


# ----- command line -------------------------------------------------------------------------
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _cmd_fidelity(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    bench = load_benchmark(args.benchmark, args.data_dir, max_train=args.max_train,
                           max_test=args.max_test, seed=args.seed)
    defaults = FidelityConfig()
    cfg = FidelityConfig(
        width=args.width, depth=args.depth, epochs=args.epochs, lrs=args.lrs or defaults.lrs,
        iters=args.iters or defaults.iters, coreset_size=args.coreset_size,
        num_samples=args.num_samples, repeats=args.repeats, references=args.references,
        depth_references=args.depth_references, ewc_examples=args.ewc_examples,
        depths=args.depths or defaults.depths, lams=args.lams or defaults.lams,
        minimize_steps=args.minimize_steps, seed=args.seed,
        estimators=tuple(n.strip() for n in args.estimators.split(","))
        if args.estimators else defaults.estimators)
    studies = tuple(s.strip() for s in args.studies.split(","))
    unknown = set(studies) - set(STUDIES)
    if unknown:
        raise SystemExit(f"unknown studies {sorted(unknown)}; choose from {', '.join(STUDIES)}")
    run_fidelity(bench, args.out, cfg, studies, progress=not args.quiet)
    print(f"wrote results to {args.out}")
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``fsd fidelity`` on the ``fsd`` command's subparsers."""
    p = subparsers.add_parser(
        "fidelity", help="estimators vs the true FSD (values, ranks, gradients), vs depth, "
                         "and as regularizers")
    p.add_argument("--benchmark", choices=BENCHMARKS, default="split-mnist")
    p.add_argument("--out", required=True, help="output folder (JSON, markdown, PNGs)")
    p.add_argument("--data-dir", default=None,
                   help="data directory (default: $FSD_DATA_DIR, else ~/.cache/fsd/data)")
    p.add_argument("--studies", default=",".join(STUDIES),
                   help="comma-separated subset of pairs,depth,minimize (default: all)")
    p.add_argument("--width", type=int, default=100)
    p.add_argument("--depth", type=int, default=2, help="hidden layers (pairs, minimize)")
    p.add_argument("--epochs", type=float, default=1.0, help="task-1 epochs of the reference")
    p.add_argument("--lrs", type=_floats, default=None,
                   help="fine-tuning learning rates, comma-separated")
    p.add_argument("--iters", type=_ints, default=None,
                   help="fine-tuning iteration counts, comma-separated")
    p.add_argument("--depths", type=_ints, default=None, help="depth study (default 1..6)")
    p.add_argument("--references", type=int, default=3,
                   help="reference networks θ_i (seeds) in the pairs study (default 3)")
    p.add_argument("--depth-references", type=int, default=2,
                   help="reference networks per depth in the depth study (default 2)")
    p.add_argument("--estimators", default=None,
                   help="comma-separated estimators of the pairs study (default: the paper's "
                        "set; also 'BGLN-D (exact)', 'BGLN-D (layerwise)', "
                        "'BGLN-D (exact+layerwise)')")
    p.add_argument("--coreset-size", type=int, default=200)
    p.add_argument("--ewc-examples", type=int, default=None,
                   help="examples EWC's Fisher averages over (default: all of task 1)")
    p.add_argument("--num-samples", type=int, default=2048,
                   help="samples per call of the sampled estimators")
    p.add_argument("--repeats", type=int, default=4,
                   help="calls averaged per estimate for the sampled estimators")
    p.add_argument("--lams", type=_floats, default=None,
                   help="regularization weights of the minimization study (default 1,10)")
    p.add_argument("--minimize-steps", type=int, default=300)
    p.add_argument("--max-train", type=int, default=None, help="subset of each task (quick)")
    p.add_argument("--max-test", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_fidelity)
