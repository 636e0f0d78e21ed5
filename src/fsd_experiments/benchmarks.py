"""The benchmarks of the studies: the task streams shared by ``fsd cl`` and ``fsd fidelity``.

A :class:`Task` is one task's training and test tensors (and, on multi-head benchmarks, the
output units it uses). :func:`make_tasks` builds the continual-learning streams of ``fsd cl``
(:data:`CL_BENCHMARKS`: MNIST, Fashion-MNIST and Split CIFAR-100);
:func:`load_benchmark` the first two MNIST tasks of a benchmark, with
flattened inputs, that ``fsd fidelity`` compares estimators on (:data:`FIDELITY_BENCHMARKS`).
Both keep random subsets with :func:`subset`; their seeding is each command's own.
:func:`split_validation` holds out part of each task's training set in place of its test set
(``fsd cl --validation``, the grid of ``fsd cl tune``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .data import CIFAR_DIRS, load_cifar, load_mnist, resolve_data_dir, split_by_classes

#: the continual-learning benchmarks of ``fsd cl``
CL_BENCHMARKS: tuple[str, ...] = ("split-mnist", "permuted-mnist", "split-fashion-mnist",
                                  "split-cifar100", "split-cifar100-11")
#: Split CIFAR-100's benchmarks and their number of tasks: CIFAR-10, then 5 or 10 tasks of 10
#: CIFAR-100 classes each (classes 0–9, 10–19, … in order)
CIFAR_BENCHMARKS: dict[str, int] = {"split-cifar100": 6, "split-cifar100-11": 11}
#: the networks ``fsd cl --model`` trains (:mod:`fsd_experiments.models`): the MLP, the CNN,
#: the CNN with average pools in place of its max-pools, and a small ResNet
MODELS: tuple[str, ...] = ("mlp", "cnn", "cnn-avgpool", "resnet")
#: the convolutional ones among :data:`MODELS`
CNN_MODELS: tuple[str, ...] = ("cnn", "cnn-avgpool", "resnet")
#: the benchmarks whose first two tasks ``fsd fidelity`` uses
FIDELITY_BENCHMARKS: tuple[str, ...] = ("split-mnist", "permuted-mnist")
#: Split MNIST's tasks: digit pairs, in order
SPLIT_PAIRS: tuple[tuple[int, int], ...] = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))


def default_model(benchmark: str) -> str:
    """The network a benchmark trains unless asked otherwise: the CNN on CIFAR, else the MLP."""
    return "cnn" if benchmark in CIFAR_BENCHMARKS else "mlp"


@dataclass
class Task:
    """One task: training and test tensors, a name and the output units it uses."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    name: str = ""
    outputs: list[int] | None = None  # head units (multi-head), None = all outputs


@dataclass
class Benchmark:
    """The first two tasks of a continual-learning benchmark sharing one output head."""

    name: str
    outputs: int
    task1: Task
    task2: Task

    @property
    def input_dim(self) -> int:
        """Flattened input dimension d."""
        return int(self.task1.x_train[0].numel())


def subset(x: Tensor, y: Tensor, limit: int | None, generator: torch.Generator
           ) -> tuple[Tensor, Tensor]:
    """A random ``limit`` rows of ``(x, y)``, kept in their order (all if ``limit`` is None)."""
    if limit is None or limit >= x.shape[0]:
        return x, y
    index = torch.randperm(x.shape[0], generator=generator)[:limit].sort().values
    return x[index], y[index]


#: added to the run's seed for the generator of the validation split: above every seed
#: (< 2³²) and every subset generator's ``10_000 + seed``, so it is none of the others'
VALIDATION_SEED_OFFSET = 2**33


def check_validation(fraction: float | None) -> None:
    """Raise ``ValueError`` unless ``fraction`` is ``None`` or a number strictly in (0, 1)."""
    if fraction is None:
        return
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0 < fraction < 1:  # NaN fails the comparison too
        raise ValueError(f"validation must be a fraction strictly between 0 and 1 of each "
                         f"task's training examples, got {fraction!r}")


