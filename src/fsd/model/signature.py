"""Architecture signatures: what a fitted summary records about its model, and the check.

A summary is only meaningful for the architecture it was fitted on. Every estimator stores a
JSON-able signature of the reference model at ``fit`` and compares the calling model's
signature with it in ``distance``. Black-box estimators use :func:`parameter_signature`;
the linearized ones use the per-layer signature of :func:`layer_signature`.
"""

from __future__ import annotations

import json
from typing import Any

from torch import Tensor, nn

from .rules import TracedLayer


class ArchitectureMismatchError(ValueError):
    """A fitted summary was used with a model of another architecture."""


def normalize(signature: Any) -> Any:
    """The signature after a JSON round trip (tuples become lists), as it is saved.

    Saved and freshly computed signatures compare equal only in this form.
    """
    return json.loads(json.dumps(signature))


def parameter_signature(model: nn.Module) -> list[list]:
    """Names and shapes of all parameters.

    Enough to tell two architectures apart for estimators that treat the model as a black box.
    """
    return [[name, list(p.shape)] for name, p in model.named_parameters()]


def check_signature(expected: list, actual: list, what: str = "architecture") -> None:
    """Raise :class:`ArchitectureMismatchError` describing the first difference.

    Args:
        expected: the signature recorded at ``fit``.
        actual: the calling model's signature.
        what: the word used in the message.
    """
    if expected == actual:
        return
    if len(expected) != len(actual):
        added = [n for n in map(_entry_name, actual) if n not in set(map(_entry_name, expected))]
        removed = [n for n in map(_entry_name, expected) if n not in set(map(_entry_name, actual))]
        detail = "".join([f"; added: {added[:4]}" if added else "",
                          f"; missing: {removed[:4]}" if removed else ""])
        hint = (" (a layer or head added after fit? create every head before the first fit: "
                "a summary measures the parameters it was fitted on)" if added else "")
        raise ArchitectureMismatchError(
            f"{what} mismatch: the summary was fitted on a model with {len(expected)} "
            f"entries, this model has {len(actual)}{detail}{hint}"
        )
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        if e != a:
            raise ArchitectureMismatchError(
                f"{what} mismatch at entry {i}: fitted on {e}, got {a}"
            )


def _entry_name(entry: Any) -> str:
    """A signature entry's name: a parameter's (``[name, shape]``) or a layer's path."""
    if isinstance(entry, dict):
        return str(entry.get("path", entry))
    if isinstance(entry, (list, tuple)) and entry:
        return str(entry[0])
    return str(entry)


def model_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and floating-point buffers by name: what the rules read.

    Buffers matter to BatchNorm, whose running statistics are part of its affine map.
    """
    state: dict[str, Tensor] = dict(model.named_parameters())
    state.update({name: b for name, b in model.named_buffers() if b.is_floating_point()})
    return state


def layer_signature(layers: list[TracedLayer]) -> list[dict]:
    """Per-layer type, hyper-parameters and parameter shapes of a traced model."""
    return [
        {
            "path": layer.path,
            "type": type(layer.module).__name__,
            "hyper": layer.rule.hyper(layer.module),
            "params": {n: list(p.shape) for n, p in layer.module.named_parameters(recurse=False)},
        }
        for layer in layers
    ]
