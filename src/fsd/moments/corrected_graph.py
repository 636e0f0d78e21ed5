"""The corrected recursion (:mod:`fsd.moments.corrected_conv`) on graphs: residual networks.

``fsd.BGLN(deterministic=True, moments="corrected")`` on models that are not chains (the
evaluator ``"corrected-graph"``). BGLN on a traced graph of affine layers (Linear, Conv2d
with zero padding, BatchNorm in evaluation), gates, max-pools and parameter-free linear
operations (``+``, ``-``, ``torch.cat``, flattening and views, slicing, ``mean``, average
pools, scaling by a constant, Identity and Dropout) is, as on a chain, the *mean-gate network*
— every gate replaced by its mean, every max-pool by its expected routing — driven by the
input and by zero-mean injections at every gate and max-pool output, uncorrelated with
everything upstream and with each other and diagonal over units
(:mod:`fsd.moments.corrected_conv` gives their 2×2 covariances). So, as there,

    E‖PΔz‖² = ‖P E[Δz]‖² + ‖A L‖² + Σ_i D_i ‖A_{:,i}‖²
              + Σ_injections Σ_units ‖M0‖² n00 + 2 M0·MΔ n0Δ + ‖MΔ‖² nΔΔ,

with A and the rows M0, MΔ of the mean-gate network's map from the input and from each
injection to PΔz. Here they come from autograd: the mean-gate network's linear map from
perturbations added at the input and at every gate and pool output is run once on k columns
(one per output row) and pulled back with one vector-Jacobian product (``torch.autograd.grad``
with ``create_graph``: differentiable in θ), which follows every path of the graph — both
branches of a residual block — exactly.

The injections' sizes need the raw second moments of (s0, Δs) per unit at every gate and pool
input. As on chains they are pushed forward in two parts:

- the part driven by the input's mean and factor L: exactly, as 1 + q images through the
  mean-gate network (factors add at an addition, are concatenated by ``torch.cat``);
- the part driven by D and by earlier injections: *carried diagonally*, node by node — an
  affine layer by its squared coefficients, a parameter-free operation by its *squared map*
  Σ_i J_ji² v_i (an addition adds, a concatenation, view or slice is itself, a mean over n
  is the mean / n, a constant c scales by c², an average pool by
  :func:`fsd.model.rules._avgpool_squared`), a gate by E[r]², E[r]E[g], E[g]², a pool by π².

**The approximation.** Besides the covariance an affine layer creates between units (dropped
as on chains), an addition of two branches drops the *cross-covariance between the branches'
carried parts*: var(a + b) ≈ var a + var b for the diagonal part, although a skip connection
and its residual branch carry the same earlier injections. The input-driven part and all rows
are exact. So the result is exact when no injection's carried variance reaches a later gate
or pool (one gated layer, anywhere in the graph, with an input covariance without diagonal
part), exact with all gate means in {0, 1} and no max-pool (no injections: exact moments of
the fixed linear network), and on chains equals :mod:`fsd.moments.corrected_conv` (and
:mod:`fsd.moments.corrected`). Measured (``tests/test_corrected_graph.py``, float64): against
:mod:`fsd.moments.exact_graph` on random residual MLPs with gate means uniform on [0, 1], a
relative gap of median 1.5 %, max 13 % over 20 seeds (a chain MLP of the same widths: 3 %,
9 %); with gate frequencies fitted on data, median 0.2 %, max 0.8 % over 10 seeds; against a
Monte Carlo of BGLN on a small ResNet without max-pool, −1.2 % (standard error 1.1 %). A
max-pool is routed by its stored frequencies independently of the values here, by the argmax
in BGLN-S: +1.7 % on the zoo's ResNet-18 layout, −4 % on a small ResNet with a max-pool stem.

Operations outside the table (LayerNorm, attention, softmax, products of activations,
embeddings, a parameter read in ``forward``, Conv1d and MaxPool1d, which have no rules) are
refused in one line naming the node and the estimators that take the model.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..covariance import Covariance
from ..model import rules, support
from ..model.plan import read
from ..model.rules import TracedLayer, is_affine, is_fixed, is_pool
from ..model.tracing import cast_dtype, evaluate, unwrap
from .corrected_conv import (
    _carry_delta,
    _carry_reference,
    _cross,
    _gate_parts,
    _pool_injection,
    _run_forward,
    _run_reference,
    _square_routed,
    check_squared,
    image_input,
)

Op = Callable[[list[Tensor]], Tensor]


@dataclass(frozen=True)
class Node:
    """One operation on data tensors of a :class:`GraphSteps`.

    Attributes:
        kind: ``"input"``, ``"affine"``, ``"gate"``, ``"pool"`` or ``"linear"``.
        name: the graph node's name (later nodes refer to its output by it).
        inputs: the names of the data nodes it reads.
        layer: affine, gate and pool nodes: the layer (path: the parameters' prefix for an
            affine layer, the statistics' key for a gate or pool).
        apply: linear nodes: the map on batch-flattened tensors (B, *shape), one per input,
            without its constant.
        squared: linear nodes: the squared map Σ_i J_ji² v_i, one tensor per input.
        constant: linear nodes: what the map adds to its inputs' means (``None``: nothing).
    """

    kind: str
    name: str
    inputs: tuple[str, ...] = ()
    layer: TracedLayer | None = None
    apply: Op | None = None
    squared: Op | None = None
    constant: Callable[[Tensor], Tensor] | None = None


@dataclass(frozen=True)
class GraphSteps:
    """A model's graph as :func:`reference` and :func:`second_moment` walk it, in order."""

    nodes: tuple[Node, ...]
    output: str
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per-example shapes


# ----- reading the graph ------------------------------------------------------------------
def _refuse(node: fx.Node, why: str, *features: support.Feature) -> NotImplementedError:
    features = features or (support.Feature.NON_AFFINE,)
    target = getattr(node.target, "__name__", str(node.target))
    return NotImplementedError(
        f"BGLN-D with moments='corrected' on a graph: {why} at graph node '{node.name}' "
        f"({node.op} {target}); {support.advice(support.BGLN_D, *features)}")


_ADD = {operator.add, operator.iadd, torch.add, "add", "__add__", "__radd__", "__iadd__"}
_SUB = {operator.sub, operator.isub, torch.sub, torch.subtract, "sub", "subtract", "__sub__",
        "__isub__"}
_MUL = {operator.mul, operator.imul, torch.mul, torch.multiply, "mul", "multiply", "__mul__",
        "__rmul__", "__imul__"}
_DIV = {operator.truediv, operator.itruediv, torch.div, torch.true_divide, "div",
        "true_divide", "__truediv__", "__itruediv__"}
_NEG = {operator.neg, torch.neg, "neg", "__neg__"}
_CAT = {torch.cat, torch.concat, torch.concatenate}
_SAME = {torch.flatten, "flatten", "contiguous", operator.getitem}  # J ∈ {0, 1}: squared = map
_VIEWS = {"view", "reshape", torch.reshape}
_MEAN = {torch.mean, "mean"}
_ADAPTIVE = {F.adaptive_avg_pool2d, F.adaptive_avg_pool1d}


def _key(node: fx.Node) -> Any:
    return str(node.target) if node.op == "call_method" else node.target


def _in(key: Any, table: set) -> bool:
    try:
        return key in table
    except TypeError:  # an unhashable target
        return False


def _adaptive_counts(in_size: tuple[int, ...], out_size: tuple[int, ...]) -> Tensor:
    """The number of inputs in each window of an adaptive average pool (*out_size)."""
    counts = torch.ones(())
    for size, out in zip(in_size, out_size, strict=True):
        j = torch.arange(out)
        start = torch.div(j * size, out, rounding_mode="floor")
        end = -torch.div(-(j + 1) * size, out, rounding_mode="floor")  # ceil
        counts = counts.unsqueeze(-1) * (end - start).to(torch.float64)
    return counts


def _adaptive_squared(pool: Callable[[Tensor], Tensor], in_shape: tuple[int, ...],
                      out_shape: tuple[int, ...], spatial: int) -> Op:
    counts = _adaptive_counts(in_shape[-spatial:], out_shape[-spatial:])

    def squared(xs: list[Tensor]) -> Tensor:
        return pool(xs[0]) / counts.to(xs[0])
    return squared


def read_graph(model: nn.Module, input_shape: tuple[int, ...],
               dtype: torch.dtype = torch.float64) -> GraphSteps:
    """Walk ``model``'s traced graph (:func:`fsd.model.plan.read`) once, classifying every node.

    A probe (one zero input through the model's own modules) gives every tensor's shape.

    Raises:
        NotImplementedError: an operation this walk cannot propagate, naming its node.
    """
    model = unwrap(model)
    plan = read(model)
    modules = dict(model.named_modules())
    value: dict[fx.Node, Any] = {}
    data: set[fx.Node] = set()
    sizes: set[fx.Node] = set()  # integers read from the data's shape (x.size(0))
    nodes: list[Node] = []
    shapes: dict[str, tuple[int, ...]] = {}
    with torch.no_grad():
        for step in plan.nodes:
            node = step.node
            inputs = [n for n in node.all_input_nodes if n in data]
            if step.kind == "input":
                if any(s.kind == "input" for s in plan.nodes if s.node is not node):
                    raise _refuse(node, "a forward with more than one input")
                value[node] = torch.zeros((1, *input_shape), dtype=dtype)
                data.add(node)
                nodes.append(Node("input", node.name))
                shapes[node.name] = tuple(input_shape)
                continue
            if step.kind == "output":
                out = node.args[0]
                if not isinstance(out, fx.Node) or out not in data:
                    raise _refuse(node, "an output that is not one tensor computed from the "
                                        "input")
                return GraphSteps(tuple(nodes), out.name, shapes)
            if step.kind == "parameter":
                raise _refuse(node, "a parameter read in forward", support.Feature.NO_RULE)
            if not inputs and not any(n in sizes for n in node.all_input_nodes):
                value[node] = evaluate(node, value, modules)  # constants
                continue
            if step.kind == "gate":
                gate = plan.gates[node]
                if [gate.input] != inputs:
                    raise _refuse(node, "an activation reading more than its input")
                value[node] = gate.module(value[gate.input])
                entry = Node("gate", node.name, (gate.input.name,),
                             TracedLayer(gate.path, gate.module, rules.RULES[type(gate.module)]))
            elif step.kind == "module":
                assert step.module is not None and step.path is not None
                value[node] = evaluate(node, value, modules)
                entry = _module_node(node, step.module, step.path, inputs, value)
            else:
                value[node] = evaluate(node, value, modules)
                out = value[node]
                if not isinstance(out, Tensor) or not out.is_floating_point():
                    if isinstance(out, int) or (isinstance(out, tuple) and all(
                            isinstance(v, int) for v in out)):
                        sizes.add(node)  # a size, read by a view
                        continue
                    raise _refuse(node, f"an operation on the data returning "
                                        f"{type(out).__name__} rather than one floating tensor")
                entry = _operation_node(node, inputs, value, sizes)
            out = value[node]
            if not isinstance(out, Tensor) or out.shape[0] != 1:
                raise _refuse(node, "an output that is not one tensor per example")
            data.add(node)
            shapes[node.name] = tuple(out.shape[1:])
            nodes.append(entry)
    raise AssertionError("a traced graph ends with an output node")  # pragma: no cover


def _module_node(node: fx.Node, module: nn.Module, path: str, inputs: list[fx.Node],
                 value: dict[fx.Node, Any]) -> Node:
    rule = rules.RULES.get(type(module))
    if len(inputs) != 1 or len(node.all_input_nodes) != 1:
        raise _refuse(node, f"{type(module).__name__} reading several tensors")
    source = inputs[0].name
    if is_affine(rule):
        layer = TracedLayer(str(node.target), module, rule)
        check_squared([layer])
        return Node("affine", node.name, (source,), layer)
    if is_pool(rule):
        if getattr(module, "ceil_mode", False):
            raise _refuse(node, "a MaxPool2d with ceil_mode=True", support.Feature.CEIL_POOL)
        return Node("pool", node.name, (source,), TracedLayer(path, module, rule))
    if is_fixed(rule):
        layer = TracedLayer(path, module, rule)
        check_squared([layer])
        squared = rule.squared
        assert squared is not None  # check_squared
        return Node("linear", node.name, (source,),
                    apply=lambda xs: rule.apply(module, xs[0]),
                    squared=lambda xs: squared(module, xs[0]))
    if isinstance(module, nn.Unflatten):  # a view: each output is one input
        return Node("linear", node.name, (source,), apply=lambda xs: module(xs[0]),
                    squared=lambda xs: module(xs[0]))
    if isinstance(module, (nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool1d)):
        spatial = 2 if isinstance(module, nn.AdaptiveAvgPool2d) else 1
        in_shape = tuple(value[inputs[0]].shape[1:])
        out_shape = tuple(value[node].shape[1:])
        return Node("linear", node.name, (source,), apply=lambda xs: module(xs[0]),
                    squared=_adaptive_squared(module, in_shape, out_shape, spatial))
    if any(True for _ in module.parameters()):
        raise _refuse(node, f"{type(module).__name__} has parameters but no affine rule",
                      support.Feature.NO_RULE)
    raise _refuse(node, f"{type(module).__name__} has no rule", support.Feature.NO_RULE)


def _scalar(arg: Any) -> float | None:
    return float(arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


def _operation_node(node: fx.Node, inputs: list[fx.Node], value: dict[fx.Node, Any],
                    sizes: set[fx.Node]) -> Node:
    """A parameter-free operation on the data, from the table, with its squared map."""
    key = _key(node)
    names = tuple(n.name for n in inputs)
    given: list[Any] = list(node.args)
    args = [given[i] if i < len(given) else None for i in range(2)]
    if any(n in sizes for n in node.all_input_nodes) and not _in(key, _VIEWS):
        raise _refuse(node, "an operation reading a size of the data")
    if _in(key, _ADD | _SUB) and not node.kwargs:
        sign = -1.0 if _in(key, _SUB) else 1.0
        if len(inputs) == 2 and all(isinstance(a, fx.Node) for a in args) and \
                args[0] is not args[1]:
            first, second = args
            assert isinstance(first, fx.Node) and isinstance(second, fx.Node)
            if value[first].shape != value[second].shape:
                raise _refuse(node, "an addition that broadcasts")
            order = (first.name, second.name)
            return Node("linear", node.name, order,
                        apply=lambda xs: xs[0] + sign * xs[1],
                        squared=lambda xs: xs[0] + xs[1])
        if len(inputs) == 1:
            first = args[0] is inputs[0]
            constant = _scalar(args[1] if first else args[0])
            if constant is not None:
                flip = -1.0 if (sign < 0 and not first) else 1.0  # c − x
                shift = -constant if (sign < 0 and first) else constant
                return Node("linear", node.name, names, apply=lambda xs: flip * xs[0],
                            squared=lambda xs: xs[0], constant=lambda m: m + shift)
    if _in(key, _MUL | _DIV) and len(inputs) == 1 and not node.kwargs:
        other = args[1] if args[0] is inputs[0] else args[0]
        constant = _scalar(other)
        if constant is not None and (args[0] is inputs[0] or _in(key, _MUL)):
            scale = 1.0 / constant if _in(key, _DIV) else constant
            return Node("linear", node.name, names, apply=lambda xs: scale * xs[0],
                        squared=lambda xs: scale ** 2 * xs[0])
    if _in(key, _NEG) and len(inputs) == 1:
        return Node("linear", node.name, names, apply=lambda xs: -xs[0],
                    squared=lambda xs: xs[0])
    dtype = cast_dtype(node)
    if dtype is not None and len(inputs) == 1:  # x.float(), x.to(torch.float32)
        def cast(xs: list[Tensor]) -> Tensor:
            return xs[0].to(dtype)
        return Node("linear", node.name, names, apply=cast, squared=cast)
    if _in(key, _CAT) and len(inputs) == len(node.all_input_nodes):
        tensors = given[0] if given else node.kwargs.get("tensors")
        dim = node.kwargs.get("dim", given[1] if len(given) > 1 else 0)
        if isinstance(tensors, (list, tuple)) and isinstance(dim, int) \
                and dim % value[node].dim() != 0:
            order = tuple(t.name if isinstance(t, fx.Node) else "" for t in tensors)
            if "" in order:
                raise _refuse(node, "a concatenation with a constant tensor")

            def cat(xs: list[Tensor]) -> Tensor:
                return torch.cat(xs, dim)
            return Node("linear", node.name, order, apply=cat, squared=cat)
    if len(inputs) == 1 and len(node.all_input_nodes) - len(
            [n for n in node.all_input_nodes if n in sizes]) == 1:
        shape = tuple(value[node].shape[1:])
        if _in(key, _VIEWS):
            def view(xs: list[Tensor]) -> Tensor:
                return xs[0].reshape(xs[0].shape[0], *shape)
            return Node("linear", node.name, names, apply=view, squared=view)
        if _in(key, _SAME) and inputs[0] is given[0]:
            if key is operator.getitem and not _batch_kept(given[1]):
                raise _refuse(node, "an index that selects examples")
            rest, kwargs = given[1:], dict(node.kwargs)
            if key in (torch.flatten, "flatten") and _start(rest, kwargs) == 0:
                raise _refuse(node, "a flatten of the batch dimension")

            def same(xs: list[Tensor]) -> Tensor:
                if isinstance(key, str):
                    return getattr(xs[0], key)(*rest, **kwargs)
                return key(xs[0], *rest, **kwargs)
            return Node("linear", node.name, names, apply=same, squared=same)
        if _in(key, _MEAN) and inputs[0] is given[0]:
            rest, kwargs = given[1:], dict(node.kwargs)
            count = value[inputs[0]].numel() / value[node].numel()
            dims = kwargs.get("dim", rest[0] if rest else None)
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            if any(not isinstance(d, int) or d % value[inputs[0]].dim() == 0 for d in dims):
                raise _refuse(node, "a mean over the batch dimension")

            def mean(xs: list[Tensor]) -> Tensor:
                return xs[0].mean(*rest, **kwargs)
            return Node("linear", node.name, names, apply=mean,
                        squared=lambda xs: mean(xs) / count)
        if _in(key, _ADAPTIVE) and inputs[0] is given[0]:
            rest, kwargs = given[1:], dict(node.kwargs)
            spatial = 2 if key is F.adaptive_avg_pool2d else 1
            pool_function: Any = key

            def pool(v: Tensor) -> Tensor:
                return pool_function(v, *rest, **kwargs)
            in_shape, out_shape = tuple(value[inputs[0]].shape[1:]), tuple(value[node].shape[1:])
            return Node("linear", node.name, names, apply=lambda xs: pool(xs[0]),
                        squared=_adaptive_squared(pool, in_shape, out_shape, spatial))
    raise _refuse(node, "an operation without a squared map (not in the table of linear "
                        "operations)")


def _start(rest: list, kwargs: dict) -> int:
    return int(kwargs.get("start_dim", rest[0] if rest else 0))


def _batch_kept(index: Any) -> bool:
    """Whether a getitem index keeps dim 0 whole (``x[:, 0]``, ``x[..., :3]``)."""
    if isinstance(index, tuple):
        first = index[0] if index else None
        return first is Ellipsis or (isinstance(first, slice) and first == slice(None))
    return False


# ----- the passes ---------------------------------------------------------------------------
def _flat(op: Op, xs: list[Tensor]) -> Tensor:
    """A map on (B, *shape) tensors applied to (G, n, *shape) ones."""
    lead = xs[0].shape[:2]
    y = op([x.reshape(lead[0] * lead[1], *x.shape[2:]) for x in xs])
    return y.view(*lead, *y.shape[1:])


def _zeros_like_shape(like: Tensor, n: int, shape: tuple[int, ...]) -> Tensor:
    return like.new_zeros(like.shape[0], n, *shape)


def _linear_inputs(node: Node, get: Callable[[str], Tensor | None], like: Tensor, n: int,
                   shapes: Mapping[str, tuple[int, ...]]) -> list[Tensor] | None:
    """The inputs of a linear node, ``None`` ones as zeros; ``None`` if all are."""
    values = [get(name) for name in node.inputs]
    if all(v is None for v in values):
        return None
    return [v if v is not None else _zeros_like_shape(like, n, shapes[name])
            for v, name in zip(values, node.inputs, strict=True)]


def reference(steps: GraphSteps, params0: Mapping[str, Tensor], mean: Tensor, cov: Covariance,
              statistics: Mapping[str, Tensor], input_shape: tuple[int, ...],
              injection_rank: int | None = None, injections: bool = True) -> dict[str, Any]:
    """What :func:`second_moment` needs from θ0 and the statistics (computed once, at fit).

    Returns:
        ``{"columns", "carried", "n00", "signal_factor", "signal_residual"}``: per node, the
        mean then the q factor images of a0 in the mean-gate network (G, 1 + q, *shape), the
        diagonally carried part of E a0² (G, 1, *shape) or ``None``; per gate and pool its
        injection's reference variance; and the input's whole factor and diagonal for the
        mean-gate term. ``injection_rank`` and ``injections`` as
        :func:`fsd.moments.corrected_conv.conv_reference`.
    """
    groups = mean.shape[0]
    factor, residual, signal_factor, signal_residual = image_input(cov, groups, input_shape,
                                                                   injection_rank)
    columns: dict[str, Tensor] = {}
    carried: dict[str, Tensor | None] = {}
    n00: dict[str, Tensor] = {}
    for node in steps.nodes:
        if node.kind == "input":
            columns[node.name] = torch.cat([mean.reshape(groups, 1, *input_shape),
                                            factor.reshape(groups, factor.shape[1],
                                                           *input_shape)], 1)
            carried[node.name] = None if residual is None or not injections else \
                residual.reshape(groups, 1, *input_shape)
            continue
        if node.kind == "linear":
            assert node.apply is not None and node.squared is not None
            xs = [columns[name] for name in node.inputs]
            out = _flat(node.apply, xs)
            if node.constant is not None:
                out = torch.cat([node.constant(out[:, :1]), out[:, 1:]], 1)
            columns[node.name] = out
            parts = _linear_inputs(node, carried.get, out, 1, steps.shapes)
            carried[node.name] = None if parts is None else _flat(node.squared, parts)
            continue
        layer = node.layer
        assert layer is not None
        (source,) = node.inputs
        c0, t00 = columns[source], carried[source]
        if node.kind == "affine":
            run = (layer,)
            columns[node.name] = torch.cat([_run_reference(run, params0, c0[:, :1], bias=True),
                                            _run_reference(run, params0, c0[:, 1:], bias=False)],
                                           1)
            carried[node.name] = None if t00 is None else _carry_reference(run, params0, t00)
            continue
        rule = layer.rule
        routed = torch.cat([rule.expected_reference(layer, c0[:, :1], statistics, offset=True),
                            rule.expected_reference(layer, c0[:, 1:], statistics, offset=False)],
                           1)
        columns[node.name] = routed
        if not injections:
            carried[node.name] = None
        elif node.kind == "gate":
            er, _, vr, _, _ = _gate_parts(layer, statistics, c0)
            second = c0.pow(2).sum(1, keepdim=True)
            if t00 is not None:
                second = second + t00
            n00[node.name] = vr * second
            carried[node.name] = n00[node.name] if t00 is None else \
                er.pow(2) * t00 + n00[node.name]
        else:  # a max-pool
            n00[node.name] = _pool_injection(layer, statistics, c0, c0, routed, routed, t00)
            carried[node.name] = n00[node.name] if t00 is None else \
                _square_routed(layer, t00, statistics) + n00[node.name]
    # kept: what the difference side reads (the inputs of layers, gates and pools) and the output
    kept = {steps.output} | {name for node in steps.nodes if node.kind != "linear"
                             for name in node.inputs}
    return {"columns": {k: v for k, v in columns.items() if k in kept},
            "carried": {k: v for k, v in carried.items() if k in kept}, "n00": n00,
            "signal_factor": signal_factor, "signal_residual": signal_residual}


def _mean_gate_map(steps: GraphSteps, params0: Mapping[str, Tensor],
                   params1: Mapping[str, Tensor], statistics: Mapping[str, Tensor],
                   points: list[str], perturbations: tuple[Tensor, ...]) -> Tensor:
    """The mean-gate network's Δ output from perturbations of (a0, Δa) (linear, no offsets).

    ``perturbations``: the a0 perturbation at the input, then (a0, Δa) perturbations at
    each node of ``points`` (gate and pool outputs), each (G, k, *shape).
    """
    added: dict[str, tuple[Tensor, Tensor]] = {}
    for index, name in enumerate(points):
        added[name] = (perturbations[1 + 2 * index], perturbations[2 + 2 * index])
    like = perturbations[0]
    k = like.shape[1]
    ref: dict[str, Tensor] = {}
    delta: dict[str, Tensor | None] = {}
    for node in steps.nodes:
        if node.kind == "input":
            ref[node.name], delta[node.name] = perturbations[0], None
            continue
        if node.kind == "linear":
            assert node.apply is not None
            ref[node.name] = _flat(node.apply, [ref[name] for name in node.inputs])
            parts = _linear_inputs(node, delta.get, like, k, steps.shapes)
            delta[node.name] = None if parts is None else _flat(node.apply, parts)
            continue
        layer = node.layer
        assert layer is not None
        (source,) = node.inputs
        a0, da = ref[source], delta[source]
        if node.kind == "affine":
            run = (layer,)
            ref[node.name] = _run_reference(run, params0, a0, bias=False)
            delta[node.name] = _run_forward(run, params0, params1, a0, da, bias=False)
            continue
        rule = layer.rule
        ref[node.name] = rule.expected_reference(layer, a0, statistics, offset=False)
        delta[node.name] = None if da is None else rule.expected_delta(layer, da, statistics)
        if node.name in added:
            p0, pd = added[node.name]
            ref[node.name] = ref[node.name] + p0
            moved = delta[node.name]
            delta[node.name] = pd if moved is None else moved + pd
    out = delta[steps.output]
    if out is None:
        return like.new_zeros(like.shape[0], k, *steps.shapes[steps.output])
    return out


def second_moment(steps: GraphSteps, params0: Mapping[str, Tensor],
                  params1: Mapping[str, Tensor], ref: dict[str, Any],
                  statistics: Mapping[str, Tensor], output_rows: Tensor, *,
                  gate_variance: bool = True, parts: bool = False
                  ) -> Tensor | tuple[Tensor, Tensor]:
    """E‖PΔz‖² (G,) by the mean-gate network plus the injected gate and routing variance.

    Args:
        steps: :func:`read_graph` of the model.
        params0: θ0 (with buffers).
        params1: θ (with buffers; differentiable).
        ref: :func:`reference` for the same ``params0``.
        statistics: gate statistics and max-pool routing frequencies by path.
        output_rows: (k', k) rows selecting outputs.
        gate_variance: ``False`` leaves the injections out: the mean-gate network alone.
        parts: return (mean-gate network, injections) separately.
    """
    columns, carried, n00s = ref["columns"], ref["carried"], ref["n00"]
    points = [node.name for node in steps.nodes if node.kind in ("gate", "pool")] \
        if gate_variance else []
    # forward: E[Δa] and the factor images of Δa, and the carried diagonals
    dcols: dict[str, Tensor | None] = {}
    t0d: dict[str, Tensor | None] = {}
    tdd: dict[str, Tensor | None] = {}
    injections: dict[str, tuple[Tensor, Tensor | None, Tensor | None]] = {}
    like = columns[steps.output]  # (G, 1 + q, …): the components and columns of every node
    n = like.shape[1]
    for node in steps.nodes:
        name = node.name
        if node.kind == "input":
            dcols[name] = t0d[name] = tdd[name] = None
            continue
        if node.kind == "linear":
            assert node.apply is not None and node.squared is not None
            xs = _linear_inputs(node, dcols.get, like, n, steps.shapes)
            dcols[name] = None if xs is None else _flat(node.apply, xs)
            for store in (t0d, tdd):
                ys = _linear_inputs(node, store.get, like, 1, steps.shapes)
                store[name] = None if ys is None else _flat(node.squared, ys)
            continue
        layer = node.layer
        assert layer is not None
        (source,) = node.inputs
        c0, dc, t00 = columns[source], dcols[source], carried[source]
        if node.kind == "affine":
            run = (layer,)
            mean_d = _run_forward(run, params0, params1, c0[:, :1],
                                  None if dc is None else dc[:, :1], bias=True)
            factor_d = _run_forward(run, params0, params1, c0[:, 1:],
                                    None if dc is None else dc[:, 1:], bias=False)
            dcols[name] = torch.cat([mean_d, factor_d], 1)
            if gate_variance and (t00 is not None or t0d[source] is not None):
                zero = torch.zeros_like(c0[:, :1])
                t0d[name], tdd[name] = _carry_delta(run, params0, params1,
                                                    zero if t00 is None else t00,
                                                    t0d[source], tdd[source])
            else:
                t0d[name] = tdd[name] = None
            continue
        rule = layer.rule
        routed_d = None if dc is None else rule.expected_delta(layer, dc, statistics)
        dcols[name] = routed_d
        if not gate_variance:
            t0d[name] = tdd[name] = None
            continue
        s0d, sdd = t0d[source], tdd[source]
        if dc is None:  # Δa = 0 here: only a0 gets variance
            injections[name] = (n00s[name], None, None)
            t0d[name] = tdd[name] = None
            continue
        assert routed_d is not None
        if node.kind == "gate":
            er, eg, _, crg, vg = _gate_parts(layer, statistics, dc)
            e0d, edd = _cross(c0, dc), dc.pow(2).sum(1, keepdim=True)
            if s0d is not None:
                e0d = e0d + s0d
            if sdd is not None:
                edd = edd + sdd
            n0d, ndd = crg * e0d, vg * edd
            t0d[name] = n0d if s0d is None else er * eg * s0d + n0d
            tdd[name] = ndd if sdd is None else eg.pow(2) * sdd + ndd
        else:
            routed0 = rule.expected_reference(layer, c0, statistics, offset=False)
            n0d = _pool_injection(layer, statistics, c0, dc, routed0, routed_d, s0d)
            ndd = _pool_injection(layer, statistics, dc, dc, routed_d, routed_d, sdd)
            t0d[name] = n0d if s0d is None else _square_routed(layer, s0d, statistics) + n0d
            tdd[name] = ndd if sdd is None else _square_routed(layer, sdd, statistics) + ndd
        injections[name] = (n00s[name], n0d, ndd)
    out = dcols[steps.output]
    groups = columns[steps.output].shape[0]
    rows = output_rows.to(columns[steps.output].dtype)
    if out is None:
        zero = rows.new_zeros(groups)
        return (zero, zero) if parts else zero
    mean_out = out[:, 0].reshape(groups, -1)
    mean_term = (mean_out @ rows.T).pow(2).sum(-1)

    # the rows: one vector-Jacobian product of the mean-gate map, k columns at once
    k = rows.shape[0]
    zeros = [_zeros_like_shape(like, k, steps.shapes[steps.nodes[0].name])]
    for name in points:
        zeros += [_zeros_like_shape(like, k, steps.shapes[name])] * 2

    cotangent = rows.expand(groups, *rows.shape).reshape(groups, k, *steps.shapes[steps.output])
    differentiable = torch.is_grad_enabled()  # the rows carry θ's graph for training
    with torch.enable_grad():
        leaves = tuple(z.clone().requires_grad_() for z in zeros)
        mapped = _mean_gate_map(steps, params0, params1, statistics, points, leaves)
        grads = torch.autograd.grad(mapped, leaves, cotangent, create_graph=differentiable,
                                    allow_unused=True)
    pulled = [torch.zeros_like(z) if g is None else g for g, z in zip(grads, zeros, strict=True)]
    rows_in = pulled[0].flatten(2)  # (G, k, d): A
    signal_factor = ref["signal_factor"].flatten(2)
    signal = (rows_in @ signal_factor.transpose(-1, -2)).pow(2).sum((-1, -2))
    if ref["signal_residual"] is not None:
        signal = signal + (rows_in.pow(2) * ref["signal_residual"].flatten(2)).sum((-1, -2))
    signal = mean_term + signal
    correction = signal.new_zeros(groups)
    for index, name in enumerate(points):
        m0, md = pulled[1 + 2 * index], pulled[2 + 2 * index]
        a, b, c = injections[name]
        value = m0.pow(2).sum(1) * a.squeeze(1)
        if b is not None and c is not None:
            value = value + 2 * (m0 * md).sum(1) * b.squeeze(1) + md.pow(2).sum(1) * c.squeeze(1)
        correction = correction + value.flatten(1).sum(-1)
    if parts:
        return signal, correction
    return signal + correction


def output_size(steps: GraphSteps) -> int:
    """The number of outputs per example."""
    return math.prod(steps.shapes[steps.output])
