"""How a summary calls its model: which output it measures and extra forward arguments.

``fit(model, data, output=..., forward_kwargs=...)`` records both in the summary, and every
later ``distance`` calls the model the same way, so a multi-head network ``forward(x, task)``
needs no wrapper and each task's summary measures its own head:

- ``output``: ``None`` for a forward that returns a tensor; a key for one that returns a dict
  (``{"logits": …}``, a Hugging Face ``ModelOutput``); an index for a tuple or list.
- ``forward_kwargs``: a JSON-serialisable dict of keyword arguments, e.g. ``{"task": 3}``.

The estimators see the model through :func:`bind`: a view of the same module object — the
same parameters, buffers, submodules and hooks under the same names — whose ``forward(x)``
is ``model.forward(x, **forward_kwargs)[output]``. The estimators that run the forward
(ExactFSD, NTK, EWC, KFAC) call it as they call any model; those that trace it with torch.fx
(LAFTR, BGLN) trace the view, in which ``task=3`` is a Python constant, so ``self.heads[task]``
selects one head while tracing (as ``concrete_args`` would) and the graph holds that head only.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Mapping

from torch import Tensor, nn

Output = str | int | None
"""Which output of the forward a summary measures (see the module docstring)."""


def check_output(output: Any) -> Output:
    """``output`` if it is ``None``, a str key or an int index >= 0; else ``ValueError``."""
    if output is None or isinstance(output, str):
        return output
    if isinstance(output, int) and not isinstance(output, bool) and output >= 0:
        return int(output)
    raise ValueError(f"output must be None (a forward that returns a tensor), a dict key "
                     f"(str) or a tuple index (int >= 0), got {output!r}")


def _json_equal(value: Any) -> bool:
    """Whether ``value`` survives a JSON round trip unchanged (no tuples, no NaN, str keys)."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return _same(json.loads(text), value)


def _same(a: Any, b: Any) -> bool:
    # type-exact: 1 == 1.0 == True in Python, but a forward may tell them apart
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def check_forward_kwargs(forward_kwargs: Any) -> dict[str, Any]:
    """``forward_kwargs`` as a dict that a summary file stores exactly (``{}`` for ``None``).

    The values must read back from JSON as they are (numbers, strings, booleans, ``None``,
    lists and dicts of them; not tuples, tensors or NaN), so the forward gets the same
    arguments after :func:`fsd.load` as at ``fit``. Raises ``ValueError`` naming the key.
    """
    if forward_kwargs is None:
        return {}
    if not isinstance(forward_kwargs, Mapping):
        raise ValueError(f"forward_kwargs must be a dict of keyword arguments, got "
                         f"{type(forward_kwargs).__name__}")
    out = dict(forward_kwargs)
    for key, value in out.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"forward_kwargs keys must be argument names, got {key!r}")
        if not _json_equal(value):
            raise ValueError(f"forward_kwargs[{key!r}] = {value!r} is stored in the summary "
                             f"file as JSON and must read back unchanged: use numbers, "
                             f"strings, booleans, None, lists and dicts (not tuples, tensors "
                             f"or NaN)")
    return out


def check_call_meta(meta: Mapping[str, Any]) -> None:
    """Check a loaded summary's ``output`` and ``forward_kwargs`` metadata (``ValueError``)."""
    if "output" in meta:
        try:
            check_output(meta["output"])
        except ValueError as error:
            raise ValueError(f"meta 'output': {error}") from None
    if "forward_kwargs" in meta:
        kwargs = meta["forward_kwargs"]
        if not isinstance(kwargs, dict) or not kwargs:
            raise ValueError("meta 'forward_kwargs': expected a non-empty dict")
        try:
            check_forward_kwargs(kwargs)
        except ValueError as error:
            raise ValueError(f"meta 'forward_kwargs': {error}") from None


