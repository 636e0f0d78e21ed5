"""The data ``fit`` reads: the forms it accepts, and batches checked on the way in.

``Data`` is what ``fit`` takes; :func:`as_batches` reads a map-style dataset or applies
``batch_to_input``; :func:`iter_batches` yields ``(x, y)`` batches on the model's device,
refusing in one line what an estimator would misread (dicts, scalars, NaN inputs, a batch of
another shape per example).
"""

from __future__ import annotations

import warnings
from collections.abc import Sized
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..model import support
from ..model.calls import is_integer_input

Data = Iterable[Any] | Tensor
"""What ``fit`` accepts: an iterable of batches (``x`` or ``(x, y, ...)``), e.g. a
``DataLoader``; a map-style ``Dataset`` such as ``TensorDataset`` (read in batches of 1024);
one tensor, or one ``(x, y)`` / ``(x, y, task)`` tuple, holding a single batch. Batches of
another form (dicts, objects) are read through ``fit(..., batch_to_input=fn)``."""


class MappedBatches:
    """``fn`` applied to every batch of a (re-iterable) data source."""

    def __init__(self, data: Iterable[Any], fn: Callable[[Any], Any]) -> None:
        self.data, self.fn = data, fn

    def __iter__(self) -> Iterator[Any]:
        return map(self.fn, self.data)

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]


def as_batches(data: Any, batch_to_input: Callable[[Any], Any] | None = None) -> Any:
    """``data`` in the form the estimators iterate: batches of ``x`` or ``(x, y, ...)``.

    Args:
        data: any form :data:`Data` describes.
        batch_to_input: applied to every batch first, returning ``x`` or ``(x, y)`` (e.g.
            ``lambda b: (b["pixel_values"], b["labels"])`` for dict batches).
    """
    if isinstance(data, Tensor):
        data = [data]
    elif (isinstance(data, tuple) and 2 <= len(data) <= 3
          and all(isinstance(t, Tensor) and t.dim() >= 1 for t in data)
          and len({t.shape[0] for t in data}) == 1):
        data = [data]  # one (x, y) or (x, y, task) batch, not a sequence of batches
    elif (isinstance(data, list) and 2 <= len(data) <= 3
          and all(isinstance(t, Tensor) and t.dim() >= 1 for t in data)
          and len({t.shape[0] for t in data}) == 1):
        # a DataLoader's batch is a list: [x, y] of a 1-D regression would read as two
        # batches of inputs, the targets among them
        shapes = [tuple(t.shape[1:]) for t in data]
        if len(set(shapes)) > 1:  # not batches of one model's inputs: an (x, y) batch
            raise ValueError(f"data is a list of tensors with examples of shapes {shapes}: "
                             f"one (x, y) batch (a DataLoader's batch is a list) is passed as a "
                             f"tuple (tuple(batch)) or [(x, y)]")
        warnings.warn(f"data is a list of {len(data)} tensors of the same batch size, read as "
                      f"{len(data)} batches of inputs; for one (x, y) batch pass a tuple "
                      f"(tuple(batch)) or [(x, y)]", stacklevel=3)
    elif isinstance(data, torch.utils.data.Dataset) and not isinstance(
            data, torch.utils.data.IterableDataset):
        data = torch.utils.data.DataLoader(data, batch_size=1024)
    if batch_to_input is not None:
        data = MappedBatches(data, batch_to_input)
    return data


class FloatInputs:
    """Casts a batch's inputs to ``dtype`` (integer inputs of a model that needs floats)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, batch: Any) -> Any:
        """``batch`` with its inputs cast (``x``, or the first of a tuple)."""
        if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (tuple, list)):
            return (torch.as_tensor(batch[0]).to(self.dtype), *batch[1:])
        if isinstance(batch, Tensor):
            return batch.to(self.dtype)
        return batch  # iter_batches names what is wrong with it


def iter_batches(
    data: Data | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = False,
    desc: str | None = None,
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Yield ``(x, y)`` batches moved to ``device``, validating them on the way.

    Floating-point inputs are cast to ``dtype``; integer and boolean ones (token ids for an
    ``nn.Embedding``) keep their dtype. ``y`` is ``None`` for unlabelled batches. Raises
    ``ValueError`` for empty data, inputs without a batch dimension, or NaN/infinite inputs
    (naming the batch).
    """
    if data is None:
        raise ValueError("no data given: fit needs data (or statistics=... for moment methods)")
    batches = [data] if isinstance(data, Tensor) else data
    try:
        total = len(batches) if isinstance(batches, Sized) else None
    except TypeError:  # a mapped generator (batch_to_input=) has a __len__ that cannot answer
        total = None
    seen = 0
    first_shape: tuple[int, ...] | None = None
    for index, batch in enumerate(tqdm(batches, disable=not progress, desc=desc, total=total,
                                       leave=False)):
        if isinstance(batch, dict):
            raise ValueError(f"batch {index} is a dict (keys {sorted(map(str, batch))}): fit "
                             f"reads x or (x, y) batches; pass batch_to_input=, e.g. "
                             f"fit(model, loader, batch_to_input=lambda b: (b['x'], b['y']))")
        if not isinstance(batch, (Tensor, tuple, list)):
            raise ValueError(f"batch {index} is a {type(batch).__name__}: fit reads tensors x "
                             f"or (x, y) tuples; convert others with batch_to_input=")
        if isinstance(batch, (tuple, list)):
            if not batch:
                raise ValueError(f"batch {index} is empty")
            x, y = batch[0], (batch[1] if len(batch) > 1 else None)
        else:
            x, y = batch, None
        if isinstance(x, (tuple, list)):
            raise ValueError(f"batch {index}'s input is a {type(x).__name__} of {len(x)}: the "
                             f"estimators measure models of one input tensor; "
                             f"{support.SEVERAL_INPUTS}")
        x = torch.as_tensor(x)
        if x.dim() < 2:
            raise ValueError(f"batch {index} has shape {tuple(x.shape)}: expected "
                             f"(batch, *features). Data is an iterable of batches; one "
                             f"labelled batch is passed as [(x, y)]")
        # discrete inputs stay discrete: a cast would turn token ids into floats no Embedding
        # takes (fit casts them for a model that needs floats, _check_runs_on)
        # detached: inputs computed by a network (a frozen encoder's features) would tie the
        # stored summary, and every penalty's backward, to that network's graph
        x = x.detach().to(device=device, dtype=None if is_integer_input(x) else dtype)
        if not torch.isfinite(x).all():
            raise ValueError(f"batch {index} contains NaN or infinite inputs")
        if first_shape is None:
            first_shape = tuple(x.shape[1:])
        elif tuple(x.shape[1:]) != first_shape:
            # caught here, with both shapes, instead of as torch's error from inside the model
            # or from concatenating stored inputs
            raise ValueError(f"batch {index} has inputs of shape {tuple(x.shape[1:])} per "
                             f"example, the batches before it {first_shape}: every batch "
                             f"needs the same shape per example (pad sequences to one length)")

        if y is not None:
            y = torch.as_tensor(y).detach().to(device)
            if y.dim() == 0:
                raise ValueError(f"batch {index}'s label is a scalar: data is an iterable of "
                                 f"batches, not of (x, y) examples; batch them (a DataLoader, "
                                 f"or one (x, y) tuple of tensors)")
            if y.shape[0] != x.shape[0]:
                raise ValueError(f"batch {index}: {y.shape[0]} labels for {x.shape[0]} inputs")
        seen += x.shape[0]
        yield x, y
    if seen == 0:
        raise ValueError("data is empty: fit needs at least one example")
