"""Markdown tables rendered from the result files committed under ``results/``.

The tables the docs render from JSON result files are formatted here, once: for a
``<!-- rendered from PATHS by NAME: begin -->`` block (:mod:`fsd_experiments.doc_tables`;
:data:`RENDERERS` names them), and by the benchmark script that writes the files where it
prints the same table. A renderer takes the paths the block names, in its order, and returns
the table. Most load JSON files and hand them to a function of this module that the scripts
call on the rows they just measured; ``injections-against-exact`` reads ``results/cl`` row
folders (their ``results.json`` and ``gap.md``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .continual.reporting import per_seed_cell, read_gap_folders
from .io import read_json
from .presets import PRESETS

#: a renderer: the paths a block names (files or folders, in the block's order) -> a table
Renderer = Callable[[Sequence[Path]], str]


def _ratio_cell(value: float | None, significant: bool) -> str:
    if value is None:
        return "–"
    return f"{value:.3g}" if significant else f"{value:.3f}"


# ----- the chain of approximations (benchmarks/cnn_gap_chain.py) ---------------------------

def gap_chain_table(results: Sequence[Mapping[str, Any]], significant: bool = False) -> str:
    """``cnn_gap_chain.py``'s rows: each approximation's estimate over the true FSD.

    One line per (run, seed, task) of the files' ``"rows"``; a λ column where the rows have
    more than one λ, a seed column where they have more than one seed (or no λ column). The
    fired-pool columns appear only where some row has them (networks with max-pools), and
    the refitted corrected recursion is named by what it is on those rows: random routing on
    a CNN, the stored estimator refitted on a run trained against it, exact BGLN moments (to
    its rank-64 covariance) otherwise. Ratios to three decimals, or to three significant
    digits with ``significant`` (for estimates that reach 10⁻³ of the truth).
    """
    rows = [row for result in results for row in result["rows"]]
    fired = any(row.get("bgln_fired_routing") is not None for row in rows)
    if fired:
        refitted = "random routing (corrected)"
    elif all(row["method"].startswith("bgln-d-corrected") for row in rows):
        refitted = "corrected (refitted)"
    else:
        refitted = "exact BGLN moments"
    stages = [("laftr_data", "LAFTR, data"), ("bgln_s_data", "BGLN-S, data"),
              ("bgln_s_gaussian", "BGLN-S, Gaussian")]
    if fired:
        stages += [("bgln_fired_routing", "fired pools (MC)"),
                   ("corrected_fired", "fired pools (corrected)")]
    stages += [("bgln_random_routing", refitted), ("stored", "stored summary")]
    leading: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = []
    if len({row["fsd_scale"] for row in rows}) > 1:
        leading.append(("λ", lambda row: f"{row['fsd_scale']:g}"))
    if len({row["seed"] for row in rows}) > 1 or not leading:
        leading.append(("seed", lambda row: str(row["seed"])))
    header = [name for name, _ in leading] + ["task", "true FSD"] + [name for _, name in stages]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in rows:
        cells = [cell(row) for _, cell in leading] + [str(row["task"]), f"{row['true']:.3g}"]
        cells += [_ratio_cell(None if row.get(key) is None else row[key] / row["true"],
                              significant) for key, _ in stages]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ----- the BGLN-D variants on fidelity pairs (benchmarks/moment_ratios.py) -----------------

#: the fidelity study's estimator names and the variants table's
VARIANT_NAMES = {"BGLN-D": "BGLN-D (Algorithm 2)", "BGLN-D (exact)": "BGLN-D (exact)",
                 "BGLN-D (no gate variance)": "exact, no gate variance",
                 "BGLN-D (no cross-covariance)": "exact, no Cov(a0, Δa)",
                 "BGLN-D (corrected)": "corrected (rank 64)"}
#: benchmark names as the docs write them
BENCHMARK_NAMES = {"split-mnist": "Split MNIST", "permuted-mnist": "Permuted MNIST"}


def moment_ratios(result: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per estimator of an ``fsd fidelity`` pairs result, its ratios over the pairs.

    Against BGLN-D (exact): median and max |estimate / exact − 1|, median estimate / exact;
    against the true FSD: median and min estimate / true.
    """
    pairs = result["pairs"]["pairs"]
    rows = {}
    for name in result["config"]["estimators"]:
        to_exact = [p["estimates"][name] / p["estimates"]["BGLN-D (exact)"] for p in pairs]
        to_true = [p["estimates"][name] / p["true"] for p in pairs]
        rows[name] = {"median_abs_rel_to_exact": statistics.median(abs(r - 1) for r in to_exact),
                      "max_abs_rel_to_exact": max(abs(r - 1) for r in to_exact),
                      "median_est_over_exact": statistics.median(to_exact),
                      "median_est_over_true": statistics.median(to_true),
                      "min_est_over_true": min(to_true)}
    return rows


