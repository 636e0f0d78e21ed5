"""fsd.moments.evaluators: the choice at fit, the name a summary records, and files written before.

The evaluators' maths is checked against dense references in the tests of their modules
(test_exact_moments*, test_conv_moments, test_graph_moments, test_corrected_moments); here,
that ``fit`` picks the right one for each model, that a summary records it and is evaluated
by it after ``load``, and that summaries written before evaluators had names (two flags in
the metadata) give the same distance.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsd
from conftest import DTYPE, cnn, labelled_batches, mlp, perturbed
from fsd.moments import evaluators
from fsd.moments.corrected import corrected_reference
from fsd_experiments.ablations import BGLNVariant


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(h + torch.relu(self.hidden(h)))


def _residual() -> nn.Module:
    torch.manual_seed(0)
    return Residual().to(DTYPE)


CASES = [  # (model, input shape, estimator, the evaluator fit must pick)
    (lambda: mlp([4, 6, 5, 3]), (4,), lambda: fsd.BGLN(deterministic=True), "algorithm2"),
    (lambda: mlp([4, 6, 5, 3]), (4,),
     lambda: fsd.BGLN(deterministic=True, reference="layerwise"), "algorithm2"),
    (lambda: mlp([4, 6, 5, 3]), (4,), lambda: fsd.BGLN(deterministic=True, moments="exact"),
     "exact"),
    (cnn, (1, 8, 8), lambda: fsd.BGLN(deterministic=True), "algorithm2-conv"),
    (_residual, (4,), lambda: fsd.BGLN(deterministic=True, moments="exact"), "exact-graph"),
    (lambda: mlp([4, 6, 5, 3]), (4,), lambda: BGLNVariant(moments="corrected"), "corrected"),
    (lambda: mlp([4, 6, 5, 3]), (4,), lambda: BGLNVariant(moments="no-gate-variance"),
     "no-gate-variance"),
    (lambda: mlp([4, 6, 5, 3]), (4,), lambda: BGLNVariant(moments="no-cross-covariance"),
     "no-cross-covariance"),
]


@pytest.mark.parametrize("build,shape,make,name", CASES, ids=[c[3] for c in CASES])
def test_fit_records_the_evaluator_it_chose_and_load_uses_it(build, shape, make, name,
                                                             tmp_path):
    model = build()
    data = labelled_batches(48, shape, seed=3)
    estimator = make().fit(model, data)
    assert estimator._meta["evaluator"] == name
    assert estimator._evaluator is evaluators.get(name)
    other = perturbed(model, 0.1, seed=4)
    value = estimator.distance(other)
    assert float(value.detach()) > 0
    estimator.save(tmp_path / "s.pt")
    loaded = fsd.load(tmp_path / "s.pt")
    assert loaded._evaluator is evaluators.get(name)
    assert torch.equal(loaded.distance(other), value)


_BEFORE_NAMES = [c for c in CASES if c[3] in ("algorithm2", "algorithm2-conv", "exact",
                                               "exact-graph")]


# ids that do not print functions (their addresses differ between pytest-xdist's workers)
@pytest.mark.parametrize("build,shape,make,name", _BEFORE_NAMES,
                         ids=[f"{c[3]}-{i}" for i, c in enumerate(_BEFORE_NAMES)])
def test_a_summary_written_before_evaluator_names_reads_its_flags(build, shape, make, name):
    model = build()
    estimator = make().fit(model, labelled_batches(48, shape, seed=3))
    other = perturbed(model, 0.1, seed=4)
    # what earlier versions wrote: no name, a flag for the convolutional and graph walks
    del estimator._meta["evaluator"]
    if name == "algorithm2-conv":
        estimator._meta["convolutional"] = True
    if name == "exact-graph":
        estimator._meta["graph"] = True
    old = fsd.from_payload(estimator.to_payload())
    assert old._evaluator is evaluators.get(name)
    assert torch.equal(old.distance(other), make().fit(model, labelled_batches(
        48, shape, seed=3)).distance(other))


@pytest.mark.parametrize("recorded", ["exact", "algorithm3", 7])
def test_load_refuses_an_evaluator_that_is_unknown_or_not_the_configurations(recorded):
    estimator = fsd.BGLN(deterministic=True).fit(mlp([4, 5, 3]), labelled_batches(32, (4,)))
    estimator._meta["evaluator"] = recorded  # moments="paper": not exact moments
    with pytest.raises(fsd.SummaryFormatError, match="evaluator"):
        fsd.from_payload(estimator.to_payload())


def test_the_dense_ablation_refuses_a_cnn_at_fit_and_the_corrected_recursion_takes_it():
    with pytest.raises(NotImplementedError, match="walks MLP chains only") as info:
        BGLNVariant(moments="no-cross-covariance").fit(cnn(), labelled_batches(32, (1, 8, 8)))
    assert "\n" not in str(info.value)
    for moments, name in (("corrected", "corrected-conv"),
                          ("no-gate-variance", "no-gate-variance-conv")):
        fitted = BGLNVariant(moments=moments).fit(cnn(), labelled_batches(32, (1, 8, 8)))
        assert fitted._meta["evaluator"] == name


def test_the_registry_refuses_what_is_not_an_evaluator_and_names_the_known_ones():
    with pytest.raises(TypeError, match="Evaluator"):
        evaluators.register(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="algorithm2-conv"):
        evaluators.get("nope")
    assert {"algorithm2", "algorithm2-conv", "exact", "exact-graph"} <= set(evaluators.names())


def test_summaries_keep_the_flags_older_versions_read():
    conv = fsd.BGLN(deterministic=True).fit(cnn(), labelled_batches(32, (1, 8, 8)))
    graph = fsd.BGLN(deterministic=True, moments="exact").fit(
        _residual(), labelled_batches(32, (4,)))
    assert conv._meta["convolutional"] is True and "graph" not in conv._meta
    assert graph._meta["graph"] is True and "convolutional" not in graph._meta


def test_a_name_read_from_old_flags_is_refused_in_one_line_saying_so():
    estimator = fsd.BGLN(deterministic=True).fit(mlp([4, 5, 3]), labelled_batches(32, (4,)))
    del estimator._meta["evaluator"]
    estimator._meta["graph"] = True  # a graph walk for moments="paper"
    with pytest.raises(fsd.SummaryFormatError) as info:
        fsd.from_payload(estimator.to_payload())
    message = str(info.value)
    assert "written before evaluator names" in message and "ValueError" not in message


@pytest.mark.parametrize("old,new", [
    ("fsd.interpreter", "fsd.moments.algorithm2"), ("fsd.estimator", "fsd.estimators.base"),
    ("fsd.rules", "fsd.model.rules"), ("fsd.graph_moments", "fsd.moments.exact_graph"),
    ("fsd.calibration", "fsd.uses.calibration"), ("fsd.coreset", "fsd.statistics.coreset")])
def test_old_module_paths_forward_every_name_with_a_warning(old, new):
    """Each module path before the sub-packages still imports, and each name is the new one."""
    import importlib
    moved, home = importlib.import_module(old), importlib.import_module(new)
    public = [n for n in vars(home) if not n.startswith("_")]
    assert public
    for name in public:
        with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to fsd"):
            assert getattr(moved, name) is getattr(home, name)


def test_names_that_left_their_module_forward_to_where_they_live():
    import fsd.corrected_moments
    import fsd.graph
    import fsd.interpreter
    import fsd.model.linearize
    import fsd.model.plan
    with pytest.warns(DeprecationWarning, match="fsd.model.plan.chain"):
        assert fsd.graph.chain is fsd.model.plan.chain
    with pytest.warns(DeprecationWarning, match="fsd.moments.corrected"):
        assert fsd.corrected_moments.corrected_reference is corrected_reference
    with pytest.warns(DeprecationWarning, match="fsd.model.linearize"):
        from fsd.interpreter import propagate_linearized
    assert propagate_linearized is fsd.model.linearize.propagate_linearized
    with pytest.raises(AttributeError):
        fsd.interpreter.__wrapped__  # noqa: B018  # dunder lookups are not forwarded


def test_a_summary_set_restacks_a_member_fitted_again():
    model, data = mlp([4, 6, 5, 3]), labelled_batches(48, (4,), seed=3)
    members = [fsd.BGLN(deterministic=True, covariance="full").fit(perturbed(model, 0.1, seed=s),
                                                                   data) for s in (5, 6)]
    together = fsd.combine(members)
    moved = perturbed(model, 0.2, seed=7)
    together.distance(moved)  # stacks and caches
    members[1].fit(perturbed(model, 0.3, seed=8), data)
    expected = members[0].distance(moved) + members[1].distance(moved)
    torch.testing.assert_close(together.distance(moved), expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("config,message", [
    ({}, "is not a chain of layers"),  # Algorithm 2 walks chains: the chain's own refusal
    ({"moments": "exact", "reference": "layerwise"}, "reference='propagated' on this graph"),
])
def test_bgln_d_on_a_graph_no_evaluator_walks_is_refused_in_one_line(config, message):
    with pytest.raises(fsd.UnsupportedModuleError, match=message) as info:
        fsd.BGLN(deterministic=True, **config).fit(_residual(), labelled_batches(32, (4,)))
    assert "\n" not in str(info.value)


def test_distance_by_walks_the_same_statistics_as_a_summary_fitted_for_that_walk():
    # fit reads the same statistics whatever the moments: a summary walked by another
    # evaluator gives what a summary fitted for that evaluator gives, on every output kept
    model = mlp([4, 6, 5, 3])
    moved = perturbed(model, 0.3, seed=5)
    data = labelled_batches(48, (4,), seed=3)
    common = {"covariance": "lowrank", "rank": 2}
    fitted = {"algorithm2": fsd.BGLN(deterministic=True, **common),
              "exact": fsd.BGLN(deterministic=True, moments="exact", **common),
              "corrected": BGLNVariant(moments="corrected", **common),
              "no-gate-variance": BGLNVariant(moments="no-gate-variance", **common)}
    for outputs in (None, [0, 2]):
        summaries = {name: e.fit(model, data, outputs=outputs) for name, e in fitted.items()}
        with torch.no_grad():
            own = {name: float(s.distance(moved)) for name, s in summaries.items()}
            assert len({round(v, 12) for v in own.values()}) == 4  # four different walks
            for summary in summaries.values():
                for name, value in own.items():
                    assert float(summary.distance_by(moved, name)) == pytest.approx(value,
                                                                                   rel=1e-9)
        # differentiable as distance is, and the recorded evaluator's cache is untouched
        exact = summaries["exact"]
        moved.zero_grad()
        exact.distance_by(moved, "algorithm2").backward()
        by_walk = [p.grad.clone() for p in moved.parameters()]
        moved.zero_grad()
        summaries["algorithm2"].distance(moved).backward()
        for a, b in zip(by_walk, (p.grad for p in moved.parameters()), strict=True):
            torch.testing.assert_close(a, b)
        with torch.no_grad():
            assert float(exact.distance(moved)) == pytest.approx(own["exact"], rel=1e-12)


def test_distance_by_refuses_bgln_s_an_unknown_name_and_a_walk_that_does_not_apply():
    model = mlp([4, 6, 5, 3])
    data = labelled_batches(48, (4,), seed=3)
    with pytest.raises(ValueError, match="this summary is BGLN-S"):
        fsd.BGLN(num_samples=4).fit(model, data).distance_by(model, "exact")
    summary = fsd.BGLN(deterministic=True).fit(model, data)
    with pytest.raises(ValueError, match="unknown evaluator 'nope'; known: algorithm2"):
        summary.distance_by(model, "nope")
    conv = cnn()
    on_cnn = fsd.BGLN(deterministic=True).fit(conv, labelled_batches(48, (1, 8, 8), seed=3))
    with pytest.raises(NotImplementedError, match="moments='exact' is implemented for MLPs"):
        on_cnn.distance_by(conv, "exact")
    with pytest.raises(fsd.UnsupportedModuleError, match="the 'corrected' evaluator walks "
                                                         "chains of flat layers"):
        on_cnn.distance_by(conv, "corrected")
    assert float(on_cnn.distance_by(conv, "algorithm2-conv")) == float(on_cnn.distance(conv))
