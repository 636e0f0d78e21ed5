"""Reading what older versions wrote: results files and checkpoints from before a setting.

The drivers read and write only the current layout; every allowance for an older file is
here, with what the older version meant.

``fsd cl``:
    results.json files without ``schema_version`` (version 1) may lack ``complete``,
    ``seeds_requested`` and ``device``, and settings added since: ``optimizer`` (before it,
    a fresh Adam per task), ``penalty`` (the plain sum), ``penalty_outputs`` (each summary
    covered its task's head, which on a single-head benchmark is every logit), ``model``
    (the MLP) and other settings whose default is ``None`` (``first_epochs``: every task
    trained ``epochs``; ``validation``: accuracies on the test sets; ``injection_rank``: the
    method's own), and ``statistics`` (recorded in the last epoch). Checkpoints from before
    these settings resume under the same rules; checkpoints before version 3 carry no
    sha256 of their contents and resume unchecked (version 1 had no ``version`` at all).
    Run folders written before output folders were marked (``.fsd-output``) are recognised
    as fsd's by their layout and adopted (``fsd_experiments.continual.runner``'s
    ``_earlier_run_folder``): fsd cl's files and nothing else, with a results.json of fsd cl
    or a ``checkpoints/seed<S>`` folder; tunings' folders likewise by theirs. The output
    folders of ``fsd fidelity``, ``toy``, ``memory``, ``compare-estimators`` and ``influence
    uci`` / ``mislabeled`` are adopted the same way when they hold that command's result
    files and nothing else (``fsd_experiments.io.earlier_output``, ``owned_files``).

``fsd influence``:
    mislabeled results written before the pool's corrupted mask was saved rebuild it from
    a detection curve, and read as run on the CPU with no non-finite score where they do
    not say; UCI results from before the bootstrap intervals get them computed from their
    scores, and older PBRF settings (moments, clusters, EWC Fisher, point term) read as the
    defaults those runs used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from .presets import default_hyperparameters
from .stats import bootstrap_intervals

#: the version of ``fsd cl``'s results.json layout written now (files without one: 1)
CL_RESULTS_SCHEMA = 2

# cl settings that older results files lack, and what those runs did
_CL_LEGACY_SETTINGS: dict[str, Any] = {"optimizer": "per-task", "penalty": "sum",
                                        "model": "mlp", "statistics": "last-epoch"}


def legacy_penalty_outputs(benchmark: str, method: str) -> str:
    """``penalty_outputs`` of a run made before the setting existed: the task's head."""
    return ("head" if benchmark.startswith("split")
            else default_hyperparameters(benchmark, method)["penalty_outputs"])


def cl_checkpoint_settings(saved: str, benchmark: str, method: str) -> dict[str, Any]:
    """The settings stored in an ``fsd cl`` checkpoint (JSON text), in today's terms.

    A checkpoint written before ``penalty_outputs`` covered each task's head; one written
    before ``model`` and ``first_epochs`` trained the MLP, every task for ``epochs``; one
    written before ``validation`` scored the test sets.
    """
    return {"penalty_outputs": legacy_penalty_outputs(benchmark, method), "model": "mlp",
            "first_epochs": None, "validation": None, "injection_rank": None,
            "statistics": "last-epoch", **json.loads(saved)}


def cl_checkpoint_has_checksum(state: Mapping[str, Any]) -> bool:
    """Whether an ``fsd cl`` checkpoint carries a sha256 of its contents (version 3 on)."""
    return int(state.get("version", 1)) >= 3


def cl_hyperparameters(raw: Mapping[str, Any], benchmark: str, method: str) -> dict[str, Any]:
    """A results file's ``hyperparameters`` with every current setting present.

    Settings the file lacks take what the run that wrote it did: a fresh Adam per task, the
    plain sum of the distances, each summary on its task's head, ``None`` for the others
    (``validation``: the test sets).
    The keys come in today's order; none but today's are kept.
    """
    current = default_hyperparameters(benchmark, method)
    legacy = {**_CL_LEGACY_SETTINGS,
              "penalty_outputs": legacy_penalty_outputs(benchmark, method)}
    return {key: raw[key] if key in raw else legacy.get(key) for key in current}


def cl_results(raw: Mapping[str, Any]) -> dict[str, Any]:
    """An ``fsd cl`` results.json dictionary in the current layout (see the module docstring)."""
    results = dict(raw)
    results.setdefault("complete", True)
    results.setdefault("seeds_requested", list(results["seeds"]))
    results.setdefault("device", "cpu")
    results.setdefault("torch_threads", None)
    results.setdefault("summary_bytes_per_task", 0.0)
    results["hyperparameters"] = cl_hyperparameters(
        results["hyperparameters"], results["benchmark"], results["method"])
    results.setdefault("schema_version", 1)
    results.setdefault("fsd_version", None)
    results.setdefault("torch_version", None)
    results.setdefault("cpu", None)
    return results


def is_cl_results(raw: Mapping[str, Any]) -> bool:
    """Whether a results.json was written by ``fsd cl`` (other commands write one too)."""
    return {"benchmark", "method", "accuracy_matrix"} <= set(raw)


# PBRF settings that older UCI results lack, and what those runs used
_UCI_PBRF_LEGACY: dict[str, Any] = {"bgln_moments": "paper", "bgln_clusters": None,
                                    "ewc_fisher": "true", "point_term": False}


def uci_result(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A UCI result with every PBRF setting present (older files: what those runs used)."""
    return {**raw, "pbrf": {**_UCI_PBRF_LEGACY, **raw["pbrf"]}}


def mislabeled_result(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A mislabeled result with ``device`` and ``nonfinite`` (older files: CPU, none)."""
    return {"device": "cpu", "nonfinite": {}, **raw}


def pool_corrupted(result: Mapping[str, Any]) -> np.ndarray:
    """The pool's corrupted mask of a mislabeled result (rebuilt from a curve in old files).

    Results written before the mask was saved still hold each method's scores and its
    detection curve; the curve rises exactly where the point checked next is corrupted.
    """
    if "is_corrupted" in result["pool"]:
        return np.asarray(result["pool"]["is_corrupted"], dtype=float)
    method = next(m for m, v in result["scores"].items()
                  if v is not None and np.isfinite(np.asarray(v, dtype=float)).all())
    scores = np.asarray(result["scores"][method], dtype=float)
    steps = np.diff(np.asarray(result["curves"][method], dtype=float)) > 0
    mask = np.zeros(scores.shape[0])
    mask[np.argsort(-scores, kind="stable")[steps]] = 1.0
    return mask


def uci_bootstrap(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """A UCI result's bootstrap intervals (computed from its scores for runs that predate them)."""
    if "bootstrap" in result:
        return result["bootstrap"]
    if "exact" not in result["scores"] or len(result["scores"]) < 2:
        return None
    others = {m: v for m, v in result["scores"].items() if m != "exact"}
    return bootstrap_intervals(others, result["scores"]["exact"], seed=result.get("seed", 0))
