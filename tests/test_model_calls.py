"""How estimators call the model: ``output=``, ``forward_kwargs=``, unused parameters, token ids.

Ground truths: a summary fitted with ``forward_kwargs={"task": t}`` (or ``output=``) must give
exactly the distance of the same estimator fitted on a wrapper module that calls
``forward(x, t)`` (picks the output) itself; token-id inputs to an ``nn.Embedding`` must give
exactly the distance of the same network written as a one-hot input to a bias-free Linear;
ExactFSD is checked against its formula.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fsd
from conftest import perturbed
from fsd.estimators.base import from_payload
from fsd.model.calls import bind
from fsd.validation import SummaryFormatError, payload_checksums

DTYPE = torch.float64
OLD_FILES = Path(__file__).resolve().parent / "data" / "summaries_before_calls"

# the eight estimators of the estimator table (BGLN-D in both moment forms)
ESTIMATORS = {
    "ExactFSD": lambda: fsd.ExactFSD(),
    "NTK": lambda: fsd.NTK(coreset_size=12),
    "EWC": lambda: fsd.EWC(),
    "KFAC": lambda: fsd.KFAC(),
    "LAFTR": lambda: fsd.LAFTR(coreset_size=12),
    "BGLN-S": lambda: fsd.BGLN(covariance="full", num_samples=16),
    "BGLN-D-paper": lambda: fsd.BGLN(deterministic=True, covariance="full"),
    "BGLN-D-exact": lambda: fsd.BGLN(deterministic=True, moments="exact", covariance="full"),
}


class MultiHead(nn.Module):
    """The multi-head continual-learning network: a shared body, one head per task."""

    def __init__(self, tasks: int = 3, returns: str = "tensor") -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(6, 3) for _ in range(tasks))
        self.returns = returns

    def forward(self, x, task):
        h = self.body(x)
        z = self.heads[task](h)
        if self.returns == "dict":
            return {"hidden": h, "logits": z}
        if self.returns == "tuple":
            return z, h
        return z


class FixedTask(nn.Module):
    """The reference implementation: the task (and the output) fixed by a wrapper."""

    def __init__(self, net: nn.Module, task: int, output=None) -> None:
        super().__init__()
        self.net, self.task, self.output = net, task, output

    def forward(self, x):
        out = self.net(x, self.task)
        return out if self.output is None else out[self.output]


def _model(returns: str = "tensor", seed: int = 0) -> MultiHead:
    torch.manual_seed(seed)
    return MultiHead(returns=returns).to(DTYPE)


def _data(n: int = 40, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, 5, dtype=DTYPE, generator=torch.Generator().manual_seed(seed))


def _round_trip(estimator: fsd.Estimator, tmp_path: Path) -> fsd.Estimator:
    path = tmp_path / "summary.pt"
    estimator.save(path)
    return fsd.load(path)


# ----- forward_kwargs: one head per task, against a wrapper with the task fixed ---------

@pytest.mark.parametrize("name", ESTIMATORS)
def test_forward_kwargs_give_exactly_the_wrappers_distance(name, tmp_path):
    model, x = _model(), _data()
    moved = perturbed(model)
    for task in (0, 2):
        summary = ESTIMATORS[name]().fit(model, x, forward_kwargs={"task": task})
        reference = ESTIMATORS[name]().fit(FixedTask(model, task), x)
        expected = reference.distance(FixedTask(moved, task))
        assert torch.equal(summary.distance(moved), expected)
        # the file keeps the call: the loaded summary calls the same head
        loaded = _round_trip(summary, tmp_path)
        assert loaded._meta["forward_kwargs"] == {"task": task}
        assert torch.equal(loaded.distance(moved), expected)
        # and the gradients are those of the wrapper's distance (fresh copies of both, so
        # BGLN-S draws the same samples)
        grads = torch.autograd.grad(_round_trip(summary, tmp_path).distance(moved),
                                    list(moved.parameters()), allow_unused=True)
        wrapped = FixedTask(moved, task)
        ref_grads = torch.autograd.grad(
            ESTIMATORS[name]().fit(FixedTask(model, task), x).distance(wrapped),
            list(moved.parameters()), allow_unused=True)
        for g, r in zip(grads, ref_grads, strict=True):
            assert (g is None and r is None) or (g is not None and r is not None
                                                 and torch.allclose(g, r, atol=1e-13))


def test_exact_fsd_with_forward_kwargs_is_its_formula_on_that_head():
    model, x = _model(), _data()
    moved = perturbed(model)
    summary = fsd.ExactFSD().fit(model, x, forward_kwargs={"task": 1})
    with torch.no_grad():
        truth = 0.5 * (moved(x, 1) - model(x, 1)).pow(2).sum(1).mean()
    assert torch.allclose(summary.distance(moved), truth, rtol=1e-13, atol=0)
    # another task's head moving does not move this task's function
    only_other_head = copy.deepcopy(model)
    with torch.no_grad():
        only_other_head.heads[2].weight.add_(1.0)
    assert float(summary.distance(only_other_head)) == 0.0


def test_a_forward_that_needs_an_argument_says_to_pass_forward_kwargs():
    with pytest.raises(ValueError, match=r"pass forward_kwargs= to fit") as info:
        fsd.NTK().fit(_model(), _data())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"task": (1, 2)}, "read back unchanged"),
    ({"task": torch.tensor(1)}, "read back unchanged"),
    ({"task": math.nan}, "read back unchanged"),
    ({1: 2}, "argument names"),
    ([("task", 1)], "dict of keyword arguments"),
])
def test_forward_kwargs_that_a_file_cannot_keep_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fsd.ExactFSD().fit(_model(), _data(), forward_kwargs=kwargs)


def test_wrong_forward_kwargs_are_named_in_the_error():
    with pytest.raises(ValueError, match=r"cannot run.*forward_kwargs=\{'tsk': 1\}"):
        fsd.ExactFSD().fit(_model(), _data(), forward_kwargs={"tsk": 1})


# ----- dict and tuple outputs -----------------------------------------------------------

@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("returns, output", [("dict", "logits"), ("tuple", 0)])
def test_output_picks_a_dict_key_or_tuple_item_like_a_wrapper(name, returns, output):
    model, x = _model(returns), _data()
    moved = perturbed(model)
    summary = ESTIMATORS[name]().fit(model, x, output=output, forward_kwargs={"task": 1})
    reference = ESTIMATORS[name]().fit(FixedTask(model, 1, output), x)
    assert torch.equal(summary.distance(moved), reference.distance(FixedTask(moved, 1, output)))


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("returns, found", [("dict", r"dict with keys \['hidden', 'logits'\]"),
                                            ("tuple", "tuple of 2")])
def test_a_non_tensor_output_is_refused_at_fit_naming_what_it_found(name, returns, found):
    with pytest.raises(ValueError, match=f"returns a {found}, not a tensor: pass output=") \
            as info:
        ESTIMATORS[name]().fit(_model(returns), _data(), forward_kwargs={"task": 0})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("returns, output, message", [
    ("dict", "probs", r"output='probs' is not an output.*e.g. output='hidden'"),
    ("tuple", 5, r"output=5 is not an output.*index 0..1"),
    ("tuple", "logits", "is not an output"),
    ("tensor", "logits", "returns a tensor: leave output=None"),
])
def test_an_output_the_model_does_not_have_is_refused_at_fit(returns, output, message):
    with pytest.raises(ValueError, match=message):
        fsd.LAFTR().fit(_model(returns), _data(), output=output, forward_kwargs={"task": 0})


@pytest.mark.parametrize("output", [1.5, True, -1, ["logits"]])
def test_output_must_be_a_key_or_an_index(output):
    with pytest.raises(ValueError, match="output must be None"):
        fsd.ExactFSD().fit(_model("dict"), _data(), output=output, forward_kwargs={"task": 0})


def test_outputs_selects_units_of_the_chosen_output():
    model, x = _model("dict"), _data()
    moved = perturbed(model)
    summary = fsd.ExactFSD().fit(model, x, output="logits", forward_kwargs={"task": 0},
                                 outputs=[0, 2])
    with torch.no_grad():
        truth = 0.5 * (moved(x, 0)["logits"] - model(x, 0)["logits"])[:, [0, 2]].pow(2) \
            .sum(1).mean()
    assert torch.allclose(summary.distance(moved), truth, rtol=1e-13, atol=0)


# ----- the call is part of the checked file ---------------------------------------------

def _resigned(payload: dict, meta: dict) -> dict:
    """``payload`` with ``meta`` replaced and its checksums recomputed (a consistent file)."""
    payload = dict(payload, meta=json.dumps(meta))
    payload["checksums"] = payload_checksums(payload["estimator"], payload["config"],
                                             payload["meta"], payload["tensors"])
    return payload


@pytest.mark.parametrize("field, value, message", [
    ("output", 1.5, "meta 'output'"),
    ("output", True, "meta 'output'"),
    ("forward_kwargs", [1], "meta 'forward_kwargs'"),
    ("forward_kwargs", {}, "meta 'forward_kwargs'"),
    ("forward_kwargs", {"not a name": 1}, "meta 'forward_kwargs'"),
])
def test_load_refuses_a_malformed_call(field, value, message):
    payload = fsd.ExactFSD().fit(_model(), _data(), forward_kwargs={"task": 0}).to_payload()
    meta = dict(json.loads(payload["meta"]), **{field: value})
    with pytest.raises(SummaryFormatError, match=message):
        from_payload(_resigned(payload, meta))


def test_a_changed_call_without_new_checksums_is_damage():
    payload = fsd.ExactFSD().fit(_model(), _data(), forward_kwargs={"task": 0}).to_payload()
    meta = dict(json.loads(payload["meta"]), forward_kwargs={"task": 1})
    with pytest.raises(SummaryFormatError, match="checksum"):
        from_payload(dict(payload, meta=json.dumps(meta)))


def test_plain_summaries_record_no_call():
    payload = fsd.ExactFSD().fit(_model("tensor"), _data(), forward_kwargs={"task": 0}
                                 ).to_payload()
    assert json.loads(payload["meta"])["forward_kwargs"] == {"task": 0}
    plain = fsd.ExactFSD().fit(nn.Linear(5, 2).to(DTYPE), _data()).to_payload()
    assert not {"output", "forward_kwargs"} & set(json.loads(plain["meta"]))


@pytest.mark.parametrize("name", ["ExactFSD", "LAFTR", "BGLN-D", "KFAC", "EWC", "NTK"])
def test_files_written_before_output_and_forward_kwargs_load_and_agree(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    x = torch.randn(24, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    makers = {"ExactFSD": fsd.ExactFSD(), "LAFTR": fsd.LAFTR(coreset_size=8),
              "BGLN-D": fsd.BGLN(deterministic=True, moments="exact", covariance="full"),
              "KFAC": fsd.KFAC(), "EWC": fsd.EWC(), "NTK": fsd.NTK(coreset_size=8)}
    old = fsd.load(OLD_FILES / f"{name}.pt")
    fresh = makers[name].fit(model, x)
    # the same metadata, but for the evaluator's name, which BGLN-D summaries record since
    # (the old file's walk is read from its configuration: fsd.moments.evaluators.recorded)
    fresh_meta = json.loads(fresh.to_payload()["meta"])
    if fresh_meta.pop("evaluator", None) is not None:
        assert old._evaluator.name == fresh._evaluator.name
    assert fresh_meta == json.loads(from_payload(old.to_payload()).to_payload()["meta"])
    moved = perturbed(model)
    # equal up to the last bits: the old files were written on another CPU, whose vector width
    # orders float64 reductions differently (one ulp seen between AVX2- and AVX-512 machines)
    torch.testing.assert_close(old.distance(moved), fresh.distance(moved), rtol=1e-14, atol=0)


# ----- unused parameters (other tasks' heads) -------------------------------------------

@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("how", ["forward_kwargs", "wrapper"])
def test_unused_heads_survive_save_and_load(name, how, tmp_path):
    model, x = _model(), _data()
    moved = perturbed(model)
    if how == "wrapper":
        fitted = ESTIMATORS[name]().fit(FixedTask(model, 1), x)
        call = FixedTask(moved, 1)
    else:
        fitted = ESTIMATORS[name]().fit(model, x, forward_kwargs={"task": 1})
        call = moved
    loaded = _round_trip(fitted, tmp_path)
    # θ0 of every head is kept, used or not: the reference network can be rebuilt whole
    state = loaded.reference_state_dict()
    assert len(state) == len(model.state_dict())
    assert any("heads.0." in k for k in state) and any("heads.2." in k for k in state)
    assert torch.equal(loaded.distance(call), fitted.distance(call))


# ----- integer inputs (token ids) -------------------------------------------------------

class Tokens(nn.Module):
    """Token ids → embedding → ReLU → linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.out = nn.Linear(12, 3)

    def forward(self, ids):
        return self.out(torch.relu(self.embed(ids)).flatten(1))


