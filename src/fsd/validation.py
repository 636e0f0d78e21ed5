"""Checks of a summary's stored tensors, so a damaged or hand-edited file fails at load.

A summary is plain tensors plus JSON. :func:`fsd.load` checks them before the estimator is
used: the parameter copy θ0 against the stored architecture, dtypes, finite values, and each
estimator's own fields (shapes that agree with each other, covariances positive
semi-definite, Fisher diagonals non-negative, gate frequencies in [0, 1]). A failed check
raises :class:`SummaryFormatError` naming the field; a matmul deep inside ``distance`` never
sees a malformed tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Mapping, NamedTuple, Sequence

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
        elif key in ("data.x", "coreset.x", "probe.x") and not value.is_complex():
            pass  # stored inputs keep their dtype: token ids are integers
        elif integer and (value.is_floating_point() or value.is_complex()):
            raise SummaryFormatError(f"field {key!r}: expected integers, got {value.dtype}")
        elif not integer and not value.is_floating_point():
            raise SummaryFormatError(f"field {key!r}: expected floating point, got "
                                     f"{value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise SummaryFormatError(f"field {key!r}: contains NaN or infinite values")
    require_in_range(stored)
    floats = [(k, v.dtype) for k, v in stored.items() if v.is_floating_point()]
    # fit stores every statistic in the model's dtype, θ0's; a summary whose statistics
    # mix dtypes would fail inside distance's matrix products
    reference = next((d for k, d in floats if k.startswith("theta0.")), None)
    for key, dtype in floats:
        if reference is not None and dtype != reference and not key.startswith(
                ("theta0.", "buffer0.")):
            raise SummaryFormatError(f"field {key!r}: dtype {dtype}, expected {reference} "
                                     f"(the dtype of the stored parameters θ0)")
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


def magnitude_limit(dtype: torch.dtype) -> float:
    """The largest magnitude a summary value may have when computed with in ``dtype``.

    Every distance is a quadratic form in the summary's values (Δθᵀ F Δθ, tr(P C Pᵀ),
    ‖f − f0‖², K-FAC's tr(ΔᵀGΔA)), so a value whose square overflows ``dtype`` gives an
    infinite (or NaN) distance: √max is where that starts (1.8e19 for float32, 1.3e154 for
    float64), far above any real data, weight or moment.

    θ0, stored inputs and outputs and input means enter those forms squared. Second moments
    (EWC's Fisher, K-FAC's factors, input covariances) enter linearly but are themselves
    squares of the data, so they pass 1.8e19 in float32 for inputs near 4e9 (a Unix time
    in ms, 1.7e12, gives 2.9e24): one bound for all, which ``fit`` applies too
    (:func:`out_of_range`), so such a summary is refused at fit, not at load.
    """
    return math.sqrt(torch.finfo(dtype).max)


class OutOfRange(NamedTuple):
    """A stored field beyond :func:`magnitude_limit`: what :func:`out_of_range` finds."""

    key: str
    largest: float
    limit: float
    dtype: torch.dtype


def out_of_range(stored: Mapping[str, Tensor], dtype: torch.dtype | None = None
                 ) -> OutOfRange | None:
    """The first floating tensor whose magnitude exceeds :func:`magnitude_limit`, or ``None``.

    The one test of a summary's range: ``fsd.load`` refuses what it finds
    (:func:`require_in_range`) and ``fit`` refuses the same summary before it can be saved,
    so a file ``save`` writes is one ``load`` reads. ``dtype=None`` checks each tensor
    against its own dtype; a dtype checks the values a summary will be converted to.
    """
    for key, value in stored.items():
        if not isinstance(value, Tensor) or not value.is_floating_point() or not value.numel():
            continue
        target = value.dtype if dtype is None else dtype
        limit = magnitude_limit(target)
        largest = float(value.detach().abs().max())
        if not largest <= limit:
            return OutOfRange(key, largest, limit, target)
    return None


def require_in_range(stored: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> None:
    """Every floating tensor's magnitude within :func:`magnitude_limit` of ``dtype``.

    ``dtype=None`` checks each tensor against its own dtype (at load); a dtype checks the
    values a summary will be converted to (a float64 summary used with a float32 model).
    Raises :class:`SummaryFormatError` for the first field :func:`out_of_range` finds.
    """
    found = out_of_range(stored, dtype)
    if found is not None:
        raise SummaryFormatError(f"field {found.key!r}: values up to {found.largest:.3g} exceed "
                                 f"{found.limit:.3g}, beyond which their squares overflow "
                                 f"{found.dtype}")


def tensor_digest(value: Tensor) -> str:
    """sha256 of a tensor's dtype, shape and values in row-major order (hex)."""
    flat = value.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.sha256(f"{flat.dtype}|{list(value.shape)}|".encode())
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def text_digest(text: str) -> str:
    """sha256 of a string's UTF-8 bytes (hex)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def payload_checksums(estimator: str, config: str, meta: str,
                      tensors: Mapping[str, Tensor]) -> str:
    """The ``checksums`` entry written with a summary: JSON of the sha256 of every part."""
    return json.dumps({"estimator": text_digest(estimator), "config": text_digest(config),
                       "meta": text_digest(meta),
                       "tensors": {k: tensor_digest(v) for k, v in tensors.items()}})


def checksum_damage(payload: Mapping[str, Any], *, required: bool = False) -> str | None:
    """What in a summary payload disagrees with its ``checksums`` entry, or ``None``.

    A payload without checksums is damaged when ``required`` (its format version is one
    written with them: the entry was deleted); otherwise it predates them and ``None`` is
    the answer, its bytes unchecked. The answer names the first damaged part (a field, the
    config or the meta).
    """
    if "checksums" not in payload:
        return ("the checksums are missing, and a summary of this format version is always "
                "saved with them: the file was edited or damaged") if required else None
    damaged = "checksum mismatch: the file was damaged or changed after it was saved"
    try:
        sums = json.loads(payload["checksums"])
        if not isinstance(sums, dict) or not isinstance(sums.get("tensors"), dict):
            raise ValueError("not a JSON object")
    except (TypeError, ValueError):
        return "the checksums are unreadable: the file was damaged"
    for part in ("estimator", "config", "meta"):
        text = payload.get(part)
        if not isinstance(text, str) or sums.get(part) != text_digest(text):
            return f"{part}: {damaged}"
    tensors = payload.get("tensors")
    if not isinstance(tensors, dict):
        return f"tensors: {damaged}"
    for key in sorted(set(sums["tensors"]) | set(tensors), key=str):
        value = tensors.get(key)
        if key not in tensors:
            return f"field {key!r} is missing ({damaged})"
        if key not in sums["tensors"] or not isinstance(value, Tensor) or \
                sums["tensors"][key] != tensor_digest(value):
            return f"field {key!r}: {damaged}"
    return None


def regularizer_checksum(payload: Mapping[str, Any]) -> str:
    """sha256 over a regularizer file's settings and task list, in order (hex).

    Each task enters by its format version and its own ``checksums`` entry, which covers
    its tensors, configuration and metadata: a task dropped, duplicated, reordered or
    swapped, or a strength or reduction changed, changes this digest. Raises ``TypeError``
    for settings that are not JSON (a damaged file).
    """
    summaries = payload.get("summaries")
    tasks = [[p.get("version"), p.get("checksums")] if isinstance(p, Mapping) else None
             for p in (summaries if isinstance(summaries, list) else [])]
    return text_digest(json.dumps({"strength": payload.get("strength"),
                                   "reduction": payload.get("reduction"), "tasks": tasks},
                                  sort_keys=True))


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
    """``stored[key]`` (..., d, d) is symmetric positive semi-definite up to round-off.

    Round-off is relative to the largest entry: 1e-5 for float32 files (Gram matrices
    summed over millions of rows in float32 reach a few parts in a million), 1e-9 for
    float64 ones (fit accumulates those in float64, ~1e-13 and below), so an eigenvalue of
    −9e-6 in a float64 covariance of scale 1 is refused. Eigenvalues admitted below zero
    are round-off; the estimators clamp their quadratic forms at 0, so they cannot make a
    distance negative.
    """
    raw = require(stored, key)
    value = raw.to(torch.float64)
    scale = value.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-300)
    tolerance = (1e-9 if raw.dtype == torch.float64 else 1e-5) * scale
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
