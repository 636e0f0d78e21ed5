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


def cpu_name() -> str:
    """The CPU's model name and the vector instructions torch's kernels use on it.

    Recorded with results because CPU runs repeat to the digit only on the same CPU model:
    the kernels torch picks (``AVX2``, ``AVX512``, …) round differently. The model name
    comes from ``/proc/cpuinfo`` where it exists, else :func:`platform.processor`.
    """
    import platform

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), "")
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"
