"""Stage split: cut a declared model's blocks into balanced contiguous stages and prune a copy per stage.

``plan_stages`` cuts the blocks into ``pp * virtual_stages`` contiguous stages, balanced by the
model's declared costs (the embedding rides on the first stage, final norm + head on the last).
``build_stages`` prunes a meta-device copy of the model per stage, so every parameter keeps its
global name (``layers.57.mlp.up_proj.weight``) on every mesh.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

from lightning_hybrid.distributed.parallel_dims import tied_embedding_error
from lightning_hybrid.models.spec import ParallelSpec

if TYPE_CHECKING:  # the split is arithmetic (the planner shares plan_stages); the pruning deep-copies modules
    from torch import nn

__all__ = ["StagePlan", "plan_stages", "prune_to_stage", "build_stages"]


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: blocks ``[first_block, last_block)`` and whether it holds the ends."""

    index: int
    first_block: int
    last_block: int
    has_embedding: bool
    has_head: bool
    cost: float

    @property
    def num_blocks(self) -> int:
        return self.last_block - self.first_block


def _stage_cost(spec: ParallelSpec, first: int, last: int, num_blocks: int) -> float:
    cost = (last - first) * spec.block_cost
    if first == 0:
        cost += spec.embedding_cost
    if last == num_blocks:
        cost += spec.head_cost
    return cost


def _plans(spec: ParallelSpec, bounds: list[int], num_blocks: int) -> list[StagePlan]:
    return [StagePlan(i, a, b, a == 0, b == num_blocks, _stage_cost(spec, a, b, num_blocks))
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def _balanced_bounds(spec: ParallelSpec, num_blocks: int, num_stages: int) -> list[int]:
    """Contiguous split minimizing the largest stage cost (exact dynamic program, ties: earliest cut)."""
    inf = float("inf")
    # best[s][j]: smallest max-cost of splitting blocks [0, j) into s stages; cut[s][j]: start of the last one.
    best = [[inf] * (num_blocks + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_blocks + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, num_blocks - (num_stages - s) + 1):
            for k in range(s - 1, j):
                if best[s - 1][k] == inf:
                    continue
                value = max(best[s - 1][k], _stage_cost(spec, k, j, num_blocks))
                if value < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = value, k
    bounds, j = [num_blocks], num_blocks
    for s in range(num_stages, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    return bounds[::-1]


def plan_stages(spec: ParallelSpec, num_blocks: int, num_stages: int,
                split_points: Optional[Sequence[Union[str, int]]] = None) -> list[StagePlan]:
    """Cut ``num_blocks`` blocks into ``num_stages`` contiguous stages.

    Args:
        spec: the model's declared parts and costs.
        num_blocks: number of blocks.
        num_stages: ``pp * virtual_stages``.
        split_points: ``None`` balances by cost; block names where stages 2..n start
            (``["layers.40"]``); or the number of blocks of every stage (``[41, 39]``).

    Raises:
        ValueError: more stages than blocks, or split points that do not exist, are not increasing,
            or do not give ``num_stages`` non-empty stages.
    """
    if num_stages > num_blocks:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {num_blocks} blocks; "
                         f"use at most {num_blocks} stages (pp * virtual_stages)")
    if split_points is None or len(split_points) == 0:
        return _plans(spec, _balanced_bounds(spec, num_blocks, num_stages), num_blocks)
    points = list(split_points)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in points):
        if len(points) != num_stages or any(p < 1 for p in points) or sum(points) != num_blocks:
            raise ValueError(f"pp_split_points={points} must be {num_stages} positive block counts summing to "
                             f"{num_blocks}")
        bounds = [0]
        for count in points:
            bounds.append(bounds[-1] + count)
        return _plans(spec, bounds, num_blocks)
    if len(points) != num_stages - 1:
        raise ValueError(f"pp_split_points={points} names {len(points)} stage starts; {num_stages} stages need "
                         f"{num_stages - 1}, like "
                         f"{[f'{spec.blocks}.{(i + 1) * num_blocks // num_stages}' for i in range(num_stages - 1)]}")
    starts = []
    for point in points:
        prefix, _, index = str(point).rpartition(".")
        if prefix != spec.blocks or not index.isdigit() or not 0 < int(index) < num_blocks:
            raise ValueError(f"split point {point!r} does not exist; use {spec.blocks}.N with "
                             f"1 <= N <= {num_blocks - 1}")
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ValueError(f"pp_split_points={points} must be strictly increasing")
    return _plans(spec, [0, *starts, num_blocks], num_blocks)


def prune_to_stage(model: nn.Module, spec: ParallelSpec, plan: StagePlan) -> nn.Module:
    """A deep copy of the (meta-device) model holding only the blocks and ends of ``plan``."""
    stage = copy.deepcopy(model)
    blocks = getattr(stage, spec.blocks)
    for key in list(blocks.keys()):
        if not plan.first_block <= int(key) < plan.last_block:
            del blocks[key]
    if not plan.has_embedding:
        setattr(stage, spec.embedding, None)
    if not plan.has_head:
        setattr(stage, spec.norm, None)
        setattr(stage, spec.head, None)
    return stage


def build_stages(model: nn.Module, spec: ParallelSpec, plans: list[StagePlan],
                 stage_ids: list[int]) -> tuple[nn.Module, list[nn.Module]]:
    """This rank's stage modules and one container that holds all their parts under global names.

    The container is a pruned copy of the model whose blocks and ends *are* the stage modules' (the
    same objects), so its ``named_parameters()`` are this rank's parameters with their global names,
    for the optimizer and checkpoints. It is never called.

    Raises:
        ValueError: the model ties its embedding to its head across stages.
    """
    embedding, head = getattr(model, spec.embedding, None), getattr(model, spec.head, None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if tied:
        raise ValueError(tied_embedding_error(tied, 1, len(plans)))
    stages = [prune_to_stage(model, spec, plans[i]) for i in stage_ids]
    container = copy.deepcopy(model)
    blocks = getattr(container, spec.blocks)
    for key in list(blocks.keys()):
        del blocks[key]
    for name in (spec.embedding, spec.norm, spec.head):
        setattr(container, name, None)
    for stage in stages:
        for key, block in getattr(stage, spec.blocks).items():
            blocks[key] = block
        for name in (spec.embedding, spec.norm, spec.head):
            if getattr(stage, name, None) is not None:
                setattr(container, name, getattr(stage, name))
    # Keep blocks in global order so parameter order is the same on every mesh.
    ordered = sorted(blocks.items(), key=lambda kv: int(kv[0]))
    for key in list(blocks.keys()):
        del blocks[key]
    for key, block in ordered:
        blocks[key] = block
    return container, stages
