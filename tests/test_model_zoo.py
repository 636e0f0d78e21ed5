"""Real users' models × the estimators of the docs table.

The models (``tests/zoo_models.py``) are written the way their sources write them. Every cell
of model × estimator is either refused at ``fit`` in one line naming an alternative, or its
distance is checked against a brute force, on float64 models moved by N(0, 0.05²) noise:

- ExactFSD: its formula, the mean over the data of ½‖f(x, θ) − f(x, θ0)‖² (the default
  Euclidean metric of ``fsd.metrics``).
- NTK (all inputs as the coreset): ½ mean ‖J(x, θ0) Δθ‖² with J the dense per-example
  Jacobian by reverse mode (to round-off).
- LAFTR (all inputs as the coreset): the same first-order brute force, which LAFTR matches to
  first order in Δθ — checked at Δθ of 1e-4 and 1e-5 (relative error below 3e-3 and
  shrinking with Δθ).
- BGLN-S and BGLN-D with exact moments, where both run: BGLN-S's Monte Carlo mean within 5
  standard errors of BGLN-D exact. Where BGLN-D exact refuses the model, BGLN-S gets the
  generic checks below only (no brute force exists for it there).
- BGLN-D corrected (``moments="corrected"``): BGLN-S's Monte Carlo mean within 10 % (the
  approximation's) plus 5 standard errors, or the measured gap where the two model max-pools
  differently (:data:`CORRECTED_GAP`).
- BGLN-D (Algorithm 2): ``fsd.testing.dense_algorithm2_cnn``, the dense transcription, with
  the summary's moments and gate frequencies.
- EWC: ½ Σ diag(F) Δθ² with F the dense Gauss–Newton matrix E[JᵀJ] of the data.
- KFAC: its definition from hooks and the dense Jacobian — per ``Linear``/``Conv1d``/``Conv2d``
  Kronecker block ½ tr(ΔW̄ᵀ G ΔW̄ A) with A = E[Σ_t ā_t ā_tᵀ], G = E[(1/T) Σ_t Σ_k g_kt g_ktᵀ]
  (patches by ``F.unfold``), and ½ Σ D ⊙ Δp² with D the dense Gauss–Newton diagonal for
  every parameter in ``diagonal_parameters``.

Every cell that fits also checks: finite and ≥ 0, zero at θ0, save → ``fsd.load`` → the same
distance, and ``distance(...).backward()`` giving finite gradients. :data:`EXPECTED` is the
table of docs/user-guide.md ("Which estimators take which models"), which
``benchmarks/model_zoo.py --markdown`` prints from the same cells.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import fsd
import zoo_models as zoo
from conftest import perturbed
from fsd.model.rules import UnsupportedModuleError
from fsd.testing import dense_algorithm2_cnn

pytestmark = pytest.mark.usefixtures("single_thread")

DTYPE = zoo.DTYPE
SCALE = 0.05
DOCS = Path(__file__).resolve().parents[1] / "docs" / "user-guide.md"

# ----------------------------------------------------------------------------------------
# the table: model -> estimator -> "✓" or "refused: <message>"
# ----------------------------------------------------------------------------------------
_ALL = "✓"
# the advice of fsd.model.support's table, as the refusals end
_GRAPH = "BGLN-S or LAFTR on any graph torch.fx traces, or ExactFSD, NTK, EWC or KFAC on any model"
_CORRECTED = ("BGLN-D with moments='corrected' on chains and residual graphs of layers with rules "
              "(CNNs too), ")
_TOKENS = ("refused: BGLN with inputs='gaussian' fits a Gaussian to the inputs, and these are "
           "discrete (torch.int64, e.g. token ids): use BGLN-S with inputs='coreset' or LAFTR "
           "with inputs='coreset' on any graph torch.fx traces, or ExactFSD, NTK, EWC or KFAC "
           "on any model")
_EXACT_CNN = ("refused: BGLN-D with moments='exact' is implemented for MLPs only: on layers "
              "over images or sequences (inputs that are not flat vectors) it would carry "
              "(C·H·W)² second moments; use BGLN-D with moments='paper' (Algorithm 2) on chains "
              "of layers with rules (CNNs too), " + _CORRECTED + _GRAPH)


def _flat(shape: str) -> str:
    return (f"refused: BGLN-D on a graph that is not a chain needs flat inputs (got examples of "
            f"shape {shape}); use {_CORRECTED}{_GRAPH}")


def _not_chain(model: str, reads: str, previous: str) -> str:
    return (f"refused: {model}.forward is not a chain of layers at graph node 'add' (add): it "
            f"reads {reads} instead of the previous step '{previous}'. BGLN-D with "
            f"moments='paper' (Algorithm 2) takes chains of layers with rules (CNNs too); use "
            f"BGLN-D with moments='exact' on MLP chains and graphs of flat layers, "
            f"{_CORRECTED}{_GRAPH}")


def _no_rule(operation: str, kind: str, model: str) -> str:
    return (f"refused: operation {operation} ({kind}) at graph node '{operation}' of "
            f"{model}.forward has no rule; BGLN-D supports the modules of fsd.model.rules.RULES, "
            f"their functional forms (F.relu, F.leaky_relu, F.gelu, torch.tanh, …) and "
            f"flattening. Use the module form (e.g. nn.ReLU()), register a rule for a module "
            f"that does it (fsd.register_rule), or use {_GRAPH}")


_PARAMETRIZED = ("refused: module ParametrizedLinear at '0' has no rule, so BGLN-D cannot walk "
                 "it (rules: AvgPool2d, BatchNorm1d, BatchNorm2d, Conv2d, Dropout, ELU, Flatten, "
                 "GELU, Identity, LeakyReLU, Linear, MaxPool2d, ReLU, SiLU, Sigmoid, Softplus, "
                 "Tanh, Sequential); add a rule with fsd.register_rule, or use " + _GRAPH)
_PARAMETRIZED_EXACT = ("refused: BGLN-D with exact moments on a graph: ParametrizedLinear has "
                       "parameters or buffers but no affine rule at graph node '_0' "
                       "(call_module 0); use " + _GRAPH)


def _corrected(why: str, node: str, call: str) -> str:
    return (f"refused: BGLN-D with moments='corrected' on a graph: {why} at graph node '{node}' "
            f"({call}); use {_GRAPH}")


_CORRECTED_TRANSPOSE = _corrected("an operation without a squared map (not in the table of "
                                  "linear operations)", "transpose", "call_method transpose")
_CORRECTED_PARAMETRIZED = _corrected("ParametrizedLinear has parameters but no affine rule", "_0",
                                     "call_module 0")


def _row(**refused: str) -> dict[str, str]:
    keys = {"BGLN_S": "BGLN-S", "BGLN_D": "BGLN-D", "BGLN_D_exact": "BGLN-D exact",
            "BGLN_D_corrected": "BGLN-D corrected"}
    row = {name: _ALL for name in zoo.ESTIMATORS}
    for key, cell in refused.items():
        row[keys.get(key, key)] = cell
    return row


EXPECTED: dict[str, dict[str, str]] = {
    "mlp": _row(),
    "cnn": _row(BGLN_D_exact=_EXACT_CNN),
    "resnet18": _row(BGLN_D=_not_chain("ResNet18", "layer1_0_bn2, maxpool", "layer1_0_bn2"),
                     BGLN_D_exact=_flat("(3, 16, 16)")),
    "preact-resnet": _row(BGLN_D=_not_chain("PreActResNet", "layer1_conv2, conv1",
                                            "layer1_conv2"),
                          BGLN_D_exact=_flat("(3, 8, 8)")),
    "multihead-resnet": _row(BGLN_D=_not_chain("MultiHeadResNet", "body_layer1_conv2, body_conv1",
                                               "body_layer1_conv2"),
                             BGLN_D_exact=_flat("(3, 8, 8)")),
    "vit": _row(BGLN_D=_no_rule("flatten", "call_method", "ViT"),
                BGLN_D_exact=_flat("(3, 8, 8)"), BGLN_D_corrected=_CORRECTED_TRANSPOSE),
    "transformer-encoder": _row(BGLN_D=_no_rule("mean", "call_method", "SequenceTransformer"),
                                BGLN_D_exact=_flat("(5, 4)"),
                                BGLN_D_corrected=_corrected(
                                    "TransformerEncoder has parameters but no affine rule",
                                    "encoder", "call_module encoder")),
    "mlp-mixer": _row(BGLN_D=_no_rule("flatten", "call_method", "Mixer"),
                      BGLN_D_exact=_flat("(3, 8, 8)"), BGLN_D_corrected=_CORRECTED_TRANSPOSE),
    "lstm-text": _row(BGLN_S=_TOKENS, BGLN_D=_no_rule("getitem", "call_function", "RNNClassifier"),
                      BGLN_D_exact=_TOKENS, BGLN_D_corrected=_TOKENS),
    "gru-text": _row(BGLN_S=_TOKENS, BGLN_D=_no_rule("getitem", "call_function", "RNNClassifier"),
                     BGLN_D_exact=_TOKENS, BGLN_D_corrected=_TOKENS),
    "conv1d": _row(BGLN_D=_no_rule("mean", "call_method", "Conv1dNet"),
                   BGLN_D_exact=_flat("(2, 8)"),
                   BGLN_D_corrected=_corrected("Conv1d has parameters but no affine rule",
                                               "conv1", "call_module conv1")),
    "dict-output": _row(),
    "weight-norm-mlp": _row(BGLN_D=_PARAMETRIZED, BGLN_D_exact=_PARAMETRIZED_EXACT,
                            BGLN_D_corrected=_CORRECTED_PARAMETRIZED),
    "spectral-norm-mlp": _row(BGLN_D=_PARAMETRIZED, BGLN_D_exact=_PARAMETRIZED_EXACT,
                              BGLN_D_corrected=_CORRECTED_PARAMETRIZED),
    "compiled-mlp": _row(),
    "ddp-cnn": _row(BGLN_D_exact=_EXACT_CNN),
}

# cells whose check fails for a defect not fixed here: (model, estimator) -> the defect
XFAIL: dict[tuple[str, str], str] = {}

# the words of a refusal that name another way to measure the model
ALTERNATIVES = ("ExactFSD", "LAFTR", "BGLN-S", "deterministic=False", "NTK", "EWC", "KFAC",
                "moments='paper'", "register_rule")


def test_the_table_covers_every_model_and_estimator():
    assert list(EXPECTED) == list(zoo.MODELS)
    assert all(list(row) == list(zoo.ESTIMATORS) for row in EXPECTED.values())
    assert len(EXPECTED) >= 15


def test_the_docs_table_is_the_scripts():
    text = DOCS.read_text()
    start = text.index("<!-- model-zoo table: begin -->")
    end = text.index("<!-- model-zoo table: end -->")
    table = text[start:end].split("\n", 1)[1]
    assert table.strip() == zoo.markdown(EXPECTED).strip(), (
        "regenerate it with: python benchmarks/model_zoo.py --markdown")


# ----------------------------------------------------------------------------------------
# brute forces
# ----------------------------------------------------------------------------------------
def _forward(model: nn.Module, name: str, x: torch.Tensor,
             state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The output the zoo entry measures, written out: forward(x, **kwargs)[output]."""
    call = zoo.MODELS[name].call
    kwargs = call.get("forward_kwargs", {})
    out = model(x, **kwargs) if state is None else functional_call(model, state, (x,), kwargs)
    return out if call.get("output") is None else out[call["output"]]