def describe(value: Any) -> str:
    """What a forward returned, for a message: ``"a dict with keys ['aux', 'logits']"``."""
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _hint(value: Any) -> str:
    if isinstance(value, Mapping) and value:
        keys = [k for k in value if isinstance(value[k], Tensor)] or list(value)
        return f"e.g. output={keys[0]!r}"
    if isinstance(value, (tuple, list)) and value:
        return f"an index 0..{len(value) - 1}, e.g. output=0"
    return "a key or an index"


def select_output(value: Any, output: Output, name: str = "the model") -> Tensor:
    """The tensor ``output`` picks from a forward's result, with a one-line error if none.

    Used at ``fit`` on the real result, where the error can say what the forward returned.
    """
    if output is None:
        if isinstance(value, Tensor):
            return value
        raise ValueError(f"{name} returns {describe(value)}, not a tensor: pass output= to "
                         f"fit to say which output to measure ({_hint(value)})")
    if isinstance(value, Tensor):
        raise ValueError(f"output={output!r}, but {name} returns a tensor: leave output=None")
    try:
        if isinstance(value, Mapping) or not isinstance(output, str):
            picked = value[output]
        else:
            raise KeyError(output)
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"output={output!r} is not an output of {name}: it returns "
                         f"{describe(value)} ({_hint(value)})") from None
    if not isinstance(picked, Tensor):
        raise ValueError(f"output={output!r} of {name} is {describe(picked)}, not a tensor")
    return picked


# one view class per model class and call, and one view per model and call: the graph
# walkers cache their traces by module object and forward, so a view is made once
_CLASSES: dict[tuple[type, str], type] = {}
_VIEWS: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = weakref.WeakKeyDictionary()


def call_key(output: Output, forward_kwargs: Mapping[str, Any]) -> str:
    """A string naming a call (``output`` and ``forward_kwargs``); equal calls, equal keys."""
    return json.dumps([output, dict(forward_kwargs)], sort_keys=True)


def bind(model: nn.Module, output: Output = None,
         forward_kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """``model`` as a module whose ``forward(x)`` is ``forward(x, **forward_kwargs)[output]``.

    ``model`` itself when there is nothing to bind. Otherwise a view that shares the model's
    state (its ``__dict__``: parameters, buffers, submodules, hooks, ``training``), so names
    are the model's own, a change to the model is seen by the view, and ``functional_call``
    on the view swaps the model's tensors. Its class is a subclass of the model's class, so
    methods and ``super()`` in ``forward`` work as they do on the model.
    """
    kwargs = dict(forward_kwargs or {})
    if output is None and not kwargs:
        return model
    key = call_key(output, kwargs)
    views = _VIEWS.setdefault(model, {})
    if key not in views:
        cls = _view_class(type(model), output, kwargs, key)
        view = object.__new__(cls)  # no __init__: the state is the model's
        object.__setattr__(view, "__dict__", model.__dict__)  # shared, not copied
        views[key] = view
    return views[key]


def _view_class(base: type, output: Output, kwargs: dict[str, Any], key: str) -> type:
    cached = _CLASSES.get((base, key))
    if cached is not None:
        return cached
    inner = base.forward

    def forward(self: nn.Module, x: Any) -> Any:
        # a fresh copy each call: the forward may not change the stored arguments
        result = inner(self, x, **json.loads(json.dumps(kwargs)))
        # no type checks here: under torch.fx the result may be a Proxy (fit checked it)
        return result if output is None else result[output]

    forward.__doc__ = f"{base.__name__}.forward(x, **{kwargs!r})" + (
        "" if output is None else f"[{output!r}]")
    cls = type(base.__name__, (base,), {"forward": forward, "__module__": __name__,
                                        "__qualname__": base.__qualname__,
                                        "_fsd_call": (output, kwargs)})
    _CLASSES[(base, key)] = cls
    return cls


def is_integer_input(x: Tensor) -> bool:
    """Whether inputs are discrete (token ids, indices): integer or boolean tensors."""
    return not (x.is_floating_point() or x.is_complex())

