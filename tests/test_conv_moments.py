"""BGLN-D (Algorithm 2) on convolutional networks against a dense float64 transcription.

The library never forms a convolution's matrix or a (C·H·W)² covariance
(:mod:`fsd.moments.algorithm2_conv`); :func:`fsd.testing.dense_algorithm2_cnn` does both, on
8×8 images.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import fsd
from conftest import DTYPE, perturbed
from fsd.model import rules
from fsd.moments import algorithm2_conv as conv_moments
from fsd.testing import dense_algorithm2_cnn


def _cnn(variant: str = "pool", seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    if variant == "pool":  # max-pool (non-overlapping), BatchNorm2d, two activation kinds
        layers = [nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                  nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GELU(), nn.Flatten(),
                  nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3)]
    elif variant == "overlap":  # overlapping padded windows, stride 2 conv, average pool
        layers = [nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.LeakyReLU(0.1),
                  nn.MaxPool2d(3, stride=2, padding=1), nn.AvgPool2d(1), nn.Flatten(),
                  nn.Dropout(0.3), nn.Linear(12, 4), nn.Sigmoid(), nn.Linear(4, 3)]
    elif variant == "padding-modes":  # borders reflected and wrapped: still linear maps
        layers = [nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                  nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
                  nn.ReLU(), nn.Flatten(), nn.Linear(64, 5), nn.ReLU(), nn.Linear(5, 3)]
    else:  # the paper's CNN shape in miniature: conv-conv-pool-conv-conv-pool-fc-fc
        layers = [nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3), nn.ReLU(),
                  nn.MaxPool2d(2), nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(),
                  nn.Conv2d(3, 3, 2), nn.ReLU(), nn.MaxPool2d(1), nn.Flatten(),
                  nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 4)]
    model = nn.Sequential(*layers).to(DTYPE).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.uniform_(-0.5, 0.5)
            if name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
    return model


SHAPES = {"pool": (2, 8, 8), "overlap": (2, 8, 8), "paper": (1, 8, 8),
          "padding-modes": (2, 8, 8)}


def _moved(model: nn.Module, scale: float = 0.1, seed: int = 1) -> nn.Module:
    """Parameters perturbed, and every BatchNorm's running variance moved by 10 %."""
    moved = perturbed(model, scale, seed)
    with torch.no_grad():
        for name, b in moved.named_buffers():
            if name.endswith("running_var"):
                b.mul_(1.1)
    return moved


def _data(shape, n: int = 300, seed: int = 2, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g, dtype=DTYPE) + 0.3
    return [(x, torch.arange(n) % classes)]


def _dense_covariance(est: fsd.BGLN, group: int) -> torch.Tensor:
    cov = est.input_covariance()
    if isinstance(cov, tuple):
        return cov[0][group] @ cov[0][group].T + torch.diag(cov[1][group])
    return torch.diag(cov[group]) if cov.dim() == 2 else cov[group]


def _dense(est: fsd.BGLN, model, moved, shape) -> torch.Tensor:
    """The estimate by the dense transcription, mixed over the summary's components."""
    layers = fsd.trace(model)
    stored = est._gate_means()
    total = torch.zeros((), dtype=DTYPE)
    for group, weight in enumerate(est._state["weights"]):
        gates = []
        for layer in layers:
            if isinstance(layer.rule, fsd.GateRule):
                moments = layer.rule.gate_moments(layer.module, stored[layer.path][group])
                gates.append((moments.reference_mean, moments.delta_mean, moments.offset))
        routings = [est._state[f"routing.{layer.path}"][group] for layer in layers
                    if isinstance(layer.rule, fsd.MaxPoolRule)]
        total = total + weight * dense_algorithm2_cnn(
            model, moved, shape, est._state["input.mean"][group], _dense_covariance(est, group),
            gates, routings)
    return total


@pytest.mark.parametrize("covariance", ["full", "lowrank", "diag"])
@pytest.mark.parametrize("variant", list(SHAPES))
def test_bgln_d_on_cnns_equals_the_dense_transcription(variant, covariance):
    model = _cnn(variant)
    moved = _moved(model)
    shape = SHAPES[variant]
    est = fsd.BGLN(deterministic=True, covariance=covariance, rank=6).fit(model, _data(shape))
    assert est._meta["evaluator"] == "algorithm2-conv"
    got = est.distance(moved)
    expected = _dense(est, model, moved, shape)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=0)
    grads = torch.autograd.grad(got, list(moved.parameters()))
    expected_grads = torch.autograd.grad(expected, list(moved.parameters()))
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12 * float(b.abs().max()))


