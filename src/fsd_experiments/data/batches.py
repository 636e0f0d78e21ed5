"""In-memory minibatches and class subsets of tensors."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


class TensorBatches:
    """Iterable of ``(x, y)`` minibatches over two tensors with the same first dimension.

    A light stand-in for ``torch.utils.data.DataLoader`` on small in-memory CPU jobs, where the
    DataLoader's per-sample collation dominates. Each ``iter()`` makes a new pass; with
    ``shuffle`` a fresh permutation is drawn from ``generator`` (or the global RNG). The last
    batch may be smaller. ``len()`` is the number of batches per pass.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        """Store the tensors and options; raises ``ValueError`` on mismatched lengths."""
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y = x, y
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.generator = generator

    def __len__(self) -> int:
        """Number of batches per pass (the last one may be partial)."""
        return -(-self.x.shape[0] // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the minibatches of one pass."""
        n, b = self.x.shape[0], self.batch_size
        if not self.shuffle:
            # Slices are views: no copy for the ordered case.
            for i in range(0, n, b):
                yield self.x[i : i + b], self.y[i : i + b]
            return
        # randperm on CPU so a CPU generator works whatever device the data are on.
        perm = torch.randperm(n, generator=self.generator)
        for i in range(0, n, b):
            idx = perm[i : i + b]
            yield self.x[idx.to(self.x.device)], self.y[idx.to(self.y.device)]


def split_by_classes(
    x: torch.Tensor,
    y: torch.Tensor,
    classes: Sequence[int],
    relabel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the rows of ``(x, y)`` whose label is in ``classes``, in their original order.

    With ``relabel`` the kept labels become their position in ``classes`` (e.g. digits
    ``[2, 3]`` become ``0``/``1``), which is what a classifier head over the subset expects.
    """
    cls = [int(c) for c in classes]
    if not cls:
        raise ValueError("classes must not be empty")
    if len(set(cls)) != len(cls):
        raise ValueError(f"classes must be distinct, got {cls}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y must be 1-D with {x.shape[0]} labels, got shape {tuple(y.shape)}")
    cls_t = torch.tensor(cls, dtype=y.dtype, device=y.device)
    match = y.unsqueeze(1) == cls_t  # (N, C) one-hot of membership
    keep = match.any(dim=1)
    y_sub = match[keep].to(torch.int64).argmax(dim=1).to(y.dtype) if relabel else y[keep]
    return x[keep], y_sub
