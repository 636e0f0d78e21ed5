"""``fsd cl tune``: the paper's tuning protocol for the penalty weight λ.

The appendix: run a grid of settings on seed 42, keep the one with the best final average
accuracy, then report seeds 20, 21 and 22 with it. The grid is scored on a validation split
(``Hyperparameters.validation``: that fraction of each task's training examples held out,
``fsd cl tune --validation``, 0.1 by default), not on the test sets the reported seeds are
measured on; the final run trains on the full training sets and reports the test sets.
Each grid point and the final run are ordinary ``fsd cl`` runs in sub-directories of the
output (``grid/lambda-<λ>`` and ``final``), so a stopped tuning resumes where it stopped,
point by point and task by task; a point (or final run) whose ``results.json`` is complete
is read, not run, so a grid kept as result files without checkpoints (``fsd cl merge
--no-checkpoints``, or copied from another machine) is not trained again. ``tune.json``
and ``tune.md`` hold the grid's table, the split it was scored on and the chosen λ. With
``jobs`` > 1 the grid points, and then the final seeds, run as that many processes at a
time; each final seed in
``final-seeds/seed<S>``, merged into ``final`` (checkpoints with it) when all are done.
A λ chosen at the grid's edge is named (stderr, ``tune.md``); rerun with a wider grid, a
final run made at an earlier choice moves to ``final-lambda-<λ>``.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..io import (
    BOOKKEEPING,
    LOCK,
    DirectoryInUseError,
    UnsafeOutputError,
    atomic_write_text,
    claim_directory,
    file_kind,
    is_fsd_temporary,
    is_pid_lock,
    os_error_message,
    read_json,
    refuse_nested,
    versioned,
    write_json,
)
from ..presets import default_hyperparameters
from .reporting import (
    _ROW_FOLDER,
    PAPER,
    _read_runs,
    _row_changes,
    _row_key,
    merge_runs,
    per_seed_cell,
)
from .results import RunResults, _pm
from .runner import (
    CHECKPOINT_FOLDER,
    CheckpointMismatchError,
    UnreadableCheckpointError,
    is_checkpoint_folder,
    run,
)
from .settings import RunSettings

#: 2: ``validation``, the split the grid was scored on
TUNE_SCHEMA_VERSION = 2


@dataclass(frozen=True)
class TuneResult:
    """The grid on the tuning seed, the λ it chose, and the final run's results.

    Attributes:
        grid: one row per λ: ``{"fsd_scale", "avg_accuracy", "backward_transfer"}``, on the
            held-out examples when ``validation`` is set.
        chosen: the λ with the best final average accuracy on the tuning seed.
        tuning_seed: the seed of the grid (the paper's 42).
        final: the run with the chosen λ on the reported seeds (test sets).
        validation: the fraction of each task's training examples the grid held out and
            was scored on; ``None``: the grid was scored on the test sets.
    """

    grid: list[dict[str, float]]
    chosen: float
    tuning_seed: int
    final: RunResults
    validation: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON written to ``tune.json``."""
        return versioned({
                "tuning_seed": self.tuning_seed, "validation": self.validation,
                "grid": self.grid, "chosen": self.chosen,
                "final_seeds": self.final.seeds,
                "final_avg_accuracy": self.final.avg_accuracy,
                "final_backward_transfer": self.final.backward_transfer},
            TUNE_SCHEMA_VERSION, self.final.device)

    def markdown(self, settings: RunSettings) -> str:
        """The grid's table, the chosen λ and the final seeds' accuracy."""
        if self.validation is None:
            split, scored = "on the test sets", "avg accuracy (%)"
        else:
            split = (f"on a validation split: {100 * self.validation:g} % of each task's training "
                     f"examples held out, the runs trained on the rest")
            scored = "avg validation accuracy (%)"
        edge = grid_edge([row["fsd_scale"] for row in self.grid], self.chosen)
        lines = [f"# Tuning λ for {settings.method} on {settings.benchmark}", "",
                 f"Grid on seed {self.tuning_seed}, {split}; the best final average accuracy "
                 f"chose λ = {self.chosen:g}.{' ' + edge if edge else ''}", "",
                 f"| λ | {scored} | BWT (%) |", "|---:|---:|---:|"]
        for row in sorted(self.grid, key=lambda r: r["fsd_scale"]):
            mark = " **(chosen)**" if row["fsd_scale"] == self.chosen else ""
            lines.append(f"| {row['fsd_scale']:g}{mark} | {row['avg_accuracy']:.2f} | "
                         f"{row['backward_transfer']:.2f} |")
        avg, bwt = self.final.avg_accuracy, self.final.backward_transfer
        lines += ["", f"Seeds {', '.join(map(str, self.final.seeds))} at λ = {self.chosen:g}, "
                      f"full training sets: {avg['mean']:.2f} ± {avg['std']:.2f} average test "
                      f"accuracy, BWT "
                      f"{bwt['mean']:.2f} ± {bwt['std']:.2f}."]
        return "\n".join(lines) + "\n"


def grid_edge(grid: Sequence[float], chosen: float) -> str | None:
    """A sentence when ``chosen`` is the grid's smallest or largest λ, else ``None``.

    The best λ may then lie outside the grid; a grid of one value has no inside.
    """
    if len(grid) < 2 or min(grid) < chosen < max(grid):
        return None
    side, beyond = ("smallest", "below") if chosen == min(grid) else ("largest", "above")
    return (f"λ = {chosen:g} is the grid's {side} value, so the best may lie {beyond} it: "
            f"add values {beyond} it to --grid (finished points are read, not run again).")


def tune(settings: RunSettings, grid: Sequence[float], tuning_seed: int = 42,
         jobs: int = 1) -> TuneResult:
    """Run the protocol; ``settings.seeds`` are the reported seeds, ``settings.out`` the root.

    The grid's runs hold out ``settings.hyperparameters.validation`` of each task's training
    examples and are scored on them (``None``: on the test sets); the final run at the
    chosen λ has ``validation`` ``None``: the full training sets, the test sets.

    ``jobs`` > 1 runs the grid points, then the final seeds, as that many processes at a
    time (each with ``settings.threads`` torch threads, or torch's default count divided
    by ``jobs``; per-task lines only, prefixed by the run's folder, no progress bars); the
    numbers are those of one process. A final run already started in ``final`` (by a
    tuning with one job) resumes there, in this process; final seeds already started in
    ``final-seeds`` resume there, one at a time for one job, and are merged as usual.

    Raises ``ValueError`` for an empty grid, one that repeats a λ, or ``jobs`` < 1.
    """
    grid = [float(v) for v in grid]
    if not grid or len(set(grid)) != len(grid):
        raise ValueError(f"the grid needs distinct values of λ, got {grid}")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    root = Path(settings.out)
    refuse_nested(root, is_checkpoint_folder, CHECKPOINT_FOLDER)
    # the tuning writes its runs, tune.json and tune.md only into a folder of its own
    claim_directory(root, TUNE_FOLDER, earlier=_earlier_tune_folder)
    points = [dataclasses.replace(
        settings, seeds=(tuning_seed,), out=root / "grid" / f"lambda-{scale:g}", plots=False,
        hyperparameters=dataclasses.replace(settings.hyperparameters, fsd_scale=scale))
        for scale in grid]
    # a finished point is read from its results.json: its checkpoints may be gone (a grid
    # committed with `fsd cl merge --no-checkpoints`, or run on another machine)
    results: list[RunResults | None] = [_finished(point) for point in points]
    to_run = [point for point, result in zip(points, results, strict=True) if result is None]
    ran = iter(_run_all(to_run, jobs, root) if to_run else [])
    rows = []
    for scale, result in zip(grid, [r if r is not None else next(ran) for r in results],
                             strict=True):
        rows.append({"fsd_scale": scale,
                     "avg_accuracy": float(result.avg_accuracy["mean"]),
                     "backward_transfer": float(result.backward_transfer["mean"])})
    # the first of equal accuracies: the grid's order decides a tie
    chosen = max(rows, key=lambda r: r["avg_accuracy"])["fsd_scale"]
    edge = grid_edge(grid, chosen)
    if edge:  # said before the final seeds, the costly part, start
        print(f"note: {edge}", file=sys.stderr, flush=True)
    _set_aside(root / "final", chosen)
    final_settings = dataclasses.replace(
        settings, out=root / "final",
        hyperparameters=dataclasses.replace(settings.hyperparameters, fsd_scale=chosen,
                                            validation=None))
    started = final_settings.out.is_dir() and any(
        p.name not in BOOKKEEPING for p in final_settings.out.iterdir())
    apart = root / "final-seeds"
    # seeds already started apart (by a tuning with jobs > 1) resume apart, whatever jobs is
    finished = _finished(final_settings) if started else None
    if finished is not None:
        final = finished
    elif started or (not apart.is_dir() and (jobs == 1 or len(settings.seeds) == 1)):
        final = run(final_settings)
    else:
        seeds = [dataclasses.replace(final_settings, seeds=(seed,), plots=False,
                                     out=apart / f"seed{seed}")
                 for seed in settings.seeds]
        _run_all(seeds, jobs, root)
        final = merge_runs([s.out for s in seeds], final_settings.out,
                           plots=final_settings.plots)
        shutil.rmtree(apart)  # final holds their results and (linked) checkpoints
    result = TuneResult(rows, chosen, tuning_seed, final, settings.hyperparameters.validation)
    write_json(root / "tune.json", result.to_json())
    atomic_write_text(root / "tune.md", result.markdown(settings))
    return result


#: the kind of folder ``fsd cl tune`` writes (see :func:`fsd_experiments.io.claim_directory`)
TUNE_FOLDER = "cl tune"
_TUNE_ENTRIES = re.compile(r"grid|final|final-seeds|final-lambda-.+|tune\.json|tune\.md")


def _earlier_tune_folder(path: Path) -> bool:
    """Whether ``path`` (no marker) is a tuning of an fsd from before output folders were marked.

    It holds only a tuning's folders and files (grid, final, final-seeds, final-lambda-<λ>,
    tune.json, tune.md), fsd's temporary files and fsd's lock, and its grid or tune.json.
    """
    names = [p.name for p in path.iterdir() if p.name not in BOOKKEEPING
             and not is_fsd_temporary(p)]
    lock = path / LOCK
    return (file_kind(lock) is None or is_pid_lock(lock)) \
        and all(_TUNE_ENTRIES.fullmatch(name) for name in names) \
        and ("grid" in names or "tune.json" in names)


def _set_aside(final: Path, chosen: float) -> None:
    """Move a final run at another λ (an earlier grid's choice) to ``final-lambda-<λ>``.

    A grid widened past its edge may choose a new λ; the earlier final run stays readable
    beside the new one instead of blocking it with a settings mismatch.
    """
    file = final / "results.json"
    if not file.is_file():
        return
    earlier = RunResults.read(file).hyperparameters.fsd_scale
    if earlier == chosen:
        return
    aside = final.with_name(f"final-lambda-{earlier:g}")
    if aside.exists():
        raise ValueError(f"{final} holds a run at λ {earlier:g}, and {aside} exists too: move "
                         f"one of them")
    final.rename(aside)
    print(f"note: the final run at λ {earlier:g}, an earlier grid's choice, is kept in {aside}",
          file=sys.stderr, flush=True)


def _finished(settings: RunSettings) -> RunResults | None:
    """The results of ``settings`` if its folder holds them complete, for these seeds."""
    file = Path(settings.out) / "results.json"
    if not file.is_file():
        return None
    previous = RunResults.read(file)
    same = all(getattr(previous, key) == getattr(settings, key)
               for key in ("benchmark", "method", "hyperparameters"))
    if same and previous.complete and list(previous.seeds) == list(settings.seeds):
        return previous
    return None  # run() resumes it, or refuses other settings in one line


# the errors fsd cl reports in one line, rebuilt by name in the parent: a worker's own
# exception object may not survive pickling
_REPORTED = {cls.__name__: cls for cls in (CheckpointMismatchError, UnreadableCheckpointError,
                                           DirectoryInUseError, UnsafeOutputError, ValueError,
                                           FileNotFoundError, OSError)}


def _run_all(runs: Sequence[RunSettings], jobs: int, root: Path) -> list[RunResults]:
    """``run`` each of ``runs``: in this process for one job, else ``jobs`` at a time."""
    if jobs == 1 or len(runs) == 1:
        return [run(r) for r in runs]
    threads = runs[0].threads or max(1, torch.get_num_threads() // jobs)
    quiet = [dataclasses.replace(r, progress=False, threads=threads) for r in runs]
    # spawn: a forked child would inherit torch's thread pools mid-state
    with ProcessPoolExecutor(max_workers=min(jobs, len(runs)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        outcomes = list(pool.map(_run_in_worker, quiet,
                                 [str(r.out.relative_to(root)) for r in quiet]))
    # every run has finished (or stopped) by now: raise the first failure in order
    results = []
    for outcome in outcomes:
        if isinstance(outcome, tuple):
            name, message = outcome
            raise _REPORTED.get(name, RuntimeError)(
                message if name in _REPORTED else f"{name}: {message}")
        results.append(outcome)
    return results


def _run_in_worker(settings: RunSettings, label: str) -> RunResults | tuple[str, str]:
    """One run in a worker process, its log lines prefixed by ``label``; errors as values."""
    torch.set_num_threads(settings.threads or 1)
    sys.stderr = _Prefixed(sys.stderr, f"{label}: ")
    try:
        return run(settings)
    except Exception as error:  # reported by the parent, after the other runs finish
        # as the nearest class the parent reports in one line (an OSError in its words)
        name = next((c.__name__ for c in type(error).__mro__ if c.__name__ in _REPORTED),
                    type(error).__name__)
        return name, os_error_message(error) if isinstance(error, OSError) else str(error)


class _Prefixed(io.TextIOBase):
    """A text stream that starts every line written to it with ``prefix``."""

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream, self._prefix, self._line_start = stream, prefix, True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            if self._line_start:
                self._stream.write(self._prefix)
            self._stream.write(piece)
            self._line_start = piece.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def _read_tuning(path: Path) -> dict[str, Any]:
    """A ``tune.json``, checked for what the tuning table shows; ValueError names the file."""
    raw = read_json(path)

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    problem = None
    if not isinstance(raw, dict):
        problem = "expected a JSON object"
    elif not number(raw.get("chosen")):
        problem = "chosen must be a number (the λ the grid chose)"
    elif not isinstance(raw.get("tuning_seed"), int):
        problem = "tuning_seed must be an integer"
    elif not (raw.get("validation") is None or number(raw["validation"])):
        problem = "validation must be a fraction or null"
    elif not (isinstance(raw.get("grid"), list) and raw["grid"] and all(
            isinstance(p, dict) and number(p.get("fsd_scale")) and number(p.get("avg_accuracy"))
            for p in raw["grid"])):
        problem = "grid must list points with a number fsd_scale and avg_accuracy"
    if problem:
        raise ValueError(f"{path}: not a tune.json of fsd cl tune: {problem}")
    return raw


def _grid_cell(tuning: dict[str, Any]) -> str:
    cells = []
    for point in sorted(tuning["grid"], key=lambda p: p["fsd_scale"]):
        text = f"{point['fsd_scale']:g}: {point['avg_accuracy']:.2f}"
        cells.append(f"**{text}**" if point["fsd_scale"] == tuning["chosen"] else text)
    return ", ".join(cells)


def _tuning_folder(results_file: Path) -> Path | None:
    """The folder of the tuning whose final run ``results_file`` is, if it is one.

    ``fsd cl tune --out OUT`` writes ``OUT/tune.json`` and ``OUT/final/results.json``; a row
    folder in ``results/cl`` holds both files side by side.
    """
    folder = results_file.parent
    if (folder / "tune.json").is_file():
        return folder
    if folder.name == "final" and (folder.parent / "tune.json").is_file():
        return folder.parent
    return None


def _tuning_key(folder: Path) -> tuple[int, tuple[str, int, str] | str]:
    # row folders in row order, then other tuning outputs by name
    return (0, _row_key(folder / "results.json")) if _ROW_FOLDER.match(folder.name) \
        else (1, folder.name)


def tune_tables(paths: Sequence[str]) -> str:
    """The docs' tuning table: a line per ``fsd cl tune`` output under ``paths``.

    A tuning is an ``fsd cl tune`` output folder (``tune.json``, the final run in ``final/``)
    or a row folder holding both files side by side (e.g.
    ``results/cl/split-mnist/R5t-bgln-s-cw-tuned``); a row folder's line is named by its row
    id, any other by the folder's name. Each line shows the grid on the tuning seed (the
    chosen λ in bold), the split it was scored on, the settings other than λ that differ
    from the defaults, and the final seeds at the chosen λ (mean ± std, per seed) beside the
    paper's number. Raises ``ValueError`` when no tuning is found, or for a ``tune.json``
    whose chosen λ is not the final run's.
    """
    found = sorted(((folder, res) for _, _, path, res in _read_runs(paths)
                    if (folder := _tuning_folder(path)) is not None),
                   key=lambda r: (r[1].benchmark, _tuning_key(r[0])))
    if not found:
        raise ValueError(f"no fsd cl tune output in {', '.join(map(str, paths))}: give "
                         f"folders holding tune.json and the final run's results.json")
    lines = ["| row | benchmark | method | other settings | grid on seed, scored on | "
             "λ: avg acc (%) on the grid | seeds at the chosen λ | avg acc (%) | paper | BWT |",
             "|---|---|---|---|---|---|---|---:|---:|---:|"]
    for folder, res in found:
        tuning = _read_tuning(folder / "tune.json")
        hp = res.hyperparameters
        if tuning["chosen"] != hp.fsd_scale:
            raise ValueError(f"{folder}: tune.json chose λ {tuning['chosen']:g}, the final "
                             f"run used {hp.fsd_scale:g}")
        validation = tuning.get("validation")
        split = "test sets" if validation is None else f"validation ({100 * validation:g} %)"
        default_scale = default_hyperparameters(res.benchmark, res.method)["fsd_scale"]
        others = dataclasses.replace(hp, fsd_scale=default_scale)
        named = _ROW_FOLDER.match(folder.name)
        row = named[0][:-1] if named else folder.name
        lines.append(
            f"| {row} | {res.benchmark} | {res.method} | "
            f"{_row_changes(others, res.benchmark, res.method)} | "
            f"{tuning['tuning_seed']}, {split} | {_grid_cell(tuning)} | "
            f"{' '.join(map(str, res.seeds))} | {per_seed_cell(res.avg_accuracy)} | "
            f"{PAPER['avg'].get(res.benchmark, {}).get(res.method, '–')} | "
            f"{_pm(res.backward_transfer)} |")
    return "\n".join(lines) + "\n"
