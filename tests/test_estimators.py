"""Ground-truth tests of every FSD estimator against independent brute-force computations.

Each reference is written from the paper's definitions (§3, Algorithms 1–2, Appendix B) with plain
numpy/torch loops, below or in fsd.testing, without using the library's own walks
(fsd.model.linearize, fsd.moments). Everything runs in float64 so exact identities are checked to
~1e-10 relative; Monte Carlo estimators are checked to 5 standard errors estimated from repeated
independent calls.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsd
from conftest import (
    DTYPE,
    cnn,
    distance_fn,
    labelled_batches,
    linear_net,
    mlp,
    perturbed,
    stack,
)
from fsd.testing import dense_algorithm2, linearized_outputs

pytestmark = pytest.mark.usefixtures("single_thread")

METRICS = ("euclidean", "softmax_euclidean", "kl")


# ----------------------------------------------------------------------------------------
# independent metric implementations (numpy)
# ----------------------------------------------------------------------------------------
def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float64) if isinstance(t, torch.Tensor) \
        else np.asarray(t, dtype=np.float64)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def rho(metric: str, z0, z1) -> np.ndarray:
    """Per-example output distance ρ(z0, z1), rows = examples."""
    z0, z1 = _np(z0), _np(z1)
    if metric == "euclidean":
        return 0.5 * ((z1 - z0) ** 2).sum(-1)
    if metric == "softmax_euclidean":
        return 0.5 * ((_softmax(z1) - _softmax(z0)) ** 2).sum(-1)
    lp0, lp1 = _log_softmax(z0), _log_softmax(z1)
    return (np.exp(lp0) * (lp0 - lp1)).sum(-1)


def linears(model: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(_np(m.weight), _np(m.bias)) for m in model if isinstance(m, nn.Linear)]


def relu_paths(model: nn.Sequential) -> list[str]:
    return [name for name, m in model.named_children() if isinstance(m, nn.ReLU)]


# ----------------------------------------------------------------------------------------
# 1. θ = θ0: every estimator is exactly zero with zero gradient
# ----------------------------------------------------------------------------------------
def _zero_cases():
    cases = []
    for m in METRICS:
        cases += [
            (f"exact-{m}", lambda m=m: fsd.ExactFSD(metric=m), True),
            (f"laftr-coreset-{m}", lambda m=m: fsd.LAFTR(metric=m), True),
            (f"laftr-gauss-{m}", lambda m=m: fsd.LAFTR(inputs="gaussian", metric=m,
                                                       num_samples=32), True),
            (f"bgln-s-{m}", lambda m=m: fsd.BGLN(metric=m, num_samples=32), True),
            (f"bgln-s-coreset-{m}", lambda m=m: fsd.BGLN(inputs="coreset", metric=m), True),
            (f"bgln-s-cw-{m}", lambda m=m: fsd.BGLN(classwise=True, metric=m,
                                                    num_samples=32), True),
            (f"ntk-{m}", lambda m=m: fsd.NTK(metric=m), True),
            (f"ewc-true-{m}", lambda m=m: fsd.EWC(fisher="true", metric=m), True),
        ]
    cases += [
        ("bgln-d", lambda: fsd.BGLN(deterministic=True), False),
        ("bgln-d-diag", lambda: fsd.BGLN(deterministic=True, covariance="diag"), False),
        ("bgln-d-cw", lambda: fsd.BGLN(deterministic=True, classwise=True), False),
        ("bgln-d-cw2", lambda: fsd.BGLN(deterministic=True, classwise=2), False),
        ("ewc-sampled-kl", lambda: fsd.EWC(fisher="sampled", metric="kl"), True),
        ("ewc-sampled-euclidean", lambda: fsd.EWC(fisher="sampled", metric="euclidean"), True),
        ("ewc-empirical-kl", lambda: fsd.EWC(fisher="empirical", metric="kl"), True),
    ]
    out = []
    for name, make, conv_ok in cases:
        out.append(pytest.param(make, "mlp", id=f"{name}-mlp"))
        # conv: every estimator once, with the KL metric where it has one (keeps time down)
        if conv_ok and not name.endswith(("-euclidean", "-softmax_euclidean")):
            out.append(pytest.param(make, "cnn", id=f"{name}-cnn"))
    return out


@pytest.mark.parametrize("make, kind", _zero_cases())
def test_zero_at_reference(make, kind):
    if kind == "mlp":
        model, data = mlp([5, 6, 4, 3], seed=0), labelled_batches(30, (5,), seed=0)
    else:
        model, data = cnn(seed=0), labelled_batches(6, (1, 8, 8), batch=4, seed=0)
    est = make().fit(model, data)
    d = est.distance(model)
    assert d.dim() == 0 and d.dtype == DTYPE
    # Δθ = 0 gives Δz = 0 exactly in every estimator; 1e-12 leaves room only for KL's
    # Σ p log p round-off, which is exactly 0 here anyway.
    assert abs(float(d)) <= 1e-12
    params = list(model.parameters())
    grads = torch.autograd.grad(d, params, allow_unused=True)
    for g in grads:
        assert g is not None, "distance must depend on every parameter"
        assert float(g.abs().max()) <= 1e-12


# ----------------------------------------------------------------------------------------
# 2. networks without activations: LAFTR(coreset, all data) == ExactFSD
# ----------------------------------------------------------------------------------------
def _manual_fsd(model0: nn.Module, model1: nn.Module, xs: torch.Tensor, metric: str) -> float:
    """(1/N) Σ_i ρ(f(x_i, θ0), f(x_i, θ)) by an explicit loop, both models in eval mode."""
    m0, m1 = copy.deepcopy(model0).eval(), copy.deepcopy(model1).eval()
    with torch.no_grad():
        vals = [rho(metric, m0(x[None]), m1(x[None]))[0] for x in xs]
    return float(np.mean(vals))


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("arch", ["linear", "conv", "dropout"])
def test_laftr_exact_without_activations(arch, metric):
    torch.manual_seed(0)
    if arch == "linear":
        model, data = linear_net([5, 7, 6, 4], seed=0), labelled_batches(30, (5,), seed=1)
    elif arch == "conv":
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(72, 4)).to(DTYPE)
        data = labelled_batches(12, (1, 8, 8), batch=5, seed=1)
    else:
        model = nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.5), nn.Linear(7, 6),
                              nn.Dropout(0.3), nn.Linear(6, 4)).to(DTYPE)
        data = labelled_batches(30, (5,), seed=1)
        model.train()  # Dropout must still act as the identity inside fit and distance
    other = perturbed(model, 0.3, seed=2)
    other.train(model.training)
    laftr = fsd.LAFTR(inputs="coreset", coreset_size=None, metric=metric).fit(model, data)
    exact = fsd.ExactFSD(metric=metric).fit(model, data)
    d_laftr, d_exact = float(laftr.distance(other)), float(exact.distance(other))
    truth = _manual_fsd(model, other, stack(data)[0], metric)
    assert truth > 1e-4  # the perturbation is not negligible
    # float64 throughout: only round-off separates them
    assert abs(d_laftr - truth) <= 1e-10 * truth
    assert abs(d_exact - truth) <= 1e-10 * truth
    if arch == "dropout":
        assert model.training and other.training  # mode flags restored
        assert all(m.training for m in other.modules())


# ----------------------------------------------------------------------------------------
# 3. LAFTR(coreset) == brute-force linearized forward (ReLU gates + max-pool routing)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mlp", "mlp-nobias", "cnn"])
def test_laftr_coreset_matches_brute_force(arch):
    if arch == "mlp":
        model, data = mlp([5, 8, 6, 3], seed=3), labelled_batches(25, (5,), seed=4)
    elif arch == "mlp-nobias":
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(5, 8, bias=False), nn.ReLU(), nn.Linear(8, 6),
                              nn.ReLU(), nn.Linear(6, 3, bias=False)).to(DTYPE)
        data = labelled_batches(25, (5,), seed=4)
    else:
        model, data = cnn(seed=3), labelled_batches(10, (1, 8, 8), batch=4, seed=4)
    other = perturbed(model, 0.3, seed=5)
    xs = stack(data)[0]
    with torch.no_grad():
        pairs = [linearized_outputs(model, other, x) for x in xs]
        # the reference forward reproduces the model exactly (sanity of the brute force)
        z_ref = torch.stack([p[0] for p in pairs])
        assert torch.allclose(z_ref, model(xs), rtol=1e-12, atol=1e-12)
    for metric in METRICS:
        truth = float(np.mean([rho(metric, z0[None], z1[None])[0] for z0, z1 in pairs]))
        est = fsd.LAFTR(inputs="coreset", coreset_size=None, metric=metric).fit(model, data)
        got = float(est.distance(other))
        assert abs(got - truth) <= 1e-10 * truth, metric
        # the linearization matters here (the test could tell LAFTR from exact FSD)
        exact = _manual_fsd(model, other, xs, metric)
        assert abs(exact - truth) > 1e-4 * truth, metric


def test_coreset_reservoir_is_uniform():
    """Every example is kept with probability size/N (reservoir sampling): inclusion
    frequencies over 2000 seeds within 5 binomial standard errors of 3/10."""
    from fsd.statistics.coreset import Reservoir

    x = torch.arange(10, dtype=DTYPE).reshape(10, 1)
    counts = np.zeros(10)
    gen = torch.Generator().manual_seed(0)
    runs = 2000
    for _ in range(runs):
        r = Reservoir(3, gen)
        r.add(x[:4], None)
        r.add(x[4:], None)
        kept = r.tensors()[0][:, 0].long().tolist()
        assert len(set(kept)) == 3
        counts[kept] += 1
    se = np.sqrt(0.3 * 0.7 / runs)
    assert np.abs(counts / runs - 0.3).max() <= 5 * se


def test_laftr_with_a_reused_relu_instance_is_correct_or_refused():
    torch.manual_seed(0)
    act = nn.ReLU()  # one instance at two positions: common in hand-written models
    model = nn.Sequential(nn.Linear(4, 6), act, nn.Linear(6, 5), act, nn.Linear(5, 3)).to(DTYPE)
    data = labelled_batches(20, (4,), seed=1)
    other = perturbed(model, 0.3, seed=2)
    try:
        got = float(fsd.LAFTR().fit(model, data).distance(other))
    except (fsd.UnsupportedModuleError, ValueError):
        return  # refusing the model is acceptable
    with torch.no_grad():
        pairs = [linearized_outputs(model, other, x) for x in stack(data)[0]]
    truth = float(np.mean([rho("euclidean", z0[None], z1[None])[0] for z0, z1 in pairs]))
    assert abs(got - truth) <= 1e-10 * truth


def test_laftr_coreset_subset_is_a_subset_of_the_data():
    model, data = mlp([5, 8, 3], seed=0), labelled_batches(40, (5,), seed=0)
    est = fsd.LAFTR(coreset_size=7, seed=3).fit(model, data)
    xs = stack(data)[0]
    core = est._state["coreset.x"]
    assert core.shape == (7, 5)
    # every kept input is one of the data's rows, no duplicates
    idx = [int(((xs - c).abs().sum(1) == 0).nonzero()[0]) for c in core]
    assert len(set(idx)) == 7
    other = perturbed(model, 0.3, seed=1)
    truth = np.mean([rho("euclidean", *[z[None] for z in linearized_outputs(model, other, c)])[0]
                     for c in core])
    assert abs(float(est.distance(other)) - truth) <= 1e-10 * truth


# ----------------------------------------------------------------------------------------
# 4. BGLN-D == dense transcription of Algorithm 2; stored statistics == brute force
# ----------------------------------------------------------------------------------------
def algorithm2(model0, model1, mean, cov, mus, select=None) -> float:
    """Paper Algorithm 2 (BGLN-D), dense float64 (fsd.testing), as a float."""
    with torch.no_grad():
        return float(dense_algorithm2(model0, model1, mean, cov, mus, outputs=select))


def manual_gates(model: nn.Sequential, xs: torch.Tensor) -> dict[str, np.ndarray]:
    """Fraction of examples with pre-activation > 0 at every ReLU, by a manual forward."""
    out, a = {}, xs
    with torch.no_grad():
        for name, layer in model.named_children():
            if isinstance(layer, nn.ReLU):
                out[name] = _np((a > 0).to(DTYPE).mean(0))
            a = layer(a)
    return out


def population_moments(xs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    x = _np(xs.reshape(xs.shape[0], -1))
    m = x.mean(0)
    return m, (x - m).T @ (x - m) / x.shape[0]


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_bgln_d_matches_algorithm2(covariance):
    model, data = mlp([5, 8, 6, 3], seed=7), labelled_batches(50, (5,), seed=8)
    other = perturbed(model, 0.2, seed=9)
    xs = stack(data)[0]
    est = fsd.BGLN(deterministic=True, covariance=covariance).fit(model, data)
    st = est._state
    # --- stored statistics against brute force
    m, c = population_moments(xs)
    np.testing.assert_allclose(_np(st["input.mean"]), m[None], rtol=0, atol=1e-12)
    if covariance == "full":
        np.testing.assert_allclose(_np(st["input.cov"]), c[None], rtol=0, atol=1e-12)
    else:
        np.testing.assert_allclose(_np(st["input.cov"]), np.diag(c)[None], rtol=0, atol=1e-12)
    gates = manual_gates(model, xs)
    assert sorted(k for k in st if k.startswith("gate.")) == [f"gate.{p}" for p in sorted(gates)]
    for path, mu in gates.items():
        # running mean over batches: exact fraction up to a few ulps
        np.testing.assert_allclose(_np(st[f"gate.{path}"]), mu[None], rtol=0, atol=1e-14)
    np.testing.assert_array_equal(_np(st["weights"]), [1.0])
    # --- distance against the transcription, fed with the brute-force statistics
    cov_in = c if covariance == "full" else np.diag(np.diag(c))
    mus = [gates[p] for p in relu_paths(model)]
    truth = algorithm2(model, other, m, cov_in, mus)
    got = float(est.distance(other))
    assert truth > 1e-4
    assert abs(got - truth) <= 1e-10 * truth


def test_bgln_d_image_inputs_through_flatten():
    """Moments of image inputs are taken over the C-order flattened pixels, as nn.Flatten."""
    torch.manual_seed(17)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 3)).to(DTYPE)
    data = labelled_batches(40, (1, 4, 4), seed=18)
    other = perturbed(model, 0.2, seed=19)
    xs = stack(data)[0]
    m, c = population_moments(xs)
    mus = [manual_gates(model, xs)[p] for p in relu_paths(model)]
    truth = algorithm2(model, other, m, c, mus)
    est = fsd.BGLN(deterministic=True).fit(model, data)
    assert abs(float(est.distance(other)) - truth) <= 1e-10 * truth


def test_bgln_d_outputs_restriction_matches_algorithm2():
    model, data = mlp([5, 8, 4], seed=1), labelled_batches(40, (5,), seed=2)
    other = perturbed(model, 0.2, seed=3)
    xs = stack(data)[0]
    m, c = population_moments(xs)
    mus = [manual_gates(model, xs)[p] for p in relu_paths(model)]
    for outputs, select in (([3, 1], [3, 1]), (slice(1, None, 2), [1, 3])):
        est = fsd.BGLN(deterministic=True).fit(model, data, outputs=outputs)
        truth = algorithm2(model, other, m, c, mus, select=select)
        assert abs(float(est.distance(other)) - truth) <= 1e-10 * truth


@pytest.mark.parametrize("rank", [2, 5])
def test_bgln_d_lowrank_matches_algorithm2(rank):
    """covariance="lowrank": Algorithm 2 with Cov(x) = F Fᵀ + diag(residual), F the top-rank
    eigenpairs of the data covariance and the residual restoring its diagonal; rank = d is
    the full covariance."""
    model, data = mlp([5, 8, 6, 3], seed=14), labelled_batches(50, (5,), seed=15)
    other = perturbed(model, 0.2, seed=16)
    xs = stack(data)[0]
    m, c = population_moments(xs)
    values, vectors = np.linalg.eigh(c)
    top = vectors[:, -rank:] * np.sqrt(values[-rank:])
    low = top @ top.T
    cov_in = low + np.diag(np.diag(c) - np.diag(low))
    mus = [manual_gates(model, xs)[p] for p in relu_paths(model)]
    truth = algorithm2(model, other, m, cov_in, mus)
    est = fsd.BGLN(deterministic=True, covariance="lowrank", rank=rank).fit(model, data)
    assert abs(float(est.distance(other)) - truth) <= 1e-10 * truth
    if rank == 5:
        full = algorithm2(model, other, m, c, mus)
        assert abs(truth - full) <= 1e-12 * full


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_bgln_d_classwise_is_frequency_weighted_mixture(covariance):
    model, data = mlp([4, 7, 5, 3], seed=11), labelled_batches(60, (4,), classes=3, seed=12)
    other = perturbed(model, 0.2, seed=13)
    xs, ys = stack(data)
    est = fsd.BGLN(deterministic=True, classwise=True, covariance=covariance).fit(model, data)
    st = est._state
    classes = sorted(set(ys.tolist()))
    assert est._meta["groups"] == [[c] for c in classes]
    truth = 0.0
    for g, cls in enumerate(classes):
        xc = xs[ys == cls]
        w = xc.shape[0] / xs.shape[0]
        m, c = population_moments(xc)
        gates = manual_gates(model, xc)
        assert abs(float(st["weights"][g]) - w) <= 1e-15
        np.testing.assert_allclose(_np(st["input.mean"][g]), m, rtol=0, atol=1e-12)
        want_cov = c if covariance == "full" else np.diag(c)
        np.testing.assert_allclose(_np(st["input.cov"][g]), want_cov, rtol=0, atol=1e-12)
        for path, mu in gates.items():
            np.testing.assert_allclose(_np(st[f"gate.{path}"][g]), mu, rtol=0, atol=1e-14)
        cov_in = c if covariance == "full" else np.diag(np.diag(c))
        truth += w * algorithm2(model, other, m, cov_in,
                                [gates[p] for p in relu_paths(model)])
    got = float(est.distance(other))
    assert abs(got - truth) <= 1e-10 * truth
    # class-conditioning changes the estimate (the test can tell pooled from classwise)
    pooled = float(fsd.BGLN(deterministic=True, covariance=covariance).fit(model, data)
                   .distance(other))
    assert abs(pooled - truth) > 1e-6 * truth


# ----------------------------------------------------------------------------------------
# 5. BGLN-S: Monte Carlo converges to the exact expectation over gates and inputs
# ----------------------------------------------------------------------------------------
def gated_affine_maps(theta0, theta1, masks):
    """For fixed gate masks, BGLN-S (Algorithm 1) is affine in x: returns (P, p, Q, q)
    with z0 = P x + p and Δz = Q x + q."""
    d = theta0[0][0].shape[1]
    P, p = np.eye(d), np.zeros(d)
    Q, q = np.zeros((d, d)), np.zeros(d)
    for layer, ((W0, b0), (W1, b1)) in enumerate(zip(theta0, theta1, strict=True)):
        dW, db = W1 - W0, b1 - b0
        S0, s0 = W0 @ P, W0 @ p + b0
        DS, ds = dW @ P + W1 @ Q, dW @ p + W1 @ q + db
        if layer < len(theta0) - 1:
            m = masks[layer]
            S0, s0, DS, ds = S0 * m[:, None], s0 * m, DS * m[:, None], ds * m
        P, p, Q, q = S0, s0, DS, ds
    return P, p, Q, q


def gate_patterns(mus):
    """All gate patterns of the hidden units with their probabilities."""
    sizes = [len(mu) for mu in mus]
    flat_mu = np.concatenate(mus)
    for bits in itertools.product([0.0, 1.0], repeat=len(flat_mu)):
        bits = np.array(bits)
        prob = float(np.prod(np.where(bits == 1, flat_mu, 1 - flat_mu)))
        masks, start = [], 0
        for s in sizes:
            masks.append(bits[start:start + s])
            start += s
        yield prob, masks


def exact_bgln_s_gaussian(mean, cov, theta0, theta1, mus) -> float:
    """E over gates (exact sum) and x ~ N(mean, cov) (closed form) of ½‖Δz‖²."""
    total = 0.0
    for prob, masks in gate_patterns(mus):
        _, _, Q, q = gated_affine_maps(theta0, theta1, masks)
        r = Q @ mean + q
        total += prob * (0.5 * r @ r + 0.5 * np.trace(Q @ cov @ Q.T))
    return total


def mc_check(est, other, truth, calls):
    """Mean of independent distance calls within 5 standard errors of the truth."""
    vals = np.array([float(est.distance(other)) for _ in range(calls)])
    se = vals.std(ddof=1) / np.sqrt(calls)
    assert se > 0  # the estimator is actually random
    assert se < 0.05 * truth  # enough samples for the check to have power
    assert abs(vals.mean() - truth) <= 5 * se, (vals.mean(), truth, se)
    return vals.mean(), se


def _tiny_setup(seed=0, classes=2, n=80):
    model = mlp([3, 4, 3, 2], seed=seed)
    data = labelled_batches(n, (3,), classes=classes, seed=seed + 1)
    other = perturbed(model, 0.3, seed=seed + 2)
    return model, data, other


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_bgln_s_gaussian_converges_to_exact_expectation(covariance):
    model, data, other = _tiny_setup(seed=20)
    est = fsd.BGLN(num_samples=1000, covariance=covariance, seed=1).fit(model, data)
    st = est._state
    mean = _np(st["input.mean"][0])
    cov = _np(st["input.cov"][0])
    cov = cov if covariance == "full" else np.diag(cov)
    mus = [_np(st[f"gate.{p}"][0]) for p in relu_paths(model)]
    assert all(((mu > 0) & (mu < 1)).any() for mu in mus)  # gates genuinely random
    truth = exact_bgln_s_gaussian(mean, cov, linears(model), linears(other), mus)
    mc_check(est, other, truth, calls=60)
    # BGLN-D drops terms of this expectation: it is a different number
    d = float(fsd.BGLN(deterministic=True, covariance=covariance).fit(model, data)
              .distance(other))
    assert abs(d - truth) > 1e-3 * truth


@pytest.mark.parametrize("covariance, classwise", [("full", False), ("diag", False),
                                                   ("full", True)])
def test_bgln_d_exact_moments_equal_gate_enumeration(covariance, classwise):
    """BGLN(deterministic=True, moments="exact") claims E[BGLN-S]: compare it with the
    exact sum over all 2^7 gate patterns × closed-form Gaussian expectation (float64)."""
    model, data, other = _tiny_setup(seed=25, classes=3, n=90)
    est = fsd.BGLN(deterministic=True, moments="exact", covariance=covariance,
                   classwise=classwise).fit(model, data)
    st = est._state
    truth = 0.0
    for g in range(st["weights"].shape[0]):
        cov = _np(st["input.cov"][g])
        cov = cov if covariance == "full" else np.diag(cov)
        mus = [_np(st[f"gate.{p}"][g]) for p in relu_paths(model)]
        truth += float(st["weights"][g]) * exact_bgln_s_gaussian(
            _np(st["input.mean"][g]), cov, linears(model), linears(other), mus)
    assert abs(float(est.distance(other)) - truth) <= 1e-10 * truth


def test_bgln_s_classwise_converges_to_mixture_expectation():
    model, data, other = _tiny_setup(seed=30, classes=3, n=90)
    est = fsd.BGLN(num_samples=900, classwise=True, covariance="full", seed=2).fit(model, data)
    st = est._state
    truth = 0.0
    for g in range(st["weights"].shape[0]):
        mus = [_np(st[f"gate.{p}"][g]) for p in relu_paths(model)]
        truth += float(st["weights"][g]) * exact_bgln_s_gaussian(
            _np(st["input.mean"][g]), _np(st["input.cov"][g]), linears(model), linears(other),
            mus)
    mc_check(est, other, truth, calls=60)


def test_bgln_s_coreset_classwise_uses_each_points_class_gates():
    model, data, other = _tiny_setup(seed=45, classes=2, n=10)
    xs, ys = stack(data)
    xs = _np(xs)
    est = fsd.BGLN(inputs="coreset", classwise=True, seed=5).fit(model, data)
    groups = est._meta["groups"]
    truth = np.zeros(len(xs))
    for g, members in enumerate(groups):
        rows = np.isin(ys.numpy(), members)
        mus = [_np(est._state[f"gate.{p}"][g]) for p in relu_paths(model)]
        for prob, masks in gate_patterns(mus):
            _, _, Q, q = gated_affine_maps(linears(model), linears(other), masks)
            dz = xs[rows] @ Q.T + q
            truth[rows] += prob * 0.5 * (dz ** 2).sum(-1)
    mc_check(est, other, float(truth.mean()), calls=300)


@pytest.mark.parametrize("metric", METRICS)
def test_bgln_s_coreset_converges_to_exact_gate_enumeration(metric):
    model, data, other = _tiny_setup(seed=40, n=12)
    xs = _np(stack(data)[0])
    est = fsd.BGLN(inputs="coreset", coreset_size=None, metric=metric, seed=3).fit(model, data)
    np.testing.assert_array_equal(_np(est._state["coreset.x"]), xs)
    mus = [_np(est._state[f"gate.{p}"][0]) for p in relu_paths(model)]
    truth = 0.0
    for prob, masks in gate_patterns(mus):
        P, p, Q, q = gated_affine_maps(linears(model), linears(other), masks)
        z0 = xs @ P.T + p
        dz = xs @ Q.T + q
        truth += prob * rho(metric, z0, z0 + dz).mean()
    mc_check(est, other, truth, calls=300)


# ----------------------------------------------------------------------------------------
# 6. LAFTR with Gaussian inputs on a linear network: closed form
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_laftr_gaussian_linear_network_closed_form(covariance):
    model, data = linear_net([4, 5, 3], seed=50), labelled_batches(60, (4,), seed=51)
    other = perturbed(model, 0.3, seed=52)
    est = fsd.LAFTR(inputs="gaussian", covariance=covariance, num_samples=500, seed=4) \
        .fit(model, data)
    m, c = population_moments(stack(data)[0])
    np.testing.assert_allclose(_np(est._state["input.mean"][0]), m, atol=1e-12)
    if covariance == "diag":
        c = np.diag(np.diag(c))

    def end_to_end(theta):
        M, v = np.eye(4), np.zeros(4)
        for W, b in theta:
            M, v = W @ M, W @ v + b
        return M, v

    (M0, v0), (M1, v1) = end_to_end(linears(model)), end_to_end(linears(other))
    A, a = M1 - M0, v1 - v0
    r = A @ m + a
    truth = 0.5 * r @ r + 0.5 * np.trace(A @ c @ A.T)
    mc_check(est, other, truth, calls=50)


# ----------------------------------------------------------------------------------------
# 7. ExactFSD, NTK and EWC against brute force
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_exact_fsd_matches_manual_loop_with_output_restrictions(metric):
    model, data = mlp([5, 6, 4], seed=60), labelled_batches(23, (5,), seed=61)
    other = perturbed(model, 0.4, seed=62)
    xs = stack(data)[0]
    with torch.no_grad():
        z0, z1 = _np(model(xs)), _np(other(xs))
    for outputs, cols in ((None, [0, 1, 2, 3]), ([2, 0], [2, 0]), ([3], [3]),
                          (slice(0, 2), [0, 1]), (slice(1, None, 2), [1, 3])):
        if metric != "euclidean" and len(cols) == 1:
            # a softmax over one output is constant: refused at fit (test_reliability_fit)
            with pytest.raises(ValueError, match="softmax over one output"):
                fsd.ExactFSD(metric=metric).fit(model, data, outputs=outputs)
            continue
        # batch_size=5 splits the stored data into uneven chunks
        est = fsd.ExactFSD(metric=metric, batch_size=5).fit(model, data, outputs=outputs)
        truth = float(np.mean([rho(metric, z0[i:i + 1, cols], z1[i:i + 1, cols])[0]
                               for i in range(len(xs))]))
        assert abs(float(est.distance(other)) - truth) <= 1e-12 * max(truth, 1e-300) + 1e-15


@pytest.mark.parametrize("metric", METRICS)
def test_ntk_equals_exact_for_model_linear_in_parameters(metric):
    torch.manual_seed(0)
    model = nn.Linear(5, 3).to(DTYPE)
    data = labelled_batches(20, (5,), seed=70)
    other = perturbed(model, 0.5, seed=71)
    ntk = fsd.NTK(metric=metric).fit(model, data)
    truth = _manual_fsd(model, other, stack(data)[0], metric)
    assert abs(float(ntk.distance(other)) - truth) <= 1e-10 * truth


@pytest.mark.parametrize("metric", METRICS)
def test_ntk_matches_jacobian_brute_force(metric):
    model, data = mlp([4, 6, 3], seed=80), labelled_batches(10, (4,), seed=81)
    other = perturbed(model, 0.3, seed=82)
    xs = stack(data)[0]
    names = [n for n, _ in model.named_parameters()]
    theta0 = [p.detach().clone() for p in model.parameters()]
    shapes = [p.shape for p in theta0]
    sizes = [p.numel() for p in theta0]

    def f(flat):
        parts = torch.split(flat, sizes)
        params = {n: t.reshape(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return torch.func.functional_call(model, params, (xs,))

    flat0 = torch.cat([t.reshape(-1) for t in theta0])
    J = torch.autograd.functional.jacobian(f, flat0)  # (n, k, P)
    with torch.no_grad():
        z0 = model(xs)
    flat1 = torch.cat([p.reshape(-1) for p in other.parameters()])  # differentiable
    z_lin = z0 + torch.einsum("nkp,p->nk", J, flat1 - flat0)
    if metric == "euclidean":
        brute = 0.5 * (z_lin - z0).pow(2).sum(-1).mean()
    elif metric == "softmax_euclidean":
        brute = 0.5 * (z_lin.softmax(-1) - z0.softmax(-1)).pow(2).sum(-1).mean()
    else:
        brute = (z0.softmax(-1) * (z0.log_softmax(-1) - z_lin.log_softmax(-1))).sum(-1).mean()
    est = fsd.NTK(metric=metric).fit(model, data)
    got = est.distance(other)
    assert abs(float(got) - float(brute)) <= 1e-10 * float(brute)
    # gradients agree too (NTK is used as a differentiable regularizer)
    g_got = torch.autograd.grad(got, list(other.parameters()))
    g_brute = torch.autograd.grad(brute, list(other.parameters()))
    for a, b in zip(g_got, g_brute, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def brute_fisher(model, xs, kind, metric, ys=None, outputs=None):
    """Diagonal Fisher by a plain per-example (and per-class) autograd loop."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]

    def out(x):
        z = model(x[None])[0]
        return z if outputs is None else z[outputs]

    for i, x in enumerate(xs):
        terms = []  # list of (weight, scalar whose gradient is squared)
        z = out(x)
        if kind == "true" and metric == "kl":
            logp = z.log_softmax(-1)
            terms = [(float(logp[y].exp()), lambda y=y, x=x: out(x).log_softmax(-1)[y])
                     for y in range(z.shape[0])]
        elif kind == "true" and metric == "euclidean":
            terms = [(1.0, lambda k=k, x=x: out(x)[k]) for k in range(z.shape[0])]
        elif kind == "true" and metric == "softmax_euclidean":
            terms = [(1.0, lambda k=k, x=x: out(x).softmax(-1)[k]) for k in range(z.shape[0])]
        elif kind == "empirical" and metric == "kl":
            terms = [(1.0, lambda x=x, i=i: F.cross_entropy(out(x)[None], ys[i][None]))]
        elif kind == "empirical" and metric == "euclidean":
            terms = [(1.0, lambda x=x, i=i: 0.5 * (out(x) - ys[i]).pow(2).sum())]
        for w, fn in terms:
            grads = torch.autograd.grad(fn(), params)
            for t, g in zip(total, grads, strict=True):
                t += w * g.pow(2)
    return {n: t / len(xs) for (n, _), t in zip(model.named_parameters(), total, strict=True)}


