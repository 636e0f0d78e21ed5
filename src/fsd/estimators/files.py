"""Summary files on disk: atomic saves, and reading only what is a regular file.

A save writes a temporary file beside the target and renames it (a crash or a full disk
never leaves half a file, and the temporary file goes); a read refuses a FIFO, a device or a
socket before opening it, and reads with ``torch.load(weights_only=True)``, which runs no
pickled code. Shared by summaries (:mod:`fsd.estimators.base`) and regularizer files
(:mod:`fsd.uses.regularizer`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import stat
import tempfile
import time
from typing import IO, Any, cast

import torch

from ..validation import SummaryFormatError

# Age after which a temporary file of :func:`atomic_torch_save` is a killed write's leftover.
# A write takes seconds; an hour leaves room for a slow disk without keeping litter for good.
_STALE_TEMPORARY_SECONDS = 3600.0


def _temporary_prefix(path: str) -> str:
    """The prefix of the temporary files that saving to ``path`` creates beside it."""
    # the target's name is part of it, so only leftovers of saves to the same file are
    # removed; cut so that prefix, random part and suffix stay within a file name's 255 bytes
    return f".fsd-{os.path.basename(path)[:200]}."


def _remove_stale_temporaries(path: str | os.PathLike,
                             older_than: float = _STALE_TEMPORARY_SECONDS) -> list[str]:
    """Delete leftovers of earlier saves to ``path`` killed before their rename; return them.

    Only the temporary files that :func:`atomic_torch_save` names after this target
    (``.fsd-<name>.<random>.tmp`` beside it), regular files owned by this user, whose last
    change is more than
    ``older_than`` seconds old are removed: a younger one may be another process's save in
    progress.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    pattern = glob.escape(_temporary_prefix(path)) + "*.tmp"
    removed = []
    now = time.time()
    for candidate in glob.glob(os.path.join(glob.escape(directory), pattern)):
        try:
            info = os.lstat(candidate)
            # a regular file of this user's: never a link, nor another user's file
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() \
                    and now - info.st_mtime > older_than:
                os.remove(candidate)
                removed.append(candidate)
        except OSError:  # gone meanwhile, or not ours to remove: leave it
            continue
    return removed


