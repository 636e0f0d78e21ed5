"""Training a continual-learning task stream (``fsd cl``): one seed, resumable, and a whole run."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from fsd.estimators.base import Estimator, load
from fsd.statistics.collector import StatisticsCollector
from fsd.uses.regularizer import ContinualRegularizer

from ..benchmarks import CL_BENCHMARKS, CNN_MODELS, Task, make_tasks
from ..compat import cl_checkpoint_has_checksum, cl_checkpoint_settings, is_cl_results
from ..data import TensorBatches
from ..devices import resolve_device
from ..io import (
    BOOKKEEPING,
    LOCK,
    atomic_write_bytes,
    check_target,
    claim_directory,
    exclusive_directory,
    file_kind,
    is_fsd_temporary,
    is_pid_lock,
    marker_kind,
    non_file_kind,
    read_json,
    refuse_nested,
    remove_stale_temporaries,
)
from ..models import ResidualNet, conv_net, mlp
from ..presets import CL_METHODS, PRESETS, Preset
from ..training import LossFn, keep_freed_memory, train
from .results import RunResults, SeedResult, write_results
from .settings import PENALTY_MODES, Hyperparameters, RunSettings

BENCHMARKS: tuple[str, ...] = CL_BENCHMARKS
#: 3: a sha256 of the checkpoint's contents (``"sha256"``), checked before resuming
CHECKPOINT_VERSION = 3
#: the kind of folder an ``fsd cl`` run writes (see :func:`fsd_experiments.io.claim_directory`)
RUN_FOLDER = "cl run"


class CheckpointMismatchError(RuntimeError):
    """A run directory holds a checkpoint written with other settings than those asked for."""


class UnreadableCheckpointError(CheckpointMismatchError, ValueError):
    """A run directory holds a checkpoint that cannot be resumed: damaged or incomplete.

    Also a ``ValueError``: the commands that read checkpoints without resuming them (``fsd
    cl gap``) report it as they report any bad input.
    """


_STATE_KEYS = ("hyperparameters", "model", "optimizer", "shuffle_state", "matrix",
               "wall_seconds", "summary_bytes")


#: the methods of ``fsd cl``, by name (see :mod:`fsd_experiments.presets`)
METHODS: dict[str, Preset] = {name: PRESETS[name] for name in CL_METHODS}


def _head(logits: Tensor, task: Task) -> Tensor:
    return logits if task.outputs is None else logits[:, task.outputs]


@torch.no_grad()
def _accuracy(model: nn.Module, task: Task, device: torch.device) -> float:
    model.eval()
    correct = 0
    for i in range(0, task.x_test.shape[0], 2048):
        x = task.x_test[i:i + 2048].to(device)
        y = task.y_test[i:i + 2048].to(device)
        correct += int((_head(model(x), task).argmax(-1) == y).sum())
    model.train()
    return 100.0 * correct / task.x_test.shape[0]


def _fit_summary(method: str, hp: Hyperparameters, model: nn.Module, task: Task,
                 collector: StatisticsCollector | None, seed: int) -> Estimator:
    """Fit task ``task``'s estimator at the model's current parameters."""
    spec = METHODS[method]
    estimator = spec.continual_estimator(hp.to_dict(), seed)
    gen = torch.Generator().manual_seed(seed)  # coreset / Fisher subset of this task
    data: Any = None
    if method == "exact-coreset":
        # a random coreset of the task's training inputs, stored in full by ExactFSD
        idx = torch.randperm(task.x_train.shape[0], generator=gen)[:hp.coreset_size]
        data = task.x_train[idx]
    elif method == "ewc":
        # the Fisher needs per-example gradients: a random subset keeps fit time bounded
        idx = torch.randperm(task.x_train.shape[0], generator=gen)[:hp.fisher_samples]
        data = TensorBatches(task.x_train[idx], task.y_train[idx], 256)
    elif spec.needs_data:
        data = TensorBatches(task.x_train, task.y_train, 1024)
    return estimator.fit(model, data, outputs=summary_outputs(task, hp),
                         statistics=collector)


@torch.no_grad()
def _record_after(model: nn.Module, collector: StatisticsCollector, task: Task,
                  classwise: bool, device: torch.device) -> None:
    """Record the summary's statistics in one pass over ``task``'s training inputs.

    At the task's final parameters in evaluation mode (dropout off): the statistics of the
    function the summary's distance then compares against, not of the last epoch's moving,
    masked network. Costs one forward pass over the training set.
    """
    model.eval()
    try:
        for i in range(0, task.x_train.shape[0], 1024):
            x = task.x_train[i:i + 1024].to(device)
            y = task.y_train[i:i + 1024].to(device)
            with collector.record(labels=y if classwise else None):
                model(x)
    finally:
        model.train()


class _LastEpochRecorder:
    """The data loss of one task, recording the summary's statistics in the last epoch."""

    def __init__(self, collector: StatisticsCollector | None, epochs: int,
                 classwise: bool) -> None:
        self.collector, self.epochs, self.classwise = collector, epochs, classwise
        self.recording = False

    def start_epoch(self, epoch: int) -> None:
        """Record during the last epoch only (when there is a collector)."""
        self.recording = self.collector is not None and epoch == self.epochs - 1

    def head_loss(self, task: Task) -> LossFn:
        """Cross-entropy on ``task``'s head; the forward pass is recorded when asked."""
        def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            if self.recording and self.collector is not None:
                with self.collector.record(labels=y if self.classwise else None):
                    logits = model(x)
            else:
                logits = model(x)
            return nn.functional.cross_entropy(_head(logits, task), y)
        return loss


