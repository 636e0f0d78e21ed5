"""Half-precision models (float16, bfloat16) are fitted and measured in float32.

A summary's statistics are sums over a data set — a Fisher diagonal, K-FAC's Gram matrices,
covariances — and a float16 sum overflows at 65504 (bfloat16 keeps only 8 significant bits),
so a float16 model's EWC or KFAC summary came out infinite, was saved, and was refused by
``fsd.load``. ``fit`` and ``distance`` of a model with float16 or bfloat16 parameters or
buffers therefore run on float32 casts of them, put in the model's place for the call only
(:func:`float32_view`): the summary is float32, its θ0 holds the model's values exactly (every
float16 and bfloat16 number is a float32 number), the distance is the one the model's float32
copy gets, and its gradient flows back to the half-precision parameters. Float32 and float64
models are not touched.
"""

from __future__ import annotations

import contextlib
import itertools
import typing
from typing import Any, Iterator

import torch
from torch import Tensor, nn

HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a model of ``dtype`` is fitted and measured in: float32 for half precision."""
    return torch.float32 if dtype in HALF else dtype


def is_half(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is float16 or bfloat16."""
    return any(t.dtype in HALF for t in itertools.chain(model.parameters(), model.buffers()))


@contextlib.contextmanager
def float32_view(model: nn.Module, *, differentiable: bool) -> Iterator[nn.Module]:
    """Inside the block, ``model``'s half-precision parameters and buffers are float32 casts.

    The casts replace the tensors in each module's parameter and buffer tables (as
    ``torch.func.functional_call`` does) and the originals are put back on leaving, also on
    an error. With ``differentiable``, a parameter's cast keeps its autograd link, so what is
    computed inside has gradients with respect to the half-precision parameter; otherwise the
    casts are detached copies. A tensor shared by two modules (tied weights) is cast once.
    Yields ``model`` itself; a model without half-precision tensors is left as it is.
    """
    if not is_half(model):
        yield model
        return
    casts: dict[int, Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    try:
        for module in model.modules():
            # plain dicts here: the casts are tensors, not Parameters, as in functional_call
            tables = typing.cast("tuple[dict[str, Any], ...]",
                                 (module._parameters, module._buffers))
            for table in tables:
                for name, value in list(table.items()):
                    if value is None or value.dtype not in HALF:
                        continue
                    cast = casts.get(id(value))
                    if cast is None:
                        cast = value.float() if differentiable else value.detach().float()
                        casts[id(value)] = cast
                    swapped.append((table, name, value))
                    table[name] = cast
        yield model
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value
