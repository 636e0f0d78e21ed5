"""Models written as classes: trace ``forward`` with torch.fx into the chain of layers.

LAFTR and BGLN walk a chain of rule-tagged layers (:mod:`fsd.rules`). An ``nn.Sequential``
is that chain already; any other model is traced with ``torch.fx.symbolic_trace`` and its
graph read as a chain: modules called in ``forward`` (nested ones included), and the
functional forms of the parameter-free layers, which are replaced by the equivalent module
so that every step has a rule and a path:

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
raises :class:`~fsd.rules.UnsupportedModuleError` naming the operation and its node; such
models work with ExactFSD, NTK, EWC and KFAC, which run the model's own forward.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from . import rules
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
    """The user's model inside ``torch.compile`` and (Distributed)DataParallel wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            inner = model._orig_mod  # torch.compile's wrapper
        else:
            return model
        assert isinstance(inner, nn.Module)
        model = inner


@dataclass(frozen=True)
class ChainStep:
    """One step of a traced chain: the module it runs and its path."""

    path: str
    module: nn.Module
    replaced_call: bool  # a function call in forward, run here as an equivalent module


# traced chains by model, with the structure they were traced from: distance() traces on every
# call, and fx costs milliseconds; a changed submodule or forward is traced again
_CHAINS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, list[ChainStep]]] = \
    weakref.WeakKeyDictionary()


def chain(model: nn.Module) -> list[ChainStep]:
    """The steps of ``model``'s ``forward`` as a chain (see the module docstring).

    Raises:
        UnsupportedModuleError: the model cannot be traced, its graph branches, or an
            operation has no rule; the message names the operation and the graph node.
    """
    structure = (type(model).forward, model.__dict__.get("forward"),
                 tuple((path, id(m), type(m)) for path, m in model.named_modules()))
    cached = _CHAINS.get(model)
    if cached is not None and cached[0] == structure:
        return list(cached[1])
    steps = _trace_chain(model)
    _CHAINS[model] = (structure, steps)
    return list(steps)


class _RuleTracer(fx.Tracer):
    """fx's tracer, stopping at every module that has a rule (a user's registered layer too)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return type(m) in rules.RULES or super().is_leaf_module(m, module_qualified_name)


def _symbolic_trace(model: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(model, _RuleTracer().trace(model), type(model).__name__)


def _trace_chain(model: nn.Module) -> list[ChainStep]:
    name = type(model).__name__
    try:
        graph = _symbolic_trace(model).graph
    except Exception as error:  # fx raises many types for data-dependent control flow
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UnsupportedModuleError(
            f"cannot trace {name}.forward with torch.fx ({type(error).__name__}: {first}); "
            f"LAFTR and BGLN need a forward without data-dependent control flow — or use "
            f"ExactFSD, NTK, EWC or KFAC, which run the model as it is") from None
    modules = dict(model.named_modules())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UnsupportedModuleError(f"{name}.forward takes {len(placeholders)} inputs; "
                                     f"LAFTR and BGLN need exactly one")
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
            raise _branch_error(name, node, f"it reads {', '.join(map(str, inputs)) or 'no'} "
                                            f"instead of the previous step '{current}'")
        steps.append(_step(name, node, modules))
        current = node
    if not steps:
        raise UnsupportedModuleError(f"{name}.forward has no layers")
    return steps


def runnable(model: nn.Module) -> nn.Module:
    """A module that computes ``model``'s function with a module at every step.

    ``model`` itself, unless its forward calls parameter-free layers as functions: then an
    ``fx.GraphModule`` sharing its modules and parameters, in which those calls are modules
    named by their paths, so that statistics can be recorded at every step.
    """
    if not any(step.replaced_call for step in chain(model)):
        return model
    module = _symbolic_trace(model)
    for node in list(module.graph.nodes):
        if node.op in ("placeholder", "output") or _is_batch_size(node):
            continue
        step = _step(type(model).__name__, node, dict(model.named_modules()))
        if not step.replaced_call:
            continue
        if hasattr(module, step.path):
            raise UnsupportedModuleError(f"{type(model).__name__} has an attribute "
                                         f"'{step.path}', the name of a graph node fsd needs")
        module.add_submodule(step.path, step.module)
        with module.graph.inserting_after(node):
            call = module.graph.call_module(step.path, (node.all_input_nodes[0],))
        node.replace_all_uses_with(call)
        module.graph.erase_node(node)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


def _step(name: str, node: fx.Node, modules: dict[str, nn.Module]) -> ChainStep:
    if node.op == "call_module":
        return ChainStep(str(node.target), modules[str(node.target)], False)
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS and not _inplace(node):
        return ChainStep(node.name, nn.ReLU(), True)
    if node.op == "call_method" and node.target == "relu":
        return ChainStep(node.name, nn.ReLU(), True)
    if node.op == "call_function" and node.target is F.leaky_relu and not _inplace(node):
        slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
        if isinstance(slope, (int, float)):  # a constant, not a traced value
            return ChainStep(node.name, nn.LeakyReLU(float(slope)), True)
    if node.op == "call_function" and node.target in _SMOOTH_FUNCTIONS and not _inplace(node):
        module = _SMOOTH_FUNCTIONS[node.target](node)
        if module is not None:
            return ChainStep(node.name, module, True)
    if node.op == "call_method" and node.target in _SMOOTH_METHODS:
        return ChainStep(node.name, _SMOOTH_METHODS[str(node.target)](), True)
    flatten = _flatten_start(node)
    if flatten is not None:
        return ChainStep(node.name, nn.Flatten(flatten), True)
    what = getattr(node.target, "__name__", str(node.target))
    raise UnsupportedModuleError(
        f"operation {what} ({node.op}) at graph node '{node.name}' of {name}.forward has no "
        f"rule; LAFTR and BGLN support the modules of fsd.rules.RULES, their functional "
        f"forms (F.relu, F.leaky_relu, F.gelu, torch.tanh, …) and flattening. "
        f"Use the module form (e.g. nn.ReLU()) or register a rule for a module that does it "
        f"(fsd.register_rule); ExactFSD, NTK, EWC and KFAC take any model")


def _branch_error(name: str, node: fx.Node, why: str) -> UnsupportedModuleError:
    what = getattr(node.target, "__name__", str(node.target))
    return UnsupportedModuleError(
        f"{name}.forward is not a chain of layers at graph node '{node.name}' ({what}): {why}. "
        f"LAFTR and BGLN walk chains (residual additions and concatenations are not "
        f"supported); ExactFSD, NTK, EWC and KFAC take any model")


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
        if (len(shape) == 2 and shape[1] == -1 and isinstance(shape[0], fx.Node)
                and _is_batch_size(shape[0])):
            return 1
    return None
