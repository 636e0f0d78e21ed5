"""The data directory and the error every loader raises when a data set is missing."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PathLike = str | os.PathLike

#: Environment variable that selects the data directory when no explicit one is given.
ENV_VAR = "FSD_DATA_DIR"

#: Environment variable that, set to anything but ``""`` or ``"0"``, stops the loaders from
#: downloading a missing data set (``--no-download`` on the command line sets it).
NO_DOWNLOAD_ENV = "FSD_NO_DOWNLOAD"


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


def downloads_allowed() -> bool:
    """Whether a loader may download a data set it finds missing (see :data:`NO_DOWNLOAD_ENV`)."""
    return os.environ.get(NO_DOWNLOAD_ENV, "").strip() in ("", "0")


@contextmanager
def downloads_disabled(disabled: bool = True) -> Iterator[None]:
    """Within the block, loaders do not download (the environment variable, restored after).

    An environment variable rather than an argument, so that a command's worker processes
    (``torch.distributed``, the data loaders) inherit the choice.
    """
    before = os.environ.get(NO_DOWNLOAD_ENV)
    if disabled:
        os.environ[NO_DOWNLOAD_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NO_DOWNLOAD_ENV, None)
        else:
            os.environ[NO_DOWNLOAD_ENV] = before


def _data_dir(text: str) -> str:
    """A ``--data-dir`` value: not empty (``''`` would silently be the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (it would be the current directory); give a "
                                         "folder, or leave the option out for the default")
    return text


def add_data_options(parser: argparse.ArgumentParser, *, reads: bool = True) -> None:
    """``--data-dir`` and ``--no-download``: the data options of every command that reads data.

    ``reads=False`` (``fsd data fetch``, which downloads because it is asked to) adds only
    ``--data-dir``.
    """
    parser.add_argument("--data-dir", type=_data_dir, default=None,
                        help="data directory (default: $FSD_DATA_DIR, else ~/.cache/fsd/data)"
                             + ("; a data set missing there is fetched on first use"
                                if reads else ""))
    if not reads:
        return
    parser.add_argument("--no-download", action="store_true",
                        help=f"never download a missing data set (also ${NO_DOWNLOAD_ENV}=1); "
                             "the error then says what to run")
