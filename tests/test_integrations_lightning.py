"""fsd.integrations.lightning against the installed Lightning (no mock of the framework).

Ground truth: the same training written as a plain loop, loss / k + penalty / k backpropagated
per batch and a step every k batches (float64, rtol 1e-12); under a gradient scaler, the run
with scale 2¹⁰ against the run with scale 1 (powers of two: unscaling is exact).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fsd

L = pytest.importorskip("lightning")
from fsd.integrations.lightning import FSDCallback  # noqa: E402  (needs lightning)

pytestmark = pytest.mark.usefixtures("single_thread")


class Module(L.LightningModule):
    """A LightningModule around a small MLP (``self.net``), trained by SGD."""

    def __init__(self, data_weight: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        self.data_weight = data_weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.data_weight * nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(seed: int, dtype: torch.dtype = torch.float64, n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def _trainer(callbacks, steps: int, accumulate: int = 1, **options) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks,
                     accumulate_grad_batches=accumulate, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **options)


def _regularizer(module: Module, strength: float = 1.0) -> fsd.ContinualRegularizer:
    """One summary of task 0, fitted at the module's parameters, moved after it."""
    reg = fsd.ContinualRegularizer(
        lambda: fsd.BGLN(deterministic=True, moments="corrected", covariance="full"),
        strength=strength)
    reg.end_task(module.net, _loader(1, next(module.parameters()).dtype))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2),
                                     dtype=p.dtype))
    return reg


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_callback_trains_as_a_loop_adding_the_penalty_to_the_loss(accumulate):
    module = Module().double()
    reg = _regularizer(module)
    plain = copy.deepcopy(module)
    callback = FSDCallback(reg, network=lambda m: m.net)
    steps = 3
    _trainer([callback], steps, accumulate, precision="64-true").fit(module, _loader(3))
    # the same steps by hand
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    batches = iter(_loader(3))
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            x, y = next(batches)
            loss = nn.functional.cross_entropy(plain.net(x), y) + reg.penalty(plain.net)
            (loss / accumulate).backward()
        optimizer.step()
    for trained, want in zip(module.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(trained, want, rtol=1e-12, atol=1e-14)
    assert callback.last_penalty is not None and float(callback.last_penalty) > 0


def test_without_summaries_the_callback_changes_nothing():
    module, plain = Module().double(), Module().double()
    reg = fsd.ContinualRegularizer(lambda: fsd.LAFTR(), strength=1.0)
    _trainer([FSDCallback(reg, network=lambda m: m.net)], 2, precision="64-true").fit(
        module, _loader(3))
    _trainer([], 2, precision="64-true").fit(plain, _loader(3))
    for a, b in zip(module.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_under_a_gradient_scaler_the_penalty_is_scaled_as_the_loss():
    # 16-mixed with the trainer's GradScaler: the optimizer step unscales every gradient, so
    # a penalty backpropagated unscaled would reach it divided by the scale. Data weight 0:
    # the step is the penalty's gradient alone (fp32, outside autocast), so the runs at scale
    # 1 and at scale 2^10 must agree exactly.
    from lightning.pytorch.plugins.precision import MixedPrecision

    results = []
    for scale in (1.0, 2.0 ** 10):
        module = Module(data_weight=0.0)
        reg = _regularizer(module, strength=10.0)
        plugin = MixedPrecision("16-mixed", "cpu",
                                scaler=torch.amp.GradScaler("cpu", init_scale=scale))
        _trainer([FSDCallback(reg, network=lambda m: m.net)], 2, plugins=[plugin]).fit(
            module, _loader(3, torch.float32))
        results.append([p.detach().clone() for p in module.parameters()])
    moved = Module(data_weight=0.0)
    _regularizer(moved)  # the parameters the runs started from
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, s) for a, s in zip(results[0], moved.parameters(),
                                                     strict=True))


def test_end_task_fits_the_network_and_a_distributed_run_is_refused_in_one_line():
    module = Module().double()
    reg = fsd.ContinualRegularizer(lambda: fsd.LAFTR(), strength=1.0)
    callback = FSDCallback(reg, network=lambda m: m.net)
    summary = callback.end_task(module, _loader(1))
    assert len(reg) == 1 and reg.summaries[0] is summary
    assert float(summary.distance(module.net).detach()) == 0
    trainer = types.SimpleNamespace(world_size=2, strategy=object())
    with pytest.raises(RuntimeError, match="training_step") as info:
        callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="ContinualRegularizer"):
        FSDCallback(object())  # type: ignore[arg-type]


def test_the_lightning_example_keeps_the_tasks_with_the_exact_fsd():
    # examples/lightning_continual.py: the plain-loop example's tasks, trained by Lightning
    import importlib.util
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))  # it imports the plain example's tasks
    try:
        spec = importlib.util.spec_from_file_location("lightning_example",
                                                      examples / "lightning_continual.py")
        assert spec is not None and spec.loader is not None
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        for penalty, keeps in ((None, False), ("ExactFSD", True)):
            own, final = example.train(penalty, seed=0)
            lost = max(o - f for o, f in zip(own[:2], final[:2], strict=True))
            assert (lost < 5) is keeps, (penalty, own, final)
    finally:
        sys.path.remove(str(examples))
