"""fsd.ContinualRegularizer: the penalty, fitting from statistics, one-file save/load, example."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import fsd

DTYPE = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).to(DTYPE)


def _step(model: nn.Module, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _three_tasks(make, strength=2.0, reduction="sum"):
    torch.manual_seed(0)
    model = _mlp()
    reg = fsd.ContinualRegularizer(make, strength=strength, reduction=reduction)
    data = [torch.randn(40, 4, dtype=DTYPE) + i for i in range(3)]
    for t in range(3):
        _step(model, 0.2, t)
        reg.end_task(model, data[t], outputs=[t])
    _step(model, 0.2, 9)
    return model, reg, data


@pytest.mark.parametrize("make", [
    lambda: fsd.BGLN(deterministic=True, moments="exact"),
    lambda: fsd.BGLN(deterministic=True),
    lambda: fsd.EWC(metric="euclidean"),
    lambda: fsd.ExactFSD(),
    lambda: fsd.KFAC(),
])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_penalty_is_strength_times_the_weighted_sum_of_distances(make, reduction):
    model, reg, data = _three_tasks(make, reduction=reduction)
    separate = []
    for t, (summary, d) in enumerate(zip(reg.summaries, data, strict=True)):
        reference = copy.deepcopy(model)
        reference.load_state_dict(summary.reference_state_dict())
        separate.append(make().fit(reference, d, outputs=[t]))
    weight = 1.0 if reduction == "sum" else 1 / 3
    expected = 2.0 * weight * sum(e.distance(model) for e in separate)
    value = reg.penalty(model)
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-14)
    value.backward()
    assert any(float(p.grad.abs().max()) > 0 for p in model.parameters())


def test_penalty_is_zero_before_the_first_task_and_follows_the_model_dtype():
    reg = fsd.ContinualRegularizer(lambda: fsd.BGLN(deterministic=True, moments="exact"))
    model = _mlp().float()
    assert reg.penalty(model).dtype == torch.float32 and float(reg.penalty(model)) == 0
    reg.end_task(model, torch.randn(30, 4))
    _step(model, 0.1, 1)
    value32 = reg.penalty(model)
    value64 = reg.penalty(model.double())
    assert value64.dtype == torch.float64
    torch.testing.assert_close(value32.double(), value64, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make", [
    lambda: fsd.BGLN(deterministic=True, moments="exact"),
    lambda: fsd.BGLN(deterministic=True, classwise=True),
    lambda: fsd.LAFTR(inputs="gaussian", num_samples=8),
])
def test_statistics_recorded_in_training_give_the_summary_fit_computes_from_data(make):
    torch.manual_seed(1)
    model = _mlp()
    x, y = torch.randn(60, 4, dtype=DTYPE), torch.randint(0, 3, (60,))
    batches = [(x[:30], y[:30]), (x[30:], y[30:])]
    reg = fsd.ContinualRegularizer(make)
    collector = reg.statistics_collector(model)
    with collector:
        for xb, yb in batches:
            with collector.record(labels=yb if reg.needs_labels else None):
                model(xb)
        from_statistics = reg.end_task(model, statistics=collector)
    from_data = make().fit(model, batches)
    moved = copy.deepcopy(model)
    _step(moved, 0.3, 2)
    torch.testing.assert_close(from_statistics.distance(moved), from_data.distance(moved),
                               rtol=1e-10, atol=1e-14)


def test_estimators_that_need_data_have_no_collector():
    reg = fsd.ContinualRegularizer(lambda: fsd.EWC())
    assert reg.statistics_collector(_mlp()) is None and not reg.needs_labels


def test_save_and_load_keep_every_summary_and_setting(tmp_path):
    model, reg, data = _three_tasks(lambda: fsd.BGLN(deterministic=True, moments="exact"),
                                    strength=0.5, reduction="mean")
    reg.save(tmp_path / "reg.fsd")
    loaded = fsd.ContinualRegularizer.load(tmp_path / "reg.fsd")
    assert (len(loaded), loaded.strength, loaded.reduction) == (3, 0.5, "mean")
    torch.testing.assert_close(loaded.penalty(model), reg.penalty(model), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="no estimator factory"):
        loaded.end_task(model, data[0])
    again = fsd.ContinualRegularizer.load(
        tmp_path / "reg.fsd", estimator=lambda: fsd.BGLN(deterministic=True, moments="exact"))
    again.end_task(model, data[0])
    assert len(again) == 4


def test_a_damaged_summary_inside_the_file_names_the_task(tmp_path):
    _, reg, _ = _three_tasks(lambda: fsd.EWC(metric="euclidean"))
    reg.save(tmp_path / "reg.fsd")
    payload = torch.load(tmp_path / "reg.fsd", weights_only=True)
    payload["summaries"][1]["tensors"]["fisher.0.weight"] *= -1
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match=r"\(task 1\).*'fisher\.0\.weight'"):
        fsd.ContinualRegularizer.load(tmp_path / "bad.fsd")
    (tmp_path / "junk.fsd").write_bytes(b"not a file")
    with pytest.raises(fsd.SummaryFormatError, match="not an fsd regularizer file"):
        fsd.ContinualRegularizer.load(tmp_path / "junk.fsd")


@pytest.mark.parametrize("kwargs,message", [
    (dict(reduction="max"), "reduction must be one of sum, mean"),
    (dict(strength=-1.0), "strength must be a finite non-negative number"),
    (dict(strength=float("nan")), "strength must be a finite non-negative number"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fsd.ContinualRegularizer(lambda: fsd.EWC(), **kwargs)


def test_the_user_guide_example_keeps_earlier_tasks_where_its_docstring_says():
    # examples/continual_regularizer.py: three tasks, the model and data of a user's own.
    # Fine-tuning forgets tasks 1 and 2; the BGLN-D penalty keeps them at seed 0 and loses
    # one at seed 1; the exact FSD on the stored inputs keeps them at both.
    spec = importlib.util.spec_from_file_location(
        "continual_example", ROOT / "examples" / "continual_regularizer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def lost(own: list[float], final: list[float]) -> float:
        return max(o - f for o, f in zip(own[:2], final[:2], strict=True))

    assert lost(*example.train(None)) > 30  # forgotten
    assert lost(*example.train("BGLN-D", seed=0)) < 5
    assert lost(*example.train("BGLN-D", seed=1)) > 30
    for seed in (0, 1):
        assert lost(*example.train("ExactFSD", seed=seed)) < 5
