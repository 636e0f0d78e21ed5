"""The model zoo of ``tests/test_model_zoo.py``: models written the way their sources write them.

Shared with ``benchmarks/model_zoo.py`` (the docs table) and ``benchmarks/model_zoo_costs.py``
(fit and distance cost against a training step), so the three cannot drift apart. Every
model is tiny and float64; :data:`MODELS` maps a name to ``(build, inputs, call)`` where
``call`` holds the ``fit`` keyword arguments (``output=``, ``forward_kwargs=``) the model
needs, and :data:`ESTIMATORS` maps the estimators of the docs table to factories.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import fsd
from fsd.model.rules import UnsupportedModuleError

DTYPE = torch.float64
N = 8  # examples per model: every estimator fits on all of them (coresets keep them all)


# ----------------------------------------------------------------------------------------
# ResNets (torchvision's layout; He et al. 2016 pre-activation)
# ----------------------------------------------------------------------------------------
def _conv3x3(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock, as written there."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet18(nn.Module):
    """torchvision.models.resnet18's layout ([2, 2, 2, 2] BasicBlocks) at tiny widths.

    7×7 stride-2 stem, BatchNorm, in-place ReLU, 3×3 stride-2 max-pool, four stages with
    1×1 conv + BatchNorm downsamples, adaptive average pooling, ``torch.flatten``, ``fc``.
    """

    def __init__(self, widths: tuple[int, ...] = (4, 4, 6, 6), classes: int = 3) -> None:
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(widths[0], 2)
        self.layer2 = self._make_layer(widths[1], 2, stride=2)
        self.layer3 = self._make_layer(widths[2], 2, stride=2)
        self.layer4 = self._make_layer(widths[3], 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3], classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        return torch.flatten(x, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class PreActBlock(nn.Module):
    """Pre-activation BasicBlock (He et al. 2016, "Identity mappings"), kuangliu's layout."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if hasattr(self, "shortcut") else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        out += shortcut
        return out