def test_classwise_bgln_d_on_a_cnn_mixes_the_dense_components():
    model, shape = _cnn("pool"), SHAPES["pool"]
    moved = _moved(model)
    est = fsd.BGLN(deterministic=True, classwise=True, covariance="lowrank", rank=4).fit(
        model, _data(shape))
    assert est._state["weights"].shape == (3,)
    torch.testing.assert_close(est.distance(moved), _dense(est, model, moved, shape),
                               rtol=1e-8, atol=0)


def test_the_convolutional_path_on_an_mlp_is_the_mlp_path():
    # two implementations of Algorithm 2: fsd.moments.algorithm2_conv against the chain walk of
    # fsd.moments.algorithm2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6),
                          nn.Tanh(), nn.Linear(6, 3)).to(DTYPE).eval()
    moved = _moved(model)
    est = fsd.BGLN(deterministic=True, covariance="lowrank", rank=3, classwise=True).fit(
        model, _data((5,)))
    assert est._meta["evaluator"] == "algorithm2"
    layers = fsd.trace(model)
    steps = conv_moments.moment_steps(layers)
    params0, params1 = est.reference_state(), dict(moved.named_parameters())
    params1.update(dict(moved.named_buffers()))
    reference = conv_moments.reference_side(steps, params0, est._state["input.mean"],
                                            est.input_covariance(), est._gate_means(), (5,))
    rows = torch.eye(3, dtype=DTYPE)
    mean_d, trace = conv_moments.delta_side(steps, params0, params1, reference,
                                            est._gate_means(), rows, (5,))
    value = (est._state["weights"] * (0.5 * mean_d.pow(2).sum(-1) + 0.5 * trace)).sum()
    torch.testing.assert_close(value, est.distance(moved), rtol=1e-12, atol=0)


def _brute_routing(x: torch.Tensor, k: int, s: int, p: int) -> torch.Tensor:
    """Window by window: which kernel position holds the (first) maximum, one-hot."""
    n, c, h, w = x.shape
    out_h, out_w = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    out = torch.zeros(n, c, out_h, out_w, k * k, dtype=torch.float64)
    for e, ch, i, j in itertools.product(range(n), range(c), range(out_h), range(out_w)):
        best, where = -float("inf"), 0
        for a, b in itertools.product(range(k), range(k)):
            r, q = i * s - p + a, j * s - p + b
            if 0 <= r < h and 0 <= q < w and float(x[e, ch, r, q]) > best:
                best, where = float(x[e, ch, r, q]), a * k + b
        out[e, ch, i, j, where] = 1
    return out


