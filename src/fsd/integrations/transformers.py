"""A Hugging Face ``Trainer`` whose loss carries the continual-learning penalty.

::

    import fsd
    from fsd.integrations.transformers import FSDTrainer

    reg = fsd.ContinualRegularizer(lambda: fsd.BGLN(), strength=0.1)
    for task in tasks:
        trainer = FSDTrainer(model=model, args=args, train_dataset=task.train, regularizer=reg,
                             network=lambda model: model.classifier_body)
        trainer.train()
        reg.end_task(model.classifier_body, task.loader)   # this task's summary, at θ_t

``Trainer`` callbacks cannot change the loss, so the penalty enters in ``compute_loss``: the
loss of the model (or of ``compute_loss_func``) plus ``regularizer.penalty(network)``, in one
backward pass, which a distributed run reduces with the loss. Under gradient accumulation the
Trainer divides a per-batch loss by the accumulation steps itself, but not a loss the model
already normalised by ``num_items_in_batch`` over the whole accumulated batch; there
:class:`FSDTrainer` divides the penalty by the steps, so that every optimizer step adds it once.
The penalty runs outside autocast, in the parameters' dtype; evaluation losses do not carry it.
For another ``Trainer`` subclass, put this class first: ``class MyTrainer(FSDTrainer,
SFTTrainer)``. Needs ``pip install "fsd[transformers]"``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from transformers import Trainer

from ..uses.regularizer import ContinualRegularizer

__all__ = ["FSDTrainer"]


class FSDTrainer(Trainer):
    """``transformers.Trainer`` with λ·Σ D_t added to every training loss.

    Args:
        *args: what ``Trainer`` takes.
        regularizer: the summaries of the finished tasks, the penalty's strength and reduction
            (:class:`fsd.ContinualRegularizer`); with no summary yet the loss is the model's.
        network: the module the summaries measure, from the (unwrapped) model, e.g.
            ``lambda model: model.body``; ``None``: the model itself.
        **kwargs: what ``Trainer`` takes.

    After each training step :attr:`last_penalty` holds the penalty's value.
    """

    def __init__(self, *args: Any, regularizer: ContinualRegularizer,
                 network: Callable[[nn.Module], nn.Module] | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(regularizer, ContinualRegularizer):
            raise TypeError(f"regularizer must be an fsd.ContinualRegularizer, got "
                            f"{type(regularizer).__name__}")
        super().__init__(*args, **kwargs)
        self.regularizer = regularizer
        self.network = network
        self.last_penalty: Tensor | None = None

    def _scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Whether the Trainer leaves this loss undivided by the accumulation steps."""
        told = getattr(self, "loss_is_scaled_for_ga", None)  # a subclass's own answer
        if told is not None:
            return bool(told)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any],
                     return_outputs: bool = False, num_items_in_batch: Any = None
                     ) -> Tensor | tuple[Tensor, Any]:
        """The model's loss, plus the penalty while training (see the module docstring)."""
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        if len(self.regularizer) and model.training and torch.is_grad_enabled():
            unwrapped = self.accelerator.unwrap_model(model)
            network = unwrapped if self.network is None else self.network(unwrapped)
            penalty = self.regularizer.penalty(network)  # fsd runs it outside autocast
            self.last_penalty = penalty.detach()
            if self._scaled_for_accumulation(num_items_in_batch):
                penalty = penalty / self.current_gradient_accumulation_steps
            loss = loss + penalty
        return (loss, outputs) if return_outputs else loss
