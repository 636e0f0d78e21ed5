"""matplotlib for the studies' figures: the file-only Agg backend, chosen in one place.

matplotlib is imported only when a figure is drawn, so the library and the commands that
draw nothing never load it.
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (figures are written to files, never shown)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
