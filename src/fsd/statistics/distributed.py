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

import contextlib
import hashlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn


class DistributedFitError(ValueError):
    """A rank cannot fit, or the ranks hold different reference networks.

    Raised on every rank with the same message, before any statistic is exchanged, so no
    rank is left waiting in a collective for one that failed.
    """


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
    with _collective():
        torch.distributed.all_gather_object(out, _to_cpu(obj))
    return out


def sum_tensors(tensors: dict[str, Tensor], count: int) -> tuple[dict[str, Tensor], int]:
    """Element-wise sums of ``tensors`` and of ``count`` over the ranks (same keys/shapes)."""
    if world_size() == 1:
        return tensors, count
    summed = {}
    device = next(iter(tensors.values())).device if tensors else None
    total = torch.tensor([count], dtype=torch.float64, device=device)
    with _collective():
        for key in sorted(tensors):  # one order on every rank
            value = tensors[key].detach().clone()
            torch.distributed.all_reduce(value)
            summed[key] = value
        torch.distributed.all_reduce(total)
    return summed, int(total.item())


@contextlib.contextmanager
def _collective() -> Iterator[None]:
    """A collective of fitting: a rank that failed or never joined, in one line.

    The backend's error (gloo's timeout after the process group's ``timeout``, a peer's
    closed connection) is many lines about sockets; what went wrong is that the ranks did
    not all reach this point.
    """
    try:
        yield
    except RuntimeError as error:  # torch.distributed.DistBackendError is one
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        raise DistributedFitError(
            f"rank {rank()} of {world_size()}: a collective of fit failed ({first[:200]}): "
            f"every rank must call fit, or record statistics, at the same point, and none may "
            f"exit or stall (one that never joins leaves the others waiting until the "
            f"process group's timeout)") from None


def state_digests(model: nn.Module) -> list[tuple[str, str]]:
    """A hash of each parameter and floating-point buffer of ``model`` (θ0 as ``fit`` stores it).

    Equal lists mean bit-identical tensors (values, shapes and dtypes), in named order.
    """
    out = []
    named = [(f"parameter '{n}'", t) for n, t in model.named_parameters()]
    named += [(f"buffer '{n}'", t) for n, t in model.named_buffers() if t.is_floating_point()]
    for name, tensor in named:
        flat = tensor.detach().reshape(-1).cpu().contiguous()
        digest = hashlib.blake2b(f"{flat.dtype}{tuple(tensor.shape)}".encode(), digest_size=16)
        digest.update(flat.view(torch.uint8).numpy().tobytes())  # any dtype, bfloat16 too
        out.append((name, digest.hexdigest()))
    return out


def agree_to_fit(failure: BaseException | None, model: nn.Module | None) -> None:
    """Check, on every rank at once, that each rank can fit and all hold the same θ0.

    Every rank calls it after its own checks (``failure`` is what they raised, ``model``
    ``None`` then) and before the first collective of fitting. A rank's failure (no data,
    data the model cannot run on, ...) or θ0 that differs between ranks raises
    :class:`DistributedFitError` with the same one-line message on every rank — instead of
    that rank alone raising while the others wait in a collective until the timeout, or
    summaries of different networks being merged. Does nothing when not distributed.
    """
    if world_size() == 1:
        return
    message = None
    if failure is not None:
        text = str(failure).strip()
        message = text.splitlines()[0] if text else type(failure).__name__
    digests = state_digests(model) if failure is None and model is not None else None
    reports = gather_objects((message, digests))
    size = len(reports)
    for index, (reason, _) in enumerate(reports):
        if reason is not None:
            raise DistributedFitError(f"rank {index} of {size} cannot fit: {reason}")
    first = reports[0][1]
    for index, (_, theirs) in enumerate(reports[1:], start=1):
        if theirs != first:
            assert first is not None and theirs is not None  # no failure: every rank hashed
            where = next((a[0] for a, b in zip(first, theirs, strict=False) if a != b),
                         "the list of parameters")
            raise DistributedFitError(
                f"the ranks hold different reference networks: {where} on rank {index} of "
                f"{size} differs from rank 0's; every rank must fit the same θ0 (load or "
                f"broadcast the same weights before fit)")


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
