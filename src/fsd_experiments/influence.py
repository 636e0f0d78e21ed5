"""Influence-function studies (paper §5.3): UCI regressions and mislabeled MNIST.

:func:`run_uci` correlates each method's self-influence scores with the ``exact`` PBRF oracle
on five UCI regressions; :func:`run_mislabeled` ranks MNIST training points with 10% corrupted
labels by self-influence and measures how many corrupted points each method finds. Exposed as
``fsd influence uci`` and ``fsd influence mislabeled``. The PBRF machinery itself (distance
terms, solver, conjugate gradient) is :mod:`fsd.influence`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from fsd.influence import cg_scores, pbrf_scores, pointwise_loss

from .data import UCI_DATASETS, DataNotFoundError, TensorBatches, load_mnist, load_uci
from .devices import device_name, resolve_device
from .io import atomic_write_text, write_json
from .models import mlp
from .plotting import pyplot
from .stats import (
    area_under,
    bootstrap_intervals,
    correlations,
    detection_curve,
    detection_intervals,
    kmeans_labels,
)
from .training import train

#: Methods of each study: the PBRF methods, CG, and (mislabeled) a random ranking.
UCI_METHODS: tuple[str, ...] = ("exact", "ewc", "cg", "bgln-d")
MISLABELED_METHODS: tuple[str, ...] = ("exact", "ewc", "cg", "bgln-d", "random")
LEARNING_RATES: tuple[float, ...] = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)
METHOD_TITLES = {"exact": "PBRF (exact)", "ewc": "EWC", "cg": "CG", "bgln-d": "BGLN-D",
                 "random": "random"}


def _check_methods(methods: Sequence[str], allowed: Sequence[str]) -> list[str]:
    methods = list(methods)
    unknown = [m for m in methods if m not in allowed]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown or methods!r}; expected any of "
                         f"{', '.join(allowed)}")
    return methods


# --------------------------------------------------------------------------------------------
# Training the base networks
# --------------------------------------------------------------------------------------------


def train_sgd(model: nn.Module, x: Tensor, y: Tensor, *, loss: str, epochs: int, lr: float,
              batch_size: int = 128, seed: int = 0, desc: str = "training",
              progress: bool = True) -> bool:
    """Plain SGD on the mean loss; returns ``False`` if the loss became non-finite."""
    batches = TensorBatches(x, y, batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))

    def mean_pointwise(model: nn.Module, xb: Tensor, yb: Tensor) -> Tensor:
        return pointwise_loss(loss, model(xb), yb).mean()

    return train(model, batches, mean_pointwise, torch.optim.SGD(model.parameters(), lr=lr),
                 epochs=epochs, stop_on_nonfinite=True, progress=progress, desc=desc,
                 bar="epochs")


def mean_loss(model: nn.Module, x: Tensor, y: Tensor, loss: str) -> float:
    """Mean loss over (x, y) without gradients."""
    with torch.no_grad():
        return float(pointwise_loss(loss, model(x), y).mean())


# --------------------------------------------------------------------------------------------
# Metrics, files, plots
# --------------------------------------------------------------------------------------------


def pool_corrupted(result: dict[str, Any]) -> np.ndarray:
    """The pool's corrupted mask of a mislabeled result (rebuilt from a curve in old files).

    Results written before the mask was saved still hold each method's scores and its
    detection curve; the curve rises exactly where the point checked next is corrupted.
    """
    if "is_corrupted" in result["pool"]:
        return np.asarray(result["pool"]["is_corrupted"], dtype=float)
    method = next(m for m, v in result["scores"].items()
                  if v is not None and np.isfinite(np.asarray(v, dtype=float)).all())
    scores = np.asarray(result["scores"][method], dtype=float)
    steps = np.diff(np.asarray(result["curves"][method], dtype=float)) > 0
    mask = np.zeros(scores.shape[0])
    mask[np.argsort(-scores, kind="stable")[steps]] = 1.0
    return mask


# --------------------------------------------------------------------------------------------
# UCI experiment
# --------------------------------------------------------------------------------------------


def _canonical_uci(name: str) -> str:
    lookup = {n.lower(): n for n in UCI_DATASETS}
    lookup.update({"boston": "bostonHousing", "housing": "bostonHousing",
                   "wine": "wine-quality-red"})
    canon = lookup.get(name.strip().lower())
    if canon is None:
        raise ValueError(f"unknown UCI data set {name!r}; expected one of "
                         f"{', '.join(UCI_DATASETS)} (or 'all')")
    return canon


def split_uci(x: Tensor, y: Tensor, seed: int, test_fraction: float = 0.1,
              validation_fraction: float = 0.1) -> dict[str, tuple[Tensor, Tensor]]:
    """Seeded random split into train / validation / test, standardized on train.

    ``test_fraction`` of the rows is the test set; ``validation_fraction`` of the rest is the
    validation set (for the learning rate); the remainder is the training set that θ0 is
    trained on and that the PBRF averages over. X and y are standardized with the training
    set's mean and standard deviation.
    """
    n = x.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * n))
    rest = perm[n_test:]
    n_val = int(round(validation_fraction * rest.shape[0]))
    parts = {"test": perm[:n_test], "validation": rest[:n_val], "train": rest[n_val:]}
    xt, yt = x[parts["train"]], y[parts["train"]]
    x_mean, x_std = xt.mean(0), xt.std(0).clamp_min(1e-12)
    y_mean, y_std = yt.mean(0), yt.std(0).clamp_min(1e-12)
    return {k: ((x[i] - x_mean) / x_std, (y[i] - y_mean) / y_std) for k, i in parts.items()}


def run_uci(dataset: str, methods: Sequence[str] = UCI_METHODS, *, seed: int = 0,
            out: str | Path | None = None, data_dir: str | Path | None = None,
            removals: int = 50, epochs: int = 200, pbrf_epochs: float = 20,
            pbrf_lr: float | None = None,
            learning_rates: Sequence[float] = LEARNING_RATES, damping: float = 1e-3,
            batch_size: int = 128, width: int = 128, depth: int = 2, cg_iters: int = 200,
            cg_data: int | None = None, subset: int | None = None,
            bgln_moments: str = "paper", bgln_clusters: int | None = None,
            point_term: bool = False, oracle_repeat: bool = False, ewc_fisher: str = "true",
            points_per_solve: int = 32, dtype: torch.dtype = torch.float64,
            progress: bool = True) -> dict[str, Any]:
    """Self-influence on one UCI regression set: each method vs the ``exact`` PBRF oracle.

    Steps: seeded 90/10 train+validation/test split (validation = 10% of the 90%); X, y
    standardized on the training part; a ``depth``×``width`` ReLU MLP trained by SGD (batch
    ``batch_size``, ``epochs`` epochs) for every learning rate, keeping the one with the lowest
    validation loss as θ0; ``removals`` random training points scored by every method; each
    PBRF solved by SGD at the chosen learning rate for ``pbrf_epochs``·⌈N/batch⌉ steps.

    Args:
        pbrf_lr: SGD learning rate of the PBRF solves (default: the chosen training rate).
        points_per_solve: PBRFs solved side by side (speed and memory only, see
            :func:`pbrf_scores`).
        cg_data: average CG's Gauss-Newton matrix over this many random training points
            (``None``: all of them).
        subset: keep only this many random rows of the data set (tiny runs / tests).
        bgln_moments: BGLN-D's propagation (``"paper"`` or ``"exact"``), see :func:`make_term`.
        bgln_clusters: BGLN-D as a mixture over k-means clusters of the inputs, see
            :func:`make_term` (``None``: one Gaussian, the paper's setting).
        point_term: give the approximate terms (``ewc``, ``bgln-d``) the removed point's own
            exact term, see :class:`PBRF` (the exact D has it already).
        ewc_fisher: EWC's diagonal (``"true"``, ``"sampled"``, ``"empirical"``), see
            :func:`make_term`.
        oracle_repeat: solve the ``exact`` PBRFs a second time with another minibatch stream
            (seed + 1000) and correlate the two: the oracle's own noise, an upper limit for
            any method's correlation with it (``result["oracle_repeat"]``).

    Returns:
        The results dictionary (also written to ``out/results.json`` with ``results.md`` and
        ``scatter.png`` when ``out`` is given).
    """
    methods = _check_methods(methods, UCI_METHODS)
    canon = _canonical_uci(dataset)
    x, y = load_uci(canon, data_dir)
    if subset is not None and subset < x.shape[0]:
        keep = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed + 1))
        x, y = x[keep[:subset]], y[keep[:subset]]
    splits = split_uci(x.to(dtype), y.to(dtype), seed)
    x_train, y_train = splits["train"]
    n = x_train.shape[0]

    # learning-rate search on the validation split; the best model is θ0
    search, best = {}, None
    for lr in tqdm(learning_rates, desc=f"{canon}: lr search", leave=False, disable=not progress):
        torch.manual_seed(seed)
        model = mlp(x_train.shape[1], width, depth, y_train.shape[1]).to(dtype)
        ok = train_sgd(model, x_train, y_train, loss="squared", epochs=epochs, lr=lr,
                       batch_size=batch_size, seed=seed, desc=f"lr {lr}", progress=progress)
        val = mean_loss(model, *splits["validation"], "squared") if ok else math.inf
        val = val if math.isfinite(val) else math.inf
        search[str(lr)] = val
        if best is None or val < best[0]:
            best = (val, lr, model)
    assert best is not None
    _, lr, model = best
    pbrf_lr = lr if pbrf_lr is None else pbrf_lr
    for p in model.parameters():
        p.requires_grad_(True)

    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 2))[:removals]
    indices = chosen.tolist()
    steps = int(math.ceil(pbrf_epochs * math.ceil(n / batch_size)))
    result: dict[str, Any] = {
        "experiment": "uci", "dataset": canon, "seed": seed, "n_train": n,
        "n_validation": splits["validation"][0].shape[0], "n_test": splits["test"][0].shape[0],
        "split": "seeded random: 10% test; 10% of the rest validation; rest train "
                 f"(torch.randperm, seed {seed}); X, y standardized on train",
        "model": f"MLP {depth}x{width} ReLU", "epochs": epochs, "batch_size": batch_size,
        "lr_search_validation_loss": search, "lr": lr,
        "train_loss": mean_loss(model, x_train, y_train, "squared"),
        "test_rmse_standardized": math.sqrt(2 * mean_loss(model, *splits["test"], "squared")),
        "pbrf": {"optimizer": "SGD (no momentum)", "lr": pbrf_lr, "steps": steps,
                 "epochs": pbrf_epochs, "damping": damping, "exact_batch_size": batch_size,
                 "bgln_moments": bgln_moments, "bgln_clusters": bgln_clusters,
                 "point_term": point_term,
                 "ewc_fisher": ewc_fisher, "points_per_solve": points_per_solve},
        "cg": {"damping": damping, "max_iter": cg_iters},
        "removed_indices": indices, "scores": {}, "seconds": {}, "correlation": {},
    }
    # the mixture's components: k-means clusters of the training inputs
    groups = (kmeans_labels(x_train, bgln_clusters, seed=seed)
              if bgln_clusters is not None and "bgln-d" in methods else None)
    for method in methods:
        start = time.perf_counter()
        if method == "cg":
            scores, info = cg_scores(model, x_train, y_train, indices, loss="squared",
                                     damping=damping, max_iter=cg_iters, gn_data=cg_data,
                                     seed=seed, progress=progress)
            result["cg"].update(info)
        else:
            scores = pbrf_scores(model, x_train, y_train, indices, method, loss="squared",
                                 damping=damping, steps=steps, lr=pbrf_lr,
                                 batch_size=batch_size, bgln_moments=bgln_moments,
                                 bgln_groups=groups,
                                 point_term=point_term, ewc_fisher=ewc_fisher,
                                 points_per_solve=points_per_solve, seed=seed,
                                 progress=progress)
        result["seconds"][method] = time.perf_counter() - start
        result["scores"][method] = scores.tolist()
        # a diverged solve (approximate D not bounding the PBRF) shows up as inf/nan
        result.setdefault("nonfinite", {})[method] = int((~np.isfinite(scores)).sum())
    if "exact" in methods:
        reference = np.asarray(result["scores"]["exact"])
        for method in methods:
            if method != "exact":
                result["correlation"][method] = correlations(
                    np.asarray(result["scores"][method]), reference)
        result["bootstrap"] = _uci_bootstrap(result)
        if oracle_repeat:
            start = time.perf_counter()
            again = pbrf_scores(model, x_train, y_train, indices, "exact", loss="squared",
                                damping=damping, steps=steps, lr=pbrf_lr,
                                batch_size=batch_size, seed=seed + 1000,
                                points_per_solve=points_per_solve, progress=progress)
            result["oracle_repeat"] = {
                "minibatch_seed": seed + 1000, "scores": again.tolist(),
                "seconds": time.perf_counter() - start,
                "correlation": correlations(again, reference)}
    elif oracle_repeat:
        raise ValueError("oracle_repeat needs 'exact' among the methods")
    if out is not None:
        write_uci_outputs(result, Path(out))
    return result


def _fmt(value: float | None) -> str:
    return "nan" if value is None or not math.isfinite(value) else f"{value:.2f}"


def uci_table(results: Iterable[dict[str, Any]]) -> str:
    """Markdown table like the paper's: Pearson (P) / Spearman (S) with the exact PBRF."""
    results = list(results)
    methods = [m for m in ("ewc", "cg", "bgln-d")
               if any(m in r["correlation"] for r in results)]
    titles = [METHOD_TITLES[m] for m in methods]
    repeat = any("oracle_repeat" in r for r in results)
    if repeat:  # the oracle against itself (another minibatch stream): the noise ceiling
        titles.append("exact repeat")
    head = "| data set | N | " + " | ".join(f"{t} P | {t} S" for t in titles) + " |"
    lines = [head, "|---|---:|" + "---:|---:|" * len(titles)]
    for r in results:
        found = [r["correlation"].get(m) for m in methods]
        if repeat:
            found.append(r.get("oracle_repeat", {}).get("correlation"))
        cells = []
        for c in found:
            cells += [_fmt(c["pearson"]), _fmt(c["spearman"])] if c else ["–", "–"]
        lines.append(f"| {r['dataset']} | {r['n_train']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _uci_bootstrap(result: dict[str, Any]) -> dict[str, Any] | None:
    """The run's bootstrap intervals (computed from its scores for runs that predate them)."""
    if "bootstrap" in result:
        return result["bootstrap"]
    if "exact" not in result["scores"] or len(result["scores"]) < 2:
        return None
    others = {m: v for m, v in result["scores"].items() if m != "exact"}
    return bootstrap_intervals(others, result["scores"]["exact"], seed=result.get("seed", 0))


def interval_table(results: Iterable[dict[str, Any]]) -> str:
    """Markdown table of bootstrap intervals: each method's Pearson with the exact PBRF, and
    the paired difference BGLN-D − EWC (an interval containing 0: the data do not separate
    them)."""
    results = list(results)
    boots = [_uci_bootstrap(r) for r in results]
    methods = [m for m in ("ewc", "cg", "bgln-d")
               if any(b and m in b["pearson"] for b in boots)]
    diff = any(b and "bgln-d" in b["difference"] for b in boots)
    level = next((b["level"] for b in boots if b), 0.95)
    head = ["data set", *(f"{METHOD_TITLES[m]} P" for m in methods)]
    if diff:
        head += ["BGLN-D − EWC, P", "BGLN-D − EWC, S"]
    lines = [f"{level:.0%} percentile-bootstrap intervals over the scored points (paired "
             "resamples):", "", "| " + " | ".join(head) + " |",
             "|---|" + "---|" * (len(head) - 1)]

    def cell(point: float | None, interval: list[float] | None) -> str:
        if interval is None:
            return "–"
        text = f"[{interval[0]:.2f}, {interval[1]:.2f}]"
        return text if point is None else f"{_fmt(point)} {text}"

    for r, b in zip(results, boots):
        if b is None:
            continue
        cells = [cell(r["correlation"].get(m, {}).get("pearson"), b["pearson"].get(m))
                 for m in methods]
        if diff:
            d = b["difference"].get("bgln-d")
            point = {k: r["correlation"]["bgln-d"][k] - r["correlation"]["ewc"][k]
                     for k in ("pearson", "spearman")} if d else {}
            cells += [f"{point[k]:+.3f} [{d[k][0]:+.3f}, {d[k][1]:+.3f}]" if d else "–"
                      for k in ("pearson", "spearman")]
        lines.append(f"| {r['dataset']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timing_table(results: Iterable[dict[str, Any]]) -> str:
    """Markdown table of wall-clock seconds per method (all removals together)."""
    results = list(results)
    methods = [m for m in ("exact", "ewc", "cg", "bgln-d", "random")
               if any(m in r["seconds"] for r in results)]
    lines = ["| data set | " + " | ".join(f"{METHOD_TITLES[m]} (s)" for m in methods) + " |",
             "|---|" + "---:|" * len(methods)]
    for r in results:
        cells = [f"{r['seconds'][m]:.1f}" if m in r["seconds"] else "–" for m in methods]
        lines.append(f"| {r['dataset']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_uci_outputs(result: dict[str, Any], out: Path) -> None:
    """results.json, results.md and scatter.png (each method vs the exact PBRF) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result, indent=2, nan_as_null=True)
    md = [f"# Influence (UCI {result['dataset']}, seed {result['seed']})", "",
          f"N = {result['n_train']} training points, {len(result['removed_indices'])} removals; "
          f"{result['model']}, SGD lr {result['lr']} (validation-chosen), {result['epochs']} "
          f"epochs; PBRF: SGD lr {result['pbrf']['lr']}, {result['pbrf']['steps']} steps, "
          f"λ = {result['pbrf']['damping']}; BGLN-D moments "
          f"{result['pbrf'].get('bgln_moments', 'paper')}"
          + (f", mixture over {result['pbrf']['bgln_clusters']} k-means clusters"
             if result["pbrf"].get("bgln_clusters") else "") + "; EWC Fisher "
          f"{result['pbrf'].get('ewc_fisher', 'true')}"
          + ("; approximate terms + the removed point's own exact term"
             if result["pbrf"].get("point_term") else "") + ".", ""]
    if result["correlation"] or "oracle_repeat" in result:
        md += ["Correlation with the exact PBRF self-influence:", "", uci_table([result]), ""]
    if _uci_bootstrap(result) is not None:
        md += [interval_table([result]), ""]
    md += ["Wall time:", "", timing_table([result]), ""]
    atomic_write_text(out / "results.md", "\n".join(md))
    if "exact" in result["scores"] and len(result["scores"]) > 1:
        plt = pyplot()
        others = [m for m in result["scores"] if m != "exact"]
        fig, axes = plt.subplots(1, len(others), figsize=(3.2 * len(others), 3.2), squeeze=False)
        reference = np.asarray(result["scores"]["exact"])
        for ax, m in zip(axes[0], others):
            ax.scatter(reference, np.asarray(result["scores"][m]), s=10)
            c = result["correlation"].get(m)
            ax.set_title(f"{METHOD_TITLES[m]}" + (f" (P {_fmt(c['pearson'])})" if c else ""))
            ax.set_xlabel("exact PBRF self-influence")
        axes[0][0].set_ylabel("estimate")
        fig.suptitle(result["dataset"])
        fig.tight_layout()
        fig.savefig(out / "scatter.png", dpi=110)
        plt.close(fig)


def write_uci_summary(out: Path) -> str:
    """Combine every ``out/<dataset>/results.json`` into ``out/results.md`` / ``results.json``."""
    results = []
    for name in UCI_DATASETS:
        path = out / name / "results.json"
        if path.is_file():
            results.append(json.loads(path.read_text()))
    if not results:
        return ""
    text = "\n".join(["# Influence estimation on UCI regression (self-influence vs exact PBRF)",
                      "", uci_table(results), "", interval_table(results), "",
                      "Wall time per method (all removals):", "",
                      timing_table(results), ""])
    atomic_write_text(out / "results.md", text)
    write_json(out / "results.json", indent=2, nan_as_null=True, obj={
        "experiment": "uci", "datasets": [r["dataset"] for r in results],
        "correlation": {r["dataset"]: r["correlation"] for r in results},
        "bootstrap": {r["dataset"]: _uci_bootstrap(r) for r in results},
        "seconds": {r["dataset"]: r["seconds"] for r in results}})
    return text


# --------------------------------------------------------------------------------------------
# Mislabeled-example detection on MNIST
# --------------------------------------------------------------------------------------------


def corrupt_labels(y: Tensor, fraction: float, classes: int, generator: torch.Generator
                   ) -> tuple[Tensor, Tensor]:
    """Replace ``fraction`` of the labels by a uniformly random *other* class.

    Returns ``(new_labels, corrupted_mask)``.
    """
    n = y.shape[0]
    chosen = torch.randperm(n, generator=generator)[:int(round(fraction * n))]
    shift = torch.randint(1, classes, (chosen.shape[0],), generator=generator)
    y = y.clone()
    y[chosen] = (y[chosen] + shift) % classes
    mask = torch.zeros(n, dtype=torch.bool)
    mask[chosen] = True
    return y, mask


def run_mislabeled(methods: Sequence[str] = ("bgln-d", "ewc", "cg", "random"), *,
                   out: str | Path | None = None, data_dir: str | Path | None = None,
                   seed: int = 0, n_train: int = 6000, corrupt: float = 0.1, width: int = 128,
                   depth: int = 2, epochs: int = 50, lr: float = 0.1, batch_size: int = 128,
                   pool: int = 1000, pbrf_steps: int = 100, pbrf_lr: float | None = 0.003,
                   damping: float = 1e-3, cg_iters: int = 10, cg_data: int | None = 500,
                   ewc_data: int | None = 1000, bgln_covariance: str = "lowrank",
                   bgln_rank: int = 64, device: str | torch.device = "cpu",
                   points_per_solve: int = 32, progress: bool = True) -> dict[str, Any]:
    """Mislabeled-example detection by self-influence on a corrupted MNIST subset.

    ``n_train`` random MNIST training images (seeded), ``corrupt`` of them relabelled to a
    random other class; a ``depth``×``width`` ReLU MLP trained by SGD (cross-entropy, batch
    ``batch_size``). A random ``pool`` of the training points (with its share of corrupted
    ones) is scored by each method; points are checked in order of decreasing score.

    Args:
        pbrf_steps: SGD steps per PBRF solve (same for ``exact``, ``ewc``, ``bgln-d``).
        points_per_solve: PBRFs solved side by side (speed and memory only, see
            :func:`pbrf_scores`).
        pbrf_lr: PBRF learning rate (``None``: the training ``lr``). The default 0.003 keeps
            SGD stable on BGLN-D's Euclidean-on-logits term, whose curvature is far above the
            KL's (lr 0.1 and 0.01 diverge).
        cg_iters, cg_data: CG iterations and the number of random training points G
            averages over (``None`` = all).
        ewc_data: random training points EWC's exact (all-class) Fisher is fitted on.
        bgln_covariance, bgln_rank: BGLN-D's input covariance (``"lowrank"`` rank-r + diagonal
            keeps 784-dim inputs affordable).
        device: where the network, the data and every method run (``"cuda"`` for the
            paper's width 1024). Subsets, label noise, the initialization and the minibatch
            order are drawn on the CPU, so they are the same on every device.

    Returns:
        Results dictionary (AUC per method, curves, scores, timings); with ``out``, also
        results.json, results.md and detection.png.
    """
    methods = _check_methods(methods, MISLABELED_METHODS)
    device = resolve_device(device)
    x_all, y_all = load_mnist(data_dir, "train")
    generator = torch.Generator().manual_seed(seed)
    keep = torch.randperm(x_all.shape[0], generator=generator)[:n_train]
    x = x_all[keep].reshape(len(keep), -1)
    y, corrupted = corrupt_labels(y_all[keep], corrupt, 10, generator)
    torch.manual_seed(seed)
    model = mlp(x.shape[1], width, depth, 10).to(device)
    x, y = x.to(device), y.to(device)
    ok = train_sgd(model, x, y, loss="cross_entropy", epochs=epochs, lr=lr,
                   batch_size=batch_size, seed=seed, desc="training", progress=progress)
    if not ok:
        raise RuntimeError(f"training diverged at lr {lr}")
    with torch.no_grad():
        predictions = model(x).argmax(-1).cpu()
    pool_index = torch.randperm(n_train, generator=generator)[:pool]
    is_corrupt = corrupted[pool_index].numpy().astype(np.float64)
    x_test, y_test = load_mnist(data_dir, "test")
    with torch.no_grad():
        test_accuracy = float((model(x_test.reshape(len(x_test), -1).to(device)).argmax(-1)
                               .cpu() == y_test).float().mean())
    pbrf_lr = lr if pbrf_lr is None else pbrf_lr
    result: dict[str, Any] = {
        "experiment": "mislabeled", "seed": seed, "n_train": n_train,
        "corrupt_fraction": corrupt, "corrupted_total": int(corrupted.sum()),
        "model": f"MLP {depth}x{width} ReLU", "width": width, "depth": depth,
        "epochs": epochs, "lr": lr, "batch_size": batch_size,
        "device": device_name(device),
        "train_accuracy_on_given_labels": float((predictions == y.cpu()).float().mean()),
        "memorized_corrupted_fraction": float((predictions[corrupted] == y.cpu()[corrupted])
                                              .float().mean()),
        "test_accuracy": test_accuracy,
        "pool": {"size": int(pool_index.shape[0]), "corrupted": int(is_corrupt.sum()),
                 "selection": f"random (seed {seed})", "index": pool_index.tolist(),
                 "is_corrupted": is_corrupt.astype(int).tolist()},
        "pbrf": {"optimizer": "SGD (no momentum)", "lr": pbrf_lr, "steps": pbrf_steps,
                 "damping": damping, "exact_batch_size": batch_size,
                 "points_per_solve": points_per_solve,
                 "bgln_d": f"BGLN(deterministic=True, covariance={bgln_covariance!r}, "
                           f"rank={bgln_rank}), Euclidean metric on logits",
                 "ewc": f"EWC(fisher='true', metric='kl') fitted on {ewc_data or n_train} "
                        "random training points",
                 "exact": "minibatch KL (metric 'kl')"},
        "cg": {"damping": damping, "max_iter": cg_iters, "gauss_newton_points": cg_data},
        "auc": {}, "seconds": {}, "scores": {}, "curves": {},
    }
    for method in methods:
        start = time.perf_counter()
        if method == "random":
            scores = np.random.default_rng(seed).random(len(pool_index))
        elif method == "cg":
            scores, info = cg_scores(model, x, y, pool_index.tolist(), loss="cross_entropy",
                                     damping=damping, max_iter=cg_iters, gn_data=cg_data,
                                     seed=seed, progress=progress)
            result["cg"].update(info)
        else:
            scores = pbrf_scores(model, x, y, pool_index.tolist(), method, loss="cross_entropy",
                                 damping=damping, steps=pbrf_steps, lr=pbrf_lr,
                                 batch_size=batch_size, seed=seed,
                                 bgln_covariance=bgln_covariance, bgln_rank=bgln_rank,
                                 ewc_data=ewc_data, points_per_solve=points_per_solve,
                                 progress=progress)
        result["seconds"][method] = time.perf_counter() - start
        result.setdefault("nonfinite", {})[method] = int((~np.isfinite(scores)).sum())
        checked, found = detection_curve(scores, is_corrupt)
        result["scores"][method] = scores.tolist()
        result["curves"][method] = found.tolist()
        result["auc"][method] = area_under(checked, found)
        if out is not None:  # partial results after each method
            write_mislabeled_outputs(result, Path(out))
    return result


def write_mislabeled_outputs(result: dict[str, Any], out: Path) -> None:
    """results.json, results.md and detection.png in ``out``.

    Adds ``result["bootstrap"]``: :func:`detection_intervals` of the finished methods (also
    for results written before it existed, whose pool mask :func:`pool_corrupted` rebuilds).
    """
    out.mkdir(parents=True, exist_ok=True)
    corrupted = pool_corrupted(result)
    if 0 < corrupted.sum() < corrupted.shape[0]:
        result["bootstrap"] = detection_intervals(result["scores"], corrupted)
    write_json(out / "results.json", result, indent=2, nan_as_null=True)
    pool = result["pool"]
    boot = result.get("bootstrap", {"auc": {}, "difference": {}, "level": 0.95})
    lines = [f"# Mislabeled-example detection (MNIST, seed {result['seed']})", "",
             f"{result['n_train']} training images, {result['corrupted_total']} labels corrupted; "
             f"{result['model']} (SGD lr {result['lr']}, {result['epochs']} epochs; train acc. "
             f"on given labels {result['train_accuracy_on_given_labels']:.3f}, corrupted "
             f"memorized {result['memorized_corrupted_fraction']:.3f}, test acc. "
             f"{result['test_accuracy']:.3f}). Pool: {pool['size']} random training points "
             f"({pool['corrupted']} corrupted). PBRF: SGD lr {result['pbrf']['lr']}, "
             f"{result['pbrf']['steps']} steps, λ = {result['pbrf']['damping']}; BGLN-D: "
             f"{result['pbrf']['bgln_d']}. Device: {result.get('device', 'cpu')}.", "",
             f"| method | AUC (fraction found vs fraction checked) | "
             f"{boot['level']:.0%} interval | AUC − EWC ({boot['level']:.0%} interval) | "
             "wall time (s) | non-finite scores |", "|---|---:|---:|---:|---:|---:|"]

    def cell(interval: list[float] | None, sign: str = "") -> str:
        if interval is None:
            return "–"
        return f"[{interval[0]:{sign}.3f}, {interval[1]:{sign}.3f}]"

    for m, auc in result["auc"].items():
        difference = boot["difference"].get(m, {}).get("auc")
        lines.append(f"| {METHOD_TITLES[m]} | {auc:.3f} | {cell(boot['auc'].get(m))} | "
                     f"{cell(difference, '+')} | {result['seconds'][m]:.1f} | "
                     f"{result.get('nonfinite', {}).get(m, 0)} |")
    lines += ["", "Intervals: paired percentile bootstrap over the pool's points "
              f"({boot.get('resamples', 0)} resamples, the same for every method)."]
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 3.8))
    for m, found in result["curves"].items():
        checked = np.arange(len(found)) / (len(found) - 1)
        ax.plot(checked, found, label=f"{METHOD_TITLES[m]} (AUC {result['auc'][m]:.3f})")
    ax.set_xlabel("fraction of pool checked")
    ax.set_ylabel("fraction of corrupted labels found")
    ax.set_title(f"MNIST, {result['model']}, pool {pool['size']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "detection.png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _cmd_uci(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    try:
        names = list(UCI_DATASETS) if args.dataset == ["all"] else [
            _canonical_uci(d) for d in args.dataset]
        if args.bgln_clusters is not None and args.bgln_clusters < 1:
            raise ValueError(f"--bgln-clusters must be a positive int, got {args.bgln_clusters}")
        for name in names:  # fail on missing files before any long run
            load_uci(name, args.data_dir)
    except (ValueError, DataNotFoundError) as error:
        return _error(str(error))
    out = Path(args.out)
    for name in names:
        result = run_uci(name, args.methods, seed=args.seed, out=out / name,
                         data_dir=args.data_dir, removals=args.removals, epochs=args.epochs,
                         pbrf_epochs=args.pbrf_epochs, pbrf_lr=args.pbrf_lr,
                         damping=args.damping,
                         cg_iters=args.cg_iters, cg_data=args.cg_data, subset=args.subset,
                         learning_rates=args.lrs, bgln_moments=args.bgln_moments,
                         bgln_clusters=args.bgln_clusters,
                         point_term=args.point_term, oracle_repeat=args.oracle_repeat,
                         ewc_fisher=args.ewc_fisher,
                         points_per_solve=args.points_per_solve,
                         progress=not args.no_progress)
        print((out / name / "results.md").read_text())
        print(f"{name}: wrote {out / name}/results.json, results.md, scatter.png "
              f"({sum(result['seconds'].values()):.0f} s)", flush=True)
        write_uci_summary(out)
    return 0


def _cmd_mislabeled(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    try:
        result = run_mislabeled(
            args.methods, out=args.out, data_dir=args.data_dir, seed=args.seed,
            n_train=args.n_train, corrupt=args.corrupt, width=args.width, depth=args.depth,
            epochs=args.epochs, lr=args.lr, pool=args.pool, pbrf_steps=args.pbrf_steps,
            pbrf_lr=args.pbrf_lr, damping=args.damping, cg_iters=args.cg_iters,
            cg_data=args.cg_data, ewc_data=args.ewc_data, bgln_covariance=args.bgln_covariance,
            bgln_rank=args.bgln_rank, device=args.device,
            points_per_solve=args.points_per_solve, progress=not args.no_progress)
    except (ValueError, RuntimeError) as error:
        return _error(str(error))
    print((Path(args.out) / "results.md").read_text())
    print(f"AUC: {json.dumps(result['auc'])}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fsd influence uci`` and ``fsd influence mislabeled`` to the ``fsd`` command."""
    influence = subparsers.add_parser(
        "influence", help="influence functions: PBRF with exact / EWC / BGLN-D terms, and CG",
        description="Self-influence via the proximal Bregman response function (paper §5.3).")
    sub = influence.add_subparsers(dest="influence_command", metavar="EXPERIMENT",
                                   required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--data-dir", default=None,
                       help="data directory (default: $FSD_DATA_DIR, else ~/.cache/fsd/data)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--damping", type=float, default=1e-3,
                       help="λ: PBRF proximity weight and CG damping (default 1e-3)")
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        p.add_argument("--points-per-solve", type=int, default=32,
                       help="PBRFs solved side by side, vmapped (default 32; lower it if "
                            "memory runs short, the scores do not depend on it)")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")

    uci = sub.add_parser("uci", help="self-influence vs exact PBRF on UCI regression sets")
    uci.add_argument("--dataset", nargs="+", required=True,
                     help=f"one or more of {', '.join(UCI_DATASETS)}, or 'all'")
    uci.add_argument("--methods", nargs="+", default=list(UCI_METHODS), choices=UCI_METHODS)
    uci.add_argument("--removals", type=int, default=50, help="training points scored (50)")
    uci.add_argument("--epochs", type=int, default=200, help="base training epochs (200)")
    uci.add_argument("--pbrf-epochs", type=float, default=20,
                     help="PBRF optimization length in epochs of batch-128 steps (20)")
    uci.add_argument("--pbrf-lr", type=float, default=None,
                     help="SGD learning rate of the PBRF solves (default: the chosen lr)")
    uci.add_argument("--lrs", type=float, nargs="+", default=list(LEARNING_RATES),
                     help="learning rates searched on the validation split")
    uci.add_argument("--subset", type=int, default=None,
                     help="use only this many random rows of the data set (tiny runs)")
    uci.add_argument("--cg-iters", type=int, default=200, help="max CG iterations (200)")
    uci.add_argument("--cg-data", type=int, default=None,
                     help="random training points CG's Gauss-Newton matrix averages over "
                          "(default: all)")
    uci.add_argument("--bgln-moments", default="paper", choices=["paper", "exact"],
                     help="BGLN-D's moment propagation: paper (Algorithm 2, default) or exact "
                          "(joint moments, = E[BGLN-S])")
    uci.add_argument("--bgln-clusters", type=int, default=None, metavar="K",
                     help="fit BGLN-D as a mixture over K k-means clusters of the training "
                          "inputs (default: one Gaussian, as the paper)")
    uci.add_argument("--ewc-fisher", choices=("true", "sampled", "empirical"), default="true",
                     help="EWC's diagonal: true (exact Gauss-Newton diagonal, default), sampled "
                          "(one model-drawn output per example, the paper's construction) or "
                          "empirical (gradients at the data's own targets)")
    uci.add_argument("--oracle-repeat", action="store_true",
                     help="solve the exact PBRFs again with another minibatch stream and "
                          "report how well the oracle correlates with itself (noise ceiling)")
    uci.add_argument("--point-term", action="store_true",
                     help="add the removed point's own exact Bregman term to the approximate "
                          "(ewc, bgln-d) distance terms, so their PBRF stays bounded below")
    common(uci)
    uci.set_defaults(func=_cmd_uci)

    mis = sub.add_parser("mislabeled", help="detect corrupted MNIST labels by self-influence")
    mis.add_argument("--methods", nargs="+", default=["bgln-d", "ewc", "cg", "random"],
                     choices=MISLABELED_METHODS)
    mis.add_argument("--n-train", type=int, default=6000, help="MNIST training images (6000)")
    mis.add_argument("--corrupt", type=float, default=0.1, help="fraction relabelled (0.1)")
    mis.add_argument("--width", type=int, default=128,
                     help="hidden width (default 128 for CPU; the paper uses 1024)")
    mis.add_argument("--depth", type=int, default=2)
    mis.add_argument("--epochs", type=int, default=50)
    mis.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (0.1)")
    mis.add_argument("--pool", type=int, default=1000, help="random training points scored")
    mis.add_argument("--pbrf-steps", type=int, default=100,
                     help="SGD steps per PBRF solve (100, sized for 2 shared CPU cores)")
    mis.add_argument("--pbrf-lr", type=float, default=0.003,
                     help="PBRF SGD learning rate (0.003: stable for BGLN-D's logit metric)")
    mis.add_argument("--cg-data", type=int, default=500,
                     help="random training points the Gauss-Newton matrix averages over")
    mis.add_argument("--ewc-data", type=int, default=1000,
                     help="random training points EWC's Fisher is fitted on (1000)")
    mis.add_argument("--bgln-covariance", default="lowrank", choices=["full", "diag", "lowrank"])
    mis.add_argument("--bgln-rank", type=int, default=64)
    mis.add_argument("--cg-iters", type=int, default=10, help="max CG iterations (10)")
    mis.add_argument("--device", default="cpu",
                     help="torch device for the network and every method, e.g. cuda (cpu)")
    common(mis)
    mis.set_defaults(func=_cmd_mislabeled)

