"""CIFAR-10/100, official python version, read without unpickling arbitrary objects."""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np
import torch

from .common import DataNotFoundError, PathLike, _q, resolve_data_dir
from .mnist import _check_split

#: Sub-folder of the data directory for each CIFAR variant (the official archive folder names).
CIFAR_DIRS: dict[str, str] = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def _cifar_hint(kind: str, data_dir: Path) -> str:
    """Manual steps to obtain CIFAR-10/100 into ``data_dir``."""
    number = "10" if kind == "cifar10" else "100"
    return (
        f"Download the official 'CIFAR-{number} python version' archive "
        f"(cifar-{number}-python.tar.gz, https://www.cs.toronto.edu/~kriz/cifar.html) and "
        f"unpack it with:  fsd data fetch {kind} --source cifar-{number}-python.tar.gz "
        f"--data-dir {_q(data_dir)}"
    )


def _numpy_reconstruct() -> Callable[..., Any]:
    """Return numpy's array-unpickling helper without importing deprecated ``numpy.core``."""
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    return multiarray._reconstruct


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the globals needed to rebuild plain numpy arrays.

    Pickles can call arbitrary importable callables while loading; the CIFAR batches only need
    numpy's array reconstruction, so everything else is refused.
    """

    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> object:
        """Resolve ``module.name`` if it is on the allow-list, else raise ``UnpicklingError``."""
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name} from a pickle")
        if name == "_reconstruct":
            return _numpy_reconstruct()
        return getattr(np, name)


def _load_pickle(path: Path) -> dict:
    """Load one CIFAR batch file with the restricted unpickler (``encoding="bytes"``)."""
    with open(path, "rb") as f:
        return _unpickle(f, str(path))


def _unpickle(stream: BinaryIO, origin: str) -> dict:
    """One CIFAR batch read from ``stream`` by the restricted unpickler (errors name ``origin``)."""
    try:
        obj = _RestrictedUnpickler(stream, encoding="bytes").load()
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(f"{origin}: {exc}") from exc
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise ValueError(f"{origin}: not a valid CIFAR python batch ({exc})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{origin}: expected a dict, got {type(obj).__name__}")
    return obj


def batch_files(kind: str, split: str) -> list[str]:
    """The file names of a CIFAR split in its official folder (``kind``: cifar10 / cifar100)."""
    if kind == "cifar10":
        return [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return [split]


def _batch_arrays(batch: dict, key: bytes, origin: str) -> tuple[np.ndarray, np.ndarray]:
    """The images (n, 3, 32, 32) uint8 and labels (n,) of one batch, checked."""
    if b"data" not in batch or key not in batch:
        raise ValueError(f"{origin}: missing key b'data' or {key!r}")
    data = batch[b"data"]
    labels = np.asarray(batch[key], dtype=np.int64)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(f"{origin}: b'data' must be a uint8 array of shape (n, 3072)")
    if data.shape[1] != 3 * 32 * 32 or labels.shape != (data.shape[0],):
        raise ValueError(
            f"{origin}: data shape {data.shape} and {labels.shape[0]} labels do not match "
            "(n, 3072) and n"
        )
    return data.reshape(-1, 3, 32, 32), labels


def check_batch(stream: BinaryIO, kind: str, origin: str) -> int:
    """Check that ``stream`` holds one valid batch of ``kind``; returns its number of images."""
    key = b"labels" if kind == "cifar10" else b"fine_labels"
    data, labels = _batch_arrays(_unpickle(stream, origin), key, origin)
    classes = 10 if kind == "cifar10" else 100
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"{origin}: labels outside 0..{classes - 1}")
    return int(data.shape[0])


def load_cifar(
    data_dir: PathLike | None = None,
    split: str = "train",
    kind: str = "cifar10",
    label: str = "fine",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load CIFAR-10 or CIFAR-100 from the official python-pickle layout.

    Reads ``<data-dir>/cifar-10-batches-py/{data_batch_1..5,test_batch}`` or
    ``<data-dir>/cifar-100-python/{train,test}`` and returns images float32 in [0, 1] of shape
    (N, 3, 32, 32) and int64 labels (N,). ``label`` picks CIFAR-100's ``"fine"`` (100 classes)
    or ``"coarse"`` (20 super-classes) labels; CIFAR-10 only has ``"fine"``.
    """
    k = kind.lower().replace("-", "")
    if k not in CIFAR_DIRS:
        raise ValueError(f"unknown CIFAR kind {kind!r}; expected 'cifar10' or 'cifar100'")
    split = _check_split(split)
    if label not in ("fine", "coarse"):
        raise ValueError(f"unknown label set {label!r}; expected 'fine' or 'coarse'")
    if k == "cifar10" and label != "fine":
        raise ValueError("CIFAR-10 has no coarse labels; use label='fine'")
    root = resolve_data_dir(data_dir)
    directory = root / CIFAR_DIRS[k]
    files = batch_files(k, split)
    if k == "cifar10":
        key = b"labels"
    else:
        key = b"fine_labels" if label == "fine" else b"coarse_labels"
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise DataNotFoundError(
            f"{kind} {split} files not found: expected {', '.join(missing)} in {directory}. "
            + _cifar_hint(k, root)
        )
    xs, ys = [], []
    for fname in files:
        path = directory / fname
        data, labels = _batch_arrays(_load_pickle(path), key, str(path))
        xs.append(data)
        ys.append(labels)
    x = torch.from_numpy(np.concatenate(xs)).to(torch.float32).div_(255.0)
    y = torch.from_numpy(np.concatenate(ys))
    return x, y
