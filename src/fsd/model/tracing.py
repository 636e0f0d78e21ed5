"""torch.fx for models written as classes: the rule tracer and what :mod:`fsd.model.plan` reads.

:mod:`fsd.model.plan` reads a model's ``forward`` once with this module's tracer, which stops at
every module with a rule (:mod:`fsd.model.rules`), and reads the graph as a chain where it is one:
modules called in ``forward`` (nested ones included), and the functional forms of the
parameter-free layers, which are replaced by the equivalent module so that every step has a
rule and a path:

- ``F.relu(x)``, ``torch.relu(x)``, ``x.relu()`` → ``nn.ReLU``;
- ``F.leaky_relu(x, slope)`` → ``nn.LeakyReLU(slope)``;
- smooth activations: ``F.gelu``, ``F.silu``, ``torch.tanh``/``x.tanh()``,
  ``torch.sigmoid``/``x.sigmoid()``, ``F.elu``, ``F.softplus`` → their modules (constant
  hyper-parameters only);
- ``torch.flatten(x, 1)``, ``x.flatten(1)``, ``x.view(x.size(0), -1)``,
  ``x.reshape(len(x), -1)`` → ``nn.Flatten``.

A module's path is its attribute path (``"body.0"``); a replaced call's path is its graph
node's name (``"relu"``, ``"flatten_1"``). Wrappers are looked through: ``torch.compile``
(``_orig_mod``) and ``DistributedDataParallel``/``DataParallel`` (``module``). A graph that is
not a chain (a residual ``+``, ``torch.cat`` of two branches) or an operation without a rule
raises :class:`~fsd.model.rules.UnsupportedModuleError` naming the operation and its node: BGLN-D
needs the chain. LAFTR and BGLN-S take any graph (:mod:`fsd.model.linearize`), reading its gates
with :func:`fsd.model.plan.gate_nodes` — the same tracer, so the same paths; ExactFSD, NTK, EWC and
KFAC run the model's own forward.

Call sites: a module called at more than one place in ``forward`` (torchvision's
``BasicBlock`` calls ``self.relu`` twice; a shared ``MaxPool2d``) is one node per call, and
each call is keyed by its graph node's name (``"layer1_0_relu"``, ``"layer1_0_relu_1"``)
instead of the module's path (:func:`call_site_paths`), so every call site has its own
statistics. A module called once keeps its path, as before.

In-place operations: the traced graph is rewritten so that no node writes to a tensor that
another node reads: ``x.relu_()``, ``F.relu(x, inplace=True)``, ``torch.relu_(x)``,
``x.add_(y)`` become their out-of-place forms, and every later reader of the tensor an
in-place operation wrote reads that operation's result instead — what the eager forward
computes. A module with ``inplace=True`` (``nn.ReLU(inplace=True)``) stays in the graph; the
walkers call it through :func:`out_of_place`. An in-place write that another tensor would see
through a view taken before it is refused.
"""

from __future__ import annotations

import copy
import inspect
import operator
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.node import map_arg

from . import rules, support
from .rules import UnsupportedModuleError

_RELU_FUNCTIONS = (F.relu, torch.relu)
_FLATTEN_FUNCTIONS = (torch.flatten,)


def _constant(node: fx.Node, position: int, name: str, default: Any) -> Any:
    """Argument ``name`` of a call (at ``position`` or as a keyword), if it is a constant."""
    value = node.kwargs.get(name, node.args[position] if len(node.args) > position else default)
    return None if isinstance(value, fx.Node) else value


# elementwise activations with a rule, by the function (or tensor method) that computes them:
# the module that does the same, given the call (None: an argument is not a constant)
_SMOOTH_FUNCTIONS: dict[Any, Callable[[fx.Node], nn.Module | None]] = {
    F.gelu: lambda n: nn.GELU(approximate=str(_constant(n, 1, "approximate", "none"))),
    F.silu: lambda n: nn.SiLU(),
    torch.tanh: lambda n: nn.Tanh(),
    F.tanh: lambda n: nn.Tanh(),
    torch.sigmoid: lambda n: nn.Sigmoid(),
    F.sigmoid: lambda n: nn.Sigmoid(),
    F.elu: lambda n: None if _constant(n, 1, "alpha", 1.0) is None
    else nn.ELU(float(_constant(n, 1, "alpha", 1.0))),
    F.softplus: lambda n: None if None in (_constant(n, 1, "beta", 1.0),
                                           _constant(n, 2, "threshold", 20.0))
    else nn.Softplus(float(_constant(n, 1, "beta", 1.0)),
                     float(_constant(n, 2, "threshold", 20.0))),
}
_SMOOTH_METHODS: dict[str, Callable[[], nn.Module]] = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside its wrappers: compile, (Distributed)DataParallel, AveragedModel."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel,
                              torch.optim.swa_utils.AveragedModel)):
            inner = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            inner = model._orig_mod  # torch.compile's wrapper
        else:
            return model
        assert isinstance(inner, nn.Module)
        model = inner


