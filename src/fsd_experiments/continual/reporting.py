"""Across ``fsd cl`` runs: the report table, merging seeds run apart, the penalty gap."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from fsd.estimators.base import load
from fsd.estimators.exact_fsd import ExactFSD
from fsd.estimators.linearized import BGLN
from fsd.estimators.ntk import NTK
from fsd.model.rules import UnsupportedModuleError
from fsd.moments.evaluators import names as evaluator_names

from ..benchmarks import CNN_MODELS, make_tasks
from ..compat import cl_checkpoint_settings, is_cl_results
from ..io import (
    claim_directory,
    exclusive_directory,
    read_json,
    refuse_nested,
    refuse_used_directory,
)
from ..plotting import pyplot, write_figure
from ..presets import PRESETS, default_hyperparameters
from .results import RunResults, SeedResult, _mean_matrix, _pm, accuracy_summary, write_results
from .runner import (
    CHECKPOINT_FOLDER,
    METHODS,
    RUN_FOLDER,
    build_model,
    checked_matrix,
    is_checkpoint_folder,
    read_checkpoint,
    summary_outputs,
)
from .settings import Hyperparameters


def merge_runs(paths: Sequence[str | os.PathLike], out: str | os.PathLike,
               plots: bool = True, partial: bool = False,
               checkpoints: bool = True) -> RunResults:
    """Combine separate runs of the same benchmark, method and settings into one.

    Seeds run in parallel or on other machines become one ``out/results.json`` with
    statistics over all seeds. With ``checkpoints`` (the default), each merged seed's
    checkpoint folder (``checkpoints/seed<S>``), where its run kept one, is carried into
    ``out`` (hard-linked where the file system allows, else copied), so ``fsd cl gap`` and a
    resumed ``fsd cl`` or ``fsd cl tune`` see the merged seeds as finished; seeds whose runs
    kept no checkpoint (committed result files) merge without one.
    Raises ``ValueError`` if the runs differ in benchmark, method or hyper-parameters (older
    files are read as :mod:`fsd_experiments.compat` says: a setting absent from them is what
    the run did then, ``None`` for most), are unfinished, or repeat a seed. ``partial=True``
    accepts runs stopped before all their requested seeds and takes the seeds they finished
    (a results.json only ever lists finished seeds). Each run's device is kept per seed
    (``devices``).
    """
    if Path(out).resolve() in {Path(p).resolve() for p in paths}:
        raise ValueError(f"--out {out} is one of the runs merged: give a new directory (merged "
                         f"results would list seeds whose checkpoints it does not hold)")
    # into another run's directory, its results.json would be replaced while its checkpoints
    # stay, and fsd cl gap or a rerun there would mix the two
    why = "merge writes only where no other run's results or checkpoints are"
    refuse_nested(out, is_checkpoint_folder, CHECKPOINT_FOLDER)
    refuse_used_directory(out, why)  # before reading the runs; again under the lock below
    runs: list[tuple[Path, RunResults]] = []
    for path in paths:
        file = Path(path) / "results.json"
        if not file.is_file():
            raise ValueError(f"{file} not found: merge takes finished run directories")
        runs.append((file, RunResults.read(file)))
    if not runs:
        raise ValueError("merge needs at least one run directory")
    first_file, first = runs[0]
    done: list[SeedResult] = []
    devices: list[str] = []
    seed_folders: dict[int, Path] = {}
    for file, results in runs:
        for key in ("benchmark", "method", "hyperparameters"):
            if getattr(results, key) != getattr(first, key):
                raise ValueError(f"{file} differs from {first_file} in {key}: "
                                 f"{getattr(results, key)!r} vs {getattr(first, key)!r}")
        if not results.complete and not partial:
            raise ValueError(f"{file} is unfinished (complete: false); finish it first, or "
                             "take its finished seeds with partial=True (--partial)")
        bytes_per_task = results.summary_bytes_per_task
        walls = results.wall_seconds["per_seed"]
        for seed, wall in zip(results.seeds, walls, strict=True):
            if any(r.seed == seed for r in done):
                raise ValueError(f"seed {seed} appears twice (again in {file})")
            # the per-task sizes are not stored per seed; their mean is what results keep
            done.append(SeedResult(seed, results.accuracy_matrix[str(seed)], float(wall),
                                   [int(bytes_per_task)] if bytes_per_task else []))
            devices.append(results.device)
            folder = file.parent / "checkpoints" / f"seed{seed}"
            if checkpoints and (folder / "state.pt").is_file():
                seed_folders[int(seed)] = folder
    # the runs' own thread count (the merging process's says nothing about them); None
    # when they differ or did not record it
    threads = {results.torch_threads for _, results in runs}
    # likewise the versions that ran them, not the merging process's
    torch_versions = {results.torch_version for _, results in runs}
    fsd_versions = {results.fsd_version for _, results in runs}
    cpus = {results.cpu for _, results in runs}
    merged = replace(
        RunResults.collect(first.benchmark, first.method, first.hyperparameters,
                           [r.seed for r in done], done, "cpu"),
        torch_threads=threads.pop() if len(threads) == 1 else None,
        torch_version=_joined(torch_versions),
        fsd_version=_joined(fsd_versions),
        cpu=_joined(cpus),
        device=" + ".join(sorted(set(devices))),
        devices={str(r.seed): d for r, d in zip(done, devices, strict=True)},
        merged_from=[str(Path(p)) for p in paths])
    out = Path(out)
    with exclusive_directory(out):  # an fsd cl (or merge) starting there now is refused
        refuse_used_directory(out, why)
        claim_directory(out, RUN_FOLDER)  # empty: marked as an fsd cl run's folder
        # checkpoints first: results.json, written last, is what says the seeds are done
        try:
            for seed, folder in sorted(seed_folders.items()):
                shutil.copytree(folder, out / "checkpoints" / f"seed{seed}",
                                copy_function=_link_or_copy,
                                ignore=shutil.ignore_patterns(".*.tmp"))
        except (OSError, _CopyError) as error:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # half a copy looks resumable
            raise error.cause if isinstance(error, _CopyError) else error from None
        write_results(merged, out, plots=plots)
    return merged


class _CopyError(Exception):
    """A file's copy failed: raised through ``copytree``, which would gather an OSError."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _link_or_copy(source: str, destination: str) -> None:
    """Hard-link a checkpoint file (no second copy on disk), or copy it across file systems.

    A link is safe: runs replace their checkpoint files (write, then rename), never write
    into them, so resuming either directory does not change the other's files.
    """
    try:
        os.link(source, destination)
    except OSError:
        try:
            shutil.copy2(source, destination)
        except OSError as error:  # a full disk: stop at once, naming the file and the reason
            named = error.filename is not None or error.errno is None
            raise _CopyError(error if named else
                             type(error)(error.errno, error.strerror, destination)) from None


