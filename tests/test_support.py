"""The support table (fsd.model.support): what it names takes the model, and refusals quote it.

For each model feature a walker can refuse, a tiny model that has it: every walker the
table's advice names for that feature fits it and measures a moved copy, so the table claims
no support that does not exist. Then representative refusals: one line each, ending in (or
holding) the table's advice for the refusing walker and the feature.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsd
from conftest import NotDifferentiable
from fsd.model import rules, support
from fsd.model.support import Feature

DTYPE = torch.float64


# ----- a tiny model of each feature ------------------------------------------------------------

class _Residual(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 5), nn.Linear(5, 3)
        self.norm = nn.LayerNorm(5) if norm else nn.Identity()

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.norm(F.relu(h)) + h)


class _ConvResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(2, 2, 3, padding=1), nn.Linear(2 * 5 * 5, 3)

    def forward(self, x):
        return self.out(torch.flatten(F.relu(self.conv(x)) + x, 1))


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.mid(F.relu(self.inp(x))))
        return self.out(F.relu(self.mid(h)))


class _Branching(nn.Module):  # data-dependent control flow: torch.fx cannot trace it
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(10, 4), nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, ids):
        return self.out(F.relu(self.fc(self.emb(ids).mean(1))))


class _ForwardOnly(torch.autograd.Function):
    """x·w with forward mode only: per-example gradients (a backward) fail."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx, dx, dw):
        x, w = ctx.saved_tensors
        return dx * w + x * dw

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no backward")


class _NoBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.scale = nn.Linear(4, 3), nn.Parameter(torch.ones(3))

    def forward(self, x):
        return _ForwardOnly.apply(self.inp(x), self.scale)


def _mlp(*middle: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), *middle, nn.Linear(5, 3))


def _hooked() -> nn.Module:
    model = _mlp(nn.ReLU())
    model[0].register_forward_hook(lambda module, args, out: 2 * out)
    return model


def _batch_norm() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    model.to(DTYPE).train()
    with torch.no_grad():
        model(torch.randn(50, 4, dtype=DTYPE))
    return model.eval()


def _cnn(ceil: bool = False) -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 2, 3), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=ceil),
                         nn.Flatten(), nn.Linear(18, 3))


# feature -> (model, shape of an example; None: token ids)
MODELS: dict[tuple[Feature, ...], tuple[Callable[[], nn.Module], tuple[int, ...] | None]] = {
    (Feature.HOOK,): (_hooked, (4,)),
    (Feature.UNTRACEABLE,): (_Branching, (4,)),
    (Feature.NO_RULE,): (lambda: _mlp(nn.LayerNorm(5), nn.ReLU()), (4,)),
    (Feature.BRANCH,): (_Residual, (4,)),
    (Feature.SHARED_WEIGHTS,): (_Shared, (4,)),
    (Feature.UNFLAT,): (_cnn, (2, 8, 8)),
    (Feature.BRANCH, Feature.UNFLAT): (_ConvResidual, (2, 5, 5)),
    (Feature.CEIL_POOL,): (lambda: _cnn(ceil=True), (2, 7, 7)),
    (Feature.GATE_AFTER_NON_AFFINE,): (lambda: _mlp(nn.ReLU(), nn.Tanh()), (4,)),
    (Feature.NON_AFFINE,): (lambda: _Residual(norm=True), (4,)),
    (Feature.DISCRETE_INPUTS,): (_Tokens, None),
    (Feature.NOT_DIFFERENTIABLE,): (NotDifferentiable, (4,)),
    (Feature.NO_PER_EXAMPLE_GRADIENTS,): (_NoBackward, (4,)),
    (Feature.MOVED_BUFFERS,): (_batch_norm, (4,)),
}


def _example(features: tuple[Feature, ...]) -> tuple[nn.Module, torch.Tensor, nn.Module]:
    """The feature's model, data, and a copy that moved (only its buffers, for MOVED_BUFFERS)."""
    torch.manual_seed(0)
    make, shape = MODELS[features]
    model = make().to(DTYPE)
    data = torch.randint(0, 10, (30, 6)) if shape is None else torch.randn(30, *shape,
                                                                            dtype=DTYPE)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        if features == (Feature.MOVED_BUFFERS,):
            for buffer in moved.buffers():
                if buffer.is_floating_point():
                    buffer.add_(0.5)
        else:
            for p in moved.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return model, data, moved


