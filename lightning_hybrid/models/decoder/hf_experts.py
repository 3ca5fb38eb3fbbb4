"""The experts of a Hugging Face mixture-of-experts checkpoint (Qwen3-MoE) in both layouts found in the wild.

- **Per expert** (the Hub's files, and what ``transformers`` 5's ``save_pretrained`` writes back through its
  conversion mapping): ``model.layers.N.mlp.experts.E.{gate_proj,up_proj}.weight`` ``(I, H)`` and
  ``...E.down_proj.weight`` ``(H, I)``.
- **Fused** (``transformers`` 5's in-memory layout, written by anything that saves its ``state_dict`` as is):
  ``model.layers.N.mlp.experts.gate_up_proj`` ``(E, 2I, H)`` (gate rows, then up rows) and
  ``model.layers.N.mlp.experts.down_proj`` ``(E, H, I)``: our own tensors, name for name.

A rank reads only the region of its shard (some experts, some rows of them): from per-expert files the region is
assembled from the experts' own tensors, each read through safetensors' slice API. Export writes the per-expert
layout, which every ``transformers`` version reads.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

import torch

__all__ = ["is_fused_layout", "per_expert_tensors", "per_expert_source", "read_experts_region", "PER_EXPERT_NAME"]

PER_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_NAME = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_OURS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_fused_layout(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor ``names`` hold the experts fused (3-D, ``transformers`` 5's memory layout)."""
    return any(_FUSED_NAME.match(name) for name in names)


def per_expert_tensors(layer: int, num_experts: int, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of the per-expert tensors of sparse block ``layer``."""
    shapes: dict[str, tuple[int, ...]] = {}
    for e in range(num_experts):
        prefix = f"model.layers.{layer}.mlp.experts.{e}"
        shapes.update({f"{prefix}.gate_proj.weight": (inter, hidden), f"{prefix}.up_proj.weight": (inter, hidden),
                       f"{prefix}.down_proj.weight": (hidden, inter)})
    return shapes


def per_expert_source(name: str, inter: int) -> Optional[tuple[str, tuple[Any, ...]]]:
    """(our tensor, the index of it) that the per-expert Hugging Face tensor ``name`` is, or ``None`` for another
    name: expert ``E``'s gate is ``gate_up_proj[E, :I]``, its up ``gate_up_proj[E, I:]``, its down ``down_proj[E]``."""
    match = PER_EXPERT_NAME.match(name)
    if match is None:
        return None
    layer, expert, kind = int(match.group(1)), int(match.group(2)), match.group(3)
    if kind == "down_proj":
        return f"layers.{layer}.mlp.experts.down_proj", (expert,)
    rows = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
    return f"layers.{layer}.mlp.experts.gate_up_proj", (expert, rows)


def _row_parts(first: int, count: int, inter: int) -> list[tuple[str, int, int, int]]:
    """The rows ``[first, first + count)`` of a fused ``gate_up_proj`` expert as (tensor kind, its first row, rows,
    position in the region)."""
    parts = []
    for kind, base in (("gate_proj", 0), ("up_proj", inter)):
        lo, hi = max(first, base), min(first + count, base + inter)
        if lo < hi:
            parts.append((kind, lo - base, hi - lo, lo - first))
    return parts


def read_experts_region(files: Any, ours: str, offset: tuple[int, ...], shape: tuple[int, ...],
                        inter: int) -> torch.Tensor:
    """The region ``[offset, offset + shape)`` of our fused tensor ``ours`` (``layers.N.mlp.experts.gate_up_proj`` or
    ``...down_proj``) read from a per-expert checkpoint, each expert's rows from its own tensors.

    Args:
        files: a :class:`~lightning_hybrid.models.decoder.hf.SafetensorsFolder` (``read(name, offset, shape)``).
        ours: our parameter name.
        offset, shape: the region (3-D).
        inter: ``moe_intermediate_size``.
    """
    match = _OURS.match(ours)
    assert match is not None, ours
    layer, which = int(match.group(1)), match.group(2)
    (e0, r0, c0), (n, rows, cols) = offset, shape
    pieces = []
    for e in range(e0, e0 + n):
        prefix = f"model.layers.{layer}.mlp.experts.{e}"
        if which == "down_proj":
            pieces.append(files.read(f"{prefix}.down_proj.weight", (r0, c0), (rows, cols)))
            continue
        parts = [files.read(f"{prefix}.{kind}.weight", (start, c0), (count, cols))
                 for kind, start, count, _ in _row_parts(r0, rows, inter)]
        pieces.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    return torch.stack(pieces)
