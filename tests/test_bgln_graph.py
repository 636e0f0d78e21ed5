"""BGLN-S on graphs that are not chains (residual additions), against closed forms.

Ground truth: with every gate pair (r, g) fixed, BGLN's network is affine in the input — the
reference side a0 = r·s0 + φ(0), the difference side Δa = g·Δs, every other operation
(Linear, the residual +) linear — so Δz = D x + e, with D and e tracked here by hand with
dense float64 matrices along the residual structure, and E_x[½‖Δz‖²] under x ~ N(m, Σ) is
½ tr(D Σ Dᵀ) + ½ ‖D m + e‖². BGLN-S's expectation is the sum of that over every gate
configuration, weighted by its probability: Bernoulli(μ) for a ReLU, μ the firing
frequencies computed here from the data; for a smooth activation any law with the stored
moments of (r, g), e.g. four points per unit (Δz is linear in each unit's pair, so the
expectation of ½‖Δz‖² depends on the first and second moments of the pairs only).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jvp

import fsd
from conftest import DTYPE, labelled_batches, mlp, perturbed
from fsd.model.linearize import graph_gates, linearized_outputs, propagate_linearized
from fsd.model.plan import trace
from fsd.model.rules import TracedLayer

pytestmark = pytest.mark.usefixtures("single_thread")


class Residual(nn.Module):
    """x (3) → h = φ1(fc1 x) → y = x + fc2 h → z = out φ2(fc3 y) + skip y: six gated units.

    φ1 is a function call (its path is the graph node's name), φ2 a module.
    """

    def __init__(self, smooth: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2, self.fc3 = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
        self.out, self.skip = nn.Linear(3, 2), nn.Linear(3, 2, bias=False)
        self.smooth = smooth
        self.act = nn.Sigmoid() if smooth else nn.ReLU()

    def first(self, s: torch.Tensor) -> torch.Tensor:
        return F.gelu(s) if self.smooth else F.relu(s)

    def forward(self, x):
        h = F.gelu(self.fc1(x)) if self.smooth else F.relu(self.fc1(x))
        y = x + self.fc2(h)
        return self.out(self.act(self.fc3(y))) + self.skip(y)

    def preactivations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of the two activations, computed by hand."""
        s1 = x @ self.fc1.weight.T + self.fc1.bias
        y = x + self.first(s1) @ self.fc2.weight.T + self.fc2.bias
        return s1, y @ self.fc3.weight.T + self.fc3.bias


FIRST = {False: "relu", True: "gelu"}  # the function call's graph node name


def _data(n: int = 4000, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(3, (n,), generator=g)
    x = torch.randn(n, 3, generator=g, dtype=DTYPE) * 1.3
    x = x + torch.tensor([0.6, -0.4, 0.3], dtype=DTYPE) * (y.to(DTYPE) - 1)[:, None]
    return [(x[i:i + 1000], y[i:i + 1000]) for i in range(0, n, 1000)]


def _stacked(data) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])


def _params(model: Residual) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    zero = torch.zeros(2, dtype=DTYPE)
    return {name: (getattr(model, name).weight.detach(),
                   zero if getattr(model, name).bias is None
                   else getattr(model, name).bias.detach())
            for name in ("fc1", "fc2", "fc3", "out", "skip")}


