"""Low-rank BGLN-D and batched summary sets against their dense / one-by-one truths."""

from __future__ import annotations

import torch
from torch import nn

import fsd


def _mlp(d=6, width=7, outputs=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, outputs)).double()


def _data(n=300, d=6, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ mix
    x[:, 0] = 1.0  # a constant feature: rank-deficient covariance, like MNIST's border pixels
    return [(x, torch.randint(0, classes, (n,), generator=g))]


def _moved(model, scale=0.2, seed=1):
    g = torch.Generator().manual_seed(seed)
    moved = _mlp()
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return moved


def test_lowrank_bgln_d_equals_full_when_rank_is_the_dimension():
    model, data = _mlp(), _data()
    moved = _moved(model)
    for classwise in (False, True):
        full = fsd.BGLN(deterministic=True, classwise=classwise).fit(model, data)
        low = fsd.BGLN(deterministic=True, covariance="lowrank", rank=6,
                       classwise=classwise).fit(model, data)
        torch.testing.assert_close(low.distance(moved), full.distance(moved), rtol=1e-10,
                                   atol=0)
        assert low.nbytes < full.nbytes + 7 * 8 * (2 if not classwise else 8)


def _assert_equals_sum_with_gradients(batched, estimators, weights, moved):
    """A summary set's distance equals Σ w·D_i evaluated one by one, value and gradient."""
    one_by_one = sum(w * e.distance(moved) for w, e in zip(weights, estimators, strict=True))
    torch.testing.assert_close(batched, one_by_one, rtol=1e-12, atol=0)
    g_batched = torch.autograd.grad(batched, list(moved.parameters()))
    g_single = torch.autograd.grad(one_by_one, list(moved.parameters()))
    for a, b in zip(g_batched, g_single, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_summary_set_equals_sum_of_distances_with_gradients():
    model, data = _mlp(), _data()
    estimators, weights = [], [1.0, 2.0, 0.5, 1.5, 3.0, 0.7]
    for t in range(4):
        reference = _moved(model, 0.1, seed=10 + t)
        outputs = [t % 4, (t + 1) % 4] if t < 3 else None  # heads of different width
        estimators.append(fsd.BGLN(deterministic=True, classwise=(t % 2 == 0))
                          .fit(reference, data, outputs=outputs))
    estimators.append(fsd.BGLN(deterministic=True, covariance="diag").fit(model, data))
    estimators.append(fsd.EWC(metric="euclidean").fit(model, data))
    moved = _moved(model, 0.3, seed=99)
    batched = fsd.combine(estimators, weights).distance(moved)
    _assert_equals_sum_with_gradients(batched, estimators, weights, moved)


def test_summary_set_checks_architecture():
    model, data = _mlp(), _data()
    estimators = [fsd.BGLN(deterministic=True).fit(model, data) for _ in range(2)]
    other = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 7), nn.ReLU(),
                          nn.Linear(7, 4)).double()
    try:
        fsd.combine(estimators).distance(other)
    except fsd.ArchitectureMismatchError:
        return
    raise AssertionError("a summary set accepted a model of another architecture")


def test_summary_set_checks_every_batched_member_against_the_model(monkeypatch):
    """The model's signature is read once per call, but every member's is compared with it."""
    import fsd.estimators.summary_set as summary_set
    model, data = _mlp(), _data()
    other = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 7), nn.ReLU(),
                          nn.Linear(7, 4)).double()
    fitted = fsd.BGLN(deterministic=True).fit(model, data)
    stranger = fsd.BGLN(deterministic=True).fit(other, data)
    twin = fsd.BGLN(deterministic=True).fit(model, data)
    assert summary_set._batch_key(fitted) == summary_set._batch_key(stranger)  # one batch
    reads = []
    real = fsd.BGLN._full_signature

    def counting(self, module):
        reads.append(module)
        return real(self, module)

    monkeypatch.setattr(fsd.BGLN, "_full_signature", counting)
    moved = _moved(model, 0.3, seed=5)
    fsd.combine([fitted, twin]).distance(moved)
    assert len(reads) == 1
    for members in ([fitted, stranger], [stranger, fitted]):
        try:
            fsd.combine(members).distance(moved)
        except fsd.ArchitectureMismatchError:
            continue
        raise AssertionError("a summary set accepted a member fitted on another architecture")