class PreActResNet(nn.Module):
    """A pre-activation ResNet: stem conv, two stages of PreActBlocks, BN-ReLU, pool, linear."""

    def __init__(self, widths: tuple[int, int] = (4, 6), classes: int = 3) -> None:
        super().__init__()
        self.conv1 = _conv3x3(3, widths[0])
        self.layer1 = PreActBlock(widths[0], widths[0])
        self.layer2 = PreActBlock(widths[0], widths[1], stride=2)
        self.bn = nn.BatchNorm2d(widths[1])
        self.linear = nn.Linear(widths[1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(x)
        out = self.layer2(self.layer1(out))
        out = F.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1)
        out = out.view(out.size(0), -1)
        return self.linear(out)


class MultiHeadResNet(nn.Module):
    """The multi-head continual-learning network: a shared ResNet body, one head per task."""

    def __init__(self, tasks: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.body = PreActResNet(classes=classes)
        self.body.linear = nn.Identity()  # type: ignore[assignment]
        self.heads = nn.ModuleList(nn.Linear(6, classes) for _ in range(tasks))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.body(x))


# ----------------------------------------------------------------------------------------
# transformers and friends
# ----------------------------------------------------------------------------------------
class ViT(nn.Module):
    """A vision transformer as in the ViT paper / timm: conv patch embedding, cls token,
    a positional ``nn.Parameter``, ``nn.TransformerEncoderLayer`` blocks, LayerNorm, head."""

    def __init__(self, image: int = 8, patch: int = 4, dim: int = 8, depth: int = 1,
                 heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        tokens = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens + 1, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, tokens, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class SequenceTransformer(nn.Module):
    """A ``nn.TransformerEncoder`` classifier on (batch, length, features) sequences."""

    def __init__(self, features: int = 4, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(features, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=16, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(self.proj(x)).mean(dim=1))


class MixerBlock(nn.Module):
    """MLP-Mixer block (Tolstikhin et al. 2021): token mixing, then channel mixing."""

    def __init__(self, tokens: int, dim: int, hidden: int = 8) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mix = nn.Sequential(nn.Linear(tokens, hidden), nn.GELU(),
                                       nn.Linear(hidden, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mix = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(),
                                         nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class Mixer(nn.Module):
    """MLP-Mixer: patch embedding, Mixer blocks, LayerNorm, global average pool, head."""

    def __init__(self, image: int = 8, patch: int = 4, dim: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        tokens = (image // patch) ** 2
        self.blocks = nn.Sequential(MixerBlock(tokens, dim), MixerBlock(tokens, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


# ----------------------------------------------------------------------------------------
# sequences: token ids, Conv1d
# ----------------------------------------------------------------------------------------
VOCAB, LENGTH = 11, 5


class RNNClassifier(nn.Module):
    """The PyTorch text-classification tutorial's shape: Embedding, LSTM/GRU, last state, fc."""

    def __init__(self, cell: str = "lstm", dim: int = 4, hidden: int = 5,
                 classes: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, dim)
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(dim, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.embedding(tokens))
        return self.fc(output[:, -1])


class Conv1dNet(nn.Module):
    """A 1-D CNN on (batch, channels, length) signals: Conv1d-BN-ReLU, max-pool, global pool."""

    def __init__(self, channels: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, 4, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm1d(4)
        self.pool = nn.MaxPool1d(2)
        self.conv2 = nn.Conv1d(4, 5, kernel_size=3, padding=1)
        self.fc = nn.Linear(5, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean(dim=-1))


# ----------------------------------------------------------------------------------------
# MLPs: dict output, parametrizations, plain
# ----------------------------------------------------------------------------------------
class DictOutput(nn.Module):
    """Returns ``{"logits": …, "hidden": …}`` as Hugging Face models return a ModelOutput."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU())
        self.classifier = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.encoder(x)
        return {"logits": self.classifier(hidden), "hidden": hidden}


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(),
                         nn.Linear(5, 3))


def weight_norm_mlp() -> nn.Sequential:
    model = mlp()
    for i in (0, 2, 4):
        parametrizations.weight_norm(model[i])
    return model


def spectral_norm_mlp() -> nn.Sequential:
    model = mlp()
    for i in (0, 2, 4):
        parametrizations.spectral_norm(model[i])
    return model


def small_cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(16, 3))


# ----------------------------------------------------------------------------------------
# the zoo
# ----------------------------------------------------------------------------------------
@dataclass
class Zoo:
    """One model of the zoo: how to build it, its inputs and how ``fit`` must call it."""

    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], torch.Tensor]
    call: dict[str, Any] = field(default_factory=dict)  # fit(..., **call)
    wrap: str | None = None  # "compile" or "ddp": the estimators get the wrapped model


def _images(size: int = 8) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(N, 3, size, size, generator=g, dtype=DTYPE)


def _tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (N, LENGTH), generator=g)


def _vectors(g: torch.Generator) -> torch.Tensor:
    return torch.randn(N, 6, generator=g, dtype=DTYPE)


MODELS: dict[str, Zoo] = {
    "mlp": Zoo(mlp, _vectors),
    "cnn": Zoo(small_cnn, _images()),
    "resnet18": Zoo(ResNet18, _images(16)),
    "preact-resnet": Zoo(PreActResNet, _images()),
    "multihead-resnet": Zoo(MultiHeadResNet, _images(), {"forward_kwargs": {"task": 1}}),
    "vit": Zoo(ViT, _images()),
    "transformer-encoder": Zoo(SequenceTransformer,
                               lambda g: torch.randn(N, LENGTH, 4, generator=g, dtype=DTYPE)),
    "mlp-mixer": Zoo(Mixer, _images()),
    "lstm-text": Zoo(lambda: RNNClassifier("lstm"), _tokens),
    "gru-text": Zoo(lambda: RNNClassifier("gru"), _tokens),
    "conv1d": Zoo(Conv1dNet, lambda g: torch.randn(N, 2, 8, generator=g, dtype=DTYPE)),
    "dict-output": Zoo(DictOutput, _vectors, {"output": "logits"}),
    "weight-norm-mlp": Zoo(weight_norm_mlp, _vectors),
    "spectral-norm-mlp": Zoo(spectral_norm_mlp, _vectors),
    "compiled-mlp": Zoo(mlp, _vectors, wrap="compile"),
    "ddp-cnn": Zoo(small_cnn, _images(), wrap="ddp"),
}

DESCRIPTIONS = {
    "mlp": "`nn.Sequential` MLP (Linear, ReLU)",
    "cnn": "`nn.Sequential` CNN (Conv2d, ReLU, MaxPool2d, AvgPool2d, Flatten, Linear)",
    "resnet18": "torchvision ResNet-18 layout (BasicBlock, `ReLU(inplace=True)` called twice, "
                "1×1 downsample, BatchNorm, adaptive pool)",
    "preact-resnet": "pre-activation ResNet (`F.relu`, `out += shortcut`, `F.adaptive_avg_pool2d`)",
    "multihead-resnet": "multi-head CL ResNet `forward(x, task)`, pre-activation body "
                        "(`forward_kwargs={\"task\": 1}`)",
    "vit": "ViT (patch Conv2d, cls token, positional `nn.Parameter`, "
           "`nn.TransformerEncoderLayer`, LayerNorm)",
    "transformer-encoder": "`nn.TransformerEncoder` sequence classifier (dropout, mean pool)",
    "mlp-mixer": "MLP-Mixer (token and channel mixing, LayerNorm, GELU)",
    "lstm-text": "LSTM text classifier on token ids (`nn.Embedding`)",
    "gru-text": "GRU text classifier on token ids (`nn.Embedding`)",
    "conv1d": "Conv1d net (Conv1d, BatchNorm1d, `F.relu`, MaxPool1d, mean pool)",
    "dict-output": "dict output `{\"logits\": …, \"hidden\": …}` (`output=\"logits\"`)",
    "weight-norm-mlp": "MLP with `parametrizations.weight_norm`",
    "spectral-norm-mlp": "MLP with `parametrizations.spectral_norm`",
    "compiled-mlp": "`torch.compile(mlp)`",
    "ddp-cnn": "`DistributedDataParallel(cnn)`",
}

ESTIMATORS: dict[str, Callable[[], fsd.Estimator]] = {
    "ExactFSD": lambda: fsd.ExactFSD(),
    "LAFTR": lambda: fsd.LAFTR(coreset_size=None),
    "BGLN-S": lambda: fsd.BGLN(covariance="full", num_samples=64),
    "BGLN-D": lambda: fsd.BGLN(deterministic=True, covariance="full"),
    "BGLN-D exact": lambda: fsd.BGLN(deterministic=True, moments="exact", covariance="full"),
    "BGLN-D corrected": lambda: fsd.BGLN(deterministic=True, moments="corrected",
                                         covariance="full"),
    "NTK": lambda: fsd.NTK(coreset_size=None),
    "EWC": lambda: fsd.EWC(),
    "KFAC": lambda: fsd.KFAC(),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """The model (float64, eval mode, non-trivial BatchNorm statistics) and its inputs."""
    torch.manual_seed(seed)
    model = MODELS[name].build().to(DTYPE)
    with torch.no_grad():  # BatchNorm that is not the identity
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.2, 0.2)  # type: ignore[union-attr]
                m.running_var.uniform_(0.5, 1.5)  # type: ignore[union-attr]
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    model.eval()
    return model, MODELS[name].inputs(torch.Generator().manual_seed(seed + 100))


def moved(model: nn.Module, scale: float = 0.05, seed: int = 5) -> nn.Module:
    """A deep copy of ``model`` with N(0, scale²) noise added to every parameter."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return other


@contextlib.contextmanager
def wrapped(name: str, *models: nn.Module) -> Iterator[list[nn.Module]]:
    """The models as the zoo entry hands them to the estimators (compiled, in DDP)."""
    wrap = MODELS[name].wrap
    if wrap is None:
        yield list(models)
    elif wrap == "compile":
        yield [torch.compile(m) for m in models]  # type: ignore[misc]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            torch.distributed.init_process_group(
                "gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0,
                world_size=1)
            try:
                yield [nn.parallel.DistributedDataParallel(m) for m in models]
            finally:
                torch.distributed.destroy_process_group()


def outcome(error: BaseException | None) -> str:
    """A cell of the table: ``"✓"`` or ``"refused: <the one-line message>"``."""
    return "✓" if error is None else f"refused: {error}"


def fit(estimator: str, model: nn.Module, name: str, x: torch.Tensor
        ) -> tuple[fsd.Estimator | None, Exception | None]:
    """Fit one cell: the summary, or the error it was refused with.

    A refusal is a ``ValueError``, an ``UnsupportedModuleError`` (a ``TypeError``: a model
    the graph walkers cannot walk) or a ``NotImplementedError`` (a walk not written yet).
    """
    try:
        return ESTIMATORS[estimator]().fit(model, x, **MODELS[name].call), None
    except (ValueError, UnsupportedModuleError, NotImplementedError) as error:
        return None, error


def markdown(table: dict[str, dict[str, str]]) -> str:
    """The docs table of ``{model: {estimator: cell}}``: ✓ or a footnoted refusal."""
    names = list(ESTIMATORS)
    lines = ["| model | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    notes: list[str] = []
    for model, row in table.items():
        cells = []
        for estimator in names:
            cell = row[estimator]
            if cell == "✓":
                cells.append("✓")
                continue
            message = cell.removeprefix("refused: ")
            if message not in notes:
                notes.append(message)
            cells.append(f"refused ({notes.index(message) + 1})")
        lines.append(f"| {DESCRIPTIONS[model]} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{i}. `{message}`" for i, message in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"
