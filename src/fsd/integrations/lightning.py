"""A Lightning callback that adds the continual-learning penalty to every training step.

::

    import lightning as L
    import fsd
    from fsd.integrations.lightning import FSDCallback

    reg = fsd.ContinualRegularizer(
        lambda: fsd.BGLN(deterministic=True, moments="corrected"), strength=0.1)
    callback = FSDCallback(reg, network=lambda module: module.net)
    for task in tasks:
        L.Trainer(max_epochs=2, callbacks=[callback]).fit(module, task.train_loader)
        callback.end_task(module, task.train_loader)   # this task's summary, at θ_t

Lightning's ``on_before_backward`` cannot change the loss, so the callback runs a second
backward pass, of the penalty, right after the loss's (``on_after_backward``), into the same
gradients, which the optimizer step then reads. It divides the penalty by
``accumulate_grad_batches``, as Lightning divides the loss, so that a step over k accumulated
batches adds the penalty's gradient once; under ``precision="16-mixed"`` it scales the penalty
with the trainer's gradient scaler, as the loss was, so that unscaling gives its true gradient;
the penalty itself runs outside autocast, in the parameters' dtype. One process only: a
distributed strategy would reduce the loss's gradients before the penalty's are added, and is
refused at ``fit``; there, add ``reg.penalty(net)`` to the loss in ``training_step``.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ..uses.regularizer import ContinualRegularizer

__all__ = ["FSDCallback"]


class FSDCallback(pl.Callback):
    """Adds ``regularizer.penalty(network)`` to every training step's gradients.

    Args:
        regularizer: the summaries of the finished tasks and the penalty's strength and
            reduction (:class:`fsd.ContinualRegularizer`); with no summary yet the callback
            does nothing, so the first task trains as without it.
        network: the network inside the LightningModule that the summaries measure (e.g.
            ``lambda module: module.net``); ``None``: the LightningModule itself.

    After each step :attr:`last_penalty` holds the penalty's value (``None`` before any).
    """

    def __init__(self, regularizer: ContinualRegularizer, *,
                 network: Callable[[pl.LightningModule], nn.Module] | None = None) -> None:
        if not isinstance(regularizer, ContinualRegularizer):
            raise TypeError(f"regularizer must be an fsd.ContinualRegularizer, got "
                            f"{type(regularizer).__name__}")
        self.regularizer = regularizer
        self.network = network
        self.last_penalty: Tensor | None = None

    def _network(self, module: pl.LightningModule) -> nn.Module:
        return module if self.network is None else self.network(module)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a distributed strategy in one line (the penalty's gradients would miss it)."""
        if stage == "fit" and trainer.world_size > 1:
            raise RuntimeError(
                f"FSDCallback adds the penalty's gradients after the loss's backward pass, "
                f"which a distributed strategy ({type(trainer.strategy).__name__}, "
                f"{trainer.world_size} processes) has already reduced; add "
                f"regularizer.penalty(network) to the loss in training_step instead")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Backpropagate λ·Σ D_t / accumulate_grad_batches (scaled as the loss was)."""
        if len(self.regularizer) == 0 or not torch.is_grad_enabled():
            return
        penalty = self.regularizer.penalty(self._network(pl_module))  # fsd runs it outside autocast
        scaled = penalty / trainer.accumulate_grad_batches
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed: the loss was scaled before its backward
            scaled = scaler.scale(scaled)
        scaled.backward()
        self.last_penalty = penalty.detach()

    def end_task(self, pl_module: pl.LightningModule, data: Any = None,
                 **fit_options: Any) -> Any:
        """Fit the finished task's summary of the network and keep it in the regularizer.

        :meth:`fsd.ContinualRegularizer.end_task` on ``network(pl_module)``; ``fit_options``
        go to it as they are (``outputs=``, ``statistics=``, ``forward_kwargs=``, …). Returns
        the new summary.
        """
        return self.regularizer.end_task(self._network(pl_module), data, **fit_options)