def _record_stacked_params(monkeypatch, name):
    """Patch fsd.moments.evaluators' ``name`` to record the stacked params0 of every call."""
    import fsd.moments.evaluators as evaluators
    calls = []
    real = getattr(evaluators, name)

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluators, name, counting)
    return calls


def test_exact_moment_summaries_are_batched_and_equal_the_sum(monkeypatch):
    calls = _record_stacked_params(monkeypatch, "delta_second_moment_adjoint")
    model, data = _mlp(), _data()
    estimators = []
    for t in range(3):  # full covariance: classwise or not, heads of different width
        reference = _moved(model, 0.1, seed=20 + t)
        outputs = [t % 4, (t + 1) % 4] if t < 2 else None
        estimators.append(fsd.BGLN(deterministic=True, moments="exact", classwise=(t == 1))
                          .fit(reference, data, outputs=outputs))
    for t, covariance in enumerate(("diag", "diag", "lowrank", "lowrank")):
        reference = _moved(model, 0.1, seed=30 + t)
        estimators.append(fsd.BGLN(deterministic=True, moments="exact", covariance=covariance,
                                   rank=3, reference="layerwise" if t == 3 else "propagated")
                          .fit(reference, data))
    estimators.append(fsd.BGLN(deterministic=True).fit(model, data))  # Algorithm 2: apart
    weights = [1.0, 2.0, 0.5, 1.5, 3.0, 0.7, 1.1, 0.9]
    moved = _moved(model, 0.3, seed=98)
    batched = fsd.combine(estimators, weights).distance(moved)
    # one pass per covariance form (full, diag, lowrank); the lone paper summary goes alone
    assert len(calls) == 3
    # components per pass: the classwise summary brings one per class (4)
    assert sorted(p["0.weight"].shape[0] for p in calls) == [2, 2, 1 + 4 + 1]
    _assert_equals_sum_with_gradients(batched, estimators, weights, moved)


def test_classwise_summaries_share_one_reference_per_summary(monkeypatch):
    """Equal component counts: params0 is stacked once per summary, not once per class."""
    calls = _record_stacked_params(monkeypatch, "delta_moments")
    model, data = _mlp(), _data()
    for covariance in ("full", "diag", "lowrank"):
        calls.clear()
        estimators = [fsd.BGLN(deterministic=True, classwise=True, covariance=covariance, rank=3)
                      .fit(_moved(model, 0.1, seed=40 + t), data) for t in range(3)]
        weights = [1.0, 2.0, 0.5]
        moved = _moved(model, 0.3, seed=97)
        batched = fsd.combine(estimators, weights).distance(moved)
        assert [p["0.weight"].shape[0] for p in calls] == [3]  # 3 references, 12 components
        _assert_equals_sum_with_gradients(batched, estimators, weights, moved)


def test_classwise_summaries_of_a_linear_batchnorm_run_equal_the_sum():
    """Composed Linear + BatchNorm1d runs: per-reference ΔW and Δb, classes consecutive."""
    torch.manual_seed(3)
    x = torch.randn(300, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (300,))

    def network(shift):
        net = nn.Sequential(nn.Linear(6, 7), nn.BatchNorm1d(7), nn.ReLU(),
                            nn.Linear(7, 4)).double()
        net.train()
        net(x + shift)  # moves the running statistics away from their initial values
        return net.eval()

    estimators = [fsd.BGLN(deterministic=True, classwise=True).fit(network(0.1 * t), [(x, y)])
                  for t in range(3)]
    weights = [1.0, 2.0, 3.0]
    moved = network(0.5)
    batched = fsd.combine(estimators, weights).distance(moved)
    _assert_equals_sum_with_gradients(batched, estimators, weights, moved)
