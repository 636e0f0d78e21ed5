"""LAFTR's linearized forward pass (paper eqs. 4–9), on chains and on any traceable graph.

On a chain of rule-tagged layers, :func:`propagate_linearized` runs the reference network θ0
as usual and the other network θ linearized around it at every nonlinearity. Differences are
propagated directly (Δs = ΔW a0 + W1 Δa + Δb), which avoids the cancellation of subtracting
two nearly equal outputs. The gates are supplied by the caller: the reference's own
1{s0 > 0} (LAFTR, :func:`true_gates`) or Bernoulli draws (BGLN-S).

The rest of this module evaluates LAFTR's definition on a torch.fx graph of any shape — residual
additions, concatenations, normalisation layers, attention, smooth activations — by carrying
through every node the reference value a0 and the difference Δa of the linearized network.
Only what the data flows through is linearized; what the parameters alone compute is each
network's own:

- a node computed from parameters and buffers alone (``self.W``, ``self.W.T``,
  ``F.softplus(self.scale)``, ``self.head(self.query)``) is evaluated on both networks:
  Δ = f(p1) − f(p0), exact; a view of a parameter loses no digits this way;
- an operation on the data without such an argument (``F.gelu``, ``+``, ``torch.cat``,
  ``softmax``, ``@`` of two activations, …) is replaced by its first-order expansion at the
  reference: Δout = J_f(a0) · Δa (``torch.func.jvp``); linear operations are therefore exact;
- an operation on the data that also reads such values P (``F.linear(x, self.W, self.b)``,
  ``x @ self.W``, ``x * self.gain``, ``F.conv2d(x, self.weight)``, ``x + self.bias``,
  ``F.layer_norm(x, s, self.w, self.b)``) is exact in P and linear in the data, as a module
  is in its own parameters: Δout = f(a0; P1) − f(a0; P0) + J_a f(a0; P1)·Δa — exact, the
  second-order term Δa·ΔP included, wherever f is affine in its data arguments. For the
  operations that are affine in P as well (products, sums, ``F.linear``, convolutions, the
  normalisations' weight and bias: :data:`_AFFINE`) the same value is taken without
  cancellation as one JVP at (a0, P1): Δout = f(Δa, P1) + f(a0, ΔP);
- a layer with parameters or buffers m(x; p) (``nn.LayerNorm``, ``nn.BatchNorm2d`` in
  evaluation mode, ``nn.MultiheadAttention``, …) is exact in its own parameters (and in any
  argument computed from parameters alone) at the reference input and linear in its input:
  Δout = m(a0; p1) − m(a0; p0) + J_x m(a0; p1)·Δa, so the moved network's weights *and*
  running statistics count. ``nn.Linear`` and ``nn.Conv2d`` use the affine rule's form
  (ΔW a0 + W1 Δa + Δb, no cancellation).

A network written with ``F.linear``, ``x @ self.W`` or a learnable gain therefore gets what
its ``nn.Linear`` twin gets.

For a ReLU network this is exactly the result of :func:`propagate_linearized` (gates
1{s0 > 0}); for a network without nonlinearities it is the exact FSD.

BGLN-S walks the same graph with a gate callback (:data:`fsd.model.rules.GateFn`): at every
activation BGLN gates (:func:`fsd.model.plan.gate_nodes` — a module with a gate rule, or
``F.relu``, ``F.gelu``, ``torch.tanh``, … called as a function) the callback gives the
reference activation a0 and the gate g, and Δa = g·Δs; every other operation is linearized
as above, around the reference values the gated activations produce (as the chain pass
routes a max-pool by the gated reference). The graph is traced with the rule tracer of
:mod:`fsd.model.tracing`, so a gate's path is the one :func:`fsd.model.tracing.runnable` gives
the module that records its statistics at fit.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import autodiff, rules
from .plan import GateNode, read
from .rules import GateFn, TracedLayer, UnsupportedModuleError, is_affine, is_gate
from .signature import model_state
from .tracing import arguments, evaluate, out_of_place, unwrap


def graph_gates(model: nn.Module) -> list[TracedLayer]:
    """The activations BGLN-S gates in ``model``'s graph, in graph order, with their rules.

    Paths are a module's attribute path, or the graph node's name for a function call
    (:func:`fsd.model.plan.gate_nodes`): the paths under which the statistics are stored. An
    activation module called at several places (torchvision's ``self.relu``) is one gate per
    call, each keyed by its call's graph node name, so each has its own statistics.

    Raises:
        UnsupportedModuleError: the forward cannot be traced.
    """
    return [_layer(gate) for gate in read(unwrap(model)).gates.values()]


def _layer(gate: GateNode) -> TracedLayer:
    return TracedLayer(gate.path, gate.module, rules.RULES[type(gate.module)])


def linearized_outputs(model: nn.Module, reference: Mapping[str, Tensor], x: Tensor,
                       gate: GateFn | None = None) -> tuple[Tensor, Tensor]:
    """Reference outputs z0 and the linearized network's differences Δz on inputs ``x``.

    Args:
        model: the moved network (its parameters and buffers are θ).
        reference: θ0's parameters and buffers by name (:meth:`fsd.Estimator.reference_state`).
        x: inputs (n, ...).
        gate: ``None`` — LAFTR: every operation on the data linearized at the reference
            (JVPs), exact in what the parameters alone compute (``F.linear(x, self.W)``); or a
            callback ``gate(layer, s0) -> (a0, g)`` (:data:`fsd.model.rules.GateFn`) called at
            every gate node of the graph (:func:`fsd.model.plan.gate_nodes`) with a
            :class:`~fsd.model.rules.TracedLayer` (path, module, rule) and the reference
            pre-activation: the node's reference value becomes a0 and its difference g·Δs
            (BGLN-S's draws; :func:`true_gates` gives LAFTR's result).

    Returns:
        ``(z0, dz)``, differentiable in the model's parameters through ``dz``.
    """
    # attention's fused kernels have no forward-mode derivative; the math kernel has
    with sdpa_kernel([SDPBackend.MATH]):
        return _propagate(model, reference, x, gate)


def _propagate(model: nn.Module, reference: Mapping[str, Tensor], x: Tensor,
               gate: GateFn | None) -> tuple[Tensor, Tensor]:
    current = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    plan = read(model)
    value: dict[fx.Node, Any] = {}
    delta: dict[fx.Node, Any] = {}
    # θ's own value of every node computed from parameters and buffers alone (not from the
    # data): the second network's weights, which the data's path reads exactly
    moved: dict[fx.Node, Any] = {}
    data: set[fx.Node] = set()  # nodes whose tensors the data flows through
    for step in plan.nodes:
        node = step.node
        reads_data = any(n in data for n in node.all_input_nodes)
        if step.kind == "gate" and gate is not None:  # LAFTR linearizes it as any module
            value[node], delta[node] = _gated(plan.gates[node], gate, value, delta)
        elif node.op == "placeholder":
            value[node], delta[node] = x, None
        elif node.op == "get_attr":
            name = str(node.target)
            value[node] = reference[name]
            moved[node] = current[name]
            delta[node] = _subtract(moved[node], value[node])
        elif node.op == "output":
            out = node.args[0]
            assert isinstance(out, fx.Node)
            z0, dz = value[out], delta[out]
            return z0, torch.zeros_like(z0) if dz is None else dz
        elif not reads_data:  # parameters, buffers and constants alone: both networks' own
            value[node], delta[node] = _fixed(node, step.module, reference, current, value,
                                              moved)
        elif node.op == "call_module":
            assert step.module is not None  # a module call's module
            value[node], delta[node] = _module(node, step.module, reference, current, value,
                                               delta, moved)
        elif node.op in ("call_function", "call_method"):
            value[node], delta[node] = _operation(node, value, delta, moved)
        if node.op == "placeholder" or (step.kind == "gate" and gate is not None) or (
                reads_data and _holds_tensor(value[node])):
            data.add(node)  # x.size(0) read from the data is a constant of the walk
    raise AssertionError("a traced graph ends with an output node")


def _holds_tensor(out: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in tree_flatten(out)[0])


def _gated(node: GateNode, gate: GateFn, value: dict, delta: dict) -> tuple[Tensor, Any]:
    """A gate node's reference activation and difference from the callback: (a0, g·Δs)."""
    s0 = value[node.input]
    if not isinstance(s0, Tensor):
        raise UnsupportedModuleError(f"the activation at '{node.path}' is applied to a "
                                     f"{type(s0).__name__}, not a tensor")
    a0, g = gate(_layer(node), s0)
    ds = delta.get(node.input)
    return a0, None if ds is None else ds * g


def _moving(node: fx.Node, value: dict, delta: dict) -> list[fx.Node]:
    """Input nodes carrying a difference (floating tensors of the linearized network)."""
    return [n for n in node.all_input_nodes
            if isinstance(value[n], Tensor) and delta.get(n) is not None]


def _tangent(fn: Any, out: Any, primals: Mapping[fx.Node, Tensor],
             tangents: Mapping[fx.Node, Tensor]) -> Any:
    """J·tangents of ``fn(substitutions)`` at ``primals``, structured as its output ``out``.

    The output may be a tensor or a tuple of them (e.g. attention's (output, weights)); the
    difference has the same structure, ``None`` where an output does not move (and ``None``
    when nothing moves).
    """
    leaves, spec = tree_flatten(out)
    moves = [i for i, leaf in enumerate(leaves)
             if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    if not primals or not moves:
        return None
    nodes = list(primals)

    def f(*points: Tensor) -> tuple[Tensor, ...]:
        result, _ = tree_flatten(fn(dict(zip(nodes, points, strict=True))))
        return tuple(result[i] for i in moves)

    # an operation without a forward-mode derivative (weight_norm's kernel) takes two vjps;
    # attention's fast paths (taken under torch.no_grad()) are off inside
    jv = autodiff.jvp(f, tuple(_own_memory(primals[n]) for n in nodes),
                      tuple(_own_memory(tangents[n]) for n in nodes))[1]
    d: list[Any] = [None] * len(leaves)
    for i, t in zip(moves, jv, strict=True):
        d[i] = t
    return tree_unflatten(d, spec)


def _own_memory(t: Tensor) -> Tensor:
    """``t``, or a copy where elements share memory (an ``expand``): forward mode refuses those."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape, strict=True)):
        return t.contiguous()
    return t


def _linearize(fn: Any, node: fx.Node, value: dict, delta: dict) -> tuple[Any, Any]:
    """fn(substitutions) at the reference, and its JVP along the inputs' differences."""
    out0 = fn({})
    moving = _moving(node, value, delta)
    return out0, _tangent(fn, out0, {n: value[n] for n in moving},
                          {n: delta[n] for n in moving})


def _states(node: fx.Node, module: nn.Module, reference: Mapping[str, Tensor],
            current: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A called module's parameters and buffers by name in θ0 and in θ."""
    prefix = f"{node.target}."
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return ({n: reference[prefix + n] for n in names}, {n: current[prefix + n] for n in names})


def _fixed(node: fx.Node, module: nn.Module | None, reference: Mapping[str, Tensor],
           current: Mapping[str, Tensor], value: dict, moved: dict) -> tuple[Any, Any]:
    """A node the data does not reach, on both networks: (f(p0), f(p1) − f(p0)).

    Its θ value goes to ``moved``. A node of constants alone (``torch.arange(n)``) has no
    difference.
    """
    if node.op == "call_module":
        assert module is not None  # a module call's module
        function = out_of_place(module)
        state0, state1 = _states(node, module, reference, current)

        def run(state: dict[str, Tensor], substitute: Mapping[fx.Node, Any]) -> Any:
            args, kwargs = arguments(node, value, substitute)
            return functional_call(function, state, args, kwargs)

        out0 = run(state0, {})
        if not state1 and not any(n in moved for n in node.all_input_nodes):
            return out0, None
        out1 = run(state1, moved)
    else:
        out0 = evaluate(node, value, {})
        if not any(n in moved for n in node.all_input_nodes):
            return out0, None
        out1 = evaluate(node, value, {}, moved)
    moved[node] = out1
    return out0, _subtract(out1, out0)


def _operation(node: fx.Node, value: dict, delta: dict, moved: dict) -> tuple[Any, Any]:
    if node.target is operator.getitem and isinstance(value[node.args[0]], (tuple, list)):
        source, index = node.args[0], node.args[1]  # an item of a module's tuple output
        inner = delta[source]
        return value[source][index], None if inner is None else inner[index]

    def run(substitute: Mapping[fx.Node, Any]) -> Any:
        return evaluate(node, value, {}, substitute)  # a function or method call

    weights = {n: moved[n] for n in node.all_input_nodes if n in moved}
    if not weights:  # the data alone: linearized at the reference
        return _linearize(run, node, value, delta)

    # the data and values of the parameters alone (F.linear(x, self.W), x * self.gain): exact
    # in those, linear in the data
    out0 = run({})
    data = {n: value[n] for n in _moving(node, value, delta) if n not in moved}
    turning = [n for n in weights
               if isinstance(weights[n], Tensor) and delta.get(n) is not None]

    def at_weights(substitute: Mapping[fx.Node, Any]) -> Any:
        return run({**weights, **substitute})

    # f(a0 + Δa, P1) − f(a0, P0) = f(Δa, P1) + f(a0, ΔP); a mask or an integer computed from
    # parameters may differ between the networks too: then only the subtraction is exact
    if len(turning) == len(weights) and _affine_in(node, turning):
        primals = {**data, **{n: weights[n] for n in turning}}
        return out0, _tangent(at_weights, out0, primals, {n: delta[n] for n in primals})
    # f(a0; P1) − f(a0; P0) + J_a f(a0; P1)·Δa, as a module in its own parameters
    return out0, _add(_subtract(at_weights({}), out0),
                      _tangent(at_weights, out0, data, {n: delta[n] for n in data}))


def _module(node: fx.Node, module: nn.Module, reference: Mapping[str, Tensor],
            current: Mapping[str, Tensor], value: dict, delta: dict,
            moved: dict) -> tuple[Any, Any]:
    state0, state1 = _states(node, module, reference, current)
    rule = rules.RULES.get(type(module))
    weights = {n: moved[n] for n in node.all_input_nodes if n in moved}
    if is_affine(rule) and not weights:  # the chain's step: ΔW first, no cancellation
        (a0,) = arguments(node, value)[0]
        return rule.linearized(TracedLayer("", module, rule), a0, delta[node.all_input_nodes[0]],
                               state0, state1, true_gates)

    # a module made with inplace=True would overwrite its input, which other nodes and
    # autograd still read: call its out-of-place twin
    function = out_of_place(module)

    def run(state: dict[str, Tensor], base: Mapping[fx.Node, Any]) -> Any:
        def call(substitute: Mapping[fx.Node, Any]) -> Any:
            args, kwargs = arguments(node, value, {**base, **substitute})
            return functional_call(function, state, args, kwargs)
        return call

    # the reference side is evaluated with θ0's own parameters and buffers
    out0 = run(state0, {})({})
    data = [n for n in _moving(node, value, delta) if n not in moved]
    d = _tangent(run(state1, weights), out0, {n: value[n] for n in data},
                 {n: delta[n] for n in data})
    if state1 or weights:  # exact in the layer's own parameters and buffers at the reference
        # input, and in any argument computed from parameters alone
        d = _add(_subtract(run(state1, weights)({}), out0), d)
    return out0, d


# Operations affine in the arguments computed from parameters alone (P), so that their exact
# difference f(a0; P1) − f(a0; P0) is J_P f · ΔP, and one JVP at (a0, P1) gives the whole
# difference without the cancellation of subtracting two outputs. Any other operation gets the
# same value as that subtraction (:func:`_operation`); these lists only save digits.
_SUMS: frozenset[Any] = frozenset({  # affine in all their arguments jointly
    operator.add, operator.sub, operator.neg, torch.add, torch.sub, torch.subtract, torch.neg,
    torch.cat, torch.concat, torch.concatenate, torch.stack, torch.where})
_PRODUCTS: frozenset[Any] = frozenset({  # affine in each argument: one P that moves
    operator.mul, operator.matmul, torch.mul, torch.multiply, torch.matmul, torch.mm,
    torch.bmm, torch.mv, torch.outer, torch.einsum, torch.tensordot, torch.addmm, torch.addmv,
    torch.baddbmm, torch.addbmm, torch.addcmul})
_LAYERS: frozenset[Any] = frozenset({  # affine in every argument after the input, jointly
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.layer_norm, F.group_norm, F.prelu,
    *([F.rms_norm] if hasattr(F, "rms_norm") else [])})
_METHOD_SUMS = frozenset({"add", "sub", "subtract", "neg", "__add__", "__radd__", "__sub__"})
_METHOD_PRODUCTS = frozenset({"mul", "multiply", "matmul", "mm", "bmm", "mv", "outer",
                              "addmm", "addmv", "baddbmm", "addbmm", "addcmul", "__mul__",
                              "__rmul__", "__matmul__"})


def _affine_in(node: fx.Node, weights: list[fx.Node]) -> bool:
    """Whether the call is affine in the moving arguments ``weights`` jointly (:data:`_SUMS`)."""
    if node.op == "call_method":
        target = str(node.target)
        return target in _METHOD_SUMS or (target in _METHOD_PRODUCTS and len(weights) <= 1)
    target = node.target
    try:
        if target in _SUMS:
            return True
        if target in _PRODUCTS:
            return len(weights) <= 1
        if target in _LAYERS:
            first = node.args[0] if node.args else node.kwargs.get("input")
            return all(first is not w for w in weights)
    except TypeError:  # a target that cannot be hashed
        pass
    return False


def _subtract(a: Any, b: Any) -> Any:
    if isinstance(a, Tensor):
        return a - b if a.is_floating_point() else None
    if isinstance(a, (tuple, list)):
        return tuple(_subtract(x, y) for x, y in zip(a, b, strict=True))
    return None


def _add(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, Tensor):
        return a + b
    return tuple(_add(x, y) for x, y in zip(a, b, strict=True))


def true_gates(layer: TracedLayer, s0: Tensor) -> tuple[Tensor, Tensor]:
    """LAFTR's gates: (φ(s0), φ'(s0)) of the reference network itself."""
    rule = layer.rule
    assert is_gate(rule)  # called at gate layers only
    return rule.reference_gates(layer.module, s0)


def propagate_linearized(
    layers: list[TracedLayer],
    params0: Mapping[str, Tensor],
    params1: Mapping[str, Tensor] | None,
    x: Tensor,
    gate: GateFn = true_gates,
) -> tuple[Tensor, Tensor | None]:
    """Run the reference network and the network linearized around it.

    Args:
        layers: output of :func:`fsd.trace`.
        params0: reference parameters θ0 (detached).
        params1: parameters θ of the other network, or ``None`` to run the reference only.
        x: inputs, shape (n, *input_shape).
        gate: the reference activation and the gate at every gate layer (:data:`GateFn`).

    Returns:
        ``(z0, dz)``: reference outputs and output differences z1 − z0 (``None`` when
        ``params1`` is ``None``). With ``true_gates``, z0 is f(x, θ0), and dz is exact for
        networks without nonlinearities.
    """
    a0, da = x, None
    for layer in layers:  # each layer's step is its rule's (fsd.model.rules.Rule.linearized)
        a0, da = layer.rule.linearized(layer, a0, da, params0, params1, gate)
    if params1 is not None and da is None:
        da = torch.zeros_like(a0)
    return a0, da


def linearized_pass(model: nn.Module, layers: list[TracedLayer] | None,
                    reference: Mapping[str, Tensor], x: Tensor,
                    gate: GateFn | None = None) -> tuple[Tensor, Tensor]:
    """LAFTR's pass for ``model`` around ``reference``: over its chain, or else its graph.

    Args:
        model: the moved network (its parameters and buffers are θ).
        layers: the model's chain (:func:`fsd.trace`), or ``None`` to walk its graph.
        reference: θ0's parameters and buffers by name.
        x: inputs (n, ...).
        gate: the gates (:data:`fsd.model.rules.GateFn`; BGLN-S's draws), or ``None`` for
            the reference's own (LAFTR).

    Returns:
        ``(z0, dz)``: reference outputs and the linearized network's output differences.
    """
    if layers is None:
        return linearized_outputs(model, reference, x, gate)
    z0, dz = propagate_linearized(layers, reference, model_state(model), x, gate or true_gates)
    assert dz is not None  # the moved parameters were given
    return z0, dz
