"""Statistics the studies share: correlations, paired bootstraps, detection AUCs, k-means.

The influence studies correlate each method's scores with an oracle's and bootstrap the
scored points; the fidelity study bootstraps Spearman differences over network pairs. Both
resample rows with :func:`resample_rows` and compute a correlation for every resample at once
(:func:`rowwise_pearson`, :func:`rowwise_spearman`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike
from scipy import stats as scipy_stats
from torch import Tensor


def kmeans_labels(x: Tensor, k: int, *, iters: int = 100, seed: int = 0) -> Tensor:
    """Cluster the rows of ``x`` (n, ...) into ``k`` groups (k-means++ start, Lloyd steps).

    For unlabelled data (e.g. regression inputs), the labels make a k-component mixture
    summary: pass ``(x, labels)`` batches to ``fit`` with ``classwise=True``. Returns int64
    labels (n,) in 0..k−1; deterministic for a given ``seed``.
    """
    flat = x.reshape(x.shape[0], -1).to(torch.float64)
    n = flat.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in 1..{n} (the number of rows), got {k}")
    g = torch.Generator().manual_seed(seed)
    centers = flat[torch.randint(n, (1,), generator=g)]
    for _ in range(1, k):  # k-means++: next center drawn ∝ squared distance to the nearest
        d2 = torch.cdist(flat, centers).pow(2).min(dim=1).values
        pick = torch.multinomial(d2, 1, generator=g) if d2.sum() > 0 else \
            torch.randint(n, (1,), generator=g)
        centers = torch.cat([centers, flat[pick]])
    labels = torch.cdist(flat, centers).argmin(dim=1)
    for _ in range(iters):
        for j in range(k):
            members = labels == j
            if members.any():  # an emptied cluster keeps its old center
                centers[j] = flat[members].mean(dim=0)
        new = torch.cdist(flat, centers).argmin(dim=1)
        if torch.equal(new, labels):
            break
        labels = new
    return labels


def statistic(result: Any) -> float:
    """The statistic of a ``scipy.stats`` test result (its first field), as a float."""
    return float(result[0])


def correlations(scores: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Pearson and Spearman correlation of ``scores`` with ``reference`` (scipy.stats)."""
    return {"pearson": statistic(scipy_stats.pearsonr(scores, reference)),
            "spearman": statistic(scipy_stats.spearmanr(scores, reference))}


def rowwise_pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of every row of ``a`` (draws, n) with the same row of ``b``."""
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (a * b).sum(axis=1) / np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))


def resample_rows(n: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, n) indices of ``n`` points drawn with replacement (``numpy`` generator)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _resampling(n: int, resamples: int, level: float, seed: int
               ) -> tuple[np.ndarray, Callable[[np.ndarray], list[float]]]:
    # the bootstraps' shared part: (resamples, n) row indices drawn with replacement, and the
    # two-sided percentile interval of a vector of resampled statistics
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be positive, got {resamples}")
    tails = [100 * (1 - level) / 2, 100 * (1 + level) / 2]

    def interval(x: np.ndarray) -> list[float]:
        return [float(v) for v in np.nanpercentile(x, tails)]

    return resample_rows(n, resamples, seed), interval


def bootstrap_intervals(scores: Mapping[str, ArrayLike], reference: ArrayLike, *,
                        baseline: str | None = "ewc", resamples: int = 2000,
                        level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Percentile-bootstrap intervals of each method's correlation with the reference.

    The scored points are resampled with replacement (the same resamples for every method,
    so differences are paired). With 50 scored points a Pearson of 0.90 can have an interval
    0.2 wide; this says which gaps between methods the data resolve.

    Args:
        scores: method name → scores of the same points as ``reference``. Methods with a
            non-finite score are left out (their correlation is undefined).
        reference: the oracle's scores.
        baseline: also give the paired difference (method − baseline) of Pearson and
            Spearman for every other method, if the baseline is among ``scores``.
        resamples: bootstrap resamples.
        level: coverage of the two-sided percentile intervals.
        seed: seeds the resamples.

    Returns:
        ``{"resamples", "level", "pearson": {m: [lo, hi]}, "spearman": {m: [lo, hi]},
        "difference": {m: {"baseline", "pearson": [lo, hi], "spearman": [lo, hi]}}}``.
    """
    reference = np.asarray(reference, dtype=float)
    n = reference.shape[0]
    if n < 3 or not np.isfinite(reference).all():
        raise ValueError("the reference needs at least 3 finite scores")
    rows, interval = _resampling(n, resamples, level, seed)
    ref = reference[rows]
    ref_ranks = scipy_stats.rankdata(ref, axis=1)
    draws: dict[str, dict[str, np.ndarray]] = {}
    for method, values in scores.items():
        values = np.asarray(values, dtype=float)
        if values.shape != reference.shape:
            raise ValueError(f"{method}: {values.shape[0]} scores for {n} reference scores")
        if not np.isfinite(values).all():
            continue
        sample = values[rows]
        draws[method] = {
            "pearson": rowwise_pearson(sample, ref),
            "spearman": rowwise_pearson(scipy_stats.rankdata(sample, axis=1), ref_ranks)}

    out: dict[str, Any] = {"resamples": resamples, "level": level, "pearson": {},
                           "spearman": {}, "difference": {}}
    for method, d in draws.items():
        for kind in ("pearson", "spearman"):
            out[kind][method] = interval(d[kind])
        if baseline in draws and method != baseline:
            out["difference"][method] = {"baseline": baseline, **{
                kind: interval(d[kind] - draws[baseline][kind])
                for kind in ("pearson", "spearman")}}
    return out


