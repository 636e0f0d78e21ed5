"""The ``fsd cl`` command and its ``report``, ``gap`` and ``merge`` subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsd.metrics import METRICS
from fsd.moments.evaluators import names as evaluator_names

from .. import argtypes
from ..argtypes import (
    Distinct,
    add_threads_option,
    apply_threads,
    device,
    momentum,
    positive_int,
)
from ..benchmarks import MODELS
from ..data import add_data_options
from ..io import DirectoryInUseError, atomic_write_text
from ..presets import CNN_METHODS, RESIDUAL_METHODS
from .reporting import (
    UNFINISHED_LINE,
    comparison_plot,
    gap_evaluators_markdown,
    gap_layers_markdown,
    gap_markdown,
    gap_plot,
    gap_tables,
    learning_tables,
    merge_runs,
    penalty_gap,
    report,
    row_tables,
    wall_tables,
)
from .results import results_markdown
from .runner import BENCHMARKS, METHODS, CheckpointMismatchError, run
from .settings import (
    OPTIMIZER_MODES,
    PENALTY_MODES,
    PENALTY_OUTPUTS,
    STATISTICS_MODES,
    RunSettings,
)
from .tune import tune, tune_tables


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.benchmark or not args.method or not args.out:
        print("error: fsd cl needs --benchmark, --method and --out (or: fsd cl report DIR...)",
              file=sys.stderr)
        return 2
    settings = RunSettings.from_args(args)
    apply_threads(settings.threads)
    try:
        results = run(settings)
    except (CheckpointMismatchError, DirectoryInUseError) as error:  # a message, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(results_markdown(results))
    print(f"wrote {Path(args.out) / 'results.json'}, results.md"
          + ("" if args.no_plots else ", accuracy_matrix.png, task_accuracy.png"))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.fsd_scale is not None:
        print("error: fsd cl tune chooses λ from --grid; leave out --fsd-scale", file=sys.stderr)
        return 2
    args.validation = args.validation or None  # --validation 0: the grid on the test sets
    settings = RunSettings.from_args(args)
    apply_threads(settings.threads)
    try:
        result = tune(settings, args.grid, args.tuning_seed, jobs=args.jobs)
    except (CheckpointMismatchError, DirectoryInUseError) as error:  # a message, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.markdown(settings))
    print(f"wrote {Path(args.out) / 'tune.json'}, tune.md")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    try:
        merged = merge_runs(args.dirs, args.out, plots=not args.no_plots, partial=args.partial,
                            checkpoints=not args.no_checkpoints)
    except DirectoryInUseError as error:  # an fsd cl (or merge) holds --out: a message
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(results_markdown(merged))
    carried = sorted(int(p.name[4:]) for p in (Path(args.out) / "checkpoints").glob("seed*"))
    print(f"wrote {Path(args.out) / 'results.json'} (seeds {merged.seeds}; checkpoints of "
          f"seeds {carried or 'none'})")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    if args.rows + args.tune + args.gap + args.wall + args.learning > 1:
        print("error: --rows, --tune, --gap, --wall and --learning are different tables; give "
              "one", file=sys.stderr)
        return 2
    for flag in ("wall", "learning"):
        if getattr(args, flag) and args.plot:
            print(f"error: --{flag} has no figure; drop --plot", file=sys.stderr)
            return 2
    table = (row_tables(args.dirs) if args.rows else tune_tables(args.dirs) if args.tune
             else gap_tables(args.dirs) if args.gap else wall_tables(args.dirs) if args.wall
             else learning_tables(args.dirs) if args.learning else report(args.dirs))
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = ("# Continual learning results\n\nProduced by `fsd cl report "
                  + " ".join(args.dirs) + "`.\n\n")
        atomic_write_text(out, header + table)
        print(f"wrote {out}")
    if args.plot:
        plot = gap_plot if args.gap else comparison_plot
        print(f"wrote {plot(args.dirs, args.plot)}")
    return 0


def _cmd_gap(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    rows = penalty_gap(args.dir, args.data_dir, args.examples, args.linearized, args.by_layer,
                       args.evaluators or ())
    for seed in dict.fromkeys(r["seed"] for r in rows if not r["finished"]):
        after = max(r["after_task"] for r in rows if r["seed"] == seed)
        print(UNFINISHED_LINE.format(seed=seed, after=after) + "\n")
    print(gap_markdown(rows))
    if args.by_layer:
        print(gap_layers_markdown(rows))
    if args.evaluators:
        print(gap_evaluators_markdown(rows))
    return 0


def _tune_validation(text: str) -> float:
    """``fsd cl tune --validation``: 0 (the grid on the test sets) or a fraction in (0, 1)."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass  # refused below, in argtypes.probability's words
    return argtypes.probability(text)