def _build(walker: support.Walker, features: tuple[Feature, ...]) -> fsd.Estimator:
    return getattr(fsd, walker.estimator)(**walker.spelled(features)[1])


def test_every_feature_has_a_model_and_the_table_names_a_taker_for_it():
    assert {f for features in MODELS for f in features} == set(Feature)
    for features in MODELS:
        assert support.takers(*features), features


@pytest.mark.parametrize("features", list(MODELS), ids=lambda fs: "+".join(f.name for f in fs))
def test_every_walker_the_advice_names_takes_a_model_of_that_kind(features):
    model, data, moved = _example(features)
    for walker in support.takers(*features):
        name = walker.spelled(features)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # EWC's moved-buffers warning, on its own model
            value = _build(walker, features).fit(model, data).distance(moved)
        assert torch.isfinite(value) and float(value) > 0, (name, float(value))


# ----- refusals ---------------------------------------------------------------------------------

REFUSALS = [  # (estimator, features of its model, error type, the walker that refuses)
    (lambda: fsd.BGLN(deterministic=True), (Feature.BRANCH,), fsd.UnsupportedModuleError,
     support.BGLN_D),
    (lambda: fsd.BGLN(deterministic=True), (Feature.NO_RULE,), fsd.UnsupportedModuleError,
     support.BGLN_D),
    (lambda: fsd.BGLN(deterministic=True), (Feature.SHARED_WEIGHTS,), fsd.UnsupportedModuleError,
     support.BGLN_D),
    (lambda: fsd.LAFTR(), (Feature.HOOK,), fsd.UnsupportedModuleError, support.LAFTR),
    (lambda: fsd.BGLN(), (Feature.UNTRACEABLE,), fsd.UnsupportedModuleError, support.LAFTR),
    (lambda: fsd.BGLN(deterministic=True, moments="exact"), (Feature.UNFLAT,),
     NotImplementedError, support.BGLN_D_EXACT),
    (lambda: fsd.BGLN(deterministic=True, reference="layerwise"), (Feature.UNFLAT,),
     NotImplementedError, support.BGLN_D_LAYERWISE),
    (lambda: fsd.BGLN(deterministic=True, moments="exact"), (Feature.BRANCH, Feature.UNFLAT),
     NotImplementedError, support.BGLN_D_EXACT),
    (lambda: fsd.BGLN(deterministic=True), (Feature.CEIL_POOL,), NotImplementedError,
     support.BGLN_D),
    (lambda: fsd.BGLN(deterministic=True, moments="exact"), (Feature.GATE_AFTER_NON_AFFINE,),
     NotImplementedError, support.BGLN_D_EXACT),
    (lambda: fsd.BGLN(deterministic=True, moments="exact"), (Feature.NON_AFFINE,),
     NotImplementedError, support.BGLN_D_EXACT),
    (lambda: fsd.BGLN(), (Feature.DISCRETE_INPUTS,), ValueError, support.BGLN_S),
    (lambda: fsd.LAFTR(), (Feature.NOT_DIFFERENTIABLE,), ValueError, support.LAFTR),
    (lambda: fsd.BGLN(), (Feature.NOT_DIFFERENTIABLE,), ValueError, support.BGLN_S),
    (lambda: fsd.NTK(), (Feature.NOT_DIFFERENTIABLE,), ValueError, support.NTK),
    (lambda: fsd.EWC(), (Feature.NO_PER_EXAMPLE_GRADIENTS,), ValueError, support.EWC),
]


@pytest.mark.parametrize("make, features, error, failing", REFUSALS,
                         ids=lambda v: "+".join(f.name for f in v) if isinstance(v, tuple)
                         else None)
def test_a_refusal_is_one_line_with_the_tables_advice(make, features, error, failing):
    model, data, _ = _example(features)
    assert not set(features) <= failing.takes  # the table agrees that it refuses
    with pytest.raises(error) as info:
        make().fit(model, data)
    message = str(info.value)
    assert "\n" not in message
    assert support.advice(failing, *features) in message


