"""LAFTR's linearized forward pass (paper eqs. 4–9), on chains and on any traceable graph.

On a chain of rule-tagged layers, :func:`propagate_linearized` runs the reference network θ0
as usual and the other network θ linearized around it at every nonlinearity. Differences are
propagated directly (Δs = ΔW a0 + W1 Δa + Δb), which avoids the cancellation of subtracting
two nearly equal outputs. The gates are supplied by the caller: the reference's own
1{s0 > 0} (LAFTR, :func:`true_gates`) or Bernoulli draws (BGLN-S).

The rest of this module evaluates LAFTR's definition on a torch.fx graph of any shape — residual
additions, concatenations, normalisation layers, attention, smooth activations — by carrying
through every node the reference value a0 and the difference Δa of the linearized network:

- a parameter-free operation f (``F.gelu``, ``+``, ``torch.cat``, ``softmax``, ``@`` of two
  activations, …) is replaced by its first-order expansion at the reference:
  Δout = J_f(a0) · Δa (``torch.func.jvp``); linear operations are therefore exact;
- a layer with parameters or buffers m(x; p) (``nn.LayerNorm``, ``nn.BatchNorm2d`` in
  evaluation mode, ``nn.MultiheadAttention``, …) is exact in its own parameters at the
  reference input and linear in its input: Δout = m(a0; p1) − m(a0; p0) + J_x m(a0; p1)·Δa,
  so the moved network's weights *and* running statistics count. ``nn.Linear`` and
  ``nn.Conv2d`` use the affine rule's form (ΔW a0 + W1 Δa + Δb, no cancellation);
- a parameter read directly in ``forward`` (``self.position``) enters with Δ = p1 − p0.

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
        gate: ``None`` — LAFTR: every operation linearized at the reference (JVPs); or a
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
    for step in plan.nodes:
        node = step.node
        if step.kind == "gate" and gate is not None:  # LAFTR linearizes it as any module
            value[node], delta[node] = _gated(plan.gates[node], gate, value, delta)
        elif node.op == "placeholder":
            value[node], delta[node] = x, None
        elif node.op == "get_attr":
            name = str(node.target)
            value[node] = reference[name]
            moved = current[name]
            delta[node] = moved - reference[name] if moved.is_floating_point() else None
        elif node.op == "call_module":
            assert step.module is not None  # a module call's module
            value[node], delta[node] = _module(node, step.module, reference, current, value,
                                               delta)
        elif node.op in ("call_function", "call_method"):
            value[node], delta[node] = _operation(node, value, delta)
        elif node.op == "output":
            out = node.args[0]
            assert isinstance(out, fx.Node)
            z0, dz = value[out], delta[out]
            return z0, torch.zeros_like(z0) if dz is None else dz
    raise AssertionError("a traced graph ends with an output node")


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


def _linearize(fn: Any, node: fx.Node, value: dict, delta: dict) -> tuple[Any, Any]:
    """fn(substitutions) at the reference, and its JVP along the inputs' differences.

    The output may be a tensor or a tuple of them (e.g. attention's (output, weights)); the
    difference has the same structure, ``None`` where an output does not move.
    """
    out0 = fn({})
    moving = _moving(node, value, delta)
    leaves, spec = tree_flatten(out0)
    moves = [i for i, leaf in enumerate(leaves)
             if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    if not moving or not moves:
        return out0, None

    def f(*primals: Tensor) -> tuple[Tensor, ...]:
        out, _ = tree_flatten(fn(dict(zip(moving, primals, strict=True))))
        return tuple(out[i] for i in moves)

    # an operation without a forward-mode derivative (weight_norm's kernel) takes two vjps;
    # attention's fast paths (taken under torch.no_grad()) are off inside
    tangents = autodiff.jvp(f, tuple(value[n] for n in moving),
                            tuple(delta[n] for n in moving))[1]
    d: list[Any] = [None] * len(leaves)
    for i, t in zip(moves, tangents, strict=True):
        d[i] = t
    return out0, tree_unflatten(d, spec)


def _operation(node: fx.Node, value: dict, delta: dict) -> tuple[Any, Any]:
    if node.target is operator.getitem and isinstance(value[node.args[0]], (tuple, list)):
        source, index = node.args[0], node.args[1]  # an item of a module's tuple output
        inner = delta[source]
        return value[source][index], None if inner is None else inner[index]

    def run(substitute: dict[fx.Node, Tensor]) -> Any:
        return evaluate(node, value, {}, substitute)  # a function or method call

    return _linearize(run, node, value, delta)


def _module(node: fx.Node, module: nn.Module, reference: Mapping[str, Tensor],
            current: Mapping[str, Tensor], value: dict, delta: dict) -> tuple[Any, Any]:
    prefix = f"{node.target}."
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    state0 = {n: reference[prefix + n] for n in names}
    state1 = {n: current[prefix + n] for n in names}
    rule = rules.RULES.get(type(module))
    if is_affine(rule):  # the chain's step: ΔW first, no cancellation as θ → θ0
        (a0,) = arguments(node, value)[0]
        return rule.linearized(TracedLayer("", module, rule), a0, delta[node.all_input_nodes[0]],
                               state0, state1, true_gates)

    # a module made with inplace=True would overwrite its input, which other nodes and
    # autograd still read: call its out-of-place twin
    function = out_of_place(module)

    def run(state: dict[str, Tensor]) -> Any:
        def call(substitute: dict[fx.Node, Tensor]) -> Any:
            args, kwargs = arguments(node, value, substitute)
            return functional_call(function, state, args, kwargs)
        return call

    out0, d = _linearize(run(state1), node, value, delta)
    # the reference side is evaluated with θ0's own parameters and buffers
    out0 = run(state0)({})
    if names:  # exact in the layer's own parameters and buffers at the reference input
        d = _add(_subtract(run(state1)({}), out0), d)
    return out0, d


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
