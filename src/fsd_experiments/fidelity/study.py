"""``fsd fidelity``'s settings and the run of its studies, writing JSON, markdown and PNGs."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..argtypes import UsageError
from ..benchmarks import FIDELITY_BENCHMARKS, Benchmark
from ..io import atomic_write_text, claim_output, earlier_output, named, versioned, write_json
from ..stats import bootstrap_spearman_difference
from .depth import depth_plot, depth_study, format_depth
from .minimize import format_minimization, minimization_plot, minimization_study
from .pairs import format_summary, pair_study, scatter_plot, summarize_pairs
from .suite import (
    ALL_ESTIMATORS,
    DEPTH_ESTIMATORS,
    FITTABLE,
    MINIMIZE_ESTIMATORS,
    SAMPLED,
    STUDIES,
    Suite,
    accuracy,
    fit_suite,
    make_family,
    takes_metric,
    train_reference,
)

#: the layout of fidelity_<benchmark>.json
FIDELITY_SCHEMA = 1
#: the kind of folder ``fsd fidelity`` writes (see :func:`fsd_experiments.io.claim_directory`)
FIDELITY_FOLDER = "fidelity run"


def fidelity_files(benchmark: str) -> tuple[str, ...]:
    """The files :func:`run_fidelity` writes for ``benchmark`` (each study its own plot)."""
    return (f"fidelity_{benchmark}.json", f"fidelity_{benchmark}.md",
            *(f"{plot}_{benchmark}.png" for plot in ("scatter", "depth", "minimize")))


def claim_fidelity_folder(out: str | Path, benchmark: str) -> None:
    """Make ``out`` an ``fsd fidelity`` folder before any work, or refuse it.

    New, empty or already fidelity's; a folder without fsd's marker only where it holds
    nothing but an earlier ``fsd fidelity``'s files (of any of its benchmarks). A result file
    for ``benchmark`` that is a FIFO, a device or a folder is refused too.

    Raises:
        UnsafeOutputError: the folder or a result path is not fsd's to write (the message
            says which and what to do).
    """
    earlier = earlier_output(named(*(re.escape(name) for bench in FIDELITY_BENCHMARKS
                                     for name in fidelity_files(bench))))
    claim_output(out, FIDELITY_FOLDER, earlier, fidelity_files(benchmark))


@dataclass(frozen=True)
class FidelityConfig:
    """Settings of :func:`run_fidelity` (defaults: the ``fsd fidelity`` defaults)."""

    width: int = 100
    depth: int = 2
    epochs: float = 1.0
    lr: float = 1e-3
    batch_size: int = 64
    lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
    iters: tuple[int, ...] = (10, 30, 100, 300)
    references: int = 3
    depth_references: int = 2
    coreset_size: int = 200
    ewc_examples: int | None = None
    num_samples: int = 2048
    repeats: int = 4
    estimators: tuple[str, ...] = ALL_ESTIMATORS
    depths: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    depth_lrs: tuple[float, ...] = (1e-4, 1e-3, 1e-2)
    depth_iters: tuple[int, ...] = (10, 30, 100, 300)
    depth_estimators: tuple[str, ...] = DEPTH_ESTIMATORS
    minimize_estimators: tuple[str, ...] = MINIMIZE_ESTIMATORS
    lams: tuple[float, ...] = (1.0, 10.0)
    minimize_samples: int = 256
    minimize_steps: int = 300
    minimize_lr: float = 1e-3
    log_every: int = 20
    metric: str = "euclidean"
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FidelityConfig:
        """The settings the ``fsd fidelity`` options ask for.

        Unset lists take the defaults; with a metric other than ``"euclidean"``, only the
        default estimators that compute it. Named estimators that do not are refused here,
        before any data loads.
        """
        defaults, metric = cls(), args.metric

        def chosen(text: str | None, allowed: Sequence[str], default: Sequence[str]
                   ) -> tuple[str, ...]:
            if not text:
                return tuple(n for n in default if takes_metric(n, metric))
            names = _names(text, allowed)
            refused = [n for n in names if not takes_metric(n, metric)]
            if refused:
                raise UsageError(
                    f"{', '.join(refused)} compute only the Euclidean metric; with --metric "
                    f"{metric} choose from "
                    f"{', '.join(repr(a) for a in allowed if takes_metric(a, metric))}")
            return names

        return cls(
            width=args.width, depth=args.depth, epochs=args.epochs,
            lrs=args.lrs or defaults.lrs, iters=args.iters or defaults.iters,
            coreset_size=args.coreset_size, num_samples=args.num_samples,
            repeats=args.repeats, references=args.references,
            depth_references=args.depth_references, ewc_examples=args.ewc_examples,
            depths=args.depths or defaults.depths, lams=args.lams or defaults.lams,
            minimize_steps=args.minimize_steps, minimize_samples=args.minimize_samples,
            seed=args.seed, metric=metric,
            estimators=chosen(args.estimators, FITTABLE, defaults.estimators),
            depth_estimators=chosen(None, FITTABLE, defaults.depth_estimators),
            minimize_estimators=chosen(args.minimize_estimators, ("none", *FITTABLE),
                                       defaults.minimize_estimators))


def _names(text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """Comma-separated estimator titles, checked before any data is loaded."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise UsageError(f"unknown estimators {unknown or [text]}; choose from "
                         f"{', '.join(repr(a) for a in allowed)}")
    return names


