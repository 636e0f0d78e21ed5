"""The data directory and the error every loader raises when a data set is missing."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

PathLike = str | os.PathLike

#: Environment variable that selects the data directory when no explicit one is given.
ENV_VAR = "FSD_DATA_DIR"


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
