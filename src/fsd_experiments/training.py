"""The one training loop of the studies: minibatch steps on a data loss plus an optional penalty.

Every driver trains through :func:`train`: the estimator comparison and the fidelity study
(Adam, cross-entropy), the continual-learning harness (Adam shared across tasks, the FSD
penalty of the previous tasks, statistics recorded in the last epoch), the influence studies
(SGD, stopping when the loss diverges) and the toy regression (full-batch Adam on squared
error). One step is always: ``zero_grad``, data loss, (divergence check), ``+ weight ·
penalty(model)``, ``backward``, ``optimizer.step``, then the step hook.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

#: a data loss: ``loss(model, x, y)`` → scalar tensor (it runs the forward pass itself)
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]

#: glibc's ``mallopt`` parameters (``<malloc.h>``)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: what :func:`keep_freed_memory` keeps: freed memory at the heap's top up to 256 MiB, and
#: blocks up to 32 MiB (glibc's largest mmap threshold) served from the heap
KEEP_FREED_BYTES, HEAP_BLOCK_BYTES = 256 << 20, 32 << 20


def keep_freed_memory() -> bool:
    """Let glibc's malloc reuse freed memory instead of handing it back to the system.

    A penalised step allocates and frees buffers of a few MB (e.g. one first-layer matrix per
    stored summary). By default glibc returns such memory to the kernel, and every step
    then pays a page fault per 4 KiB page to get it back: with four corrected BGLN-D
    summaries of the 784-256-256-10 MLP some 2,300 faults a step, and a quarter of its median
    time on a 2-core VM. This sets a fixed mmap threshold (32 MiB) and a trim threshold of
    256 MiB for the whole process, so memory stays mapped between steps. The numbers are
    unchanged: only where the buffers live.

    Returns whether it applied: ``False`` off Linux or without glibc's ``mallopt``.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # musl's mallopt exists and does nothing (returns 0)
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


def cross_entropy(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of ``model(x)`` against integer labels ``y``."""
    return nn.functional.cross_entropy(model(x), y)


def squared_error(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean squared error of ``model(x)`` against targets ``y`` (no ½)."""
    return (model(x) - y).pow(2).mean()


def minibatch_stream(x: Tensor, y: Tensor, batch_size: int, steps: int,
                     generator: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
    """``steps`` minibatches of rows, counted in steps rather than epochs.

    Rows are taken in the order of a permutation drawn from ``generator``; when fewer than
    ``batch_size`` remain, a fresh permutation is appended, so a batch can hold the end of
    one pass and the start of the next.
    """
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if order.numel() < batch_size:  # reshuffle when the epoch runs out
            order = torch.cat([order, torch.randperm(x.shape[0], generator=generator)])
        index, order = order[:batch_size], order[batch_size:]
        yield x[index], y[index]


def train(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], loss: LossFn,
          optimizer: torch.optim.Optimizer, *, epochs: int = 1,
          penalty: Callable[[nn.Module], Tensor] | None = None, weight: float = 0.0,
          on_epoch: Callable[[int], None] | None = None,
          on_step: Callable[[int], None] | None = None, stop_on_nonfinite: bool = False,
          device: torch.device | None = None, progress: bool = False,
          desc: str = "training", bar: Literal["batches", "epochs"] | None = "batches",
          mininterval: float = 0.1) -> bool:
    """Train ``model`` for ``epochs`` passes over ``batches``; ``False`` if it diverged.

    Args:
        model: put in train mode for the loop and in eval mode after it.
        batches: re-iterable of ``(x, y)`` minibatches; each pass is one epoch (e.g. a
            shuffling :class:`~fsd_experiments.data.TensorBatches`, ``[(x, y)]`` for full-batch
            steps, or one :func:`minibatch_stream` with ``epochs=1``).
        loss: the data loss ``loss(model, x, y)``.
        optimizer: built by the caller (it may carry state from earlier calls).
        epochs: passes over ``batches``.
        penalty: a regularizer ``penalty(model)``, added to the loss times ``weight``.
        weight: the penalty's weight; with ``0`` the penalty is not evaluated.
        on_epoch: called with the epoch index (from 0) before each epoch.
        on_step: called with the number of steps taken (from 1) after each step.
        stop_on_nonfinite: stop (returning ``False``) at the first non-finite data loss,
            before its backward pass.
        device: move each minibatch there first (``None``: leave it where it is).
        progress: show a tqdm bar.
        desc: the bar's description.
        bar: ``"batches"``, one bar per epoch over its batches described
            ``"{desc} epoch e/E"``; ``"epochs"``, one bar over the epochs; ``None``, no bar.
        mininterval: seconds between the bar's updates.
    """
    model.train()
    step = 0
    epoch_range: Iterable[int] = range(epochs)
    if bar == "epochs":
        epoch_range = tqdm(epoch_range, desc=desc, leave=False, disable=not progress)
    for epoch in epoch_range:
        if on_epoch is not None:
            on_epoch(epoch)
        passes: Iterable[tuple[Tensor, Tensor]] = batches
        if bar == "batches":
            passes = tqdm(batches, desc=f"{desc} epoch {epoch + 1}/{epochs}", leave=False,
                          disable=not progress, mininterval=mininterval)
        for x, y in passes:
            if device is not None:
                x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            value = loss(model, x, y)
            if stop_on_nonfinite and not torch.isfinite(value):
                model.eval()
                return False
            if penalty is not None and weight:
                value = value + weight * penalty(model)
            value.backward()
            optimizer.step()
            step += 1
            if on_step is not None:
                on_step(step)
    model.eval()
    return True