def split_validation(x: Tensor, y: Tensor, fraction: float, generator: torch.Generator
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Hold out ``fraction`` of the rows of ``(x, y)``: ``(x_train, y_train, x_held, y_held)``.

    The held-out rows are a random ``round(fraction · n)`` of the n rows (at least one, and
    at least one row is left to train on), drawn from ``generator``; both parts keep the rows
    in their order. Together they are every row once. Raises ``ValueError`` for a
    ``fraction`` outside (0, 1) or fewer than 2 rows.
    """
    kept, held = _holdout(int(x.shape[0]), fraction, generator)
    return x[kept], y[kept], x[held], y[held]


def _holdout(n: int, fraction: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The sorted row indices (kept, held out) of :func:`split_validation` for ``n`` rows."""
    check_validation(fraction)
    if n < 2:
        raise ValueError(f"a validation split needs at least 2 training examples per task, "
                         f"got {n}")
    held = min(n - 1, max(1, round(fraction * n)))
    order = torch.randperm(n, generator=generator)
    return order[held:].sort().values, order[:held].sort().values


def _with_validation(tasks: list[Task], fraction: float, seed: int,
                     shared: bool) -> list[Task]:
    """The tasks with part of each training set held out in place of its test set.

    ``shared``: every task holds the same images (Permuted MNIST), so one split serves all
    of them and no held-out image is trained on under another permutation.
    """
    generator = torch.Generator().manual_seed(VALIDATION_SEED_OFFSET + seed)
    out: list[Task] = []
    index: tuple[Tensor, Tensor] | None = None
    for task in tasks:
        if index is None or not shared:
            index = _holdout(int(task.x_train.shape[0]), fraction, generator)
        kept, held = index
        out.append(Task(task.x_train[kept], task.y_train[kept], task.x_train[held],
                        task.y_train[held], task.name, task.outputs))
    return out


_LOADED: dict[tuple, tuple[Tensor, Tensor]] = {}


def _load_cached(data_dir: str | None, split: str, kind: str) -> tuple[Tensor, Tensor]:
    # several seeds (or runs in one process) reuse the decoded files; tasks never modify them.
    # The folder's files, sizes and modification times are part of the key, so files that
    # change on disk are read again
    directory = resolve_data_dir(data_dir)
    folder = directory / CIFAR_DIRS.get(
        kind, "fashion-mnist" if kind == "fashion-mnist" else "mnist")
    stamp = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                         for p in folder.glob("*") if p.is_file())) if folder.is_dir() else ()
    key = (str(directory), split, kind, stamp)
    if key not in _LOADED:
        _LOADED[key] = (load_cifar(data_dir, split, kind=kind) if kind in CIFAR_DIRS
                        else load_mnist(data_dir, split, kind=kind))
    return _LOADED[key]


def _cifar_tasks(benchmark: str, data_dir: str | None, generator: torch.Generator,
                 train_subset: int | None, test_subset: int | None,
                 num_tasks: int | None) -> tuple[list[Task], int]:
    """Split CIFAR-100: CIFAR-10's 10 classes, then CIFAR-100's classes in blocks of 10.

    Each task has its own head of 10 units (task t: units 10t … 10t + 9) and labels 0–9.
    """
    total = CIFAR_BENCHMARKS[benchmark]
    count = total if num_tasks is None else min(num_tasks, total)
    tasks: list[Task] = []
    for i in range(count):
        kind = "cifar10" if i == 0 else "cifar100"
        classes = list(range(10)) if i == 0 else list(range(10 * (i - 1), 10 * i))
        x_tr, y_tr = _load_cached(data_dir, "train", kind)
        x_te, y_te = _load_cached(data_dir, "test", kind)
        xa, ya = subset(*split_by_classes(x_tr, y_tr, classes), train_subset, generator)
        xb, yb = subset(*split_by_classes(x_te, y_te, classes), test_subset, generator)
        name = "CIFAR-10" if i == 0 else f"CIFAR-100 {classes[0]}–{classes[-1]}"
        tasks.append(Task(xa, ya, xb, yb, name, list(range(10 * i, 10 * i + 10))))
    return tasks, 10 * total


def make_tasks(benchmark: str, data_dir: str | None, seed: int, *,
               train_subset: int | None = None, test_subset: int | None = None,
               num_tasks: int | None = None, validation: float | None = None
               ) -> tuple[list[Task], int]:
    """Build the task stream of ``benchmark``; returns (tasks, number of model outputs).

    Args:
        benchmark: one of :data:`CL_BENCHMARKS`.
        data_dir: data directory (``None``: ``$FSD_DATA_DIR`` or the default cache).
        seed: seeds the permutations (permuted-mnist) and the subsets.
        train_subset: keep a random N training examples per task (tiny runs).
        test_subset: keep a random M test examples per task.
        num_tasks: keep only the first tasks.
        validation: hold out this fraction (in (0, 1)) of each task's training examples,
            after ``train_subset``, in place of its test set: the task trains on the rest
            and its ``x_test``/``y_test`` are the held-out examples (``test_subset`` then
            applies to nothing). The split is drawn once per seed from a generator of its
            own (:data:`VALIDATION_SEED_OFFSET` + ``seed``), so the other draws, and every
            stream built without it, stay as they were; on Permuted MNIST every task holds
            out the same images. ``None``: the test sets.
    """
    if benchmark not in CL_BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; expected one of {CL_BENCHMARKS}")
    check_validation(validation)
    tasks, outputs = _tasks(benchmark, data_dir, seed, train_subset, test_subset, num_tasks)
    if validation is not None:
        tasks = _with_validation(tasks, validation, seed, benchmark == "permuted-mnist")
    return tasks, outputs


