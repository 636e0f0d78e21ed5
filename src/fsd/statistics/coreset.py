"""Coresets: a uniform random subset of a data stream, also across torch.distributed ranks."""

from __future__ import annotations

import torch
from torch import Tensor

from . import distributed


class Reservoir:
    """Uniform random subset of a stream (reservoir sampling), or all of it if size is None."""

    def __init__(self, size: int | None, generator: torch.Generator) -> None:
        if size is not None and size < 1:
            raise ValueError(f"coreset_size must be a positive int or None, got {size}")
        self.size, self.generator, self.seen = size, generator, 0
        self.x: list[Tensor] = []
        self.y: list[Tensor | None] = []
        # under torch.distributed each rank samples its shard with its own stream, and the
        # union is sampled with the shared seed (tensors())
        self._shared_seed = generator.initial_seed()
        if distributed.world_size() > 1:
            generator.manual_seed(self._shared_seed + 1 + distributed.rank())

    def add(self, x: Tensor, y: Tensor | None) -> None:
        """Offer a batch to the reservoir."""
        for i in range(x.shape[0]):
            item_y = None if y is None else y[i]
            if self.size is None or len(self.x) < self.size:
                self.x.append(x[i].clone())
                self.y.append(item_y)
            else:
                j = int(torch.randint(self.seen + 1, (1,), generator=self.generator))
                if j < self.size:
                    self.x[j], self.y[j] = x[i].clone(), item_y
            self.seen += 1

    def tensors(self) -> tuple[Tensor, Tensor | None]:
        """The kept inputs (N, *shape) and labels (N,) or None.

        Under torch.distributed: a uniform sample of the union of all ranks' streams, the
        same on every rank (call it on every rank).
        """
        xs = torch.stack(self.x) if self.x else None
        labels = [v for v in self.y if v is not None]
        ys = torch.stack(labels) if labels and len(labels) == len(self.y) else None
        if distributed.world_size() > 1:
            return self._union_sample(xs, ys)
        if xs is None:
            raise ValueError("no data was offered to the coreset")
        return xs, ys

    def _union_sample(self, xs: Tensor | None, ys: Tensor | None
                      ) -> tuple[Tensor, Tensor | None]:
        parts = [p for p in distributed.gather_objects((xs, ys, self.seen)) if p[2] > 0]
        if not parts:
            raise ValueError("no data was offered to the coreset on any rank")
        device = (xs if xs is not None else parts[0][0]).device
        if self.size is None:  # everything, in rank order as one process would keep it
            x = torch.cat([p[0] for p in parts]).to(device)
            labelled = all(p[1] is not None for p in parts)
            return x, torch.cat([p[1] for p in parts]).to(device) if labelled else None
        # each rank holds a uniform sample of its shard; draw how many of the union's
        # sample come from each shard (sequentially, ∝ what is left of it), then which
        g = torch.Generator().manual_seed(self._shared_seed)
        orders = [torch.randperm(p[0].shape[0], generator=g) for p in parts]
        left = torch.tensor([float(p[2]) for p in parts], dtype=torch.float64)
        taken = [0] * len(parts)
        picks = []
        for _ in range(min(self.size, int(left.sum()))):
            r = int(torch.multinomial(left, 1, generator=g))
            picks.append((r, int(orders[r][taken[r]])))
            taken[r] += 1
            left[r] -= 1
        x = torch.stack([parts[r][0][i] for r, i in picks]).to(device)
        if any(parts[r][1] is None for r, _ in picks):
            return x, None
        return x, torch.stack([parts[r][1][i] for r, i in picks]).to(device)
