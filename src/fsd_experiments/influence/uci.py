"""Self-influence on UCI regressions, each method against the exact PBRF (``fsd influence uci``)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from fsd.estimators.files import file_kind
from fsd.uses.influence import cg_scores, pbrf_scores

from ..compat import uci_bootstrap, uci_result
from ..data import UCI_DATASETS, load_uci
from ..data.uci import canonical_uci_name
from ..io import (
    UnsafeOutputError,
    atomic_write_text,
    check_target,
    claim_output,
    owned_files,
    versioned,
    write_json,
)
from ..models import mlp
from ..plotting import pyplot, write_figure
from ..stats import (
    correlations,
    kmeans_labels,
)
from .common import METHOD_TITLES, _check_methods, mean_loss, recorded_experiment, train_sgd

#: layout of the results.json files ``fsd influence uci`` writes
UCI_SCHEMA = 1
#: the kind of folder ``fsd influence uci`` writes (see ``io.claim_directory``)
UCI_FOLDER = "influence uci run"
#: what ``fsd influence uci`` writes: the summary into its folder, and each data set's
#: results into a sub-folder named after it
UCI_SUMMARY_FILES = ("results.json", "results.md")
UCI_DATASET_FILES = ("results.json", "results.md", "scatter.png")

#: Methods of each study: the PBRF methods, CG, and (mislabeled) a random ranking.
UCI_METHODS: tuple[str, ...] = ("exact", "ewc", "cg", "bgln-d")

LEARNING_RATES: tuple[float, ...] = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)


def _canonical_uci(name: str) -> str:
    canon = canonical_uci_name(name)
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
    n_test = round(test_fraction * n)
    rest = perm[n_test:]
    n_val = round(validation_fraction * rest.shape[0])
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
        dataset: a UCI data set (:data:`fsd_experiments.data.UCI_DATASETS`, or an alias).
        methods: any of :data:`UCI_METHODS`.
        seed: seeds the split, the initialization, the removals and the PBRF minibatches.
        out: also write results.json, results.md and scatter.png there.
        data_dir: the data directory (``None``: ``$FSD_DATA_DIR`` or the default cache).
        removals: training points scored.
        epochs: training epochs of θ0.
        pbrf_epochs: PBRF optimization length, in epochs of ``batch_size`` steps.
        learning_rates: searched on the validation split.
        damping: λ, the PBRF proximity weight and CG's damping.
        batch_size: minibatch size of the training and of the exact PBRF.
        width: hidden width of the MLP.
        depth: hidden layers of the MLP.
        cg_iters: maximum CG iterations.
        dtype: floating-point type of the data and the network.
        progress: show progress bars.
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
    steps = math.ceil(pbrf_epochs * math.ceil(n / batch_size))
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
        result["bootstrap"] = uci_bootstrap(result)
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


def interval_table(results: Iterable[dict[str, Any]]) -> str:
    """Markdown table of bootstrap intervals.

    Each method's Pearson with the exact PBRF, and the paired difference BGLN-D − EWC (an
    interval containing 0: the data do not separate them).
    """
    results = list(results)
    boots = [uci_bootstrap(r) for r in results]
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

    for r, b in zip(results, boots, strict=True):
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
    write_json(out / "results.json", versioned(result, UCI_SCHEMA), indent=2, nan_as_null=True)
    pbrf = uci_result(result)["pbrf"]
    md = [f"# Influence (UCI {result['dataset']}, seed {result['seed']})", "",
          f"N = {result['n_train']} training points, {len(result['removed_indices'])} removals; "
          f"{result['model']}, SGD lr {result['lr']} (validation-chosen), {result['epochs']} "
          f"epochs; PBRF: SGD lr {result['pbrf']['lr']}, {result['pbrf']['steps']} steps, "
          f"λ = {result['pbrf']['damping']}; BGLN-D moments "
          f"{pbrf['bgln_moments']}"
          + (f", mixture over {pbrf['bgln_clusters']} k-means clusters"
             if pbrf["bgln_clusters"] else "") + "; EWC Fisher "
          f"{pbrf['ewc_fisher']}"
          + ("; approximate terms + the removed point's own exact term"
             if pbrf["point_term"] else "") + ".", ""]
    if result["correlation"] or "oracle_repeat" in result:
        md += ["Correlation with the exact PBRF self-influence:", "", uci_table([result]), ""]
    if uci_bootstrap(result) is not None:
        md += [interval_table([result]), ""]
    md += ["Wall time:", "", timing_table([result]), ""]
    atomic_write_text(out / "results.md", "\n".join(md))
    if "exact" in result["scores"] and len(result["scores"]) > 1:
        plt = pyplot()
        others = [m for m in result["scores"] if m != "exact"]
        fig, axes = plt.subplots(1, len(others), figsize=(3.2 * len(others), 3.2), squeeze=False)
        reference = np.asarray(result["scores"]["exact"])
        for ax, m in zip(axes[0], others, strict=True):
            ax.scatter(reference, np.asarray(result["scores"][m]), s=10)
            c = result["correlation"].get(m)
            ax.set_title(f"{METHOD_TITLES[m]}" + (f" (P {_fmt(c['pearson'])})" if c else ""))
            ax.set_xlabel("exact PBRF self-influence")
        axes[0][0].set_ylabel("estimate")
        fig.suptitle(result["dataset"])
        fig.tight_layout()
        write_figure(fig, out / "scatter.png", dpi=110)  # atomically: no half PNG


def claim_uci_folder(out: str | Path, datasets: Sequence[str]) -> Path:
    """Make ``out`` an ``fsd influence uci`` folder before any work, or refuse it.

    New, empty or already this command's; a folder without fsd's marker only where it holds
    nothing but an earlier fsd's UCI results (the summary, data set folders with theirs). A
    data set's folder that is a link or a file, or a result path that is a FIFO, a device or
    a folder, is refused too.

    Raises:
        UnsafeOutputError: the folder or a result path is not fsd's to write (the message
            says which and what to do).
    """
    folder = claim_output(out, UCI_FOLDER, _earlier_uci_folder, UCI_SUMMARY_FILES)
    for name in datasets:
        kind = file_kind(folder / name)
        if kind not in (None, "a directory"):  # a link would be written through
            raise UnsafeOutputError(f"{folder / name} is {kind}, not a folder: fsd writes the "
                                    f"{name} results into a folder of its own there; remove "
                                    f"it or give another --out")
        for file in UCI_DATASET_FILES:
            check_target(folder / name / file)
    return folder


def _earlier_uci_folder(path: Path) -> bool:
    """Whether ``path`` (no marker) holds only an earlier fsd's ``fsd influence uci`` results.

    The summary (its results.json a uci one) and data set folders holding only their
    results, and at least one of these files.
    """
    top = owned_files(path, lambda name: name in UCI_SUMMARY_FILES,
                      folders=lambda name: name in UCI_DATASETS)
    if top is None or ("results.json" in top  # a mislabeled run's is not adopted
                       and recorded_experiment(path / "results.json") != "uci"):
        return False
    inner = [owned_files(path / name, lambda file: file in UCI_DATASET_FILES)
             for name in top if name in UCI_DATASETS]
    if any(files is None for files in inner):
        return False
    return any(name in UCI_SUMMARY_FILES for name in top) or any(inner)


def write_uci_summary(out: Path) -> str:
    """Combine every ``out/<dataset>/results.json`` into ``out/results.md`` / ``results.json``."""
    results = []
    for name in UCI_DATASETS:
        path = out / name / "results.json"
        if path.is_file():
            results.append(uci_result(json.loads(path.read_text())))
    if not results:
        return ""
    text = "\n".join(["# Influence estimation on UCI regression (self-influence vs exact PBRF)",
                      "", uci_table(results), "", interval_table(results), "",
                      "Wall time per method (all removals):", "",
                      timing_table(results), ""])
    atomic_write_text(out / "results.md", text)
    write_json(out / "results.json", indent=2, nan_as_null=True, obj=versioned({
        "experiment": "uci", "datasets": [r["dataset"] for r in results],
        "correlation": {r["dataset"]: r["correlation"] for r in results},
        "bootstrap": {r["dataset"]: uci_bootstrap(r) for r in results},
        "seconds": {r["dataset"]: r["seconds"] for r in results}}, UCI_SCHEMA))
    return text