@pytest.mark.parametrize("k, s, p", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_routing_statistics_against_a_window_by_window_argmax(k, s, p):
    x = torch.randn(3, 2, 7, 6, generator=torch.Generator().manual_seed(4), dtype=DTYPE)
    got = rules.routing_statistics(nn.MaxPool2d(k, s, p), x)
    assert torch.equal(got, _brute_routing(x, k, s, p))


@pytest.mark.parametrize("k, s, p", [(2, 2, 0), (3, 2, 1)])
def test_fired_routing_is_the_argmax_where_the_window_maximum_is_positive(k, s, p):
    # a ReLU's output: many zeros, so windows whose maximum is 0 occur
    x = torch.relu(torch.randn(4, 2, 7, 6, generator=torch.Generator().manual_seed(6),
                               dtype=DTYPE) - 0.8)
    brute = _brute_routing(x, k, s, p)
    got = rules.fired_routing_statistics(nn.MaxPool2d(k, s, p), x)
    positive = (_windows_max(x, k, s, p) > 0).unsqueeze(-1)
    assert bool((~positive).any()) and bool(positive.any())  # both kinds of window occur
    assert torch.equal(got, brute * positive)


def _windows_max(x: torch.Tensor, k: int, s: int, p: int) -> torch.Tensor:
    """Each window's maximum over its in-image positions, by loops."""
    n, c, h, w = x.shape
    out_h, out_w = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    out = torch.full((n, c, out_h, out_w), -float("inf"), dtype=x.dtype)
    for e, ch, i, j in itertools.product(range(n), range(c), range(out_h), range(out_w)):
        for a, b in itertools.product(range(k), range(k)):
            r, q = i * s - p + a, j * s - p + b
            if 0 <= r < h and 0 <= q < w:
                out[e, ch, i, j] = max(float(out[e, ch, i, j]), float(x[e, ch, r, q]))
    return out


def test_the_collector_keeps_routing_and_fired_routing_apart():
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    x = torch.randn(50, 1, 6, 6, generator=torch.Generator().manual_seed(7), dtype=DTYPE)
    model = model.double()
    with fsd.StatisticsCollector(model, moments=None) as collector:
        with collector.record():
            model(x)
    stats = collector.finalize()
    a = torch.relu(model[0](x)).detach()
    torch.testing.assert_close(stats.routing["2"][0], _brute_routing(a, 2, 2, 0).mean(0))
    torch.testing.assert_close(stats.fired_routing["2"][0],
                               rules.fired_routing_statistics(model[2], a).mean(0))


def test_the_expected_routing_of_one_hot_frequencies_is_the_max_pool():
    x = torch.randn(5, 2, 6, 6, generator=torch.Generator().manual_seed(5), dtype=DTYPE)
    pool = nn.MaxPool2d(3, 2, 1)
    for example in range(5):
        one = x[example:example + 1]
        frequencies = rules.routing_statistics(pool, one)  # this example's own routing
        routed = rules.expected_routing(pool, one.unsqueeze(0), frequencies)
        torch.testing.assert_close(routed[0], pool(one), rtol=0, atol=0)


@pytest.mark.parametrize("options, message", [
    ({"moments": "exact"}, "moments='exact'"),
    ({"reference": "layerwise"}, "reference='layerwise'")])
def test_exact_moments_and_layerwise_statistics_refuse_a_cnn_at_fit(options, message):
    with pytest.raises(NotImplementedError, match=message):
        fsd.BGLN(deterministic=True, **options).fit(_cnn(), _data(SHAPES["pool"]))


def test_a_ceil_mode_max_pool_is_refused():
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
                          nn.Flatten(), nn.Linear(18, 2)).to(DTYPE)
    with pytest.raises(NotImplementedError, match="ceil_mode"):
        fsd.BGLN(deterministic=True).fit(model, _data(SHAPES["pool"]))


def test_a_cnn_summary_survives_save_and_load_and_bad_routing_is_refused(tmp_path):
    model, shape = _cnn("pool"), SHAPES["pool"]
    moved = _moved(model)
    est = fsd.BGLN(deterministic=True).fit(model, _data(shape))
    est.save(tmp_path / "cnn.fsd")
    loaded = fsd.load(tmp_path / "cnn.fsd")
    torch.testing.assert_close(loaded.distance(moved), est.distance(moved), rtol=0, atol=0)
    payload = torch.load(tmp_path / "cnn.fsd", weights_only=True)
    payload["tensors"]["routing.2"][..., 0] = 0.0  # windows whose routing sums below 1
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match=r"routing\.2"):
        fsd.load(tmp_path / "bad.fsd")


def test_combine_sums_convolutional_summaries():
    model, shape = _cnn("pool"), SHAPES["pool"]
    moved = _moved(model)
    first = fsd.BGLN(deterministic=True).fit(model, _data(shape))
    second = fsd.BGLN(deterministic=True).fit(_moved(model, seed=3), _data(shape, seed=4))
    expected = 0.3 * first.distance(moved) + 0.7 * second.distance(moved)
    torch.testing.assert_close(fsd.combine([first, second], [0.3, 0.7]).distance(moved),
                               expected, rtol=1e-12, atol=0)


def test_float32_near_the_reference_matches_float64():
    # ΔW is formed first at every layer, so float32 keeps its digits as θ → θ0
    model32 = _cnn("pool").float()
    moved32 = copy.deepcopy(model32)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in moved32.parameters():
            p.add_(1e-4 * p.abs() * torch.randn(p.shape, generator=g))
    est = fsd.BGLN(deterministic=True).fit(copy.deepcopy(model32).double(),
                                           _data(SHAPES["pool"]))
    moved64 = copy.deepcopy(moved32).double()
    value64 = est.distance(moved64)
    value32 = est.distance(moved32)
    assert value32.dtype == torch.float32
    assert abs(float(value32) - float(value64)) <= 1e-4 * float(value64)
    grads64 = torch.autograd.grad(value64, list(moved64.parameters()))
    grads32 = torch.autograd.grad(value32, list(moved32.parameters()))
    for a, b in zip(grads32, grads64, strict=True):
        assert float((a.double() - b).norm()) <= 1e-4 * float(b.norm())