def _over_exact(value: float) -> str:
    # exact moments' own ratio is 1 by construction; another estimator's is shown to three
    # decimals, so that 1.0006 does not read as that same 1
    return "1" if value == 1 else f"{value:.3f}"


def moment_variants_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The BGLN-D variants against exact moments and the truth, one line per estimator.

    ``results``: ``fsd fidelity`` pairs results (``--studies pairs``) whose estimators
    include BGLN-D (exact), in the table's order. Rank and gradient columns from each
    study's summary, the ratios from its pairs (:func:`moment_ratios`).
    """
    lines = ["| benchmark | estimator | Spearman | Pearson | median est/true | min est/true | "
             "median est/exact | median \\|est/exact − 1\\| | max \\|est/exact − 1\\| | "
             "median grad cos |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        benchmark = BENCHMARK_NAMES.get(result["benchmark"], result["benchmark"])
        for name, ratio in moment_ratios(result).items():
            summary = result["pairs"]["summary"][name]
            lines.append(
                f"| {benchmark} | {VARIANT_NAMES.get(name, name)} | {summary['spearman']:.4f} | "
                f"{summary['pearson']:.4f} | {ratio['median_est_over_true']:.3g} | "
                f"{ratio['min_est_over_true']:.3g} | "
                f"{_over_exact(ratio['median_est_over_exact'])} | "
                f"{ratio['median_abs_rel_to_exact']:.3g} | {ratio['max_abs_rel_to_exact']:.3g} | "
                f"{summary['median_grad_cosine']:.4f} |")
    return "\n".join(lines) + "\n"


# ----- the corrected recursion's penalty cost (benchmarks/corrected_moments.py) ------------

def penalty_timing_header(injection_rank: int) -> str:
    """The header of :func:`penalty_timing_table` (two lines) for injections of that rank."""
    cut = f"injection rank {injection_rank}"
    columns = ["width", "K", "Algorithm 2: ms", "exact: ms", "corrected: ms",
               f"corrected, {cut}: ms", "exact / Alg. 2", "corrected / Alg. 2",
               f"{cut} / Alg. 2", "corrected, one by one / Alg. 2",
               f"{cut}, one by one / Alg. 2", "corrected, autograd / Alg. 2",
               f"{cut}, autograd / Alg. 2", "corrected: max \\|est/exact − 1\\|",
               f"{cut}: max \\|est/exact − 1\\|"]
    return "| " + " | ".join(columns) + " |\n|" + "---:|" * len(columns)


def penalty_timing_row(row: Mapping[str, Any]) -> str:
    """One line of :func:`penalty_timing_table`: a (width, K) row of ``corrected_moments.py``."""
    paper = row["paper_ms"]
    times = [f"{row[f'{m}_ms']:.2f}" for m in ("paper", "exact", "corrected", "injections")]
    ratios = [f"{row[f'{m}_ms'] / paper:.1f}x" for m in (
        "exact", "corrected", "injections", "corrected_one_by_one", "injections_one_by_one",
        "corrected_autograd", "injections_autograd")]
    errors = [f"{row[f'{m}_max_error']:.1e}" for m in ("corrected", "injections")]
    return "| " + " | ".join([str(row["width"]), str(row["K"]), *times, *ratios, *errors]) + " |"


def penalty_timing_table(result: Mapping[str, Any]) -> str:
    """The penalty of Algorithm 2, exact moments and the corrected recursion, per width and K.

    Distance + backward of K stacked summaries, ms and over Algorithm 2's, the corrected
    recursion with the whole covariance and with its injections cut (also one summary at a
    time and differentiated by autograd), and its largest |estimate / exact − 1|.
    """
    lines = [penalty_timing_header(result["injection_rank"])]
    lines += [penalty_timing_row(row) for row in result["rows"]]
    return "\n".join(lines) + "\n"


def injection_rank_runs_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One line per run of ``corrected_moments.py``: each stacked penalty over Algorithm 2's.

    The cut and whole-covariance ratios and Algorithm 2's milliseconds of the run's rows,
    in its order, joined by " / ".
    """
    lines = ["| injection rank | injections cut / Alg. 2 | whole covariance / Alg. 2 | "
             "Algorithm 2: ms |", "|---|---|---|---|"]
    for result in results:
        rows = result["rows"]
        cut = " / ".join(f"{r['injections_ms'] / r['paper_ms']:.1f}" for r in rows)
        whole = " / ".join(f"{r['corrected_ms'] / r['paper_ms']:.1f}" for r in rows)
        paper = " / ".join(f"{r['paper_ms']:.1f}" for r in rows)
        lines.append(f"| {result['injection_rank']} | {cut} | {whole} | {paper} |")
    return "\n".join(lines) + "\n"


