"""Validated option types for the ``fsd`` command line.

Each is an argparse ``type=``: a bad value is argparse's one-line error and exit code 2
(``argument --width: must be a positive integer, got '0'``) before any data is read, instead
of a count that Python slicing quietly reinterprets (``--tasks -1``), a NaN that trains to NaN
weights, or a traceback from torch.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, NoReturn, Sequence

import torch


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
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's, "
                             f"{torch.get_num_threads()} here; 1 lets runs share the cores)")


def apply_threads(threads: int | None) -> int:
    """Set torch's CPU threads to ``threads`` (``None`` keeps torch's default); returns the count.

    The returned count is what the results files record.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