_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of ``os.stat``'s ``st_mode`` is, for a message: ``"a FIFO"``, ..."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def file_kind(path: str | os.PathLike, *, follow_symlinks: bool = False) -> str | None:
    """What ``path`` is (``"a file"``, ``"a directory"``, ``"a FIFO"``, ...), or ``None``.

    ``None`` when nothing is there. A symbolic link is ``"a symbolic link"`` unless
    ``follow_symlinks``, which reads what it points to.
    """
    try:
        mode = (os.stat if follow_symlinks else os.lstat)(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return kind_of(mode)


def special_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a directory.

    Links are followed: a link to a FIFO is a FIFO.
    """
    try:
        kind = file_kind(path, follow_symlinks=True)
    except (OSError, ValueError):  # unreadable: open() says so, naming the path
        return None
    return None if kind in (None, "a file", "a directory") else kind


def require_regular_file(path: str | os.PathLike, kind: str) -> str:
    """``path`` as a string, or one line why it is no fsd ``kind`` file to read.

    A FIFO with no writer would block ``torch.load`` for ever, a terminal waits for input
    and ``/dev/zero`` never ends: refused before anything is opened. A directory or a
    missing file is left to ``open``, whose ``IsADirectoryError`` / ``FileNotFoundError``
    names the path.

    Raises:
        SummaryFormatError: ``path`` is a FIFO, a device or a socket.
    """
    path = os.fspath(path)
    special = special_file(path)
    if special is not None:
        raise SummaryFormatError(f"{path} is not an fsd {kind} file: it is {special}, not a "
                                 f"regular file")
    return path


class _RecordingWriter:
    """A binary file's ``write`` and ``flush`` that keep the first ``OSError`` raised.

    ``torch.save`` turns an error of its writer (a full disk, a file-size limit) into a
    ``RuntimeError`` without the reason; the reason is read back from here.
    """

    def __init__(self, handle: Any) -> None:
        self.handle, self.error = handle, None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        try:
            self.handle.flush()
        except OSError as error:
            self.error = self.error or error
            raise


def _cannot_save(path: str, error: OSError) -> OSError:
    """``error`` restated in one line that names ``path`` (not the temporary file)."""
    reason = error.strerror or str(error) or type(error).__name__
    message = f"cannot save to {path}: {reason}"
    # OSError(errno, text) keeps the errno and picks the subclass (PermissionError, ...)
    return OSError(error.errno, message) if error.errno is not None else OSError(message)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename it to ``path``.

    A crash or a failed write never leaves a half-written file at ``path``, and a failed
    write removes its temporary file. A process killed before the rename leaves its
    temporary file (``.fsd-<name>.<random>.tmp``) behind; the next save to the same
    ``path`` removes those older than an hour.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        OSError: ``path`` is a FIFO, a device or a socket; or its folder is missing or
            cannot be written; or the write failed (``No space left on device``, a file-size
            limit). One line naming ``path``, not the temporary file; the errno is kept.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory: give the summary a file name")
    special = special_file(path)
    if special is not None:  # the rename would replace the FIFO or device node itself
        raise OSError(f"cannot save to {path}: it is {special}, not a regular file; give "
                      f"the summary a file name")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_temporary_prefix(path), suffix=".tmp")
    except OSError as error:  # mkstemp's message would name a temporary file the user never saw
        reason = "does not exist" if isinstance(error, FileNotFoundError) else \
            f"cannot be written ({error.strerror})"
        raise type(error)(f"cannot save to {path}: its folder {directory} {reason}") from None
    writer: _RecordingWriter | None = None
    try:
        with os.fdopen(fd, "wb") as handle:
            writer = _RecordingWriter(handle)
            torch.save(obj, cast(IO[bytes], writer))
            handle.flush()
            _fsync(handle.fileno())  # a full disk may only show here, not at the write
        # mkstemp makes the file private (0600); give it the mode open() would have
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except Exception as error:
        # torch reports its writer's OSError as a RuntimeError without the reason
        cause = writer.error if writer is not None and writer.error is not None else error
        if isinstance(cause, OSError):
            raise _cannot_save(path, cause) from None
        raise
    finally:
        with contextlib.suppress(OSError):
            if os.path.lexists(tmp):
                os.remove(tmp)
    _remove_stale_temporaries(path)


def _fsync(fd: int) -> None:
    """``os.fsync``, where the file system has it (some network and FUSE ones do not)."""
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask






def read_weights_only(path: str | os.PathLike, kind: str,
                      map_location: str | torch.device | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` of an fsd ``kind`` file, or one line why not.

    Raises:
        SummaryFormatError: ``path`` is a FIFO, a device or a socket (refused unopened), or
            its contents are no file torch reads without running pickled code.
        OSError: ``path`` is missing, a directory or unreadable: the message names it.
    """
    path = require_regular_file(path, kind)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except OSError as error:
        if error.errno is None:  # not the file system's: the bytes are what is wrong
            raise SummaryFormatError(f"{path} is not an fsd {kind} file (unreadable: "
                                     f"{type(error).__name__})") from None
        raise OSError(error.errno, f"cannot read {path}: {error.strerror}") from None
    except Exception as error:  # truncated, empty, random bytes, a pickle of anything else
        # torch's own message suggests weights_only=False, which would run pickled code
        raise SummaryFormatError(f"{path} is not an fsd {kind} file (unreadable: "
                                 f"{type(error).__name__})") from None


def check_format_version(version: Any, origin: str, kind: str, newest: int) -> int:
    """``version`` of an fsd ``kind`` file, refused unless in 1..``newest``.

    A larger integer is a file of a later fsd: the message says to upgrade. Raises
    :class:`~fsd.validation.SummaryFormatError` in one line naming ``origin``.
    """
    if isinstance(version, int) and not isinstance(version, bool):
        if version > newest:
            raise SummaryFormatError(f"{origin}: written by a newer fsd ({kind} format version "
                                     f"{version}; this fsd reads versions 1 to {newest}): "
                                     f"upgrade fsd to load it")
        if version >= 1:
            return version
    raise SummaryFormatError(f"{origin}: unsupported fsd {kind} version {version!r}")
