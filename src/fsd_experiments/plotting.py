"""matplotlib for the studies' figures: the file-only Agg backend, chosen in one place.

matplotlib is imported only when a figure is drawn, so the library and the commands that
draw nothing never load it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from .io import atomic_write_bytes


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (figures are written to files, never shown)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_figure(fig: Any, out: str | os.PathLike, dpi: int) -> Path:
    """Save a matplotlib figure atomically to ``out`` (its suffix picks the format), close it.

    Drawn into memory, then written by :func:`~fsd_experiments.io.atomic_write_bytes`: a full
    disk is one line naming ``out`` and leaves no half file.
    """
    out = Path(out)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, dpi=dpi, format=out.suffix.lstrip(".") or "png")
    finally:
        pyplot().close(fig)
    atomic_write_bytes(out, buffer.getvalue())
    return out
