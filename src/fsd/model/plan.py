"""A model read once: the plan every walker works from.

:func:`read` reads a model's ``forward`` once per model and structure (its forward and its
submodules by path and identity; a changed one is read again) into a :class:`Plan`: the
torch.fx graph of the rule tracer (:mod:`fsd.model.tracing`), each module call's key, the
activations BGLN gates, every node with its kind, and — where the forward is one — its chain of
steps. :func:`trace` gives that chain as rule-tagged layers (a plain ``nn.Sequential`` is its chain
without tracing); LAFTR's and BGLN-S's graph walk (:mod:`fsd.model.linearize`) and BGLN-D's exact
moments on graphs (:mod:`fsd.moments.exact_graph`) walk :attr:`Plan.nodes`. The one other trace is
:func:`fsd.model.tracing.runnable`'s, with the same tracer: a fresh graph it may change, for
recording statistics at fit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property

from torch import fx, nn

from . import rules, support
from .hooks import forward_hooks
from .rules import Cast, TracedLayer, UnsupportedModuleError, rule_for
from .tracing import (
    UNGATED_FUNCTIONS,
    UNGATED_METHODS,
    _gate_call,
    _is_batch_size,
    _replacement,
    _symbolic_trace,
    call_site_paths,
    cast_dtype,
    unwrap,
)


@dataclass(frozen=True)
class ChainStep:
    """One step of a traced chain: the module it runs and its path.

    The path is the module's, or for a module called at several places the call's graph node
    name (:func:`call_site_paths`).
    """

    path: str
    module: nn.Module
    replaced_call: bool  # a function call in forward, run here as an equivalent module


@dataclass(frozen=True)
class GateNode:
    """An activation in a traced graph that BGLN gates.

    Attributes:
        path: the module's attribute path for a module call, the graph node's name for a
            function call (``F.relu(x)`` → ``"relu"``) — the path :func:`runnable` gives the
            module it puts in the call's place, so statistics recorded there match — or for
            each call of a module called at several places, the call's node name
            (:func:`call_site_paths`).
        module: the module called, or the equivalent module of a function call.
        input: the graph node of the pre-activation.
    """

    path: str
    module: nn.Module
    input: fx.Node


@dataclass(frozen=True)
class PlanNode:
    """One node of a :class:`Plan`'s graph, with what the walkers ask of it.

    Attributes:
        node: the torch.fx node.
        kind: ``"input"`` (the placeholder), ``"parameter"`` (a ``get_attr``), ``"gate"``
            (an activation BGLN gates: :attr:`Plan.gates`), ``"module"`` (another module
            call), ``"operation"`` (a function or method call) or ``"output"``.
        path: a module call's key (:func:`fsd.model.tracing.call_site_paths`) or a gate's path;
            ``None`` for other nodes.
        module: the module called (a gate call's equivalent module); ``None`` for others.
        last_use: the position of the last node that reads it (−1: none does).
    """

    node: fx.Node
    kind: str
    path: str | None
    module: nn.Module | None
    last_use: int


# in torch.nn.modules.activation, but not elementwise activations a gate could replace
_NOT_ACTIVATIONS = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.MultiheadAttention,
                    nn.GLU)


class Plan:
    """A model's ``forward`` read once (:func:`read`); each part is read on first use.

    The plan keeps a weak reference to the model: it does not keep the model alive.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def _live(self) -> nn.Module:
        model = self._model()
        if model is None:  # read() keys plans by model: a caller holds it while reading
            raise RuntimeError("the model of this plan was freed")
        return model

    @cached_property
    def _traced(self) -> tuple[fx.Graph, dict[fx.Node, str], dict[fx.Node, GateNode]]:
        model = self._live()
        graph = _symbolic_trace(model).graph
        modules = dict(model.named_modules())
        sites = call_site_paths(graph, modules)
        return graph, sites, _find_gates(graph, modules, sites)

    @property
    def graph(self) -> fx.Graph:
        """``model``'s forward as a torch.fx graph, traced with the rule tracer (cached).

        Modules that have a rule are leaves (one ``call_module`` node each), so node names, and
        hence paths, are those of :func:`chain` and :func:`fsd.model.tracing.runnable`. The graph
        is shared: read it, do not change it.

        Raises:
            UnsupportedModuleError: fx cannot trace the forward (data-dependent control
                flow).
        """
        return self._traced[0]

    @property
    def sites(self) -> dict[fx.Node, str]:
        """Every module call's key: what its statistics are stored under."""
        return self._traced[1]

    @property
    def gates(self) -> dict[fx.Node, GateNode]:
        """The activations BGLN gates in :func:`traced_graph`, by node, in graph order.

        A gate node is a call of a module whose rule is a :class:`~fsd.model.rules.GateRule`
        (path: the module's path), or a function call that the chain reads as such a module
        (``F.relu``, ``torch.relu``, ``x.relu()``, ``F.leaky_relu``, ``F.gelu``, ``F.silu``,
        ``torch.tanh``, ``torch.sigmoid``, ``F.elu``, ``F.softplus``, …; path: the node's name) — in
        both cases only where its input depends on the model's input: an activation of parameters
        alone (``F.softplus(self.scale)``) is not a unit's response to the data: it is evaluated
        exactly on both networks (:mod:`fsd.model.linearize`).
        """
        return self._traced[2]

    @cached_property
    def ungated(self) -> list[str]:
        """Activations on the data that BGLN does not gate, as ``"<what> at '<path>'"``.

        ``nn.ReLU6``, ``nn.Hardtanh``, ``F.hardswish``, ``torch.clamp`` other than at zero from
        below, ``torch.maximum``, …: no gate rule says what a Bernoulli gate of theirs is, so
        the graph walk linearizes them at the reference, as LAFTR does everywhere.
        """
        model = self._live()
        modules = dict(model.named_modules())
        data: set[fx.Node] = set()
        found = []
        for node in self.graph.nodes:
            if node.op == "placeholder" or any(n in data for n in node.all_input_nodes):
                data.add(node)
            if node not in data or node in self.gates:
                continue
            if node.op == "call_module":
                module = modules[str(node.target)]
                kind = type(module)
                if (kind.__module__ == "torch.nn.modules.activation" and kind not in rules.RULES
                        and kind not in _NOT_ACTIVATIONS):
                    found.append(f"{kind.__name__} at '{self.sites[node]}'")
            elif (node.op == "call_function" and node.target in UNGATED_FUNCTIONS) or (
                    node.op == "call_method" and node.target in UNGATED_METHODS):
                name = getattr(node.target, "__name__", str(node.target))
                found.append(f"{name} at '{node.name}'")
        return found

    @cached_property
    def nodes(self) -> tuple[PlanNode, ...]:
        """Every node of :attr:`graph` in order, with its kind, key and liveness."""
        model = self._live()
        modules = dict(model.named_modules())
        held = {name for name, _ in model.named_parameters()} | {
            name for name, _ in model.named_buffers()}
        order = list(self.graph.nodes)
        position = {n: i for i, n in enumerate(order)}
        planned = []
        for node in order:
            path: str | None = None
            module: nn.Module | None = None
            if node in self.gates:
                kind, path, module = "gate", self.gates[node].path, self.gates[node].module
            elif node.op == "call_module":
                kind, path, module = "module", self.sites[node], modules[str(node.target)]
            else:
                if node.op == "get_attr" and str(node.target) not in held:
                    # θ0 is the parameters and buffers: another tensor has no reference value
                    raise UnsupportedModuleError(
                        f"{type(model).__name__}.forward reads '{node.target}', a tensor that "
                        f"is neither a parameter nor a buffer (a plain attribute, or a tensor "
                        f"made in forward): register it with self.register_buffer so the "
                        f"summary holds it")
                kind = {"placeholder": "input", "get_attr": "parameter",
                        "output": "output"}.get(node.op, "operation")
            planned.append(PlanNode(node, kind, path, module,
                                    max((position[u] for u in node.users), default=-1)))
        return tuple(planned)

    @cached_property
    def _chain(self) -> list[ChainStep] | str:
        model = self._live()
        try:
            return _trace_chain(model, self.graph, self.sites)
        except UnsupportedModuleError as error:
            return str(error)

    def chain(self) -> list[ChainStep]:
        """The steps of ``model``'s ``forward`` as a chain (see :mod:`fsd.model.tracing`).

        Raises:
            UnsupportedModuleError: the model cannot be traced, its graph branches, or an
                operation has no rule; the message names the operation and the graph node.
        """
        steps = self._chain
        if isinstance(steps, str):
            raise UnsupportedModuleError(steps)
        return list(steps)


# plans by model, with the structure they were read from: distance() reads the model on every
# call, and fx costs milliseconds
_PLANS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Plan]] = weakref.WeakKeyDictionary()