_JACOBIANS: dict[str, torch.Tensor] = {}


def _jacobian(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(examples, outputs, parameters): per-example rows by reverse mode, one output at a time."""
    if name not in _JACOBIANS:
        params = [p for _, p in model.named_parameters()]
        rows = []
        for i in range(len(x)):
            z = _forward(model, name, x[i:i + 1])[0]
            per_output = []
            for j in range(z.shape[0]):
                grads = torch.autograd.grad(z[j], params, retain_graph=True, allow_unused=True)
                per_output.append(torch.cat([
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for g, p in zip(grads, params, strict=True)]))
            rows.append(torch.stack(per_output))
        _JACOBIANS[name] = torch.stack(rows).detach()
    return _JACOBIANS[name]


def _delta(model: nn.Module, moved: nn.Module) -> dict[str, torch.Tensor]:
    moved_params = dict(moved.named_parameters())
    return {n: (moved_params[n] - p).detach() for n, p in model.named_parameters()}


def _flat_delta(model: nn.Module, moved: nn.Module) -> torch.Tensor:
    return torch.cat([d.reshape(-1) for d in _delta(model, moved).values()])


def _split(model: nn.Module, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for n, p in model.named_parameters():
        out[n] = vector[start:start + p.numel()].reshape(p.shape)
        start += p.numel()
    return out


def _first_order(name: str, model: nn.Module, moved: nn.Module, x: torch.Tensor
                 ) -> torch.Tensor:
    dz = _jacobian(name, model, x) @ _flat_delta(model, moved)
    return 0.5 * dz.pow(2).sum(-1).mean()


def _exact(name: str, model: nn.Module, moved: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return 0.5 * (_forward(moved, name, x) - _forward(model, name, x)).pow(2).sum(-1).mean()


def _gauss_newton_diagonal(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _jacobian(name, model, x).pow(2).sum(1).mean(0)  # H = I: Σ over outputs


def _ewc(name: str, model: nn.Module, moved: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (_gauss_newton_diagonal(name, model, x) * _flat_delta(model, moved) ** 2).sum()


def _patches(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """(examples, fan_in + 1, locations): the bias-augmented inputs of every output location."""
    if isinstance(module, nn.Linear):
        rows = a.unsqueeze(-1)
    else:
        if isinstance(module, nn.Conv1d):
            a = a.unsqueeze(2)
            kernel, dilation = (1, module.kernel_size[0]), (1, module.dilation[0])
            padding, stride = (0, module.padding[0]), (1, module.stride[0])  # type: ignore[index]
        else:
            kernel, dilation = module.kernel_size, module.dilation  # type: ignore[assignment]
            padding, stride = module.padding, module.stride  # type: ignore[assignment]
        rows = F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)
    ones = torch.ones(rows.shape[0], 1, rows.shape[2], dtype=rows.dtype)
    return torch.cat([rows, ones], dim=1)


def _kfac(name: str, est: fsd.KFAC, model: nn.Module, moved: nn.Module, x: torch.Tensor
          ) -> torch.Tensor:
    diagonal = set(est.diagonal_parameters)
    delta = _delta(model, moved)
    gn = _split(model, _gauss_newton_diagonal(name, model, x))
    total = sum(0.5 * (gn[n] * delta[n] ** 2).sum() for n in diagonal)
    blocks = {path: m for path, m in model.named_modules()
              if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))
              and f"{path}.weight" in delta and f"{path}.weight" not in diagonal}
    seen: dict[str, list[torch.Tensor]] = {}

    def record(path: str):
        def hook(module, args, output):
            seen[path] = [args[0].detach(), output]
            return output.clone()  # in-place operations after the layer act on the copy
        return hook

    handles = [m.register_forward_hook(record(p)) for p, m in blocks.items()]
    try:
        z = _forward(model, name, x)
    finally:
        for handle in handles:
            handle.remove()
    outputs = [seen[p][1] for p in blocks]
    # Euclidean metric: H = I, factors h_k = e_k; rows of one example depend on it alone
    grads = [torch.autograd.grad(z[:, k].sum(), outputs, retain_graph=True)
             for k in range(z.shape[1])] if outputs else []
    for index, (path, module) in enumerate(blocks.items()):
        abar = _patches(module, seen[path][0])  # (n, fan_in + 1, T)
        locations = abar.shape[2]
        a_factor = torch.einsum("nit,njt->ij", abar, abar) / len(x)
        g_factor = sum(torch.einsum("nit,njt->ij", g[index].reshape(len(x), g[index].shape[1], -1),
                                    g[index].reshape(len(x), g[index].shape[1], -1))
                       for g in grads) / (len(x) * locations)
        dw = delta[f"{path}.weight"].reshape(module.weight.shape[0], -1)
        db = delta.get(f"{path}.bias", torch.zeros(dw.shape[0], dtype=dw.dtype))
        dwbar = torch.cat([dw, db.unsqueeze(1)], dim=1)
        total = total + 0.5 * torch.trace(dwbar.T @ g_factor @ dwbar @ a_factor)
    return torch.as_tensor(total)


def _algorithm2(est: fsd.BGLN, model: nn.Module, moved: nn.Module, x: torch.Tensor
                ) -> torch.Tensor:
    """BGLN-D (Algorithm 2) by the dense transcription, with the summary's moments."""
    layers, moved_layers = fsd.trace(est.bind(model)), fsd.trace(est.bind(moved))
    chain0 = nn.Sequential(*[layer.module for layer in layers])
    chain1 = nn.Sequential(*[layer.module for layer in moved_layers])
    stored = est._gate_means()
    cov = est.input_covariance()
    total = torch.zeros((), dtype=DTYPE)
    for group, weight in enumerate(est._state["weights"]):
        gates = []
        for layer in layers:
            if isinstance(layer.rule, fsd.GateRule):
                moments = layer.rule.gate_moments(layer.module, stored[layer.path][group])
                gates.append((moments.reference_mean, moments.delta_mean, moments.offset))
        routings = [est._state[f"routing.{layer.path}"][group] for layer in layers
                    if isinstance(layer.rule, fsd.MaxPoolRule)]
        total = total + weight * dense_algorithm2_cnn(
            chain0, chain1, tuple(x.shape[1:]), est._state["input.mean"][group], cov[group],
            gates, routings)
    return total


def _shifted(model: nn.Module, scale: float) -> nn.Module:
    return zoo.moved(model, scale)


def _check_brute_force(name: str, estimator: str, est: fsd.Estimator, model: nn.Module,
                       moved: nn.Module, wrapped_moved: nn.Module, x: torch.Tensor,
                       distance: torch.Tensor) -> None:
    value = distance.detach()
    if estimator == "ExactFSD":
        torch.testing.assert_close(value, _exact(name, model, moved, x), rtol=1e-10, atol=0)
    elif estimator == "NTK":
        torch.testing.assert_close(value, _first_order(name, model, moved, x),
                                   rtol=1e-9, atol=0)
    elif estimator == "LAFTR":
        errors = []
        for scale in (1e-4, 1e-5):
            small = _shifted(model, scale)
            errors.append(abs(float(est.distance(small)) /
                              float(_first_order(name, model, small, x)) - 1))
        assert errors[0] < 3e-3, errors
        assert errors[1] < max(errors[0] / 4, 1e-9), errors  # first order: error ∝ Δθ
    elif estimator == "EWC":
        torch.testing.assert_close(value, _ewc(name, model, moved, x), rtol=1e-9, atol=0)
    elif estimator == "KFAC":
        assert isinstance(est, fsd.KFAC)
        torch.testing.assert_close(value, _kfac(name, est, model, moved, x).detach(),
                                   rtol=1e-9, atol=0)
    elif estimator == "BGLN-D":
        assert isinstance(est, fsd.BGLN)
        with torch.no_grad():
            torch.testing.assert_close(value, _algorithm2(est, model, moved, x),
                                       rtol=1e-9, atol=0)
    elif estimator == "BGLN-D corrected" and EXPECTED[name]["BGLN-S"] == _ALL:
        _check_corrected(name, model, wrapped_moved, x, value)
    elif estimator in ("BGLN-S", "BGLN-D exact") and EXPECTED[name]["BGLN-D exact"] == _ALL \
            and EXPECTED[name]["BGLN-S"] == _ALL:
        other = "BGLN-D exact" if estimator == "BGLN-S" else "BGLN-S"
        pair = {estimator: est, other: zoo.ESTIMATORS[other]().fit(
            model, x, **zoo.MODELS[name].call)}
        exact = pair["BGLN-D exact"].distance(moved).detach()
        with torch.no_grad():
            draws = torch.stack([pair["BGLN-S"].distance(wrapped_moved) for _ in range(12)])
        mean, error = draws.mean(), draws.std() / math.sqrt(len(draws))
        assert float((mean - exact).abs()) < 5 * float(error), (float(mean), float(exact))


#: BGLN-D corrected against BGLN-S's Monte Carlo mean: the corrected recursion's approximation
#: (relative gaps measured at 12 × 1000 samples: mlp −0.6 %, resnet18 +1.7 %, preact-resnet
#: −0.2 %, multihead-resnet +0.2 %), except where the two model different things: on the CNN a
#: ReLU feeds a MaxPool2d, whose routing BGLN-D draws independently of the gates by the stored
#: frequencies and BGLN-S takes at the argmax of the gated values (measured +71 %)
CORRECTED_GAP = {"cnn": 0.8, "ddp-cnn": 0.8}


def _check_corrected(name: str, model: nn.Module, wrapped_moved: nn.Module,
                     x: torch.Tensor, value: torch.Tensor) -> None:
    sampled = zoo.ESTIMATORS["BGLN-S"]().fit(model, x, **zoo.MODELS[name].call)
    with torch.no_grad():
        draws = torch.stack([sampled.distance(wrapped_moved) for _ in range(12)])
    mean, error = float(draws.mean()), float(draws.std()) / math.sqrt(len(draws))
    tolerance = CORRECTED_GAP.get(name, 0.10) * mean + 5 * error
    assert abs(float(value) - mean) < tolerance, (float(value), mean, error)


# ----------------------------------------------------------------------------------------
# the cells
# ----------------------------------------------------------------------------------------
def _cells():
    for name in zoo.MODELS:
        for estimator in zoo.ESTIMATORS:
            marks = []
            if (name, estimator) in XFAIL:
                marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[name, estimator]))
            yield pytest.param(name, estimator, marks=marks, id=f"{name}-{estimator}")