class _RuleTracer(fx.Tracer):
    """fx's tracer, stopping at every module that has a rule (a user's registered layer too)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return type(m) in rules.RULES or super().is_leaf_module(m, module_qualified_name)


def _untraceable() -> str:
    return support.advice(support.LAFTR, support.Feature.UNTRACEABLE)


def _symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """A fresh GraphModule of ``model`` (the rule tracer), with a one-line error if fx fails."""
    try:
        graph = _RuleTracer().trace(model)
    except Exception as error:  # fx raises many types for data-dependent control flow
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UnsupportedModuleError(
            f"cannot trace {type(model).__name__}.forward with torch.fx "
            f"({type(error).__name__}: {first}); LAFTR and BGLN need a forward without "
            f"data-dependent control flow — or {_untraceable()}") from None
    _functionalize(graph, dict(model.named_modules()))
    _drop_copies(graph)
    return fx.GraphModule(model, graph, type(model).__name__)


# copies that keep every value (and dtype, and gradient): ``x.contiguous()``, ``x.clone()``
_COPY_METHODS = frozenset({"contiguous", "clone"})
_COPY_FUNCTIONS = frozenset({torch.clone})


def _drop_copies(graph: fx.Graph) -> None:
    """Remove the operations that return their input's values unchanged (in place).

    ``contiguous`` and ``clone`` anywhere, and ``detach`` of the forward's input or of what
    is computed from it alone (no gradient to stop): each reader reads the operation's input
    instead. A ``detach`` after a layer stays (it stops gradients to that layer). Run after
    :func:`_functionalize`, so no in-place write can reach a tensor through a removed copy.
    """
    for node in list(graph.nodes):
        source = node.args[0] if node.args else None
        if not isinstance(source, fx.Node):
            continue
        copies = ((node.op == "call_method" and node.target in _COPY_METHODS)
                  or (node.op == "call_function" and node.target in _COPY_FUNCTIONS))
        detach = _from_input_alone(source) and (
            (node.op == "call_method" and node.target == "detach")
            or (node.op == "call_function" and node.target is torch.detach))
        extra = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
        if (copies or detach) and not extra:
            node.replace_all_uses_with(source)
            graph.erase_node(node)


# augmented assignments, should fx record them (for tensors Python falls back to ``+``)
_INPLACE_OPERATORS: dict[Any, Any] = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow,
    operator.imatmul: operator.matmul, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor,
    operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
}
# in-place methods that only set a flag or share memory: not writes to the values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
# operations whose result may share memory with their first argument
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose",
    "permute", "t", "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select",
    "unfold", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "split", "chunk",
    "unbind", "tensor_split", "as_strided", "detach", "contiguous", "real", "imag",
})
_VIEW_FUNCTIONS = frozenset({
    torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.squeeze,
    torch.unsqueeze, torch.narrow, torch.select, torch.split, torch.chunk, torch.unbind,
    torch.movedim, torch.swapaxes, torch.diagonal, torch.t, torch.detach,
    torch.tensor_split, operator.getitem,
})
_VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)


def _on_copy(x: torch.Tensor, method: str, *args: Any, **kwargs: Any) -> Any:
    """``x.<method>(*args)`` on a copy of ``x``: an in-place method without an out-of-place form."""
    return getattr(x.clone(), method)(*args, **kwargs)


def out_of_place(module: nn.Module) -> nn.Module:
    """``module``, or for one made with ``inplace=True`` a shallow copy that is not in place.

    The walkers call modules on tensors that other nodes (and autograd) still read; an
    ``nn.ReLU(inplace=True)`` would overwrite them. The copy shares the parameters.
    """
    if getattr(module, "inplace", False) is not True:
        return module
    twin = copy.copy(module)
    twin.__dict__["inplace"] = False  # the copy's own attribute: the original is untouched
    return twin


def _inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


def _inplace_argument(node: fx.Node) -> int | str | None:
    """Where a function call passes ``inplace=True`` (a keyword or a position), if it does."""
    if node.kwargs.get("inplace") is True:
        return "inplace"
    try:
        names = list(inspect.signature(node.target).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # builtins without a signature
        return None
    position = names.index("inplace") if "inplace" in names else len(node.args)
    return position if position < len(node.args) and node.args[position] is True else None


def _inplace_function(target: Any) -> tuple[str, Any] | None:
    """(name, out-of-place twin or None) of ``torch.relu_``, ``F.leaky_relu_``, …."""
    name = getattr(target, "__name__", "")
    if not isinstance(name, str) or not _inplace_name(name):
        return None
    for namespace in (F, torch):
        if getattr(namespace, name, None) is target:
            return name, getattr(namespace, name[:-1], None)
    return None


def _written(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The node whose tensor ``node`` overwrites in place, if it does (its first argument)."""
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_method" and _inplace_name(str(node.target)):
        return first
    if node.op == "call_function" and (node.target in _INPLACE_OPERATORS
                                       or _inplace_function(node.target) is not None
                                       or _inplace_argument(node) is not None):
        return first
    if node.op == "call_module" and getattr(modules.get(str(node.target)), "inplace",
                                            False) is True:
        return first
    return None