# ----- the corrected recursion on CNNs (benchmarks/corrected_conv.py) ----------------------

#: ``corrected_conv.py``'s networks as the docs name them
CNN_NAMES = {"cifar": "CIFAR-100 (60 logits, head of 10)", "fashion": "Fashion-MNIST (10 logits)"}


def corrected_conv_table(result: Mapping[str, Any]) -> str:
    """Cost and value of the deterministic estimators on the two CNNs.

    Per CNN, each estimator's distance + backward (ms, and over Algorithm 2's) and its
    estimate over BGLN-S's Monte-Carlo mean, over the sampled BGLN with random routing and
    over the true FSD; the two Monte-Carlo rows name their standard error, in % of the mean.
    """
    lines = ["| CNN | estimator | distance + backward: ms | / Algorithm 2 | estimate / BGLN-S "
             "mean | estimate / sampled BGLN with random routing | estimate / true FSD |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        network = CNN_NAMES.get(row["cnn"], row["cnn"])
        if "ms" in row:
            name, ms, ratio = row["estimator"], f"{row['ms']:.0f}", f"{row['ratio']:.2f}x"
        else:  # a Monte-Carlo mean, not timed
            error = 100 * row["standard_error"] / row["estimate"]
            name, ms, ratio = f"{row['estimator']} (Monte Carlo, ± {error:.1f} %)", "–", "–"
        lines.append(f"| {network} | {name} | {ms} | {ratio} | "
                     f"{row['estimate_over_bgln_s']:.3f} | "
                     f"{row['estimate_over_sampled_routing']:.3f} | "
                     f"{row['estimate_over_true']:.3f} |")
    return "\n".join(lines) + "\n"


# ----- mixture components by gate pattern (benchmarks/gate_clusters.py) --------------------

def _clusters_name(clusters: int | str) -> str:
    return "one per class" if clusters == "classes" else f"M = {clusters}"


def gate_clusters_table(result: Mapping[str, Any]) -> str:
    """BGLN-S on the inputs / the corrected recursion, over the true FSD, per mixture size.

    One line per (run, seed, task) of ``gate_clusters.py``'s rows, named by the method trained
    against, the seed and the task after which it is read, one column per number of
    clusters in the order first measured ("–" where a line lacks it), after the true FSD
    and LAFTR on the inputs over it; three significant digits.
    """
    rows = result["rows"]
    sizes = list(dict.fromkeys(row["clusters"] for row in rows))
    lines_of: dict[tuple[str, int, int], dict[int | str, Mapping[str, Any]]] = {}
    for row in rows:
        lines_of.setdefault((row["run"], row["seed"], row["task"]), {})[row["clusters"]] = row
    header = ["network", "task", "true FSD", "LAFTR on the inputs",
              *(_clusters_name(s) for s in sizes)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for (_run, seed, task), by_size in lines_of.items():
        first = next(iter(by_size.values()))
        true = first["true"]
        # the file names the run's folder, not its benchmark: the tasks it trained tell them apart
        cells = [f"`{first['method']}`, seed {seed}, read after task {first['after_task']}",
                 str(task), f"{true:.3g}",
                 f"{first['laftr_data'] / true:.3g}"]
        cells += [f"{by_size[s]['bgln_s_data'] / true:.3g} / {by_size[s]['corrected'] / true:.3g}"
                  if s in by_size else "–" for s in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ----- the injections' rank over ten tasks (fsd cl gap of row folders) ---------------------

#: the most an old task's true FSD may exceed exact moments' before it counts as let go
HOLD_FACTOR = 1.5


def _spans(numbers: Sequence[int]) -> str:
    """``[4, 5, 6, 9]`` -> ``"4–6, 9"``."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _injections(results: Mapping[str, Any]) -> str:
    if PRESETS[results["method"]].options.get("moments") != "corrected":
        return "none (exact moments)"  # a rerun of the reference itself
    rank = results["hyperparameters"].get("injection_rank")
    if rank is None:  # the preset's (bgln-d-corrected-cut: 8) or the whole covariance
        rank = PRESETS[results["method"]].options.get("injection_rank")
    return "whole covariance" if rank is None else f"rank {rank}"


def _two_digits(value: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a collapsed estimate's 0.0013)."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def injections_against_exact_table(folders: Sequence[Path]) -> str:
    """Corrected-recursion rows against exact moments over the same seeds and tasks.

    ``folders``: ``results/cl`` row folders holding ``results.json`` and ``gap.md`` (what
    ``fsd cl gap`` printed); the first is exact moments' row, each other a line: its
    injections (the whole covariance or a rank), average accuracy and BWT, each old task's
    true FSD over exact moments' on the same seed and task after the last task (the spread,
    and how many pairs exceed :data:`HOLD_FACTOR`), and the spread of its estimate over its
    true FSD. The true FSDs are ``gap.md``'s three significant digits.

    Raises:
        ValueError: a folder without ``gap.md`` or ``results.json``, or a (seed, task) that
            exact moments' row does not have.
    """
    if len(folders) < 2:
        raise ValueError("give exact moments' row folder, then the rows to compare with it")
    found = [read_gap_folders([str(folder)])[0] for folder in folders]
    for folder, (_, _, results, _) in zip(folders, found, strict=True):
        if not results:
            raise ValueError(f"{folder} has no results.json")
    exact = {(r["seed"], r["task"]): r["true_fsd"] for r in found[0][3]}
    most = max(len(rows) for *_, rows in found[1:])
    lines = ["| row | injections | avg acc (%) | BWT | old tasks' true FSD / exact moments' "
             f"({most} pairs) | pairs above {HOLD_FACTOR:g}× | estimate / true FSD |",
             "|---|---|---:|---:|---|---:|---|"]
    for folder, (_, row, results, rows) in zip(folders[1:], found[1:], strict=True):
        missing = [(r["seed"], r["task"]) for r in rows if (r["seed"], r["task"]) not in exact]
        if missing:
            raise ValueError(f"{folder}: exact moments' row has no seed and task {missing[0]}")
        factors = [r["true_fsd"] / exact[r["seed"], r["task"]] for r in rows]
        above = [r["task"] for r, f in zip(rows, factors, strict=True) if f > HOLD_FACTOR]
        count = f"{len(above)}" if len(rows) == most else f"{len(above)} of {len(rows)}"
        if above:
            count += f" (task{'s' if len(set(above)) > 1 else ''} {_spans(above)})"
        seeds = results["avg_accuracy"]["per_seed"]
        injections = _injections(results)
        if len(seeds) == 1:
            injections += f" (seed {results['seeds'][0]})"
        bwt = f"{results['backward_transfer']['mean']:.2f}".replace("-", "−")
        ratios = [r["ratio"] for r in rows]
        lines.append(f"| {row} | {injections} | {per_seed_cell(results['avg_accuracy'])} | {bwt} | "
                     f"{min(factors):.2f}–{max(factors):.2f}× | {count} | "
                     f"{_two_digits(min(ratios))}–{_two_digits(max(ratios))} |")
    return "\n".join(lines) + "\n"


# ----- the estimators' defaults (benchmarks/defaults.py) -----------------------------------

def _study_table(result: Mapping[str, Any], letter: str) -> list[list[str]]:
    for table in result["tables"]:
        if table["heading"].startswith(f"({letter})"):
            return table["rows"]
    raise ValueError(f"no table ({letter}) in the defaults study")


def _percent(cell: str, digits: int | None = None) -> str:
    """``"7.91%"`` -> ``"7.9 %"`` (``digits`` 1) or ``"7.91 %"`` (as printed)."""
    number = cell.removesuffix("%")
    return f"{float(number):.{digits}f} %" if digits is not None else f"{number} %"


def defaults_summary_table(result: Mapping[str, Any]) -> str:
    """Each estimator default against its most accurate setting, from ``defaults.py``'s tables.

    Bytes, milliseconds per call and error from table (a), the rank-32 covariance's largest
    difference from table (d), BGLN-S's sampling error (relative standard deviation at 128
    samples) from table (b).
    """
    a = {(row[0], row[1]): row for row in _study_table(result, "a")}
    spread = {row[0]: row[1] for row in _study_table(result, "b")}
    rank = {row[0]: row[1] for row in _study_table(result, "d")}
    lines = ["| default | most accurate setting | bytes: most accurate → default | "
             "ms / call: most accurate → default | error of the default |",
             "|---|---|---:|---:|---:|"]
    for estimator, call in (("LAFTR (coreset)", "LAFTR()"), ("NTK", "NTK()")):
        full, kept = a[estimator, "all data"], a[estimator, "coreset 40"]
        lines.append(f"| `{call}`: a coreset of 40 inputs | all the data | {full[2]} → "
                     f"{kept[2]} | {full[3]} → {kept[3]} | {_percent(kept[5], 1)} |")
    paper = (a["BGLN-D (paper)", "full covariance"], a["BGLN-D (paper)", "low rank 32"])
    exact = (a["BGLN-D (exact moments)", "full covariance"],
             a["BGLN-D (exact moments)", "low rank 32"])
    lines.append(f"| `BGLN()`: `covariance=\"lowrank\"`, rank 32 | `\"full\"` | {paper[0][2]} → "
                 f"{paper[1][2]} | BGLN-D {paper[0][3]} → {paper[1][3]} (Alg. 2), "
                 f"{exact[0][3]} → {exact[1][3]} (exact) | ≤ {_percent(rank['paper'])} "
                 f"(Alg. 2), ≤ {_percent(rank['exact'])} (exact) |")
    ewc = a["EWC", "euclidean"]
    lines.append(f"| `EWC()`: `metric=\"euclidean\"` | – (`\"kl\"` is another metric) | "
                 f"{ewc[2]} | {ewc[3]} | – |")
    sampled = a["BGLN-S", "S = 128"]
    lines.append(f"| `BGLN()`: `num_samples=128` | exact moments (its expectation) | – | "
                 f"{sampled[3]} (full covariance) | "
                 f"{100 * float(spread['128']):.0f} % sampling error |")
    return "\n".join(lines) + "\n"


# ----- the memory budget (fsd memory) -----------------------------------------------------

#: the training images ExactFSD keeps in the memory budget: MNIST's
MNIST_TRAINING_IMAGES = 60_000


def memory_budget_table(result: Mapping[str, Any]) -> str:
    """Numbers stored per summary and their megabytes at float32, from ``fsd memory``'s counts.

    ``result``: ``memory_<arch>.json``. ExactFSD keeps :data:`MNIST_TRAINING_IMAGES` inputs
    and their C logits.
    """
    costs, arch = result["costs"], result["architecture"]

    def megabytes(key: str) -> str:
        return f"{costs[key] * 4 / 1e6:.2f} MB"

    exact = MNIST_TRAINING_IMAGES * (arch["d"] + result["C"]) * 4 / 1e6
    rows = [("EWC", "2P", megabytes("EWC")),
            ("LAFTR / NTK coreset", "P + Nd",
             f"{megabytes('LAFTR (coreset)')} (N = {result['N']})"),
            ("BGLN, full covariance", "P + A + d + d²", megabytes("BGLN-S / BGLN-D")),
            ("BGLN, `covariance=\"lowrank\", rank=r` (the default, r = 32)", "P + A + d(r + 2)",
             "–"),
            ("BGLN, `covariance=\"diag\"` (paper's \"Var\")", "P + A + 2d",
             megabytes("BGLN-S-Var / BGLN-D-Var")),
            ("BGLN, `classwise=True`", "P + C(A + d + d²)", megabytes("BGLN-S-CW / BGLN-D-CW")),
            ("ExactFSD", "all inputs",
             f"{exact:.0f} MB ({MNIST_TRAINING_IMAGES:,} images and their logits)")]
    lines = ["| summary | numbers | MNIST MLP 784-100-100-10 |", "|---|---|---:|"]
    lines += [f"| {name} | {formula} | {size} |" for name, formula, size in rows]
    return "\n".join(lines) + "\n"


# ----- the registry -------------------------------------------------------------------------

def _on_json(table: Callable[[list[Any]], str]) -> Renderer:
    """A renderer that loads each path as JSON and passes the list to ``table``."""
    def renderer(paths: Sequence[Path]) -> str:
        return table([read_json(path) for path in paths])
    renderer.__doc__ = table.__doc__
    return renderer


def _one(table: Callable[[Any], str]) -> Callable[[list[Any]], str]:
    """``table`` of one loaded file, refusing more."""
    def of_one(results: list[Any]) -> str:
        if len(results) != 1:
            raise ValueError(f"this table is rendered from one file, not {len(results)}")
        return table(results[0])
    return of_one


#: every renderer a ``<!-- rendered from PATHS by NAME: begin -->`` block may name
RENDERERS: dict[str, Renderer] = {
    "gap-chain": _on_json(gap_chain_table),
    "gap-chain-significant": _on_json(lambda results: gap_chain_table(results, significant=True)),
    "moment-variants": _on_json(moment_variants_table),
    "penalty-timing": _on_json(_one(penalty_timing_table)),
    "injection-rank-runs": _on_json(injection_rank_runs_table),
    "corrected-conv": _on_json(_one(corrected_conv_table)),
    "gate-clusters": _on_json(_one(gate_clusters_table)),
    "injections-against-exact": injections_against_exact_table,
    "defaults-summary": _on_json(_one(defaults_summary_table)),
    "memory-budget": _on_json(_one(memory_budget_table)),
}


def render_table(name: str, paths: Sequence[Path]) -> str:
    """The table renderer ``name`` makes of ``paths``.

    Raises:
        ValueError: no renderer of that name, or files it cannot read (one line naming them).
    """
    if name not in RENDERERS:
        raise ValueError(f"no renderer named {name!r} (known: {', '.join(sorted(RENDERERS))})")
    try:
        return RENDERERS[name](paths)
    except (KeyError, TypeError, IndexError, AttributeError, ZeroDivisionError) as error:
        named = ", ".join(str(p) for p in paths)
        raise ValueError(f"renderer {name} cannot read {named}: {type(error).__name__} "
                         f"{error}") from None
