"""Saving/loading summaries, refusing unsafe files, architecture checks and input errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsd
from conftest import DTYPE, cnn, labelled_batches, mlp, perturbed

pytestmark = pytest.mark.usefixtures("single_thread")

DETERMINISTIC = [
    pytest.param(lambda: fsd.ExactFSD(metric="kl"), id="exact"),
    pytest.param(lambda: fsd.LAFTR(coreset_size=9, metric="softmax_euclidean"), id="laftr"),
    pytest.param(lambda: fsd.BGLN(deterministic=True), id="bgln-d"),
    pytest.param(lambda: fsd.BGLN(deterministic=True, covariance="diag", classwise=True),
                 id="bgln-d-diag-cw"),
    pytest.param(lambda: fsd.NTK(coreset_size=7, metric="kl"), id="ntk"),
    pytest.param(lambda: fsd.EWC(fisher="true"), id="ewc-true"),
    pytest.param(lambda: fsd.EWC(fisher="sampled", metric="euclidean"), id="ewc-sampled"),
    pytest.param(lambda: fsd.EWC(fisher="empirical", metric="kl"), id="ewc-empirical"),
]
STOCHASTIC = [
    pytest.param(lambda: fsd.LAFTR(inputs="gaussian", num_samples=8), id="laftr-gauss"),
    pytest.param(lambda: fsd.BGLN(num_samples=8, metric="kl", seed=3), id="bgln-s"),
    pytest.param(lambda: fsd.BGLN(num_samples=8, classwise=True, covariance="diag"),
                 id="bgln-s-cw-diag"),
    pytest.param(lambda: fsd.BGLN(inputs="coreset", coreset_size=5), id="bgln-s-coreset"),
]
ALL = DETERMINISTIC + STOCHASTIC


def _setup():
    model = mlp([5, 6, 4, 3], seed=0)
    data = labelled_batches(30, (5,), classes=3, seed=1)
    return model, data, perturbed(model, 0.3, seed=2)


# ----------------------------------------------------------------------------------------
# save / load
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", DETERMINISTIC)
def test_save_load_roundtrip_deterministic(make, tmp_path):
    model, data, other = _setup()
    est = make().fit(model, data)
    before = est.distance(other)
    path = tmp_path / "summary.pt"
    est.save(path)
    loaded = fsd.load(path)
    assert type(loaded) is type(est) and loaded.config == est.config
    assert loaded.nbytes == est.nbytes
    after = loaded.distance(other)
    assert torch.equal(before, after.detach()) or float(before) == float(after)
    assert after.requires_grad  # still a differentiable regularizer after loading
    assert not list(tmp_path.glob(".fsd-*"))  # no temporary left behind


@pytest.mark.parametrize("make", ALL)
def test_reference_state_dict_rebuilds_the_reference_network(make, tmp_path):
    model, data, _ = _setup()
    est = make().fit(model, data)
    est.save(tmp_path / "s.pt")
    rebuilt = mlp([5, 6, 4, 3], seed=7)  # other weights until loaded
    rebuilt.load_state_dict(fsd.load(tmp_path / "s.pt").reference_state_dict())
    for a, b in zip(rebuilt.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert float(est.distance(rebuilt).detach()) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("make", STOCHASTIC)
def test_save_load_roundtrip_stochastic_is_seeded(make, tmp_path):
    model, data, other = _setup()
    est = make().fit(model, data)
    first = [float(est.distance(other)) for _ in range(2)]
    assert first[0] != first[1]  # really random between calls
    est.save(tmp_path / "s.pt")
    loaded = fsd.load(tmp_path / "s.pt")
    again = [float(loaded.distance(other)) for _ in range(2)]
    # the sampling stream restarts from the seed: first call after load == first after fit
    assert again == first
    # a re-fit restarts it too
    assert float(make().fit(model, data).distance(other)) == first[0]


@pytest.mark.parametrize("classwise", [False, True], ids=["bgln-s", "bgln-s-cw"])
def test_bgln_s_summary_of_a_cnn_loads_back(classwise, tmp_path):
    # a conv layer's gate frequencies are stored per unit, shape (groups, C, H, W)
    model, data = cnn(seed=0), labelled_batches(12, (1, 8, 8), seed=1)
    est = fsd.BGLN(num_samples=4, classwise=classwise, seed=2).fit(model, data)
    assert any(v.dim() == 4 for k, v in est._state.items() if k.startswith("gate."))
    est.save(tmp_path / "s.pt")
    other = perturbed(model)
    assert float(fsd.load(tmp_path / "s.pt").distance(other)) == float(
        fsd.BGLN(num_samples=4, classwise=classwise, seed=2).fit(model, data).distance(other))


def test_load_refuses_pickled_objects(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pt"
    torch.save({"format": "fsd-summary", "version": 1, "estimator": "LAFTR", "config": "{}",
                "meta": "{}", "tensors": {}, "payload": Evil()}, path)
    # refused by torch's weights-only unpickler, reported as one line without its advice to
    # load with weights_only=False
    with pytest.raises(fsd.SummaryFormatError, match="unreadable: UnpicklingError"):
        fsd.load(path)
    assert not marker.exists()


def test_load_rejects_foreign_files(tmp_path):
    torch.save({"a": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an fsd summary"):
        fsd.load(tmp_path / "other.pt")
    model, data, _ = _setup()
    est = fsd.LAFTR().fit(model, data)
    est.save(tmp_path / "ok.pt")
    payload = torch.load(tmp_path / "ok.pt", weights_only=True)
    payload["version"] = 999
    torch.save(payload, tmp_path / "future.pt")
    with pytest.raises(ValueError, match="version"):
        fsd.load(tmp_path / "future.pt")
    payload["version"], payload["estimator"] = 1, "NoSuchEstimator"
    torch.save(payload, tmp_path / "unknown.pt")
    with pytest.raises(ValueError, match="unknown estimator"):
        fsd.load(tmp_path / "unknown.pt")


# ----------------------------------------------------------------------------------------
# architecture mismatches
# ----------------------------------------------------------------------------------------
def _wider():
    return mlp([5, 7, 4, 3], seed=0)


def _other_layer_type():
    m = mlp([5, 6, 4, 3], seed=0)
    m[1] = nn.Identity()  # same parameters, different function
    return m


def _extra_layer():
    m = mlp([5, 6, 4, 3], seed=0)
    return nn.Sequential(*m, nn.ReLU(), nn.Linear(3, 3).to(DTYPE))


def _extra_relu():
    m = mlp([5, 6, 4, 3], seed=0)
    return nn.Sequential(*m, nn.ReLU())


@pytest.mark.parametrize("make", ALL)
@pytest.mark.parametrize("variant", [_wider, _extra_layer])
def test_architecture_mismatch_any_estimator(make, variant):
    model, data, _ = _setup()
    est = make().fit(model, data)
    with pytest.raises(fsd.ArchitectureMismatchError):
        est.distance(variant())


LINEARIZED = [p for p in ALL if p.id.startswith(("laftr", "bgln"))]


@pytest.mark.parametrize("make", LINEARIZED)
@pytest.mark.parametrize("variant", [_other_layer_type, _extra_relu])
def test_architecture_mismatch_layer_structure(make, variant):
    """The linearized estimators read the layer structure, so parameter-free changes count."""
    model, data, _ = _setup()
    est = make().fit(model, data)
    with pytest.raises(fsd.ArchitectureMismatchError):
        est.distance(variant())


def test_architecture_mismatch_after_load_and_conv_hyperparameters(tmp_path):
    model, data = cnn(seed=0), labelled_batches(6, (1, 8, 8), seed=1)
    est = fsd.LAFTR().fit(model, data)
    est.save(tmp_path / "c.pt")
    loaded = fsd.load(tmp_path / "c.pt")
    loaded.distance(perturbed(model))  # same architecture: fine
    other = cnn(seed=0)
    other[2] = nn.AvgPool2d(2)  # max → average pooling
    with pytest.raises(fsd.ArchitectureMismatchError):
        loaded.distance(other)
    other = cnn(seed=0)
    other[3].padding = (0, 0)  # same parameter shapes, different conv
    with pytest.raises(fsd.ArchitectureMismatchError):
        loaded.distance(other)


# ----------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, name", [(lambda: nn.Softmax(dim=-1), "Softmax"),
                                       (lambda: nn.LayerNorm(4), "LayerNorm")])
@pytest.mark.parametrize("make", [p for p in LINEARIZED if p.id.startswith("bgln-d")])
def test_unsupported_module_names_class_and_path(make, bad, name):
    # BGLN-D needs a rule for every layer; LAFTR and BGLN-S linearize any operation on the
    # graph path (test_linearize.py, test_bgln_graph.py)
    model = nn.Sequential(nn.Linear(5, 4), nn.Sequential(bad(), nn.Linear(4, 3))).to(DTYPE)
    data = labelled_batches(10, (5,), seed=0)
    with pytest.raises(fsd.UnsupportedModuleError) as info:
        make().fit(model, data)
    assert name in str(info.value) and "'1.0'" in str(info.value)
    assert "BGLN-S or LAFTR on any graph" in str(info.value)
    with pytest.raises(fsd.UnsupportedModuleError, match=r"'1\.0'"):
        fsd.trace(model)


@pytest.mark.parametrize("bad", [lambda: nn.Softmax(dim=-1), lambda: nn.LayerNorm(4)])
@pytest.mark.parametrize("make", [p for p in LINEARIZED if p.id.startswith("bgln-s")])
def test_bgln_s_takes_a_layer_without_rule_on_the_graph_path(make, bad):
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), bad(), nn.Linear(4, 3)).to(DTYPE)
    est = make().fit(model, labelled_batches(10, (5,), seed=0))
    assert "gate.1" in est._state  # the ReLU's frequencies, stored by its path
    value = est.distance(perturbed(model, 0.3, seed=2))
    assert torch.isfinite(value) and float(value) > 0


@pytest.mark.parametrize("make", [pytest.param(lambda: fsd.ExactFSD(), id="exact"),
                                  pytest.param(lambda: fsd.NTK(), id="ntk"),
                                  pytest.param(lambda: fsd.EWC(), id="ewc")])
def test_black_box_estimators_accept_any_module(make):
    model = nn.Sequential(nn.Linear(5, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 3))).to(DTYPE)
    data = labelled_batches(10, (5,), seed=0)
    est = make().fit(model, data)
    assert float(est.distance(model)) == 0.0
    assert float(est.distance(perturbed(model))) > 0.0


@pytest.mark.parametrize("make", ALL)
def test_empty_data(make):
    model, _, _ = _setup()
    with pytest.raises(ValueError, match="empty"):
        make().fit(model, [])
    with pytest.raises(ValueError):
        make().fit(model, None)


@pytest.mark.parametrize("make", ALL)
def test_empty_tensor_data_is_a_value_error(make):
    model, _, _ = _setup()
    with pytest.raises(ValueError):  # EWC(fisher="empirical") may first ask for labels
        make().fit(model, torch.empty(0, 5, dtype=DTYPE))
    with pytest.raises(ValueError, match="empty"):
        make().fit(model, [(torch.empty(0, 5, dtype=DTYPE), torch.empty(0, dtype=torch.long))])


@pytest.mark.parametrize("make", ALL)
def test_empty_batch_inside_data_is_skipped(make):
    model, data, other = _setup()
    empty = (torch.empty(0, 5, dtype=DTYPE), torch.empty(0, dtype=torch.long))
    with_gap = make().fit(model, [data[0], empty, data[1]])
    without = make().fit(model, [data[0], data[1]])
    assert float(with_gap.distance(other)) == float(without.distance(other))


@pytest.mark.parametrize("make", ALL)
def test_nonfinite_data(make):
    model, _, _ = _setup()
    for value in (float("nan"), float("inf"), float("-inf")):
        data = labelled_batches(12, (5,), seed=0, batch=4)
        data[1][0][2, 3] = value
        with pytest.raises(ValueError, match="batch 1"):
            make().fit(model, data)


@pytest.mark.parametrize("make", ALL)
def test_distance_and_save_before_fit(make, tmp_path):
    model, _, _ = _setup()
    with pytest.raises(fsd.NotFittedError):
        make().distance(model)
    with pytest.raises(fsd.NotFittedError):
        make().save(tmp_path / "x.pt")


def test_public_summary_accessors():
    # what fsd.SummarySet uses instead of the estimators' internals
    model, data, other = _setup()
    est = fsd.BGLN(deterministic=True, covariance="full")
    with pytest.raises(fsd.NotFittedError):
        est.require_fitted()
    est.fit(model, data)
    est.require_fitted()
    est.check_architecture(other)
    with pytest.raises(fsd.ArchitectureMismatchError):
        est.check_architecture(mlp([5, 6, 3], seed=0))
    theta0 = est.reference_parameters()
    assert list(theta0) == [name for name, _ in model.named_parameters()]
    assert all(torch.equal(theta0[n], p) for n, p in model.named_parameters())
    est.place(torch.float32, torch.device("cpu"))
    assert all(t.dtype == torch.float32 for t in est.reference_parameters().values())
    assert est.input_covariance().dtype == torch.float32
    est.place(DTYPE, torch.device("cpu"))  # back to the stored float64, nothing was lost
    assert all(torch.equal(est.reference_parameters()[n], p) for n, p in model.named_parameters())
    parts = est.moment_parts(fsd.trace(model), est.reference_parameters())
    assert set(parts) == {"reference", "gate_means", "output_rows", "weights", "params0"}
    assert float(parts["weights"].sum()) == pytest.approx(1.0)


def test_configuration_errors():
    with pytest.raises(ValueError, match="Euclidean"):
        fsd.BGLN(deterministic=True, metric="kl")
    with pytest.raises(ValueError):
        fsd.BGLN(deterministic=True, metric="softmax_euclidean")
    with pytest.raises(ValueError):
        fsd.BGLN(deterministic=True, inputs="coreset")
    for ctor in (fsd.ExactFSD, fsd.LAFTR, fsd.BGLN, fsd.NTK, fsd.EWC):
        with pytest.raises(ValueError, match="unknown metric"):
            ctor(metric="cosine")
    with pytest.raises(ValueError):
        fsd.EWC(fisher="hessian")
    with pytest.raises(ValueError):
        fsd.EWC(fisher="sampled", metric="softmax_euclidean")
    with pytest.raises(ValueError):
        fsd.LAFTR(inputs="data")
    with pytest.raises(ValueError):
        fsd.BGLN(covariance="banded")
    with pytest.raises(ValueError):
        fsd.BGLN(classwise=0)
    with pytest.raises(ValueError):
        fsd.BGLN(num_samples=0)


def test_statistics_must_be_a_collector():
    model, _, _ = _setup()
    with pytest.raises(TypeError, match="StatisticsCollector, got dict"):
        fsd.BGLN(deterministic=True).fit(model, statistics={"means": None})

def test_statistics_an_estimator_would_ignore_are_refused():
    # ignored statistics (or data) would be a summary of something else than was meant
    model, data, _ = _setup()
    collector = fsd.StatisticsCollector(model)
    with pytest.raises(ValueError, match="LAFTR with inputs='coreset' keeps inputs, not "
                                         "statistics"):
        fsd.LAFTR().fit(model, data, statistics=collector)
    for estimator in (fsd.ExactFSD(), fsd.NTK(), fsd.EWC(), fsd.KFAC()):
        with pytest.raises(ValueError, match=rf"{type(estimator).__name__} computes its "
                                             r"summary from data"):
            estimator.fit(model, data, statistics=collector)
    with collector.record():
        for batch in data:
            model(batch[0] if isinstance(batch, (tuple, list)) else batch)
    with pytest.raises(ValueError, match="data and statistics= were both given"):
        fsd.BGLN(deterministic=True).fit(model, data, statistics=collector)
    fsd.BGLN(deterministic=True).fit(model, statistics=collector)  # one of them: fine


def test_bgln_d_on_cnn_runs_algorithm2_and_refuses_exact_moments():
    model, data = cnn(seed=0), labelled_batches(6, (1, 8, 8), seed=1)
    with pytest.raises(NotImplementedError, match="moments='exact'"):
        fsd.BGLN(deterministic=True, moments="exact").fit(model, data)
    # Algorithm 2 (fsd.moments.algorithm2_conv, checked in test_conv_moments.py) and BGLN-S
    # handle it
    for est in (fsd.BGLN(deterministic=True), fsd.BGLN(num_samples=4)):
        assert float(est.fit(model, data).distance(perturbed(model))) > 0


@pytest.mark.parametrize("make", [
    pytest.param(lambda: fsd.BGLN(deterministic=True, classwise=True), id="bgln-d"),
    pytest.param(lambda: fsd.BGLN(classwise=2), id="bgln-s"),
    pytest.param(lambda: fsd.BGLN(inputs="coreset", classwise=True), id="bgln-s-coreset"),
])
def test_classwise_without_labels(make):
    model, data, _ = _setup()
    unlabelled = [x for x, _ in data]
    with pytest.raises(ValueError, match="labels"):
        make().fit(model, unlabelled)
    with pytest.raises(ValueError, match="labels"):
        make().fit(model, torch.cat(unlabelled))


def test_label_count_mismatch_and_missing_batch_dim():
    model, data, _ = _setup()
    x, y = data[0]
    with pytest.raises(ValueError):
        fsd.BGLN(classwise=True).fit(model, [(x, y[:-1])])
    with pytest.raises(ValueError, match="batch"):
        fsd.LAFTR().fit(model, [x[0]])


def test_output_index_out_of_range():
    model, data, _ = _setup()
    with pytest.raises(ValueError):
        fsd.ExactFSD().fit(model, data, outputs=[])
    for est in (fsd.ExactFSD(), fsd.LAFTR(), fsd.BGLN(deterministic=True)):
        # caught at fit, where the model's outputs are known, not first at distance
        with pytest.raises(ValueError, match="out of range"):
            est.fit(model, data, outputs=[0, 7])