def _make_out_of_place(node: fx.Node) -> None:
    """Rewrite an in-place call (not a module's) as the out-of-place call it equals."""
    if node.op == "call_method":
        name = str(node.target)
        if callable(getattr(torch.Tensor, name[:-1], None)):
            node.target = name[:-1]  # x.relu_() → x.relu()
        else:  # x.copy_(y), x.fill_(v): the same method on a copy
            node.op, node.target = "call_function", _on_copy
            node.args = (node.args[0], name, *node.args[1:])
        return
    if node.op != "call_function":
        return  # a module with inplace=True: the walkers call out_of_place(module)
    if node.target in _INPLACE_OPERATORS:
        node.target = _INPLACE_OPERATORS[node.target]
        return
    where = _inplace_argument(node)
    if isinstance(where, str):
        node.kwargs = {**node.kwargs, where: False}
        return
    if where is not None:
        node.args = (*node.args[:where], False, *node.args[where + 1:])
        return
    found = _inplace_function(node.target)
    assert found is not None  # _written said it writes
    name, twin = found
    if twin is not None:
        node.target = twin  # torch.relu_(x) → torch.relu(x)
    else:
        node.target = _on_copy
        node.args = (node.args[0], name, *node.args[1:])


def _is_view(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), _VIEW_MODULES)
    return False


def _functionalize(graph: fx.Graph, modules: dict[str, nn.Module]) -> None:
    """Rewrite the in-place operations of a traced graph as out-of-place ones (in place).

    Each later reader of the tensor an in-place operation writes reads the operation's
    result instead, which is what the eager forward computes; a write that a tensor taken
    as a view before it (``v = x.view(…); x.relu_(); … v``) would see is refused, since
    the rewritten graph could not show it.

    Raises:
        UnsupportedModuleError: an in-place write seen through a view.
    """
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    aliases: dict[fx.Node, set[fx.Node]] = {}  # nodes that may share memory, by node

    def join(a: fx.Node, b: fx.Node) -> None:
        group = aliases.setdefault(a, {a}) | aliases.setdefault(b, {b})
        for member in group:
            aliases[member] = group

    for node in nodes:
        written = _written(node, modules)
        if written is None:
            source = node.args[0] if node.args else None
            if isinstance(source, fx.Node) and _is_view(node, modules):
                join(node, source)
            continue
        here = position[node]
        for other in aliases.get(written, {written}) - {written}:
            late = [u for u in other.users if position[u] > here]
            if position[other] < here and late:
                what = getattr(node.target, "__name__", str(node.target))
                raise UnsupportedModuleError(
                    f"the in-place operation {what} at graph node '{node.name}' writes to "
                    f"'{written.name}', which graph node '{late[0].name}' reads through "
                    f"'{other.name}', a view taken before the write; LAFTR and BGLN need "
                    f"that operation written out of place (e.g. x = x.relu()), or "
                    f"{_untraceable()}")
        for user in list(written.users):
            if position[user] > here:
                user.replace_input_with(written, node)
        _make_out_of_place(node)
        join(node, written)


