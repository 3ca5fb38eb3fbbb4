"""Inside a launched worker: objects, full weights and predictions gathered from every rank (gloo)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_objects", "gather_merged", "full_weights", "first_prediction"]


def gather_objects(value: Any) -> list:
    """``value`` of every rank, by rank, on every rank."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_merged(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Union over all ranks of per-rank dicts (pipeline stages hold different keys)."""
    merged: dict[str, torch.Tensor] = {}
    for part in gather_objects(local):
        merged.update(part)
    return merged


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, gathered from TP/FSDP shards and pipeline stages, on every rank."""
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.init_weights import canonical_name

    local = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        local[canonical_name(name)] = value.detach().cpu().clone()
    return gather_merged(local)


def first_prediction(predictions: Any) -> Any:
    """The first batch of ``trainer.predict``'s result, from the rank that has one (a pipeline's last stage)."""
    mine = predictions[0] if predictions and predictions[0] is not None else None
    return next(p for p in gather_objects(mine) if p is not None)
