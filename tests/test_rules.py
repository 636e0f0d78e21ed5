"""fsd.model.rules: every registered layer rule against a brute-force evaluation in float64."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

import fsd
from conftest import DTYPE, labelled_batches, linear_net, perturbed, stack
from fsd.model import rules

# BatchNorm's rule is checked against the module and hand-folded twins in test_batch_norm.py
SUPPORTED = {nn.Linear, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.ReLU, nn.LeakyReLU,
             nn.MaxPool2d, nn.AvgPool2d, nn.Flatten, nn.Dropout, nn.Identity,
             nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.Softplus, rules.Cast}


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


# ----------------------------------------------------------------------------------------
# brute-force evaluations: explicit loops over outputs, windows and positions
# ----------------------------------------------------------------------------------------
def brute_linear(x, w, b):
    n, (o, i) = x.shape[0], w.shape
    y = torch.zeros(n, o, dtype=DTYPE)
    for r, j in itertools.product(range(n), range(o)):
        y[r, j] = sum(w[j, k] * x[r, k] for k in range(i)) + (0 if b is None else b[j])
    return y


def brute_conv2d(x, w, b, stride, padding, dilation, groups):
    n, c_in, h, wd = x.shape
    c_out, c_per, kh, kw = w.shape
    xp = torch.zeros(n, c_in, h + 2 * padding[0], wd + 2 * padding[1], dtype=DTYPE)
    xp[:, :, padding[0]:padding[0] + h, padding[1]:padding[1] + wd] = x
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    y = torch.zeros(n, c_out, oh, ow, dtype=DTYPE)
    out_per = c_out // groups
    for r, co, i, j in itertools.product(range(n), range(c_out), range(oh), range(ow)):
        first = (co // out_per) * c_per  # the group's first input channel
        total = 0.0 if b is None else float(b[co])
        for ci, u, v in itertools.product(range(c_per), range(kh), range(kw)):
            total += float(w[co, ci, u, v] * xp[r, first + ci, i * stride[0] + u * dilation[0],
                                                 j * stride[1] + v * dilation[1]])
        y[r, co, i, j] = total
    return y


def _windows(h, w, k, s, p):
    """(output position, list of in-range input positions) of a k×k pooling window."""
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    for i, j in itertools.product(range(oh), range(ow)):
        cells = [(i * s + u - p, j * s + v - p) for u, v in itertools.product(range(k), range(k))]
        yield (i, j), [(a, c) for a, c in cells if 0 <= a < h and 0 <= c < w], oh, ow


def brute_max_pool(x, k, s, p):
    n, ch, h, w = x.shape
    windows = list(_windows(h, w, k, s, p))
    oh, ow = windows[0][2], windows[0][3]
    y = torch.zeros(n, ch, oh, ow, dtype=DTYPE)
    index = torch.zeros(n, ch, oh, ow, dtype=torch.long)
    for r, c in itertools.product(range(n), range(ch)):
        for (i, j), cells, _, _ in windows:
            a, b = max(cells, key=lambda cell: float(x[r, c, cell[0], cell[1]]))
            y[r, c, i, j], index[r, c, i, j] = x[r, c, a, b], a * w + b
    return y, index


def brute_avg_pool(x, k, s, p, count_include_pad):
    n, ch, h, w = x.shape
    windows = list(_windows(h, w, k, s, p))
    y = torch.zeros(n, ch, windows[0][2], windows[0][3], dtype=DTYPE)
    for r, c in itertools.product(range(n), range(ch)):
        for (i, j), cells, _, _ in windows:
            total = sum(float(x[r, c, a, b]) for a, b in cells)
            y[r, c, i, j] = total / (k * k if count_include_pad else len(cells))
    return y


# ----------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------
def test_the_registry_holds_exactly_the_tested_layer_types():
    # a newly registered rule must get its brute-force test below
    assert set(rules.RULES) == SUPPORTED


def test_linear_rule_uses_the_parameters_passed_in():
    m = nn.Linear(4, 3).to(DTYPE)
    x, w, b = _randn(5, 4, seed=1), _randn(3, 4, seed=2), _randn(3, seed=3)
    rule = rules.rule_for(m, "")
    assert isinstance(rule, fsd.AffineRule) and rule.flat_moments(m) and rule.hyper(m) == {}
    torch.testing.assert_close(rule.apply(m, x, w, b), brute_linear(x, w, b), rtol=1e-13, atol=0)
    torch.testing.assert_close(rule.apply(m, x, w, None), brute_linear(x, w, None), rtol=1e-13,
                               atol=0)
    with torch.no_grad():  # with the module's own parameters it is the module
        torch.testing.assert_close(rule.apply(m, x, m.weight, m.bias), m(x))


@pytest.mark.parametrize("stride, padding, dilation, groups", [
    ((1, 1), (0, 0), (1, 1), 1), ((2, 1), (1, 2), (1, 1), 1), ((1, 1), (1, 1), (2, 1), 2)])
def test_conv2d_rule_against_explicit_loops(stride, padding, dilation, groups):
    m = nn.Conv2d(2, 4, (3, 2), stride=stride, padding=padding, dilation=dilation,
                  groups=groups).to(DTYPE)
    x = _randn(2, 2, 6, 5, seed=4)
    w, b = _randn(*m.weight.shape, seed=5), _randn(4, seed=6)
    rule = rules.rule_for(m, "conv")
    assert isinstance(rule, fsd.AffineRule) and not rule.flat_moments(m)
    assert rule.hyper(m) == {"stride": list(stride), "padding": list(padding),
                             "dilation": list(dilation), "groups": groups}
    expected = brute_conv2d(x, w, b, stride, padding, dilation, groups)
    torch.testing.assert_close(rule.apply(m, x, w, b), expected, rtol=1e-12, atol=1e-12)
    expected = brute_conv2d(x, w, None, stride, padding, dilation, groups)
    torch.testing.assert_close(rule.apply(m, x, w, None), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv2d_pads_as_the_module_does(mode):
    m = nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode=mode).double()
    x = _randn(2, 2, 5, 6, seed=8)
    rule = rules.rule_for(m, "conv")
    torch.testing.assert_close(rule.apply(m, x, m.weight, m.bias), m(x), rtol=0, atol=0)
    assert rule.hyper(m)["padding_mode"] == mode  # a summary records it
    assert "padding_mode" not in rule.hyper(nn.Conv2d(1, 1, 3))  # older summaries still load


@pytest.mark.parametrize("module, slope", [(nn.ReLU(), 0.0), (nn.LeakyReLU(0.2), 0.2),
                                           (nn.LeakyReLU(), 0.01)])
def test_gate_rules_are_the_activation_and_their_gate_moments_are_enumerated(module, slope):
    x = _randn(4, 6, seed=7)
    rule = rules.rule_for(module, "")
    assert isinstance(rule, fsd.GateRule) and rule.flat_moments(module)
    expected = torch.where(x > 0, x, slope * x)  # the activation, written out
    torch.testing.assert_close(rule.apply(module, x), expected, rtol=0, atol=0)
    # φ(s) = g·s with g the gate of u = 1{s > 0}
    torch.testing.assert_close(rule.gate_values(module, (x > 0).to(DTYPE)) * x, expected,
                               rtol=1e-15, atol=0)
    # u ~ Bernoulli(μ): enumerate u ∈ {0, 1}
    firing = torch.rand(6, generator=torch.Generator().manual_seed(8), dtype=DTYPE)
    values = [slope, 1.0]
    mean = (1 - firing) * values[0] + firing * values[1]
    second = (1 - firing) * values[0] ** 2 + firing * values[1] ** 2
    moments = rule.gate_moments(module, firing)
    for got in (moments.reference_mean, moments.delta_mean):  # r = g
        torch.testing.assert_close(got, mean, rtol=1e-14, atol=0)
    for got in (moments.reference_variance, moments.covariance, moments.delta_variance):
        torch.testing.assert_close(got, second - mean**2, rtol=1e-12, atol=1e-15)
    assert moments.offset == 0.0 and not isinstance(rule, fsd.SmoothGateRule)
    assert rule.hyper(module) == ({} if slope == 0.0 else {"negative_slope": slope})


def _normal_cdf(x):
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def _tanh_gelu(x):
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1 + torch.tanh(inner))


def _tanh_gelu_slope(x):
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return (0.5 * (1 + torch.tanh(inner)) + 0.5 * x * (1 - torch.tanh(inner) ** 2)
            * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x**2))


def _softplus(x, beta=2.0):  # threshold 20: linear above βx = 20
    return torch.where(beta * x > 20, x, torch.log1p(torch.exp(beta * x)) / beta)


# each smooth activation φ with φ and φ' written out from their definitions
SMOOTH = [
    (nn.GELU(), lambda x: x * _normal_cdf(x),
     lambda x: _normal_cdf(x) + x * torch.exp(-x**2 / 2) / math.sqrt(2 * math.pi)),
    (nn.GELU(approximate="tanh"), _tanh_gelu, _tanh_gelu_slope),
    (nn.SiLU(), lambda x: x / (1 + torch.exp(-x)),
     lambda x: 1 / (1 + torch.exp(-x)) * (1 + x * (1 - 1 / (1 + torch.exp(-x))))),
    (nn.Tanh(), lambda x: (torch.exp(2 * x) - 1) / (torch.exp(2 * x) + 1),
     lambda x: 4 / (torch.exp(x) + torch.exp(-x)) ** 2),
    (nn.Sigmoid(), lambda x: 1 / (1 + torch.exp(-x)),
     lambda x: torch.exp(-x) / (1 + torch.exp(-x)) ** 2),
    (nn.ELU(0.7), lambda x: torch.where(x > 0, x, 0.7 * (torch.exp(x) - 1)),
     lambda x: torch.where(x > 0, 1.0, 0.7 * torch.exp(x))),
    (nn.Softplus(beta=2.0), _softplus,
     lambda x: torch.where(2 * x > 20, 1.0, 1 / (1 + torch.exp(-2 * x)))),
]


@pytest.mark.parametrize("module, phi, slope", SMOOTH, ids=[repr(m) for m, _, _ in SMOOTH])
def test_smooth_gate_rules_against_their_written_out_definitions(module, phi, slope):
    x = torch.cat([_randn(200, seed=10) * 3, torch.tensor([0.0, 11.0, -11.0], dtype=DTYPE)])
    rule = rules.rule_for(module, "")
    assert isinstance(rule, fsd.SmoothGateRule) and rule.flat_moments(module)
    torch.testing.assert_close(rule.apply(module, x), phi(x), rtol=1e-12, atol=1e-14)
    a0, g = rule.reference_gates(module, x)
    torch.testing.assert_close(a0, phi(x), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, slope(x), rtol=1e-10, atol=1e-14)
    # the gate pair: a0 = r·s + φ(0) with the secant r (the slope at s = 0), Δa = g·Δs
    offset = rule.gate_offset(module)
    assert offset == pytest.approx(float(phi(torch.zeros((), dtype=DTYPE))), abs=1e-15)
    r, g = rule.gate_pair(module, x)
    torch.testing.assert_close(r * x + offset, phi(x), rtol=1e-12, atol=1e-14)
    assert float(r[200]) == pytest.approx(float(slope(x[200])), rel=1e-12)
    torch.testing.assert_close(g, slope(x), rtol=1e-10, atol=1e-14)
    # the fit averages [r, g, r², rg, g²]; the moments are the sample moments of the pair
    statistics = rule.gate_statistics(module, x.reshape(-1, 1)).mean(0)
    moments = rule.gate_moments(module, statistics)
    centred_r, centred_g = r - r.mean(), g - g.mean()
    for got, expected in [(moments.reference_mean, r.mean()), (moments.delta_mean, g.mean()),
                          (moments.reference_variance, centred_r.pow(2).mean()),
                          (moments.covariance, (centred_r * centred_g).mean()),
                          (moments.delta_variance, centred_g.pow(2).mean())]:
        torch.testing.assert_close(got.squeeze(), expected, rtol=1e-9, atol=1e-14)
    assert moments.offset == offset


def test_smooth_gate_draws_have_the_stored_moments():
    # the bivariate normal BGLN-S draws: its sample moments converge to the stored ones
    module = nn.GELU()
    rule = rules.rule_for(module, "")
    s = _randn(500, 3, seed=11) * torch.tensor([0.5, 2.0, 4.0], dtype=DTYPE) + 0.3
    statistics = rule.gate_statistics(module, s).mean(0)
    moments = rule.gate_moments(module, statistics)
    n = 200_000
    r, g = rule.sample_gates(module, statistics.expand(n, 3, 5),
                             torch.Generator().manual_seed(12))
    # within 5 standard errors of each sample moment
    for sample, expected in [(r, moments.reference_mean), (g, moments.delta_mean)]:
        error = sample.std(0) / math.sqrt(n)
        assert bool(((sample.mean(0) - expected).abs() < 5 * error).all())
    cov = ((r - r.mean(0)) * (g - g.mean(0))).mean(0)
    torch.testing.assert_close(cov, moments.covariance, rtol=0.03, atol=1e-4)
    torch.testing.assert_close(r.var(0), moments.reference_variance, rtol=0.03, atol=1e-4)
    torch.testing.assert_close(g.var(0), moments.delta_variance, rtol=0.03, atol=1e-4)


@pytest.mark.parametrize("k, s, p", [(2, 2, 0), (3, 1, 1), (2, 1, 0)])
def test_maxpool_rule_values_and_argmax_indices(k, s, p):
    m = nn.MaxPool2d(k, s, p)
    x = _randn(2, 3, 5, 6, seed=8)
    rule = rules.rule_for(m, "")
    assert isinstance(rule, fsd.MaxPoolRule) and not rule.flat_moments(m)
    y, index = rule.apply(m, x)
    expected_y, expected_index = brute_max_pool(x, k, s, p)
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)
    assert torch.equal(index, expected_index)
    assert rule.hyper(m)["kernel_size"] == k and rule.hyper(m)["padding"] == p


@pytest.mark.parametrize("k, s, p, include", [(2, 2, 0, True), (3, 1, 1, True),
                                              (3, 2, 1, False)])
def test_avgpool_rule_against_explicit_windows(k, s, p, include):
    m = nn.AvgPool2d(k, s, p, count_include_pad=include)
    x = _randn(2, 2, 5, 6, seed=9)
    rule = rules.rule_for(m, "")
    assert isinstance(rule, fsd.FixedRule) and not rule.flat_moments(m)
    torch.testing.assert_close(rule.apply(m, x), brute_avg_pool(x, k, s, p, include),
                               rtol=1e-13, atol=1e-15)
    assert rule.hyper(m)["count_include_pad"] is include


@pytest.mark.parametrize("start, end, flat", [(1, -1, True), (2, -1, False), (1, 2, False)])
def test_flatten_rule(start, end, flat):
    m = nn.Flatten(start, end)
    x = _randn(2, 3, 4, 5, seed=10)
    rule = rules.rule_for(m, "")
    assert isinstance(rule, fsd.FixedRule) and rule.flat_moments(m) is flat
    assert rule.hyper(m) == {"start_dim": start, "end_dim": end}
    expected = {(1, -1): x.reshape(2, 60), (2, -1): x.reshape(2, 3, 20),
                (1, 2): x.reshape(2, 12, 5)}[(start, end)]
    assert torch.equal(rule.apply(m, x), expected)


@pytest.mark.parametrize("module", [nn.Dropout(0.9), nn.Identity()], ids=["dropout", "identity"])
def test_dropout_and_identity_are_the_identity_even_in_training_mode(module):
    module.train()
    x = _randn(50, 8, seed=11)
    rule = rules.rule_for(module, "")
    assert isinstance(rule, fsd.FixedRule) and rule.flat_moments(module)
    assert torch.equal(rule.apply(module, x), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_cast_is_the_tensor_cast_and_its_own_squared_map(dtype):
    # what plans hold for x.float() / x.to(dtype); BGLN-D's flat path takes it as the identity
    module = rules.Cast(dtype)
    x = _randn(6, 5, seed=12)
    rule = rules.rule_for(module, "")
    assert isinstance(rule, fsd.FixedRule) and rule.flat_moments(module)
    assert rule.hyper(module) == {"dtype": str(dtype)}
    assert rule.squared is not None
    for out in (rule.apply(module, x), rule.squared(module, x), module(x)):
        assert out.dtype == dtype and torch.equal(out, x.to(dtype))


def test_unsupported_module_error_names_class_path_and_the_supported_types():
    with pytest.raises(fsd.UnsupportedModuleError) as info:
        rules.rule_for(nn.Softmax(dim=-1), "encoder.3")
    message = str(info.value)
    assert "Softmax" in message and "'encoder.3'" in message
    # every layer type a user writes; Cast is what plans make of x.float(), not listed
    assert all(t.__name__ in message for t in SUPPORTED - {rules.Cast})
    assert "Cast" not in message
    with pytest.raises(fsd.UnsupportedModuleError, match="'<root>'"):
        rules.rule_for(nn.LayerNorm(3), "")


def test_subclasses_of_supported_types_are_not_matched():
    class LeakyishReLU(nn.ReLU):
        def forward(self, x):
            return super().forward(x) + 0.1 * x

    with pytest.raises(fsd.UnsupportedModuleError, match="LeakyishReLU at '1'"):
        fsd.trace(nn.Sequential(nn.Linear(3, 3), LeakyishReLU()))


class Scale(nn.Module):
    """y = 2x: a parameter-free linear map that no built-in rule covers."""

    def forward(self, x):
        return 2 * x


def test_register_rule_makes_a_new_layer_type_usable(monkeypatch):
    monkeypatch.setattr(rules, "RULES", dict(rules.RULES))  # restored after the test
    model = nn.Sequential(nn.Linear(4, 5), Scale(), nn.Linear(5, 3)).to(DTYPE)
    with pytest.raises(fsd.UnsupportedModuleError, match="Scale at '1'"):
        fsd.trace(model)
    fsd.register_rule(Scale, fsd.FixedRule(apply=lambda m, x: 2 * x))
    assert [type(layer.rule) for layer in fsd.trace(model)] == [fsd.AffineRule, fsd.FixedRule,
                                                                fsd.AffineRule]
    # a network without gates: LAFTR on all the data is the exact FSD
    data = labelled_batches(20, (4,), seed=12)
    other = perturbed(model, 0.3, seed=13)
    laftr = fsd.LAFTR(coreset_size=None).fit(model, data)
    with torch.no_grad():
        xs = stack(data)[0]
        truth = 0.5 * (other(xs) - model(xs)).pow(2).sum(-1).mean()
    torch.testing.assert_close(laftr.distance(other).detach(), truth, rtol=1e-12, atol=0)
    # inside a class's forward the registered layer is a leaf of the trace, not traced into


    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body(x)

    assert [type(layer.module) for layer in fsd.trace(Wrapped())] == [nn.Linear, Scale,
                                                                       nn.Linear]


def test_a_parameter_free_rule_claiming_flat_moments_must_be_the_identity(monkeypatch):
    # BGLN-D's MLP path takes such a layer as the identity: a scaling that claims it would
    # give a distance 4× too small, so fit refuses it in one line
    monkeypatch.setattr(rules, "RULES", dict(rules.RULES))
    fsd.register_rule(Scale, fsd.FixedRule(apply=lambda m, x: 2 * x,
                                           flat_moments=lambda m: True))
    model = nn.Sequential(nn.Linear(4, 5), Scale(), nn.ReLU(), nn.Linear(5, 3)).to(DTYPE)
    data = labelled_batches(20, (4,), seed=12)
    for moments in ("paper", "exact"):
        with pytest.raises(fsd.UnsupportedModuleError,
                           match=r"Scale at '1' has flat_moments=True.*not the identity") as e:
            fsd.BGLN(deterministic=True, moments=moments).fit(model, data)
        assert "\n" not in str(e.value)
    # the built-in parameter-free layers are the identity there
    for layer in (nn.Dropout(0.3), nn.Identity(), nn.Flatten()):
        chain = nn.Sequential(nn.Linear(4, 5), layer, nn.ReLU(), nn.Linear(5, 3)).to(DTYPE)
        fsd.BGLN(deterministic=True).fit(chain, data)


def test_weight_bias_reads_a_layer_from_a_flat_parameter_dict():
    model = linear_net([3, 4, 2], seed=14)
    params = dict(model.named_parameters())
    w, b = rules.weight_bias(params, "1")
    assert w is params["1.weight"] and b is params["1.bias"]
    single = nn.Linear(3, 2, bias=False)
    w, b = rules.weight_bias(dict(single.named_parameters()), "")
    assert w is single.weight and b is None
    with pytest.raises(KeyError):
        rules.weight_bias(params, "2")


class Diagonal(nn.Module):
    """y = w ⊙ x + b: an affine layer that no built-in rule covers (as in the user guide)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.weight + self.bias


