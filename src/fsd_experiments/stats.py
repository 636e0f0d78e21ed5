"""Statistics the studies share: k-means clustering of inputs (more helpers join here)."""

from __future__ import annotations

import torch
from torch import Tensor


def kmeans_labels(x: Tensor, k: int, *, iters: int = 100, seed: int = 0) -> Tensor:
    """Cluster the rows of ``x`` (n, ...) into ``k`` groups (k-means++ start, Lloyd steps).

    For unlabelled data (e.g. regression inputs), the labels make a k-component mixture
    summary: pass ``(x, labels)`` batches to ``fit`` with ``classwise=True``. Returns int64
    labels (n,) in 0..k−1; deterministic for a given ``seed``.
    """
    flat = x.reshape(x.shape[0], -1).to(torch.float64)
    n = flat.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in 1..{n} (the number of rows), got {k}")
    g = torch.Generator().manual_seed(seed)
    centers = flat[torch.randint(n, (1,), generator=g)]
    for _ in range(1, k):  # k-means++: next center drawn ∝ squared distance to the nearest
        d2 = torch.cdist(flat, centers).pow(2).min(dim=1).values
        pick = torch.multinomial(d2, 1, generator=g) if d2.sum() > 0 else \
            torch.randint(n, (1,), generator=g)
        centers = torch.cat([centers, flat[pick]])
    labels = torch.cdist(flat, centers).argmin(dim=1)
    for _ in range(iters):
        for j in range(k):
            members = labels == j
            if members.any():  # an emptied cluster keeps its old center
                centers[j] = flat[members].mean(dim=0)
        new = torch.cdist(flat, centers).argmin(dim=1)
        if torch.equal(new, labels):
            break
        labels = new
    return labels