def run_fidelity(bench: Benchmark, out: str | Path, config: FidelityConfig | None = None,
                 studies: Sequence[str] = STUDIES, progress: bool = True) -> dict[str, Any]:
    """Run the chosen studies and write JSON, markdown and PNGs into ``out``.

    Files: ``fidelity_<bench>.{json,md}``, ``scatter_<bench>.png``, ``depth_<bench>.png``,
    ``minimize_<bench>.png``. Returns the JSON-able results.
    """
    cfg = config or FidelityConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tag = bench.name
    results: dict[str, Any] = {"benchmark": tag, "config": {
        k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
        "task1_train_size": int(bench.task1.x_train.shape[0])}
    say = print if progress else (lambda *a, **k: None)

    def save() -> None:
        write_json(out / f"fidelity_{tag}.json", versioned(results, FIDELITY_SCHEMA), indent=1)
        atomic_write_text(out / f"fidelity_{tag}.md", fidelity_markdown(results))

    reference = suite = None
    if "pairs" in studies or "minimize" in studies:
        start = time.perf_counter()
        reference = train_reference(bench, width=cfg.width, depth=cfg.depth, epochs=cfg.epochs,
                                    lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed)
        results["reference_task1_accuracy"] = accuracy(reference, bench.task1.x_test,
                                                       bench.task1.y_test)
        names = list(dict.fromkeys(
            (list(cfg.estimators) if "pairs" in studies else [])
            + ([n for n in cfg.minimize_estimators if n != "none"]
               if "minimize" in studies else [])))
        suite = fit_suite(reference, bench, names, coreset_size=cfg.coreset_size,
                          num_samples=cfg.num_samples, repeats=cfg.repeats, seed=cfg.seed,
                          ewc_examples=cfg.ewc_examples, metric=cfg.metric)
        results["fit_seconds"] = suite.fit_seconds
        results["nbytes"] = {n: e.nbytes for n, e in suite.estimators.items()}
        results["nbytes"]["ExactFSD"] = suite.exact.nbytes
        say(f"reference + fits: {time.perf_counter() - start:.0f}s "
            f"(task-1 test acc {results['reference_task1_accuracy']:.4f})", flush=True)

    if "pairs" in studies:
        assert reference is not None and suite is not None  # fitted above
        start = time.perf_counter()
        pairs = []
        for r in range(cfg.references):
            if r == 0:
                ref_r, suite_r = reference, Suite(
                    suite.exact, {n: suite.estimators[n] for n in cfg.estimators},
                    suite.repeats, suite.coreset_size)
            else:  # further references: other seeds, same recipe
                ref_r = train_reference(bench, width=cfg.width, depth=cfg.depth,
                                        epochs=cfg.epochs, lr=cfg.lr,
                                        batch_size=cfg.batch_size, seed=cfg.seed + r)
                suite_r = fit_suite(ref_r, bench, cfg.estimators,
                                    coreset_size=cfg.coreset_size, num_samples=cfg.num_samples,
                                    repeats=cfg.repeats, seed=cfg.seed + r,
                                    ewc_examples=cfg.ewc_examples, metric=cfg.metric)
            family = make_family(ref_r, bench, lrs=cfg.lrs, iters=cfg.iters,
                                 batch_size=cfg.batch_size, seed=cfg.seed + r)
            pairs += pair_study(bench, ref_r, family, suite_r, progress=progress,
                                reference_id=r)["pairs"]
        result = {"pairs": pairs, "summary": summarize_pairs(pairs, list(cfg.estimators))}
        versus = ({n: bootstrap_spearman_difference(pairs, n, "NTK (coreset)", seed=cfg.seed)
                   for n in cfg.estimators if n != "NTK (coreset)"}
                  if "NTK (coreset)" in cfg.estimators else None)
        result["spearman_vs_ntk"] = versus
        results["pairs"] = result
        scatter_plot(result, out / f"scatter_{tag}.png",
                     f"{tag}: estimated vs true FSD ({len(pairs)} pairs)")
        say(f"pairs: {time.perf_counter() - start:.0f}s", flush=True)
        say(format_summary(result["summary"], None, versus), flush=True)
        save()

    if "minimize" in studies:
        assert reference is not None and suite is not None  # fitted above
        start = time.perf_counter()
        estimators = dict(suite.estimators)
        sampled = [n for n in cfg.minimize_estimators if n in SAMPLED]
        if sampled:  # training-style use: fewer samples per call than the fidelity estimates
            estimators.update(fit_suite(reference, bench, sampled, coreset_size=cfg.coreset_size,
                                        num_samples=cfg.minimize_samples, repeats=1,
                                        seed=cfg.seed, metric=cfg.metric).estimators)
        min_suite = Suite(suite.exact, estimators, 1, suite.coreset_size)
        result = minimization_study(bench, reference, min_suite, cfg.minimize_estimators,
                                    lams=cfg.lams, steps=cfg.minimize_steps, lr=cfg.minimize_lr,
                                    batch_size=cfg.batch_size, log_every=cfg.log_every,
                                    seed=cfg.seed, progress=progress)
        results["minimize"] = result
        minimization_plot(result, out / f"minimize_{tag}.png",
                          f"{tag}: true FSD ({cfg.metric}) while training task 2")
        say(f"minimize: {time.perf_counter() - start:.0f}s", flush=True)
        save()

    if "depth" in studies:
        start = time.perf_counter()
        result = depth_study(bench, depths=cfg.depths, names=cfg.depth_estimators,
                             width=cfg.width, epochs=cfg.epochs, lr=cfg.lr, lrs=cfg.depth_lrs,
                             iters=cfg.depth_iters, batch_size=cfg.batch_size,
                             coreset_size=cfg.coreset_size, num_samples=cfg.num_samples,
                             repeats=cfg.repeats, seed=cfg.seed,
                             references=cfg.depth_references, progress=progress,
                             metric=cfg.metric)
        results["depth"] = result
        depth_plot(result, out / f"depth_{tag}.png",
                   f"{tag}: correlation with true FSD vs depth")
        say(f"depth: {time.perf_counter() - start:.0f}s", flush=True)
        save()
    save()
    return results


def fidelity_markdown(results: dict[str, Any]) -> str:
    """The markdown ``fsd fidelity`` writes beside its JSON, rendered from those results.

    One function for both, so a committed ``fidelity_<benchmark>.json`` regenerates its
    ``.md`` (and the docs tables copied from it) exactly.
    """
    cfg = results["config"]
    md = [f"## {results['benchmark']}\n",
          f"Output metric: {cfg['metric']} (the truth's and every estimator's).\n"]
    if "pairs" in results:
        pairs, versus = results["pairs"]["pairs"], results["pairs"]["spearman_vs_ntk"]
        md += [f"### Pairs: {len(pairs)} pairs ({cfg['references']} references θ_i × "
               f"{len(cfg['lrs'])} learning rates × {len(cfg['iters'])} iteration counts; "
               f"MLP {cfg['depth']}×{cfg['width']}, coreset N = {cfg['coreset_size']}, sampled "
               f"estimators: mean of {cfg['repeats']} calls × {cfg['num_samples']} samples)\n",
               format_summary(results["pairs"]["summary"], results["nbytes"], versus), "",
               f"True FSD range: {min(p['true'] for p in pairs):.4g} – "
               f"{max(p['true'] for p in pairs):.4g}; ExactFSD stores "
               f"{results['nbytes']['ExactFSD']:,} bytes. Bytes are those of reference 0's "
               f"summaries.\n"]
    if "minimize" in results:
        md += [f"### Minimization: task 2 trained with λ·estimate from θ1 "
               f"({cfg['minimize_steps']} Adam steps, lr {cfg['minimize_lr']:g}, batch "
               f"{cfg['batch_size']}; sampled estimators {cfg['minimize_samples']} samples per "
               f"call)\n",
               format_minimization(results["minimize"]), ""]
    if "depth" in results:
        per_depth = (cfg["depth_references"] * len(cfg["depth_lrs"])
                     * len(cfg["depth_iters"]))
        md += [f"### Depth: Spearman / Kendall with the truth, MLP width {cfg['width']}, "
               f"{per_depth} pairs per depth ({cfg['depth_references']} references)\n",
               format_depth(results["depth"]), ""]
    return "\n".join(md) + "\n"
