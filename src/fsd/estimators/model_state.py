"""What ``fit`` and ``distance`` check about the model's own tensors: values, finite.

``fit`` snapshots θ0 from the model, and ``distance`` measures the model's current
parameters: a NaN or infinite parameter (a diverged step) or one on the ``meta`` device
(no values at all) gives a NaN distance or a raw torch error. Both calls refuse them in one
line that names the first such tensor.

``distance`` runs on every training step, so its checks cost no pass over the parameters:
the meta device is metadata, and finiteness is read off the distance itself
(:func:`check_distance`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

Call = Literal["fit", "distance"]

#: what the model's tensors are to each call, for the messages
_ROLE = {"fit": "fit takes θ0 from the model's parameters, which must be finite",
         "distance": "distance measures the model's current parameters, which must be finite"}
_NEEDS = {"fit": "fit needs the reference network's weights",
          "distance": "distance needs the model's weights"}


def _named_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    named = [(f"parameter '{n}'", t) for n, t in model.named_parameters()]
    return named + [(f"buffer '{n}'", t) for n, t in model.named_buffers()]


def check_parameters(model: nn.Module, call: Call = "fit") -> None:
    """Refuse a model whose parameters or buffers hold no values or non-finite ones.

    Raises ``ValueError`` in one line naming the first parameter or buffer that is on the
    ``meta`` device, then the first that is NaN or infinite, and what ``call`` needs.
    """
    named = _named_tensors(model)
    _refuse_meta(named, call)
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            _refuse_non_finite(name, call)


def _refuse_meta(named: list[tuple[str, Tensor]], call: Call) -> None:
    for name, tensor in named:
        if tensor.is_meta:
            raise ValueError(f"{name} is on the meta device and holds no values: "
                             f"{_NEEDS[call]} (e.g. model.to_empty(device='cpu'), then "
                             f"load_state_dict)")


def _refuse_non_finite(name: str, call: Call) -> None:
    raise ValueError(f"{name} has NaN or infinite values: {_ROLE[call]} (a diverged "
                     f"training run? a smaller learning rate or gradient clipping)")


def refuse_meta(model: nn.Module, call: Call = "distance") -> None:
    """Raise ``ValueError`` naming the first parameter or buffer on the ``meta`` device.

    Looks at the first parameter only, then names the culprit: a model moved to ``meta``
    moves every tensor, and this runs on every ``distance``.
    """
    first = next(model.parameters(), None)
    if first is not None and first.is_meta:
        _refuse_meta(_named_tensors(model), call)


def check_distance(value: Tensor, model: nn.Module) -> Tensor:
    """``value``, a distance of ``model``, unless it is not finite because ``model`` is not.

    A NaN or infinite parameter makes the distance NaN or infinite, so the distance's own
    value is what is checked: one comparison per call instead of a pass over every parameter
    on every training step (a measurable share of a small network's step). Only a value that is not
    finite leads to the pass that names the first NaN or infinite parameter or buffer
    (``ValueError``); if there is none (a distance that overflowed), the value is returned as
    it is. Under ``vmap``, which batches the value, nothing is checked.
    """
    try:
        # a 0-dim distance is read as a number: cheaper than a tensor comparison
        finite = math.isfinite(value.item()) if value.dim() == 0 else \
            bool(torch.isfinite(value).all())
    except RuntimeError:  # batched by vmap: no one value to read
        return value
    if not finite:
        for name, tensor in _named_tensors(model):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                _refuse_non_finite(name, "distance")
    return value