@pytest.mark.parametrize("kind, metric", [("true", "kl"), ("true", "euclidean"),
                                          ("true", "softmax_euclidean"), ("empirical", "kl"),
                                          ("empirical", "euclidean")])
def test_ewc_fisher_matches_per_example_brute_force(kind, metric):
    model = mlp([4, 5, 3], seed=90)
    data = labelled_batches(13, (4,), seed=91, batch=5)
    if kind == "empirical" and metric == "euclidean":  # regression targets
        gen = torch.Generator().manual_seed(3)
        data = [(x, torch.randn(x.shape[0], 3, generator=gen, dtype=DTYPE)) for x, _ in data]
    xs, ys = stack(data)
    est = fsd.EWC(fisher=kind, metric=metric, chunk_size=4).fit(model, data)
    fisher = brute_fisher(model, xs, kind, metric, ys)
    for name, f in fisher.items():
        torch.testing.assert_close(est._state[f"fisher.{name}"], f, rtol=1e-10, atol=1e-14)
    other = perturbed(model, 0.2, seed=92)
    truth = 0.5 * sum(float((f * (p1 - p0).pow(2)).sum()) for f, p0, p1 in
                      zip(fisher.values(), model.parameters(), other.parameters(), strict=True))
    assert abs(float(est.distance(other)) - truth) <= 1e-10 * truth


