"""The continual-learning penalty inside a Lightning ``Trainer``: ``FSDCallback``.

The three tasks, network and settings of ``continual_regularizer.py``, trained by Lightning
with the user's ``LightningModule`` unchanged: the callback adds the penalty to every step and
fits each task's summary when the task ends (one ``Trainer`` per task, so Adam starts afresh
at each, where the plain loop keeps one). Needs ``pip install "fsd[lightning]"``; runs in
seconds::

    python examples/lightning_continual.py
"""

from __future__ import annotations

import logging
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from continual_regularizer import PENALTIES, TASKS, accuracy, make_model, make_task
from torch.utils.data import DataLoader

import fsd
from fsd.integrations.lightning import FSDCallback


class Classifier(L.LightningModule):
    """The user's module: a network, its loss and its optimizer; nothing of fsd in it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        """The data loss of one batch."""
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        """Adam, as the plain loop's."""
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def train(penalty: str | None, strength: float = 1.0, epochs: int = 10,
          seed: int = 0) -> tuple[list[float], list[float]]:
    """``continual_regularizer.train`` with Lightning: accuracies after each task and at the end."""
    torch.manual_seed(seed)
    train_sets = [make_task(c, a, 512, seed + i) for i, (c, a) in enumerate(TASKS)]
    test_sets = [make_task(c, a, 512, 100 + seed + i) for i, (c, a) in enumerate(TASKS)]
    module = Classifier()
    callbacks = []
    if penalty is not None:
        regularizer = fsd.ContinualRegularizer(PENALTIES[penalty], strength=strength)
        callbacks.append(FSDCallback(regularizer, network=lambda m: m.net))
    own = []
    for task, data in enumerate(train_sets):
        loader = DataLoader(data, batch_size=64, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(module, loader)
        own.append(accuracy(module.net, test_sets[task]))
        for callback in callbacks:
            callback.end_task(module, loader)  # this task's summary, at θ_t
    return own, [accuracy(module.net, data) for data in test_sets]


def main(seed: int = 0) -> None:
    """Fine-tuning, the BGLN-D penalty and the exact FSD on one seed, trained by Lightning."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # its start-up notes
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # one of Lightning's own
    print(f"accuracy of each task after all three (%), seed {seed}, trained by Lightning")
    for penalty in (None, "BGLN-D", "ExactFSD"):
        _, final = train(penalty, seed=seed)
        print(f"{penalty or 'fine-tuning':12s} " + "  ".join(f"{a:6.2f}" for a in final))


if __name__ == "__main__":
    main()