def _from_input_alone(node: fx.Node) -> bool:
    """Whether ``node`` is computed from the forward's inputs without a module or parameter."""
    seen: set[fx.Node] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op in ("call_module", "get_attr"):
            return False
        pending.extend(current.all_input_nodes)
    return True


def call_site_paths(graph: fx.Graph, modules: dict[str, nn.Module]) -> dict[fx.Node, str]:
    """The key of every module call of a traced graph: what its statistics are stored under.

    A module called at one place keeps its path (``"body.0"``); each call of a module called
    at several (torchvision's ``self.relu``) is keyed by its graph node's name
    (``"layer1_0_relu"``, ``"layer1_0_relu_1"``), which is the same for every trace of the
    same forward, so fit and distance, and a saved summary, agree.

    Raises:
        UnsupportedModuleError: a call site's node name is the path of a module called
            once, so two keys would be the same.
    """
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    keys: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        if calls[target] > 1 and calls.get(node.name) == 1 and node.name in modules:
            raise UnsupportedModuleError(
                f"the call of '{target}' at graph node '{node.name}' (one of its "
                f"{calls[target]} calls) would be keyed '{node.name}', which is also the "
                f"path of the module called there; rename that module")
        keys[node] = target if calls[target] == 1 else node.name
    return keys


def arguments(node: fx.Node, value: Mapping[fx.Node, Any],
              substitute: Mapping[fx.Node, Any] | None = None) -> tuple[Any, Any]:
    """A node's ``args`` and ``kwargs`` from the values of the nodes it reads, some replaced."""
    chosen = substitute or {}

    def pick(n: fx.Node) -> Any:
        return chosen.get(n, value[n])
    return map_arg(node.args, pick), map_arg(node.kwargs, pick)


def evaluate(node: fx.Node, value: Mapping[fx.Node, Any], modules: Mapping[str, nn.Module],
             substitute: Mapping[fx.Node, Any] | None = None) -> Any:
    """A call node's output from :func:`arguments` (a module called out of place)."""
    args, kwargs = arguments(node, value, substitute)
    if node.op == "call_module":  # never in place: other nodes read the same values
        return out_of_place(modules[str(node.target)])(*args, **kwargs)
    if node.op == "call_method":
        self_arg, *rest = args
        return getattr(self_arg, str(node.target))(*rest, **kwargs)
    return node.target(*args, **kwargs)  # type: ignore[operator]


