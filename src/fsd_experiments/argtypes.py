"""Validated option types for the ``fsd`` command line.

Each is an argparse ``type=``: a bad value is argparse's one-line error and exit code 2
(``argument --width: must be a positive integer, got '0'``) before any data is read, instead
of a count that Python slicing quietly reinterprets (``--tasks -1``), a NaN that trains to NaN
weights, or a traceback from torch.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch

from .io import file_kind


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        name = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {name}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


# Upper bounds, where a larger value would exhaust memory or never finish (each says why).
#: hidden units per layer: a width × width layer of 16384 is 1 GiB of float32 weights, 4 GiB
#: with its gradient and Adam's two moments; the paper's widest network has 1024
MAX_WIDTH = 16_384
#: hidden layers: the paper's deepest is 6, and 64 layers of the widest width hold 64 GiB
MAX_DEPTH = 64
#: epochs: the paper's longest training is 200 (Split CIFAR-100's first task); 10000 epochs
#: of even Split MNIST take months on a CPU
MAX_EPOCHS = 10_000
#: optimisation steps or iterations (fine-tuning, minimisation, PBRF solves, CG): the
#: defaults are at most 2000; a million of the smallest network's steps take hours
MAX_STEPS = 1_000_000
#: Monte Carlo samples per distance call: memory grows with samples × inputs × width, and
#: 65536 (32 × fidelity's default) already needs gigabytes at the default sizes
MAX_SAMPLES = 65_536
#: whole repetitions (reference networks, seeds, timed calls): each one trains or times
#: everything again; the defaults are at most 5
MAX_REPEATS = 1_000
#: PBRFs solved side by side: memory is this many copies of the network and its optimiser
MAX_POINTS_PER_SOLVE = 4_096
#: classes: ImageNet's 1000; the class-wise summaries hold one d × d covariance per class
MAX_CLASSES = 1_000
#: coreset points drawn in memory (``fsd memory --N``): more than CIFAR's 50000 images is no
#: longer a coreset, and 100000 CIFAR-sized inputs are 1.2 GB
MAX_CORESET = 100_000
#: the counts ``fsd memory`` takes in place of the network's (P, A, d): a trillion is more
#: than any network has, and the formulas' squares stay exact in float64's range
MAX_COUNT = 10**12
#: torch CPU threads: more than any machine's cores only slows torch down
MAX_THREADS = 1_024
#: learning rates: a step above 10 diverges on every network here (the command would
#: train to NaN and report it)
MAX_LEARNING_RATE = 10.0
#: penalty weights λ and damping: above 1e12 the weighted penalty overflows float32 (3.4e38)
#: for distances as small as 1e26, and no useful weight comes near it
MAX_WEIGHT = 1e12
#: seeds: numpy's and torch's generators both take [0, 2³² − 1], and ``fsd cl`` derives
#: seed × 100 + task for its summaries, which stays far inside torch's 64 bits
MAX_SEED = 2**32 - 1


def _at_most(value: float, maximum: float, why: str, text: str) -> None:
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum:g} ({why}), got {text!r}")


def bounded_int(maximum: int, why: str) -> Callable[[str], int]:
    """An argparse type: an integer in [1, ``maximum``]; ``why`` is said when it is too large."""
    def parse(text: str) -> int:
        value = positive_int(text)
        _at_most(value, maximum, why, text)
        return value
    parse.__name__ = "bounded_int"
    return parse


def bounded_float(maximum: float, why: str, *, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in (0, ``maximum``] (``zero``: [0, ``maximum``])."""
    def parse(text: str) -> float:
        value = nonnegative_float(text) if zero else positive_float(text)
        _at_most(value, maximum, why, text)
        return value
    parse.__name__ = "bounded_float"
    return parse


#: an integer count of hidden units (see :data:`MAX_WIDTH`)
width = bounded_int(MAX_WIDTH, "a width × width layer of that size would not fit in memory")
#: a number of hidden layers (see :data:`MAX_DEPTH`)
depth = bounded_int(MAX_DEPTH, "deeper networks would not fit in memory")
#: whole epochs (see :data:`MAX_EPOCHS`)
epochs = bounded_int(MAX_EPOCHS, "more would never finish")
#: epochs that may be fractional (see :data:`MAX_EPOCHS`)
fractional_epochs = bounded_float(MAX_EPOCHS, "more would never finish")
#: optimisation steps or iterations (see :data:`MAX_STEPS`)
steps = bounded_int(MAX_STEPS, "more would never finish")
#: Monte Carlo samples per call (see :data:`MAX_SAMPLES`)
samples = bounded_int(MAX_SAMPLES, "more samples would not fit in memory")
#: repetitions of a whole measurement (see :data:`MAX_REPEATS`)
repeats = bounded_int(MAX_REPEATS, "each repeats the whole computation; more would never "
                                   "finish")
