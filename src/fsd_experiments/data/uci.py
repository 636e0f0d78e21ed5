"""The UCI regression sets of the influence study (the layout of the authors' copies)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from .common import DataNotFoundError, PathLike, _q, resolve_data_dir

#: Canonical UCI regression data set names (folder names under ``<data-dir>/uci/``).
UCI_DATASETS: tuple[str, ...] = (
    "bostonHousing",
    "concrete",
    "energy",
    "kin8nm",
    "wine-quality-red",
)

_UCI_ALIASES: dict[str, str] = {
    **{name.lower(): name for name in UCI_DATASETS},
    "boston": "bostonHousing",
    "housing": "bostonHousing",
    "boston-housing": "bostonHousing",
    "wine": "wine-quality-red",
    "wine-red": "wine-quality-red",
}


def _uci_hint(data_dir: Path) -> str:
    """Manual steps to lay out the UCI regression sets under ``data_dir``."""
    return (
        f"Put each UCI regression set in {_q(data_dir / 'uci' / '<name>')}/ as data.txt "
        "(whitespace-separated rows), index_features.txt and index_target.txt (0-based column "
        f"indices); names: {', '.join(UCI_DATASETS)}"
    )


def canonical_uci_name(name: str) -> str | None:
    """The canonical folder name of a UCI data set name or alias (case-insensitive), or None."""
    return _UCI_ALIASES.get(name.strip().lower().replace("_", "-"))


def _uci_name(name: str) -> str:
    """Map a UCI data set name or alias (case-insensitive) to its canonical folder name."""
    canon = canonical_uci_name(name)
    if canon is None:
        raise ValueError(
            f"unknown UCI data set {name!r}; valid names: {', '.join(UCI_DATASETS)} "
            "(aliases: boston, housing, wine)"
        )
    return canon


def load_uci(name: str, data_dir: PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a UCI regression set from ``<data-dir>/uci/<name>/``.

    A set missing there is first installed from the copies shipped with this package
    (:func:`~fsd_experiments.data.fetching.fetch_on_first_use`; no network needed).

    Returns float64 ``X`` of shape (N, d) and ``y`` of shape (N, k) (k = 1 for the standard
    sets), with columns chosen by ``index_features.txt`` / ``index_target.txt`` (0-based).
    ``name`` may be a canonical name from :data:`UCI_DATASETS` or an alias
    (case-insensitive): ``boston``/``housing``, ``wine``. A ``ValueError`` naming the file
    (and the row, counted from 1) refuses a table the studies cannot standardise: fewer than
    two rows, a NaN or infinite value, a column whose standard deviation overflows float64,
    and a target column that is also listed as a feature.
    """
    canon = _uci_name(name)
    root = resolve_data_dir(data_dir)
    directory = root / "uci" / canon
    files = ("data.txt", "index_features.txt", "index_target.txt")
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        from .fetching import fetch_on_first_use  # fetching reads this module's names
        fetch_on_first_use("uci", root)
        missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise DataNotFoundError(
            f"UCI data set {canon}: expected {', '.join(missing)} in {directory}. "
            + _uci_hint(root)
        )
    data_file = directory / "data.txt"
    data = _read_table(data_file, np.float64, 2)
    if data.shape[0] < 2:
        raise ValueError(
            f"{data_file}: {data.shape[0]} data row{'s' if data.shape[0] != 1 else ''}; at "
            "least 2 are needed (each column is standardised by its standard deviation)")
    feat = _read_table(directory / "index_features.txt", np.int64, 1)
    targ = _read_table(directory / "index_target.txt", np.int64, 1)
    ncol = data.shape[1]
    for label, idx in (("index_features.txt", feat), ("index_target.txt", targ)):
        if idx.size == 0 or idx.min() < 0 or idx.max() >= ncol:
            raise ValueError(
                f"{directory / label}: column indices must be in 0..{ncol - 1}, got {idx.tolist()}"
            )
    leaked = sorted(set(feat.tolist()) & set(targ.tolist()))
    if leaked:
        raise ValueError(
            f"{directory / 'index_features.txt'}: column {leaked[0]} is also a target column "
            "(index_target.txt); the target would leak into the features")
    _check_rows(data_file, data, np.concatenate([feat, targ]))
    return torch.from_numpy(data[:, feat].copy()), torch.from_numpy(data[:, targ].copy())


def _read_table(path: Path, dtype: type, ndmin: Literal[1, 2]) -> np.ndarray:
    """``np.loadtxt`` of ``path``, its errors naming the file."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # an empty file: refused below
            return np.loadtxt(path, dtype=dtype, ndmin=ndmin)
    except ValueError as error:  # numpy names the row and column, not the file
        raise ValueError(f"{path}: {error}") from None


def _check_rows(path: Path, data: np.ndarray, columns: np.ndarray) -> None:
    """Refuse a table that cannot be standardised: non-finite or overflowing values.

    Rows are counted from 1, as the data lines of ``path`` (numpy skips blank lines).
    """
    used = data[:, np.unique(columns)]
    bad = ~np.isfinite(used)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        count = int(bad.any(axis=1).sum())
        raise ValueError(
            f"{path}: row {row + 1} has the non-finite value {used[row, col]} in column "
            f"{np.unique(columns)[col]} ({count} such row{'s' if count != 1 else ''})")
    with np.errstate(over="ignore", invalid="ignore"):
        spread = used.std(axis=0)
    if not np.isfinite(spread).all():
        col = int(np.flatnonzero(~np.isfinite(spread))[0])
        row = int(np.abs(used[:, col]).argmax())
        raise ValueError(
            f"{path}: column {np.unique(columns)[col]} overflows float64 when standardised "
            f"(row {row + 1} holds {used[row, col]:.3g})")