def _closed_form(model: Residual, moved: Residual, mean: torch.Tensor, cov: torch.Tensor,
                 laws: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]
                 ) -> torch.Tensor:
    """E[½‖Δz‖²] over x ~ N(mean, cov) and the gate laws, by enumerating configurations.

    ``laws``: per activation (r (units, K), g (units, K), p (units, K), φ(0)), K points per
    unit. Affine maps in x are pairs (M, c), batched over the configurations.
    """
    p0, p1 = _params(model), _params(moved)
    k = laws[0][0].shape[1]
    units = [law[0].shape[0] for law in laws]
    index = torch.cartesian_prod(*[torch.arange(k)] * sum(units))  # (C, 6)
    pairs, weight, start = [], torch.ones(index.shape[0], dtype=DTYPE), 0
    for (r, g, p, offset), n in zip(laws, units, strict=True):
        pick = index[:, start:start + n]  # (C, n)
        rows = torch.arange(n)
        pairs.append((torch.diag_embed(r[rows, pick]), torch.diag_embed(g[rows, pick]), offset))
        weight = weight * p[rows, pick].prod(-1)
        start += n
    (r1, g1, off1), (r2, g2, off2) = pairs

    def linear(name, params, value):  # W·(M, c) + b
        w, b = params[name]
        return w @ value[0], (w @ value[1].unsqueeze(-1)).squeeze(-1) + b

    def diff(name, ref, d):  # ΔW·ref + W1·d + Δb (d None: the input does not move)
        (w0, b0), (w1, b1) = p0[name], p1[name]
        m = (w1 - w0) @ ref[0]
        c = ((w1 - w0) @ ref[1].unsqueeze(-1)).squeeze(-1) + (b1 - b0)
        if d is not None:
            m, c = m + w1 @ d[0], c + (w1 @ d[1].unsqueeze(-1)).squeeze(-1)
        return m, c

    def gated(gate, value, offset=0.0):
        return gate @ value[0], (gate @ value[1].unsqueeze(-1)).squeeze(-1) + offset

    def add(a, b):
        return a[0] + b[0], a[1] + b[1]

    eye = torch.eye(3, dtype=DTYPE)
    x = (eye.expand(index.shape[0], 3, 3), torch.zeros(index.shape[0], 3, dtype=DTYPE))
    # reference side
    s1 = linear("fc1", p0, x)
    a1 = gated(r1, s1, off1)
    y0 = add(x, linear("fc2", p0, a1))
    s2 = linear("fc3", p0, y0)
    a2 = gated(r2, s2, off2)
    # difference side (the input and the residual's x do not move)
    ds1 = diff("fc1", x, None)
    da1 = gated(g1, ds1)
    dy = diff("fc2", a1, da1)
    ds2 = diff("fc3", y0, dy)
    da2 = gated(g2, ds2)
    d_map, d_offset = add(diff("out", a2, da2), diff("skip", y0, dy))
    centre = (d_map @ mean) + d_offset
    per_config = 0.5 * (torch.einsum("cij,jk,cik->c", d_map, cov, d_map)
                        + centre.pow(2).sum(-1))
    return (weight * per_config).sum()


