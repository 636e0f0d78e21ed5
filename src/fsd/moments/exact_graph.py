"""BGLN-D with exact moments on any traced graph of flat layers: residual and branching MLPs.

:mod:`fsd.moments.exact` propagates the joint raw second moments of (a0, Δa) along a chain.
A graph with a skip connection (``x + block(x)``), a concatenation of two branches or any
other fan-out needs more: the tensors that meet at an addition are correlated, through the
input they share and through the gates upstream of it. This module keeps the joint raw
second moment of *every tensor still to be used*:

    ξ = [1; a0 and Δa of each live node],  M = E[ξ ξᵀ]  (per mixture component)

and walks the graph once in order (:func:`graph_plan`). Every operation appends its
output's coordinates to ξ and drops those of nodes no later operation reads:

- an affine layer (an :class:`~fsd.model.rules.AffineRule` whose moments are flat: Linear,
  BatchNorm1d): s0 = W0 a0 + b0, Δs = ΔW a0 + Δb + W1 Δa — rows linear in ξ, so with A the
  rows, M ← [[M, (AM)ᵀ], [AM, A M Aᵀ]];
- a parameter-free operation that is affine row by row (``+``, ``-``, ``torch.cat``,
  ``view``/``reshape``/``flatten``, slicing, scaling by a constant, Dropout and Identity at
  evaluation, …): its Jacobian is read off at fit by evaluating it on basis rows, and its
  affinity is checked on random rows; a0 and Δa map by it like an affine layer;
- an activation BGLN gates (:func:`fsd.model.plan.gate_nodes`): a0 = r ⊙ s0 + φ(0), Δa = g ⊙ Δs
  with the pair (r, g) of each unit independent of everything else. Cross moments with any
  other coordinate are gated by the means E[r], E[g] (linear in ξ, as above); within the new
  block the Hadamard products E[r rᵀ] ⊙ · etc. add the gates' variances on the diagonal
  (:class:`fsd.model.rules.GateMoments`).

The result, tr(P E[Δz Δzᵀ] Pᵀ), is exact under the BGLN model with Gaussian inputs — the
expectation of BGLN-S on the same graph — and for a chain equals
:func:`fsd.moments.exact.delta_second_moment_adjoint`. The cost is that of dense products
with M, whose size is 1 + the widths of the inputs plus twice those of the live tensors:
for a chain the specialised module is faster, for graphs this is the exact answer.

Operations with parameters but no flat affine rule (LayerNorm, attention, a parameter read in
``forward``), operations that are not affine (softmax, a product of two activations) and
tensors that are not flat feature vectors (a view to an image before a convolution) raise
``NotImplementedError`` naming the graph node and the walkers that take such a model
(:func:`fsd.model.support.advice`: for non-flat tensors those that take
:attr:`~fsd.model.support.Feature.UNFLAT` graphs); BGLN-S and LAFTR take them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_flatten

from ..covariance import Covariance
from ..model import rules, support
from ..model.plan import read
from ..model.rules import AffineRule, GateRule, is_affine, is_gate
from ..model.tracing import evaluate, unwrap


@dataclass(frozen=True)
class GraphStep:
    """One operation of a :class:`GraphPlan`.

    Attributes:
        operation: ``"input"``, ``"affine"`` (a layer with an affine rule), ``"gate"`` (an
            activation BGLN gates) or ``"linear"`` (a parameter-free affine operation).
        node: the graph node's name, which later steps use to refer to its output.
        inputs: names of the data inputs whose moments it reads.
        path: ``"affine"``: the layer's module path; ``"gate"``: the path its statistics
            are stored under.
        jacobians: ``"linear"``: one (out, in) matrix per input, in the order of ``inputs``.
        constant: ``"linear"``: the output at zero inputs (out,).
        module: ``"gate"``: the activation module (for a function call such as ``F.relu``,
            the equivalent module :func:`fsd.model.plan.gate_nodes` gives).
        drop: names of nodes that no later step reads once this one has run.
    """

    operation: str
    node: str
    inputs: tuple[str, ...] = ()
    path: str = ""
    jacobians: tuple[Tensor, ...] = ()
    constant: Tensor | None = None
    module: nn.Module | None = None
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class GraphPlan:
    """The operations of a model's graph that :func:`graph_second_moment` walks, in order.

    Attributes:
        steps: the operations on data tensors, from the input to the output.
        output: the name of the node the model returns.
        output_size: its width.
    """

    steps: tuple[GraphStep, ...]
    output: str
    output_size: int


# a tensor that is not a flat feature vector, in a graph that is not a chain (the graphs
# walked here): the walkers that take both, not Algorithm 2's chains of layers
_UNFLAT_GRAPH = (support.Feature.BRANCH, support.Feature.UNFLAT)


def _refuse(node: fx.Node, why: str, *features: support.Feature) -> NotImplementedError:
    """The one-line refusal at ``node``, with the table's advice for ``features``.

    ``features``: what the model has that this walk cannot take; by default an operation
    that is not affine (:attr:`fsd.model.support.Feature.NON_AFFINE`).
    """
    features = features or (support.Feature.NON_AFFINE,)
    return NotImplementedError(
        f"BGLN-D with exact moments on a graph: {why} at graph node '{node.name}' "
        f"({node.op} {_target_name(node)}); "
        f"{support.advice(support.BGLN_D_EXACT, *features)}")


def _target_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target))


def graph_plan(model: nn.Module, reference: Mapping[str, Tensor], input_width: int,
               dtype: torch.dtype = torch.float64) -> GraphPlan:
    """Walk ``model``'s traced graph once and record what its moments need.

    Checks every operation on the data (see the module docstring) and reads the Jacobians
    of the parameter-free ones; the result depends on the architecture only, not on θ.

    Args:
        model: the network (its parameters are not read; ``reference``'s are).
        reference: θ0's parameters and buffers by name, for the layers' output widths.
        input_width: the number of input features (flat inputs only).
        dtype: the dtype the Jacobians are read and stored in.

    Raises:
        NotImplementedError: an operation this module cannot propagate, naming its node.
        UnsupportedModuleError: the forward cannot be traced.
    """
    model = unwrap(model)
    plan = read(model)
    gates = plan.gates
    modules = dict(model.named_modules())
    nodes = [step.node for step in plan.nodes]
    # a first pass on one row gives every tensor's width; the second evaluates each
    # parameter-free operation on as many rows as the widest tensor has features, so that
    # the rows can be the basis vectors
    rows = max(_widths(nodes, gates, modules, reference, input_width, dtype).values()) + 1
    last_use = {step.node: step.last_use for step in plan.nodes}
    value: dict[fx.Node, Any] = {}
    data: set[fx.Node] = set()  # floating tensors computed from the input: they carry moments
    steps: list[GraphStep] = []
    dead: list[str] = []  # moments no later step reads, dropped after the next step
    generator = torch.Generator().manual_seed(0)
    for index, node in enumerate(nodes):
        inputs = [n for n in node.all_input_nodes if n in data]
        step: GraphStep | None = None
        if node.op == "placeholder":
            if index != 0 or any(n.op == "placeholder" for n in nodes[1:]):
                raise _refuse(node, "a forward with more than one input")
            value[node] = torch.zeros(rows, input_width, dtype=dtype)
            step = GraphStep("input", node.name)
        elif node.op == "output":
            out = node.args[0]
            if not isinstance(out, fx.Node) or out not in data:
                raise _refuse(node, "an output that is not one tensor computed from the input")
            return GraphPlan(tuple(steps), out.name, value[out].shape[1])
        elif node.op == "get_attr":
            value[node] = reference[str(node.target)]
        elif not inputs:  # sizes, constants, functions of parameters: no moments
            value[node] = evaluate(node, value, modules)
        elif node in gates:
            value[node] = value[gates[node].input]
            step = GraphStep("gate", node.name, (gates[node].input.name,), gates[node].path,
                             module=gates[node].module)
        elif node.op == "call_module" and _affine(modules[str(node.target)]):
            module = modules[str(node.target)]
            if not _affine_rule(module).flat_moments(module):
                raise _refuse(node, f"{type(module).__name__} on images", *_UNFLAT_GRAPH)
            value[node] = _affine_value(node, module, reference, value, dtype)
            step = GraphStep("affine", node.name, (node.all_input_nodes[0].name,),
                             str(node.target))
        else:
            _check_parameter_free(node, modules)
            out = evaluate(node, value, modules)
            value[node] = out
            if isinstance(out, Tensor) and out.is_floating_point():
                step = _linear_step(node, inputs, value, modules, generator)
            elif any(isinstance(leaf, Tensor) for leaf in tree_flatten(out)[0]):
                # torch.chunk, split, argmax: tensors whose moments this walk does not track
                raise _refuse(node, f"an operation on the data returning "
                                    f"{type(out).__name__} rather than one floating tensor")
        if step is not None:
            out = value[node]
            if out.dim() != 2:
                raise _refuse(node, f"a tensor of shape {tuple(out.shape[1:])} per example "
                                    f"(flat feature vectors only)", *_UNFLAT_GRAPH)
            data.add(node)
        dead += [n.name for n in nodes[:index + 1] if n in data and last_use[n] == index]
        if step is not None:
            steps.append(replace(step, drop=tuple(dead)))
            dead = []
    raise AssertionError("a traced graph ends with an output node")  # pragma: no cover


def _affine_value(node: fx.Node, module: nn.Module, reference: Mapping[str, Tensor],
                  value: dict[fx.Node, Any], dtype: torch.dtype) -> Tensor:
    """An affine layer's output at the reference parameters, for a probe's shapes."""
    rule = _affine_rule(module)
    weight, bias = rule.affine_parameters(module, reference, str(node.target))
    (source,) = node.all_input_nodes
    return rule.apply(module, value[source], weight.to(dtype),
                      None if bias is None else bias.to(dtype))


def _affine_rule(module: nn.Module) -> AffineRule:
    rule = rules.RULES[type(module)]
    assert is_affine(rule), type(module).__name__  # checked by _affine
    return rule


def _gate_rule(module: nn.Module) -> GateRule:
    rule = rules.RULES[type(module)]
    assert is_gate(rule), type(module).__name__  # a gate node's module
    return rule


def _affine(module: nn.Module) -> bool:
    rule = rules.RULES.get(type(module))
    return is_affine(rule)


def _widths(nodes: list[fx.Node], gates: Mapping[fx.Node, Any],
            modules: Mapping[str, nn.Module], reference: Mapping[str, Tensor],
            input_width: int, dtype: torch.dtype) -> dict[str, int]:
    """The feature width of every floating tensor of the forward, from one zero row."""
    value: dict[fx.Node, Any] = {}
    widths: dict[str, int] = {}
    for node in nodes:
        if node.op == "output":
            break
        if node.op == "placeholder":
            value[node] = torch.zeros(1, input_width, dtype=dtype)
        elif node.op == "get_attr":
            value[node] = reference[str(node.target)]
            continue
        elif node in gates:
            value[node] = value[gates[node].input]
        elif node.op == "call_module" and _affine(modules[str(node.target)]):
            value[node] = _affine_value(node, modules[str(node.target)], reference, value,
                                        dtype)
        else:
            value[node] = evaluate(node, value, modules)
        out = value[node]
        if isinstance(out, Tensor) and out.is_floating_point() and out.dim() >= 1:
            widths[node.name] = out[0].numel()
    return widths


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(
        b.is_floating_point() for b in module.buffers())


def _check_parameter_free(node: fx.Node, modules: Mapping[str, nn.Module]) -> None:
    if any(n.op == "get_attr" for n in node.all_input_nodes):
        raise _refuse(node, "an operation on a parameter read in forward")
    if node.op == "call_module" and _has_state(modules[str(node.target)]):
        module = modules[str(node.target)]
        raise _refuse(node, f"{type(module).__name__} has parameters or buffers but no "
                            f"affine rule")


def _linear_step(node: fx.Node, inputs: list[fx.Node], value: dict[fx.Node, Any],
                 modules: Mapping[str, nn.Module], generator: torch.Generator) -> GraphStep:
    """A parameter-free operation on data tensors, with its Jacobians; refuse if not affine.

    The inputs' values are zero rows (as many as the widest tensor has features, plus one):
    the Jacobian with respect to an input of width w is read from the output on the first
    w basis rows, the constant from the output at zero, and affinity is checked on random
    rows.
    """
    zeros = {n: torch.zeros_like(value[n]) for n in inputs}
    constant = evaluate(node, value, modules, zeros)
    rows = next(iter(zeros.values())).shape[0]
    if constant.dim() != 2 and constant.dim() >= 1 and constant.shape[0] == rows:
        # one tensor per example, but not a vector: an image or a sequence (a view or
        # nn.Unflatten before a convolution), or a scalar
        raise _refuse(node, f"a tensor of shape {tuple(constant.shape[1:])} per example "
                            f"(flat feature vectors only)", *_UNFLAT_GRAPH)
    if constant.dim() != 2 or constant.shape[0] != rows:
        raise _refuse(node, f"an output of shape {tuple(constant.shape)} for {rows} examples "
                            f"(flat feature vectors, one row per example, only)")
    jacobians = []
    for n in inputs:
        width = value[n].shape[1]
        basis = torch.zeros_like(value[n])
        basis[:width] = torch.eye(width, dtype=basis.dtype)
        response = evaluate(node, value, modules, {**zeros, n: basis}) - constant
        if bool(response[width:].abs().max() > 0):
            raise _refuse(node, "an operation that mixes examples")
        jacobians.append(response[:width].T.contiguous())
    # affine row by row: f(x) = c + Σ J_i x_i at random rows too
    probe = {n: torch.randn(value[n].shape, generator=generator, dtype=value[n].dtype)
             for n in inputs}
    got = evaluate(node, value, modules, probe)
    expected = constant + sum(x @ j.T for x, j in zip(probe.values(), jacobians, strict=True))
    tolerance = 1e3 * torch.finfo(constant.dtype).eps * (1.0 + float(expected.abs().max()))
    # NaN compares False with any tolerance: an operation undefined at the probes (a square
    # root, a logarithm of negative values) is refused as not affine, not let through
    if not isinstance(got, Tensor) or got.shape != expected.shape \
            or not bool(torch.isfinite(got).all() and torch.isfinite(expected).all()) \
            or float((got - expected).abs().max()) > tolerance:
        raise _refuse(node, "an operation that is not affine in its inputs")
    if float((constant - constant[:1]).abs().max()) > tolerance:
        raise _refuse(node, "an operation that depends on the example's position")
    return GraphStep("linear", node.name, tuple(n.name for n in inputs),
                     jacobians=tuple(jacobians), constant=constant[0].clone())


class _Joint:
    """The raw second moment M = E[ξ ξᵀ] (G, D, D) of the live coordinates, with their places.

    Coordinate 0 is the constant 1. ``places[name] = (a0 positions, Δa positions or None)``.
    """

    def __init__(self, second: Tensor, width: int) -> None:
        self.second = second
        positions = torch.arange(1, width + 1, device=second.device)
        self.places: dict[str, tuple[Tensor, Tensor | None]] = {"input": (positions, None)}

    @property
    def size(self) -> int:
        return self.second.shape[-1]

    def rows(self, blocks: list[tuple[Tensor, Tensor]]) -> Tensor:
        """A M for rows A = Σ C_b E_b (E_b: the coordinates ``positions_b``): (G, k, D)."""
        total: Tensor | None = None
        for coefficients, positions in blocks:
            part = coefficients @ self.second[..., positions, :]
            total = part if total is None else total + part
        assert total is not None  # at least one block
        return total

    def append(self, blocks: list[list[tuple[Tensor, Tensor]]],
               correction: Tensor | None = None) -> list[Tensor]:
        """Append the coordinates A_j ξ for each row group j; returns their positions.

        ``correction`` is added to the new-by-new block (a gate's variances).
        """
        products = [self.rows(b) for b in blocks]  # A_j M
        rows_m = torch.cat(products, dim=-2)  # (G, k, D)
        inner = torch.cat([self._times_transpose(rows_m, b) for b in blocks], dim=-1)
        if correction is not None:
            inner = inner + correction
        top = torch.cat([self.second, rows_m.transpose(-1, -2)], dim=-1)
        bottom = torch.cat([rows_m, inner], dim=-1)
        start = self.size
        self.second = torch.cat([top, bottom], dim=-2)
        positions, offset = [], start
        for product in products:
            k = product.shape[-2]
            positions.append(torch.arange(offset, offset + k, device=self.second.device))
            offset += k
        return positions

    @staticmethod
    def _times_transpose(rows_m: Tensor, blocks: list[tuple[Tensor, Tensor]]) -> Tensor:
        """(A_i M) A_jᵀ for all row groups i against the group ``blocks`` of A_j."""
        total: Tensor | None = None
        for coefficients, positions in blocks:
            part = rows_m[..., positions] @ coefficients.transpose(-1, -2)
            total = part if total is None else total + part
        assert total is not None
        return total

    def drop(self, names: tuple[str, ...]) -> None:
        """Remove the coordinates of nodes no later step reads."""
        dead = [p for name in names if name in self.places
                for p in self.places[name] if p is not None]
        if not dead:
            return
        keep_mask = torch.ones(self.size, dtype=torch.bool, device=self.second.device)
        keep_mask[torch.cat(dead)] = False
        keep = keep_mask.nonzero().squeeze(-1)
        self.second = self.second[..., keep, :][..., keep]
        new_index = torch.cumsum(keep_mask.long(), 0) - 1
        for name in names:
            self.places.pop(name, None)
        self.places = {name: (new_index[a], None if d is None else new_index[d])
                       for name, (a, d) in self.places.items()}


def input_second_moment(mean: Tensor, cov: Covariance) -> Tensor:
    """E[x̃ x̃ᵀ] (G, d + 1, d + 1) for x̃ = [1; x]: any covariance form of :mod:`fsd.covariance`."""
    if isinstance(cov, tuple):
        factor, residual = cov
        dense = factor @ factor.transpose(-1, -2) + torch.diag_embed(residual)
    elif cov.dim() == 2:
        dense = torch.diag_embed(cov)
    else:
        dense = cov
    second = dense + mean.unsqueeze(-1) * mean.unsqueeze(-2)
    top = torch.cat([mean.new_ones(mean.shape[0], 1, 1), mean.unsqueeze(-2)], dim=-1)
    bottom = torch.cat([mean.unsqueeze(-1), second], dim=-1)
    return torch.cat([top, bottom], dim=-2)


def graph_second_moment(plan: GraphPlan, model: nn.Module, params0: Mapping[str, Tensor],
                        params1: Mapping[str, Tensor], mean: Tensor, cov: Covariance,
                        gate_statistics: Mapping[str, Tensor], output_rows: Tensor) -> Tensor:
    """tr(P E[Δz Δzᵀ] Pᵀ) per mixture component (G,) under BGLN, exactly, on a graph.

    Args:
        plan: :func:`graph_plan` of the model.
        model: the network; its modules give the layers' rules (their parameters are read
            from ``params0`` and ``params1``).
        params0: θ0's parameters and buffers by name.
        params1: θ's (differentiable).
        mean: input means (G, d).
        cov: input covariances in any form of :mod:`fsd.covariance`.
        gate_statistics: the stored gate statistics by path (firing frequencies, or a smooth
            gate's moments; :meth:`fsd.model.rules.GateRule.gate_moments`).
        output_rows: (k', k) or (G, k', k) rows selecting outputs.

    Returns:
        (G,): half of it is BGLN-D's E[½‖Δz‖²] per component.
    """
    modules = dict(unwrap(model).named_modules())
    joint = _Joint(input_second_moment(mean, cov), mean.shape[-1])
    dtype = mean.dtype
    constant = torch.zeros(1, dtype=torch.long, device=mean.device)
    for step in plan.steps:
        if step.operation == "input":
            joint.places[step.node] = joint.places.pop("input")
        elif step.operation == "affine":
            module = modules[step.path]
            rule = _affine_rule(module)
            reference, delta = joint.places[step.inputs[0]]
            w0, b0 = rule.affine_matrix(module, params0, step.path)
            w1 = rule.affine_matrix(module, params1, step.path)[0]
            dw, db = rule.affine_delta_matrix(module, params0, params1, step.path)
            reference_rows = [(w0.to(dtype), reference)]
            if b0 is not None:
                reference_rows.append((b0.to(dtype).unsqueeze(-1), constant))
            delta_rows = [(dw.to(dtype), reference)]
            if db is not None:
                delta_rows.append((db.to(dtype).unsqueeze(-1), constant))
            if delta is not None:
                delta_rows.append((w1.to(dtype), delta))
            a, d = joint.append([reference_rows, delta_rows])
            joint.places[step.node] = (a, d)
        elif step.operation == "gate":
            _gate_step(joint, step, gate_statistics, constant)
        else:
            blocks_reference, blocks_delta = [], []
            for name, jacobian in zip(step.inputs, step.jacobians, strict=True):
                reference, delta = joint.places[name]
                blocks_reference.append((jacobian.to(dtype), reference))
                if delta is not None:
                    blocks_delta.append((jacobian.to(dtype), delta))
            assert step.constant is not None  # a linear step stores its constant
            if bool(step.constant.abs().max() > 0):
                blocks_reference.append((step.constant.to(dtype).unsqueeze(-1), constant))
            groups = [blocks_reference] + ([blocks_delta] if blocks_delta else [])
            places = joint.append(groups)
            joint.places[step.node] = (places[0], places[1] if blocks_delta else None)
        joint.drop(step.drop)
    delta = joint.places[plan.output][1]
    rows = output_rows.to(dtype)
    if delta is None:  # nothing between input and output moves
        return mean.new_zeros(mean.shape[0])
    final = joint.second[..., delta, :][..., delta]
    return ((rows @ final) * rows).sum((-1, -2))


def _gate_step(joint: _Joint, step: GraphStep, gate_statistics: Mapping[str, Tensor],
               constant: Tensor) -> None:
    """a0 = r ⊙ s0 + φ(0), Δa = g ⊙ Δs with (r, g) independent per unit."""
    module = step.module
    assert module is not None  # a gate step keeps its activation module
    moments = _gate_rule(module).gate_moments(module, gate_statistics[step.path])
    reference, delta = joint.places[step.inputs[0]]
    second, dtype = joint.second, joint.second.dtype
    r = moments.reference_mean.to(dtype)
    # cross moments with every other coordinate: gated by the means
    reference_rows = [(torch.diag_embed(r), reference)]
    if moments.offset != 0.0:
        offset = torch.full((*r.shape, 1), moments.offset, dtype=dtype, device=r.device)
        reference_rows.append((offset, constant))
    groups = [reference_rows]
    if delta is not None:
        groups.append([(torch.diag_embed(moments.delta_mean.to(dtype)), delta)])
    # within the new block: + diag(Var r ⊙ E[s0²]), diag(Cov(r, g) ⊙ E[s0 Δs]),
    # diag(Var g ⊙ E[Δs²]) — the gates' own variance
    top = [torch.diag_embed(moments.reference_variance.to(dtype)
                            * _diagonal(second, reference, reference))]
    correction = top[0]
    if delta is not None:
        cross = torch.diag_embed(moments.covariance.to(dtype)
                                 * _diagonal(second, reference, delta))
        bottom = torch.diag_embed(moments.delta_variance.to(dtype)
                                  * _diagonal(second, delta, delta))
        correction = torch.cat([torch.cat([top[0], cross], dim=-1),
                                torch.cat([cross, bottom], dim=-1)], dim=-2)
    places = joint.append(groups, correction)
    joint.places[step.node] = (places[0], places[1] if delta is not None else None)


def _diagonal(second: Tensor, rows: Tensor, columns: Tensor) -> Tensor:
    """The diagonal of M[rows, columns] (equal lengths), (G, k)."""
    return second[..., rows, columns]
