"""The adjoint recursion for exact-moment BGLN-D against the forward one, value and gradient.

:func:`fsd.moments.exact.delta_second_moment` (dense moments pushed forward through every
layer, checked against BGLN-S and ExactFSD in test_exact_moments.py) is the reference;
:func:`fsd.moments.exact.delta_second_moment_adjoint` is what BGLN and fsd.combine use. Both
are evaluated in float64 on the same cached reference blocks, for every architecture shape
the adjoint treats differently: low-rank-plus-diagonal adjoints reaching the first layer,
dense adjoints carried through hidden layers, affine layers without a gate in between, a
gate after the last layer, output restrictions, mixtures, layer-wise statistics and stacked
reference networks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsd
from conftest import perturbed
from fsd.model.plan import trace
from fsd.moments.exact import delta_second_moment, delta_second_moment_adjoint

RTOL = 1e-10


def _net(kind, d=6, seed=0):
    torch.manual_seed(seed)
    if kind == "one hidden":  # the first layer sees the structured (low-rank + diag) adjoint
        layers = [nn.Linear(d, 7), nn.ReLU(), nn.Linear(7, 4)]
    elif kind == "two hidden":  # ... the dense adjoint, formed at the last hidden layer
        layers = [nn.Linear(d, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 4)]
    elif kind == "three hidden":  # ... dense adjoints carried through a dense layer
        layers = [nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 6),
                  nn.ReLU(), nn.Linear(6, 4)]
    elif kind == "linear with dropout":  # affine after affine: no gate in between
        layers = [nn.Linear(d, 5), nn.Dropout(0.3), nn.Linear(5, 6), nn.Linear(6, 4)]
    elif kind == "affine pairs":  # gates and gate-less pairs mixed, no bias on one layer
        layers = [nn.Flatten(), nn.Linear(d, 7), nn.Linear(7, 6, bias=False), nn.ReLU(),
                  nn.Linear(6, 5), nn.ReLU(), nn.Identity(), nn.Linear(5, 5), nn.Linear(5, 4)]
    elif kind == "relu at the end":
        layers = [nn.Linear(d, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 4),
                  nn.ReLU()]
    else:
        raise AssertionError(kind)
    return nn.Sequential(*layers).double()


def _moved(model, scale=0.3, seed=1):
    return perturbed(model, scale, seed)


def _data(n=300, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(
        d, d, generator=g, dtype=torch.float64) + 0.5
    x[:, 0] = 1.0  # a constant input: rank-deficient covariance
    return [(x, torch.randint(0, classes, (n,), generator=g))]


def _both(estimator, moved):
    """(value, gradients) of the forward reference and of the adjoint, same cached blocks."""
    layers = trace(moved)
    params0 = estimator.reference_parameters()
    parts = estimator.moment_parts(layers, params0)
    out = []
    for function in (delta_second_moment, delta_second_moment_adjoint):
        params1 = dict(moved.named_parameters())
        value = function(layers, params0, params1, parts["reference"], parts["gate_means"],
                         parts["output_rows"])
        total = (parts["weights"] * value).sum()
        out.append((value, torch.autograd.grad(total, list(params1.values()))))
    return out


def _assert_equal(estimator, moved):
    (value, grads), (fast, fast_grads) = _both(estimator, moved)
    assert float(value.min()) > 0
    torch.testing.assert_close(fast, value, rtol=RTOL, atol=0)
    for a, b in zip(fast_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()))


KINDS = ["one hidden", "two hidden", "three hidden", "linear with dropout", "affine pairs",
         "relu at the end"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("covariance", ["full", "diag", "lowrank"])
def test_adjoint_equals_forward_moments(kind, covariance):
    model = _net(kind)
    estimator = fsd.BGLN(deterministic=True, moments="exact", covariance=covariance,
                         rank=3).fit(model, _data())
    _assert_equal(estimator, _moved(model))


@pytest.mark.parametrize("kind", ["one hidden", "two hidden", "three hidden"])
def test_adjoint_equals_forward_with_mixtures_outputs_and_layerwise_statistics(kind):
    model, data = _net(kind), _data()
    moved = _moved(model)
    for options in ({"classwise": True, "covariance": "full"},
                    {"classwise": 2, "covariance": "lowrank", "rank": 2},
                    {"reference": "layerwise", "covariance": "full"},
                    {"reference": "layerwise", "classwise": True, "covariance": "diag"}):
        estimator = fsd.BGLN(deterministic=True, moments="exact", **options)
        for outputs in (None, [1, 3], slice(2, 4)):
            _assert_equal(estimator.fit(model, data, outputs=outputs), moved)


def test_adjoint_is_exactly_zero_at_the_reference():
    model = _net("three hidden")
    estimator = fsd.BGLN(deterministic=True, moments="exact", covariance="lowrank",
                         rank=2, classwise=True).fit(model, _data())
    value = estimator.distance(model)
    grads = torch.autograd.grad(value, list(model.parameters()))
    assert float(value) == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads)


@pytest.mark.parametrize("covariance", ["full", "diag", "lowrank"])
def test_batched_summaries_equal_the_forward_reference(covariance):
    # stacked reference networks (fsd.combine): per-component θ0, heads of different width
    model, data = _net("two hidden"), _data()
    estimators, weights = [], [1.0, 0.5, 2.0]
    for t in range(3):
        reference = _moved(model, 0.1, seed=10 + t)
        estimators.append(fsd.BGLN(deterministic=True, moments="exact", covariance=covariance,
                                   rank=3, classwise=(t == 1))
                          .fit(reference, data, outputs=[t, t + 1] if t < 2 else None))
    moved = _moved(model, 0.3, seed=99)
    batched = fsd.combine(estimators, weights).distance(moved)
    grads = torch.autograd.grad(batched, list(moved.parameters()))
    layers = trace(moved)
    truth = 0
    for w, e in zip(weights, estimators, strict=True):
        parts = e.moment_parts(layers, e.reference_parameters())
        value = delta_second_moment(layers, e.reference_parameters(),
                                    dict(moved.named_parameters()), parts["reference"],
                                    parts["gate_means"], parts["output_rows"])
        truth = truth + w * 0.5 * (parts["weights"] * value).sum()
    truth_grads = torch.autograd.grad(truth, list(moved.parameters()))
    torch.testing.assert_close(batched, truth, rtol=RTOL, atol=0)
    for a, b in zip(grads, truth_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()))


def test_adjoint_under_torch_func_and_double_backward():
    # the batched PBRF solver takes vmap(grad(·)) of BGLN-D terms (fsd.uses.influence), and the
    # first layer's source is a custom autograd function: both must see the same function
    from conftest import distance_fn

    model, data = _net("two hidden"), _data()
    for covariance in ("full", "lowrank"):
        estimator = fsd.BGLN(deterministic=True, moments="exact", covariance=covariance,
                             rank=3, classwise=True).fit(model, data)
        names, f = distance_fn(estimator, model)
        g = torch.Generator().manual_seed(2)
        stacks = [torch.stack([p.detach() + 0.1 * torch.randn(p.shape, generator=g,
                                                              dtype=p.dtype)
                               for _ in range(3)]) for p in model.parameters()]
        batched = torch.func.vmap(torch.func.grad(f, argnums=tuple(range(len(names)))))(*stacks)
        for b in range(3):
            point = [s[b].clone().requires_grad_() for s in stacks]
            for a, r in zip(batched, torch.autograd.grad(f(*point), point), strict=True):
                torch.testing.assert_close(a[b], r, rtol=1e-12, atol=1e-15)
        point = [s[0].clone().requires_grad_() for s in stacks]
        assert torch.autograd.gradgradcheck(f, point)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("kind", ["two hidden", "one hidden"])
def test_full_covariance_first_layer_by_factor_and_by_dense_moments(monkeypatch, kind, dense):
    # a full covariance's first layer has both Φ and R00 = ΦΦᵀ; the adjoint picks the cheaper
    import fsd.moments.exact as exact_moments

    monkeypatch.setattr(exact_moments, "_dense_is_cheaper", lambda block, outputs: dense)
    model = _net(kind)
    for classwise in (False, True):
        estimator = fsd.BGLN(deterministic=True, moments="exact", classwise=classwise,
                             covariance="full").fit(model, _data())
        _assert_equal(estimator, _moved(model))