@pytest.mark.parametrize(("name", "estimator"), list(_cells()))
def test_cell(name, estimator, tmp_path):
    model, x = zoo.build(name)
    moved = zoo.moved(model, SCALE)
    expected = EXPECTED[name][estimator]
    with zoo.wrapped(name, model, moved) as (wrapped_model, wrapped_moved):
        est, error = zoo.fit(estimator, wrapped_model, name, x)
        assert zoo.outcome(error) == expected
        if error is not None:
            assert isinstance(error, (ValueError, UnsupportedModuleError, NotImplementedError))
            assert "\n" not in str(error)
            assert any(word in str(error) for word in ALTERNATIVES), str(error)
            return
        assert est is not None
        distance = est.distance(wrapped_moved)  # the first call (BGLN-S: the first draws)
        assert torch.isfinite(distance) and float(distance.detach()) > 0
        est.save(tmp_path / "summary.pt")
        loaded = fsd.load(tmp_path / "summary.pt")
        torch.testing.assert_close(loaded.distance(wrapped_moved), distance, rtol=1e-12, atol=0)
        distance.backward()
        grads = [p.grad for p in moved.parameters()]
        assert all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)
        assert float(est.distance(wrapped_model).detach().abs()) < 1e-12  # zero at θ0
        _check_brute_force(name, estimator, est, model, moved, wrapped_moved, x, distance)


