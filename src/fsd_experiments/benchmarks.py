"""The benchmarks of the studies: MNIST task streams shared by ``fsd cl`` and ``fsd fidelity``."""

from __future__ import annotations

#: the continual-learning benchmarks of ``fsd cl``
CL_BENCHMARKS: tuple[str, ...] = ("split-mnist", "permuted-mnist", "split-fashion-mnist")
#: Split MNIST's tasks: digit pairs, in order
SPLIT_PAIRS: tuple[tuple[int, int], ...] = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))
