"""Continual learning in your own training loop with ``fsd.ContinualRegularizer``.

Three tasks arrive one after another: points in the plane, each task a different region,
each labelled by a different rule, all learned by one two-class network. Trained task after
task without a penalty, the network forgets the earlier rules; with the BGLN-D penalty (exact
moments) it keeps them. LAFTR and BGLN read ``nn.Sequential`` models of the layers listed in
the README; ExactFSD, NTK, EWC and KFAC take any module. Runs in seconds on a CPU::

    python examples/continual_regularizer.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fsd


def make_model() -> nn.Sequential:
    """A small classifier of 2-d points."""
    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 2))


def make_task(center: tuple[float, float], angle: float, n: int, seed: int) -> TensorDataset:
    """Points around ``center``; the label says on which side of a line through it they lie."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g) + torch.tensor(center)
    normal = torch.tensor([torch.cos(torch.tensor(angle)), torch.sin(torch.tensor(angle))])
    y = ((x - torch.tensor(center)) @ normal > 0).long()
    return TensorDataset(x, y)


TASKS = [((-4.0, 0.0), 0.0), ((4.0, 0.0), 1.6), ((0.0, 4.0), 3.1)]


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    """Percentage of correctly classified points."""
    x, y = data.tensors
    with torch.no_grad():
        return 100.0 * float((model(x).argmax(-1) == y).float().mean())


def train(penalty_strength: float | None, epochs: int = 10, seed: int = 0) -> list[float]:
    """Train on the three tasks in order; return the final accuracy on each."""
    torch.manual_seed(seed)
    train_sets = [make_task(c, a, 512, seed + i) for i, (c, a) in enumerate(TASKS)]
    test_sets = [make_task(c, a, 512, 100 + seed + i) for i, (c, a) in enumerate(TASKS)]
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    regularizer = None
    if penalty_strength is not None:
        regularizer = fsd.ContinualRegularizer(
            lambda: fsd.BGLN(deterministic=True, moments="exact"), strength=penalty_strength)
    for data in train_sets:
        loader = DataLoader(data, batch_size=64, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        for _ in range(epochs):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                if regularizer is not None:
                    loss = loss + regularizer.penalty(model)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        if regularizer is not None:
            regularizer.end_task(model, loader)  # summary of this task at θ_t
    return [accuracy(model, data) for data in test_sets]


def main() -> None:
    """Print each task's final accuracy with and without the penalty."""
    plain = train(None)
    kept = train(penalty_strength=1.0)
    print("task accuracies after all three tasks (%)")
    print("fine-tuning:    " + "  ".join(f"{a:6.2f}" for a in plain)
          + f"   mean {sum(plain) / 3:6.2f}")
    print("BGLN-D penalty: " + "  ".join(f"{a:6.2f}" for a in kept)
          + f"   mean {sum(kept) / 3:6.2f}")


if __name__ == "__main__":
    main()