def _joined(versions: set[str | None]) -> str | None:
    """One version, or several joined by " + " (None when no run recorded one)."""
    if versions == {None}:
        return None
    return " + ".join(sorted(v or "unrecorded" for v in versions))


# The paper's numbers (tables "avg_mnist", "bwt_mnist", "kl_cifar" and "task_seq"), verbatim;
# methods/benchmarks the tables do not give are absent. On Split CIFAR-100 each method's row is
# the one of its default metric (presets._CIFAR_METRIC).
PAPER: dict[str, dict[str, dict[str, str]]] = {
    "avg": {
        "split-mnist": {
            "ntk": "99.50 ± 0.09", "bgln-s-coreset": "99.50 ± 0.03", "ewc": "63.10",
            "osla": "80.56",
            "bgln-d": "99.72 ± 0.03", "bgln-d-cw": "99.78 ± 0.02", "bgln-s": "99.64 ± 0.04",
            "bgln-s-cw": "99.77 ± 0.05", "bgln-d-var": "99.64 ± 0.04",
            "bgln-s-var": "99.50 ± 0.03"},
        "permuted-mnist": {
            "ntk": "96.46 ± 0.11", "bgln-s-coreset": "96.36 ± 0.13", "ewc": "84.00",
            "osla": "95.73",
            "bgln-d": "96.03 ± 0.20", "bgln-d-cw": "96.85 ± 0.02", "bgln-s": "96.36 ± 0.12",
            "bgln-s-cw": "96.99 ± 0.07", "bgln-d-var": "94.98 ± 0.18",
            "bgln-s-var": "96.36 ± 0.13"},
        "split-cifar100": {
            "ntk": "77.61 ± 0.20", "ewc": "71.60 ± 0.40", "osla": "72.61",
            "laftr-coreset": "78.33 ± 0.01", "laftr": "75.61 ± 0.01",
            "bgln-s": "74.29 ± 0.01", "bgln-s-cw": "77.78 ± 0.01",
            "bgln-s-coreset": "73.27 ± 0.01"},
        "split-cifar100-11": {"laftr-coreset": "78.75 ± 0.01"},
    },
    "bwt": {
        "split-mnist": {"bgln-s": "-0.04 ± 0.03", "bgln-d": "-0.09 ± 0.04",
                        "bgln-s-cw": "-0.18 ± 0.06", "bgln-d-cw": "-0.07 ± 0.07"},
        "permuted-mnist": {"bgln-s": "-0.41 ± 0.08", "bgln-d": "-0.56 ± 0.04",
                           "bgln-s-cw": "-0.37 ± 0.14", "bgln-d-cw": "-1.17 ± 0.07"},
        "split-cifar100": {"ntk": "-2.03 ± 0.04", "laftr-coreset": "-0.73 ± 0.10",
                           "laftr": "-1.93 ± 0.59", "bgln-s": "-5.49 ± 0.05",
                           "bgln-s-cw": "-1.75 ± 0.50", "bgln-s-coreset": "-4.99 ± 0.28"},
        "split-cifar100-11": {"laftr-coreset": "-1.59 ± 0.47"},
    },
}


def _find_results(paths: Sequence[str]) -> list[Path]:
    # run directories, or folders holding them; symbolic links are not followed, so a
    # folder such as /proc/self cannot send the search round in circles
    found: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_file():
            found.append(path)
        elif (path / "results.json").is_file():
            found.append(path / "results.json")
        elif path.is_dir():
            found += sorted(Path(root) / "results.json" for root, _, files in os.walk(path)
                            if "results.json" in files)
        else:
            raise ValueError(f"{path} does not exist")
    if paths and not found:
        raise ValueError(f"no results.json in {', '.join(map(str, paths))}: give run "
                         f"directories of fsd cl, or folders holding them")
    return found


#: the settings compared with the defaults — by ``report``'s protocol column ("not paper
#: protocol: …") and the row tables' "differs from the defaults" cell — in this order
SETTINGS = ("fsd_scale", "lr", "epochs", "first_epochs", "batch_size", "model", "width",
            "penalty_outputs", "metric", "rank", "optimizer", "penalty", "coreset_size",
            "num_samples", "momentum", "train_subset", "test_subset", "tasks", "validation",
            "injection_rank", "statistics")


def _protocol(hp: Hyperparameters, benchmark: str, method: str, device: str = "cpu") -> str:
    paper = default_hyperparameters(benchmark, method)
    epochs = f"{hp.epochs} ep" if hp.first_epochs is None else \
        f"{hp.first_epochs}+{hp.epochs} ep"
    network = {"mlp": f"w {hp.width}", "cnn": "CNN", "resnet": "ResNet"}.get(
        hp.model, "CNN, average pools")
    parts = [epochs, f"bs {hp.batch_size}", f"λ {hp.fsd_scale:g}", f"lr {hp.lr:g}", network]
    settings = hp.to_dict()
    changed = [k for k in SETTINGS if settings[k] != paper[k]]
    if hp.optimizer != paper["optimizer"]:
        parts.append(f"{hp.optimizer} Adam")
    if hp.penalty != paper["penalty"]:
        parts.append(f"penalty {hp.penalty}")
    if hp.penalty_outputs != paper["penalty_outputs"]:
        parts.append(f"{hp.penalty_outputs} logits")
    if hp.rank:
        parts.append(f"lowrank r={hp.rank}")
    if hp.injection_rank:
        parts.append(f"injections r={hp.injection_rank}")
    if hp.statistics != paper["statistics"]:
        parts.append(f"statistics {hp.statistics}")
    if hp.metric != paper["metric"]:
        parts.append(f"metric {hp.metric or 'euclidean'}")
    if hp.train_subset:
        parts.append(f"train {hp.train_subset}/task")
    if hp.tasks:
        parts.append(f"{hp.tasks} tasks")
    if device != "cpu":
        parts.append(f"on {device}")
    return ", ".join(parts) + (" (**not paper protocol**: " + ", ".join(changed) + ")"
                               if changed else "")


