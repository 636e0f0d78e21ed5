"""Writing result files atomically: a reader (or a killed run) never sees half a file."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from fsd.estimators.files import file_kind, kind_of


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    """Write ``payload`` to ``path`` via a temporary file in the same folder and ``os.replace``.

    The folder is created if needed. The temporary file has a unique name and is opened
    with ``"xb"`` (so it gets the umask's permissions, not ``mkstemp``'s 0600, and a symbolic
    link in its place is not followed), flushed to disk before the rename, and removed if
    anything fails.

    Raises:
        UnsafeOutputError: ``path`` is a directory, a FIFO, a device or a socket.
        OSError: the write failed (a full disk, a file size limit): the error's ``filename``
            is ``path``, not the temporary file, and nothing is left behind.
    """
    dest = Path(path)
    check_target(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not isinstance(error, OSError) or error.errno is None \
                or error.filename not in (None, str(tmp)):
            raise
        # a write's own error names no file (or the temporary one): name the result instead
        raise type(error)(error.errno, error.strerror, str(dest)) from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (strict JSON has no NaN/inf)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def provenance(device: str = "cpu") -> dict[str, Any]:
    """What every results file records about the software and machine that produced it.

    ``fsd_version``, ``torch_version``, ``device`` (a GPU's name, else ``"cpu"``),
    ``torch_threads`` (the CPU thread count torch ran with) and ``cpu`` (the CPU model and
    the vector instructions torch used, :func:`fsd_experiments.devices.cpu_name`).
    """
    import torch

    from fsd import __version__
    from fsd_experiments.devices import cpu_name
    return {"fsd_version": __version__, "torch_version": torch.__version__, "device": device,
            "torch_threads": torch.get_num_threads(), "cpu": cpu_name()}


def versioned(payload: dict[str, Any], schema: int, device: str = "cpu") -> dict[str, Any]:
    """``payload`` with the file layout's ``schema_version`` and its :func:`provenance`.

    Keys already in ``payload`` (a ``device`` the study recorded itself) win.
    """
    return {**provenance(device), **payload, "schema_version": schema}


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1,
               nan_as_null: bool = False) -> None:
    """Write ``obj`` as JSON atomically.

    Args:
        path: the file.
        obj: JSON-able data.
        indent: ``json.dumps``'s indent.
        nan_as_null: write non-finite floats as ``null`` (strict JSON); otherwise as
            Python's ``NaN`` / ``Infinity``.
    """
    text = (json.dumps(json_safe(obj), indent=indent, allow_nan=False) if nan_as_null
            else json.dumps(obj, indent=indent))
    atomic_write_text(path, text)


def read_json(path: str | os.PathLike) -> Any:
    """The JSON in ``path``; a file that is not JSON is a ``ValueError`` naming it.

    (``json``'s own message says where in the file, not which file.)
    """
    require_regular_file(path, "a JSON file")  # a FIFO would be waited on for ever
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None


class DirectoryInUseError(RuntimeError):
    """Another process holds the run directory."""


class UnsafeOutputError(ValueError):
    """A folder or file that fsd must not write, lock or clean: the message says why.

    A folder holding files that are not fsd's, a folder inside another run, a lock that is
    a symbolic link, a result file that is a FIFO or a device. The message names the path
    and what to do.
    """


#: marks a folder as fsd's own output folder: written when fsd creates (or adopts) it,
#: it holds the folder's kind, e.g. ``{"kind": "cl run"}``
MARKER = ".fsd-output"
#: the lock file of :func:`exclusive_directory`
LOCK = ".lock"
#: fsd's bookkeeping in an output folder: with nothing else, the folder counts as empty
BOOKKEEPING = frozenset({MARKER, LOCK})

# the temporary files of fsd's writers: atomic_write_bytes' ".<name>.<pid>.<hex>.tmp" and
# fsd.estimators.files.atomic_torch_save's ".fsd-<name>.<random>.tmp"
_TEMPORARY = re.compile(r"\.(?:fsd-.+|.+\.\d+\.[0-9a-f]+)\.tmp")


def non_file_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is (links followed) if it exists and is not a regular file, else ``None``."""
    kind = file_kind(path, follow_symlinks=True)
    return None if kind in (None, "a file") else kind


def require_regular_file(path: str | os.PathLike, what: str = "a file") -> None:
    """Raise :class:`UnsafeOutputError` if ``path`` (links followed) exists and is no file.

    Reading a FIFO would wait for a writer for ever; a device or a directory is no result
    file. A missing ``path`` passes (the caller's own error names it).
    """
    kind = non_file_kind(path)
    if kind is not None:
        raise UnsafeOutputError(f"{path} is {kind}, not {what}: remove it or give another path")


def check_target(dest: str | os.PathLike) -> None:
    """Raise :class:`UnsafeOutputError` unless a result file may replace ``dest``.

    Missing, a regular file or a symbolic link (replaced, not followed); not a directory,
    a FIFO, a device or a socket.
    """
    kind = file_kind(dest)
    if kind not in (None, "a file", "a symbolic link"):
        raise UnsafeOutputError(f"{dest} is {kind}, not a regular file: fsd writes its results "
                                f"as regular files; remove it or write elsewhere")


def os_error_message(error: OSError) -> str:
    """One line for an ``OSError``: the path and the reason, without errno's brackets.

    A full disk or a file size limit (``ulimit -f``) also says what to do.
    """
    if error.filename is None:  # raised with a message of our own, or without a path
        return str(error) if error.errno is None else f"{error.strerror}"
    if isinstance(error, FileExistsError):  # what mkdir says of a file in the way
        return f"{error.filename} exists and is not a directory"
    advice = {errno.ENOSPC: "; free some space there or write elsewhere, then run again",
              errno.EDQUOT: "; free some of your quota or write elsewhere, then run again",
              errno.EFBIG: "; a file size limit (ulimit -f) stopped the write: raise it or "
                           "write elsewhere, then run again"}.get(error.errno or 0, "")
    return f"{error.filename}: {error.strerror}{advice}"


def is_pid_lock(path: Path) -> bool:
    """Whether ``path`` may be a lock fsd wrote: a small regular file holding a pid, or empty.

    Anything else named ``.lock`` (text of the user's, a link) is not fsd's to overwrite.
    """
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > 32:
            return False
        return path.read_text(encoding="ascii").strip().isdigit() or info.st_size == 0
    except (OSError, UnicodeDecodeError):
        return False


def is_fsd_temporary(path: Path) -> bool:
    """Whether ``path`` is a temporary file of fsd's writers: by name, type and owner.

    Named as :func:`atomic_write_bytes` or ``atomic_torch_save`` name theirs, a regular file
    (a symbolic link is never one), owned by this user.
    """
    if not _TEMPORARY.fullmatch(path.name):
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def marker_kind(directory: str | os.PathLike) -> str | None:
    """The kind of fsd output folder ``directory``'s marker names; ``None`` without a marker.

    A marker that is not a regular file (a link, a FIFO) or not fsd's JSON counts as none.
    """
    marker = Path(directory) / MARKER
    if file_kind(marker) != "a file":
        return None
    try:
        raw = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = raw.get("kind") if isinstance(raw, dict) else None
    return kind if isinstance(kind, str) else None


def _entries(directory: Path) -> list[str]:
    """The names in ``directory`` other than fsd's bookkeeping (a foreign ``.lock`` counts)."""
    return sorted(p.name for p in directory.iterdir()
                  if not (p.name == MARKER or (p.name == LOCK and is_pid_lock(p))))


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def claim_directory(path: str | os.PathLike, kind: str,
                    earlier: Callable[[Path], bool] | None = None) -> None:
    """Make ``path`` an output folder of ``kind`` that fsd may write, lock and clean.

    A missing folder is created; an empty one (fsd's bookkeeping aside) is taken; both get
    the marker (:data:`MARKER`) naming ``kind``. A folder whose marker names ``kind`` is
    fsd's already. A folder without a marker is adopted (and marked) only where
    ``earlier(path)`` says an fsd from before the marker wrote it, with nothing foreign.

    Raises:
        UnsafeOutputError: the folder is another kind of fsd folder, or holds files that are
            not fsd's (listed): nothing in it is changed.
        NotADirectoryError: ``path`` is a file (or a FIFO, a device...).
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is {file_kind(directory)}, not a directory: "
                                 f"give a directory (or a new name)")
    if directory.is_dir():
        owner = marker_kind(directory)
        if owner == kind:
            return
        if owner is not None:
            raise UnsafeOutputError(f"{directory} is an fsd {owner} folder, not an fsd {kind} "
                                    f"folder: give a new or empty directory")
        foreign = _entries(directory)
        if foreign and not (earlier is not None and earlier(directory)):
            raise UnsafeOutputError(
                f"{directory} holds files that are not an fsd {kind}'s ({_shown(foreign)}): "
                f"fsd writes only into a new or empty directory, or one it made; give another")
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / MARKER, json.dumps({"kind": kind}) + "\n")


def refuse_used_directory(path: str | os.PathLike, why: str) -> None:
    """Raise ``ValueError`` unless ``path`` is missing or empty (fsd's bookkeeping aside).

    For commands that must not write beside another run's files: ``why`` says what mixing
    them in would do. A ``.lock`` that is not fsd's (not a pid in a regular file) counts.
    """
    directory = Path(path)
    if not directory.is_dir():
        return
    entries = _entries(directory)
    if entries:
        raise ValueError(f"{directory} is not empty ({_shown(entries)}): give a new or empty "
                         f"directory ({why})")


def refuse_nested(path: str | os.PathLike, is_inside: Callable[[Path], bool], what: str
                  ) -> None:
    """Raise :class:`UnsafeOutputError` if ``path`` or a folder above it is ``what``.

    ``is_inside(folder)`` says whether a folder is one a run must not be put in (another
    run's checkpoints, say): files there are that run's, and cleaning either run would touch
    the other's.
    """
    absolute = Path(os.path.abspath(path))
    for above in (absolute, *absolute.parents):
        if is_inside(above):
            shown = "" if above == absolute else f" is inside {above}, which"
            raise UnsafeOutputError(f"{path}{shown} is {what}: give a directory outside it")


@contextlib.contextmanager
def exclusive_directory(path: str | os.PathLike) -> Iterator[None]:
    """Hold ``path`` (created if needed) for this process alone while the block runs.

    An advisory ``flock`` on ``path/.lock``, released when the block ends or the process
    dies (the kernel drops it with the process, so a killed run leaves no stale lock). A
    second process gets :class:`DirectoryInUseError` naming the holder's pid, instead of
    reading and writing checkpoints beside the first. A ``.lock`` that is a symbolic link,
    a FIFO or a device is refused (:class:`UnsafeOutputError`), never followed or written.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is {file_kind(directory)}, not a directory: "
                                 f"give a directory (or a new name)")
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK
    refusal = (f"{lock} is {{}}, not fsd's lock file: fsd never follows or writes through "
               f"one; remove it, then run again")
    kind = file_kind(lock)
    if kind not in (None, "a file"):
        raise UnsafeOutputError(refusal.format(kind))
    try:
        # O_NOFOLLOW: a link put there after the check above is refused too
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeOutputError(refusal.format("a symbolic link")) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # put there between the check and the open
        os.close(fd)
        raise UnsafeOutputError(refusal.format(kind_of(mode)))
    handle = os.fdopen(fd, "r+")  # held for the whole block
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read().strip() or "unknown"
            raise DirectoryInUseError(
                f"{directory} is in use by another fsd process (pid {holder}); wait for it "
                f"to finish, or give another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the lock


def remove_stale_temporaries(directory: str | os.PathLike,
                             below: Iterable[str] = ()) -> list[Path]:
    """Delete the temporary files a killed fsd writer left in ``directory``; return them.

    Only call it while holding the directory (:func:`exclusive_directory`), in a folder fsd
    owns (:func:`claim_directory`): then no other process is writing there. Only
    ``directory`` itself and its sub-folders matching the glob patterns ``below`` (real
    folders, not links) are looked in, not deeper, and only files that
    :func:`is_fsd_temporary` says fsd's writers made are removed.
    """
    root = Path(directory)
    folders = [root] + [p for pattern in below for p in sorted(root.glob(pattern))
                        if _real_folder(root, p)]
    stale = [p for folder in folders for p in folder.iterdir() if is_fsd_temporary(p)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _real_folder(root: Path, path: Path) -> bool:
    """Whether ``path`` and every folder between it and ``root`` is a folder, not a link."""
    inner = path.relative_to(root)
    return all(file_kind(root / part) == "a directory"
               for part in [inner, *inner.parents] if part != Path("."))


def owned_files(path: Path, owned: Callable[[str], bool],
                folders: Callable[[str], bool] = lambda name: False) -> list[str] | None:
    """The result files in ``path`` that ``owned`` names, or ``None`` if anything else is there.

    Regular files only (a link or a folder by such a name is not one a command wrote), and
    real folders (not links) that ``folders`` names, listed too for the caller to look into;
    fsd's marker, a lock holding a pid and fsd's temporary files (a killed write's) are
    passed over.
    """
    found = []
    for entry in path.iterdir():
        if entry.name == MARKER or (entry.name == LOCK and is_pid_lock(entry)) \
                or is_fsd_temporary(entry):
            continue
        kind = file_kind(entry)
        if not ((owned(entry.name) and kind == "a file")
                or (folders(entry.name) and kind == "a directory")):
            return None
        found.append(entry.name)
    return found


def earlier_output(owned: Callable[[str], bool]) -> Callable[[Path], bool]:
    """The ``earlier`` test of :func:`~fsd_experiments.io.claim_directory` for a command.

    A folder without fsd's marker counts as one an fsd from before the marker wrote when it
    holds at least one of the command's result files (``owned(name)``) and nothing else but
    fsd's temporary files: see :func:`owned_files`.
    """
    return lambda path: bool(owned_files(path, owned))


def named(*patterns: str) -> Callable[[str], bool]:
    """Whether a file name is one of ``patterns`` (regular expressions matching whole names)."""
    whole = re.compile("|".join(f"(?:{p})" for p in patterns))
    return lambda name: whole.fullmatch(name) is not None


def claim_output(out: str | Path, kind: str, earlier: Callable[[Path], bool],
                 results: Iterable[str] = ()) -> Path:
    """Claim ``out`` for a command before its work starts; return it as a ``Path``.

    :func:`~fsd_experiments.io.claim_directory` with ``kind`` and ``earlier``; then each of
    ``results`` (paths inside ``out``) that is a FIFO, a device or a folder is refused now,
    not when the results are written after the study.

    Raises:
        UnsafeOutputError: ``out`` is not fsd's to write, or a result path is no file.
        NotADirectoryError: ``out`` is a file.
    """
    folder = Path(out)
    claim_directory(folder, kind, earlier=earlier)
    for name in results:
        check_target(folder / name)
    return folder
