"""Cross-replica consistency: bitwise checksums of the weights that groups of ranks must hold identically.

Used by :meth:`~lightning_hybrid.callbacks.TrainingHealth.check_consistency`: with ``data_parallel="replicate"``
every DP replica holds the same weights; under TP the parameters held whole (norms) are the same on every TP peer.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensor_checksum", "replica_checksums", "find_inconsistent"]

_SLOTS = (("dp",), ("tp",), ("dp", "tp"))  # the mesh dims a parameter's identical copies span


def _replicated_dims(param: torch.Tensor, dims: Any, replicate_dp: bool) -> tuple[str, ...]:
    """The world-mesh dims (of ``dp``, ``tp``) along which every rank holds the same bits of ``param``'s piece."""
    from torch.distributed.tensor import DTensor

    sizes = {"dp": dims.dp, "tp": dims.tp}
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        spans = {n for n, p in zip(names, param.placements) if p.is_replicate()}
        if "dp" not in names and replicate_dp:
            spans.add("dp")
    else:  # a plain parameter is a full copy on every TP peer, and on every DP peer when not sharded
        spans = {"dp", "tp"} if replicate_dp else {"tp"}
    return tuple(d for d in ("dp", "tp") if d in spans and sizes[d] > 1)


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of a tensor's bits, position-weighted: one ulp anywhere changes it."""
    flat = tensor.detach().contiguous().reshape(-1)
    ints = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()])
    weights = torch.arange(ints.numel(), dtype=torch.int64, device=ints.device) % 65521 + 1
    return (ints.to(torch.int64) * weights).sum()


def replica_checksums(module: torch.nn.Module, dims: Any, replicate_dp: bool) -> torch.Tensor:
    """Per slot of ``_SLOTS``: a checksum of this rank's pieces of the parameters replicated along those dims."""
    from torch.distributed.tensor import DTensor

    sums = torch.zeros(len(_SLOTS), dtype=torch.int64)
    for index, (_, param) in enumerate(sorted(module.named_parameters(), key=lambda item: item[0])):
        spans = _replicated_dims(param, dims, replicate_dp)
        if spans:
            local = param.to_local() if isinstance(param, DTensor) else param
            sums[_SLOTS.index(spans)] += tensor_checksum(local).cpu() * (index + 1)
    return sums


def find_inconsistent(gathered: list[list[int]], dims: Any) -> list[tuple[str, list[int], list[int]]]:
    """(dims, odd ranks, their peers) per group of replicas whose checksums differ; the odd ones are the ranks
    outside the largest agreeing subset (all of them on a tie)."""
    found = []
    for slot, spans in enumerate(_SLOTS):
        groups: dict[tuple, list[int]] = {}
        for rank in range(len(gathered)):
            coords = dims.coordinates(rank)
            groups.setdefault(tuple(v for k, v in coords.items() if k not in spans), []).append(rank)
        for ranks in groups.values():
            values = [gathered[r][slot] for r in ranks]
            if len(set(values)) > 1:
                counts = {v: values.count(v) for v in values}
                best = max(counts.values())
                winners = [v for v, c in counts.items() if c == best]
                agree = winners[0] if len(winners) == 1 else None
                odd = [r for r in ranks if gathered[r][slot] != agree]
                found.append(("x".join(spans), odd, [r for r in ranks if r not in odd]))
    return found