def _bernoulli_law(mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """A ReLU unit's gate r = g = u ∈ {1, 0} with probabilities μ, 1 − μ."""
    u = torch.tensor([1.0, 0.0], dtype=DTYPE).expand(len(mu), 2)
    return u, u, torch.stack([mu, 1 - mu], -1), 0.0


def _four_point_law(moments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """mean + L·(±1, ±1), L the Cholesky factor of Cov(r, g): the stored moments exactly."""
    root = moments.reference_variance.clamp_min(0).sqrt()
    lower = torch.where(root > 0, moments.covariance / torch.where(root > 0, root, 1), 0)
    rest = (moments.delta_variance - lower**2).clamp_min(0).sqrt()
    signs = torch.tensor([[1, 1], [1, -1], [-1, 1], [-1, -1]], dtype=DTYPE)
    r = moments.reference_mean[:, None] + root[:, None] * signs[:, 0]
    g = moments.delta_mean[:, None] + lower[:, None] * signs[:, 0] + rest[:, None] * signs[:, 1]
    return r, g, torch.full_like(r, 0.25), moments.offset


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    centred = x - x.mean(0)
    return x.mean(0), centred.T @ centred / len(x)


def _monte_carlo(est: fsd.BGLN, moved: nn.Module, calls: int = 12) -> tuple[float, float]:
    with torch.no_grad():
        draws = torch.stack([est.distance(moved) for _ in range(calls)])
    return float(draws.mean()), float(draws.std() / math.sqrt(calls))


@pytest.mark.parametrize("inputs, classwise", [("gaussian", False), ("gaussian", True),
                                               ("coreset", True)])
def test_bgln_s_on_a_residual_relu_network_is_unbiased_for_the_closed_form(inputs, classwise):
    model = Residual()
    model.to(DTYPE)
    moved = perturbed(model, 0.3, seed=2)
    data = _data()
    est = fsd.BGLN(inputs=inputs, covariance="full", classwise=classwise, coreset_size=None,
                   num_samples=40_000, seed=3).fit(model, data)
    xs, ys = _stacked(data)
    classes = [ys == c for c in range(3)] if classwise else [torch.ones_like(ys, dtype=bool)]
    expected = torch.zeros((), dtype=DTYPE)
    with torch.no_grad():
        for members in classes:
            x = xs[members]
            s1, s2 = model.preactivations(x)
            laws = [_bernoulli_law((s1 > 0).to(DTYPE).mean(0)),
                    _bernoulli_law((s2 > 0).to(DTYPE).mean(0))]
            expected += members.to(DTYPE).mean() * _closed_form(model, moved, *_moments(x),
                                                                 laws)
    mean, standard_error = _monte_carlo(est, moved)
    assert abs(mean - float(expected)) < 5 * standard_error
    assert standard_error < 0.02 * float(expected)  # the test has power
    # and the gates matter: LAFTR's true gates give another number, far outside the noise
    laftr = float(fsd.LAFTR(coreset_size=None).fit(model, data).distance(moved))
    assert abs(laftr - float(expected)) > 20 * standard_error


def test_bgln_s_on_a_smooth_residual_network_is_unbiased_for_a_law_with_the_fitted_moments():
    # F.gelu (φ(0) = 0) then nn.Sigmoid (φ(0) = ½, the offset on the reference side)
    model = Residual(smooth=True)
    model.to(DTYPE)
    with torch.no_grad():  # pre-activations of a few units, where secant and slope differ
        model.fc1.weight.mul_(3)
        model.fc3.weight.mul_(3)
    moved = perturbed(model, 0.3, seed=2)
    data = _data()
    est = fsd.BGLN(covariance="full", num_samples=40_000, seed=3).fit(model, data)
    stored = est._gate_means()
    laws = []
    for layer in graph_gates(model):
        moments = layer.rule.gate_moments(layer.module, stored[layer.path][0])
        laws.append(_four_point_law(moments))
    assert [law[3] for law in laws] == [0.0, 0.5]
    xs, _ = _stacked(data)
    with torch.no_grad():
        expected = float(_closed_form(model, moved, *_moments(xs), laws))
        # a likely mistake, differences gated by the secant r instead of the slope g, is
        # far outside the noise (φ(0) on the reference side is checked exactly by
        # test_the_graph_walker_with_a_gate_callback_equals_the_chain_walker)
        secant_only = float(_closed_form(model, moved, *_moments(xs),
                                         [(r, r, p, offset) for r, _, p, offset in laws]))
    mean, standard_error = _monte_carlo(est, moved)
    assert abs(mean - expected) < 5 * standard_error
    assert standard_error < 0.02 * expected
    assert abs(mean - secant_only) > 10 * standard_error


@pytest.mark.parametrize("classwise", [False, True])
def test_stored_gate_statistics_of_a_residual_network_are_the_data_averages(classwise):
    data = _data(600)
    xs, ys = _stacked(data)
    for smooth in (False, True):
        model = Residual(smooth=smooth)
        model.to(DTYPE)
        est = fsd.BGLN(classwise=classwise).fit(model, data)
        groups = [ys == c for c in range(3)] if classwise else [torch.ones_like(ys, dtype=bool)]
        first, second = FIRST[smooth], "act"
        for g, members in enumerate(groups):
            with torch.no_grad():
                s1, s2 = model.preactivations(xs[members])
            if not smooth:  # firing frequencies
                torch.testing.assert_close(est._state[f"gate.{first}"][g],
                                           (s1 > 0).to(DTYPE).mean(0), rtol=0, atol=1e-15)
                torch.testing.assert_close(est._state[f"gate.{second}"][g],
                                           (s2 > 0).to(DTYPE).mean(0), rtol=0, atol=1e-15)
                continue
            for key, s, phi in ((f"gate_moments.{first}", s1, F.gelu),
                                (f"gate_moments.{second}", s2, torch.sigmoid)):
                r = (phi(s) - phi(torch.zeros((), dtype=DTYPE))) / s  # no s is exactly 0
                slope = jvp(phi, (s,), (torch.ones_like(s),))[1]
                expected = torch.stack([r, slope, r * r, r * slope, slope * slope], -1).mean(0)
                torch.testing.assert_close(est._state[key][g], expected, rtol=1e-12,
                                           atol=1e-15)
        assert sorted(k for k in est._state if k.startswith("gate")) == \
            sorted([f"gate{'_moments' if smooth else ''}.{p}" for p in (first, second)])


class ModuleResidual(nn.Module):
    """The ReLU Residual with both activations as modules (hookable during training)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.out = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.act1, self.act2 = nn.ReLU(), nn.ReLU()

    def forward(self, x):
        y = x + self.fc2(self.act1(self.fc1(x)))
        return self.out(self.act2(y))


def test_a_collector_recording_during_training_gives_the_summary_of_fit():
    model = ModuleResidual().to(DTYPE)
    data = _data(600)
    with fsd.StatisticsCollector(model) as collector:
        assert collector.gate_paths == ["act1", "act2"]
        for x, y in data:
            with collector.record(labels=y):
                model(x)
        recorded = fsd.BGLN(classwise=True, covariance="full").fit(model, statistics=collector)
    fitted = fsd.BGLN(classwise=True, covariance="full").fit(model, data)
    for key in fitted._state:
        torch.testing.assert_close(recorded._state[key], fitted._state[key], rtol=1e-12,
                                   atol=1e-15)
    moved = perturbed(model, 0.3, seed=2)
    torch.testing.assert_close(recorded.distance(moved), fitted.distance(moved), rtol=1e-12,
                               atol=0)
    # a function call cannot be hooked: the collector says to use fit(model, data)
    with pytest.raises(fsd.UnsupportedModuleError, match=r"'relu' is a function call.*fit\("):
        fsd.StatisticsCollector(Residual().to(DTYPE))


def test_an_activation_module_called_twice_has_statistics_per_call():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.out = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
            self.act = nn.ReLU()

        def forward(self, x):
            y = x + self.fc2(self.act(self.fc1(x)))
            return self.out(self.act(y))

    model = Twice().to(DTYPE)
    data = _data(50)
    # each call is its own gate, keyed by its graph node (tests/test_graph_calls.py has more)
    assert [layer.path for layer in graph_gates(model)] == ["act", "act_1"]
    est = fsd.BGLN().fit(model, data)
    xs = torch.cat([x for x, _ in data])
    with torch.no_grad():
        s1 = model.fc1(xs)
        s2 = xs + model.fc2(F.relu(s1))
    torch.testing.assert_close(est._state["gate.act"][0], (s1 > 0).to(DTYPE).mean(0))
    torch.testing.assert_close(est._state["gate.act_1"][0], (s2 > 0).to(DTYPE).mean(0))
    assert float(fsd.LAFTR().fit(model, data).distance(perturbed(model, 0.3))) > 0


def test_bgln_d_on_a_residual_network_says_in_one_line_what_takes_the_graph():
    model = Residual().to(DTYPE)
    with pytest.raises(fsd.UnsupportedModuleError,
                       match=r"not a chain of layers at graph node 'add'.*moments='paper' "
                             r"\(Algorithm 2\) takes chains.*use BGLN-D with moments='exact'.*"
                             r"BGLN-S or LAFTR on any graph") as info:
        fsd.BGLN(deterministic=True).fit(model, _data(50))
    assert "\n" not in str(info.value)


def test_a_graph_summary_survives_save_and_load(tmp_path):
    model = Residual(smooth=True)
    model.to(DTYPE)
    moved = perturbed(model, 0.3, seed=2)
    make = lambda: fsd.BGLN(classwise=True, num_samples=64, seed=4)  # noqa: E731
    first = float(make().fit(model, _data(300)).distance(moved))
    est = make().fit(model, _data(300))
    est.save(tmp_path / "residual.fsd")
    loaded = fsd.load(tmp_path / "residual.fsd")
    # the sampling stream restarts from the seed: the first call after load is the first
    assert float(loaded.distance(moved)) == first
    assert float(est.distance(moved)) == first
    # the summary records the activations by path: the same parameters with a ReLU where
    # the Sigmoid was is another architecture
    other = Residual(smooth=True)
    other.to(DTYPE)
    other.act = nn.ReLU()
    with pytest.raises(fsd.ArchitectureMismatchError, match="Sigmoid"):
        loaded.distance(other)


def test_an_activation_of_parameters_alone_is_linearized_not_gated():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
            self.scale = nn.Parameter(torch.zeros(4))

        def forward(self, x):
            h = F.relu(self.fc1(x)) * F.softplus(self.scale)
            return self.fc2(h) + x[:, :2]

    torch.manual_seed(0)
    model = Scaled().to(DTYPE)
    assert [layer.path for layer in graph_gates(model)] == ["relu"]
    est = fsd.BGLN().fit(model, _data(200))
    assert sorted(k for k in est._state if k.startswith("gate")) == ["gate.relu"]
    assert float(est.distance(perturbed(model, 0.3))) > 0


class _ResidualWith(nn.Module):
    def __init__(self, act) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(3, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.act = act

    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.out(h + self.act(self.fc2(h)))


@pytest.mark.parametrize("spelling", [lambda h: h.clamp(min=0), lambda h: torch.clamp(h, 0),
                                      lambda h: h.clamp_min(0), lambda h: torch.clamp_min(h, 0)])
def test_a_relu_spelled_as_a_clamp_is_gated_like_f_relu(spelling):
    # it was linearized at the sampled reference instead (−35 % on a CNN), without a word
    def pair(act):
        torch.manual_seed(0)
        model = _ResidualWith(act).to(DTYPE)
        return model, perturbed(model, 0.3)
    model, moved = pair(spelling)
    twin, twin_moved = pair(F.relu)
    assert len(graph_gates(model)) == 2
    data = _data(200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a gated clamp is not an ungated activation
        value = fsd.BGLN(seed=3).fit(model, data).distance(moved)
    assert value.item() == fsd.BGLN(seed=3).fit(twin, data).distance(twin_moved).item()

    class Chain(nn.Module):  # and a chain reads it as a ReLU layer (Algorithm 2 walks it)
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(3, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.fc2(spelling(self.fc1(x)))
    assert [type(layer.module) for layer in trace(Chain())] == [nn.Linear, nn.ReLU, nn.Linear]


@pytest.mark.parametrize("act, named", [(nn.ReLU6(), "ReLU6 at 'act'"),
                                        (lambda h: h.clamp(0, 1), "clamp at 'clamp'"),
                                        (F.hardswish, "hardswish at 'hardswish'")])
def test_bgln_s_says_which_activations_it_does_not_gate(act, named):
    torch.manual_seed(0)
    model = _ResidualWith(act).to(DTYPE)
    with pytest.warns(UserWarning, match=f"linearized at the reference.*{named}"):
        est = fsd.BGLN().fit(model, _data(200))
    assert math.isfinite(float(est.distance(perturbed(model, 0.3))))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # LAFTR linearizes every activation: nothing to say
        fsd.LAFTR().fit(model, _data(200))


# ----------------------------------------------------------------------------------------
# the chain path is unchanged
# ----------------------------------------------------------------------------------------
# BGLN-S on a plain chain, computed before graphs were supported (commit ba9cbb6), two
# successive distance() calls each: the same seed must still give the same numbers
CHAIN_VALUES = {
    "gaussian": (0.1329516661488101, 0.16712304025263458),
    "coreset-cw": (0.11477337122360005, 0.08902599643518197),
    "gaussian-cw-full": (0.12497862761528336, 0.1103625110295737),
    "gelu": (0.13022697712913434, 0.14766920789465734),
}


@pytest.mark.parametrize("name", sorted(CHAIN_VALUES))
def test_bgln_s_on_a_chain_gives_the_numbers_it_gave_before(name):
    data = labelled_batches(120, (4,), classes=3, seed=0)
    make = {"gaussian": lambda: fsd.BGLN(num_samples=64, seed=5),
            "coreset-cw": lambda: fsd.BGLN(inputs="coreset", classwise=True, seed=5),
            "gaussian-cw-full": lambda: fsd.BGLN(covariance="full", classwise=True,
                                                 num_samples=64, seed=5),
            "gelu": lambda: fsd.BGLN(num_samples=64, seed=5, covariance="full")}[name]
    if name == "gelu":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3)).to(DTYPE)
    else:
        model = mlp([4, 6, 5, 3], seed=0)
    moved = perturbed(model, 0.2, seed=1)
    est = make().fit(model, data)
    with torch.no_grad():
        got = tuple(float(est.distance(moved)) for _ in range(2))
    # rel 1e-8, not 1e-12: the CPU's vector width changes the last bits of the float64 draws
    # and reductions, which the Monte Carlo mean carries to 2e-9 (seen between two machines);
    # any change to the estimator moves these numbers by far more
    assert got == pytest.approx(CHAIN_VALUES[name], rel=1e-8, abs=0)


@pytest.mark.parametrize("kind", ["cnn", "smooth"])
def test_the_graph_walker_with_a_gate_callback_equals_the_chain_walker(kind):
    # the same (deterministic, non-trivial) gates in both walkers
    torch.manual_seed(1)
    if kind == "cnn":
        model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(27, 8), nn.LeakyReLU(0.1),
                              nn.Linear(8, 3)).to(DTYPE)
        x = torch.randn(10, 1, 6, 6, dtype=DTYPE)
    else:
        model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 5), nn.Sigmoid(),
                              nn.Linear(5, 3)).to(DTYPE)
        x = torch.randn(10, 4, dtype=DTYPE)
    moved = perturbed(model, 0.2, seed=3)
    calls: list[str] = []

    def gate(layer: TracedLayer, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(layer.path)
        g = torch.Generator().manual_seed(len(layer.path) + 10 * int(layer.path))
        r, slope = torch.rand(2, *s0.shape, generator=g, dtype=s0.dtype)
        return r * s0 + layer.rule.gate_offset(layer.module), slope

    params0 = {k: v.detach() for k, v in model.named_parameters()}
    z0, dz = propagate_linearized(trace(model), params0, dict(moved.named_parameters()), x,
                                  gate)
    chain_calls = list(calls)
    calls.clear()
    g0, gz = linearized_outputs(moved, params0, x, gate)
    assert calls == chain_calls == [layer.path for layer in trace(model)
                                    if isinstance(layer.rule, fsd.GateRule)]
    torch.testing.assert_close(g0, z0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gz, dz, rtol=1e-12, atol=1e-14)
