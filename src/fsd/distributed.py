"""Fitting on torch.distributed: every rank iterates its own shard, all end with one summary.

When a default process group is initialised with more than one process, ``fit`` and
:class:`fsd.StatisticsCollector` combine what the ranks collected: moments, class-wise
moments and gate frequencies are merged exactly (the parallel form of the running mean and
covariance), Fisher diagonals and K-FAC factors are summed, ExactFSD's data is gathered, and
coresets are drawn as a uniform sample of the union that every rank draws identically. Each
rank then holds the summary a single process would fit on the union of the shards — up to
round-off, except coresets, which are a different uniform draw, and gate frequencies kept as
an exponential moving average (``momentum``), which are averaged over the ranks by count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def world_size() -> int:
    """Processes in the default group, or 1 when torch.distributed is not in use."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return torch.distributed.get_rank() if world_size() > 1 else 0


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` when not distributed).

    Tensors inside are moved to the CPU first, so any backend can carry them.
    """
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, _to_cpu(obj))
    return out


def sum_tensors(tensors: dict[str, Tensor], count: int) -> tuple[dict[str, Tensor], int]:
    """Element-wise sums of ``tensors`` and of ``count`` over the ranks (same keys/shapes)."""
    if world_size() == 1:
        return tensors, count
    summed = {}
    for key in sorted(tensors):  # one order on every rank
        value = tensors[key].detach().clone()
        torch.distributed.all_reduce(value)
        summed[key] = value
    device = next(iter(tensors.values())).device if tensors else None
    total = torch.tensor([count], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total)
    return summed, int(total.item())


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
