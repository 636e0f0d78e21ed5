"""Writing result files atomically: a reader (or a killed run) never sees half a file."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, Iterator


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    """Write ``payload`` to ``path`` via a temporary file in the same folder and ``os.replace``.

    The folder is created if needed. The temporary file has a unique name and is opened
    with ``"xb"`` (so it gets the umask's permissions, not ``mkstemp``'s 0600), flushed to
    disk before the rename, and removed if anything fails.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None


class DirectoryInUseError(RuntimeError):
    """Another process holds the run directory."""


@contextlib.contextmanager
def exclusive_directory(path: str | os.PathLike) -> Iterator[None]:
    """Hold ``path`` (created if needed) for this process alone while the block runs.

    An advisory ``flock`` on ``path/.lock``, released when the block ends or the process
    dies (the kernel drops it with the process, so a killed run leaves no stale lock). A
    second process gets :class:`DirectoryInUseError` naming the holder's pid, instead of
    reading and writing checkpoints beside the first.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file: give a directory (or a new name)")
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / ".lock", "a+")  # held for the whole block
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
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


def refuse_used_directory(path: str | os.PathLike, why: str) -> None:
    """Raise ``ValueError`` unless ``path`` is missing or empty (its ``.lock`` aside).

    For commands that must not write beside another run's files: ``why`` says what mixing
    them in would do.
    """
    directory = Path(path)
    if not directory.is_dir():
        return
    entries = sorted(p.name for p in directory.iterdir() if p.name != ".lock")
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ValueError(f"{directory} is not empty ({shown}): give a new or empty directory "
                         f"({why})")


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files a killed writer left under ``directory``; return them.

    Only call it while holding the directory (:func:`exclusive_directory`): then no other
    process is writing there, and every ``.fsd-*.tmp`` (the library's summaries) and
    ``.*.tmp`` (:func:`atomic_write_bytes`) is a leftover of a write that never finished.
    """
    stale = [p for p in Path(directory).rglob(".*.tmp") if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
