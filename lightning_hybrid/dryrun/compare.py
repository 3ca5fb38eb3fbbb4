"""The planner's prediction for the rank a dry run traced, the ratios, and whether the rank fits its device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_hybrid.dryrun.rank import RankResult
from lightning_hybrid.dryrun.recipe import DryRunJob

__all__ = ["Prediction", "predict", "usable_bytes", "FIGURES"]

# The figures a report shows, traced beside the planner's. "activations" is MemTracker's kind: every tensor made in
# the forward and kept, FSDP2's gathered parameters and autocast's weight copies included, which the planner lists
# apart (fsdp_buffers, autocast_copies); "transient" is everything but the model state, on both sides.
FIGURES = ("parameters", "gradients", "optimizer", "activations", "transient", "total")


@dataclass
class Prediction:
    """The planner's bytes for one rank (``figures``) and the device's usable bytes."""

    figures: dict[str, float]
    usable: float
    collectives: Optional[dict[str, dict[str, list[int]]]] = None  # None: a layout the planner does not count
    full_step_total: float = 0.0  # the planner's total for the recipe's whole step (all its micro-batches)


def usable_bytes(gpu: str, device_memory_gib: Optional[float]) -> float:
    """Bytes a rank may fill: the planner's rule (memory less the framework's reserve, less fragmentation) on the
    GPU table's memory, or on ``device_memory_gib`` GiB.

    Raises:
        ValueError: an unknown GPU name or a memory that is not positive.
    """
    from lightning_hybrid.hardware import SYSTEM_GPUS
    from lightning_hybrid.planner.step_time import Hardware

    if gpu not in SYSTEM_GPUS:
        raise ValueError(f"--gpu {gpu!r} is not in the hardware table; use one of {', '.join(sorted(SYSTEM_GPUS))}")
    hw = Hardware(SYSTEM_GPUS[gpu], 1, 1)
    if device_memory_gib is None:
        return hw.usable_bytes
    if not device_memory_gib > 0:
        raise ValueError(f"--device-memory-gib {device_memory_gib} must be positive")
    gb = device_memory_gib * (1 << 30) / 1e9
    return max(0.0, (gb - hw.reserved_gb) * (1 - hw.fragmentation)) * 1e9


def _layout(job: DryRunJob, dims: Any, options: Any, microbatches: Optional[int] = None) -> Any:
    """The planner's layout of ``job``, with ``microbatches`` of the recipe's size per step (default: the recipe's
    count)."""
    from lightning_hybrid.planner.layout import Layout

    m = options.num_microbatches if dims.pp > 1 else 1
    return Layout(tp=dims.tp, pp=dims.pp, dp=dims.dp, data_parallel=options.data_parallel,
                  micro_batch_size=job.batch_size // m, microbatches=microbatches if dims.pp > 1 and microbatches
                  else m, schedule=options.pp_schedule if dims.pp > 1 else "none",
                  virtual_stages=options.virtual_stages, recompute=options.activation_checkpointing,
                  sequence_parallel=options.sequence_parallel, cp=dims.cp,
                  dp_shard=dims.dp_shard if options.data_parallel == "hsdp" else 0)


def predict(job: DryRunJob, config: Any, dims: Any, options: Any, result: RankResult, gpu: str,
            usable: float, traced_microbatches: int = 1) -> Prediction:
    """The planner's figures for ``result``'s rank: its exact state bytes at the rank's coordinates
    (:func:`~lightning_hybrid.planner.memory.rank_memory`), its memory breakdown for the rank's pipeline
    coordinate (activations held at the peak, total) in a step of ``traced_microbatches`` micro-batches, its total in
    the recipe's whole step, and the collectives of the traced step
    (:func:`~lightning_hybrid.planner.collectives.predicted_collectives`)."""
    from lightning_hybrid.distributed.pipeline.schedules import V_SHAPED
    from lightning_hybrid.hardware import SYSTEM_GPUS
    from lightning_hybrid.planner.collectives import predicted_collectives
    from lightning_hybrid.planner.layout import Problem
    from lightning_hybrid.planner.layout_memory import rank_memory_breakdown
    from lightning_hybrid.planner.memory import rank_memory
    from lightning_hybrid.planner.runtime import runtime_from_options
    from lightning_hybrid.planner.step_time import Hardware

    c = result.coordinates
    stage_style = "v" if options.pp_schedule in V_SHAPED else "loop"
    # FSDP shards over dp x cp, HSDP inside groups of dp_shard consecutive dp ranks (dp_shard == dp without HSDP) x cp:
    # the rank's state is FSDP's over its shard group, where its index is (dp within the group, cp) flattened
    mode = "fsdp" if options.data_parallel == "hsdp" else options.data_parallel
    shard_index = (c["dp"] % dims.dp_shard) * dims.cp + c.get("cp", 0)
    state = rank_memory(config, dims.tp, dims.pp, dims.dp_shard * dims.cp, mode, c["pp"], c["tp"], shard_index,
                        job.precision, "adamw", options.virtual_stages, stage_style)
    hw = Hardware(SYSTEM_GPUS[gpu], job.world_size, job.devices_per_node)
    problem = Problem(config, hw, job.seq_len, job.batch_size * dims.dp, job.precision,
                      runtime=runtime_from_options(job.strategy, job.precision))
    layout = _layout(job, dims, options)
    # at the traced micro-batches; what grows with their count beyond those in flight (a schedule that keeps its
    # outputs) is added to the traced peak for the recipe's whole step by the report (full_step_total)
    memory = rank_memory_breakdown(problem, _layout(job, dims, options, traced_microbatches), c["pp"])
    figures = {"parameters": state["param_bytes"], "gradients": state["grad_bytes"],
               "optimizer": state["optimizer_bytes"], "activations": memory["activations"],
               "total": memory["total"],
               "transient": memory["total"] - memory["weights"] - memory["gradients"] - memory["optimizer"]}
    try:
        collectives = predicted_collectives(problem, layout, c["pp"], traced_microbatches,
                                            gradient_clipping=bool(job.gradient_clip_val),
                                            selective_ac=options.selective_ac, loss_parallel=options.loss_parallel,
                                            reshard_after_forward=options.fsdp_reshard_after_forward)
    except ValueError:  # cp, HSDP and multi-stage schedules are not counted by the planner
        collectives = None
    return Prediction(figures, usable, collectives, rank_memory_breakdown(problem, layout, c["pp"])["total"])