class OneHot(nn.Module):
    """The same network on one-hot float inputs: an Embedding is a bias-free Linear."""

    def __init__(self, tokens: Tokens) -> None:
        super().__init__()
        self.embed = nn.Linear(11, 4, bias=False).to(tokens.out.weight.dtype)
        self.out = copy.deepcopy(tokens.out)
        with torch.no_grad():
            self.embed.weight.copy_(tokens.embed.weight.T)

    def forward(self, onehot):
        return self.out(torch.relu(self.embed(onehot)).flatten(1))


def _tokens(seed: int = 0) -> tuple[Tokens, torch.Tensor]:
    torch.manual_seed(seed)
    ids = torch.randint(0, 11, (30, 3), generator=torch.Generator().manual_seed(3))
    return Tokens().to(DTYPE), ids


TOKEN_ESTIMATORS = {
    "ExactFSD": lambda: fsd.ExactFSD(),
    "NTK": lambda: fsd.NTK(coreset_size=10),
    "EWC": lambda: fsd.EWC(),
    "LAFTR": lambda: fsd.LAFTR(coreset_size=10),
    "BGLN-S-coreset": lambda: fsd.BGLN(inputs="coreset", coreset_size=10),
}


@pytest.mark.parametrize("name", TOKEN_ESTIMATORS)
def test_token_ids_give_the_one_hot_networks_distance(name, tmp_path):
    model, ids = _tokens()
    moved = perturbed(model)
    onehot = nn.functional.one_hot(ids, 11).to(DTYPE)
    summary = TOKEN_ESTIMATORS[name]().fit(model, ids)
    reference = TOKEN_ESTIMATORS[name]().fit(OneHot(model), onehot)
    expected = reference.distance(OneHot(moved))
    got = summary.distance(moved)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-15)
    assert float(expected) > 0
    loaded = _round_trip(summary, tmp_path)
    stored = [v for k, v in loaded._stored.items() if k in ("data.x", "coreset.x")]
    assert (name == "EWC") != bool(stored)  # EWC keeps a Fisher, the others the inputs
    assert all(v.dtype == torch.int64 for v in stored)  # the ids themselves, not floats
    assert torch.equal(loaded.distance(moved), got)  # (BGLN-S: its first draw, as got's)


