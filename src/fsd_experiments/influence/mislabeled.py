"""Mislabeled-example detection on MNIST by self-influence (``fsd influence mislabeled``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from fsd.uses.influence import cg_scores, pbrf_scores

from ..compat import mislabeled_result, pool_corrupted
from ..data import load_mnist
from ..devices import device_name, resolve_device
from ..io import atomic_write_text, claim_output, owned_files, versioned, write_json
from ..models import mlp
from ..plotting import pyplot, write_figure
from ..stats import (
    area_under,
    detection_curve,
    detection_intervals,
)
from .common import METHOD_TITLES, _check_methods, recorded_experiment, train_sgd

#: layout of the results.json files ``fsd influence mislabeled`` writes
MISLABELED_SCHEMA = 1
#: the kind of folder ``fsd influence mislabeled`` writes (see ``io.claim_directory``)
MISLABELED_FOLDER = "influence mislabeled run"
#: what ``fsd influence mislabeled`` writes into its folder
MISLABELED_FILES = ("results.json", "results.md", "detection.png")

MISLABELED_METHODS: tuple[str, ...] = ("exact", "ewc", "cg", "bgln-d", "random")


def corrupt_labels(y: Tensor, fraction: float, classes: int, generator: torch.Generator
                   ) -> tuple[Tensor, Tensor]:
    """Replace ``fraction`` of the labels by a uniformly random *other* class.

    Returns ``(new_labels, corrupted_mask)``.
    """
    n = y.shape[0]
    chosen = torch.randperm(n, generator=generator)[:round(fraction * n)]
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
        methods: any of :data:`MISLABELED_METHODS`.
        out: also write results.json, results.md and detection.png there.
        data_dir: the data directory (``None``: ``$FSD_DATA_DIR`` or the default cache).
        seed: seeds the subset, the corrupted labels, the initialization and the pool.
        n_train: MNIST training images used.
        corrupt: fraction of them relabelled.
        width: hidden width of the MLP.
        depth: hidden layers of the MLP.
        epochs: training epochs.
        lr: SGD learning rate of the training.
        batch_size: minibatch size of the training and of the exact PBRF.
        pool: random training points scored.
        damping: λ, the PBRF proximity weight and CG's damping.
        progress: show progress bars.
        pbrf_steps: SGD steps per PBRF solve (same for ``exact``, ``ewc``, ``bgln-d``).
        points_per_solve: PBRFs solved side by side (speed and memory only, see
            :func:`pbrf_scores`).
        pbrf_lr: PBRF learning rate (``None``: the training ``lr``). The default 0.003 keeps
            SGD stable on BGLN-D's Euclidean-on-logits term, whose curvature is far above the
            KL's (lr 0.1 and 0.01 diverge).
        cg_iters: maximum CG iterations.
        cg_data: random training points the Gauss-Newton matrix G averages over
            (``None`` = all).
        ewc_data: random training points EWC's exact (all-class) Fisher is fitted on.
        bgln_covariance: BGLN-D's input covariance (``"lowrank"``, rank-r + diagonal, keeps
            784-dim inputs affordable).
        bgln_rank: the rank r of the low-rank covariance.
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
    if n_train > x_all.shape[0]:  # slicing would silently keep fewer (and index past them)
        raise ValueError(f"n_train {n_train} is more than the {x_all.shape[0]} MNIST training "
                         "images")
    generator = torch.Generator().manual_seed(seed)
    keep = torch.randperm(x_all.shape[0], generator=generator)[:n_train]
    x = x_all[keep].reshape(len(keep), -1)
    y, corrupted = corrupt_labels(y_all[keep], corrupt, 10, generator)
    # drawn before training, which does not use this generator: the same pool as after it
    pool_index = torch.randperm(n_train, generator=generator)[:pool]
    is_corrupt = corrupted[pool_index].numpy().astype(np.float64)
    if not 0 < is_corrupt.sum() < len(is_corrupt):
        # every detection curve would divide by zero: NaN areas, said before training
        raise ValueError(
            f"the pool of {len(is_corrupt)} points holds "
            f"{'no' if is_corrupt.sum() == 0 else 'only'} corrupted labels "
            f"({int(corrupted.sum())} of the {n_train} training images are corrupted), so "
            f"detection cannot be scored: raise --n-train or --pool, or change --corrupt")
    torch.manual_seed(seed)
    model = mlp(x.shape[1], width, depth, 10).to(device)
    x, y = x.to(device), y.to(device)
    ok = train_sgd(model, x, y, loss="cross_entropy", epochs=epochs, lr=lr,
                   batch_size=batch_size, seed=seed, desc="training", progress=progress)
    if not ok:
        raise RuntimeError(f"training diverged at lr {lr}")
    with torch.no_grad():
        predictions = model(x).argmax(-1).cpu()
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
    write_json(out / "results.json", versioned(result, MISLABELED_SCHEMA), indent=2,
               nan_as_null=True)
    pool = result["pool"]
    shown = mislabeled_result(result)
    boot = result.get("bootstrap", {"auc": {}, "difference": {}, "level": 0.95})
    lines = [f"# Mislabeled-example detection (MNIST, seed {result['seed']})", "",
             f"{result['n_train']} training images, {result['corrupted_total']} labels corrupted; "
             f"{result['model']} (SGD lr {result['lr']}, {result['epochs']} epochs; train acc. "
             f"on given labels {result['train_accuracy_on_given_labels']:.3f}, corrupted "
             f"memorized {result['memorized_corrupted_fraction']:.3f}, test acc. "
             f"{result['test_accuracy']:.3f}). Pool: {pool['size']} random training points "
             f"({pool['corrupted']} corrupted). PBRF: SGD lr {result['pbrf']['lr']}, "
             f"{result['pbrf']['steps']} steps, λ = {result['pbrf']['damping']}; BGLN-D: "
             f"{result['pbrf']['bgln_d']}. Device: {shown['device']}.", "",
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
                     f"{shown['nonfinite'].get(m, 0)} |")
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
    write_figure(fig, out / "detection.png", dpi=110)  # atomically: no half PNG


def claim_mislabeled_folder(out: str | Path) -> Path:
    """Make ``out`` an ``fsd influence mislabeled`` folder before any work, or refuse it.

    New, empty or already this command's; a folder without fsd's marker only where it holds
    nothing but an earlier fsd's mislabeled results (:data:`MISLABELED_FILES`, its
    results.json a mislabeled one). A result path that is a FIFO, a device or a folder is
    refused too.

    Raises:
        UnsafeOutputError: the folder or a result path is not fsd's to write (the message
            says which and what to do).
    """
    return claim_output(out, MISLABELED_FOLDER, _earlier_mislabeled_folder, MISLABELED_FILES)


def _earlier_mislabeled_folder(path: Path) -> bool:
    """Whether ``path`` (no marker) holds only an earlier fsd's mislabeled results."""
    found = owned_files(path, lambda name: name in MISLABELED_FILES)
    return bool(found) and ("results.json" not in found  # a uci summary is not adopted
                            or recorded_experiment(path / "results.json") == "mislabeled")
