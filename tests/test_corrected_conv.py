"""The corrected recursion on convolutional chains (fsd.moments.corrected_conv).

Ground truth: the exact BGLN moments of a tiny CNN with dense matrices
(:func:`fsd.testing.dense_bgln_cnn`, itself checked against gate enumeration and a Monte-Carlo
run of the BGLN with sampled gates and routing), and the MLP corrected recursion on the same
network written with dense Linear layers (an independent walk of the same approximation).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsd
from conftest import perturbed
from fsd.model.rules import RULES, FixedRule, register_rule
from fsd.testing import dense_bgln_cnn, enumerated_gates
from fsd_experiments.ablations import BGLNVariant

SHAPE = (1, 6, 6)


def _images(n: int = 300, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 1, 3, 3, generator=g, dtype=torch.float64)
    # correlated pixels (an upsampled field plus noise), with a non-zero mean
    x = F.interpolate(base, size=SHAPE[1:], mode="bilinear", align_corners=False)
    return x + 0.3 * torch.randn(n, *SHAPE, generator=g, dtype=torch.float64) + 0.2


def _pool_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double()


def _firing_and_routing(model: nn.Sequential, x: torch.Tensor):
    """μ of the ReLU and π of the 2×2 max-pool, from the data, written out directly."""
    s = model[0](x)
    mu = (s > 0).double().mean(0)
    _, index = F.max_pool2d(torch.relu(s), 2, return_indices=True)
    width = s.shape[-1]
    offset = (index // width % 2) * 2 + index % width % 2
    pi = F.one_hot(offset, 4).double().mean(0)
    return mu, pi


def _flat_moments(x: torch.Tensor):
    flat = x.reshape(x.shape[0], -1)
    return flat.mean(0), torch.cov(flat.T, correction=0)


def test_dense_reference_is_gate_enumeration_on_mlps():
    torch.manual_seed(3)
    make = lambda: nn.Sequential(nn.Linear(3, 4), nn.LeakyReLU(0.2), nn.Linear(4, 3),  # noqa: E731
                                 nn.ReLU(), nn.Linear(3, 2)).double()
    m0, m1 = make(), make()
    mean = torch.randn(3, dtype=torch.float64)
    root = torch.randn(3, 3, dtype=torch.float64)
    firing = [torch.rand(4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)]
    gates = []
    for mu, slope in zip(firing, (0.2, 0.0), strict=True):
        mean_gate, var = slope + (1 - slope) * mu, (1 - slope) ** 2 * mu * (1 - mu)
        gates.append((mean_gate, mean_gate, var, var, var, 0.0))
    expected = enumerated_gates(m0, m1, mean, root @ root.T, firing)
    got = dense_bgln_cnn(m0, m1, (3,), mean, root @ root.T, gates, [])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_dense_reference_is_the_sampled_bgln_with_random_routing():
    # Monte-Carlo over Gaussian inputs, Bernoulli gates and one-hot routing per window
    m0 = _pool_model()
    m1 = perturbed(m0, 0.3)
    x = _images()
    mu, pi = _firing_and_routing(m0, x)
    mean, cov = _flat_moments(x)
    var = mu * (1 - mu)
    exact = dense_bgln_cnn(m0, m1, SHAPE, mean, cov, [(mu, mu, var, var, var, 0.0)], [pi])
    values = _sampled_pool_model(m0, m1, mean, cov, pi, 200_000, 5, gate_means=mu)
    standard_error = values.std() / values.shape[0] ** 0.5
    assert abs(values.mean() - exact) < 4 * standard_error, (values.mean(), exact)


@pytest.mark.parametrize("moved_scale", [0.1, 0.5])
def test_corrected_conv_is_exact_for_one_gate_and_a_pool(moved_scale):
    m0 = _pool_model()
    m1 = perturbed(m0, moved_scale)
    x = _images()
    mu, pi = _firing_and_routing(m0, x)
    mean, cov = _flat_moments(x)
    var = mu * (1 - mu)
    est = BGLNVariant(moments="corrected", covariance="full").fit(m0, x)
    assert est._meta["evaluator"] == "corrected-conv"
    got = est.distance(m1)
    params = list(m1.parameters())
    grads = torch.autograd.grad(got, params)
    exact = dense_bgln_cnn(m0, m1, SHAPE, mean, cov, [(mu, mu, var, var, var, 0.0)], [pi])
    expected_grads = torch.autograd.grad(exact, params)
    torch.testing.assert_close(got, exact, rtol=1e-10, atol=0)
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    # Algorithm 2 on the same summary data is not exact: the test can fail
    paper = fsd.BGLN(deterministic=True, covariance="full").fit(m0, x).distance(m1)
    assert abs(float(paper) / float(exact) - 1) > 0.05


@pytest.mark.parametrize("first", ["relu", "pool"])
def test_corrected_conv_is_exact_for_a_chain_that_starts_with_a_gate_or_pool(first):
    # the injection before the first affine layer was dropped (−40 % on such a chain)
    torch.manual_seed(4)
    head = nn.ReLU() if first == "relu" else nn.MaxPool2d(2)
    size = 2 * 6 * 6 if first == "relu" else 2 * 3 * 3
    m0 = nn.Sequential(head, nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(),
                       nn.Linear(size, 3)).double()
    m1 = perturbed(m0, 0.3)
    x = _images()
    mean, cov = _flat_moments(x)
    if first == "relu":
        mu = (x > 0).double().mean(0).flatten()
        var = mu * (1 - mu)
        gates, routings = [(mu, mu, var, var, var, 0.0)], []
    else:
        _, index = F.max_pool2d(x, 2, return_indices=True)
        offset = (index // 6 % 2) * 2 + index % 6 % 2
        gates, routings = [], [F.one_hot(offset, 4).double().mean(0)]
    exact = dense_bgln_cnn(m0, m1, SHAPE, mean, cov, gates, routings)
    got = BGLNVariant(moments="corrected", covariance="full").fit(m0, x).distance(m1)
    torch.testing.assert_close(got, exact, rtol=1e-10, atol=0)


def _fired_routing(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """P(argmax = p and window maximum > 0) of the 2×2 max-pool after the ReLU, written out."""
    s = model[0](x)
    pooled, index = F.max_pool2d(torch.relu(s), 2, return_indices=True)
    width = s.shape[-1]
    offset = (index // width % 2) * 2 + index % width % 2
    return (F.one_hot(offset, 4).double() * (pooled > 0).double().unsqueeze(-1)).mean(0)


def _sampled_pool_model(m0: nn.Sequential, m1: nn.Sequential, mean: torch.Tensor,
                        cov: torch.Tensor, routing: torch.Tensor, n: int, seed: int,
                        gate_means: torch.Tensor | None = None) -> torch.Tensor:
    """½‖Δz‖² per sample of :func:`_pool_model`'s BGLN, by Monte Carlo over Gaussian inputs.

    With ``gate_means``, Bernoulli gates on the ReLU and then one position per window drawn
    from ``routing``; without, no gate and each window drawing a position or, with the
    probability ``routing`` leaves, none (output 0): the fired model.
    """
    g = torch.Generator().manual_seed(seed)
    root = torch.linalg.cholesky(cov + 1e-12 * torch.eye(cov.shape[0], dtype=torch.float64))
    xs = (mean + torch.randn(n, mean.shape[0], generator=g, dtype=torch.float64) @ root.T
          ).reshape(n, *SHAPE)
    c0, c1 = m0[0], m1[0]
    s0 = c0(xs)
    ds = F.conv2d(xs, c1.weight - c0.weight, c1.bias - c0.bias, padding=1)
    if gate_means is not None:
        gate = torch.bernoulli(gate_means.expand_as(s0), generator=g)
        s0, ds = gate * s0, gate * ds
    windows0 = F.unfold(s0.flatten(0, 1).unsqueeze(1), 2, stride=2).view(n, 2, 4, 9)
    windowsd = F.unfold(ds.flatten(0, 1).unsqueeze(1), 2, stride=2).view(n, 2, 4, 9)
    cumulative = routing.permute(0, 3, 1, 2).reshape(2, 4, 9).cumsum(1)
    u = torch.rand(n, 2, 1, 9, generator=g, dtype=torch.float64)
    pick = (u > cumulative).sum(2, keepdim=True)  # 4: past every position, no output
    kept = (pick < 4).double().reshape(n, -1)
    pick = pick.clamp_max(3)
    p0 = windows0.gather(2, pick).reshape(n, -1) * kept
    pd = windowsd.gather(2, pick).reshape(n, -1) * kept
    l0, l1 = m0[4], m1[4]
    dz = F.linear(p0, l1.weight - l0.weight, l1.bias - l0.bias) + F.linear(pd, l1.weight)
    return 0.5 * dz.pow(2).sum(-1)


def test_fired_routing_is_exact_for_a_relu_and_a_pool():
    # one draw per window with P(argmax = p, maximum > 0), no gate: against the dense moments
    # of that model (value and gradient) and a Monte-Carlo run of it
    m0 = _pool_model()
    m1 = perturbed(m0, 0.3)
    x = _images()
    fired = _fired_routing(m0, x)
    assert float(fired.sum(-1).max()) < 1  # some windows do not fire: the test can fail
    mean, cov = _flat_moments(x)
    one = torch.ones(2, 6, 6, dtype=torch.float64)
    est = BGLNVariant(moments="corrected", covariance="full", pool_routing="fired").fit(m0, x)
    got = est.distance(m1)
    params = list(m1.parameters())
    exact = dense_bgln_cnn(m0, m1, SHAPE, mean, cov, [(one, one, 0.0, 0.0, 0.0, 0.0)], [fired])
    torch.testing.assert_close(got, exact, rtol=1e-10, atol=0)
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(exact, params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    values = _sampled_pool_model(m0, m1, mean, cov, fired, 200_000, 5)
    standard_error = values.std() / values.shape[0] ** 0.5
    assert abs(values.mean() - exact) < 4 * standard_error, (values.mean(), exact)
    # independent gates and routing give another value on the same data
    independent = BGLNVariant(moments="corrected", covariance="full").fit(m0, x).distance(m1)
    assert abs(float(independent) / float(exact) - 1) > 0.05


def test_fired_routing_leaves_a_pool_without_a_relu_before_it_alone():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
                          nn.Flatten(), nn.Linear(18, 3)).double()
    moved = perturbed(model, 0.3)
    x = _images()
    fired = BGLNVariant(moments="corrected", covariance="full", pool_routing="fired").fit(model, x)
    default = BGLNVariant(moments="corrected", covariance="full").fit(model, x)
    torch.testing.assert_close(fired.distance(moved), default.distance(moved), rtol=0, atol=0)


def test_fired_routing_summaries_save_and_bad_options_are_refused(tmp_path):
    m0 = _pool_model()
    est = BGLNVariant(moments="no-gate-variance", covariance="full",
                      pool_routing="fired").fit(m0, _images())
    est.save(tmp_path / "fired.fsd")
    back = fsd.load(tmp_path / "fired.fsd")
    assert back.config["pool_routing"] == "fired"
    m1 = perturbed(m0, 0.3)
    torch.testing.assert_close(back.distance(m1), est.distance(m1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="pool_routing must be one of"):
        BGLNVariant(pool_routing="argmax")
    with pytest.raises(ValueError, match="convolutional walks"):
        BGLNVariant(moments="no-cross-covariance", pool_routing="fired")


def _conv_chain(activation: type[nn.Module], seed: int = 0, batch_norm: bool = True,
                pool: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Conv2d(1, 2, 3, padding=1)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(2))
    layers.append(activation())
    if pool:
        layers.append(nn.AvgPool2d(2))
    size = 3 if pool else 6
    layers += [nn.Conv2d(2, 2, 3, padding=1), activation(), nn.Flatten(),
               nn.Linear(2 * size * size, 3)]
    model = nn.Sequential(*layers).double()
    if batch_norm:  # non-trivial running statistics
        with torch.no_grad():
            model[1].running_mean.uniform_(-0.5, 0.5)
            model[1].running_var.uniform_(0.5, 2.0)
            model[1].weight.uniform_(0.5, 1.5)
    return model.eval()


def _as_mlp(model: nn.Sequential, shape: tuple[int, ...]) -> nn.Sequential:
    """The same network with every convolution, BatchNorm and pool as a dense Linear layer."""
    from fsd.testing import _dense_layer
    layers: list[nn.Module] = [nn.Flatten()]
    for module in model:
        matrix, bias, out_shape = _dense_layer(module, shape)
        if isinstance(module, (nn.Flatten,)):
            pass
        elif matrix is not None:
            linear = nn.Linear(matrix.shape[1], matrix.shape[0], bias=bias is not None).double()
            with torch.no_grad():
                linear.weight.copy_(matrix)
                if bias is not None:
                    linear.bias.copy_(bias)
            layers.append(linear)
        else:
            layers.append(copy.deepcopy(module))
        shape = out_shape
    return nn.Sequential(*layers).double().eval()


@pytest.mark.parametrize("activation", [nn.ReLU, nn.Sigmoid])
@pytest.mark.parametrize("options", [{"covariance": "full"},
                                     {"covariance": "lowrank", "rank": 3},
                                     {"covariance": "diag"},
                                     {"covariance": "lowrank", "rank": 5, "injection_rank": 2},
                                     {"covariance": "lowrank", "rank": 3, "classwise": True}])
def test_corrected_conv_equals_the_mlp_recursion_on_the_same_network(activation, options):
    # every layer written as a dense Linear, the MLP corrected recursion walks the same
    # approximation (diagonal carrying per affine layer): the two agree to round-off
    m0 = _conv_chain(activation)
    m1 = perturbed(m0, 0.2)
    images = _images()
    labels = torch.arange(3).repeat_interleave(len(images) // 3)
    x = [(images, labels)]
    cnn = BGLNVariant(moments="corrected", **options).fit(m0, x)
    assert cnn._meta["evaluator"] == "corrected-conv"
    mlp0, mlp1 = _as_mlp(m0, SHAPE), _as_mlp(m1, SHAPE)
    mlp = BGLNVariant(moments="corrected", **options).fit(mlp0, x)
    assert mlp._meta["evaluator"] == "corrected"
    torch.testing.assert_close(cnn.distance(m1), mlp.distance(mlp1), rtol=1e-9, atol=0)
    mean_gate = BGLNVariant(moments="no-gate-variance", **{
        k: v for k, v in options.items() if k != "injection_rank"})
    torch.testing.assert_close(
        mean_gate.fit(m0, x).distance(m1),
        BGLNVariant(moments="no-gate-variance", **{
            k: v for k, v in options.items() if k != "injection_rank"}).fit(
            mlp0, x).distance(mlp1), rtol=1e-9, atol=0)


def _statistics(model: nn.Sequential, x: torch.Tensor):
    """Per ReLU (μ, μ, v, v, v, 0) and per 2×2 max-pool π, from the data, written out."""
    gates, routings = [], []
    a = x
    for module in model:
        if isinstance(module, nn.ReLU):
            mu = (a > 0).double().mean(0).reshape(-1)
            v = mu * (1 - mu)
            gates.append((mu, mu, v, v, v, 0.0))
        elif isinstance(module, nn.MaxPool2d):
            _, index = F.max_pool2d(a, 2, return_indices=True)
            width = a.shape[-1]
            offset = (index // width % 2) * 2 + index % width % 2
            routings.append(F.one_hot(offset, 4).double().mean(0))
        a = module(a)
    return gates, routings


def _deep(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(18, 3)).double()


def test_corrected_conv_is_exact_across_a_pool_between_two_gates():
    # the first gate's injection reaches the pool undisturbed (diagonal: no within-window
    # terms) and the second gate through one convolution: exact for a full covariance
    torch.manual_seed(0)
    m0 = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                       nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), nn.Flatten(),
                       nn.Linear(18, 3)).double()
    m1 = perturbed(m0, 0.5)
    x = _images()
    gates, routings = _statistics(m0, x)
    exact = dense_bgln_cnn(m0, m1, SHAPE, *_flat_moments(x), gates, routings)
    got = BGLNVariant(moments="corrected", covariance="full").fit(m0, x).distance(m1)
    torch.testing.assert_close(got, exact, rtol=1e-10, atol=0)


@pytest.mark.parametrize("scale", [0.2, 0.5])
def test_corrected_conv_against_exact_moments_where_it_is_approximate(scale):
    # a second convolution between a gate and a pool correlates the carried injections
    # within a window, which the recursion takes as 0: measured 0.08 % and 1.6 % off
    m0 = _deep()
    m1 = perturbed(m0, scale)
    x = _images()
    gates, routings = _statistics(m0, x)
    exact = float(dense_bgln_cnn(m0, m1, SHAPE, *_flat_moments(x), gates, routings).detach())
    with torch.no_grad():
        corrected = float(BGLNVariant(moments="corrected", covariance="full").fit(m0, x)
                          .distance(m1))
        paper = float(fsd.BGLN(deterministic=True, covariance="full").fit(m0, x).distance(m1))
    assert 1e-4 < abs(corrected / exact - 1) < 0.03  # approximate, and close
    assert abs(paper / exact - 1) > 0.2


def test_corrected_conv_is_zero_at_the_reference_and_saves():
    m0 = _conv_chain(nn.ReLU)
    x = _images()
    est = BGLNVariant(moments="corrected", covariance="lowrank", rank=3).fit(m0, x)
    same = copy.deepcopy(m0)
    value = est.distance(same)
    grads = torch.autograd.grad(value, list(same.parameters()), allow_unused=True)
    assert float(value) == 0.0
    assert all(g is None or float(g.abs().max()) == 0.0 for g in grads)


def test_corrected_conv_refuses_a_fixed_layer_without_a_squared_map():
    class Halve(nn.Module):
        def forward(self, x):
            return 0.5 * x

    register_rule(Halve, FixedRule(apply=lambda m, x: 0.5 * x))
    try:
        _refuses_and_falls_back(Halve)
    finally:
        RULES.pop(Halve)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_corrected_conv_refuses_a_border_that_is_not_zeros(mode):
    # a reflected border puts one input twice in a window: W² would carry its variance wrong
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode=mode), nn.ReLU(),
                          nn.Flatten(), nn.Linear(72, 2)).double()
    x = _images(50)
    with pytest.raises(fsd.UnsupportedModuleError, match=f"padding_mode='{mode}'"):
        BGLNVariant(moments="corrected").fit(model, x)


def _refuses_and_falls_back(halve: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), halve(), nn.Flatten(),
                          nn.Linear(32, 2)).double()
    x = _images(50)
    with pytest.raises(fsd.UnsupportedModuleError, match="squared"):
        BGLNVariant(moments="corrected").fit(model, x)
    # Algorithm 2 and the mean-gate network need no squared map
    BGLNVariant(moments="no-gate-variance").fit(model, x).distance(perturbed(model, 0.3))