def _structure(model: nn.Module) -> tuple:
    """What a plan depends on: the forward, the submodules by path and identity, the rules.

    A forward set on the instance is held weakly (a bound method holds the model, which would
    then never leave the cache). The rule registry's identity and size tell a rule registered
    since (the tracer stops at modules with a rule).
    """
    forward: object = model.__dict__.get("forward")
    if forward is not None:
        try:
            forward = weakref.ref(forward)
        except TypeError:  # a callable that takes no weak reference: held as it is
            pass
    return (type(model).forward, forward,
            id(rules.RULES), len(rules.RULES),
            tuple((path, id(m), type(m)) for path, m in model.named_modules()))


def read(model: nn.Module) -> Plan:
    """``model``'s plan: read once per model and structure, then shared (do not change it)."""
    structure = _structure(model)
    cached = _PLANS.get(model)
    if cached is None or cached[0] != structure:
        cached = (structure, Plan(model))
        _PLANS[model] = cached
    return cached[1]


def chain(model: nn.Module) -> list[ChainStep]:
    """``read(model).chain()`` (:meth:`Plan.chain`): the forward as a chain of steps."""
    return read(model).chain()


def traced_graph(model: nn.Module) -> fx.Graph:
    """``read(model).graph`` (:attr:`Plan.graph`): the forward as a torch.fx graph."""
    return read(model).graph


