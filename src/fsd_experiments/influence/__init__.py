"""Influence-function studies (paper §5.3): UCI regressions and mislabeled MNIST.

:func:`run_uci` correlates each method's self-influence scores with the ``exact`` PBRF oracle
on five UCI regressions; :func:`run_mislabeled` ranks MNIST training points with 10% corrupted
labels by self-influence and measures how many corrupted points each method finds. Exposed as
``fsd influence uci`` and ``fsd influence mislabeled``. The PBRF machinery itself (distance
terms, solver, conjugate gradient) is :mod:`fsd.uses.influence`.
"""

from __future__ import annotations

from ..compat import pool_corrupted
from .cli import add_cli
from .common import METHOD_TITLES, mean_loss, train_sgd
from .mislabeled import (
    MISLABELED_METHODS,
    corrupt_labels,
    run_mislabeled,
    write_mislabeled_outputs,
)
from .uci import (
    LEARNING_RATES,
    UCI_METHODS,
    interval_table,
    run_uci,
    split_uci,
    timing_table,
    uci_table,
    write_uci_outputs,
    write_uci_summary,
)

__all__ = [
    "LEARNING_RATES", "METHOD_TITLES", "MISLABELED_METHODS", "UCI_METHODS", "add_cli",
    "corrupt_labels", "interval_table", "mean_loss", "pool_corrupted", "run_mislabeled",
    "run_uci", "split_uci", "timing_table", "train_sgd", "uci_table", "write_mislabeled_outputs",
    "write_uci_outputs", "write_uci_summary",
]
