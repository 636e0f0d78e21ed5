"""fsd.integrations.transformers against the installed Hugging Face Trainer (no mock).

Ground truth: the same Trainer run on a model whose forward adds the penalty to its own loss,
as the Trainer's documentation would have a user do by hand: per-batch losses (the Trainer
divides by the accumulation steps) and losses normalised by ``num_items_in_batch`` (it does
not; the penalty must then be divided by the steps). Same seed, same data order: the
parameters after the run must be equal (rtol 1e-6, float32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsd

transformers = pytest.importorskip("transformers")
from fsd.integrations.transformers import FSDTrainer  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.usefixtures("single_thread")
ACCUMULATE = 2


class Points(torch.utils.data.Dataset):
    """Labelled points as the dicts the Trainer's collator stacks."""

    def __init__(self, seed: int, n: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    """A classifier whose forward returns its loss; ``by_hand`` adds the penalty itself."""

    def __init__(self, by_hand: fsd.ContinualRegularizer | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        self.by_hand = by_hand

    def forward(self, x, labels=None):
        logits = self.body(x)
        loss = nn.functional.cross_entropy(logits, labels)
        if self.by_hand is not None and self.training:
            loss = loss + self.by_hand.penalty(self.body)
        return {"loss": loss, "logits": logits}


class SumNet(Net):
    """The loss summed and divided by ``num_items_in_batch`` (the Trainer then does not
    divide by the accumulation steps, so the penalty by hand is divided here)."""

    def forward(self, x, labels=None, **kwargs):
        logits = self.body(x)
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        loss = loss / kwargs["num_items_in_batch"]
        if self.by_hand is not None and self.training:
            loss = loss + self.by_hand.penalty(self.body) / ACCUMULATE
        return {"loss": loss, "logits": logits}


def _args(tmp_path) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8,
        gradient_accumulation_steps=ACCUMULATE, max_steps=3, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)


def _regularizer(model: Net) -> fsd.ContinualRegularizer:
    """One summary of task 0 at the model's parameters, which then move."""
    reg = fsd.ContinualRegularizer(lambda: fsd.BGLN(deterministic=True, moments="corrected"),
                                   strength=1.0)
    reg.end_task(model.body, torch.utils.data.DataLoader(Points(1), batch_size=16),
                 batch_to_input=lambda batch: (batch["x"], batch["labels"]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    return reg


@pytest.mark.parametrize("kind", [Net, SumNet], ids=["per-batch loss", "num_items_in_batch"])
def test_the_trainer_trains_as_a_model_adding_the_penalty_to_its_own_loss(kind, tmp_path):
    model = kind()
    reg = _regularizer(model)
    by_hand = copy.deepcopy(model)
    by_hand.by_hand = reg
    trainer = FSDTrainer(model=model, args=_args(tmp_path / "a"), train_dataset=Points(3),
                         regularizer=reg, network=lambda m: m.body)
    assert trainer.model_accepts_loss_kwargs is (kind is SumNet)
    trainer.train()
    transformers.Trainer(model=by_hand, args=_args(tmp_path / "b"),
                         train_dataset=Points(3)).train()
    for a, b in zip(model.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert trainer.last_penalty is not None and float(trainer.last_penalty) > 0


def test_without_summaries_or_in_evaluation_the_loss_is_the_models(tmp_path):
    model = Net()
    reg = fsd.ContinualRegularizer(lambda: fsd.LAFTR(), strength=1.0)
    trainer = FSDTrainer(model=model, args=_args(tmp_path), train_dataset=Points(3),
                         regularizer=reg, network=lambda m: m.body)
    batch = {"x": Points(4).x[:8], "labels": Points(4).y[:8]}
    assert torch.equal(trainer.compute_loss(model, dict(batch)), model(**batch)["loss"])
    reg.end_task(model.body, [(batch["x"], batch["labels"])])
    with torch.no_grad():
        model.body[0].weight.add_(0.5)
    own = model(**batch)["loss"]
    assert float(trainer.compute_loss(model, dict(batch))) > float(own)  # training: + penalty
    model.eval()
    assert torch.equal(trainer.compute_loss(model, dict(batch)), model(**batch)["loss"])
    with pytest.raises(TypeError, match="ContinualRegularizer"):
        FSDTrainer(model=model, args=_args(tmp_path), regularizer=object())