def gate_nodes(model: nn.Module) -> dict[fx.Node, GateNode]:
    """``read(model).gates`` (:attr:`Plan.gates`): the activations BGLN gates, by node."""
    return read(model).gates


def _find_gates(graph: fx.Graph, modules: dict[str, nn.Module], sites: dict[fx.Node, str]
                ) -> dict[fx.Node, GateNode]:
    gates: dict[fx.Node, GateNode] = {}
    data: set[fx.Node] = set()  # nodes that depend on the model's input
    for node in graph.nodes:
        if node.op == "placeholder" or any(n in data for n in node.all_input_nodes):
            data.add(node)
        if node.op == "call_module":
            module = modules[str(node.target)]
            path = sites[node]
            rule = rules.RULES.get(type(module))
            if not rules.is_gate(rule):
                continue
        elif node.op in ("call_function", "call_method"):
            replacement = _gate_call(node)
            if replacement is None:
                continue
            module, path = replacement, node.name
        else:
            continue
        source = _gate_input(node)
        if source is not None and source in data:
            gates[node] = GateNode(path, module, source)
    return gates


def _gate_input(node: fx.Node) -> fx.Node | None:
    """The graph node an activation is applied to (its first argument)."""
    value = node.args[0] if node.args else node.kwargs.get("input")
    return value if isinstance(value, fx.Node) else None


def _trace_chain(model: nn.Module, graph: fx.Graph, sites: dict[fx.Node, str]
                 ) -> list[ChainStep]:
    name = type(model).__name__
    modules = dict(model.named_modules())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UnsupportedModuleError(f"{name}.forward takes {len(placeholders)} inputs; "
                                     f"LAFTR and BGLN need exactly one: "
                                     f"{support.SEVERAL_INPUTS}")
    current = placeholders[0]
    steps: list[ChainStep] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            if node.args[0] is not current:
                raise _branch_error(name, node, "the output is not the last step's result")
            break
        if _is_batch_size(node):
            continue  # x.size(0) / len(x), read by a flattening view
        inputs = [a for a in node.all_input_nodes if not _is_batch_size(a)]
        if inputs != [current]:
            read = (f"it reads {', '.join(map(str, inputs))} instead of the previous step "
                    f"'{current}'" if inputs else
                    f"it does not read the previous step '{current}' (a size other than the "
                    f"batch's, x.size(0), read from a shape?)")
            raise _branch_error(name, node, read)
        steps.append(_step(name, node, modules, sites))
        current = node
    if not steps:
        raise UnsupportedModuleError(f"{name}.forward has no layers")
    return steps


def _step(name: str, node: fx.Node, modules: dict[str, nn.Module],
          sites: dict[fx.Node, str]) -> ChainStep:
    if node.op == "call_module":
        return ChainStep(sites[node], modules[str(node.target)], False)
    module = _replacement(node)
    if module is None:
        dtype = cast_dtype(node)  # x.float(), x.to(torch.float32): a layer with a rule
        module = None if dtype is None else Cast(dtype)
    if module is not None:
        return ChainStep(node.name, module, True)
    what = getattr(node.target, "__name__", str(node.target))
    raise UnsupportedModuleError(
        f"operation {what} ({node.op}) at graph node '{node.name}' of {name}.forward has no "
        f"rule; BGLN-D supports the modules of fsd.model.rules.RULES, their functional "
        f"forms (F.relu, F.leaky_relu, F.gelu, torch.tanh, …) and flattening. "
        f"Use the module form (e.g. nn.ReLU()), register a rule for a module that does it "
        f"(fsd.register_rule), or {support.advice(support.BGLN_D, support.Feature.NO_RULE)}")


