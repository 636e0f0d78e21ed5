"""The networks the studies train: the ReLU MLP and the paper's Split CIFAR100 CNN."""

from __future__ import annotations

from torch import nn


def mlp(input_dim: int, width: int, depth: int, outputs: int) -> nn.Sequential:
    """ReLU MLP: Flatten, ``depth`` hidden Linear+ReLU layers of ``width``, Linear head."""
    layers: list[nn.Module] = [nn.Flatten()]
    last = input_dim
    for _ in range(depth):
        layers += [nn.Linear(last, width), nn.ReLU()]
        last = width
    layers.append(nn.Linear(last, outputs))
    return nn.Sequential(*layers)


def cifar_cnn(heads: int = 6, classes_per_head: int = 10) -> nn.Sequential:
    """The Split CIFAR100 CNN (Zenke et al. 2017, used by FROMP / S-FSVI), P = 1,276,508.

    conv3×3 32 ('same'), conv3×3 32 ('valid'), maxpool 2, conv3×3 64 ('same'),
    conv3×3 64 ('valid'), maxpool 2, dense 2304→512, and ``heads`` heads of
    ``classes_per_head`` outputs, stored as one Linear (same parameter count). Dropout is
    left out: it holds no parameters and no statistics.
    """
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 6 * 6, 512), nn.ReLU(),
        nn.Linear(512, heads * classes_per_head),
    )