def _tasks(benchmark: str, data_dir: str | None, seed: int, train_subset: int | None,
           test_subset: int | None, num_tasks: int | None) -> tuple[list[Task], int]:
    """The task streams of :func:`make_tasks`, each with its test sets."""
    # separate generators so subsets do not depend on how many permutations were drawn
    sub_gen = torch.Generator().manual_seed(10_000 + seed)
    if benchmark in CIFAR_BENCHMARKS:
        return _cifar_tasks(benchmark, data_dir, sub_gen, train_subset, test_subset, num_tasks)
    kind = "fashion-mnist" if benchmark == "split-fashion-mnist" else "mnist"
    x_tr, y_tr = _load_cached(data_dir, "train", kind)
    x_te, y_te = _load_cached(data_dir, "test", kind)
    tasks: list[Task] = []
    if benchmark.startswith("split"):
        count = len(SPLIT_PAIRS) if num_tasks is None else min(num_tasks, len(SPLIT_PAIRS))
        for i, pair in enumerate(SPLIT_PAIRS[:count]):
            xa, ya = subset(*split_by_classes(x_tr, y_tr, pair), train_subset, sub_gen)
            xb, yb = subset(*split_by_classes(x_te, y_te, pair), test_subset, sub_gen)
            tasks.append(Task(xa, ya, xb, yb, f"{pair[0]}/{pair[1]}", [2 * i, 2 * i + 1]))
        return tasks, 2 * len(SPLIT_PAIRS)
    perm_gen = torch.Generator().manual_seed(seed)
    count = 10 if num_tasks is None else min(num_tasks, 10)
    xa_all, ya_all = subset(x_tr, y_tr, train_subset, sub_gen)
    xb_all, yb_all = subset(x_te, y_te, test_subset, sub_gen)
    for i in range(count):
        perm = torch.arange(784) if i == 0 else torch.randperm(784, generator=perm_gen)
        xa = xa_all.reshape(-1, 784)[:, perm].reshape(-1, 1, 28, 28)
        xb = xb_all.reshape(-1, 784)[:, perm].reshape(-1, 1, 28, 28)
        tasks.append(Task(xa, ya_all, xb, yb_all, f"perm {i + 1}"))
    return tasks, 10


def load_benchmark(name: str, data_dir: str | None = None, *, max_train: int | None = None,
                   max_test: int | None = None, seed: int = 0) -> Benchmark:
    """The first two tasks of a benchmark, inputs flattened.

    Split MNIST: 0/1 then 2/3, 2 outputs. Permuted MNIST: the identity then one fixed random
    permutation, 10 outputs.

    ``max_train``/``max_test`` keep a random subset of each task (quick runs and tests).
    """
    if name not in FIDELITY_BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of "
                         f"{', '.join(FIDELITY_BENCHMARKS)}")
    generator = torch.Generator().manual_seed(seed)
    x, y = load_mnist(data_dir, "train")
    xt, yt = load_mnist(data_dir, "test")
    x, xt = x.flatten(1), xt.flatten(1)
    if name == "split-mnist":
        parts = []
        for classes in ([0, 1], [2, 3]):
            a, b = split_by_classes(x, y, classes)
            c, d = split_by_classes(xt, yt, classes)
            a, b = subset(a, b, max_train, generator)
            c, d = subset(c, d, max_test, generator)
            parts.append(Task(a, b, c, d))
        return Benchmark(name, 2, parts[0], parts[1])
    x, y = subset(x, y, max_train, generator)
    xt, yt = subset(xt, yt, max_test, generator)
    perm = torch.randperm(x.shape[1], generator=generator)
    return Benchmark(name, 10, Task(x, y, xt, yt),
                     Task(x[:, perm], y, xt[:, perm], yt))