def test_ewc_layer_terms_are_each_modules_share_of_the_brute_force_quadratic():
    model = mlp([4, 5, 3], seed=90)
    data = labelled_batches(13, (4,), seed=91, batch=5)
    est = fsd.EWC(fisher="true", metric="kl", chunk_size=4).fit(model, data)
    fisher = brute_fisher(model, stack(data)[0], "true", "kl")
    other = perturbed(model, 0.2, seed=92)
    expected: dict[str, float] = {}
    for (name, p0), p1 in zip(model.named_parameters(), other.parameters(), strict=True):
        module = name.rpartition(".")[0]  # weight and bias of one Linear share a term
        expected[module] = expected.get(module, 0.0) + 0.5 * float(
            (fisher[name] * (p1 - p0).pow(2)).sum())
    terms = est.layer_terms(other)
    assert list(terms) == list(expected) == ["0", "2"]
    for module, value in terms.items():
        assert abs(float(value) - expected[module]) <= 1e-10 * expected[module]
    torch.testing.assert_close(est.distance(other), sum(terms.values()), rtol=1e-12, atol=0)
    terms["0"].backward()  # differentiable, and only the first layer's parameters feel it
    assert other[0].weight.grad is not None and other[2].weight.grad is None


def test_layer_terms_refuse_an_estimator_that_does_not_split_by_layer():
    model = mlp([4, 5, 3], seed=90)
    est = fsd.NTK(coreset_size=None).fit(model, labelled_batches(6, (4,), seed=91))
    with pytest.raises(NotImplementedError, match="NTK's distance is not a sum over layers; "
                                                  "these estimators split by layer: EWC, KFAC"):
        est.layer_terms(model)


