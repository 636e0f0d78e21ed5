"""Which torch device a study runs on, and how it is named in results."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, with a clear error when CUDA is asked for but absent."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was asked for, but torch.cuda.is_available() is "
                           "False on this machine; use --device cpu")
    return dev


def device_name(device: str | torch.device) -> str:
    """The GPU's name for a CUDA device (recorded with timings), else the device type."""
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
