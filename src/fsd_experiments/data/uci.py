"""The UCI regression sets of the influence study (the layout of the authors' copies)."""

from __future__ import annotations

from pathlib import Path

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

    Returns float64 ``X`` of shape (N, d) and ``y`` of shape (N, k) (k = 1 for the standard
    sets), with columns chosen by ``index_features.txt`` / ``index_target.txt`` (0-based).
    ``name`` may be a canonical name from :data:`UCI_DATASETS` or an alias
    (case-insensitive): ``boston``/``housing``, ``wine``.
    """
    canon = _uci_name(name)
    root = resolve_data_dir(data_dir)
    directory = root / "uci" / canon
    files = ("data.txt", "index_features.txt", "index_target.txt")
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise DataNotFoundError(
            f"UCI data set {canon}: expected {', '.join(missing)} in {directory}. "
            + _uci_hint(root)
        )
    data = np.loadtxt(directory / "data.txt", dtype=np.float64, ndmin=2)
    feat = np.loadtxt(directory / "index_features.txt", dtype=np.int64, ndmin=1)
    targ = np.loadtxt(directory / "index_target.txt", dtype=np.int64, ndmin=1)
    ncol = data.shape[1]
    for label, idx in (("index_features.txt", feat), ("index_target.txt", targ)):
        if idx.size == 0 or idx.min() < 0 or idx.max() >= ncol:
            raise ValueError(
                f"{directory / label}: column indices must be in 0..{ncol - 1}, got {idx.tolist()}"
            )
    return torch.from_numpy(data[:, feat].copy()), torch.from_numpy(data[:, targ].copy())
