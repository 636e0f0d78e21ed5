"""The derivatives the estimators take, with fallbacks where a model's operations lack one.

Not every operation a model may call has every derivative torch can take:

- **forward mode** (``torch.func.jvp``, which NTK and the graph walks of LAFTR and BGLN-S
  use) is missing for e.g. ``torch._weight_norm`` (``parametrizations.weight_norm``), oneDNN's
  LSTM kernel on CPU and the fused attention kernels;
- the fused fast paths of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``, which
  they take in evaluation mode when nothing requires a gradient (under ``torch.no_grad()``,
  or inside ``torch.func.jvp``), have no derivative at all;
- ``torch.func.vmap`` (EWC's and KFAC's per-example gradients) cannot batch some kernels, e.g.
  ``nn.GRU``'s in-place update of its hidden state.

:func:`differentiable_kernels` turns the fast paths off (:func:`no_fast_paths`) and picks
attention's composite kernel, which has every derivative; :func:`jvp` takes J·v by forward
mode and, where an operation has none, as two reverse-mode products (the double-vjp trick:
u ↦ Jᵀu is linear, and its own vjp with v is J·v); :func:`squared_gradients` vectorizes
per-example gradients with ``vmap`` and loops over the examples where ``vmap`` cannot batch
the model. The values are the same either way (to round-off); only the cost differs.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.func import grad, vjp, vmap
from torch.func import jvp as forward_jvp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map


@contextlib.contextmanager
def no_fast_paths() -> Iterator[None]:
    """Inside the block, attention layers skip their fused fast paths, which have no derivative.

    Those of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``
    (``torch.backends.mha``). They are taken only where no gradient is recorded (evaluation
    mode, under ``torch.no_grad()`` or inside ``torch.func.jvp``), so a computation that
    records one computes the same without them.
    """
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


@contextlib.contextmanager
def differentiable_kernels() -> Iterator[None]:
    """Inside the block, attention runs kernels that have forward- and reverse-mode derivatives.

    :func:`no_fast_paths`, and ``scaled_dot_product_attention`` takes its math kernel (the
    fused ones have no forward mode).
    """
    with no_fast_paths(), sdpa_kernel([SDPBackend.MATH]):
        yield


def forward_ad_missing(error: BaseException) -> bool:
    """Whether ``error`` is torch's report of an operation without a forward-mode derivative."""
    # "Trying to use forward AD with <op> ...", "... custom autograd.Function to use it with
    # forward mode AD"
    text = str(error)
    return isinstance(error, NotImplementedError) and ("forward AD" in text
                                                       or "forward mode AD" in text)


def double_vjp(f: Callable[..., Any], primals: tuple[Tensor, ...],
               tangents: tuple[Tensor, ...]) -> tuple[Any, Any]:
    """``f(*primals)`` and J·tangents by two reverse-mode products (no forward mode).

    u ↦ Jᵀu is linear in u; its vjp with the tangents is J·tangents. Differentiable in the
    tangents, as ``torch.func.jvp`` is, and independent of the caller's grad mode. ``f`` may
    return a tensor or a tuple of tensors.
    """
    # torch's annotations of vjp and jvp do not tie the tuple's length to has_aux (False)
    out, pull = vjp(f, *primals)  # pyright: ignore[reportAssignmentType]
    zeros = tree_map(torch.zeros_like, out)
    _, push = vjp(pull, zeros)  # pyright: ignore[reportAssignmentType]
    (jv,) = push(tuple(tangents))
    return out, jv


def jvp(f: Callable[..., Any], primals: tuple[Tensor, ...], tangents: tuple[Tensor, ...],
        *, reverse: bool = False) -> tuple[Any, Any, bool]:
    """``f(*primals)``, J·tangents and whether it was taken in reverse mode.

    Attention's fast paths are off inside (:func:`no_fast_paths`). Forward mode
    (``torch.func.jvp``) unless ``reverse``; an operation without a forward-mode derivative
    makes it fall back to :func:`double_vjp`. Callers keep the returned flag to skip the
    failing forward pass on their next call.
    """
    with no_fast_paths():  # inside torch.func.jvp nothing requires a gradient
        if not reverse:
            try:
                # torch's first forward-mode product loads decompositions that warn about
                # torch.jit.script's deprecation: under -W error that would read as the model's
                # failure, so torch's own warning is silenced here
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*torch.jit.script",
                                            category=DeprecationWarning)
                    out, jv = forward_jvp(f, primals, tangents)  # pyright: ignore[reportAssignmentType]
                return out, jv, False
            except NotImplementedError as error:
                if not forward_ad_missing(error):
                    raise
        out, jv = double_vjp(f, primals, tangents)
        return out, jv, True