def _diagonal_rule(flat: bool) -> rules.AffineRule:
    # W and b are the module's weight and bias (the default parameters); W as an (out, in)
    # matrix is diag(w)
    return fsd.AffineRule(apply=lambda m, x, w, b: x * w if b is None else x * w + b,
                          dense=torch.diag_embed, flat_moments=lambda m: flat)


def _folded(model: nn.Sequential) -> nn.Sequential:
    """``model`` with each Diagonal folded into the Linear before it: W ← diag(w) W, b ← w b + c."""
    layers: list[nn.Module] = []
    for m in model:
        if isinstance(m, Diagonal):
            linear = layers[-1]
            assert isinstance(linear, nn.Linear)
            with torch.no_grad():
                linear.weight.copy_(m.weight.unsqueeze(-1) * linear.weight)
                linear.bias.copy_(m.weight * linear.bias + m.bias)
        else:
            layers.append(copy.deepcopy(m))
    return nn.Sequential(*layers)


def test_a_registered_affine_rule_is_exact_for_laftr_and_walked_by_bgln_d(monkeypatch):
    monkeypatch.setattr(rules, "RULES", dict(rules.RULES))  # restored after the test
    fsd.register_rule(Diagonal, _diagonal_rule(flat=True))
    torch.manual_seed(0)
    data = labelled_batches(40, (4,), seed=14)
    # no gates: LAFTR (the affine rule's ΔW a0 + W1 Δa + Δb) is the exact FSD
    model = nn.Sequential(nn.Linear(4, 5), Diagonal(5), nn.Linear(5, 3)).to(DTYPE)
    assert [type(layer.rule) for layer in fsd.trace(model)] == [fsd.AffineRule] * 3
    other = perturbed(model, 0.3, seed=15)
    laftr = fsd.LAFTR(coreset_size=None).fit(model, data).distance(other)
    exact = fsd.ExactFSD().fit(model, data).distance(other)
    torch.testing.assert_close(laftr, exact, rtol=1e-12, atol=0)
    # an MLP: BGLN-D composes Linear then Diagonal into one map, as if folded by hand
    model = nn.Sequential(nn.Linear(4, 6), Diagonal(6), nn.ReLU(), nn.Linear(6, 3)).to(DTYPE)
    other = perturbed(model, 0.1, seed=16)
    values = {}
    for moments in ("paper", "exact"):
        values[moments] = fsd.BGLN(deterministic=True, covariance="full", moments=moments).fit(
            model, data).distance(other).detach()
        expected = fsd.BGLN(deterministic=True, covariance="full", moments=moments).fit(
            _folded(model), data).distance(_folded(other)).detach()
        assert values[moments].item() > 0
        torch.testing.assert_close(values[moments], expected, rtol=1e-10, atol=0)
    # without flat moments BGLN-D takes the convolutional path, applying the rule's own map
    fsd.register_rule(Diagonal, _diagonal_rule(flat=False))
    general = fsd.BGLN(deterministic=True, covariance="full").fit(model, data)
    assert general._meta["evaluator"] == "algorithm2-conv"
    torch.testing.assert_close(general.distance(other).detach(), values["paper"], rtol=1e-10,
                               atol=0)