def test_ewc_warns_of_moved_buffers_with_the_tables_advice():
    model, data, moved = _example((Feature.MOVED_BUFFERS,))
    with pytest.warns(UserWarning) as record:
        fsd.EWC().fit(model, data).distance(moved)
    message = str(record[0].message)
    assert "\n" not in message
    assert message.endswith(support.advice(support.EWC, Feature.MOVED_BUFFERS))


def test_advice_groups_walkers_by_what_they_take_and_adds_the_options_a_feature_needs():
    assert support.advice(support.BGLN_D, Feature.BRANCH) == (
        "use BGLN-D with moments='exact' on MLP chains and graphs of flat layers, BGLN-D with "
        "moments='corrected' on chains and residual graphs of layers with rules (CNNs too), "
        "BGLN-S or LAFTR on any graph torch.fx traces, or ExactFSD, NTK, EWC or KFAC on any "
        "model")
    assert support.advice(support.LAFTR, Feature.HOOK) == \
        "use ExactFSD, NTK, EWC or KFAC on any model"
    # the refusing walker is named when an option makes it take the feature
    assert "BGLN-S with inputs='coreset'" in support.advice(support.BGLN_S,
                                                            Feature.DISCRETE_INPUTS)


def test_walker_of_finds_an_estimators_row():
    assert support.walker_of(fsd.BGLN, fsd.BGLN().config) is support.BGLN_S
    assert support.walker_of(fsd.BGLN, fsd.BGLN(deterministic=True).config) is support.BGLN_D
    assert support.walker_of(fsd.BGLN, fsd.BGLN(deterministic=True,
                                                 moments="exact").config) is support.BGLN_D_EXACT
    assert support.walker_of(fsd.LAFTR, fsd.LAFTR().config) is support.LAFTR
    assert support.walker_of(fsd.BGLN, fsd.BGLN(
        deterministic=True, moments="corrected").config) is support.BGLN_D_CORRECTED
    from fsd_experiments.ablations import BGLNVariant  # a subclass: its base class's rows
    assert support.walker_of(BGLNVariant, BGLNVariant().config) is support.BGLN_D_CORRECTED
    assert support.walker_of(BGLNVariant, BGLNVariant(
        moments="no-gate-variance").config) is support.BGLN_D


def test_advice_says_so_when_no_other_walker_takes_the_features():
    # before: IndexError from an empty list of takers (ExactFSD, which takes any model, is the
    # one refusing here, and nothing else takes both features)
    features = (Feature.NOT_DIFFERENTIABLE, Feature.NO_PER_EXAMPLE_GRADIENTS)
    assert support.takers(*features, failing=support.EXACT_FSD) == []
    assert support.advice(support.EXACT_FSD, *features) == (
        "no other estimator takes a model with an operation neither forward mode nor two "
        "reverse-mode products take and parameters without per-example gradients (no "
        "backward); change that part of the model")


def test_advice_is_one_line_for_every_walker_and_pair_of_features():
    # every refusing walker × every feature or pair of features: the walkers the advice
    # names are exactly the takers, or it says that none is
    pairs = [(f,) for f in Feature] + [(f, g) for f in Feature for g in Feature if f != g]
    for failing in support.WALKERS:
        for features in pairs:
            text = support.advice(failing, *features)
            named = support.takers(*features, failing=failing)
            assert text and "\n" not in text, (failing.name, features)
            if not named:
                assert text.startswith("no other estimator takes a model with "), text
                assert all(f.value in text for f in features), text
                continue
            assert text.startswith("use "), text
            for walker in support.WALKERS:
                spelled = walker.spelled(features)[0]
                assert (f"{spelled} on " in text or f"{spelled}, " in text
                        or f"{spelled} or " in text) == (walker in named), (text, walker.name)


def test_advice_with_a_table_where_nothing_else_takes_a_model(monkeypatch):
    monkeypatch.setattr(support, "WALKERS", (support.LAFTR,))
    assert support.advice(support.LAFTR, Feature.HOOK) == (
        "no other estimator takes a model with a forward hook that changes a layer's output; "
        "change that part of the model")
    assert support.advice(support.LAFTR) == "no other estimator takes this model"


# ----- exact moments on a graph: which feature each refusal names -----------------------------

