"""Influence functions: PBRF and CG against closed forms, estimator terms, CLI end to end."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

import fsd
import fsd_experiments.data
from datafiles import REAL_DATA_DIR
from fsd.testing import one_point_at_a_time
from fsd.uses import influence
from fsd_experiments import compat, stats
from fsd_experiments import influence as studies
from fsd_experiments.cli import main
from fsd_experiments.stats import kmeans_labels

DATA_DIR = REAL_DATA_DIR
DTYPE = torch.float64


@pytest.fixture(autouse=True)
def one_thread():
    # many tiny ops: extra threads only add contention on the shared 2-core machines
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def regression_problem(n: int = 20, d: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=DTYPE)
    y = x @ torch.randn(d, 1, generator=g, dtype=DTYPE) + 0.3 * torch.randn(n, 1, generator=g,
                                                                            dtype=DTYPE)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, 1)).to(DTYPE)
    return model, x, y


def closed_form_pbrf(model: nn.Module, x: torch.Tensor, y: torch.Tensor, i: int,
                     damping: float) -> tuple[torch.Tensor, float]:
    """Minimizer Δθ of the linear-regression PBRF and the resulting self-influence.

    With x̃ = [x, 1], r0 = x̃ᵀθ0 − y and G = X̃ᵀX̃/N, the objective
    −(1/2N)(r0 + x̃ᵀΔ)² + ½ΔᵀGΔ + (λ/2)‖Δ‖² is stationary where
    (G + λI − x̃x̃ᵀ/N) Δ = (r0/N) x̃ (positive definite: G − x̃x̃ᵀ/N is the Gram of the others).
    """
    n = x.shape[0]
    xt = torch.cat([x, torch.ones(n, 1, dtype=DTYPE)], 1)
    theta0 = torch.cat([model[0].weight.detach().reshape(-1), model[0].bias.detach()])
    r0 = float(xt[i] @ theta0 - y[i, 0])
    gram = xt.T @ xt / n
    a = gram + damping * torch.eye(xt.shape[1], dtype=DTYPE) - torch.outer(xt[i], xt[i]) / n
    delta = torch.linalg.solve(a, r0 / n * xt[i])
    score = 0.5 * (r0 + float(xt[i] @ delta)) ** 2 - 0.5 * r0 ** 2
    return delta, score


def test_pbrf_reaches_linear_regression_closed_form():
    model, x, y = regression_problem()
    damping, i = 0.1, 4
    delta, score = closed_form_pbrf(model, x, y, i, damping)
    term = influence.ExactTerm(model, x, "euclidean", batch_size=None)
    solver = influence.PBRF(model, term, x.shape[0], loss="squared", damping=damping,
                            steps=300, lr=0.5)
    value = float(solver.self_influence(x[i:i + 1], y[i:i + 1])[0])
    solved = solver.solve(x[i:i + 1], y[i:i + 1])
    got = torch.cat([solved["0.weight"][0].reshape(-1), solved["0.bias"][0]])
    theta0 = torch.cat([model[0].weight.detach().reshape(-1), model[0].bias.detach()])
    torch.testing.assert_close(got - theta0, delta, rtol=1e-6, atol=1e-9)
    assert value == pytest.approx(score, rel=1e-6)
    # θ0 itself was not modified
    torch.testing.assert_close(model[0].weight.detach(), theta0[:-1].reshape(1, -1))


def test_point_term_pbrf_reaches_its_closed_form():
    # D + (1/2N)(x̃ᵀΔ)²: the removed point's curvature cancels, (G + λI) Δ = (r0/N) x̃
    model, x, y = regression_problem()
    damping, i, n = 0.1, 4, x.shape[0]
    xt = torch.cat([x, torch.ones(n, 1, dtype=DTYPE)], 1)
    theta0 = torch.cat([model[0].weight.detach().reshape(-1), model[0].bias.detach()])
    r0 = float(xt[i] @ theta0 - y[i, 0])
    delta = torch.linalg.solve(xt.T @ xt / n + damping * torch.eye(xt.shape[1], dtype=DTYPE),
                               r0 / n * xt[i])
    term = influence.ExactTerm(model, x, "euclidean", batch_size=None)
    solver = influence.PBRF(model, term, n, loss="squared", damping=damping, steps=300, lr=0.5,
                            point_term=True)
    value = float(solver.self_influence(x[i:i + 1], y[i:i + 1])[0])
    solved = solver.solve(x[i:i + 1], y[i:i + 1])
    got = torch.cat([solved["0.weight"][0].reshape(-1), solved["0.bias"][0]])
    torch.testing.assert_close(got - theta0, delta, rtol=1e-6, atol=1e-9)
    assert value == pytest.approx(0.5 * (r0 + float(xt[i] @ delta)) ** 2 - 0.5 * r0 ** 2,
                                  rel=1e-6)
    # it differs from the plain PBRF's answer
    assert not torch.allclose(delta, closed_form_pbrf(model, x, y, i, damping)[0])


def test_pbrf_stochastic_exact_term_is_close_to_closed_form():
    # minibatch D (the oracle as run in the experiment) lands near the full-batch answer
    model, x, y = regression_problem(n=64)
    expected = [closed_form_pbrf(model, x, y, i, 0.1)[1] for i in range(4)]
    scores = influence.pbrf_scores(model, x, y, range(4), "exact", loss="squared",
                                   damping=0.1, steps=300, lr=0.2, batch_size=16,
                                   progress=False)
    assert np.corrcoef(scores, expected)[0, 1] > 0.99
    np.testing.assert_allclose(scores, expected, rtol=0.1, atol=1e-4)


@pytest.mark.parametrize("method,point_term", [("exact", False), ("ewc", True),
                                               ("bgln-d", False), ("bgln-d", True)])
def test_batched_solves_equal_solving_one_point_at_a_time(method, point_term):
    # vmap over stacked copies of θ is the same arithmetic as one SGD run per point, including
    # the exact term's minibatch stream (restarted for every point) and clustered BGLN-D
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=DTYPE)
    y = torch.randn(40, 1, dtype=DTYPE)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 1)).to(DTYPE)
    groups = kmeans_labels(x, 3) if method == "bgln-d" else None
    term = influence.make_term(method, model, x, y, "squared", batch_size=16, bgln_groups=groups)
    settings = dict(damping=0.01, steps=12, lr=0.3, point_term=point_term)
    expected = one_point_at_a_time(model, term, 40, x[:5], y[:5], **settings)
    solver = influence.PBRF(model, term, 40, loss="squared", **settings)
    got = solver.self_influence(x[:5], y[:5]).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-14)
    assert np.all(np.abs(expected) > 1e-6)  # the solves moved


def test_scores_do_not_depend_on_points_per_solve():
    model, x, y = regression_problem(n=30)
    common = dict(loss="squared", damping=0.1, steps=10, lr=0.2, batch_size=8, progress=False)
    one = influence.pbrf_scores(model, x, y, range(7), "exact", points_per_solve=1, **common)
    three = influence.pbrf_scores(model, x, y, range(7), "exact", points_per_solve=3, **common)
    np.testing.assert_allclose(three, one, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="points_per_solve"):
        influence.pbrf_scores(model, x, y, range(2), "exact", points_per_solve=0, **common)


def test_bgln_d_equals_exact_fsd_for_a_linear_model():
    # f(x, θ) = Wx + b: FSD = ½‖ΔW μ + Δb‖² + ½ tr(ΔW Σ ΔWᵀ) with the data's (population)
    # moments, which is what BGLN-D computes; no ReLU, so the Bernoulli gates play no role
    torch.manual_seed(0)
    x = torch.randn(50, 4, dtype=DTYPE) * torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=DTYPE) + 0.3
    y = torch.randn(50, 2, dtype=DTYPE)
    model = nn.Sequential(nn.Linear(4, 2)).to(DTYPE)
    exact = influence.make_term("exact", model, x, y, "squared", batch_size=None)
    bgln = influence.make_term("bgln-d", model, x, y, "squared")
    moved = nn.Sequential(nn.Linear(4, 2)).to(DTYPE)
    with torch.no_grad():
        for p, q in zip(moved.parameters(), model.parameters(), strict=True):
            p.copy_(q + 0.2 * torch.randn_like(q))
    torch.testing.assert_close(bgln(moved), exact(moved), rtol=1e-10, atol=1e-12)
    # hence the PBRF self-influence is the same under both terms
    a = influence.PBRF(model, exact, 50, damping=0.01, steps=20, lr=0.1).self_influence(
        x[:3], y[:3])
    b = influence.PBRF(model, bgln, 50, damping=0.01, steps=20, lr=0.1).self_influence(
        x[:3], y[:3])
    torch.testing.assert_close(a, b, rtol=1e-9, atol=0)


def test_bgln_d_clusters_reach_the_estimator_as_a_mixture():
    torch.manual_seed(0)
    x = torch.randn(30, 4, dtype=DTYPE)
    y = torch.randn(30, 1, dtype=DTYPE)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(DTYPE)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.1 * torch.randn_like(p))
    # one group per point: every component is a point mass with its own 0/1 gates, where
    # BGLN-D is exactly LAFTR over the data (true gates, no input variance)
    clustered = influence.make_term("bgln-d", model, x, y, "squared", bgln_groups=torch.arange(30))
    laftr = fsd.LAFTR(inputs="coreset", coreset_size=None).fit(model, x)
    torch.testing.assert_close(clustered(moved), laftr.distance(moved), rtol=1e-10, atol=1e-14)
    assert clustered.estimator._state["weights"].shape[0] == 30
    # a linear model: any mixture with the data's per-cluster moments gives the exact FSD
    linear = nn.Sequential(nn.Linear(4, 2)).to(DTYPE)
    moved_linear = copy.deepcopy(linear)
    with torch.no_grad():
        for p in moved_linear.parameters():
            p.add_(0.2 * torch.randn_like(p))
    exact = influence.make_term("exact", linear, x, y, "squared", batch_size=None)
    three = influence.make_term("bgln-d", linear, x, y, "squared", bgln_groups=kmeans_labels(x, 3))
    with pytest.raises(ValueError, match="bgln_groups has 3 labels for 30"):
        influence.make_term("bgln-d", linear, x, y, "squared", bgln_groups=torch.arange(3))
    torch.testing.assert_close(three(moved_linear), exact(moved_linear), rtol=1e-10, atol=1e-12)


def test_kmeans_labels_recovers_separated_clusters():
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    truth = torch.arange(90) % 3
    x = centers[truth] + 0.5 * torch.randn(90, 2, generator=g)
    labels = kmeans_labels(x, 3, seed=1)
    # the same partition up to renaming: each true cluster maps to one label, all distinct
    mapping = {int(t): set(labels[truth == t].tolist()) for t in range(3)}
    assert all(len(v) == 1 for v in mapping.values())
    assert len(set.union(*mapping.values())) == 3
    assert torch.equal(kmeans_labels(x, 3, seed=1), labels)  # deterministic
    assert kmeans_labels(x, 1).unique().tolist() == [0]
    with pytest.raises(ValueError, match=r"k must lie in 1\.\.90"):
        kmeans_labels(x, 0)
    with pytest.raises(ValueError, match="k must lie"):
        kmeans_labels(x, 91)


def test_bgln_d_moments_option_reaches_the_estimator():
    # on a ReLU net the two propagations differ; "exact" equals a direct BGLN(moments="exact")
    torch.manual_seed(1)
    x, y = torch.randn(80, 3, dtype=DTYPE), torch.randn(80, 1, dtype=DTYPE)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)).to(DTYPE)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.3 * torch.randn_like(p))
    paper = influence.make_term("bgln-d", model, x, y, "squared")(moved)
    exact = influence.make_term("bgln-d", model, x, y, "squared", bgln_moments="exact")(moved)
    direct = fsd.BGLN(deterministic=True, moments="exact").fit(
        model, fsd_experiments.data.TensorBatches(x, y, 1024)).distance(moved)
    torch.testing.assert_close(exact, direct, rtol=1e-10, atol=1e-12)
    assert abs(float(exact - paper)) > 1e-3 * float(exact)


def jacobian_ggn(model: nn.Module, x: torch.Tensor, loss: str) -> torch.Tensor:
    """(1/N) Σ JᵀHJ from explicit per-example Jacobians (reference for GaussNewton)."""
    params = dict(model.named_parameters())
    names = list(params)
    total = 0.0
    for xi in x:
        def f(*values, xi=xi):
            state = dict(zip(names, values, strict=True))
            return torch.func.functional_call(model, state, (xi[None],))[0]
        jac = torch.autograd.functional.jacobian(f, tuple(params.values()))
        j = torch.cat([t.reshape(t.shape[0], -1) for t in jac], 1)
        z = f(*params.values()).detach()
        h = torch.eye(len(z), dtype=DTYPE) if loss == "squared" else \
            torch.diag(z.softmax(-1)) - torch.outer(z.softmax(-1), z.softmax(-1))
        total = total + j.T @ h @ j
    return total / x.shape[0]


@pytest.mark.parametrize("loss", ["squared", "cross_entropy"])
def test_gauss_newton_products_and_cg_match_dense_solve(loss):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3)).to(DTYPE)
    x = torch.randn(30, 3, dtype=DTYPE)
    y = torch.randn(30, 3, dtype=DTYPE) if loss == "squared" else torch.randint(0, 3, (30,))
    gn = influence.GaussNewton(model, x, loss, chunk_size=7)
    dense = gn.dense()
    torch.testing.assert_close(dense, jacobian_ggn(model, x, loss), rtol=1e-9, atol=1e-12)
    damping = 1e-2
    scores, info = influence.cg_scores(model, x, y, [0, 3, 7], loss=loss, damping=damping,
                                       max_iter=500, tol=1e-12, block=2, progress=False)
    g = influence.per_example_gradients(model, x[[0, 3, 7]], y[[0, 3, 7]], loss)
    solved = torch.linalg.solve(dense + damping * torch.eye(gn.size, dtype=DTYPE), g.T).T
    expected = (g * solved).sum(1) / x.shape[0]
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-7)
    assert info["max_relative_residual"] < 1e-10


def test_cg_gives_the_exact_linear_regression_pbrf_via_sherman_morrison():
    # linear model: CG's I = r0² h with leverage h = x̃ᵀ(G + λ)⁻¹x̃ / N; removing the point's
    # curvature by Sherman-Morrison gives the PBRF's exact answer x̃ᵀΔ = r0 h / (1 − h), so
    # score = r0² (h/(1−h) + ½ (h/(1−h))²) — compared with the direct closed form
    model, x, y = regression_problem(n=40)
    damping = 0.1
    cg, _ = influence.cg_scores(model, x, y, [0, 1, 2], damping=damping, tol=1e-12,
                                progress=False)
    with torch.no_grad():
        r0 = (model(x[:3]) - y[:3]).reshape(-1).numpy()
    t = (cg / r0 ** 2) / (1 - cg / r0 ** 2)
    closed = [closed_form_pbrf(model, x, y, i, damping)[1] for i in range(3)]
    np.testing.assert_allclose(r0 ** 2 * (t + 0.5 * t ** 2), closed, rtol=1e-8)


def test_ewc_term_is_the_gauss_newton_diagonal():
    model, x, y = regression_problem()
    term = influence.make_term("ewc", model, x, y, "squared")
    diag = influence.GaussNewton(model, x).dense().diagonal()
    moved = nn.Sequential(nn.Linear(3, 1)).to(DTYPE)
    delta = torch.cat([(p - q).detach().reshape(-1) for p, q in
                       zip(moved.parameters(), model.parameters(), strict=True)])
    assert float(term(moved)) == pytest.approx(float(0.5 * (diag * delta ** 2).sum()), rel=1e-9)


def test_detection_curve_and_auc():
    corrupted = np.array([1, 0, 1, 0, 0], dtype=float)
    checked, found = stats.detection_curve(np.array([5, 1, 4, 2, 3.0]), corrupted)
    assert found.tolist() == [0, 0.5, 1, 1, 1, 1]
    assert stats.area_under(checked, found) == pytest.approx(0.8)
    y, mask = studies.corrupt_labels(torch.arange(10) % 10, 0.3, 10,
                                       torch.Generator().manual_seed(0))
    assert int(mask.sum()) == 3 and bool((y[mask] != (torch.arange(10) % 10)[mask]).all())


def test_detection_auc_closed_form_matches_the_curve():
    rng = np.random.default_rng(3)
    corrupted = (rng.random(50) < 0.2).astype(float)
    scores = rng.normal(size=50) + corrupted
    rows = rng.integers(0, 50, size=(20, 50))  # resampled pools repeat points
    fast = stats.detection_aucs(scores[rows], corrupted[rows])
    slow = [stats.area_under(*stats.detection_curve(scores[r], corrupted[r]))
            for r in rows]
    assert fast == pytest.approx(slow, rel=1e-12)


def test_detection_intervals_pairing_and_separation():
    rng = np.random.default_rng(4)
    corrupted = (rng.random(400) < 0.1).astype(float)
    informative = corrupted + rng.normal(size=400)
    boot = stats.detection_intervals(
        {"ewc": informative, "bgln-d": informative.copy(), "random": rng.random(400),
         "broken": np.where(np.arange(400) == 7, np.nan, informative)},
        corrupted, resamples=500)
    assert boot["difference"]["bgln-d"]["auc"] == pytest.approx([0, 0], abs=1e-12)
    assert boot["difference"]["random"]["auc"][1] < 0  # clearly worse than EWC
    assert "broken" not in boot["auc"]
    lo, hi = boot["auc"]["ewc"]
    point = stats.area_under(*stats.detection_curve(informative, corrupted))
    assert lo < point < hi
    with pytest.raises(ValueError, match="both corrupted and clean"):
        stats.detection_intervals({"ewc": informative}, np.zeros(400))


def test_detection_intervals_cover_a_random_rankers_auc():
    # random scores rank each corrupted point uniformly: the expected AUC is exactly 1/2
    rng = np.random.default_rng(5)
    repeats, covered = 60, 0
    for r in range(repeats):
        corrupted = (rng.random(200) < 0.15).astype(float)
        lo, hi = stats.detection_intervals({"random": rng.random(200)}, corrupted,
                                               resamples=400, level=0.9, seed=r)["auc"]["random"]
        covered += lo <= 0.5 <= hi
    assert 0.8 <= covered / repeats <= 0.98


def test_pool_mask_is_rebuilt_from_a_saved_curve():
    rng = np.random.default_rng(6)
    corrupted = (rng.random(30) < 0.3).astype(float)
    scores = rng.normal(size=30)
    _, found = stats.detection_curve(scores, corrupted)
    old_format = {"pool": {"size": 30}, "scores": {"cg": scores.tolist()},
                  "curves": {"cg": found.tolist()}}
    assert studies.pool_corrupted(old_format).tolist() == corrupted.tolist()


def test_older_results_read_with_the_settings_of_their_time():
    # a UCI result from before the moments / clusters / Fisher / point-term settings
    old = {"dataset": "energy", "pbrf": {"lr": 0.1, "steps": 5}}
    assert compat.uci_result(old)["pbrf"] == {
        "bgln_moments": "paper", "bgln_clusters": None, "ewc_fisher": "true",
        "point_term": False, "lr": 0.1, "steps": 5}
    assert compat.uci_result({"pbrf": {"bgln_moments": "exact"}})["pbrf"]["bgln_moments"] == \
        "exact"
    # a mislabeled result from before the device and the non-finite counts were recorded
    assert compat.mislabeled_result({"seed": 0}) == {"seed": 0, "device": "cpu",
                                                     "nonfinite": {}}
    assert compat.mislabeled_result({"device": "NVIDIA H100"})["device"] == "NVIDIA H100"


def test_uci_names_are_those_the_loader_accepts():
    from fsd_experiments.data.uci import canonical_uci_name
    from fsd_experiments.influence.uci import _canonical_uci
    for name in ("Boston", "housing", "wine_red", "KIN8NM", "boston-housing"):
        assert _canonical_uci(name) == canonical_uci_name(name) is not None
    with pytest.raises(ValueError, match="unknown UCI data set 'iris'"):
        _canonical_uci("iris")


def test_bootstrap_intervals_degenerate_cases_and_pearson():
    rng = np.random.default_rng(1)
    reference = rng.normal(size=40)
    noisy = reference + rng.normal(size=40)
    boot = stats.bootstrap_intervals(
        {"bgln-d": 3 * reference + 1, "ewc": 3 * reference + 1, "cg": noisy,
         "broken": np.where(np.arange(40) == 3, np.nan, noisy)}, reference, resamples=300)
    # an exact linear function of the reference: every resample correlates perfectly
    assert boot["pearson"]["bgln-d"] == pytest.approx([1, 1], abs=1e-12)
    assert boot["spearman"]["bgln-d"] == pytest.approx([1, 1], abs=1e-12)
    # identical methods on paired resamples: the difference is exactly 0
    assert boot["difference"]["bgln-d"]["pearson"] == pytest.approx([0, 0], abs=1e-12)
    assert "broken" not in boot["pearson"]  # non-finite scores: left out
    lo, hi = boot["pearson"]["cg"]
    point = stats.correlations(noisy, reference)["pearson"]
    assert lo < point < hi and hi - lo > 0.05
    # the vectorized Pearson is scipy's
    from scipy import stats as scipy_stats
    rows = rng.integers(0, 40, size=(5, 40))
    assert stats.rowwise_pearson(noisy[rows], reference[rows]) == pytest.approx(
        [scipy_stats.pearsonr(noisy[r], reference[r])[0] for r in rows], rel=1e-12)
    with pytest.raises(ValueError, match="level"):
        stats.bootstrap_intervals({"cg": noisy}, reference, level=1.5)
    with pytest.raises(ValueError, match="scores for 40"):
        stats.bootstrap_intervals({"cg": noisy[:10]}, reference)


def test_bootstrap_intervals_cover_the_true_correlation():
    # bivariate normal samples with known ρ: the 90% intervals must cover ρ in most repeats
    rho, n, repeats = 0.6, 100, 60
    rng = np.random.default_rng(0)
    covered = 0
    for r in range(repeats):
        z = rng.normal(size=(n, 2))
        x, y = z[:, 0], rho * z[:, 0] + np.sqrt(1 - rho ** 2) * z[:, 1]
        lo, hi = stats.bootstrap_intervals({"m": y}, x, resamples=400, level=0.9,
                                               seed=r)["pearson"]["m"]
        covered += lo <= rho <= hi
    assert 0.8 <= covered / repeats <= 0.98


def test_unknown_names_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown method"):
        studies.run_uci("concrete", ["exact", "magic"], data_dir=tmp_path)
    assert main(["influence", "uci", "--dataset", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown UCI data set 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["influence", "uci", "--dataset", "concrete", "--methods", "magic",
              "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:  # refused while parsing, before any data
        main(["influence", "uci", "--dataset", "concrete", "--bgln-clusters", "0",
              "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert "argument --bgln-clusters: must be a positive integer" in capsys.readouterr().err


@pytest.mark.usefixtures("real_data")
def test_cli_uci_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["influence", "uci", "--dataset", "concrete", "--subset", "150",
                 "--removals", "5", "--epochs", "2", "--pbrf-epochs", "1", "--lrs", "0.1",
                 "0.01", "--cg-iters", "30", "--out", str(out), "--data-dir", str(DATA_DIR),
                 "--no-progress"]) == 0
    result = json.loads((out / "concrete" / "results.json").read_text())
    assert set(result["scores"]) == {"exact", "ewc", "cg", "bgln-d"}
    assert all(len(s) == 5 for s in result["scores"].values())
    assert set(result["correlation"]) == {"ewc", "cg", "bgln-d"}
    assert (out / "concrete" / "scatter.png").stat().st_size > 0
    summary = (out / "results.md").read_text()
    assert "BGLN-D P" in summary and "BGLN-D − EWC, P" in summary
    assert set(result["bootstrap"]["pearson"]) <= {"ewc", "cg", "bgln-d"}
    for saved in (result, json.loads((out / "results.json").read_text())):
        assert saved["torch_version"] == torch.__version__ and saved["fsd_version"]
        assert saved["device"] == "cpu" and saved["torch_threads"] >= 1


@pytest.mark.usefixtures("real_data")
def test_cli_mislabeled_end_to_end(tmp_path):
    assert main(["influence", "mislabeled", "--methods", "bgln-d", "ewc", "cg", "exact",
                 "random", "--n-train", "200", "--pool", "30", "--width", "16", "--epochs", "1",
                 "--pbrf-steps", "2", "--cg-iters", "3", "--cg-data", "50", "--bgln-rank", "4",
                 "--out", str(tmp_path), "--data-dir", str(DATA_DIR), "--no-progress"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["auc"]) == {"bgln-d", "ewc", "cg", "exact", "random"}
    assert result["pool"]["size"] == 30 and result["width"] == 16
    assert all(0 <= a <= 1 for a in result["auc"].values())
    assert (tmp_path / "detection.png").stat().st_size > 0
    assert "MLP 2x16" in (tmp_path / "results.md").read_text()
    assert set(result["bootstrap"]["auc"]) == set(result["auc"])
    assert "AUC − EWC" in (tmp_path / "results.md").read_text()
    assert result["torch_version"] == torch.__version__ and result["device"] == "cpu"


@pytest.mark.usefixtures("real_data")
def test_oracle_repeat_measures_the_oracles_own_noise(tmp_path, capsys):
    tiny = dict(removals=6, epochs=2, pbrf_epochs=2, learning_rates=[0.1], data_dir=DATA_DIR,
                progress=False)
    # fewer training points than one batch: the oracle's "minibatches" are the whole set, so
    # a second stream must give the very same scores
    small = studies.run_uci("concrete", ["exact"], subset=100, oracle_repeat=True,
                              out=tmp_path / "small", **tiny)
    assert "exact repeat P" in (tmp_path / "small" / "results.md").read_text()
    assert small["n_train"] < 128
    np.testing.assert_allclose(small["oracle_repeat"]["scores"], small["scores"]["exact"],
                               rtol=1e-12)
    # with real minibatches the second stream differs, and its correlation is the one reported
    big = studies.run_uci("concrete", ["exact", "ewc"], subset=400, oracle_repeat=True,
                            out=tmp_path / "big", **tiny)
    again, first = (np.asarray(big["oracle_repeat"]["scores"]),
                    np.asarray(big["scores"]["exact"]))
    assert not np.allclose(again, first)
    assert big["oracle_repeat"]["correlation"]["pearson"] == pytest.approx(
        float(np.corrcoef(again, first)[0, 1]))
    assert "exact repeat P" in (tmp_path / "big" / "results.md").read_text()
    with pytest.raises(ValueError, match="oracle_repeat needs 'exact'"):
        studies.run_uci("concrete", ["ewc"], subset=100, oracle_repeat=True, **tiny)


def test_ewc_fisher_choice_reaches_the_pbrf_term():
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
                                torch.nn.Linear(4, 1)).double()
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.1)
    terms = {f: influence.make_term("ewc", model, x, y, "squared", ewc_fisher=f)
             for f in ("true", "sampled", "empirical")}
    assert {f: t.estimator.config["fisher"] for f, t in terms.items()} == \
        {f: f for f in terms}
    values = {f: float(t(moved).detach()) for f, t in terms.items()}
    assert len({round(v, 12) for v in values.values()}) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cli_mislabeled_asks_for_missing_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:  # refused while parsing, before any data
        main(["influence", "mislabeled", "--device", "cuda", "--out", str(tmp_path),
              "--data-dir", str(DATA_DIR), "--no-progress"])
    assert stop.value.code == 2
    assert "asks for CUDA, which this machine does not have" in capsys.readouterr().err