def summary_outputs(task: Task, hp: Hyperparameters) -> list[int] | None:
    """The output units task ``task``'s summary covers: its head, or all (``penalty_outputs``)."""
    return None if hp.penalty_outputs == "all" else task.outputs


def penalty_weights(num_previous: int, mode: str) -> list[float]:
    """Weights of the previous tasks' distances: ``"mean"`` 1/t each, ``"sum"`` 1 each."""
    if mode not in PENALTY_MODES:
        raise ValueError(f"penalty must be one of {PENALTY_MODES}, got {mode!r}")
    return ContinualRegularizer.reduction_weights(num_previous, mode)


def build_model(hp: Hyperparameters, input_shape: Sequence[int], outputs: int) -> nn.Module:
    """The network of ``hp.model`` for inputs of ``input_shape`` (C, H, W) and ``outputs`` units.

    ``"mlp"``: :func:`~fsd_experiments.models.mlp` of ``hp.width`` and ``hp.depth`` on the
    flattened input; ``"cnn"``: :func:`~fsd_experiments.models.conv_net`; ``"cnn-avgpool"``:
    the same with average pools; ``"resnet"``: :class:`~fsd_experiments.models.ResidualNet`.
    """
    if hp.model == "resnet":
        channels, height, width = (int(d) for d in input_shape)
        return ResidualNet((channels, height, width), outputs)
    if hp.model in CNN_MODELS:
        channels, height, width = (int(d) for d in input_shape)
        return conv_net((channels, height, width), outputs,
                        pool="avg" if hp.model == "cnn-avgpool" else "max")
    return mlp(math.prod(int(d) for d in input_shape), hp.width, hp.depth, outputs)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_seed(benchmark: str, method: str, hp: Hyperparameters, seed: int, out: Path,
             data_dir: str | None = None, device: str = "cpu",
             progress: bool = True) -> SeedResult:
    """Train the task stream for one seed, resuming from ``out``'s checkpoint if any."""
    spec = METHODS[method]
    dev = resolve_device(device)
    tasks, n_out = make_tasks(benchmark, data_dir, seed, train_subset=hp.train_subset,
                              test_subset=hp.test_subset, num_tasks=hp.tasks,
                              validation=hp.validation)
    data_sha256 = _fingerprint(tasks)
    ckpt_dir = out / "checkpoints" / f"seed{seed}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state_path = ckpt_dir / "state.pt"
    torch.manual_seed(seed)
    model = build_model(hp, tasks[0].x_train.shape[1:], n_out).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=hp.lr)
    shuffle = torch.Generator().manual_seed(seed)
    result = SeedResult(seed)
    start_task = 0
    if state_path.exists():
        start_over = f"; delete {ckpt_dir} to start seed {seed} over"
        # map_location: a run started on a GPU can be resumed on a CPU-only machine
        state = read_checkpoint(state_path, map_location=dev, advice=start_over)
        saved_hp = cl_checkpoint_settings(state["hyperparameters"], benchmark, method)
        # checkpoints written before the fingerprint was recorded carry none
        if "data_sha256" in state and state["data_sha256"] != data_sha256:
            raise CheckpointMismatchError(
                f"{state_path} was written with other data (sha256 of the tasks "
                f"{state['data_sha256'][:12]}…, now {data_sha256[:12]}…): give the --data-dir "
                f"it started with, or another --out")
        if saved_hp != _comparable(hp, benchmark, method):
            raise CheckpointMismatchError(
                f"{state_path} was written with other settings ({saved_hp}); use another --out "
                f"or delete {ckpt_dir} to start over")
        # the accuracies become the results: a NaN, a row of another width or no row at
        # all would resume into a wrong matrix (and a wrong average) without a word
        result.matrix = checked_matrix(state, state_path, len(tasks), advice=start_over)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            shuffle.set_state(state["shuffle_state"].cpu())
            result.wall_seconds = float(state["wall_seconds"])
            result.summary_bytes = [int(b) for b in state["summary_bytes"].tolist()]
        except (RuntimeError, ValueError, TypeError, AttributeError) as error:
            # readable, with these settings, but its tensors do not fit the model
            raise UnreadableCheckpointError(
                f"{state_path} does not fit the model of these settings "
                f"({type(error).__name__}); delete {ckpt_dir} to start seed {seed} over"
            ) from None
        if not (math.isfinite(result.wall_seconds) and result.wall_seconds >= 0
                and all(b >= 0 for b in result.summary_bytes)
                and len(result.summary_bytes) <= len(result.matrix)):
            # they become the results' wall time and summary size per task
            raise UnreadableCheckpointError(
                f"{state_path}: its wall time ({result.wall_seconds}) or summary sizes "
                f"({result.summary_bytes}) are not those of {len(result.matrix)} trained "
                f"tasks{start_over}")
        start_task = len(result.matrix)
        if spec.estimator is not None and start_task < len(tasks):
            _check_summaries(ckpt_dir, start_task, seed)
        # last, after the checks that say what is wrong: a matrix cut to fewer rows (or any
        # other edit) is valid on its own, but would retrain tasks on top of later weights
        if cl_checkpoint_has_checksum(state) and state.get("sha256") != checkpoint_sha256(state):
            raise UnreadableCheckpointError(
                f"{state_path} was changed after fsd wrote it (its contents do not match the "
                f"sha256 written with them), and resuming it would give other numbers"
                f"{start_over}")
        if start_task < len(tasks):
            _log(f"[{method} seed {seed}] resuming after task {start_task}/{len(tasks)}")
    for t in range(start_task, len(tasks)):
        task = tasks[t]
        began = time.perf_counter()
        # summaries are always read back from disk, also in an uninterrupted run, so that a
        # resumed run sees estimators in exactly the same state (their sampling RNG included)
        previous = [load(ckpt_dir / f"task{i}.fsd", map_location=dev) for i in range(t)] \
            if spec.estimator is not None else []
        # the library's regularizer: λ times the mean or sum over the previous tasks, BGLN-D
        # summaries evaluated in one batched pass
        if hp.penalty not in PENALTY_MODES:
            raise ValueError(f"penalty must be one of {PENALTY_MODES}, got {hp.penalty!r}")
        penalty = ContinualRegularizer.from_summaries(previous, strength=hp.fsd_scale,
                                                      reduction=hp.penalty)
        last_task = t == len(tasks) - 1
        collector = None
        if spec.estimator is not None and not last_task and (spec.moments or spec.gates):
            # one pass at fixed parameters: a plain mean, no EMA to follow a moving network
            momentum = hp.momentum if hp.statistics == "last-epoch" else None
            collector = StatisticsCollector(model, moments=spec.moments, gates=spec.gates,
                                            momentum=momentum, layer_moments=spec.layer_moments)
        if hp.optimizer == "per-task":
            optimizer = torch.optim.Adam(model.parameters(), lr=hp.lr)
        batches = TensorBatches(task.x_train, task.y_train, hp.batch_size, shuffle=True,
                                generator=shuffle)
        epochs = hp.epochs_of_task(t)
        # last epoch: with dropout, the gate frequencies are those of the training passes
        # (masks on); after: recorded by _record_after below instead
        recording = _LastEpochRecorder(collector if hp.statistics == "last-epoch" else None,
                                       epochs, spec.classwise)
        train(model, batches, recording.head_loss(task), optimizer, epochs=epochs,
              penalty=penalty.penalty if previous else None,
              weight=1.0 if hp.fsd_scale else 0.0,
              on_epoch=recording.start_epoch, device=dev, progress=progress,
              desc=f"{method} seed {seed} task {t + 1}/{len(tasks)}", mininterval=2.0)
        row = [_accuracy(model, other, dev) for other in tasks]
        if collector is not None and hp.statistics == "after":
            _record_after(model, collector, task, spec.classwise, dev)
        if spec.estimator is not None and not last_task:
            estimator = _fit_summary(method, hp, model, task, collector, seed * 100 + t)
            estimator.save(ckpt_dir / f"task{t}.fsd")
            result.summary_bytes.append(int(estimator.nbytes))
        if collector is not None:
            collector.remove()
        result.matrix.append(row)
        result.wall_seconds += time.perf_counter() - began
        checkpoint = {
            "version": CHECKPOINT_VERSION,
            "hyperparameters": json.dumps(_comparable(hp, benchmark, method)),
            "data_sha256": data_sha256,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "shuffle_state": shuffle.get_state(),
            "matrix": torch.tensor(result.matrix, dtype=torch.float64),
            "wall_seconds": torch.tensor(result.wall_seconds, dtype=torch.float64),
            "summary_bytes": torch.tensor(result.summary_bytes, dtype=torch.int64),
        }
        _save({**checkpoint, "sha256": checkpoint_sha256(checkpoint)}, state_path)
        _log(f"[{method} seed {seed}] task {t + 1}/{len(tasks)} ({task.name}) "
             f"{time.perf_counter() - began:.0f}s: acc " + " ".join(
                 f"{a:.2f}" for a in row[:t + 1]))
    return result