def test_exact_fsd_on_token_ids_is_its_formula():
    model, ids = _tokens()
    moved = perturbed(model)
    with torch.no_grad():
        truth = 0.5 * (moved(ids) - model(ids)).pow(2).sum(1).mean()
    assert torch.allclose(fsd.ExactFSD().fit(model, ids).distance(moved), truth, rtol=1e-13,
                          atol=0)


def test_kfac_takes_token_ids_or_refuses_in_one_line():
    model, ids = _tokens()
    try:
        summary = fsd.KFAC().fit(model, ids)
    except ValueError as error:  # an Embedding outside K-FAC's blocks
        assert "\n" not in str(error) and "EWC" in str(error)
    else:
        assert math.isfinite(float(summary.distance(perturbed(model))))


@pytest.mark.parametrize("make", [
    lambda: fsd.LAFTR(inputs="gaussian"),
    lambda: fsd.BGLN(),
    lambda: fsd.BGLN(deterministic=True, moments="exact"),
])
def test_gaussian_input_estimators_refuse_token_ids_at_fit(make):
    model, ids = _tokens()
    with pytest.raises(ValueError, match=r"discrete \(torch.int64.*LAFTR with inputs='coreset'"
                                         r".*ExactFSD, NTK, EWC or KFAC") as info:
        make().fit(model, ids)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["ExactFSD", "LAFTR", "BGLN-S", "BGLN-D-exact"])