class Negate(nn.Module):
    """y = −x: an operation of no built-in type, for a rule written from fsd.Rule itself."""

    def forward(self, x):
        return -x


class NegateRule(fsd.Rule):
    """A user's own operation type: its linearized step and its map in Algorithm 2."""

    def linearized(self, layer, a0, da, params0, params1, gate):
        return -a0, None if da is None else -da

    def expected_reference(self, layer, x, statistics, offset):
        return -x

    def expected_delta(self, layer, x, statistics):
        return -x


def test_a_rule_of_a_new_operation_type_runs_every_walk(monkeypatch):
    monkeypatch.setattr(rules, "RULES", dict(rules.RULES))  # restored after the test
    # flat_moments claimed, but the MLP path knows only its own rule types: it must not skip it
    fsd.register_rule(Negate, NegateRule(apply=lambda m, x: -x, flat_moments=lambda m: True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Negate(), nn.ReLU(), nn.Linear(6, 3)).to(DTYPE)
    other = perturbed(model, 0.1, seed=17)

    def folded(m: nn.Sequential) -> nn.Sequential:  # −(Wx + b) as one Linear
        twin = nn.Sequential(copy.deepcopy(m[0]), nn.ReLU(), copy.deepcopy(m[3]))
        with torch.no_grad():
            twin[0].weight.neg_()
            twin[0].bias.neg_()
        return twin

    data = labelled_batches(40, (4,), seed=18)
    for make in (lambda: fsd.LAFTR(coreset_size=None),
                 lambda: fsd.BGLN(deterministic=True, covariance="full")):
        got = make().fit(model, data).distance(other).detach()
        expected = make().fit(folded(model), data).distance(folded(other)).detach()
        assert got.item() > 0
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    with pytest.raises(TypeError, match=r"subclass of fsd\.Rule"):
        fsd.register_rule(Negate, object())  # type: ignore[arg-type]