def read_checkpoint(state_path: Path, map_location: Any = "cpu",
                    advice: str = "") -> dict[str, Any]:
    """The dictionary of an ``fsd cl`` checkpoint (``state.pt``), or one line naming the file.

    Raises:
        UnreadableCheckpointError: the file is empty, truncated, not a torch file, lacks
            keys of a checkpoint, or was written by a newer fsd (a ``version`` above
            :data:`CHECKPOINT_VERSION`); a FIFO or a device is refused before it is read.
            ``advice`` is appended to the message (what to do).
    """
    _refuse_non_file(state_path, advice)
    try:
        state = torch.load(state_path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # empty, truncated, random bytes, a pickle of anything
        raise UnreadableCheckpointError(
            f"{state_path} is not a readable checkpoint ({type(error).__name__}){advice}"
        ) from None
    if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
        raise UnreadableCheckpointError(
            f"{state_path} is not an fsd cl checkpoint (keys missing){advice}")
    version = state.get("version", 1)  # the first checkpoints had no version
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UnreadableCheckpointError(
            f"{state_path} is not an fsd cl checkpoint (version {version!r}){advice}")
    if version > CHECKPOINT_VERSION:
        raise UnreadableCheckpointError(
            f"{state_path} was written by a newer fsd (checkpoint version {version}; this fsd "
            f"reads up to {CHECKPOINT_VERSION}): use that fsd{advice or ' to read it'}")
    return state


def _refuse_non_file(state_path: Path, advice: str) -> None:
    """Refuse a checkpoint path that is a FIFO, a device or a folder (links followed)."""
    kind = non_file_kind(state_path)
    if kind is not None:  # torch.load would wait on a FIFO for ever
        raise UnreadableCheckpointError(f"{state_path} is {kind}, not a checkpoint file{advice}")


def checkpoint_sha256(state: Mapping[str, Any]) -> str:
    """sha256 of a checkpoint's contents: all but its settings, version and checksum.

    The settings are compared on their own (older checkpoints lack newer settings, see
    :mod:`fsd_experiments.compat`); everything else (the model, the optimizer, the
    shuffling generator, the accuracy matrix, the times and sizes) must be what fsd wrote
    for a resumed run to give the numbers of an uninterrupted one.
    """
    digest = hashlib.sha256()
    _digest(digest, {key: value for key, value in state.items()
                     if key not in ("hyperparameters", "version", "sha256")})
    return digest.hexdigest()


def _digest(digest: Any, value: Any) -> None:
    """Feed ``value`` (tensors, mappings, sequences, plain values) into ``digest``."""
    if isinstance(value, Tensor):
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        digest.update(f"M{len(value)}".encode())
        for key in sorted(value, key=repr):
            _digest(digest, key)
            _digest(digest, value[key])
    elif isinstance(value, (list, tuple)):  # a tuple may come back as a list
        digest.update(f"S{len(value)}".encode())
        for item in value:
            _digest(digest, item)
    else:
        digest.update(f"V{value!r};".encode())


def _save(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically, as :func:`atomic_write_bytes` writes.

    Serialized in memory first: torch's own writer reports a full disk without the file or
    the reason; this way the error is an ``OSError`` naming ``path``, and nothing is left.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def checked_matrix(state: dict[str, Any], state_path: Path, num_tasks: int | None,
                   advice: str = "") -> list[list[float]]:
    """The accuracy matrix of a checkpoint, checked against a stream of ``num_tasks`` tasks.

    After k tasks it is k × ``num_tasks`` (1 ≤ k ≤ ``num_tasks``: a checkpoint is written
    after each task) of finite accuracies in [0, 100] percent. ``num_tasks=None`` takes the
    matrix's own width (the stream's length when the data are not loaded yet).

    Raises:
        UnreadableCheckpointError: naming the file and what is wrong, plus ``advice``.
    """
    matrix = state["matrix"]
    problem = None
    if num_tasks is None and isinstance(matrix, Tensor) and matrix.dim() == 2:
        num_tasks = matrix.shape[1]
    if not isinstance(matrix, Tensor) or not matrix.is_floating_point():
        problem = f"is not a floating-point tensor ({type(matrix).__name__})"
    elif num_tasks is None or matrix.dim() != 2 or not 1 <= matrix.shape[0] <= num_tasks \
            or matrix.shape[1] != num_tasks:
        tasks = num_tasks or "T"
        problem = (f"has shape {tuple(matrix.shape)}; after k of the {tasks} tasks it is "
                   f"k × {tasks}, 1 ≤ k ≤ {tasks}")
    elif not torch.isfinite(matrix).all():
        problem = "holds non-finite accuracies (NaN or inf)"
    elif ((matrix < 0) | (matrix > 100)).any():
        problem = "holds accuracies outside [0, 100] percent"
    if problem:
        raise UnreadableCheckpointError(f"{state_path}: its accuracy matrix {problem}{advice}")
    return [list(map(float, row)) for row in matrix.tolist()]


def _check_summaries(ckpt_dir: Path, start_task: int, seed: int) -> None:
    """Refuse to resume unless every summary the tasks still to train read loads.

    Checked before anything is trained or logged, so that the refusal is the only line.
    """
    missing = [f"task{i}.fsd" for i in range(start_task)
               if not (ckpt_dir / f"task{i}.fsd").is_file()]
    if missing:
        raise UnreadableCheckpointError(
            f"{ckpt_dir} lacks {', '.join(missing)}, which resuming after task {start_task} "
            f"needs; delete {ckpt_dir} to start seed {seed} over")
    for i in range(start_task):
        load(ckpt_dir / f"task{i}.fsd")  # a damaged file: SummaryFormatError naming it


def _comparable(hp: Hyperparameters, benchmark: str, method: str) -> dict[str, Any]:
    """The settings a checkpoint must agree with to be resumed."""
    return json.loads(json.dumps({"benchmark": benchmark, "method": method, **hp.to_dict()}))


def _fingerprint(tasks: Sequence[Task]) -> str:
    """sha256 of every task's training and test tensors: what a resumed run must see again."""
    digest = hashlib.sha256()
    for task in tasks:
        for tensor in (task.x_train, task.y_train, task.x_test, task.y_test):
            digest.update(tensor.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _with_finished_seeds(settings: RunSettings, out: Path) -> list[int]:
    """The seeds asked for, after the seeds ``out`` has already finished with these settings.

    Results accumulate: a rerun with other ``--seeds`` keeps the finished ones (their
    checkpoints resume at once, training nothing). A results.json of other settings is
    refused rather than overwritten.
    """
    file = out / "results.json"
    if not file.is_file():
        return list(settings.seeds)
    previous = RunResults.read(file)
    for key in ("benchmark", "method", "hyperparameters"):
        if getattr(previous, key) != getattr(settings, key):
            raise CheckpointMismatchError(
                f"{file} was written with other settings ({key}: {getattr(previous, key)!r}); "
                f"use another --out")
    return [*previous.seeds, *(s for s in settings.seeds if s not in previous.seeds)]


#: the files an ``fsd cl`` run writes into its folder (and checkpoints/)
_RUN_FILES = ("results.json", "results.md", "accuracy_matrix.png", "task_accuracy.png")
# what the docs' row folders keep beside them: fsd cl gap's table and fsd cl tune's files
_ROW_FILES = ("gap.md", "tune.json", "tune.md")
_SEED_FOLDER = re.compile(r"seed\d+")
_CHECKPOINT_FILE = re.compile(r"state\.pt|task\d+\.fsd")


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` is an ``fsd cl`` run's folder: marked as one, or laid out as one.

    Without a marker (runs of an fsd before it): a results.json of fsd cl or a checkpoint
    in ``checkpoints/seed<S>``. Unreadable files count as no evidence.
    """
    owner = marker_kind(path)
    if owner is not None:
        return owner == RUN_FOLDER
    if any(path.glob("checkpoints/seed*/state.pt")):
        return True
    try:
        return non_file_kind(path / "results.json") is None and \
            (path / "results.json").is_file() and is_cl_results(read_json(path / "results.json"))
    except (OSError, ValueError, AttributeError, TypeError):
        return False


#: what :func:`is_checkpoint_folder` says of a folder, for messages
CHECKPOINT_FOLDER = "the checkpoint folder of an fsd cl run"


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is the ``checkpoints`` folder of an ``fsd cl`` run.

    No run's folder goes there (or below): the run there owns it and cleans it.
    """
    return path.name == "checkpoints" and is_run_folder(path.parent)


def _earlier_run_folder(path: Path) -> bool:
    """Whether ``path``, a folder without fsd's marker, is a run of an fsd from before it.

    It holds nothing but what ``fsd cl`` writes (results, plots, the docs' row files,
    ``checkpoints/seed<S>`` with checkpoints and summaries, fsd's temporary files, a lock
    holding a pid), and results.json or a seed's checkpoint folder. A results.json that is
    not fsd cl's raises the reader's error naming it, before anything is written.
    """
    def ours(entry: Path, names: Sequence[str] | re.Pattern[str], kind: str) -> bool:
        named = entry.name in names if isinstance(names, Sequence) \
            else names.fullmatch(entry.name) is not None
        return (named and file_kind(entry) == kind) or is_fsd_temporary(entry)

    lock = path / LOCK
    if file_kind(lock) is not None and not is_pid_lock(lock):
        return False
    entries = [p for p in path.iterdir() if p.name not in BOOKKEEPING]
    seeds = []
    for entry in entries:
        if entry.name == "checkpoints" and file_kind(entry) == "a directory":
            seeds = list(entry.iterdir())
            if not all(ours(seed, _SEED_FOLDER, "a directory") for seed in seeds):
                return False
            if not all(ours(f, _CHECKPOINT_FILE, "a file")
                       for seed in seeds if seed.is_dir() for f in seed.iterdir()):
                return False
        elif not ours(entry, (*_RUN_FILES, *_ROW_FILES), "a file"):
            return False
    if (path / "results.json").is_file():
        RunResults.read(path / "results.json")  # raises, naming it, if not fsd cl's
        return True
    return any(seed.is_dir() for seed in seeds)


def run(settings: RunSettings) -> RunResults:
    """Run the settings' method on its benchmark for each seed; write results into ``out``.

    ``out/results.json`` and ``results.md`` are rewritten after every finished seed
    (``complete`` false until all seeds are done); the plots after the last one.
    """
    out = Path(settings.out)
    done: list[SeedResult] = []
    results: RunResults | None = None
    # the penalised steps allocate and free MB-sized buffers: kept mapped, not faulted in anew
    keep_freed_memory()
    refuse_nested(out, is_checkpoint_folder, CHECKPOINT_FOLDER)
    # fsd writes, locks and cleans only a folder that is new, empty or its own
    claim_directory(out, RUN_FOLDER, earlier=_earlier_run_folder)
    with exclusive_directory(out):  # a second fsd cl on this --out is refused, not mixed in
        remove_stale_temporaries(out, below=("checkpoints/seed*",))
        seeds = _with_finished_seeds(settings, out)
        # a FIFO or a device where a result goes is refused now, not after hours of training
        for name in _RUN_FILES:
            check_target(out / name)
        for seed in seeds:
            folder = out / "checkpoints" / f"seed{seed}"
            _refuse_non_file(folder / "state.pt",
                             f"; delete {folder} to start seed {seed} over")
        for seed in seeds:
            done.append(run_seed(settings.benchmark, settings.method, settings.hyperparameters,
                                 seed, out, settings.data_dir, settings.device,
                                 settings.progress))
            results = RunResults.collect(settings.benchmark, settings.method,
                                         settings.hyperparameters, seeds, done,
                                         settings.device)
            write_results(results, out, plots=settings.plots and len(done) == len(seeds))
    if results is None:
        raise ValueError("fsd cl needs at least one seed")
    return results


def run_continual(benchmark: str, method: str, seeds: Sequence[int], out: str | os.PathLike,
                  *, data_dir: str | None = None, device: str = "cpu", progress: bool = True,
                  plots: bool = True, **overrides: Any) -> RunResults:
    """Run ``method`` on ``benchmark`` for each seed, see :func:`run`.

    Keyword overrides replace the paper's hyper-parameters (:class:`Hyperparameters`;
    ``None`` keeps the paper's value).
    """
    return run(RunSettings.create(benchmark, method, seeds, out, data_dir=data_dir,
                                  device=device, progress=progress, plots=plots, **overrides))
