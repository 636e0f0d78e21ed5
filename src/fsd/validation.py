"""Checks of a summary's stored tensors, so a damaged or hand-edited file fails at load.

A summary is plain tensors plus JSON. :func:`fsd.load` checks them before the estimator is
used: the parameter copy θ0 against the stored architecture, dtypes, finite values, and each
estimator's own fields (shapes that agree with each other, covariances positive
semi-definite, Fisher diagonals non-negative, gate frequencies in [0, 1]). A failed check
raises :class:`SummaryFormatError` naming the field; a matmul deep inside ``distance`` never
sees a malformed tensor.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor


class SummaryFormatError(ValueError):
    """A summary's stored tensors or metadata do not form a valid summary."""


def parameter_shapes(signature: Any) -> dict[str, list[int]]:
    """Parameter name → shape from either stored signature form.

    Black-box estimators store ``[[name, shape], ...]``; traced ones store one dict per layer
    with its ``path`` and ``params``.
    """
    if not isinstance(signature, list):
        raise SummaryFormatError("meta 'signature': expected a list")
    shapes: dict[str, list[int]] = {}
    for entry in signature:
        if isinstance(entry, dict) and isinstance(entry.get("params"), dict):
            prefix = f"{entry.get('path')}." if entry.get("path") else ""
            for name, shape in entry["params"].items():
                shapes[prefix + name] = list(shape)
        elif isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str):
            shapes[entry[0]] = list(entry[1])
        else:
            raise SummaryFormatError(f"meta 'signature': unreadable entry {entry!r}")
    return shapes


def check_common(stored: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Checks every estimator shares: types, finite values, θ0 against the signature."""
    if meta.get("fitted") is not True:
        raise SummaryFormatError("meta 'fitted': the summary was not fitted")
    for key, value in stored.items():
        if not isinstance(value, Tensor):
            raise SummaryFormatError(f"field {key!r}: expected a tensor, got "
                                     f"{type(value).__name__}")
        integer = key in ("outputs", "coreset.group")
        if key.startswith("buffer0."):
            pass  # buffers may be integers (BatchNorm's num_batches_tracked)
        elif integer and (value.is_floating_point() or value.is_complex()):
            raise SummaryFormatError(f"field {key!r}: expected integers, got {value.dtype}")
        elif not integer and not value.is_floating_point():
            raise SummaryFormatError(f"field {key!r}: expected floating point, got "
                                     f"{value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise SummaryFormatError(f"field {key!r}: contains NaN or infinite values")
    expected = parameter_shapes(meta.get("signature"))
    theta0 = {k[len("theta0."):]: v for k, v in stored.items() if k.startswith("theta0.")}
    if set(theta0) != set(expected):
        missing = sorted(set(expected) - set(theta0))
        extra = sorted(set(theta0) - set(expected))
        raise SummaryFormatError(f"fields 'theta0.*' do not match the stored architecture "
                                 f"(missing {missing}, unexpected {extra})")
    for name, shape in expected.items():
        require_shape(stored, f"theta0.{name}", shape)
    if "outputs" in stored:
        index = stored["outputs"]
        if index.dim() != 1 or index.numel() == 0 or bool((index < 0).any()):
            raise SummaryFormatError("field 'outputs': expected a non-empty list of "
                                     "non-negative output indices")


def positive_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    """``value`` as an int ≥ 1 (or ``None`` where allowed); a ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a positive int{also}, got {value!r}")
    return value


def require(stored: Mapping[str, Tensor], key: str) -> Tensor:
    """The stored tensor ``key``, or a :class:`SummaryFormatError` saying it is missing."""
    if key not in stored:
        raise SummaryFormatError(f"field {key!r} is missing")
    return stored[key]


def require_shape(stored: Mapping[str, Tensor], key: str, shape: Sequence[int | None]
                  ) -> Tensor:
    """The stored tensor ``key`` with ``shape`` (``None`` matches any size)."""
    value = require(stored, key)
    if value.dim() != len(shape) or any(s is not None and s != v
                                        for s, v in zip(shape, value.shape, strict=True)):
        wanted = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise SummaryFormatError(f"field {key!r}: shape {tuple(value.shape)}, expected {wanted}")
    return value


def require_nonnegative(stored: Mapping[str, Tensor], key: str) -> None:
    """``stored[key]`` has no negative entry."""
    if bool((require(stored, key) < 0).any()):
        raise SummaryFormatError(f"field {key!r}: has negative entries")


def require_psd(stored: Mapping[str, Tensor], key: str) -> None:
    """``stored[key]`` (..., d, d) is symmetric positive semi-definite up to round-off."""
    value = require(stored, key).to(torch.float64)
    scale = value.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-300)
    tolerance = 1e-5 * scale
    if bool(((value - value.transpose(-2, -1)).abs() > tolerance).any()):
        raise SummaryFormatError(f"field {key!r}: not symmetric")
    lowest = torch.linalg.eigvalsh(value).amin(dim=-1)
    if bool((lowest < -tolerance[..., 0, 0]).any()):
        raise SummaryFormatError(f"field {key!r}: not positive semi-definite (eigenvalue "
                                 f"{float(lowest.min()):.3g})")


def require_probabilities(stored: Mapping[str, Tensor], key: str) -> None:
    """``stored[key]`` lies in [0, 1] (gate frequencies)."""
    value = require(stored, key)
    if bool(((value < 0) | (value > 1)).any()):
        raise SummaryFormatError(f"field {key!r}: values outside [0, 1]")


def require_gate_moments(stored: Mapping[str, Tensor], key: str) -> None:
    """``stored[key]`` (…, 5) holds moments E[r], E[g], E[r²], E[rg], E[g²] of a gate pair.

    Their covariance matrix [[Var r, Cov], [Cov, Var g]] must be positive semi-definite up
    to round-off.
    """
    value = require(stored, key).to(torch.float64)
    r, g, rr, rg, gg = value.unbind(-1)
    var_r, cov, var_g = rr - r * r, rg - r * g, gg - g * g
    tolerance = 1e-5 * (rr.abs() + gg.abs()).clamp_min(1e-12)
    if bool(((var_r < -tolerance) | (var_g < -tolerance)).any()) or bool(
            (cov * cov > var_r.clamp_min(0) * var_g.clamp_min(0) + tolerance * tolerance
             + tolerance * (var_r.abs() + var_g.abs())).any()):
        raise SummaryFormatError(f"field {key!r}: not the moments of a gate pair (a negative "
                                 f"variance or |Cov(r, g)| above √(Var r · Var g))")
