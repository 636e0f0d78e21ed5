"""The ``fsd fidelity`` command."""

from __future__ import annotations

import argparse
from typing import Any

from fsd.metrics import METRICS

from .. import argtypes
from ..argtypes import add_threads_option, apply_threads, number_list, positive_int
from ..benchmarks import load_benchmark
from ..data import add_data_options
from .study import FidelityConfig, claim_fidelity_folder, run_fidelity
from .suite import BENCHMARKS, MINIMIZE_ESTIMATORS, STUDIES


def _studies(text: str) -> tuple[str, ...]:
    """``--studies``: comma-separated names of :data:`STUDIES`, checked while parsing."""
    studies = tuple(s.strip() for s in text.split(","))
    unknown = sorted(set(studies) - set(STUDIES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown studies {unknown}; choose from "
                                         f"{', '.join(STUDIES)}")
    return studies


def _cmd_fidelity(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    cfg = FidelityConfig.from_args(args)  # checks the estimator names before the data loads
    studies = args.studies
    # a folder that is not fsd's to write is refused before the data loads
    claim_fidelity_folder(args.out, args.benchmark)
    bench = load_benchmark(args.benchmark, args.data_dir, max_train=args.max_train,
                           max_test=args.max_test, seed=args.seed)
    run_fidelity(bench, args.out, cfg, studies, progress=not args.quiet)
    print(f"wrote results to {args.out}")
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``fsd fidelity`` on the ``fsd`` command's subparsers."""
    p = subparsers.add_parser(
        "fidelity", help="estimators vs the true FSD (values, ranks, gradients), vs depth, "
                         "and as regularizers")
    p.add_argument("--benchmark", choices=BENCHMARKS, default="split-mnist")
    p.add_argument("--out", type=argtypes.output_dir, required=True,
                   help="output folder (JSON, markdown, PNGs)")
    add_data_options(p)
    p.add_argument("--studies", type=_studies, default=",".join(STUDIES),
                   help="comma-separated subset of pairs,depth,minimize (default: all)")
    p.add_argument("--width", type=argtypes.width, default=100)
    p.add_argument("--depth", type=argtypes.depth, default=2,
                   help="hidden layers (pairs, minimize)")
    p.add_argument("--epochs", type=argtypes.fractional_epochs, default=1.0,
                   help="task-1 epochs of the reference")
    p.add_argument("--lrs", type=number_list(argtypes.learning_rate), default=None,
                   help="fine-tuning learning rates, comma-separated")
    p.add_argument("--iters", type=number_list(argtypes.steps), default=None,
                   help="fine-tuning iteration counts, comma-separated")
    p.add_argument("--depths", type=number_list(argtypes.depth), default=None,
                   help="depth study (default 1..6)")
    p.add_argument("--references", type=argtypes.repeats, default=3,
                   help="reference networks θ_i (seeds) in the pairs study (default 3)")
    p.add_argument("--depth-references", type=argtypes.repeats, default=2,
                   help="reference networks per depth in the depth study (default 2)")
    p.add_argument("--estimators", default=None,
                   help="comma-separated estimators of the pairs study (default: the paper's "
                        "set; also 'BGLN-D (exact)', 'BGLN-D (layerwise)', "
                        "'BGLN-D (exact+layerwise)')")
    p.add_argument("--coreset-size", type=argtypes.coreset, default=200)
    p.add_argument("--ewc-examples", type=positive_int, default=None,
                   help="examples EWC's Fisher averages over (default: all of task 1)")
    p.add_argument("--num-samples", type=argtypes.samples, default=2048,
                   help="samples per call of the sampled estimators")
    p.add_argument("--repeats", type=argtypes.repeats, default=4,
                   help="calls averaged per estimate for the sampled estimators")
    p.add_argument("--lams", type=number_list(argtypes.weight), default=None,
                   help="regularization weights of the minimization study (default 1,10)")
    p.add_argument("--minimize-estimators", default=None,
                   help="comma-separated regularizers of the minimization study, 'none' for "
                        "unregularized (default: " + ",".join(MINIMIZE_ESTIMATORS) + ")")
    p.add_argument("--minimize-steps", type=argtypes.steps, default=300)
    p.add_argument("--minimize-samples", type=argtypes.samples, default=256,
                   help="samples per call of the sampled regularizers in the minimization "
                        "study (default 256)")
    p.add_argument("--max-train", type=positive_int, default=None,
                   help="subset of each task (quick)")
    p.add_argument("--max-test", type=positive_int, default=None)
    p.add_argument("--metric", choices=METRICS, default="euclidean",
                   help="output metric of the truth and the estimators (default euclidean; "
                        "softmax_euclidean and kl leave out BGLN-D, EWC and OSLA, which "
                        "compute only the Euclidean one)")
    add_threads_option(p)
    p.add_argument("--seed", type=argtypes.seed, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_fidelity)
