"""f(x, θ0) kept at ``fit``: the check that ``distance`` is given the function it was fitted on.

The architecture signature compares parameter names and shapes. A model that holds the
same parameters but computes another function (ReLU swapped for Tanh, a chain rewritten
as a residual block) passes it, and an estimator that reads only parameters (EWC, KFAC)
would return 0 at θ0 however far the functions are apart. The summary therefore keeps the
reference's outputs on a few inputs, and ``distance`` recomputes them from the model it is
given, at θ0, once per model object and layout. NTK compares on its stored coreset; EWC and
KFAC, which keep no data, on a few synthetic inputs drawn at ``fit`` to look like the first
batch (:func:`probe_inputs`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..model.signature import ArchitectureMismatchError
from ..statistics import distributed

#: how many synthetic inputs EWC and KFAC keep
PROBE_SIZE = 4
#: the largest relative gap tolerated: loose enough for another device or kernel, far
#: below a changed activation
TOLERANCE = 1e-3


def probe_inputs(x: Tensor, seed: int = 0) -> Tensor:
    """:data:`PROBE_SIZE` synthetic inputs shaped like the rows of ``x``.

    Floating-point inputs are Gaussian with ``x``'s per-feature mean and standard deviation
    (features constant in ``x`` stay at their value); integer inputs (token ids) are drawn
    uniformly between ``x``'s smallest and largest value. No row of ``x`` is kept.
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (PROBE_SIZE, *x.shape[1:])
    if x.is_floating_point():
        mean = x.mean(0, dtype=torch.float64)
        std = x.std(0).double() if x.shape[0] > 1 else torch.zeros_like(mean)
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        return (mean.cpu() + std.cpu() * noise).to(device=x.device, dtype=x.dtype)
    low, high = int(x.min()), int(x.max())
    return torch.randint(low, high + 1, shape, generator=generator).to(device=x.device,
                                                                       dtype=x.dtype)


def reference_outputs(model: nn.Module, reference_state: dict[str, Tensor], x: Tensor
                      ) -> Tensor:
    """f(x, θ0): ``model`` called on ``x`` with the summary's parameters and buffers."""
    with torch.no_grad():
        return functional_call(model, reference_state, (x,)).detach()


def record(state: dict[str, Tensor], model: nn.Module, reference_state: dict[str, Tensor],
           x: Tensor) -> None:
    """Store ``probe.x`` and ``probe.f0`` for the first batch ``x`` of a fit.

    Nothing is stored when the model's outputs on the synthetic inputs are not a finite
    tensor (a model defined only on part of the input space): the summary then has no check.
    """
    probe = probe_inputs(x)
    try:
        f0 = reference_outputs(model, reference_state, probe)
    except Exception:  # the synthetic inputs are outside what the model takes
        return
    if isinstance(f0, Tensor) and f0.is_floating_point() and bool(torch.isfinite(f0).all()):
        state["probe.x"], state["probe.f0"] = probe, f0


def share_rank_zeros(state: dict[str, Tensor]) -> None:
    """Under torch.distributed, every rank keeps rank 0's probe (none if rank 0 has none).

    Each rank drew its probe from its own first batch; the summary must be the same on
    every rank, and the one a single process fits (whose first batch is rank 0's).
    Every rank calls it at the same point of ``fit``. Does nothing when not distributed.
    """
    if distributed.world_size() == 1:
        return
    mine = (state.get("probe.x"), state.get("probe.f0"))
    first = distributed.gather_objects(mine)[0]
    state.pop("probe.x", None)
    state.pop("probe.f0", None)
    if first[0] is not None and first[1] is not None:
        device = next(iter(state.values())).device
        state["probe.x"], state["probe.f0"] = first[0].to(device), first[1].to(device)


def check_same_function(cache: dict[str, Any], model: nn.Module,
                        outputs: Callable[[], Tensor | None], fitted: Tensor | None) -> None:
    """Raise :class:`~fsd.ArchitectureMismatchError` if ``model`` computes another function.

    ``outputs()`` gives the model's f(x, θ0) on the stored inputs (``None`` when the model
    cannot be called so: no check), ``fitted`` the one stored at ``fit`` (``None`` for a
    summary saved without it: no check). Run once per model object and layout, remembered
    in ``cache``: the comparison reads a number back (a GPU sync). The object is held weakly
    (a freed model's id can be reused) and its submodules by identity and type (a layer
    swapped in place changes the function).
    """
    if fitted is None:
        return
    layout = tuple((name, id(m), type(m)) for name, m in model.named_modules())
    seen = cache.get(f"same-function:{id(model)}")
    if seen is not None and seen[0]() is model and seen[1] == layout:
        return
    computed = outputs()
    if computed is not None:  # a mismatch raises before the model is remembered
        _compare(computed.detach(), fitted)
    cache[f"same-function:{id(model)}"] = (weakref.ref(model), layout)


def _compare(f0: Tensor, fitted: Tensor) -> None:
    if f0.shape != fitted.shape:
        raise ArchitectureMismatchError(
            f"the model gives {tuple(f0.shape[1:])} outputs per example, the summary was "
            f"fitted on a model giving {tuple(fitted.shape[1:])}")
    gap = float((f0 - fitted).abs().max())
    if gap > TOLERANCE * (float(fitted.abs().max()) + 1e-6):
        raise ArchitectureMismatchError(
            f"the model computes another function than the one fitted: at the fitted "
            f"parameters θ0 its outputs on the inputs the summary keeps differ by up to "
            f"{gap:.3g} (an activation or a layer without parameters changed?)")


def check_probe(cache: dict[str, Any], model: nn.Module, state: dict[str, Tensor],
                reference_state: Callable[[], dict[str, Tensor]]) -> None:
    """:func:`check_same_function` on the synthetic inputs :func:`record` stored in ``state``.

    ``reference_state()`` gives θ0's parameters and buffers (called only when checking).
    """
    if "probe.x" not in state:
        return

    def outputs() -> Tensor | None:
        try:
            return reference_outputs(model, reference_state(), state["probe.x"])
        except Exception:  # an object that only lists parameters: EWC and KFAC read no more
            return None

    check_same_function(cache, model, outputs, state.get("probe.f0"))
