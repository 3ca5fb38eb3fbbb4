"""Ranks that are identical by construction, so that a dry run of ``--ranks all`` traces one rank per role.

A rank's program is fixed by its pipeline coordinate (which stages it holds, so which blocks, the embedding or the
head, and its place in the schedule) and by the shapes of its local shards. Tensor-parallel shards are equal on
every tp coordinate (the strategy refuses sizes that do not divide); FSDP2 splits each TP-local tensor on dim 0 with
``torch.chunk`` rules over dp x cp, which may leave the last (dp, cp) coordinates fewer rows. Two ranks with the same
pipeline coordinate and the same local shard shapes run the same operations on tensors of the same shapes and issue
the same collectives on their own groups: their bytes and collective counts are equal, so one trace stands for all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.pipeline.schedules import stage_ids_for_rank
from lightning_hybrid.distributed.pipeline.split import plan_stages
from lightning_hybrid.planner.memory import chunk_rows, rank_parameter_shapes

__all__ = ["Role", "rank_roles", "parse_ranks"]


@dataclass(frozen=True)
class Role:
    """One distinct program: its pipeline coordinate and stages, the ranks that run it, the one traced."""

    pp_rank: int
    stages: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def traced_rank(self) -> int:
        """The rank the dry run builds for this role (the lowest)."""
        return self.ranks[0]


def _shard_shapes(config: Any, dims: ParallelDims, fsdp: bool, stage_plans: list[Any], num_stages: int,
                  tp_rank: int, dp_rank: int, cp_rank: int = 0) -> tuple:
    blocks = [b for plan in stage_plans for b in range(plan.first_block, plan.last_block)]
    shapes = rank_parameter_shapes(config, dims.tp, tp_rank, blocks, embedding=any(p.has_embedding for p in
                                   stage_plans), head=any(p.has_head for p in stage_plans),
                                   num_stages=num_stages)
    # FSDP shards over dp x cp, HSDP inside groups of dp_shard consecutive dp ranks x cp; the rank's index there is
    # (dp within the group, cp) flattened
    shards = dims.dp_shard * dims.cp
    if not (fsdp and shards > 1):
        return tuple(shapes.values())
    index = (dp_rank % dims.dp_shard) * dims.cp + cp_rank
    return tuple((chunk_rows(s[0], shards, index), *s[1:]) for s in shapes.values())


def rank_roles(config: Any, spec: Any, dims: ParallelDims, options: Any) -> list[Role]:
    """Every rank of the world grouped into roles (see the module docstring), ordered by pipeline coordinate."""
    num_stages = dims.pp * options.virtual_stages
    plans = plan_stages(spec, config.num_hidden_layers, num_stages, options.pp_split_points)
    fsdp = options.data_parallel in ("fsdp", "hsdp")
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank in range(dims.world_size):
        c = dims.coordinates(rank)
        stages = tuple(stage_ids_for_rank(c["pp"], dims.pp, options.virtual_stages, options.pp_schedule))
        signature = _shard_shapes(config, dims, fsdp, [plans[s] for s in stages], num_stages, c["tp"],
                                   c["dp"], c.get("cp", 0))
        groups[(c["pp"], stages, signature)].append(rank)
    return [Role(pp, stages, tuple(ranks)) for (pp, stages, _), ranks in sorted(groups.items(), key=lambda kv: kv[1])]


def parse_ranks(text: str, world_size: int) -> list[int]:
    """``"all"`` or a comma-separated list of ranks.

    Raises:
        ValueError: a rank that is not an integer in ``0 .. world_size - 1``.
    """
    if text.strip().lower() == "all":
        return list(range(world_size))
    ranks = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not 0 <= int(part) < world_size:
            raise ValueError(f"--ranks {text!r}: {part!r} is not a rank of this job; use 'all' or ranks from 0 to "
                             f"{world_size - 1}, comma-separated")
        ranks.append(int(part))
    return sorted(set(ranks))