def test_integer_inputs_of_a_model_that_needs_floats_are_cast_as_before(name):
    # pixel bytes into a float network: every estimator cast them to the model's dtype
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2)).to(DTYPE)
    pixels = torch.randint(0, 4, (30, 5), generator=torch.Generator().manual_seed(4))
    moved = perturbed(model)
    from_ints = ESTIMATORS[name]().fit(model, [(pixels, torch.zeros(30))]).distance(moved)
    from_floats = ESTIMATORS[name]().fit(model, pixels.to(DTYPE)).distance(moved)
    assert torch.equal(from_ints, from_floats)


# ----- the regularizer and fsd.combine --------------------------------------------------

def test_regularizer_calls_each_tasks_head_through_save_and_load(tmp_path):
    model = _model()
    tasks = [_data(seed=10 + t) for t in range(3)]
    make = lambda: fsd.BGLN(deterministic=True, moments="exact", covariance="full")  # noqa: E731
    reg = fsd.ContinualRegularizer(make)
    snapshots = []
    for t, x in enumerate(tasks):
        with torch.no_grad():  # "training" on task t: the body and head t move
            for p in list(model.body.parameters()) + list(model.heads[t].parameters()):
                p.add_(0.05 * torch.randn(p.shape, dtype=p.dtype,
                                          generator=torch.Generator().manual_seed(t)))
        reg.end_task(model, x, forward_kwargs={"task": t})
        snapshots.append(copy.deepcopy(model))
        reg.save(tmp_path / "reg.pt")
        reg = fsd.ContinualRegularizer.load(tmp_path / "reg.pt", make)
    moved = perturbed(model)
    expected = sum(make().fit(FixedTask(s, t), x).distance(FixedTask(moved, t))
                   for t, (s, x) in enumerate(zip(snapshots, tasks, strict=True)))
    assert torch.allclose(reg.penalty(moved), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("moments", ["paper", "exact"])
def test_combine_batches_summaries_per_call(moments):
    model = _model()
    moved = perturbed(model)
    summaries = [fsd.BGLN(deterministic=True, moments=moments, covariance="full").fit(
        model, _data(seed=20 + i), forward_kwargs={"task": t})
        for i, t in enumerate([0, 1, 0, 2, 1])]
    separate = sum(s.distance(moved) for s in summaries)
    combined = fsd.combine(summaries).distance(moved)
    assert torch.allclose(combined, separate, rtol=1e-12, atol=0)


def test_calibrate_measures_the_summarys_own_head():
    model, x = _model("dict"), _data()
    moved = perturbed(model)
    summary = fsd.LAFTR(coreset_size=None).fit(model, x, output="logits",
                                               forward_kwargs={"task": 2})
    result = fsd.calibrate(summary, model, x, moved=[moved])
    with torch.no_grad():
        truth = 0.5 * (moved(x, 2)["logits"] - model(x, 2)["logits"]).pow(2).sum(1).mean()
    assert result.exact[0] == pytest.approx(float(truth), rel=1e-12)
    assert result.estimates[0] == pytest.approx(float(summary.distance(moved)), rel=1e-12)


def test_bind_shares_the_models_parameters_and_names():
    model = _model("dict")
    view = bind(model, "logits", {"task": 1})
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert bind(model, "logits", {"task": 1}) is view  # one view per call: traces are cached
    assert bind(model) is model
    x = _data(4)
    assert torch.equal(view(x), model(x, 1)["logits"])
    with torch.no_grad():
        model.heads[1].bias.add_(1.0)
    assert torch.equal(view(x), model(x, 1)["logits"])


def test_the_user_guides_multi_head_example_runs(tmp_path, monkeypatch, capsys):
    text = (Path(__file__).resolve().parents[1] / "docs" / "user-guide.md").read_text()
    section = text[text.index("### Models with several heads, dict outputs, token inputs"):]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None
    monkeypatch.chdir(tmp_path)  # the example writes reg.fsd
    exec(compile(match.group(1), "user-guide", "exec"), {"__name__": "user_guide_example"})
    lines = dict(line.split() for line in capsys.readouterr().out.splitlines())
    assert float(lines["penalty"]) == 0.0 and float(lines["ntk"]) == 0.0
    assert (tmp_path / "reg.fsd").exists()
