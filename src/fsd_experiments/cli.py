"""The ``fsd`` command line (also ``python -m fsd_experiments``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from fsd import __version__

from . import argtypes
from .argtypes import OneLineParser, add_threads_option, apply_threads
from .data.common import add_data_options, downloads_disabled
from .io import (
    atomic_write_text,
    claim_output,
    earlier_output,
    os_error_message,
    versioned,
    write_json,
)

#: layout of compare_estimators.json
COMPARE_SCHEMA = 1
#: the kind of folder ``fsd compare-estimators --out`` writes (see ``io.claim_directory``)
COMPARE_FOLDER = "compare-estimators run"
_COMPARE_FILES = ("compare_estimators.md", "compare_estimators.json")


def _cmd_data_fetch(args: argparse.Namespace) -> int:
    from .data import fetch
    where = fetch(args.name, args.data_dir, source=args.source)
    print(f"{args.name}: ready in {where}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:

    from .compare import compare_estimators, format_rows
    apply_threads(args.threads)
    if args.out:  # a folder that is not fsd's to write is refused now, not after the study
        claim_output(args.out, COMPARE_FOLDER,
                     earlier_output(lambda name: name in _COMPARE_FILES), _COMPARE_FILES)
    rows = compare_estimators(args.data_dir, width=args.width, depth=args.depth,
                              epochs=args.epochs, finetune_epochs=args.finetune_epochs,
                              seed=args.seed, repeats=args.repeats)
    table = format_rows(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        atomic_write_text(out / "compare_estimators.md", table + "\n")
        write_json(out / "compare_estimators.json",
                   versioned({"rows": [asdict(r) for r in rows]}, COMPARE_SCHEMA), indent=2)
        print(f"wrote {out / 'compare_estimators.md'} and .json")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fsd`` command and its subcommands."""
    parser = OneLineParser(
        prog="fsd", description="Function space distance estimators (LAFTR / BGLN).")
    parser.add_argument("--version", action="version", version=f"fsd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    data = sub.add_parser("data", help="obtain and check data sets")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    fetch = data_sub.add_parser("fetch", help="put a data set into the data directory")
    fetch.add_argument("name", help="mnist, fashion-mnist, cifar10, cifar100, uci")
    fetch.add_argument("--source", default=None,
                       help="copy from this folder instead of downloading (e.g. a local "
                            "mirror); for cifar10/cifar100 the official archive "
                            "cifar-10-python.tar.gz / cifar-100-python.tar.gz")
    add_data_options(fetch, reads=False)
    fetch.set_defaults(func=_cmd_data_fetch)

    compare = sub.add_parser(
        "compare-estimators",
        help="every estimator vs the true FSD on an MNIST 0/1 → 2/3 pair of networks")
    add_data_options(compare)
    compare.add_argument("--width", type=argtypes.width, default=100,
                         help="hidden width (default 100)")
    compare.add_argument("--depth", type=argtypes.depth, default=2,
                         help="hidden layers (default 2)")
    compare.add_argument("--epochs", type=argtypes.epochs, default=1,
                         help="epochs on digits 0/1")
    compare.add_argument("--finetune-epochs", type=argtypes.epochs, default=1,
                         help="epochs on digits 2/3")
    compare.add_argument("--seed", type=argtypes.seed, default=0)
    compare.add_argument("--repeats", type=argtypes.repeats, default=5,
                         help="timed distance+backward calls per estimator (median reported)")
    add_threads_option(compare)
    compare.add_argument("--out", type=argtypes.output_dir, default=None,
                         help="also write the table as .md/.json here")
    compare.set_defaults(func=_cmd_compare)
    from . import continual
    continual.add_cli(sub)
    from . import fidelity, memory, toy
    fidelity.add_cli(sub)
    toy.add_cli(sub)
    memory.add_cli(sub)
    from . import influence
    influence.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fsd`` console script."""
    try:
        return _main(argv)
    except argtypes.UsageError as error:  # exits 2 as argparse's refusals do, with one line
        print(f"error: {error}", file=sys.stderr)
        raise
    except ModuleNotFoundError as error:
        # `pip install -e .` installs the script but not the experiments' dependencies
        if error.name not in _EXPERIMENT_DEPENDENCIES:
            raise
        print(f"error: the fsd command needs {error.name}, an experiments dependency: "
              f"pip install -e \".[experiments]\" (the library alone is `import fsd`)",
              file=sys.stderr)
        return 2


_EXPERIMENT_DEPENDENCIES = ("scipy", "matplotlib")


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from .data import DataNotFoundError
    try:
        with downloads_disabled(getattr(args, "no_download", False)):
            return args.func(args)
    except (DataNotFoundError, ValueError) as error:
        # bad names, missing files, inconsistent options: a message, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        # an --out that is a file or on a read-only disk, a full disk: what and where
        print(f"error: {os_error_message(error)}", file=sys.stderr)
        return 2