def test_ewc_fisher_with_output_restriction():
    model = mlp([4, 5, 4], seed=93)
    data = labelled_batches(9, (4,), seed=94)
    est = fsd.EWC(fisher="true", metric="kl").fit(model, data, outputs=[1, 3])
    fisher = brute_fisher(model, stack(data)[0], "true", "kl", outputs=[1, 3])
    for name, f in fisher.items():
        torch.testing.assert_close(est._state[f"fisher.{name}"], f, rtol=1e-10, atol=1e-14)
    # rows of the last layer for unselected outputs carry no Fisher
    assert float(est._state["fisher.2.weight"][[0, 2]].abs().max()) == 0.0


@pytest.mark.parametrize("kind, metric", [("true", "kl"), ("true", "softmax_euclidean"),
                                          ("sampled", "kl"), ("empirical", "euclidean")])
def test_ewc_linear_fast_path_equals_per_example_gradients(kind, metric, monkeypatch):
    # an all-Linear model takes the (g²)ᵀ(a²) path; forcing the generic per-example vmap path
    # must give the same Fisher (sampled: the same seed draws the same labels on both paths)
    model = mlp([4, 6, 5, 3], seed=96)
    data = labelled_batches(11, (4,), seed=97, batch=4)
    if metric == "euclidean":
        gen = torch.Generator().manual_seed(4)
        data = [(x, torch.randn(x.shape[0], 3, generator=gen, dtype=DTYPE)) for x, _ in data]
    calls = []
    fast = fsd.estimators.ewc._linear_fisher_diagonal
    monkeypatch.setattr(fsd.estimators.ewc, "_linear_fisher_diagonal",
                        lambda *a: calls.append(1) or fast(*a))
    est = fsd.EWC(fisher=kind, metric=metric, chunk_size=3).fit(model, data)
    assert len(calls) == len(data)
    monkeypatch.setattr(fsd.estimators.ewc, "_linear_layers", lambda m: None)
    generic = fsd.EWC(fisher=kind, metric=metric, chunk_size=3).fit(model, data)
    assert len(calls) == len(data)
    for key, value in generic._state.items():
        if key.startswith("fisher."):
            torch.testing.assert_close(est._state[key], value, rtol=1e-12, atol=1e-15)