#: PBRFs solved at once (see :data:`MAX_POINTS_PER_SOLVE`)
points_per_solve = bounded_int(MAX_POINTS_PER_SOLVE, "each holds a copy of the network; more "
                                                     "would not fit in memory")
#: a number of classes (see :data:`MAX_CLASSES`)
classes = bounded_int(MAX_CLASSES, "one covariance per class would not fit in memory")
#: coreset points drawn in memory (see :data:`MAX_CORESET`)
coreset = bounded_int(MAX_CORESET, "more than any training set here; it would not fit in "
                                   "memory")
#: a parameter, activation or input count of the memory formulas (see :data:`MAX_COUNT`)
count = bounded_int(MAX_COUNT, "more than any network has")
#: a learning rate (see :data:`MAX_LEARNING_RATE`)
learning_rate = bounded_float(MAX_LEARNING_RATE, "a larger step diverges")
#: a penalty weight λ or a damping, ≥ 0 (see :data:`MAX_WEIGHT`)
weight = bounded_float(MAX_WEIGHT, "a larger weight overflows float32", zero=True)


#: torch CPU threads (see :data:`MAX_THREADS`)
threads = bounded_int(MAX_THREADS, "more threads than cores only slow torch down")


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2³² − 1] (see :data:`MAX_SEED`)."""
    value = _number(text, int)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {MAX_SEED}] (the random "
                                         f"generators' range), got {text!r}")
    return value


def number_list(kind: Callable[[str], Any], *, distinct: bool = True
                ) -> Callable[[str], tuple[Any, ...]]:
    """An argparse type: comma-separated values, each checked by ``kind``, all different.

    ``--lrs 1e-3,0`` is refused for its 0 as ``--lr 0`` would be; a value given twice would
    repeat its rows of the study (``distinct=False`` allows it, e.g. for a shape).
    """
    def parse(text: str) -> tuple[Any, ...]:
        parts = [part.strip() for part in text.split(",")]
        if not text.strip() or any(not part for part in parts):
            raise argparse.ArgumentTypeError(f"must be comma-separated values, got {text!r}")
        values: list[Any] = []
        for part in parts:
            try:
                values.append(kind(part))
            except argparse.ArgumentTypeError as error:
                if len(parts) == 1:
                    raise
                raise argparse.ArgumentTypeError(f"{part!r} in {text!r}: {error}") from None
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated and distinct:
            raise argparse.ArgumentTypeError(
                f"values must differ, {', '.join(map(str, repeated))} given twice in {text!r}")
        return tuple(values)
    parse.__name__ = "number_list"
    return parse


#: an input shape: at most 4 dimensions (C, H, W or a flat size) of at most this many numbers
MAX_INPUT_NUMBERS = 2**22


def input_shape(text: str) -> tuple[int, ...]:
    """Comma-separated positive dimensions of one input (``3,32,32``), at most 4 of them.

    Their product is bounded by :data:`MAX_INPUT_NUMBERS` (4 Mi numbers, 16 MiB of float32
    per input: 1365 × 1024 × 3): ``fsd memory`` draws hundreds of such inputs at once.
    """
    shape = number_list(positive_int, distinct=False)(text)
    if len(shape) > 4:
        raise argparse.ArgumentTypeError(f"must have at most 4 dimensions, got {text!r}")
    if math.prod(shape) > MAX_INPUT_NUMBERS:
        raise argparse.ArgumentTypeError(
            f"must hold at most {MAX_INPUT_NUMBERS} numbers (hundreds of such inputs are drawn "
            f"at once), got {text!r}")
    return shape


def _checked_path(text: str, what: str) -> Path:
    """``text`` as a path, refusing the empty string and the filesystem's root."""
    if not text.strip():
        # Path('') is the current directory: an unset shell variable would write there
        raise argparse.ArgumentTypeError(f"is empty (it would be the current directory); "
                                         f"give {what}")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"contains a NUL character, got {text!r}")
    path = Path(text)
    if path.resolve() == Path(path.resolve().anchor):
        raise argparse.ArgumentTypeError(f"is the filesystem's root {text!r}; give {what}")
    return path


