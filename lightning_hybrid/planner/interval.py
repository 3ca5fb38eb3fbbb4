"""Checkpoint interval of the planner: Young/Daly's optimum and the time expected to be lost.

Young (1974) gives the interval that minimises the time lost to checkpoints and to recomputing after
failures, ``tau = sqrt(2 delta M)`` for a save of ``delta`` seconds and a mean time between failures
``M``; Daly (2006) refines it with higher-order terms. The fault-tolerance callback logs the same
interval from the save time it measures.
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["young_daly_interval", "checkpoint_plan", "DEFAULT_GPU_MTBF_HOURS", "DEFAULT_STORAGE_GBPS",
           "DEFAULT_RESTART_SECONDS"]

DEFAULT_GPU_MTBF_HOURS = 50_000.0
"""Mean time between job-interrupting failures per GPU, hours. The Llama 3 paper (Meta, 2024) reports
419 unexpected interruptions in 54 days on 16,384 H100s (GPUs, hosts, network, software), one per
~3.1 h for the job, i.e. about 50,000 GPU-hours per interruption; a job of N GPUs sees MTBF/N."""
DEFAULT_STORAGE_GBPS = 1.0
"""Checkpoint write bandwidth per GPU to shared storage, GB/s, for the estimated save time."""
DEFAULT_RESTART_SECONDS = 600.0
"""Time to detect a failure, restart the job and reload the last checkpoint, seconds."""
_MIN_SAVE_SECONDS = 1e-6  # keeps Young's square root positive for an (estimated) instant save
SECONDS_PER_HOUR = 3600


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> tuple[float, float]:
    """(Young's ``sqrt(2 delta M)``, Daly's higher-order refinement) checkpoint intervals in seconds."""
    young = math.sqrt(2 * save_seconds * mtbf_seconds)
    if save_seconds >= 2 * mtbf_seconds:
        return young, mtbf_seconds
    ratio = save_seconds / (2 * mtbf_seconds)
    daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_seconds
    return young, daly


def checkpoint_plan(checkpoint_bytes_per_gpu: float, gpus: int, step_seconds: float,
                    save_seconds: Optional[float] = None, mtbf_hours: Optional[float] = None,
                    storage_gbps: float = DEFAULT_STORAGE_GBPS,
                    restart_seconds: float = DEFAULT_RESTART_SECONDS) -> dict[str, float]:
    """Young/Daly checkpoint interval and the expected fraction of time lost to checkpoints and failures.

    Args:
        checkpoint_bytes_per_gpu: bytes each rank writes (its parameter and optimizer shards).
        gpus: GPUs in the job.
        step_seconds: predicted optimizer step time.
        save_seconds: blocking time of one save; ``None`` estimates ``bytes / storage_gbps``.
        mtbf_hours: mean time between failures of the whole job; ``None`` uses
            ``DEFAULT_GPU_MTBF_HOURS / gpus``.
        storage_gbps: write bandwidth per GPU, GB/s, for the estimate.
        restart_seconds: restart and reload time after a failure.

    Returns:
        ``save_seconds``, ``mtbf_hours``, ``interval_seconds`` (Daly), ``young_seconds``, ``interval_steps``
        and ``lost_fraction``: ``save/T + (T/2 + restart)/MTBF``.
    """
    save = save_seconds if save_seconds is not None else checkpoint_bytes_per_gpu / (storage_gbps * 1e9)
    mtbf_h = mtbf_hours if mtbf_hours is not None else DEFAULT_GPU_MTBF_HOURS / gpus
    mtbf = mtbf_h * SECONDS_PER_HOUR
    young, daly = young_daly_interval(max(save, _MIN_SAVE_SECONDS), mtbf)
    interval = max(daly, step_seconds)
    lost = save / interval + (interval / 2 + restart_seconds) / mtbf
    return {"save_seconds": save, "mtbf_hours": mtbf_h, "young_seconds": young, "interval_seconds": interval,
            "interval_steps": max(1, round(interval / step_seconds)) if step_seconds > 0 else 1,
            "restart_seconds": restart_seconds, "lost_fraction": min(1.0, lost)}