def _add_run_options(parser: argparse.ArgumentParser, *, enforce_required: bool) -> None:
    """The options of a run: ``fsd cl`` and ``fsd cl tune`` take the same ones.

    ``--benchmark``, ``--method`` and ``--out`` are required to run. argparse enforces that
    where ``enforce_required`` (``fsd cl tune``); ``fsd cl`` itself also dispatches to
    ``report``/``gap``/``merge``, which do not take them, so its own check and its usage
    line say so instead.
    """
    parser.add_argument("--benchmark", choices=BENCHMARKS, help="(required)",
                        required=enforce_required)
    parser.add_argument("--method", choices=list(METHODS), help="(required)",
                        required=enforce_required)
    parser.add_argument("--seeds", type=argtypes.seed, nargs="+", default=[20, 21, 22],
                        action=Distinct,
                        help="seeds, run one after the other (default: 20 21 22, the paper's)")
    parser.add_argument("--out", type=argtypes.output_dir,
                        help="(required) output directory (results, plots, "
                                      "checkpoints)", required=enforce_required)
    add_data_options(parser)
    paper = "(default: the paper's for the benchmark and method)"
    for name, kind, what in [
            ("--epochs", argtypes.epochs, f"epochs per task {paper}"),
            ("--first-epochs", argtypes.epochs, "epochs on the first task (default: the paper's, "
             "200 on Split CIFAR-100; elsewhere --epochs)"),
            ("--lr", argtypes.learning_rate, f"Adam learning rate {paper}"),
            ("--batch-size", positive_int, f"batch size {paper}"),
            ("--fsd-scale", argtypes.weight, f"penalty weight λ {paper}"),
            ("--width", argtypes.width, "hidden width of the MLP (default: split 256, "
             "permuted 512)"),
            ("--momentum", momentum, "EMA momentum of the gate frequencies, the weight kept on "
             "the past (default: running mean, which is the paper's 1/batch_size; 0.99 for "
             "bgln-s-cw on Split CIFAR-100)"),
            ("--coreset-size", argtypes.coreset, "coreset points per task (default 40; 200 on "
             "Split CIFAR-100)"),
            ("--num-samples", argtypes.samples, "Monte Carlo samples per BGLN-S/LAFTR distance "
             "call (default 32)"),
            ("--train-subset", positive_int, "random training examples kept per task (tiny runs)"),
            ("--test-subset", positive_int, "random test examples kept per task (tiny runs)"),
            ("--tasks", positive_int, "use only the first N tasks"),
            ("--rank", positive_int,
             "store each task's input covariance as its top-r eigenpairs plus "
             "a diagonal (BGLN methods with full moments; default: full covariance, "
             "64 for bgln-d-exact)"),
            ("--injection-rank", positive_int,
             "the corrected BGLN-D methods: size the gates' injected variance from the "
             "stored covariance's top r directions plus its diagonal (default: 8 for "
             "bgln-d-corrected-cut, the whole covariance for the others)")]:
        parser.add_argument(name, type=kind, default=None, help=what)
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="the network: mlp (2 hidden ReLU layers), cnn (the paper's "
                             "Split CIFAR-100 CNN, 4 conv + 2 dense layers, for any image "
                             "shape; runs " + ", ".join(CNN_METHODS) + ") or cnn-avgpool "
                             "(the same with average pools in place of its max-pools) or "
                             "resnet (a small ResNet: stem, two residual blocks, one with a "
                             "conv1×1 shortcut, adaptive average pooling; runs "
                             + ", ".join(RESIDUAL_METHODS) + ") "
                             "(default: cnn on Split CIFAR-100, else mlp)")
    parser.add_argument("--optimizer", choices=OPTIMIZER_MODES, default=None,
                    help="shared: one Adam for the whole stream (default, the authors' code); "
                         "per-task: a fresh Adam at every task")
    parser.add_argument("--penalty", choices=PENALTY_MODES, default=None,
                    help="mean: λ times the mean of the previous tasks' distances (default, "
                         "the authors' code, what the paper's λ was tuned for); sum: eq. 3")
    parser.add_argument("--penalty-outputs", choices=PENALTY_OUTPUTS, default=None,
                    help="multi-head benchmarks: each summary covers its task's head, or all "
                         "logits (default: all for the paper's BGLN-D and its variants, as the "
                         "authors' code; head for the others, bgln-d-exact included)")
    parser.add_argument("--statistics", choices=STATISTICS_MODES, default=None,
                    help="BGLN and LAFTR summaries: record the input moments and gate "
                         "statistics in each task's last training epoch (last-epoch, default, "
                         "the paper's), or in one pass over its training inputs after training, "
                         "in evaluation mode (after: dropout off, at the final parameters)")
    parser.add_argument("--metric", default=None, choices=list(METRICS),
                    help="output metric of the Monte Carlo and NTK penalties (laftr, bgln-s, "
                         "ntk...; default: softmax_euclidean, as the authors' BGLN-S code, but "
                         "euclidean for laftr and laftr-coreset, which hold earlier tasks "
                         "better on it; "
                         "on Split CIFAR-100 the paper's per method, kl for ntk and laftr)")
    add_threads_option(parser)
    parser.add_argument("--device", default="cpu", type=device)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fsd cl`` (run a benchmark) and ``fsd cl report`` to the ``fsd`` command."""
    cl = subparsers.add_parser(
        "cl", help="continual learning benchmarks (Split/Permuted MNIST, Split Fashion-MNIST, "
                   "Split CIFAR-100) with FSD penalties",
        usage="fsd cl --benchmark B --method M --out DIR [options]\n"
              "       fsd cl {report,gap,merge,tune} ...",
        description="Run a continual-learning benchmark, or `fsd cl report DIR...`. "
                    "Hyper-parameters default to the paper's for the (benchmark, method).")
    _add_run_options(cl, enforce_required=False)
    cl.add_argument("--validation", type=argtypes.probability, default=None,
                    metavar="FRACTION",
                    help="hold out FRACTION (strictly between 0 and 1, e.g. 0.1) of each "
                         "task's training examples, after --train-subset, train on the rest "
                         "and report accuracies on the held-out ones instead of the test set "
                         "(one grid point of fsd cl tune by hand; not the paper's protocol; "
                         "default: the test sets)")
    cl.set_defaults(func=_cmd_run)
    # prog given: the default derives it from the usage line above, which names options
    cl_sub = cl.add_subparsers(dest="cl_command", metavar="{report,gap,merge,tune}", prog="fsd cl")
    rep = cl_sub.add_parser("report", help="compare finished runs in one markdown table")
    rep.add_argument("dirs", nargs="+", type=argtypes.input_path,
                     help="run directories (or parents of them)")
    rep.add_argument("--out", type=argtypes.output_file, default=None,
                     help="write the table here (e.g. docs/results.md)")
    rep.add_argument("--rows", action="store_true",
                     help="the docs' tables: one per benchmark, a line per row folder "
                          "(named ROW-NAME, e.g. results/cl/split-mnist/S1-bgln-s), per-seed "
                          "values, the settings that differ from the defaults")
    rep.add_argument("--tune", action="store_true",
                     help="the docs' tuning table: a line per fsd cl tune output (its --out "
                          "folder, or a row folder holding tune.json beside the final "
                          "results.json): the grid, the chosen λ, the final seeds")
    rep.add_argument("--gap", action="store_true",
                     help="the docs' estimate-against-truth table: a line per row folder "
                          "holding gap.md (what fsd cl gap printed): the spread of estimate / "
                          "true FSD over seeds and old tasks, task 1's numbers per seed")
    rep.add_argument("--learning", action="store_true",
                     help="the docs' learning-and-forgetting table: a line per row folder, each "
                          "task's accuracy right after its own training (mean over tasks), the "
                          "average at the end, BWT, and per task right after → at the end")
    rep.add_argument("--wall", action="store_true",
                     help="the docs' wall-time table: a line per row folder, its minutes per "
                          "seed and their ratio to the fine-tuning row of the same tasks, "
                          "network, epochs and machine")
    rep.add_argument("--plot", type=argtypes.figure_file, default=None, metavar="FILE",
                     help="also draw the runs' accuracy after each task on one set of axes "
                          "(per benchmark) into FILE (.png, .pdf, .svg); with --gap, every "
                          "row's estimate / true FSD per seed and old task instead")
    rep.set_defaults(func=_cmd_report)
    gap = cl_sub.add_parser("gap", help="true FSD vs each stored summary's estimate at the "
                                        "end of a finished run")
    gap.add_argument("dir", type=argtypes.input_path,
                     help="a run directory (with results.json and checkpoints/)")
    add_data_options(gap)
    gap.add_argument("--examples", type=positive_int, default=10_000,
                     help="training inputs per task for the true FSD (10000)")
    gap.add_argument("--linearized", action="store_true",
                     help="also the FSD of the final network linearized around each task's "
                          "(what a Gauss-Newton penalty approximates), to split the gap "
                          "between the linearization and the summary's own approximation")
    gap.add_argument("--by-layer", action="store_true",
                     help="for summaries that split by layer (--method osla or ewc): each "
                          "layer's term against the linearized FSD when only that layer moves")
    gap.add_argument("--evaluators", nargs="+", choices=evaluator_names(), metavar="NAME",
                     help="for BGLN-D runs: also each summary's statistics walked by these "
                          "evaluators (" + ", ".join(evaluator_names()) + "), in a second "
                          "table, e.g. exact moments at a network trained against another walk")
    add_threads_option(gap)
    gap.set_defaults(func=_cmd_gap)
    merge = cl_sub.add_parser("merge", help="combine finished runs of the same settings "
                                            "(e.g. seeds run in parallel) into one directory")
    merge.add_argument("dirs", nargs="+", type=argtypes.input_path,
                       help="finished run directories")
    merge.add_argument("--out", type=argtypes.output_dir, required=True,
                       help="a new or empty directory for the merged results")
    merge.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    merge.add_argument("--partial", action="store_true",
                       help="accept runs stopped before all their seeds; take the finished ones")
    merge.add_argument("--no-checkpoints", action="store_true",
                       help="do not carry each seed's checkpoint (checkpoints/seed<S>, "
                            "hard-linked or copied) into --out; without them fsd cl gap and a "
                            "resumed fsd cl or tune cannot use the merged seeds")
    merge.set_defaults(func=_cmd_merge)
    tune_parser = cl_sub.add_parser(
        "tune", help="the paper's tuning protocol: a grid of λ on one seed, then the best λ "
                     "on the reported seeds (--seeds)",
        description="Run each λ of --grid on --tuning-seed with part of every task's "
                    "training set held out as a validation split (--validation, 0.1 by "
                    "default), choose the λ with the best final average accuracy on the "
                    "held-out examples, then run the reported --seeds at that λ on the full "
                    "training sets, reporting the test sets. Each grid point "
                    "(OUT/grid/lambda-<λ>) and the final run (OUT/final) is an ordinary fsd "
                    "cl run, so a stopped tuning resumes (a finished one is read from its "
                    "results.json, checkpoints or not); OUT/tune.json and tune.md hold "
                    "the grid and the choice.")
    _add_run_options(tune_parser, enforce_required=True)
    tune_parser.add_argument(
        "--validation", type=_tune_validation, default=0.1, metavar="FRACTION",
        help="the fraction of each task's training examples (after --train-subset) the grid's "
             "runs hold out and choose λ on, drawn once from the tuning seed; the final "
             "run trains on all of them and reports the test sets (default 0.1; 0: the "
             "grid on the test sets, as tunings before this option did)")
    tune_parser.add_argument("--grid", type=argtypes.weight, nargs="+", required=True,
                             action=Distinct, metavar="LAMBDA",
                             help="the values of the penalty weight λ to try")
    tune_parser.add_argument("--tuning-seed", type=argtypes.seed, default=42,
                             help="the seed the grid runs on (default 42, the paper's)")
    tune_parser.add_argument(
        "--jobs", type=argtypes.positive_int, default=1,
        help="run the grid points, then the final seeds, this many processes at a time "
             "(each with --threads torch threads, or the default count divided by --jobs; "
             "per-task lines instead of progress bars); default 1")
    tune_parser.set_defaults(func=_cmd_tune)