def runnable(model: nn.Module) -> nn.Module:
    """A module that computes ``model``'s function with a module at every activation.

    ``model`` itself, unless its forward calls parameter-free layers as functions (activations
    such as ``F.relu``, and flattening): then an ``fx.GraphModule`` sharing its modules and
    parameters, in which those calls are modules named by their graph nodes' names (the paths
    of :func:`fsd.model.plan.chain` and :func:`fsd.model.plan.gate_nodes`), so that statistics can
    be recorded at every activation. Any traceable graph works, not only a chain: the other
    operations stay as they are.

    Raises:
        UnsupportedModuleError: the forward cannot be traced, or the model has an attribute
            named like a graph node that needs a module.
    """
    module = _symbolic_trace(model)
    replaced = False
    for node in list(module.graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        replacement = _replacement(node)
        if replacement is None:
            continue
        if hasattr(module, node.name):
            raise UnsupportedModuleError(f"{type(model).__name__} has an attribute "
                                         f"'{node.name}', the name of a graph node fsd needs")
        path = node.name
        module.add_submodule(path, replacement)
        with module.graph.inserting_after(node):
            call = module.graph.call_module(path, (node.all_input_nodes[0],))
        node.replace_all_uses_with(call)
        module.graph.erase_node(node)
        replaced = True
    if not replaced:
        return model
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


def _gate_call(node: fx.Node) -> nn.Module | None:
    """The activation module that a function call computes (``None``: not one we read)."""
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS and not _inplace(node):
        return nn.ReLU()
    if node.op == "call_method" and node.target == "relu":
        return nn.ReLU()
    if _clamps_at_zero(node):
        return nn.ReLU()
    if node.op == "call_function" and node.target is F.leaky_relu and not _inplace(node):
        slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
        if isinstance(slope, (int, float)):  # a constant, not a traced value
            return nn.LeakyReLU(float(slope))
    if node.op == "call_function" and node.target in _SMOOTH_FUNCTIONS and not _inplace(node):
        return _SMOOTH_FUNCTIONS[node.target](node)
    if node.op == "call_method" and node.target in _SMOOTH_METHODS:
        return _SMOOTH_METHODS[str(node.target)]()
    return None


def _clamps_at_zero(node: fx.Node) -> bool:
    """``torch.clamp(x, min=0)``, ``x.clamp(min=0)``, ``x.clamp_min(0)``: a ReLU spelled so."""
    if node.op == "call_function" and node.target in (torch.clamp, torch.clamp_min):
        pass
    elif not (node.op == "call_method" and node.target in ("clamp", "clamp_min")):
        return False
    low = node.kwargs.get("min", node.args[1] if len(node.args) > 1 else None)
    high = node.kwargs.get("max", node.args[2] if len(node.args) > 2 else None)
    return (isinstance(low, (int, float)) and not isinstance(low, bool) and low == 0
            and high is None)


# activations BGLN has no gate for: the graph walk linearizes them at the reference instead
# (fsd.model.plan.Plan.ungated names them)
UNGATED_FUNCTIONS = (F.relu6, F.hardtanh, F.threshold, F.hardswish, F.hardsigmoid, F.selu,
                     F.celu, F.mish, F.prelu, F.rrelu, F.logsigmoid, F.hardshrink,
                     F.softshrink, F.softsign, F.tanhshrink, torch.clamp, torch.clamp_min,
                     torch.clamp_max, torch.maximum, torch.minimum)
UNGATED_METHODS = ("clamp", "clamp_min", "clamp_max", "maximum", "minimum")


def _replacement(node: fx.Node) -> nn.Module | None:
    """The module that computes a function call of a chain (activation or flattening)."""
    module = _gate_call(node)
    if module is not None:
        return module
    flatten = _flatten_start(node)
    return None if flatten is None else nn.Flatten(flatten)


_CAST_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                 "bfloat16": torch.bfloat16}


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The floating dtype ``node`` casts to: ``x.float()``, ``x.to(torch.float32)``, …; else None.

    Only a cast to a floating dtype and nothing else (no device, no other tensor's dtype).
    """
    if node.op != "call_method" or len(node.args) < 1:
        return None
    if node.target in _CAST_METHODS and len(node.args) == 1 and not node.kwargs:
        return _CAST_METHODS[str(node.target)]
    if node.target == "to":
        given = [*node.args[1:], *node.kwargs.values()]
        if (len(given) == 1 and isinstance(given[0], torch.dtype)
                and given[0].is_floating_point and set(node.kwargs) <= {"dtype"}):
            return given[0]
    return None


def _inplace(node: fx.Node) -> bool:
    return bool(node.kwargs.get("inplace", False))


def _is_batch_size(node: fx.Node) -> bool:
    # x.size(0), x.shape[0], len(x): only ever feeds a view/reshape that keeps the batch
    if node.op == "call_method" and node.target == "size":
        return bool((len(node.args) > 1 and node.args[1] == 0)
                    or node.kwargs.get("dim") == 0)
    if node.op == "call_function" and node.target is len:
        return True
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return bool(isinstance(source, fx.Node) and source.op == "call_function"
                    and source.target is getattr and source.args[1:] == ("shape",)
                    and node.args[1] == 0)
    if node.op == "call_function" and node.target is getattr:
        return bool(node.args[1:] == ("shape",)) and all(
            user.op == "call_function" and user.target is operator.getitem
            for user in node.users)
    return False


def _flatten_start(node: fx.Node) -> int | None:
    """The start dim if ``node`` flattens everything after it (else ``None``)."""
    args: tuple[Any, ...] = node.args[1:]
    if ((node.op == "call_function" and node.target in _FLATTEN_FUNCTIONS)
            or (node.op == "call_method" and node.target == "flatten")):
        start = node.kwargs.get("start_dim", args[0] if args else 0)
        end = node.kwargs.get("end_dim", args[1] if len(args) > 1 else -1)
        return 1 if end == -1 and start == 1 else None
    if node.op == "call_method" and node.target in ("view", "reshape"):
        shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        # (N, -1), or (N, k) with k a number: a forward that runs has k = the features per
        # example, so both flatten everything after the batch dimension
        if (len(shape) == 2 and isinstance(shape[0], fx.Node) and _is_batch_size(shape[0])
                and isinstance(shape[1], int) and not isinstance(shape[1], bool)
                and (shape[1] == -1 or shape[1] > 0)):
            return 1
    return None

