"""Streaming statistics (moments, gate frequencies, collector, class grouping) against
plain numpy/torch float64 computations over the whole data."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import fsd
from conftest import DTYPE, labelled_batches, mlp, perturbed, stack
from fsd.covariance import sampling_factor
from fsd.statistics.collector import (
    GateAccumulator,
    MomentAccumulator,
    StatisticsCollector,
    group_classes,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _data(n=103, d=6, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # correlated features with an offset, so that naive one-pass formulas would lose digits
    x = torch.randn(n, d, generator=gen, dtype=DTYPE) @ torch.randn(d, d, generator=gen,
                                                                     dtype=DTYPE)
    return x + 10.0


def _np_moments(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    a = x.numpy()
    m = a.mean(0)
    return m, (a - m).T @ (a - m) / a.shape[0]  # population covariance


SPLITS = [0, 1, 8, 8, 38, 70, 103]  # uneven batches, including an empty one


@pytest.mark.parametrize("diagonal", [False, True])
def test_moment_accumulator_streamed_and_merged(diagonal):
    x = _data()
    m, c = _np_moments(x)
    want_c = np.diag(c) if diagonal else c
    streamed = MomentAccumulator(diagonal=diagonal)
    for a, b in itertools.pairwise(SPLITS):
        streamed.update(x[a:b])
    # two shards merged, plus an empty accumulator merged in
    s1, s2 = MomentAccumulator(diagonal), MomentAccumulator(diagonal)
    s1.update(x[:17])
    s2.update(x[17:40])
    s2.update(x[40:])
    empty_first = MomentAccumulator(diagonal).merge(s1)  # copies s1 (merge mutates self)
    merged = s1.merge(s2).merge(MomentAccumulator(diagonal))
    for acc in (streamed, merged):
        assert acc.count == x.shape[0]
        # values are O(10) and O(1): 1e-12 absolute is ~1e3 ulps
        np.testing.assert_allclose(acc.mean.numpy(), m, rtol=0, atol=1e-12)
        np.testing.assert_allclose(acc.covariance().numpy(), want_c, rtol=0, atol=1e-12)
    np.testing.assert_allclose(empty_first.mean.numpy(), x[:17].numpy().mean(0), atol=1e-12)


def test_moment_accumulator_errors():
    with pytest.raises(ValueError):
        MomentAccumulator().covariance()
    with pytest.raises(ValueError):
        MomentAccumulator(True).merge(MomentAccumulator(False))
    acc = MomentAccumulator()
    acc.update(torch.zeros(2, 3, dtype=DTYPE))
    with pytest.raises(ValueError):
        acc.update(torch.zeros(2, 4, dtype=DTYPE))


def test_moment_accumulator_float32_input_accumulates_in_float64():
    x = _data()
    acc = MomentAccumulator()
    acc.update(x.float())
    assert acc.mean.dtype == torch.float64
    m, _ = _np_moments(x.float().double())
    np.testing.assert_allclose(acc.mean.numpy(), m, atol=1e-12)


def _rank_deficient(n=60, seed=1) -> torch.Tensor:
    x = _data(n, 6, seed)
    x[:, 2] = 0.5            # a constant pixel
    x[:, 4] = 2.0 * x[:, 0]  # a linearly dependent one
    return x


def test_sampling_factor_reproduces_singular_covariance():
    x = _rank_deficient()
    _, c = _np_moments(x)
    cov = torch.from_numpy(c)
    L = sampling_factor(cov)
    assert L.shape == (6, 4)  # rank 6 − 2 (numerical rank detection)
    # ‖C‖ is O(10): 1e-12 absolute is round-off of the eigendecomposition
    np.testing.assert_allclose((L @ L.T).numpy(), c, rtol=0, atol=1e-12)
    # full-rank and zero covariances too
    full = torch.from_numpy(_np_moments(_data())[1])
    Lf = sampling_factor(full)
    np.testing.assert_allclose((Lf @ Lf.T).numpy(), full.numpy(), atol=1e-11)
    Lz = sampling_factor(torch.zeros(3, 3, dtype=DTYPE))
    assert torch.equal(Lz @ Lz.T, torch.zeros(3, 3, dtype=DTYPE))


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_rank_deficient_data_through_bgln(covariance):
    x = _rank_deficient()
    model = mlp([6, 5, 3], seed=2)
    other = perturbed(model, 0.2, seed=3)
    data = [x[:25], x[25:]]
    s = fsd.BGLN(num_samples=64, covariance=covariance).fit(model, data)
    d_s = s.distance(other)
    assert torch.isfinite(d_s) and float(d_s) > 0
    # samples live on the data's support: the constant pixel stays constant,
    # the dependent one stays dependent (up to round-off)
    xs, _, _ = s._inputs()
    torch.testing.assert_close(xs[:, 2], torch.full_like(xs[:, 2], 0.5), rtol=0, atol=1e-12)
    if covariance == "full":
        torch.testing.assert_close(xs[:, 4], 2.0 * xs[:, 0], rtol=0, atol=1e-10)
    d = fsd.BGLN(deterministic=True, covariance=covariance).fit(model, data).distance(other)
    assert torch.isfinite(d) and float(d) > 0
    d.backward()
    assert all(torch.isfinite(p.grad).all() for p in other.parameters())


# ----------------------------------------------------------------------------------------
# gates
# ----------------------------------------------------------------------------------------
def _preacts(n=57, shape=(3, 4, 4), seed=4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=gen, dtype=DTYPE) + 0.3


def test_gate_accumulator_running_mean_is_exact_fraction():
    s = _preacts()
    want = (s > 0).to(DTYPE).mean(0)
    acc = GateAccumulator()
    for a, b in ((0, 5), (5, 5), (5, 6), (6, 40), (40, 57)):
        acc.update(s[a:b])
    assert acc.count == 57 and acc.value.shape == (3, 4, 4)
    torch.testing.assert_close(acc.value, want, rtol=0, atol=1e-15)
    # merge of shards
    a1, a2 = GateAccumulator(), GateAccumulator()
    a1.update(s[:20])
    a2.update(s[20:])
    torch.testing.assert_close(a1.merge(a2).value, want, rtol=0, atol=1e-15)
    # zero is not "active": strict inequality
    z = GateAccumulator()
    z.update(torch.zeros(4, 2, dtype=DTYPE))
    assert torch.equal(z.value, torch.zeros(2, dtype=torch.float64))


def test_gate_accumulator_ema_matches_manual_recursion():
    s = _preacts()
    m = 0.9
    acc = GateAccumulator(momentum=m)
    batches = [s[0:10], s[10:13], s[13:40], s[40:57]]
    value = None
    for b in batches:
        acc.update(b)
        frac = (b > 0).to(DTYPE).mean(0)
        value = frac if value is None else m * value + (1 - m) * frac
    torch.testing.assert_close(acc.value, value, rtol=0, atol=1e-15)
    with pytest.raises(ValueError):
        GateAccumulator(momentum=1.0)
    with pytest.raises(ValueError):
        _ = GateAccumulator().value


# ----------------------------------------------------------------------------------------
# collector during a "training epoch"
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("classwise", [True, False, 2])
def test_collector_during_training_equals_fit_on_data(classwise):
    model = mlp([5, 7, 6, 3], seed=5)
    data = labelled_batches(45, (5,), classes=3, batch=8, seed=6)
    collector = StatisticsCollector(model)  # full moments + gates, running means
    opt_free_loss = 0.0
    for x, y in data:
        with collector.record(labels=y):
            out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()  # a training step without the update: the model is unchanged
        opt_free_loss += float(loss)
        model(x + 100.0)  # forward passes outside record() are not counted
    collector.remove()
    assert collector.count == 45
    other = perturbed(model, 0.2, seed=7)
    from_stats = fsd.BGLN(deterministic=True, classwise=classwise).fit(model,
                                                                       statistics=collector)
    from_data = fsd.BGLN(deterministic=True, classwise=classwise).fit(model, data)
    for key, value in from_data._state.items():
        torch.testing.assert_close(from_stats._state[key], value, rtol=0, atol=1e-14)
    d1, d2 = float(from_stats.distance(other)), float(from_data.distance(other))
    assert abs(d1 - d2) <= 1e-12 * d2
    # removed hooks record nothing any more
    with collector.record(labels=data[0][1]):
        model(data[0][0])
    assert collector.count == 45


def test_collector_records_per_class_gate_fractions():
    model = mlp([5, 7, 3], seed=8)
    data = labelled_batches(40, (5,), classes=3, batch=7, seed=9)
    xs, ys = stack(data)
    with StatisticsCollector(model, moments="diag") as collector:
        for x, y in data:
            with collector.record(labels=y):
                model(x)
    stats = collector.finalize(True)
    with torch.no_grad():
        pre = model[0](xs)
    for g, cls in enumerate(sorted(set(ys.tolist()))):
        want = (pre[ys == cls] > 0).to(DTYPE).mean(0)
        torch.testing.assert_close(stats.gate_means["1"][g], want, rtol=0, atol=1e-14)
        torch.testing.assert_close(stats.covariances[g], xs[ys == cls].var(0, unbiased=False),
                                   rtol=0, atol=1e-12)
        assert abs(float(stats.weights[g]) - float((ys == cls).to(DTYPE).mean())) <= 1e-15
    assert stats.covariances.shape == (3, 5)  # diagonal


def test_start_and_stop_record_what_the_record_block_records():
    # a framework callback's two hooks (before and after the forward) instead of a with-block
    model = mlp([5, 7, 3], seed=8)
    data = labelled_batches(40, (5,), classes=3, batch=7, seed=9)
    with StatisticsCollector(model, moments="full") as block, \
            StatisticsCollector(model, moments="full") as hooks:
        for x, y in data:
            with block.record(labels=y):
                assert block.recording and not hooks.recording
                model(x)
            hooks.start(labels=y)
            assert hooks.recording
            model(x)
            hooks.stop()
            model(x)  # after stop: not recorded
        hooks.stop()  # a second stop does nothing
        assert not hooks.recording and hooks.count == block.count == 40
        want, got = block.finalize(True), hooks.finalize(True)
    torch.testing.assert_close(got.covariances, want.covariances, rtol=0, atol=0)
    torch.testing.assert_close(got.means, want.means, rtol=0, atol=0)
    for path, value in want.gate_means.items():
        torch.testing.assert_close(got.gate_means[path], value, rtol=0, atol=0)


def test_the_training_batch_norm_warning_points_at_the_callers_line():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    for begin in ("record", "start"):
        collector = StatisticsCollector(model.train())
        with pytest.warns(UserWarning, match="training mode") as caught:
            if begin == "record":
                with collector.record():
                    pass
            else:
                collector.start()
        assert caught[0].filename == __file__, begin
        collector.remove()


def test_collector_records_a_relu_used_twice_per_position():
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(3, 4), relu, nn.Linear(4, 4), relu,
                          nn.Linear(4, 2)).to(DTYPE)
    x = torch.randn(40, 3, dtype=DTYPE)
    with StatisticsCollector(model) as collector:
        with collector.record():
            model(x[:25])
            model(x[25:])
    stats = collector.finalize()
    with torch.no_grad():
        s1 = model[0](x)
        s2 = model[2](torch.relu(s1))
    assert sorted(stats.gate_means) == ["1", "3"]
    torch.testing.assert_close(stats.gate_means["1"][0], (s1 > 0).to(DTYPE).mean(0),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(stats.gate_means["3"][0], (s2 > 0).to(DTYPE).mean(0),
                               rtol=0, atol=1e-15)
    # a Linear shared by two positions has no chain (which reads weights by path): layer
    # moments, BGLN-D's layer-wise reference, refuse it
    shared = nn.Linear(3, 3)
    with pytest.raises(fsd.UnsupportedModuleError, match="same object as at '0'"):
        StatisticsCollector(nn.Sequential(shared, nn.ReLU(), shared), layer_moments=True)


# ----------------------------------------------------------------------------------------
# class grouping
# ----------------------------------------------------------------------------------------
def test_group_classes():
    classes = [4, 0, 3, 1, 2]
    assert group_classes(classes, True) == [[0], [1], [2], [3], [4]]
    assert group_classes(classes, False) == [[0, 1, 2, 3, 4]]
    assert group_classes(classes, 2) == [[0, 1, 2], [3, 4]]
    assert group_classes(classes, 1) == [[0, 1, 2, 3, 4]]
    assert group_classes(classes, 5) == [[0], [1], [2], [3], [4]]
    assert group_classes(classes, 9) == [[0], [1], [2], [3], [4]]  # k ≥ classes
    with pytest.raises(ValueError):
        group_classes(classes, 0)


def test_classwise_k_clusters_pool_their_classes():
    model = mlp([4, 5, 3], seed=10)
    data = labelled_batches(50, (4,), classes=5, batch=9, seed=11)
    xs, ys = stack(data)
    est = fsd.BGLN(deterministic=True, classwise=2, covariance="full").fit(model, data)
    assert est._meta["groups"] == [[0, 1, 2], [3, 4]]
    with torch.no_grad():
        pre = model[0](xs)
    for g, members in enumerate(([0, 1, 2], [3, 4])):
        mask = torch.isin(ys, torch.tensor(members))
        xg = xs[mask]
        mean = xg.mean(0)
        cov = (xg - mean).T @ (xg - mean) / xg.shape[0]
        torch.testing.assert_close(est._state["input.mean"][g], mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(est._state["input.cov"][g], cov, rtol=0, atol=1e-12)
        torch.testing.assert_close(est._state["gate.1"][g], (pre[mask] > 0).to(DTYPE).mean(0),
                                   rtol=0, atol=1e-14)
        assert abs(float(est._state["weights"][g]) - float(mask.to(DTYPE).mean())) <= 1e-15