def one_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name if it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def gradients_of_the_forward(estimator: str) -> Iterator[None]:
    """Turn torch's error for a forward that blocks its own gradients into one line.

    EWC and KFAC differentiate the model's outputs with respect to its parameters; a forward
    that runs part of itself under ``torch.no_grad()`` (a frozen backbone) cuts that path.
    """
    try:
        yield
    except RuntimeError as error:
        if "does not require grad" not in str(error):
            raise
        raise ValueError(f"{estimator} differentiates the model's outputs with respect to its "
                         f"parameters, and part of the forward runs without gradients "
                         f"(torch.no_grad() in forward?); freeze parameters with "
                         f"requires_grad_(False) instead, or use ExactFSD or NTK") from None


def squared_gradients(forward: Callable[[dict[str, Tensor], Tensor], Tensor],
                      params: dict[str, Tensor], x: Tensor, hs: Tensor, chunk_size: int,
                      *, loop: bool = False) -> tuple[dict[str, Tensor], bool]:
    """Σ over examples i and factors k of (∂(h_ik · z_i)/∂p)², for every tensor p of ``params``.

    Args:
        forward: ``forward(params, x)`` → the outputs z (n, K) of the inputs x (n, ...).
        params: the tensors to differentiate in (the model's others held inside ``forward``).
        x: inputs (n, ...).
        hs: output-space factors (n, factors, K).
        chunk_size: examples per vectorized pass (memory only).
        loop: take the per-example loop directly (a ``vmap`` failed before on this model).

    Returns:
        ``(sums in float64, looped)``: ``looped`` says that ``vmap`` could not batch the model
        and every example was taken alone (pass it back as ``loop`` for the next batch).
    """
    if not loop:
        try:
            return _vectorized(forward, params, x, hs, chunk_size), False
        except (RuntimeError, NotImplementedError):
            pass  # vmap cannot batch an operation of this model: one example at a time
    return _looped(forward, params, x, hs), True


def _vectorized(forward: Callable[[dict[str, Tensor], Tensor], Tensor],
                params: dict[str, Tensor], x: Tensor, hs: Tensor,
                chunk_size: int) -> dict[str, Tensor]:
    def projected(p: dict[str, Tensor], x: Tensor, h: Tensor) -> Tensor:
        return (forward(p, x.unsqueeze(0))[0] * h).sum()

    # per-example, per-factor gradients Jᵀh, squared and summed over factors
    def example(x: Tensor, hs: Tensor) -> dict[str, Tensor]:
        grads = vmap(grad(projected), in_dims=(None, None, 0))(params, x, hs)
        return {k: g.pow(2).sum(0) for k, g in grads.items()}

    out = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    for xs, hc in zip(torch.split(x, chunk_size), torch.split(hs, chunk_size), strict=True):
        diag = vmap(example)(xs, hc)
        for k in out:
            out[k] += diag[k].sum(0).to(torch.float64)
    return out


def _looped(forward: Callable[[dict[str, Tensor], Tensor], Tensor],
            params: dict[str, Tensor], x: Tensor, hs: Tensor) -> dict[str, Tensor]:
    out = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    names = list(params)
    with torch.enable_grad():
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        for i in range(x.shape[0]):
            z = forward(live, x[i:i + 1])[0]
            factors = hs.shape[1]
            for j in range(factors):
                grads = torch.autograd.grad((z * hs[i, j]).sum(), [live[k] for k in names],
                                            retain_graph=j < factors - 1, allow_unused=True)
                for k, g in zip(names, grads, strict=True):
                    if g is not None:  # None: z does not depend on this tensor
                        out[k] += g.detach().pow(2).to(torch.float64)
    return out