def _read_runs(paths: Sequence[str]) -> list[tuple[str, str, Path, RunResults]]:
    """(benchmark, method, results.json, results) of every ``fsd cl`` run under ``paths``."""
    rows: list[tuple[str, str, Path, RunResults]] = []
    found = _find_results(paths)
    for path in found:
        raw = read_json(path)  # a file that is not JSON is named, not a bare JSON error
        if isinstance(raw, dict) and {"benchmark", "method"} <= set(raw) \
                and not is_cl_results(raw):
            raise ValueError(f"{path} names a benchmark and a method but has no "
                             "accuracy_matrix: not a finished fsd cl run (damaged?)")
        if not isinstance(raw, dict) or not is_cl_results(raw):
            continue  # another tool's results.json (e.g. fsd influence) under the same folder
        res = RunResults.from_json(raw, path)  # checked: a NaN or a null is named, not shown
        rows.append((res.benchmark, res.method, path, res))
    if found and not rows:
        raise ValueError(f"none of the {len(found)} results.json under "
                         f"{', '.join(map(str, paths))} was written by fsd cl")
    rows.sort(key=lambda r: (r[0], r[1], str(r[2])))
    return rows


def report(paths: Sequence[str]) -> str:
    """One markdown table comparing runs (method × benchmark) next to the paper's numbers."""
    rows = _read_runs(paths)
    lines = [
        "| benchmark | method | seeds | avg acc (%) | paper avg acc | BWT (%) | paper BWT | "
        "summary bytes/task | wall time | protocol | run |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for bench, method, path, res in rows:
        seeds = ",".join(map(str, res.seeds))
        if not res.complete:
            seeds += f" (of {len(res.seeds_requested)})"
        wall = res.wall_seconds
        per = np.mean(wall["per_seed"]) if wall["per_seed"] else 0.0
        threads = f" ({res.torch_threads} threads)" if (res.torch_threads or 1) != 1 else ""
        lines.append(
            f"| {bench} | {method} | {seeds} | {_pm(res.avg_accuracy)} | "
            f"{PAPER['avg'].get(bench, {}).get(method, '–')} | "
            f"{_pm(res.backward_transfer)} | {PAPER['bwt'].get(bench, {}).get(method, '–')} | "
            f"{res.summary_bytes_per_task:,.0f} | {per / 60:.1f} min/seed{threads} | "
            f"{_protocol(res.hyperparameters, bench, method, res.device)} | `{path.parent}` |")
    notes = [
        "", "avg acc: mean test accuracy over all tasks after the last task; BWT: "
        "(1/(T−1)) Σ_{i<T} (R[T,i] − R[i,i]), in accuracy points. ± is the standard deviation "
        "over seeds (numpy.std). Wall time: training + evaluation + summary fitting per seed, "
        "1 CPU thread unless the cell names more, or the GPU named in the protocol column "
        "(\"on …\"). summary "
        "bytes/task: `Estimator.nbytes` (θ copy + statistics or coreset) per finished task. "
        "Paper numbers: tables `avg_mnist` and `bwt_mnist` of the paper (– = not reported "
        "there)."]
    return "\n".join(lines + notes) + "\n"


#: a row folder's name: its row id (letters, number, optional lower-case suffix), a dash, a name
_ROW_FOLDER = re.compile(r"^([A-Z]+)(\d+)([a-z]*)-")



def _row_match(folder: Path) -> re.Match[str]:
    found = _ROW_FOLDER.match(folder.name)
    if not found:
        raise ValueError(f"{folder} is not a row folder: --rows, --gap and --wall take folders "
                         f"named ROW-NAME, e.g. S1-bgln-s (letters and a number, a dash, a name)")
    return found


def _row_key(path: Path) -> tuple[str, int, str]:
    found = _row_match(path.parent)
    return found[1], int(found[2]), found[3]


def _row_id(folder: Path) -> str:
    """The row id a row folder's name starts with (``S1`` of ``S1-bgln-s``)."""
    return _row_match(folder)[0][:-1]


def _machine(res: RunResults) -> str:
    # a CPU run's vector instructions (AVX2, AVX512, …): runs repeat only on the same ones
    capabilities = sorted({cpu.rsplit(", ", 1)[-1] for cpu in res.cpu.split(" + ")}) \
        if res.cpu and res.device == "cpu" else []
    device = res.device + (f" ({' + '.join(capabilities)})" if capabilities else "")
    threads = res.torch_threads
    return device + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")


def _per_benchmark(tables: list[tuple[str, str]]) -> str:
    """One table as it is; several each under its benchmark's name."""
    if len(tables) == 1:
        return tables[0][1]
    return "\n".join(f"{bench}:\n\n{table}" for bench, table in tables)


def _row_changes(hp: Hyperparameters, benchmark: str, method: str) -> str:
    defaults = default_hyperparameters(benchmark, method)
    settings = hp.to_dict()
    names = {"fsd_scale": "λ", "penalty_outputs": "penalty outputs"}
    changed = [f"{names.get(k, k.replace('_', ' '))} "
               + (f"{settings[k]:g}" if isinstance(settings[k], float) else f"{settings[k]}")
               for k in SETTINGS if settings[k] != defaults[k]]
    return ", ".join(changed) or "–"


def per_seed_cell(summary: dict[str, Any]) -> str:
    """A table cell: mean ± sd of a per-seed summary, then each seed's value."""
    values = summary["per_seed"]
    if len(values) < 2:
        return _pm(summary)
    return f"{_pm(summary)} ({', '.join(f'{v:.2f}' for v in values)})"


def _paper(kind: str, bench: str, method: str, res: RunResults) -> str:
    """The paper's number for a row, or "–".

    "–" also where the row trains only the first tasks (``--tasks``): their average is not
    the whole stream's.
    """
    if res.hyperparameters.tasks is not None:
        return "–"
    return PAPER[kind].get(bench, {}).get(method, "–")


def row_tables(paths: Sequence[str]) -> str:
    """The results tables of the docs: one per benchmark, a line per row folder.

    A row folder (``results/cl/<benchmark>/<ROW>-<name>/``, e.g. ``S1-bgln-s``) holds one
    finished or merged ``fsd cl`` run; its ``ROW`` prefix orders the table. The columns are
    what the docs' continual-learning tables show: the method and λ, the settings that differ
    from ``fsd cl``'s defaults for the (benchmark, method), the seeds, the average accuracy
    and backward transfer (mean ± std over seeds, per-seed values in brackets) beside the
    paper's, the summary size, the wall time and the machine the run recorded. Raises
    ``ValueError`` for a folder whose name carries no row id.
    """
    rows = sorted(_read_runs(paths), key=lambda r: _row_key(r[2]))
    ids = [_row_id(r[2].parent) for r in rows]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"row ids used by more than one folder: {', '.join(repeated)}")
    tables: list[tuple[str, str]] = []
    for bench in dict.fromkeys(r[0] for r in rows):
        lines = [
            "| row | method | λ | differs from the defaults | seeds | avg acc (%) | paper | "
            "BWT | paper BWT | bytes/task | min/seed | machine |",
            "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for _, method, path, res in (r for r in rows if r[0] == bench):
            row = _row_id(path.parent)
            seeds = " ".join(map(str, res.seeds))
            if not res.complete:
                seeds += f" (of {len(res.seeds_requested)})"
            walls = res.wall_seconds["per_seed"]
            minutes = f"{np.mean(walls) / 60:.1f}" if walls else "–"
            lines.append(
                f"| {row} | {method} | {res.hyperparameters.fsd_scale:g} | "
                f"{_row_changes(res.hyperparameters, bench, method)} | {seeds} | "
                f"{per_seed_cell(res.avg_accuracy)} | {_paper('avg', bench, method, res)} | "
                f"{_pm(res.backward_transfer)} | {_paper('bwt', bench, method, res)} | "
                f"{res.summary_bytes_per_task:,.0f} | {minutes} | {_machine(res)} |")
        tables.append((bench, "\n".join(lines) + "\n"))
    return _per_benchmark(tables)


#: what a row and the fine-tuning row it is timed against must share: the task stream, the
#: network, the epochs, the held-out split and the machine (batch size, λ and learning rate
#: are the method's own)
_SAME_WORK = ("model", "width", "tasks", "epochs", "first_epochs", "train_subset", "test_subset",
              "validation")


def wall_tables(paths: Sequence[str]) -> str:
    """Wall time per seed of every row folder beside fine-tuning's: one table per benchmark.

    Each row's minutes per seed (mean over its seeds) and its ratio to the fine-tuning row
    (method ``finetune``) among ``paths`` that trains the same task stream on the same network
    for the same epochs on the same device and thread count (the lowest row id when several
    do; "–" when none does). The runs record their own wall time, so the ratio is only as
    steady as the machine was while they ran. Row folders as in :func:`row_tables`.
    """
    rows = sorted(_read_runs(paths), key=lambda r: _row_key(r[2]))

    def work(res: RunResults) -> tuple[Any, ...]:
        settings = res.hyperparameters.to_dict()
        return (res.benchmark, res.device, res.torch_threads,
                *(settings[k] for k in _SAME_WORK))

    def minutes(res: RunResults) -> float | None:
        walls = res.wall_seconds["per_seed"]
        return float(np.mean(walls)) / 60 if walls else None

    baselines: dict[tuple[Any, ...], tuple[str, float | None]] = {}
    for _, method, path, res in rows:
        if method == "finetune":
            baselines.setdefault(work(res), (_row_id(path.parent), minutes(res)))
    tables: list[tuple[str, str]] = []
    for bench in dict.fromkeys(r[0] for r in rows):
        lines = ["| row | method | differs from the defaults | seeds | min/seed | "
                 "× fine-tuning | machine |",
                 "|---|---|---|---|---:|---:|---|"]
        for _, method, path, res in (r for r in rows if r[0] == bench):
            own = minutes(res)
            base = baselines.get(work(res))
            if method == "finetune" or base is None or own is None or not base[1]:
                ratio = "–"
            else:
                ratio = f"{own / base[1]:.1f}× ({base[0]})"
            changes = _row_changes(res.hyperparameters, bench, method)
            seeds = " ".join(map(str, res.seeds))
            lines.append(f"| {_row_id(path.parent)} | {method} | {changes} | {seeds} | "
                         f"{'–' if own is None else f'{own:.1f}'} | {ratio} | {_machine(res)} |")
        tables.append((bench, "\n".join(lines) + "\n"))
    return _per_benchmark(tables)


def learning_tables(paths: Sequence[str]) -> str:
    """Each row's accuracy split into what its tasks learned and kept: a table per benchmark.

    A line per row folder (as :func:`row_tables` finds them, in row order): its method and λ;
    each task's accuracy right after its own training (R[i,i]) averaged over tasks, per seed;
    the average accuracy at the end; BWT; and per task, averaged over seeds, R[i,i] → R[T,i].
    An average accuracy below another row's is then either less learned (the first of these)
    or more forgotten (BWT).
    """
    rows = sorted(_read_runs(paths), key=lambda r: _row_key(r[2]))
    tables: list[tuple[str, str]] = []
    for bench in dict.fromkeys(r[0] for r in rows):
        lines = ["| row | method | λ | right after its own training (mean over tasks) | "
                 "avg acc at the end | BWT | per task, mean over seeds: right after → at the "
                 "end |", "|---|---|---:|---|---:|---:|---|"]
        for _, method, path, res in (r for r in rows if r[0] == bench):
            matrices = [res.accuracy_matrix[str(seed)] for seed in res.seeds]
            tasks = len(matrices[0])
            learned = [float(np.mean([m[i][i] for i in range(tasks)])) for m in matrices]
            per_task = [f"{np.mean([m[i][i] for m in matrices]):.2f} → "
                        f"{np.mean([m[-1][i] for m in matrices]):.2f}" for i in range(tasks)]
            bwt = f"{res.backward_transfer['mean']:.2f}".replace("-", "−")
            lines.append(
                f"| {_row_id(path.parent)} | {method} | {res.hyperparameters.fsd_scale:g} | "
                f"{per_seed_cell(accuracy_summary(learned))} | "
                f"{res.avg_accuracy['mean']:.2f} | {bwt} | {'; '.join(per_task)} |")
        tables.append((bench, "\n".join(lines) + "\n"))
    return _per_benchmark(tables)


def comparison_plot(paths: Sequence[str], out: str | os.PathLike) -> Path:
    """One figure comparing runs: test accuracy on each task after each task trained.

    One panel per benchmark, one colour per run: a thin line per task from the moment it is
    trained (how much of it is kept as later tasks are learned) and a thick line for the mean
    accuracy over the tasks trained so far, labelled with the final average. Accuracies are
    means over the run's seeds. Written atomically to ``out`` (its suffix picks the format).
    """
    rows = _read_runs(paths)
    if not rows:
        raise ValueError(f"no fsd cl results.json in {', '.join(map(str, paths))} to plot")
    return write_figure(_comparison_figure(rows), out, dpi=120)


def _comparison_figure(rows: list[tuple[str, str, Path, RunResults]]) -> Any:
    """The figure of :func:`comparison_plot` (a matplotlib ``Figure``)."""
    benchmarks = list(dict.fromkeys(bench for bench, *_ in rows))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(benchmarks), figsize=(6.0 * len(benchmarks), 4.2),
                             squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, bench in zip(axes[0], benchmarks, strict=True):
        runs = [(method, res) for b, method, _, res in rows if b == bench]
        for k, (method, res) in enumerate(runs):
            r = _mean_matrix(res)
            t = r.shape[0]
            colour = colours[k % len(colours)]
            for j in range(t):  # task j+1's accuracy from the moment it is trained
                ax.plot(range(j + 1, t + 1), r[j:, j], color=colour, lw=1, alpha=0.35)
            seeds = f", {len(res.seeds)} seeds" if len(res.seeds) > 1 else ""
            ax.plot(range(1, t + 1), [r[i, :i + 1].mean() for i in range(t)], color=colour,
                    lw=2.5, marker="o",
                    label=f"{method}: {r[-1].mean():.2f} % after task {t}{seeds}")
        t_max = max(_mean_matrix(res).shape[0] for _, res in runs)
        ax.set_xticks(range(1, t_max + 1))
        ax.set_xlabel("tasks trained")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{bench}: mean over tasks so far (thick), each task (thin)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


#: the ``fsd cl`` methods whose summaries split by layer (``fsd cl gap --by-layer``)
LAYER_SPLIT_METHODS: tuple[str, ...] = tuple(
    name for name, preset in PRESETS.items()
    if preset.estimator is not None and preset.estimator.splits_by_layer)


def penalty_gap(run_dir: str | os.PathLike, data_dir: str | None = None,
                examples: int = 10_000, linearized: bool = False,
                by_layer: bool = False, evaluators: Sequence[str] = ()
                ) -> list[dict[str, Any]]:
    """How well each stored summary tracks the FSD it was meant to bound, at the end of a run.

    For every seed's final model (``checkpoints/seed<S>/state.pt``) and every previous task t,
    compares the summary's estimate D_t(θ_final) with the true FSD between θ_t (the summary's
    reference) and θ_final over task t's first ``examples`` training inputs, in the summary's
    own metric and outputs. An estimate far below the truth means training found directions
    the penalty does not see (e.g. ReLU gates that flip, which a linearization cannot show).

    With ``linearized``, each row also has ``linearized``: the FSD of the final network
    linearized in its parameters around θ_t (:class:`fsd.NTK` on the same inputs), the
    quadratic model that a Gauss-Newton penalty such as OSLA's approximates further. The
    truth over it is the linearization's share of the gap; it over the estimate is the rest.

    With ``by_layer`` (summaries whose estimate is a sum over layers: K-FAC's and EWC's,
    :data:`LAYER_SPLIT_METHODS`), each row also has ``layers``: per layer, the linearized FSD
    when only that layer moves (the Gauss-Newton's diagonal block) and the summary's term
    for it (:meth:`fsd.Estimator.layer_terms`), which shows the layers whose factorization
    (K-FAC) or diagonal (EWC) loses the FSD.

    A seed still running (or stopped before its last task) is compared at its latest
    checkpoint: its model then stands for the final one, and the tasks trained before it
    are compared; each row's ``after_task`` says how many tasks the model had trained.

    With ``evaluators`` (BGLN-D runs; names of :func:`fsd.moments.evaluators.names`), each
    row also has ``evaluators``: the same summary's statistics walked by each of them at the
    final network (:meth:`fsd.BGLN.distance_by`), e.g. whether training against the
    corrected recursion found directions that exact moments would charge for.

    Returns one row per (seed, task): ``seed, task, after_task, finished, true_fsd,
    estimate, ratio`` (and ``linearized``, ``layers``, ``evaluators``).

    Raises:
        ValueError: ``by_layer`` on a run whose summaries do not split by layer;
            ``evaluators`` on a run that is not BGLN-D, or an unknown name; a run of a
            method without summaries; a directory with neither results.json nor a
            checkpoint; a seed whose checkpoint is missing, damaged or does not fit the
            run's settings, or lacks a summary it would compare (each names the file).
    """
    run = Path(run_dir)
    benchmark, method, hp, seeds = _run_settings(run)
    if METHODS[method].estimator is None:
        raise ValueError(f"{run} is a run of {method}, which stores no summaries; fsd cl gap "
                         f"compares each task's summary with the true FSD")
    if by_layer and method not in LAYER_SPLIT_METHODS:  # before any data loads
        raise ValueError(f"--by-layer splits summaries whose estimate is a sum over layers "
                         f"(fsd cl --method {' or '.join(LAYER_SPLIT_METHODS)}); {run} is a "
                         f"run of {method}")
    if evaluators:
        preset = PRESETS[method]
        # BGLN with deterministic=True, or a subclass of it (BGLNVariant, always BGLN-D)
        bgln_d = preset.estimator is not None and issubclass(preset.estimator, BGLN) and (
            preset.estimator is not BGLN or preset.options.get("deterministic", False))
        if not bgln_d:
            raise ValueError(f"--evaluators walks BGLN-D summaries' moments; {run} is a run of "
                             f"{method}")
        unknown = sorted(set(evaluators) - set(evaluator_names()))
        if unknown:
            raise ValueError(f"unknown evaluators {unknown}; known: "
                             f"{', '.join(evaluator_names())}")
        flat = [name for name in evaluators if not name.endswith("-conv")]
        if hp.model in CNN_MODELS and flat:
            conv = [name for name in evaluator_names() if name.endswith("-conv")]
            raise ValueError(f"evaluators {flat} walk MLP chains; {run} trains the "
                             f"{hp.model} (its walks: {', '.join(conv)})")
    # every seed's files are checked before any data loads or any FSD is computed: a task
    # left out of the table, or a traceback after an hour, would be worse than one line
    states = {seed: _gap_checkpoint(run / "checkpoints" / f"seed{seed}") for seed in seeds}
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        ckpt = run / "checkpoints" / f"seed{seed}"
        # the tasks the run trained on: with a validation split, its training part only
        tasks, n_out = make_tasks(benchmark, data_dir, int(seed), train_subset=hp.train_subset,
                                  test_subset=hp.test_subset, num_tasks=hp.tasks,
                                  validation=hp.validation)
        shape = tasks[0].x_train.shape[1:]
        final = build_model(hp, shape, n_out)
        state = states[seed]
        trained = len(checked_matrix(state, ckpt / "state.pt", len(tasks)))  # a row per task
        try:
            final.load_state_dict(state["model"])
        except (RuntimeError, TypeError, AttributeError) as error:
            raise ValueError(f"{ckpt / 'state.pt'} does not fit the model of the run's "
                             f"settings ({type(error).__name__})") from None
        for t in range(trained - 1):
            summary = load(ckpt / f"task{t}.fsd")  # a damaged file: SummaryFormatError naming it
            reference = build_model(hp, shape, n_out)
            reference.load_state_dict(summary.reference_state_dict())
            x = tasks[t].x_train[:examples]
            metric, outputs = summary.config.get("metric", "euclidean"), summary_outputs(
                tasks[t], hp)
            truth = ExactFSD(metric=metric).fit(reference, x, outputs=outputs)
            with torch.no_grad():
                true_fsd = float(truth.distance(final))
                estimate = float(summary.distance(final))
                try:
                    walked = {name: float(summary.distance_by(final, name))  # type: ignore[attr-defined]
                              for name in evaluators}
                except (UnsupportedModuleError, NotImplementedError) as error:
                    raise ValueError(f"{ckpt / f'task{t}.fsd'}: {error}") from None
            row = {"seed": int(seed), "task": t + 1, "after_task": trained,
                   "finished": trained == len(tasks), "true_fsd": true_fsd,
                   "estimate": estimate,
                   "ratio": estimate / true_fsd if true_fsd > 0 else math.nan}
            if evaluators:
                row["evaluators"] = walked
            if linearized:
                row["linearized"] = _linearized_fsd(reference, final, x, metric, outputs)
            if by_layer:
                with torch.no_grad():
                    terms = summary.layer_terms(final)
                row["layers"] = [
                    {"layer": layer, "estimate": float(term),
                     "linearized": _linearized_fsd(reference, _moved_layer(reference, final, layer),
                                                   x, metric, outputs)}
                    for layer, term in terms.items()]
            rows.append(row)
    return rows


def _gap_checkpoint(ckpt: Path) -> dict[str, Any]:
    """A seed's checkpoint for :func:`penalty_gap`, with the summaries it compares present."""
    state_path = ckpt / "state.pt"
    if not state_path.is_file():
        raise ValueError(f"{state_path} not found: fsd cl gap reads each seed's checkpoint (a "
                         f"merged directory has none; give the run directories it merged)")
    state = read_checkpoint(state_path)
    trained = len(checked_matrix(state, state_path, None))
    missing = [f"task{t}.fsd" for t in range(trained - 1) if not (ckpt / f"task{t}.fsd").is_file()]
    if missing:
        raise ValueError(f"{ckpt} lacks {', '.join(missing)}, which fsd cl gap compares after "
                         f"task {trained}")
    return state


def _run_settings(run: Path) -> tuple[str, str, Hyperparameters, list[int]]:
    """Benchmark, method, settings and seeds of a run directory, finished or not.

    The seeds are results.json's and then those that have a checkpoint but have not
    finished; without results.json, the settings come from a checkpoint.
    """
    started = sorted(int(p.parent.name[len("seed"):])
                     for p in run.glob("checkpoints/seed*/state.pt")
                     if p.parent.name[len("seed"):].lstrip("-").isdigit())
    if (run / "results.json").exists():
        results = RunResults.read(run / "results.json")
        seeds = [int(s) for s in results.seeds]
        return (results.benchmark, results.method, results.hyperparameters,
                [*seeds, *(s for s in started if s not in seeds)])
    if not started:
        raise ValueError(f"{run} has neither results.json nor a checkpoint of fsd cl")
    saved = json.loads(read_checkpoint(run / "checkpoints" / f"seed{started[0]}" / "state.pt")
                       ["hyperparameters"])
    benchmark, method = saved.pop("benchmark", None), saved.pop("method", None)
    if benchmark is None or method is None:
        raise ValueError(f"{run}: its checkpoint is older than the settings it would need; "
                         f"fsd cl gap reads it once a seed has finished (results.json)")
    settings = cl_checkpoint_settings(json.dumps(saved), benchmark, method)
    return benchmark, method, Hyperparameters.from_dict(settings), started


def _moved_layer(reference: torch.nn.Module, final: torch.nn.Module,
                 layer: str) -> torch.nn.Module:
    """A copy of ``reference`` whose module ``layer`` has ``final``'s parameters."""
    moved = copy.deepcopy(reference)
    moved.get_submodule(layer).load_state_dict(final.get_submodule(layer).state_dict())
    return moved


def _linearized_fsd(reference: torch.nn.Module, final: torch.nn.Module, x: torch.Tensor,
                    metric: str, outputs: Any, chunk: int = 1000) -> float:
    """The FSD of ``final`` linearized around ``reference`` over ``x``, in chunks.

    The FSD is a mean over inputs, so the chunks' means weighted by their sizes give it
    exactly while one forward-mode pass holds only ``chunk`` inputs.
    """
    total = 0.0
    for start in range(0, len(x), chunk):
        part = x[start:start + chunk]
        ntk = NTK(coreset_size=None, metric=metric).fit(reference, part, outputs=outputs)
        with torch.no_grad():
            total += float(ntk.distance(final)) * len(part)
    return total / len(x)


def gap_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of :func:`penalty_gap` rows, with the linearized columns if present."""
    linearized = bool(rows) and "linearized" in rows[0]
    # (header, cell of a row)
    columns: list[tuple[str, Any]] = [
        ("seed", lambda r: str(r["seed"])), ("task", lambda r: str(r["task"])),
        ("true FSD", lambda r: f"{r['true_fsd']:.3g}")]
    if linearized:
        columns.append(("linearized FSD", lambda r: f"{r['linearized']:.3g}"))
    columns += [("summary's estimate", lambda r: f"{r['estimate']:.3g}"),
                # significant digits: a collapsed estimate is 1e-5 of the truth, not "0.000"
                ("estimate / true", lambda r: f"{r['ratio']:.3g}")]
    if linearized:
        columns += [("linearized / true", lambda r: _share(r["linearized"], r["true_fsd"])),
                    ("estimate / linearized", lambda r: _share(r["estimate"],
                                                               r["linearized"]))]
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


#: ``gap_markdown``'s column headers and the row keys they hold; the ratios of the linearized
#: columns are derived from the others and not read back
_GAP_COLUMNS = {"seed": "seed", "task": "task", "true FSD": "true_fsd",
                "linearized FSD": "linearized", "summary's estimate": "estimate",
                "estimate / true": "ratio", "linearized / true": None,
                "estimate / linearized": None}
#: the line ``fsd cl gap`` prints above the table for a seed compared before its last task
UNFINISHED_LINE = ("seed {seed} has not finished: compared at its latest checkpoint, after "
                   "task {after}")
_UNFINISHED = re.compile("^" + re.escape(UNFINISHED_LINE).replace(r"\{seed\}", r"(-?\d+)")
                         .replace(r"\{after\}", r"(\d+)") + "$")


def read_gap_markdown(text: str, source: str = "gap.md") -> list[dict[str, Any]]:
    """The rows of what ``fsd cl gap`` printed (:func:`gap_markdown`), read back.

    The committed ``gap.md`` files are that output as printed, so the numbers are its
    three significant digits; a ratio printed with fewer (older versions rounded it to three
    decimals, a collapsed one to 0.000) is the printed estimate over the printed true FSD.
    Seeds run apart and joined with blank lines (under one header
    or several) read as one table; a by-layer table (:func:`gap_layers_markdown`) is
    skipped. A seed named on a "has not finished" line has ``finished`` False and its
    ``after_task``; the others have ``finished`` True and ``after_task`` None (the table
    does not say).

    Raises:
        ValueError: no gap table in ``text``, or a line of one that does not parse
            (naming ``source`` and the line).
    """
    unfinished = {int(m[1]): int(m[2]) for line in text.splitlines()
                  if (m := _UNFINISHED.match(line.strip()))}
    rows: list[dict[str, Any]] = []
    keys: list[str | None] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.strip():
            continue  # seeds run apart and joined: their tables follow under one header
        if not line.startswith("|"):
            keys = None  # a note ends a table
        elif cells[0] == "seed":
            known = all(c in _GAP_COLUMNS for c in cells)
            keys = [_GAP_COLUMNS[c] for c in cells] if known else None
        elif keys is not None and not set(line) <= set("|-: "):
            try:
                row: dict[str, Any] = {k: float(c) for k, c in zip(keys, cells, strict=True)
                                       if k is not None}
                row["seed"], row["task"] = int(row["seed"]), int(row["task"])
                printed = cells[keys.index("ratio")]
            except (ValueError, KeyError):
                raise ValueError(f"{source}, line {number}: not a row of fsd cl gap's table: "
                                 f"{line.strip()}") from None
            # older tables printed the ratio to three decimals, which rounds a collapsed
            # estimate (1e-7 of the truth) to 0.000: such a ratio is taken from the columns
            if _significant_digits(printed) < 3 and row["true_fsd"] > 0:
                row["ratio"] = row["estimate"] / row["true_fsd"]
            row["finished"] = row["seed"] not in unfinished
            row["after_task"] = unfinished.get(row["seed"])
            rows.append(row)
    if not rows:
        raise ValueError(f"{source} holds no table of fsd cl gap")
    return rows


def _significant_digits(number: str) -> int:
    mantissa = number.lower().split("e")[0].lstrip("+-").replace(".", "")
    return len(mantissa.lstrip("0"))


def read_gap_folders(paths: Sequence[str]
                     ) -> list[tuple[str, str, dict[str, Any], list[dict[str, Any]]]]:
    """(benchmark folder, row id, the ``results.json`` beside or {}, rows) per ``gap.md``.

    Row folders are found as ``--rows`` finds them (``ROW-NAME``), sorted by benchmark folder,
    then row.
    """
    found: list[Path] = []
    for p in paths:
        path = Path(p)
        if not path.is_dir():
            raise ValueError(f"{path} is not a folder")
        found += sorted(Path(root) / "gap.md" for root, _, files in os.walk(path)
                        if "gap.md" in files)
    if not found:
        raise ValueError(f"no gap.md in {', '.join(map(str, paths))}: give row folders "
                         f"holding what fsd cl gap printed")
    found = sorted(dict.fromkeys(found), key=lambda g: (g.parent.parent.name, _row_key(g)))
    out = []
    for gap in found:
        rows = read_gap_markdown(gap.read_text(encoding="utf-8"), str(gap))
        beside = gap.parent / "results.json"
        results = read_json(beside) if beside.is_file() else {}
        out.append((gap.parent.parent.name, _row_id(gap.parent), results, rows))
    return out


def gap_tables(paths: Sequence[str]) -> str:
    """The docs' estimate-against-truth table: a line per row folder holding a ``gap.md``.

    ``gap.md`` is what ``fsd cl gap`` printed for the row's run (read back by
    :func:`read_gap_markdown`). Each line shows the seeds compared, the old tasks, the
    spread of the summary's estimate over the true FSD over every (seed, task) pair
    (least, median, largest) and task 1's true FSD and estimate per seed: an estimate far
    below the truth is a collapsed penalty. The method comes from the ``results.json``
    beside it (a run stopped early may have none). Row folders are found as ``--rows``
    finds them (``ROW-NAME``), one table per benchmark folder.

    Raises:
        ValueError: no ``gap.md`` under ``paths``, one that does not parse, or a folder
            whose name carries no row id.
    """
    found = read_gap_folders(paths)
    tables: list[tuple[str, str]] = []
    for bench in dict.fromkeys(b for b, *_ in found):
        lines = ["| row | method | seeds | old tasks | estimate / true: least, median, "
                 "largest | task 1: true FSD | task 1: estimate |",
                 "|---|---|---|---|---|---|---|"]
        for _, row, results, rows in (f for f in found if f[0] == bench):
            after = {r["seed"]: r["after_task"] for r in rows}  # None: the seed finished
            seed_cells = [str(s) if a is None else f"{s} (after task {a})"
                          for s, a in after.items()]
            tasks = sorted({r["task"] for r in rows})
            ratios = [r["ratio"] for r in rows]
            first = [r for r in rows if r["task"] == 1]
            span = f"{tasks[0]}–{tasks[-1]}" if len(tasks) > 1 else f"{tasks[0]}"
            lines.append(
                f"| {row} | {results.get('method', '–')} | {' '.join(seed_cells)} | {span} | "
                f"{min(ratios):.3g}, {float(np.median(ratios)):.3g}, {max(ratios):.3g} | "
                + ", ".join(f"{r['true_fsd']:.3g}" for r in first) + " | "
                + ", ".join(f"{r['estimate']:.3g}" for r in first) + " |")
        tables.append((bench, "\n".join(lines) + "\n"))
    return _per_benchmark(tables)


#: the floor for an estimate that holds: 5 % of the true FSD, drawn on the gap figure
GAP_FLOOR = 0.05
#: the gap figure's left end: smaller ratios are drawn there
GAP_AXIS_FLOOR = 1e-9


def gap_plot(paths: Sequence[str], out: str | os.PathLike) -> Path:
    """The estimate-against-truth figure: every (seed, old task) ratio of every row, on a log axis.

    One panel per benchmark folder, one line per row folder holding a ``gap.md`` (as
    :func:`gap_tables` reads them), labelled with the row, its method and its final average
    accuracy (from the ``results.json`` beside it). Each dot is one seed's estimate over the
    true FSD for one old task, the bar its median; the line at 1 is an exact estimate, the
    dashed line at :data:`GAP_FLOOR` the floor a non-collapsed penalty keeps; ratios below
    :data:`GAP_AXIS_FLOOR` are drawn at it. Written
    atomically to ``out`` (its suffix picks the format).
    """
    return write_figure(_gap_figure(read_gap_folders(paths)), out, dpi=110)


def _gap_figure(found: list[tuple[str, str, dict[str, Any], list[dict[str, Any]]]]) -> Any:
    """The figure of :func:`gap_plot` (a matplotlib ``Figure``); rows top to bottom."""
    benchmarks = list(dict.fromkeys(b for b, *_ in found))
    counts = [sum(b == bench for b, *_ in found) for bench in benchmarks]
    plt = pyplot()
    fig, axes = plt.subplots(len(benchmarks), 1, squeeze=False,
                             figsize=(8.0, 0.2 * sum(counts) + 1.1 * len(benchmarks)),
                             gridspec_kw={"height_ratios": [c + 3 for c in counts]})
    for ax, bench in zip(axes[:, 0], benchmarks, strict=True):
        lines = [f for f in found if f[0] == bench]
        labels = []
        for y, (_, row, results, rows) in enumerate(lines):
            ratios = np.array([r["ratio"] for r in rows])
            # a few class-wise rows reach 1e-17 (or print 0, off a log axis): the axis
            # stops at GAP_AXIS_FLOOR so the other rows' spread stays readable
            ratios = np.maximum(ratios, GAP_AXIS_FLOOR)
            ax.scatter(ratios, np.full(ratios.shape, -y), s=9, color="tab:blue", alpha=0.45,
                       linewidths=0)
            ax.plot([float(np.median(ratios))] * 2, [-y - 0.35, -y + 0.35], color="black", lw=2)
            accuracy = results.get("avg_accuracy", {}).get("mean")
            acc = "" if accuracy is None else f", {accuracy:.2f} %"
            labels.append(f"{row} {results.get('method', '–')}{acc}")
        ax.set_xscale("log")
        ax.axvline(1.0, color="tab:green", lw=1)
        ax.axvline(GAP_FLOOR, color="tab:red", lw=1, ls="--")
        ax.set_yticks([-y for y in range(len(lines))], labels, fontsize=7)
        ax.set_ylim(-len(lines) + 0.4, 0.6)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{bench}: estimate / true FSD per seed and old task at the end of the run "
                     f"(bar: median; dashed: {GAP_FLOOR:g})", fontsize=8)
    axes[-1, 0].set_xlabel("summary's estimate / true FSD (fsd cl gap)")
    fig.tight_layout()
    return fig


def gap_layers_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of the ``layers`` of :func:`penalty_gap` rows (``by_layer``)."""
    lines = ["| seed | task | layer | linearized FSD, this layer moved | summary's term | "
             "term / linearized |", "|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['seed']} | {r['task']} | {part['layer']} | {part['linearized']:.3g} | "
              f"{part['estimate']:.3g} | {_share(part['estimate'], part['linearized'])} |"
              for r in rows for part in r.get("layers", [])]
    return "\n".join(lines) + "\n"


def gap_evaluators_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of the ``evaluators`` of :func:`penalty_gap` rows.

    Per row, each walk's estimate from the same statistics and its ratio to the summary's
    own estimate.
    """
    names = list(rows[0]["evaluators"]) if rows and "evaluators" in rows[0] else []
    header = ["seed", "task", "true FSD", "summary's estimate"]
    for name in names:
        header += [f"by {name}", f"{name} / estimate"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for r in rows:
        cells = [str(r["seed"]), str(r["task"]), f"{r['true_fsd']:.3g}", f"{r['estimate']:.3g}"]
        for name in names:
            value = r["evaluators"][name]
            cells += [f"{value:.3g}", _share(value, r["estimate"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _share(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.3g}" if denominator > 0 else "–"
