"""fsd_experiments — the studies built on the :mod:`fsd` library, and the ``fsd`` command line.

Continual learning (``fsd cl``), influence functions (``fsd influence``), fidelity, the toy
regression, memory costs and the estimator comparison, with the data sets they read. Installed
with ``pip install -e ".[experiments]"``; the library itself never imports this package.
"""

from fsd import __version__

__all__ = ["__version__"]
