"""Forward hooks on a user's model: which ones change what the model computes.

LAFTR and BGLN evaluate a model from its layers' rules, not by calling its ``forward``, so a
forward (pre-)hook that rescales an activation would be silently ignored. They refuse such
models instead. fsd's own recording hooks (:class:`fsd.StatisticsCollector`) only read their
inputs and are marked so that they pass.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn
from torch.nn.modules import module as torch_module

_RECORDING = "_fsd_records_only"

HookT = TypeVar("HookT", bound=Callable)


def recording_hook(hook: HookT) -> HookT:
    """Mark ``hook`` as one that only reads its arguments (fsd's statistics hooks)."""
    setattr(hook, _RECORDING, True)
    return hook


def forward_hooks(model: nn.Module) -> list[str]:
    """Describe every forward or forward-pre hook that may change ``model``'s outputs.

    Returns one line per hook, e.g. ``"forward hook scale() on Linear at '0'"``; global hooks
    (``torch.nn.modules.module.register_module_forward_hook``) are listed once each. Hooks
    marked with :func:`recording_hook` are left out.
    """
    found = []
    for kind, hooks in (("global forward hook", torch_module._global_forward_hooks),
                        ("global forward pre-hook", torch_module._global_forward_pre_hooks)):
        found += [f"{kind} {_name(h)}" for h in hooks.values() if not _records_only(h)]
    for path, module in model.named_modules():
        where = f"{type(module).__name__} at '{path or '<root>'}'"
        for kind, hooks in (("forward hook", module._forward_hooks),
                            ("forward pre-hook", module._forward_pre_hooks)):
            found += [f"{kind} {_name(h)} on {where}" for h in hooks.values()
                      if not _records_only(h)]
    return found


def _records_only(hook: Callable) -> bool:
    return bool(getattr(hook, _RECORDING, False))


def _name(hook: Callable) -> str:
    return f"{getattr(hook, '__qualname__', type(hook).__name__)}()"
