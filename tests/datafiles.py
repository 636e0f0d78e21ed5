"""Tiny data sets in the official file formats, written by the tests themselves.

Also :data:`REAL_DATA_DIR`, where the tests that need real MNIST or the UCI tables find them.

MNIST / Fashion-MNIST idx files, and CIFAR-10/100 "python version" folders and archives with
the official pickle layout (Python 2 style protocol-2 pickles naming ``numpy.core``).
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from fsd_experiments.data import CIFAR_DIRS, MNIST_FILES, resolve_data_dir

#: The data directory the tests read real MNIST and the UCI tables from: ``$FSD_DATA_DIR``,
#: else the per-user cache (``~/.cache/fsd/data``), as the ``fsd`` command. The ``real_data``
#: fixture (conftest.py) fetches what is missing there once per test session.
REAL_DATA_DIR = resolve_data_dir()

IDX_CODES = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(np.int16): 0x0B,
    np.dtype(np.int32): 0x0C,
    np.dtype(np.float32): 0x0D,
    np.dtype(np.float64): 0x0E,
}


def encode_idx(arr: np.ndarray) -> bytes:
    """Encode ``arr`` in the idx format: magic, dims as big-endian uint32, big-endian data."""
    header = bytes([0, 0, IDX_CODES[arr.dtype], arr.ndim])
    header += b"".join(struct.pack(">I", d) for d in arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_mnist_like(directory: Path, per_class: int = 3, classes: int = 10,
                     seed: int = 0) -> None:
    """Gzip idx files of ``per_class`` random images per class in each split (labels in order)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes, dtype=np.uint8), per_class)
    for name in MNIST_FILES:
        arr = rng.integers(0, 256, size=(labels.size, 28, 28), dtype=np.uint8) \
            if "images" in name else labels
        (directory / f"{name}.gz").write_bytes(gzip.compress(encode_idx(arr), compresslevel=1))


class _Py2StylePickler(pickle._Pickler):  # type: ignore[name-defined]
    """Protocol-2 pickler writing str/bytes as Python 2 ``str`` opcodes, as cPickle did for the
    official CIFAR files (they come back as ``bytes`` under ``encoding="bytes"``)."""

    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_py2_str(self, obj) -> None:
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = save_py2_str
    dispatch[bytes] = save_py2_str


def py2_pickle(obj: object) -> bytes:
    """``obj`` pickled as the official CIFAR batches are."""
    buf = io.BytesIO()
    _Py2StylePickler(buf, protocol=2).dump(obj)
    # The official files name numpy's pre-2.0 module; emulate that exactly.
    return buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def cifar_batch(n: int, n_classes: int, seed: int, cifar100: bool = False,
                labels: Sequence[int] | None = None) -> dict:
    """One batch dict of the official layout: random images, random (or given) labels.

    With ``labels`` given, each image's first byte is its label, so tests can tell which
    original class an image came from.
    """
    rng = np.random.default_rng(seed)
    if labels is None:
        labels = rng.integers(0, n_classes, size=n).tolist()
    images = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
    images[:, 0] = labels
    batch: dict = {
        b"batch_label": b"training batch",
        b"data": images,
        b"filenames": [b"img%d.png" % i for i in range(len(labels))],
    }
    if cifar100:
        batch[b"fine_labels"] = list(labels)
        batch[b"coarse_labels"] = [v // 5 for v in labels]
    else:
        batch[b"labels"] = list(labels)
    return batch


def cifar_files(kind: str, per_class: int = 2) -> dict[str, bytes]:
    """The files of an official CIFAR folder (batches and meta), ``per_class`` images per class
    in every batch, labels in class order; images carry their label in their first byte."""
    if kind == "cifar10":
        labels = [c for c in range(10) for _ in range(per_class)]
        files = {f"data_batch_{i}": py2_pickle(cifar_batch(0, 10, i, labels=labels))
                 for i in range(1, 6)}
        files["test_batch"] = py2_pickle(cifar_batch(0, 10, 9, labels=labels))
        files["batches.meta"] = py2_pickle({b"label_names": [b"c%d" % i for i in range(10)]})
        return files
    labels = [c for c in range(100) for _ in range(per_class)]
    return {"train": py2_pickle(cifar_batch(0, 100, 1, cifar100=True, labels=labels)),
            "test": py2_pickle(cifar_batch(0, 100, 2, cifar100=True, labels=labels)),
            "meta": py2_pickle({b"fine_label_names": [b"f%d" % i for i in range(100)]})}


def write_cifar(root: Path, per_class: int = 2) -> Path:
    """Both official CIFAR folders under ``root`` (the data directory); returns ``root``."""
    for kind in ("cifar10", "cifar100"):
        folder = root / CIFAR_DIRS[kind]
        folder.mkdir(parents=True, exist_ok=True)
        for name, blob in cifar_files(kind, per_class).items():
            (folder / name).write_bytes(blob)
    return root


def cifar_archive(path: Path, kind: str, per_class: int = 1,
                  extra: Sequence[tarfile.TarInfo] = ()) -> Path:
    """A ``.tar.gz`` laid out as the official archive of ``kind``, plus ``extra`` members."""
    folder = CIFAR_DIRS[kind]
    with tarfile.open(path, "w:gz") as tf:
        top = tarfile.TarInfo(folder)
        top.type = tarfile.DIRTYPE
        tf.addfile(top)
        for name, blob in cifar_files(kind, per_class).items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(blob)
            tf.addfile(info, io.BytesIO(blob))
        for info in extra:
            tf.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return path