def _branch_error(name: str, node: fx.Node, why: str) -> UnsupportedModuleError:
    what = getattr(node.target, "__name__", str(node.target))
    return UnsupportedModuleError(
        f"{name}.forward is not a chain of layers at graph node '{node.name}' ({what}): {why}. "
        f"{support.describe(support.BGLN_D)}; "
        f"{support.advice(support.BGLN_D, support.Feature.BRANCH)}")


def trace(model: nn.Module) -> list[TracedLayer]:
    """The model as the chain of its rule-tagged layers.

    Nested ``nn.Sequential`` containers of layers with rules are flattened directly; any
    other model (a class with a ``forward``, a Sequential subclass, wrappers) is traced with
    torch.fx (:func:`chain`). A module without parameters or buffers (a ReLU, a
    max-pool) may be called at several positions: each call is its own layer, under its
    position's path in a Sequential or its call's graph node name in a traced class
    (:func:`fsd.model.tracing.call_site_paths`), with its own statistics. Raises
    :class:`~fsd.model.rules.UnsupportedModuleError` naming the class and path of the first module
    that has no rule, of a module with parameters used at two positions (the chain walkers
    read a layer's parameters by its path), or of the graph node where a traced model stops
    being a chain.
    """
    model = unwrap(model)
    # a user's class is traced; torch's own layers (the root itself) get the rule's message
    if not _plain(model) and not type(model).__module__.startswith("torch.nn."):
        layers = [TracedLayer(step.path, step.module, rule_for(step.module, step.path))
                  for step in chain(model)]
        calls: set[int] = set()
        for layer in layers:
            if id(layer.module) in calls and not _stateless(layer.module):
                path = next(p for p, m in model.named_modules() if m is layer.module)
                raise UnsupportedModuleError(
                    f"module {type(layer.module).__name__} at '{path}' is called twice in "
                    f"forward: the chain walk reads a layer's parameters by its path; "
                    f"{_SHARED_WEIGHTS}")
            calls.add(id(layer.module))
        _check_hooks(model)
        return layers
    layers: list[TracedLayer] = []
    seen: dict[int, str] = {}

    def visit(module: nn.Module, path: str) -> None:
        # a module object at two positions is two layers, each under its position's path;
        # one with parameters would be read by one path only: refuse it
        if id(module) in seen and not _stateless(module):
            raise UnsupportedModuleError(
                f"module {type(module).__name__} at '{path or '<root>'}' is the same object as "
                f"at '{seen[id(module)] or '<root>'}': the chain walk reads a layer's "
                f"parameters by its path; {_SHARED_WEIGHTS}")
        seen[id(module)] = path
        if type(module) is nn.Sequential:
            for name, child in module._modules.items():
                if child is not None:
                    visit(child, f"{path}.{name}" if path else name)
        else:
            layers.append(TracedLayer(path, module, rule_for(module, path)))

    visit(model, "")
    if not layers:
        raise UnsupportedModuleError("the model has no layers")
    _check_hooks(model)
    return layers


_SHARED_WEIGHTS = (f"give each position its own module, or "
                   f"{support.advice(support.BGLN_D, support.Feature.SHARED_WEIGHTS)}")


def _stateless(module: nn.Module) -> bool:
    """No parameters and no buffers: calling it at two places shares nothing but its type."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def _plain(module: nn.Module) -> bool:
    """Nested exact ``nn.Sequential`` containers of modules with a rule (no tracing needed)."""
    if type(module) is nn.Sequential:
        return all(_plain(child) for child in module._modules.values() if child is not None)
    return type(module) in rules.RULES


def _check_hooks(model: nn.Module) -> None:
    hooks = forward_hooks(model)
    if hooks:
        raise UnsupportedModuleError(
            f"the model has a {hooks[0]}: LAFTR and BGLN evaluate the layers from their rules "
            f"and would ignore what the hook changes; remove it (handle.remove()) or "
            f"{support.advice(support.LAFTR, support.Feature.HOOK)}")
