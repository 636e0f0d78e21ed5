"""MNIST and Fashion-MNIST: idx files, the loader and the checksum check."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import torch

from .common import DataNotFoundError, PathLike, _q, resolve_data_dir

#: The four idx file names of MNIST and Fashion-MNIST (uncompressed names).
MNIST_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

#: sha256 of the raw (uncompressed) official MNIST files.
MNIST_SHA256: dict[str, str] = {
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
}

_MNIST_SUBDIRS = {"mnist": "mnist", "fashion-mnist": "fashion-mnist"}

_MNIST_TITLES = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST"}

_SPLIT_PREFIX = {"train": "train", "test": "t10k"}

_SPLIT_SIZES = {"train": 60000, "test": 10000}

_GZIP_MAGIC = b"\x1f\x8b"

_CHUNK = 1 << 20

# idx dtype codes; multi-byte types are stored big-endian.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _mnist_hint(kind: str, data_dir: Path) -> str:
    """Instructions to obtain MNIST or Fashion-MNIST into ``data_dir``."""
    if kind == "mnist":
        return f"Obtain them with:  fsd data fetch mnist --data-dir {_q(data_dir)}"
    return (
        "Obtain them with:  apt-get install -y dataset-fashion-mnist && "
        f"fsd data fetch fashion-mnist --data-dir {_q(data_dir)}"
    )


def _read_maybe_gzip(path: Path) -> bytes:
    """Return the content of ``path``, decompressed if it starts with the gzip magic bytes."""
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        if head != _GZIP_MAGIC:
            return f.read()
        try:
            with gzip.GzipFile(fileobj=f) as gz:
                return gz.read()
        except (OSError, EOFError) as exc:  # BadGzipFile is an OSError; truncation is EOFError
            raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from exc


def read_idx(path: PathLike) -> np.ndarray:
    """Parse an idx file (as used by MNIST) into a native-endian, writable numpy array.

    The header is two zero bytes, a dtype code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions and one big-endian uint32 per
    dimension; the data follow in C order, big-endian. gzip compression is detected from the
    file's magic bytes, not its name. Raises ``ValueError`` naming the file for a bad header or
    a size that does not match the header.
    """
    path = Path(path)
    raw = _read_maybe_gzip(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: too short to be an idx file ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: bad idx magic {raw[:4].hex()} (expected two zero bytes first)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown idx dtype code 0x{code:02X}")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated idx header ({len(raw)} of {header_len} bytes)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header_len != expected:
        raise ValueError(
            f"{path}: idx data size {len(raw) - header_len} bytes does not match header "
            f"shape {shape} of {dtype.name} ({expected} bytes); the file is truncated or corrupt"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    # astype copies, which also gives a writable array (torch.from_numpy warns on read-only).
    return arr.astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, name: str) -> Path | None:
    """Return the existing file for idx ``name`` in ``directory`` (raw preferred over .gz)."""
    # Some mirrors write "train-images.idx3-ubyte"; accept that spelling too.
    alt = name.replace("-idx", ".idx", 1)
    for cand in (name, name + ".gz", alt, alt + ".gz"):
        p = directory / cand
        if p.is_file():
            return p
    return None


def _normalise_mnist_kind(kind: str) -> str:
    """Map accepted spellings of the MNIST variant to ``"mnist"`` or ``"fashion-mnist"``."""
    k = kind.lower().replace("_", "-")
    if k in ("fashion", "fmnist"):
        k = "fashion-mnist"
    if k not in _MNIST_SUBDIRS:
        raise ValueError(f"unknown MNIST kind {kind!r}; expected 'mnist' or 'fashion-mnist'")
    return k


def _check_split(split: str) -> str:
    """Validate a ``"train"``/``"test"`` split name."""
    if split not in _SPLIT_PREFIX:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    return split


def load_mnist(
    data_dir: PathLike | None = None,
    split: str = "train",
    kind: str = "mnist",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load MNIST or Fashion-MNIST from ``<data-dir>/<kind>/``.

    Returns images as float32 in [0, 1] with shape (N, 1, 28, 28) and labels as int64 (N,).
    Both ``<name>`` and ``<name>.gz`` idx files are accepted; nothing is cached on disk.
    Raises :class:`DataNotFoundError` if the files are missing and ``ValueError`` if they are
    inconsistent.
    """
    kind = _normalise_mnist_kind(kind)
    split = _check_split(split)
    root = resolve_data_dir(data_dir)
    directory = root / _MNIST_SUBDIRS[kind]
    prefix = _SPLIT_PREFIX[split]
    names = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    paths = [_find_idx(directory, n) for n in names]
    if any(p is None for p in paths):
        missing = [n for n, p in zip(names, paths, strict=True) if p is None]
        raise DataNotFoundError(
            f"{_MNIST_TITLES[kind]} {split} files not found: expected "
            f"{' and '.join(m + '[.gz]' for m in missing)} in {directory}. "
            + _mnist_hint(kind, root)
        )
    img_path, lab_path = paths
    assert img_path is not None and lab_path is not None
    images, labels = read_idx(img_path), read_idx(lab_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise ValueError(
            f"{img_path}: expected uint8 images of shape (N, 28, 28), "
            f"got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise ValueError(f"{lab_path}: expected uint8 labels of shape (N,), got {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(
            f"{img_path} has {len(images)} images but {lab_path} has {len(labels)} labels"
        )
    if labels.size and labels.max() > 9:
        raise ValueError(f"{lab_path}: label {int(labels.max())} outside 0..9")
    x = torch.from_numpy(images).unsqueeze(1).to(torch.float32).div_(255.0)
    y = torch.from_numpy(labels).to(torch.int64)
    return x, y


def _sha256_stream(path: Path) -> str:
    """sha256 hex digest of the (decompressed if gzip) content of ``path``, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        gz = f.read(2) == _GZIP_MAGIC
        f.seek(0)
        stream = gzip.GzipFile(fileobj=f) if gz else f
        try:
            while chunk := stream.read(_CHUNK):
                h.update(chunk)
        except (OSError, EOFError) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from exc
    return h.hexdigest()


def verify_mnist(directory: PathLike) -> None:
    """Check the four MNIST files in ``directory`` (e.g. ``<data-dir>/mnist``) by sha256.

    The digest is taken over the raw, decompressed idx content, so ``.gz`` and plain files are
    both accepted. Raises :class:`DataNotFoundError` for a missing file and ``ValueError``
    naming the file for a mismatch.
    """
    directory = Path(directory)
    refetch = f"fsd data fetch mnist --data-dir {_q(directory.parent)}"
    for name, expected in MNIST_SHA256.items():
        path = _find_idx(directory, name)
        if path is None:
            raise DataNotFoundError(
                f"MNIST file {name}[.gz] not found in {directory}. Obtain it with:  {refetch}"
            )
        got = _sha256_stream(path)
        if got != expected:
            raise ValueError(
                f"{path}: sha256 mismatch (expected {expected}, got {got}); the file is corrupt "
                f"or not the official MNIST file. Delete it and re-fetch with:  {refetch}"
            )