class _ConvInGraph(nn.Module):
    """Flat inputs, a residual graph, and a convolution on the hidden vector viewed as an image."""

    def __init__(self, unflatten: bool = False) -> None:
        super().__init__()
        self.inp, self.conv, self.out = nn.Linear(4, 16), nn.Conv2d(1, 1, 3, padding=1), \
            nn.Linear(16, 3)
        self.unflatten = nn.Unflatten(1, (1, 4, 4)) if unflatten else None

    def forward(self, x):
        h = self.inp(x)
        image = self.unflatten(h) if self.unflatten is not None else h.view(-1, 1, 4, 4)
        return self.out(h + F.relu(self.conv(image)).flatten(1))


def _advised(monkeypatch) -> list[tuple[Feature, ...]]:
    """The features every support.advice call gets from here on."""
    calls: list[tuple[Feature, ...]] = []
    original = support.advice

    def spy(failing, *features):
        calls.append(features)
        return original(failing, *features)
    monkeypatch.setattr(support, "advice", spy)
    return calls


_UNFLAT_GRAPH = (Feature.BRANCH, Feature.UNFLAT)


@pytest.mark.parametrize("unflatten", [False, True], ids=["view", "nn.Unflatten"])
def test_a_convolution_in_a_graph_is_refused_as_unflat_with_the_walkers_that_take_it(
        unflatten, monkeypatch):
    # before: refused as "an operation that is not affine" (Feature.NON_AFFINE), about
    # "an output of shape (17, 1, 4, 4) for 17 examples"
    torch.manual_seed(0)
    model = _ConvInGraph(unflatten).to(DTYPE)
    data = torch.randn(30, 4, dtype=DTYPE)
    advised = _advised(monkeypatch)
    with pytest.raises(NotImplementedError) as info:
        fsd.BGLN(deterministic=True, moments="exact").fit(model, data)
    message = str(info.value)
    node = "unflatten" if unflatten else "view"
    assert message.startswith(
        f"BGLN-D with exact moments on a graph: a tensor of shape (1, 4, 4) per example (flat "
        f"feature vectors only) at graph node '{node}'"), message
    assert "\n" not in message
    assert advised[-1] == _UNFLAT_GRAPH
    assert message.endswith(support.advice(support.BGLN_D_EXACT, *_UNFLAT_GRAPH))
    # every walker it names takes models with non-flat tensors, and fits this one
    named = support.takers(*_UNFLAT_GRAPH, failing=support.BGLN_D_EXACT)
    assert named and all(Feature.UNFLAT in w.takes for w in named)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.3 * torch.randn_like(p))
    for walker in named:
        value = _build(walker, _UNFLAT_GRAPH).fit(model, data).distance(moved)
        assert torch.isfinite(value) and float(value) > 0, walker.name


def test_an_affine_layer_without_flat_moments_in_a_graph_is_refused_as_unflat(monkeypatch):
    # a layer whose rule propagates no flat moments (a convolution's): here a Linear whose
    # rule says so, as a flat tensor never reaches a real Conv2d in a graph of flat inputs
    linear = rules.RULES[nn.Linear]
    assert isinstance(linear, fsd.AffineRule)
    monkeypatch.setitem(rules.RULES, nn.Linear, dataclasses.replace(
        linear, flat_moments=lambda module: False))
    model, data, _ = _example((Feature.BRANCH,))
    advised = _advised(monkeypatch)
    with pytest.raises(NotImplementedError, match=r"Linear on images at graph node 'inp'") as info:
        fsd.BGLN(deterministic=True, moments="exact").fit(model, data)
    assert advised[-1] == _UNFLAT_GRAPH
    assert str(info.value).endswith(support.advice(support.BGLN_D_EXACT, *_UNFLAT_GRAPH))


def test_an_operation_that_is_not_affine_is_still_refused_as_non_affine(monkeypatch):
    class Softmaxed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.out(x + torch.softmax(self.fc(x), dim=-1))

    advised = _advised(monkeypatch)
    with pytest.raises(NotImplementedError, match=r"not affine in its inputs") as info:
        fsd.BGLN(deterministic=True, moments="exact").fit(Softmaxed().to(DTYPE),
                                                          torch.randn(30, 4, dtype=DTYPE))
    assert advised[-1] == (Feature.NON_AFFINE,)
    assert str(info.value).endswith(support.advice(support.BGLN_D_EXACT, Feature.NON_AFFINE))
