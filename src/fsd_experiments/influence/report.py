"""Tables over several influence runs, read back from their results.json files.

``fsd influence report RUN...`` prints one table per study kind: a UCI run folder (what
``fsd influence uci --out RUN`` wrote: ``RUN/<data set>/results.json``) gives one row per data
set, a mislabeled run folder (``RUN/results.json``) one row. The docs' influence tables are
these tables, regenerated from the committed ``results/influence`` by
:mod:`fsd_experiments.doc_tables`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from ..compat import mislabeled_result, uci_bootstrap, uci_result
from ..data import UCI_DATASETS
from ..io import read_json
from .common import METHOD_TITLES

#: the estimators a UCI row compares with the exact PBRF, in column order
_UCI_COMPARED = ("ewc", "cg", "bgln-d")
#: the methods of a mislabeled row, in column order
_MISLABELED_SHOWN = ("random", "bgln-d", "ewc", "cg", "exact")


def read_run(path: str | Path) -> tuple[str, str, list[dict[str, Any]]]:
    """(kind, name, results) of one run folder; kind is ``"uci"`` or ``"mislabeled"``.

    A UCI run's results come in the order of :data:`~fsd_experiments.data.UCI_DATASETS`.
    A results.json that is not JSON, or lacks what its table shows, raises ValueError
    naming the file.
    """
    folder = Path(path)
    own = folder / "results.json"
    if own.is_file():
        raw = _load(own)
        if raw.get("experiment") == "mislabeled":
            return "mislabeled", folder.name, [_checked(own, folder.name, raw, "mislabeled")]
    found = [_checked(p, folder.name, _load(p), "uci")
             for p in (folder / name / "results.json" for name in UCI_DATASETS) if p.is_file()]
    if not found:
        raise ValueError(f"{folder} holds no influence results (neither results.json of "
                         "fsd influence mislabeled nor <data set>/results.json of "
                         "fsd influence uci)")
    return "uci", folder.name, found


def _load(path: Path) -> dict[str, Any]:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a results.json of fsd influence (not an object)")
    return raw


def _checked(path: Path, name: str, raw: dict[str, Any], kind: str) -> dict[str, Any]:
    """The normalised result of ``path``, once its own row renders.

    A file missing a key so fails here, naming itself, not deep inside a table of many runs.
    """
    try:
        if kind == "mislabeled":
            result = mislabeled_result(raw)
            mislabeled_report_table([(name, [result])])
        else:
            result = uci_result(raw)
            uci_report_table([(name, [result])])
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(f"{path} is not a results.json of fsd influence {kind} "
                         f"({type(error).__name__}: {error})") from None
    return result


def _number(value: float | None, digits: int = 3) -> str:
    return "nan" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _difference(point: float, interval: Sequence[float]) -> str:
    return f"{point:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]"


def _bgln_form(pbrf: dict[str, Any]) -> str:
    clusters = pbrf.get("bgln_clusters")
    form = f"{clusters} clusters" if clusters else "1 Gaussian"
    return form + (", exact moments" if pbrf.get("bgln_moments") == "exact" else "")


def uci_report_table(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> str:
    """One row per (run, data set): each estimator's correlation with the exact PBRF.

    Columns: the run folder, the data set, N, removals, the PBRF's SGD rate and steps; the
    point term, BGLN-D's form (one Gaussian or k-means clusters, Algorithm 2 or exact
    moments) and EWC's Fisher (``--ewc-fisher``) when they differ between rows; Pearson (P,
    with its bootstrap interval) and Spearman (S) of every estimator any row has; the paired
    bootstrap difference BGLN-D − EWC with its interval; the exact PBRF against a second run
    of itself (``--oracle-repeat``); solves that diverged; wall seconds of each method over
    all removals.
    """
    rows = [(name, r) for name, results in runs for r in results]
    if not rows:
        raise ValueError("no UCI results to tabulate")
    methods = [m for m in _UCI_COMPARED if any(m in r["correlation"] for _, r in rows)]
    timed = [m for m in ("exact", *_UCI_COMPARED) if any(m in r["seconds"] for _, r in rows)]
    varies = {key: len({str(r["pbrf"].get(key)) for _, r in rows}) > 1
              for key in ("point_term", "bgln_clusters", "bgln_moments", "ewc_fisher")}
    show_point_term = varies["point_term"]
    show_form = "bgln-d" in methods and (varies["bgln_clusters"] or varies["bgln_moments"])
    show_fisher = "ewc" in methods and varies["ewc_fisher"]
    show_difference = any("bgln-d" in r["correlation"] and "ewc" in r["correlation"]
                          for _, r in rows)
    show_repeat = any("oracle_repeat" in r for _, r in rows)
    show_diverged = any(any(r.get("nonfinite", {}).values()) for _, r in rows)
    head = ["run", "data set", "N", "removals", "PBRF lr", "steps"]
    align = ["---", "---", "---:", "---:", "---:", "---:"]
    if show_point_term:
        head.append("point term")
        align.append("---")
    if show_form:
        head.append("BGLN-D")
        align.append("---")
    if show_fisher:
        head.append("EWC Fisher")
        align.append("---")
    for m in methods:
        head += [f"{METHOD_TITLES[m]} P", f"{METHOD_TITLES[m]} S"]
        align += ["---:", "---:"]
    if show_difference:
        head += ["BGLN-D − EWC, P", "BGLN-D − EWC, S"]
        align += ["---", "---"]
    if show_repeat:
        head += ["exact vs itself P", "exact vs itself S"]
        align += ["---:", "---:"]
    if show_diverged:
        head.append("diverged solves")
        align.append("---")
    head.append("seconds: " + " / ".join(METHOD_TITLES[m] for m in timed))
    align.append("---")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for name, r in rows:
        pbrf = r["pbrf"]
        cells = [name, r["dataset"], str(r["n_train"]), str(len(r["removed_indices"])),
                 f"{pbrf['lr']:g}", str(pbrf["steps"])]
        if show_point_term:
            cells.append("yes" if pbrf.get("point_term") else "no")
        if show_form:
            cells.append(_bgln_form(pbrf) if "bgln-d" in r["scores"] else "–")
        if show_fisher:
            cells.append(pbrf["ewc_fisher"] if "ewc" in r["scores"] else "–")
        boot = uci_bootstrap(r)
        for m in methods:
            c = r["correlation"].get(m)
            if not c:
                cells += ["–", "–"]
                continue
            interval = (boot or {}).get("pearson", {}).get(m)
            cells += [_number(c["pearson"]) + (f" [{interval[0]:.2f}, {interval[1]:.2f}]"
                                               if interval else ""), _number(c["spearman"])]
        if show_difference:
            d = (boot or {}).get("difference", {}).get("bgln-d")
            if d and "ewc" in r["correlation"]:
                cells += [_difference(r["correlation"]["bgln-d"][k]
                                      - r["correlation"]["ewc"][k], d[k])
                          for k in ("pearson", "spearman")]
            else:
                cells += ["–", "–"]
        if show_repeat:
            c = r.get("oracle_repeat", {}).get("correlation")
            cells += [_number(c["pearson"]), _number(c["spearman"])] if c else ["–", "–"]
        if show_diverged:
            bad = [f"{METHOD_TITLES[m]} {n}" for m, n in r.get("nonfinite", {}).items() if n]
            cells.append(", ".join(bad) or "–")
        cells.append(" / ".join(f"{r['seconds'][m]:.0f}" if m in r["seconds"] else "–"
                                for m in timed))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mislabeled_report_table(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> str:
    """One row per mislabeled run: each method's detection AUC with its bootstrap interval.

    Columns: the run folder, the seed, the network, the pool (its corrupted points), every
    method's AUC and 95 % interval, the paired interval of BGLN-D − EWC, wall seconds.
    """
    rows = [(name, r) for name, results in runs for r in results]
    if not rows:
        raise ValueError("no mislabeled results to tabulate")
    methods = [m for m in _MISLABELED_SHOWN if any(m in r["auc"] for _, r in rows)]
    level = next((r["bootstrap"]["level"] for _, r in rows if "bootstrap" in r), 0.95)
    head = ["run", "seed", "network", "pool (corrupted)",
            *(METHOD_TITLES[m] for m in methods), f"BGLN-D − EWC ({level:.0%})",
            "seconds: " + " / ".join(METHOD_TITLES[m] for m in methods)]
    lines = ["| " + " | ".join(head) + " |",
             "|---|---:|---|---|" + "---:|" * len(methods) + "---:|---|"]
    for name, r in rows:
        boot = r.get("bootstrap", {"auc": {}, "difference": {}})
        cells = [name, str(r["seed"]), f"{r['model']}, {r['device']}",
                 f"{r['pool']['size']} ({r['pool']['corrupted']})"]
        for m in methods:
            if m not in r["auc"]:
                cells.append("–")
                continue
            interval = boot["auc"].get(m)
            cells.append(f"{r['auc'][m]:.3f}"
                         + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""))
        d = boot["difference"].get("bgln-d", {}).get("auc")
        cells.append(f"[{d[0]:+.3f}, {d[1]:+.3f}]" if d else "–")
        cells.append(" / ".join(f"{r['seconds'][m]:.0f}" if m in r["seconds"] else "–"
                                for m in methods))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_tables(paths: Sequence[str | Path]) -> str:
    """The tables of ``fsd influence report PATHS``: the UCI table, then the mislabeled one.

    Each is present when some folder is of its kind; they are separated by an empty line.
    """
    runs: dict[str, list[tuple[str, list[dict[str, Any]]]]] = {"uci": [], "mislabeled": []}
    for path in paths:
        kind, name, results = read_run(path)
        runs[kind].append((name, results))
    if not any(runs.values()):
        raise ValueError("no run folders given")
    tables = []
    if runs["uci"]:
        tables.append(uci_report_table(runs["uci"]))
    if runs["mislabeled"]:
        tables.append(mislabeled_report_table(runs["mislabeled"]))
    return "\n\n".join(tables)