def _blocking_ancestor(path: Path) -> Path | None:
    """The nearest existing folder-to-be above ``path`` when it is not a directory."""
    for above in path.absolute().parents:
        if above.exists():
            return None if above.is_dir() else above
    return None


def _refuse_below_a_file(text: str, path: Path) -> None:
    """Refuse ``path`` (given as ``text``) when a folder above it is a file, a FIFO..."""
    blocking = _blocking_ancestor(path)
    if blocking is not None:
        raise argparse.ArgumentTypeError(f"{text} cannot be created: {blocking} is "
                                         f"{file_kind(blocking)}, not a directory")


def output_dir(text: str) -> str:
    """An output directory: not empty (``''`` is the current directory), not ``/``, no file.

    Nor below a file (``afile/x``): refused now rather than when the results are written.
    """
    path = _checked_path(text, "a directory (or a new name)")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is {file_kind(path)}, not a directory: give a "
                                         f"directory (or a new name)")
    _refuse_below_a_file(text, path)
    return text


def output_file(text: str) -> str:
    """An output file: not empty, not ``/``, not a directory, FIFO or device, not below a file."""
    path = _checked_path(text, "a file name")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name")
    if path.exists() and not path.is_file():  # a FIFO, a device: never replaced by a file
        raise argparse.ArgumentTypeError(f"{text} is {file_kind(path)}, not a regular file: give "
                                         f"a file name")
    _refuse_below_a_file(text, path)
    return text


#: the figure formats ``--plot`` writes (matplotlib's Agg backend)
FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def figure_file(text: str) -> str:
    """An output file for a figure: :func:`output_file` ending in one of FIGURE_SUFFIXES."""
    output_file(text)
    if Path(text).suffix.lower() not in FIGURE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"must end in {', '.join(FIGURE_SUFFIXES)} (the figure's format), got {text!r}")
    return text


def input_path(text: str) -> str:
    """A path to read: not empty (``''`` would silently be the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (it would be the current directory); give "
                                         "a path")
    return text


def correlation_count(text: str) -> int:
    """An integer ≥ 3: a number of scored points that correlations are computed over."""
    value = _number(text, int)
    if value < 3:
        raise argparse.ArgumentTypeError(
            f"must be at least 3 (the correlations need 3 points), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number ≥ 0."""
    value = _number(text, float)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """A fraction strictly between 0 and 1."""
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text!r}")
    return value


def momentum(text: str) -> float:
    """An exponential-moving-average momentum in [0, 1)."""
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text!r}")
    return value


def device(text: str) -> str:
    """A torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"is not a device, got {text!r} (e.g. cpu, cuda, "
                                         f"cuda:0)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} asks for CUDA, which this machine "
                                             f"does not have; use cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has "
                                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type not in ("cpu", "mps"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {text!r}")
    return text


class UsageError(SystemExit):
    """Options refused after parsing (they conflict, or name unknown things): exit status 2.

    A ``SystemExit`` as argparse's own refusals are, with status 2 rather than the 1 that
    ``SystemExit(message)`` gives; ``str()`` is the message, which
    :func:`fsd_experiments.cli.main` prints as one line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: the error and where the help is."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (PROG --help lists the options)`` and exit with 2."""
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


class Distinct(argparse.Action):
    """``nargs="+"`` values that must all differ (a seed given twice would count twice)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        """Store the values, or stop with argparse's error if one repeats."""
        items = list(values or [])
        repeated = sorted({v for v in items if items.count(v) > 1})
        if repeated:
            parser.error(f"argument {option_string}: values must differ, "
                         f"{', '.join(map(str, repeated))} given twice")
        setattr(namespace, self.dest, items)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch CPU threads; without it torch's own default is kept.

    Every command takes the same option; :func:`apply_threads` applies it.
    """
    parser.add_argument("--threads", type=threads, default=None,
                        help="torch CPU threads (default: torch's, "
                             f"{torch.get_num_threads()} here; 1 lets runs share the cores)")


def apply_threads(threads: int | None) -> int:
    """Set torch's CPU threads to ``threads`` (``None`` keeps torch's default); returns the count.

    The returned count is what the results files record.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