def detection_curve(scores: np.ndarray, corrupted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fraction of corrupted points found vs fraction checked, checking by descending score."""
    order = np.argsort(-scores, kind="stable")
    found = np.concatenate([[0.0], np.cumsum(corrupted[order])]) / max(1, corrupted.sum())
    checked = np.arange(len(scores) + 1) / len(scores)
    return checked, found


def area_under(x: np.ndarray, y: np.ndarray) -> float:
    """Trapezoidal area under a curve sampled at increasing ``x``."""
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2))


def detection_aucs(scores: np.ndarray, corrupted: np.ndarray) -> np.ndarray:
    """Row-wise area under the detection curve (:func:`detection_curve`, :func:`area_under`).

    A corrupted point checked r-th (1-based) of n adds (n − r + ½) / (n m) to the
    trapezoidal area, m the number of corrupted points.
    """
    n = scores.shape[-1]
    order = np.argsort(-scores, axis=-1, kind="stable")
    hits = np.take_along_axis(corrupted, order, axis=-1).astype(float)
    weights = (n - np.arange(1, n + 1) + 0.5) / n
    with np.errstate(invalid="ignore", divide="ignore"):
        return (hits * weights).sum(-1) / hits.sum(-1)


def detection_intervals(scores: Mapping[str, ArrayLike], corrupted: ArrayLike, *,
                        baseline: str | None = "ewc", resamples: int = 2000,
                        level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Percentile-bootstrap intervals of each method's detection AUC over the scored pool.

    The pool is resampled with replacement, the same resamples for every method, so the
    differences to ``baseline`` are paired: they say whether a gap between two curves is
    more than the pool's own sampling noise.

    Args:
        scores: method name → self-influence scores of the pool (methods with a non-finite
            score are left out).
        corrupted: 1 where the pool point's label was corrupted, else 0.
        baseline: also give the paired difference (method − baseline) for every other method.
        resamples: bootstrap resamples.
        level: coverage of the two-sided percentile intervals.
        seed: seeds the resamples.

    Returns:
        ``{"resamples", "level", "auc": {m: [lo, hi]},
        "difference": {m: {"baseline", "auc": [lo, hi]}}}``.
    """
    corrupted = np.asarray(corrupted, dtype=float)
    n = corrupted.shape[0]
    if not 0 < corrupted.sum() < n:
        raise ValueError("the pool needs both corrupted and clean points")
    rows, interval = _resampling(n, resamples, level, seed)
    hits = corrupted[rows]
    draws: dict[str, np.ndarray] = {}
    for method, values in scores.items():
        values = np.asarray(values, dtype=float)
        if values.shape != corrupted.shape:
            raise ValueError(f"{method}: {values.shape[0]} scores for a pool of {n}")
        if np.isfinite(values).all():
            draws[method] = detection_aucs(values[rows], hits)

    out: dict[str, Any] = {"resamples": resamples, "level": level, "auc": {}, "difference": {}}
    for method, d in draws.items():
        out["auc"][method] = interval(d)
        if baseline in draws and method != baseline:
            out["difference"][method] = {"baseline": baseline,
                                         "auc": interval(d - draws[baseline])}
    return out


def rowwise_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of every row of ``a`` (draws, n) with the same row of ``b``.

    Spearman is the Pearson correlation of the (average-tie) ranks.
    """
    return rowwise_pearson(scipy_stats.rankdata(a, axis=1), scipy_stats.rankdata(b, axis=1))


def bootstrap_spearman_difference(pairs: list[dict[str, Any]], name: str, baseline: str,
                                  draws: int = 1000, seed: int = 0,
                                  level: float = 0.9) -> tuple[float, float, float]:
    """Spearman(name) − Spearman(baseline) over the pairs, and its bootstrap interval.

    A percentile interval: the pairs are resampled with replacement, both estimators on the
    same resample.
    """
    t = np.array([p["true"] for p in pairs], dtype=float)
    a = np.array([p["estimates"][name] for p in pairs], dtype=float)
    b = np.array([p["estimates"][baseline] for p in pairs], dtype=float)
    whole = np.arange(len(t))[None]
    point = float((rowwise_spearman(t[whole], a[whole])
                   - rowwise_spearman(t[whole], b[whole]))[0])
    idx = resample_rows(len(t), draws, seed)
    diffs = rowwise_spearman(t[idx], a[idx]) - rowwise_spearman(t[idx], b[idx])
    diffs = diffs[np.isfinite(diffs)]  # resamples with a constant column have no ranks
    if diffs.size == 0:
        return point, float("nan"), float("nan")
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    return point, float(lo), float(hi)
