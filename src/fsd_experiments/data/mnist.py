"""MNIST and Fashion-MNIST: idx files, the loader and the checksum check."""

from __future__ import annotations

import gzip
import hashlib
import math
from pathlib import Path
from typing import Protocol

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

#: The largest data size :func:`read_idx` accepts from a header unless told otherwise.
MAX_IDX_BYTES = 1 << 30

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


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def _read_up_to(stream: _Readable, size: int) -> bytes:
    """Read ``size`` bytes from ``stream``, fewer only at its end."""
    parts, left = [], size
    while left > 0:
        chunk = stream.read(min(left, _CHUNK))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_idx_stream(path: Path, stream: _Readable, shape: tuple[int | None, ...] | None,
                     dtype: np.dtype | None, max_bytes: int) -> np.ndarray:
    """Parse an idx file from ``stream``, reading its body only once the header is checked."""
    head = _read_up_to(stream, 4)
    if len(head) < 4:
        raise ValueError(f"{path}: too short to be an idx file ({len(head)} bytes)")
    if head[0] != 0 or head[1] != 0:
        raise ValueError(f"{path}: bad idx magic {head.hex()} (expected two zero bytes first)")
    code, ndim = head[2], head[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown idx dtype code 0x{code:02X}")
    header_len = 4 + 4 * ndim
    dims = _read_up_to(stream, 4 * ndim)
    if len(dims) < 4 * ndim:
        raise ValueError(f"{path}: truncated idx header ({4 + len(dims)} of {header_len} bytes)")
    found_shape = tuple(int(d) for d in np.frombuffer(dims, dtype=">u4", count=ndim))
    found_dtype = _IDX_DTYPES[code]
    if (dtype is not None and found_dtype != dtype) or (shape is not None and (
            len(found_shape) != len(shape)
            or any(s is not None and s != f for s, f in zip(shape, found_shape, strict=True)))):
        wanted = "" if shape is None else " of shape (" + ", ".join(
            "N" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(
            f"{path}: expected {dtype.name if dtype is not None else 'an idx array'}{wanted}, "
            f"the header declares {found_dtype.name} {found_shape}")
    # Python ints: the declared size cannot overflow, however large the header's dimensions
    expected = math.prod(found_shape) * found_dtype.itemsize
    if expected > max_bytes:
        # checked before reading the body: a small .gz can declare and inflate to gigabytes
        raise ValueError(
            f"{path}: the header declares {found_dtype.name} {found_shape} ({expected} bytes), "
            f"more than the {max_bytes} bytes allowed; the file is corrupt or not this data set")
    # one byte past the declared size is enough to know the body is too long
    body = _read_up_to(stream, expected + 1)
    if len(body) < expected:
        raise ValueError(
            f"{path}: idx data size {len(body)} bytes does not match header shape "
            f"{found_shape} of {found_dtype.name} ({expected} bytes); the file is truncated")
    if len(body) > expected:
        raise ValueError(
            f"{path}: idx data longer than its header's shape {found_shape} of "
            f"{found_dtype.name} ({expected} bytes); the file is corrupt")
    arr = np.frombuffer(body, dtype=found_dtype).reshape(found_shape)
    # astype copies, which also gives a writable array (torch.from_numpy warns on read-only).
    return arr.astype(found_dtype.newbyteorder("="))


def read_idx(path: PathLike, *, shape: tuple[int | None, ...] | None = None,
             dtype: np.dtype | None = None, max_bytes: int = MAX_IDX_BYTES) -> np.ndarray:
    """Parse an idx file (as used by MNIST) into a native-endian, writable numpy array.

    The header is two zero bytes, a dtype code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions and one big-endian uint32 per
    dimension; the data follow in C order, big-endian. gzip compression is detected from the
    file's magic bytes, not its name, and decompressed as the file is read.

    Args:
        path: The idx file, raw or gzip-compressed.
        shape: The shape the header must declare; ``None`` entries match any length.
        dtype: The element type the header must declare.
        max_bytes: The largest data size the header may declare.

    Returns:
        The array, in native byte order.

    Raises:
        ValueError: Naming the file, for a bad header, a header that declares another shape
            or dtype or more than ``max_bytes`` (checked before the data are read, so a small
            gzip file that would inflate to gigabytes is refused without inflating it), or
            data whose size does not match the header.
    """
    path = Path(path)
    with open(path, "rb") as f:
        compressed = f.read(2) == _GZIP_MAGIC
        f.seek(0)
        if not compressed:
            return _read_idx_stream(path, f, shape, dtype, max_bytes)
        try:
            with gzip.GzipFile(fileobj=f) as gz:
                return _read_idx_stream(path, gz, shape, dtype, max_bytes)
        except (OSError, EOFError) as exc:  # BadGzipFile is an OSError; truncation is EOFError
            raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from exc


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
    Both ``<name>`` and ``<name>.gz`` idx files are accepted. Files missing from the data
    directory are fetched first (:func:`~fsd_experiments.data.fetching.fetch_on_first_use`:
    MNIST downloaded and checked by sha256, Fashion-MNIST copied from Debian's package).
    Raises :class:`DataNotFoundError` if they cannot be, with the command to run, and
    ``ValueError`` if the files are inconsistent.
    """
    kind = _normalise_mnist_kind(kind)
    split = _check_split(split)
    root = resolve_data_dir(data_dir)
    directory = root / _MNIST_SUBDIRS[kind]
    prefix = _SPLIT_PREFIX[split]
    names = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    paths = [_find_idx(directory, n) for n in names]
    if any(p is None for p in paths):
        from .fetching import fetch_on_first_use  # fetching reads this module's constants
        fetch_on_first_use(kind, root)
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
    # the headers are checked against the split's shapes before any data are read
    n = _SPLIT_SIZES[split]
    images = read_idx(img_path, shape=(None, 28, 28), dtype=np.dtype(np.uint8),
                      max_bytes=n * 28 * 28)
    labels = read_idx(lab_path, shape=(None,), dtype=np.dtype(np.uint8), max_bytes=n)
    if len(images) != len(labels):
        raise ValueError(
            f"{img_path} has {len(images)} images but {lab_path} has {len(labels)} labels"
        )
    if labels.size and labels.max() > 9:
        raise ValueError(f"{lab_path}: label {int(labels.max())} outside 0..9")
    x = torch.from_numpy(images).unsqueeze(1).to(torch.float32).div_(255.0)
    y = torch.from_numpy(labels).to(torch.int64)
    return x, y


def _official_size(name: str) -> int:
    """Bytes of the official (uncompressed) MNIST idx file ``name``."""
    n = _SPLIT_SIZES["train" if name.startswith("train") else "test"]
    return 16 + n * 28 * 28 if "images" in name else 8 + n


def _sha256_stream(path: Path, limit: int) -> str:
    """sha256 hex digest of the (decompressed if gzip) content of ``path``, streamed.

    At most ``limit`` + 1 bytes are read: a longer file cannot match a digest of ``limit``
    bytes, and a small .gz could otherwise inflate to gigabytes.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        gz = f.read(2) == _GZIP_MAGIC
        f.seek(0)
        stream = gzip.GzipFile(fileobj=f) if gz else f
        left = limit + 1
        try:
            while left > 0 and (chunk := stream.read(min(_CHUNK, left))):
                h.update(chunk)
                left -= len(chunk)
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
        got = _sha256_stream(path, _official_size(name))
        if got != expected:
            raise ValueError(
                f"{path}: sha256 mismatch (expected {expected}, got {got}); the file is corrupt "
                f"or not the official MNIST file. Delete it and re-fetch with:  {refetch}"
            )
