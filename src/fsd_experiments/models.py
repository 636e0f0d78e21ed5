"""The networks the studies train: the ReLU MLP, the paper's Split CIFAR100 CNN, a small ResNet."""

from __future__ import annotations

import torch
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


def conv_net(input_shape: tuple[int, int, int], outputs: int, *,
             dropout: bool = True, pool: str = "max") -> nn.Sequential:
    """The Split CIFAR100 CNN (Zenke et al. 2017, as in FROMP / S-FSVI) for any image shape.

    conv3×3 32 ('same'), conv3×3 32 ('valid'), maxpool 2, [dropout 0.25], conv3×3 64
    ('same'), conv3×3 64 ('valid'), maxpool 2, [dropout 0.25], dense → 512, [dropout 0.5],
    and one Linear of ``outputs`` units (all heads of a multi-head benchmark side by side).
    The dense layer's input size follows from ``input_shape`` (C, H, W): 64·6·6 for 3×32×32,
    64·5·5 for 1×28×28.

    Dropout is FROMP's. The estimators treat it as the identity: they measure the function
    at evaluation, where dropout is off (``fsd.model.rules``). ``pool="avg"`` puts
    ``AvgPool2d(2)`` in place of both max-pools: a network whose only gates are its ReLUs,
    for telling a max-pool's routing apart from the gates in an estimator's error.
    """
    if pool not in ("max", "avg"):
        raise ValueError(f"pool must be 'max' or 'avg', got {pool!r}")
    channels = input_shape[0]

    def pooling() -> nn.Module:
        return nn.MaxPool2d(2) if pool == "max" else nn.AvgPool2d(2)

    def drop(p: float) -> list[nn.Module]:
        return [nn.Dropout(p)] if dropout else []

    features = nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3), nn.ReLU(), pooling(), *drop(0.25),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3), nn.ReLU(), pooling(), *drop(0.25),
        nn.Flatten())
    with torch.no_grad():  # the flattened size of one input, whatever its height and width
        flat = int(features(torch.zeros(1, *input_shape)).shape[1])
    return nn.Sequential(
        *features, nn.Linear(flat, 512), nn.ReLU(), *drop(0.5), nn.Linear(512, outputs))


def cifar_cnn(heads: int = 6, classes_per_head: int = 10, *,
              dropout: bool = True) -> nn.Sequential:
    """The Split CIFAR100 CNN on 3×32×32 inputs with ``heads`` heads: P = 1,276,508 for 6.

    :func:`conv_net` with ``heads × classes_per_head`` outputs, stored as one Linear (same
    parameter count); dropout holds no parameters.
    """
    return conv_net((3, 32, 32), heads * classes_per_head, dropout=dropout)


class BasicBlock(nn.Module):
    """torchvision's ResNet block without BatchNorm: conv3×3, ReLU, conv3×3, + shortcut, ReLU.

    The shortcut is the identity, or a strided conv1×1 where the shape changes (torchvision's
    ``downsample``).
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.downsample = (nn.Conv2d(inplanes, planes, 1, stride=stride)
                           if stride != 1 or inplanes != planes else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """relu(conv2(relu(conv1(x))) + shortcut(x))."""
        return self.relu2(self.conv2(self.relu1(self.conv1(x))) + self.downsample(x))


class ResidualNet(nn.Module):
    """A small torchvision-style ResNet for any image shape: the residual CNN of ``fsd cl``.

    Stem conv3×3 16 + ReLU + max-pool 2, a block of 16, a block of 32 at stride 2 with a conv1×1
    shortcut, adaptive average pooling to 1×1, and one Linear of ``outputs`` units (all heads
    side by side). No BatchNorm: while later tasks train, its running statistics would move
    under the summaries of earlier tasks, which model the network at their own task's end.
    P = 19,562 + 33·(outputs − 10) on one-channel images.
    """

    def __init__(self, input_shape: tuple[int, int, int], outputs: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(input_shape[0], 16, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(32, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of all heads."""
        x = self.pool(self.relu(self.stem(x)))
        return self.fc(self.flatten(self.avgpool(self.layer2(self.layer1(x)))))
