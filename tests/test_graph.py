"""Models written as classes: traced with torch.fx into the same chain as an nn.Sequential.

Ground truth: every traced model computes the same function as an ``nn.Sequential`` holding
the same weights, so every estimator must give it the same distance (the Sequential path is
checked against brute force in test_estimators.py and test_chain.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsd
from fsd.model.plan import chain
from fsd.model.tracing import runnable, unwrap

DTYPE = torch.float64


class FunctionalMLP(nn.Module):
    """ReLUs as function calls, three spellings."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 9), nn.Linear(9, 7), nn.Linear(7, 3)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class MethodReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 9), nn.Linear(9, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


class FunctionalLeaky(nn.Module):
    """LeakyReLUs as function calls: positional and keyword slope."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 9), nn.Linear(9, 7), nn.Linear(7, 3)

    def forward(self, x):
        x = F.leaky_relu(self.fc1(x), 0.2)
        x = F.leaky_relu(self.fc2(x), negative_slope=0.05)
        return self.fc3(x)


class Wrapper(nn.Module):
    """A class that only wraps a Sequential (nested modules called in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 7), nn.ReLU())
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(self.body(x))


class MySequential(nn.Sequential):
    """A Sequential subclass (refused before tracing existed)."""


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(3 * 3 * 3, 4)

    def forward(self, x):
        x = self.pool(F.relu(self.conv(x)))
        return self.fc(x.view(x.size(0), -1))


def _sequential_twin(model: nn.Module) -> nn.Sequential:
    """The same weights as a plain nn.Sequential."""
    model = unwrap(model)
    if isinstance(model, (FunctionalMLP,)):
        layers = [model.fc1, nn.ReLU(), model.fc2, nn.ReLU(), model.fc3]
    elif isinstance(model, FunctionalLeaky):
        layers = [model.fc1, nn.LeakyReLU(0.2), model.fc2, nn.LeakyReLU(0.05), model.fc3]
    elif isinstance(model, MethodReLU):
        layers = [model.fc1, nn.ReLU(), model.fc2]
    elif isinstance(model, Wrapper):
        layers = [*model.body, model.head]
    elif isinstance(model, MySequential):
        layers = list(model)
    elif isinstance(model, SmallCNN):
        layers = [model.conv, nn.ReLU(), model.pool, nn.Flatten(), model.fc]
    else:
        raise AssertionError(type(model))
    return copy.deepcopy(nn.Sequential(*layers))


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {
        "functional": FunctionalMLP, "leaky": FunctionalLeaky, "method": MethodReLU,
        "wrapper": Wrapper,
        "subclass": lambda: MySequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 3)),
        "cnn": SmallCNN,
    }[kind]().to(DTYPE)


def _inputs(kind: str, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    shape = (n, 1, 6, 6) if kind == "cnn" else (n, 5)
    return torch.randn(shape, generator=g, dtype=DTYPE)


def _moved(model: nn.Module, seed: int = 2) -> nn.Module:
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return moved


ESTIMATORS = {
    "laftr": lambda: fsd.LAFTR(inputs="coreset"),
    "laftr-gaussian": lambda: fsd.LAFTR(inputs="gaussian", num_samples=16, seed=3),
    "bgln-s": lambda: fsd.BGLN(num_samples=16, seed=3),
    "bgln-d": lambda: fsd.BGLN(deterministic=True),
    "bgln-d-exact": lambda: fsd.BGLN(deterministic=True, moments="exact"),
}
MLP_KINDS = ["functional", "leaky", "method", "wrapper", "subclass"]


# exact moments are for MLPs only (on convolutions they would carry (C·H·W)² moments)
@pytest.mark.parametrize("kind, name", [
    (kind, name) for kind in [*MLP_KINDS, "cnn"] for name in sorted(ESTIMATORS)
    if not (kind == "cnn" and name == "bgln-d-exact")])
def test_a_traced_model_gets_the_distance_of_its_sequential_twin(kind, name):
    model = _build(kind)
    x = _inputs(kind)
    moved = _moved(model)
    got = ESTIMATORS[name]().fit(model, x).distance(moved)
    expected = ESTIMATORS[name]().fit(_sequential_twin(model), x).distance(
        _sequential_twin(moved))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-14)
    assert float(expected) > 0


@pytest.mark.parametrize("wrap", ["compile", "ddp"])
def test_wrappers_are_looked_through(wrap, tmp_path):
    model = _build("functional")
    x = _inputs("functional")
    moved = _moved(model)
    expected = fsd.BGLN(deterministic=True).fit(model, x).distance(moved)
    if wrap == "compile":
        wrapped, wrapped_moved = torch.compile(model), torch.compile(moved)
    else:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
        wrapped = nn.parallel.DistributedDataParallel(model)
        wrapped_moved = nn.parallel.DistributedDataParallel(moved)
    try:
        for make in (lambda: fsd.BGLN(deterministic=True), fsd.ExactFSD, fsd.EWC):
            fitted = make().fit(wrapped, x)
            torch.testing.assert_close(fitted.distance(wrapped_moved),
                                       make().fit(model, x).distance(moved), rtol=1e-10, atol=0)
        torch.testing.assert_close(
            fsd.BGLN(deterministic=True).fit(wrapped, x).distance(moved), expected,
            rtol=1e-10, atol=0)
    finally:
        if wrap == "ddp":
            torch.distributed.destroy_process_group()


