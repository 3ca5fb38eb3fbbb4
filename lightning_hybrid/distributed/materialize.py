"""Materialization of a parallelized meta-device module, with a hook for the dry run.

The dry run (:mod:`lightning_hybrid.dryrun`) plays one rank of a large job on the fake process group: everything up to
the sharding (mesh, TP plan, FSDP2 wrapping) runs as in the real job on the meta device, and from materialization on
the tensors are fake ones (``FakeTensorMode``), which hold shapes and no memory. FSDP2 and DeviceMesh compute
coordinates with real tensor operations at wrapping time, so the fake mode can only start here, after the wrapping.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["materialize", "before_materialize", "move_buffers"]

_BEFORE: list[Callable[[], None]] = []


def before_materialize(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` before every materialization from now on; returns a function that removes it again."""
    _BEFORE.append(hook)

    def remove() -> None:
        if hook in _BEFORE:
            _BEFORE.remove(hook)

    return remove


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s (meta-device, possibly sharded) parameters and buffers on ``device``, uninitialized."""
    for hook in list(_BEFORE):
        hook()
    module.to_empty(device=device)


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Move the buffers of ``module`` that are not on ``device`` there (a materialized declared model's parameters
    are on it already; only buffers built outside the meta device, like rotary tables, may be left behind)."""
    for sub in module.modules():
        for key, buf in sub._buffers.items():
            if buf is not None and buf.device != device:
                sub._buffers[key] = buf.to(device)
