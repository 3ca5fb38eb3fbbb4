"""Pipeline schedules: the names we accept, their families, defaults and rules, and their theoretical bubble.

Every fact about a schedule is here: which torch class runs it, how many stages a rank holds and in
which shape (one stage, a loop ``{r, r+pp}`` or a V ``{r, 2pp-1-r}``), which rank holds the last
stage, the default micro-batch count, the micro-batch rules (checked before anything is built) and
the idle fraction of the ideal schedule.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PP_SCHEDULES", "SINGLE_STAGE", "LOOPED", "V_SHAPED", "ZERO_BUBBLE", "schedule_class",
           "default_microbatches", "last_stage_pp_rank", "stage_ids_for_rank", "validate_schedule",
           "theoretical_bubble", "check_batch_splits"]

# Names accepted by `pp_schedule` (case-insensitive) -> name for torch.distributed.pipelining.get_schedule_class.
PP_SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")
LOOPED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
V_SHAPED = ("zbv_zero_bubble", "dualpipev")
# Zero-bubble schedules run the weight-gradient pass separately: FSDP must keep the blocks gathered after forward.
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def schedule_class(schedule: str) -> Any:
    """The ``torch.distributed.pipelining`` schedule class of one of :data:`PP_SCHEDULES`."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(PP_SCHEDULES[schedule])


def default_microbatches(schedule: str, pp: int, virtual_stages: int) -> int:
    """``2 * pp`` micro-batches (``2 * pp * virtual_stages`` for V schedules, which need one per stage)."""
    return 2 * pp * (virtual_stages if schedule in V_SHAPED else 1)


def last_stage_pp_rank(schedule: str, pp: int) -> int:
    """Pipeline rank holding the last stage: the last rank, or rank 0 for a V (its second stage comes back)."""
    return 0 if schedule in V_SHAPED else pp - 1


def stage_ids_for_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices a pipeline rank holds: one stage; a loop {r, r+pp, ...}; or a V {r, 2pp-1-r}."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def validate_schedule(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> None:
    """Check that the schedule, virtual stages and micro-batch count go together.

    Raises:
        ValueError: the combination is invalid, with the values that would fit.
    """
    if schedule in SINGLE_STAGE and virtual_stages != 1:
        raise ValueError(f"pp_schedule={schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                         f"interleaved schedule ({', '.join(LOOPED + V_SHAPED)})")
    if schedule in LOOPED + V_SHAPED and virtual_stages < 2:
        raise ValueError(f"pp_schedule={schedule!r} needs virtual_stages >= 2 (got {virtual_stages}); "
                         f"set virtual_stages=2 or use gpipe/1f1b")
    if schedule in V_SHAPED and virtual_stages != 2:
        raise ValueError(f"pp_schedule={schedule!r} places exactly two stages per rank in a V; use virtual_stages=2")
    stages = pp * virtual_stages
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"microbatches={microbatches} is fewer than the {pp} stages 1f1b needs; use >= {pp}")
    if schedule in LOOPED and microbatches % pp:
        raise ValueError(f"microbatches={microbatches} must be a multiple of pp={pp} for {schedule}")
    if schedule in V_SHAPED and microbatches < stages:
        raise ValueError(f"microbatches={microbatches} is fewer than the {stages} stages {schedule} needs; "
                         f"use >= {stages}")


def theoretical_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a stage in the ideal schedule: (p-1)/(m+p-1), divided by v for interleaved ones."""
    if pp <= 1:
        return 0.0
    bubble = (pp - 1) / (microbatches + pp - 1)
    return bubble / virtual_stages if schedule in LOOPED + V_SHAPED else bubble


def check_batch_splits(per_rank_batch: int, microbatches: int) -> None:
    """Raise ``ValueError`` unless the per-rank batch splits evenly into ``microbatches`` (else a shape error deep
    inside the schedule)."""
    if per_rank_batch % microbatches:
        raise ValueError(
            f"the per-rank batch of {per_rank_batch} sequences does not split into microbatches={microbatches}; "
            f"use a batch size that is a multiple of {microbatches} or change microbatches"
        )