class _SharedLinear(nn.Module):
    """One Linear applied twice: per-example gradients are not one outer product."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3).to(DTYPE)
        self.head = nn.Linear(3, 2).to(DTYPE)

    def forward(self, x):
        return self.head(torch.relu(self.inner(torch.relu(self.inner(x)))))


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _SharedLinear(), id="linear-called-twice"),
    pytest.param(lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.ReLU(),
                                       nn.Linear(4, 2)).to(DTYPE), id="layernorm"),
])
def test_ewc_fisher_outside_the_linear_fast_path_matches_brute_force(make):
    torch.manual_seed(98)
    model = make()
    data = labelled_batches(7, (3,), classes=2, seed=99, batch=3)
    est = fsd.EWC(fisher="true", metric="kl").fit(model, data)
    fisher = brute_fisher(model, stack(data)[0], "true", "kl")
    for name, f in fisher.items():
        torch.testing.assert_close(est._state[f"fisher.{name}"], f, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("metric", ["kl", "euclidean"])
def test_ewc_sampled_fisher_is_unbiased(metric):
    """The sampled Fisher averages to the true Fisher: the trace over independent seeds
    is within 5 standard errors of the exact trace."""
    model = mlp([3, 4, 3], seed=95)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
    data = [x.repeat(25, 1)]  # 100 examples, 4 distinct
    true = fsd.EWC(fisher="true", metric=metric).fit(model, data)
    t_true = sum(float(v.sum()) for k, v in true._state.items() if k.startswith("fisher."))
    traces = []
    for seed in range(8):
        est = fsd.EWC(fisher="sampled", metric=metric, seed=seed, chunk_size=50).fit(model, data)
        traces.append(sum(float(v.sum()) for k, v in est._state.items()
                          if k.startswith("fisher.")))
    traces = np.array(traces)
    se = traces.std(ddof=1) / np.sqrt(len(traces))
    assert se > 0 and se < 0.1 * t_true
    assert abs(traces.mean() - t_true) <= 5 * se


# ----------------------------------------------------------------------------------------
# 8. gradcheck of the differentiable deterministic estimators
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    pytest.param(lambda: fsd.BGLN(deterministic=True), id="bgln-d"),
    pytest.param(lambda: fsd.BGLN(deterministic=True, covariance="diag", classwise=True),
                 id="bgln-d-diag-cw"),
    pytest.param(lambda: fsd.LAFTR(coreset_size=6), id="laftr-coreset"),
    pytest.param(lambda: fsd.LAFTR(coreset_size=6, metric="kl"), id="laftr-coreset-kl"),
    pytest.param(lambda: fsd.NTK(coreset_size=6, metric="softmax_euclidean"), id="ntk"),
])
def test_gradcheck(make):
    model = mlp([3, 4, 3, 2], seed=100)
    data = labelled_batches(20, (3,), seed=101)
    est = make().fit(model, data)
    _, f = distance_fn(est, model)
    inputs = [p.detach().clone().requires_grad_() for p in perturbed(model, 0.2, 102).parameters()]
    # sanity: the wrapper really evaluates at the given tensors
    assert abs(float(f(*inputs)) - float(est.distance(perturbed(model, 0.2, 102)))) <= 1e-14
    # fast_mode checks random projections of the Jacobian (cheap, still fails on wrong grads)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


# ----------------------------------------------------------------------------------------
# 9. multi-head: summaries of different heads are independent
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    pytest.param(lambda: fsd.ExactFSD(), id="exact"),
    pytest.param(lambda: fsd.LAFTR(), id="laftr"),
    pytest.param(lambda: fsd.LAFTR(inputs="gaussian", num_samples=16), id="laftr-gauss"),
    pytest.param(lambda: fsd.BGLN(deterministic=True), id="bgln-d"),
    pytest.param(lambda: fsd.BGLN(num_samples=16, metric="kl"), id="bgln-s-kl"),
    pytest.param(lambda: fsd.NTK(metric="kl"), id="ntk"),
    pytest.param(lambda: fsd.EWC(), id="ewc"),
])
def test_multi_head_independence(make):
    model, data = mlp([5, 6, 4], seed=110), labelled_batches(20, (5,), classes=2, seed=111)
    head1 = make().fit(model, data, outputs=[0, 1])
    head2 = make().fit(model, data, outputs=[2, 3])
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # row-specific changes (a common shift is invisible to softmax)
        other[2].weight[2:] += torch.randn(2, 6, generator=gen, dtype=DTYPE)
        other[2].bias[2:] += torch.randn(2, generator=gen, dtype=DTYPE)
    assert float(head1.distance(other)) == 0.0  # exactly: no path from the change to head 1
    assert float(head2.distance(other)) > 1e-3
    # and conversely
    other2 = copy.deepcopy(model)
    with torch.no_grad():
        other2[2].weight[:2] += torch.randn(2, 6, generator=gen, dtype=DTYPE)
    assert float(head2.distance(other2)) == 0.0
    assert float(head1.distance(other2)) > 1e-3


# ----------------------------------------------------------------------------------------
# 10. dtypes
# ----------------------------------------------------------------------------------------
_DTYPE_CASES = [
    pytest.param(lambda: fsd.ExactFSD(metric="kl"), id="exact"),
    pytest.param(lambda: fsd.LAFTR(), id="laftr"),
    pytest.param(lambda: fsd.LAFTR(inputs="gaussian", num_samples=16), id="laftr-gauss"),
    pytest.param(lambda: fsd.BGLN(deterministic=True), id="bgln-d"),
    pytest.param(lambda: fsd.BGLN(num_samples=16), id="bgln-s"),
    pytest.param(lambda: fsd.BGLN(inputs="coreset"), id="bgln-s-coreset"),
    pytest.param(lambda: fsd.NTK(), id="ntk"),
    pytest.param(lambda: fsd.EWC(), id="ewc"),
]


@pytest.mark.parametrize("make", _DTYPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_follows_model(make, dtype):
    model = mlp([5, 6, 3], seed=120, dtype=dtype)
    data = labelled_batches(20, (5,), seed=121, dtype=dtype)
    other = perturbed(model, 0.2, seed=122)
    est = make().fit(model, data)
    d = est.distance(other)
    assert d.dtype == dtype and torch.isfinite(d) and float(d) > 0
    d.backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in other.parameters())


@pytest.mark.parametrize("make", [
    pytest.param(lambda: fsd.LAFTR(), id="laftr"),
    pytest.param(lambda: fsd.BGLN(deterministic=True), id="bgln-d"),
    pytest.param(lambda: fsd.ExactFSD(), id="exact"),
])
def test_float32_close_to_float64(make):
    model64, data64 = mlp([5, 6, 3], seed=123), labelled_batches(20, (5,), seed=124)
    other64 = perturbed(model64, 0.2, seed=125)
    model32, other32 = copy.deepcopy(model64).float(), copy.deepcopy(other64).float()
    data32 = [(x.float(), y) for x, y in data64]
    d64 = float(make().fit(model64, data64).distance(other64))
    d32 = float(make().fit(model32, data32).distance(other32))
    assert abs(d32 - d64) <= 1e-4 * d64  # float32 round-off on tiny nets
    # a float64 summary used with a float32 model computes in float32 and agrees
    est = make().fit(model64, data64)
    d = est.distance(other32)
    assert d.dtype == torch.float32 and abs(float(d) - d64) <= 1e-4 * d64


@pytest.mark.parametrize("make", [
    pytest.param(lambda: fsd.LAFTR(), id="laftr"),
    pytest.param(lambda: fsd.BGLN(deterministic=True), id="bgln-d"),
    pytest.param(lambda: fsd.ExactFSD(), id="exact"),
    pytest.param(lambda: fsd.EWC(), id="ewc"),
])
def test_float32_use_does_not_degrade_a_float64_summary(make):
    model = perturbed(mlp([5, 6, 3], seed=126), 0.01, seed=127)  # float64-only digits
    data = labelled_batches(20, (5,), seed=128)
    other = perturbed(model, 1e-4, seed=129)
    est = make().fit(model, data)
    before_zero, before = est.distance(model), float(est.distance(other))
    est.distance(copy.deepcopy(other).float())
    assert float(est.distance(model)) == float(before_zero) == 0.0
    assert abs(float(est.distance(other)) - before) <= 1e-12 * before