def test_chain_paths_are_module_paths_and_node_names():
    steps = chain(_build("cnn"))
    assert [(s.path, type(s.module).__name__, s.replaced_call) for s in steps] == [
        ("conv", "Conv2d", False), ("relu", "ReLU", True), ("pool", "MaxPool2d", False),
        ("view", "Flatten", True), ("fc", "Linear", False)]
    assert [s.path for s in chain(_build("wrapper"))] == ["body.0", "body.1", "body.2",
                                                          "body.3", "head"]


def test_runnable_computes_the_model_with_a_module_at_every_step():
    model = _build("cnn")
    runner = runnable(model)
    x = _inputs("cnn", 5)
    torch.testing.assert_close(runner(x), model(x), rtol=0, atol=0)
    assert isinstance(runner.get_submodule("relu"), nn.ReLU)
    assert runner.get_parameter("conv.weight") is model.conv.weight  # shared, not copied
    plain = _build("wrapper")
    assert runnable(plain) is plain


def test_statistics_collector_needs_modules_and_says_so():
    with pytest.raises(fsd.UnsupportedModuleError, match=r"'relu' is a function call.*fit\("):
        fsd.StatisticsCollector(_build("functional"))
    model = _build("wrapper")  # nn.ReLU modules: recording during training works
    x = _inputs("wrapper")
    with fsd.StatisticsCollector(model) as collector:
        with collector.record():
            model(x)
        from_training = fsd.BGLN(deterministic=True).fit(model, statistics=collector)
    moved = _moved(model)
    torch.testing.assert_close(from_training.distance(moved),
                               fsd.BGLN(deterministic=True).fit(model, x).distance(moved),
                               rtol=1e-12, atol=0)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.out(x + self.fc2(F.relu(self.fc1(x))))


class SoftmaxMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 9), nn.Linear(9, 3)

    def forward(self, x):
        return self.fc2(torch.softmax(self.fc1(x), dim=-1))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


@pytest.mark.parametrize("model,message", [
    (Residual(), r"not a chain of layers at graph node 'add'.*ExactFSD, NTK, EWC or KFAC on "
                r"any model$"),
    (SoftmaxMLP(), r"operation softmax \(call_function\) at graph node 'softmax'.*register_rule"),
    (DataDependent(), r"cannot trace DataDependent\.forward"),
])
def test_models_beyond_a_chain_get_one_error_that_says_what_to_do(model, message):
    with pytest.raises(fsd.UnsupportedModuleError, match=message) as info:
        fsd.BGLN(deterministic=True).fit(model, torch.randn(8, 5))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make", [fsd.ExactFSD, lambda: fsd.NTK(coreset_size=None), fsd.EWC,
                                  fsd.KFAC])
def test_estimators_that_run_the_forward_take_a_residual_model(make):
    model = Residual().to(DTYPE)
    x = torch.randn(30, 5, dtype=DTYPE)
    value = make().fit(model, x).distance(_moved(model))
    assert torch.isfinite(value) and float(value) > 0


def test_a_module_called_twice_is_refused():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(5, 5)

        def forward(self, x):
            return self.fc(F.relu(self.fc(x)))

    with pytest.raises(fsd.UnsupportedModuleError, match="called twice"):
        fsd.BGLN(deterministic=True).fit(Twice(), torch.randn(4, 5))


def test_a_changed_submodule_is_traced_again():
    model = _build("functional")
    assert [s.path for s in chain(model)][:2] == ["fc1", "relu"]
    model.fc2 = nn.Sequential(nn.Linear(9, 7), nn.Softmax(dim=-1))
    with pytest.raises(fsd.UnsupportedModuleError, match=r"Softmax at 'fc2\.1'"):
        fsd.trace(model)


def test_a_rule_registered_after_a_model_was_read_is_seen(monkeypatch):
    from fsd.model import plan, rules

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.scale = nn.Linear(2, 3), Scale()

        def forward(self, x):
            return self.scale(self.inp(x))

    monkeypatch.setattr(rules, "RULES", dict(rules.RULES))
    model = Net()
    with pytest.raises(fsd.UnsupportedModuleError):
        fsd.trace(model)  # the multiplication inside Scale has no rule
    fsd.register_rule(Scale, fsd.AffineRule(apply=lambda m, x, w, b: x * w,
                                            dense=torch.diag_embed))
    assert [layer.path for layer in fsd.trace(model)] == ["inp", "scale"]
    assert plan.read(model) is plan.read(model)  # read once, then shared


def test_a_model_with_a_forward_of_its_own_is_freed():
    import gc
    import weakref

    from fsd.model import plan

    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    model.forward = model.forward  # a bound method in the instance's dict
    assert len(plan.read(model).graph.nodes) > 0
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
