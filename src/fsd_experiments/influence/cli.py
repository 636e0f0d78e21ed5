"""The ``fsd influence uci``, ``fsd influence mislabeled`` and ``fsd influence report`` commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import argtypes
from ..argtypes import (
    Distinct,
    add_threads_option,
    apply_threads,
    correlation_count,
    device,
    positive_int,
    probability,
)
from ..data import UCI_DATASETS, DataNotFoundError, add_data_options, load_uci
from .mislabeled import MISLABELED_METHODS, claim_mislabeled_folder, run_mislabeled
from .report import report_tables
from .uci import (
    LEARNING_RATES,
    UCI_METHODS,
    _canonical_uci,
    claim_uci_folder,
    run_uci,
    write_uci_summary,
)


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _cmd_uci(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    try:
        names = list(UCI_DATASETS) if args.dataset == ["all"] else [
            _canonical_uci(d) for d in args.dataset]
        if args.bgln_clusters is not None and args.bgln_clusters < 1:
            raise ValueError(f"--bgln-clusters must be a positive int, got {args.bgln_clusters}")
        for name in names:  # fail on missing files before any long run
            load_uci(name, args.data_dir)
    except (ValueError, DataNotFoundError) as error:
        return _error(str(error))
    # a folder that is not fsd's to write is refused before the training
    out = claim_uci_folder(args.out, names)
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
    apply_threads(args.threads)
    try:
        claim_mislabeled_folder(args.out)  # before the data loads and the training
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


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        print(report_tables(args.runs))
    except (ValueError, OSError) as error:
        return _error(str(error))
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fsd influence uci``, ``mislabeled`` and ``report`` to the ``fsd`` command."""
    influence = subparsers.add_parser(
        "influence", help="influence functions: PBRF with exact / EWC / BGLN-D terms, and CG",
        description="Self-influence via the proximal Bregman response function (paper §5.3).")
    sub = influence.add_subparsers(dest="influence_command", metavar="EXPERIMENT",
                                   required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", type=argtypes.output_dir, required=True, help="output directory")
        add_data_options(p)
        p.add_argument("--seed", type=argtypes.seed, default=0)
        p.add_argument("--damping", type=argtypes.weight, default=1e-3,
                       help="λ: PBRF proximity weight and CG damping (default 1e-3)")
        add_threads_option(p)
        p.add_argument("--points-per-solve", type=argtypes.points_per_solve, default=32,
                       help="PBRFs solved side by side, vmapped (default 32; lower it if "
                            "memory runs short, the scores do not depend on it)")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")

    uci = sub.add_parser("uci", help="self-influence vs exact PBRF on UCI regression sets")
    uci.add_argument("--dataset", nargs="+", required=True,
                     help=f"one or more of {', '.join(UCI_DATASETS)}, or 'all'")
    uci.add_argument("--methods", nargs="+", default=list(UCI_METHODS), choices=UCI_METHODS)
    uci.add_argument("--removals", type=correlation_count, default=50,
                     help="training points scored (50)")
    uci.add_argument("--epochs", type=argtypes.epochs, default=200,
                     help="base training epochs (200)")
    uci.add_argument("--pbrf-epochs", type=argtypes.fractional_epochs, default=20,
                     help="PBRF optimization length in epochs of batch-128 steps (20)")
    uci.add_argument("--pbrf-lr", type=argtypes.learning_rate, default=None,
                     help="SGD learning rate of the PBRF solves (default: the chosen lr)")
    uci.add_argument("--lrs", type=argtypes.learning_rate, nargs="+", action=Distinct,
                     default=list(LEARNING_RATES),
                     help="learning rates searched on the validation split")
    uci.add_argument("--subset", type=positive_int, default=None,
                     help="use only this many random rows of the data set (tiny runs)")
    uci.add_argument("--cg-iters", type=argtypes.steps, default=200,
                     help="max CG iterations (200)")
    uci.add_argument("--cg-data", type=positive_int, default=None,
                     help="random training points CG's Gauss-Newton matrix averages over "
                          "(default: all)")
    uci.add_argument("--bgln-moments", default="paper", choices=["paper", "exact"],
                     help="BGLN-D's moment propagation: paper (Algorithm 2, default) or exact "
                          "(joint moments, = E[BGLN-S])")
    uci.add_argument("--bgln-clusters", type=positive_int, default=None, metavar="K",
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
    mis.add_argument("--n-train", type=positive_int, default=6000,
                     help="MNIST training images (6000)")
    mis.add_argument("--corrupt", type=probability, default=0.1, help="fraction relabelled (0.1)")
    mis.add_argument("--width", type=argtypes.width, default=128,
                     help="hidden width (default 128 for CPU; the paper uses 1024)")
    mis.add_argument("--depth", type=argtypes.depth, default=2)
    mis.add_argument("--epochs", type=argtypes.epochs, default=50)
    mis.add_argument("--lr", type=argtypes.learning_rate, default=0.1,
                     help="SGD learning rate (0.1)")
    mis.add_argument("--pool", type=positive_int, default=1000,
                     help="random training points scored")
    mis.add_argument("--pbrf-steps", type=argtypes.steps, default=100,
                     help="SGD steps per PBRF solve (100, sized for 2 shared CPU cores)")
    mis.add_argument("--pbrf-lr", type=argtypes.learning_rate, default=0.003,
                     help="PBRF SGD learning rate (0.003: stable for BGLN-D's logit metric)")
    mis.add_argument("--cg-data", type=positive_int, default=500,
                     help="random training points the Gauss-Newton matrix averages over")
    mis.add_argument("--ewc-data", type=positive_int, default=1000,
                     help="random training points EWC's Fisher is fitted on (1000)")
    mis.add_argument("--bgln-covariance", default="lowrank", choices=["full", "diag", "lowrank"])
    mis.add_argument("--bgln-rank", type=positive_int, default=64)
    mis.add_argument("--cg-iters", type=argtypes.steps, default=10,
                     help="max CG iterations (10)")
    mis.add_argument("--device", default="cpu", type=device,
                     help="torch device for the network and every method, e.g. cuda (cpu)")
    common(mis)
    mis.set_defaults(func=_cmd_mislabeled)

    report = sub.add_parser(
        "report", help="tables over finished runs, read back from their results.json",
        description="One table of the UCI runs (a row per run and data set) and one of the "
                    "mislabeled runs (a row per run), from the folders their --out named.")
    report.add_argument("runs", nargs="+", metavar="RUN",
                        help="run folders of fsd influence uci or fsd influence mislabeled")
    report.set_defaults(func=_cmd_report)
