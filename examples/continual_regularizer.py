"""Continual learning in your own training loop with ``fsd.ContinualRegularizer``.

Three tasks arrive one after another: points in the plane, each task a different region,
each labelled by a different rule, all learned by one two-class network. Trained task after
task without a penalty, the network forgets the earlier rules. Over five seeds the BGLN-D
penalty keeps them on one seed only: on the others the third task's training moves an
earlier task's outputs while that task's summary reads a small fraction of the move (the
under-reading the user guide measures on Split MNIST's heads). The exact FSD on each task's
stored inputs, as large as the data, keeps every task on every seed.
LAFTR and BGLN read
``nn.Sequential`` models of the layers listed in the README; ExactFSD, NTK, EWC and KFAC take
any module. About a minute on a CPU::

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


PENALTIES = {
    # the recommended compact summary: a Gaussian of each task's inputs and its gate frequencies
    "BGLN-D": lambda: fsd.BGLN(deterministic=True, moments="corrected"),
    # the exact FSD on each task's stored training inputs: the oracle, as large as the data
    "ExactFSD": lambda: fsd.ExactFSD(),
}


def train(penalty: str | None, strength: float = 1.0, epochs: int = 10,
          seed: int = 0) -> tuple[list[float], list[float]]:
    """Train on the three tasks in order, with the penalty named (``None``: fine-tuning).

    Returns each task's test accuracy right after its own training and after all three.
    """
    torch.manual_seed(seed)
    train_sets = [make_task(c, a, 512, seed + i) for i, (c, a) in enumerate(TASKS)]
    test_sets = [make_task(c, a, 512, 100 + seed + i) for i, (c, a) in enumerate(TASKS)]
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    regularizer = None
    if penalty is not None:
        regularizer = fsd.ContinualRegularizer(PENALTIES[penalty], strength=strength)
    own = []
    for task, data in enumerate(train_sets):
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
        own.append(accuracy(model, test_sets[task]))
        if regularizer is not None:
            regularizer.end_task(model, loader)  # summary of this task at θ_t
    return own, [accuracy(model, data) for data in test_sets]


def main(seeds: range = range(5)) -> None:
    """Each method over ``seeds``: mean final accuracy and the largest loss of an old task."""
    print("after all three tasks: mean accuracy (%) and the most an earlier task lost "
          "(points), per seed")
    for penalty in (None, "BGLN-D", "ExactFSD"):
        cells = []
        for seed in seeds:
            own, final = train(penalty, seed=seed)
            lost = max(o - f for o, f in zip(own[:-1], final[:-1], strict=True))
            cells.append(f"{sum(final) / 3:5.1f} (−{max(lost, 0.0):4.1f})")
        print(f"{penalty or 'fine-tuning':12s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