# ----------------------------------------------------------------------------------------
# ContinualRegularizer on the multi-head ResNet, three tasks of its own data
# ----------------------------------------------------------------------------------------
def _task_data(task: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(40 + task)
    y = torch.randint(0, 2, (n,), generator=generator)
    x = torch.randn(n, 3, 8, 8, generator=generator, dtype=DTYPE)
    return x + (task - 1 + 0.5 * y.to(DTYPE)).view(-1, 1, 1, 1), y


@pytest.mark.parametrize("make", [lambda: fsd.LAFTR(coreset_size=None), fsd.KFAC],
                         ids=["LAFTR", "KFAC"])
def test_continual_regularizer_on_the_multi_head_resnet(make, tmp_path):
    model, _ = zoo.build("multihead-resnet")
    path = tmp_path / "regularizer.fsd"
    reg = fsd.ContinualRegularizer(make, strength=0.5)
    snapshots = []
    for task in range(3):
        x, y = _task_data(task)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(3):
            loss = F.cross_entropy(model(x, task), y) + reg.penalty(model)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        reg.end_task(model, [(x, y)], forward_kwargs={"task": task})
        snapshots.append(copy.deepcopy(model))
        reg.save(path)  # saved and loaded between tasks: the next task uses the file's
        reg = fsd.ContinualRegularizer.load(path, estimator=make)
        assert len(reg) == task + 1
    # each task's summary, fitted apart at its snapshot, measures the model with its own head
    separate = [make().fit(snapshot, [_task_data(t)], forward_kwargs={"task": t})
                for t, snapshot in enumerate(snapshots)]
    moved = perturbed(model, SCALE, seed=7)
    penalty = reg.penalty(moved)
    expected = 0.5 * sum(est.distance(moved) for est in separate)
    torch.testing.assert_close(penalty, expected, rtol=1e-10, atol=0)
    # the heads differ: task t's summary reads head t only
    distances = [float(est.distance(moved)) for est in separate]
    assert len(set(distances)) == 3 and min(distances) > 0
    penalty.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all())
               for p in (moved.heads[0].weight, moved.heads[2].weight))
    # the summary of the last task is zero at its snapshot, the others are not
    at_last = [float(est.distance(snapshots[2])) for est in separate]
    assert at_last[2] < 1e-12 and min(at_last[:2]) > 0


def test_messages_in_the_table_are_one_line_and_have_no_backticks():
    for row in EXPECTED.values():
        for cell in row.values():
            assert "\n" not in cell and "`" not in cell and "|" not in cell
            assert cell == _ALL or re.match(r"refused: \S", cell)
