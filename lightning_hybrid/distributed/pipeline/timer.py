"""Busy and idle time of this rank's pipeline stages, and the bubble report at the end of training."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional

import torch

__all__ = ["StageTimer", "gather_bubble_report", "format_bubble_report"]


class StageTimer:
    """Busy time of this rank's stages: time inside their forward/backward compute calls, and the step time.

    On CPU the wall clock around each call. On CUDA a pair of timing events per call on the current stream, read
    back once they have completed (never a ``synchronize``: that would serialise the pipeline's sends and
    receives with compute and cost the throughput it measures); :attr:`busy`, :attr:`step_time` and
    :attr:`idle_fraction` wait for the events still in flight when they are read.
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self._cuda = device is not None and device.type == "cuda"
        self._busy = 0.0
        self._step_time = 0.0
        self.steps = 0
        self._pending: deque[tuple[str, Any, Any]] = deque()  # ("busy" | "step", start, end event), CUDA only
        self._step_start: Any = None

    def reset(self) -> None:
        """Forget what was measured so far (call after warm-up steps)."""
        self._drain(wait=True)
        self._busy = self._step_time = 0.0
        self.steps = 0

    def wrap(self, stage: Any) -> None:
        # forward_one_chunk / backward_one_chunk / backward_weight_one_chunk are the per-micro-batch compute
        # calls of torch's PipelineStage; the schedule's p2p waits happen outside them.
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, name, None)
            if inner is not None:
                setattr(stage, name, self._timed(inner))

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, kind: str, start: Any, end: Any) -> None:
        if self._cuda:
            self._pending.append((kind, start, end))
            self._drain(wait=False)
        else:
            self._accumulate(kind, end - start)

    def _accumulate(self, kind: str, seconds: float) -> None:
        if kind == "busy":
            self._busy += seconds
        else:
            self._step_time += seconds

    def _drain(self, wait: bool) -> None:
        """Add up the CUDA event pairs that have completed (all of them when ``wait``), oldest first."""
        while self._pending:
            kind, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            self._accumulate(kind, start.elapsed_time(end) / 1e3)

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add("busy", start, self._mark())

        return timed

    def start_step(self) -> None:
        self._step_start = self._mark()

    def end_step(self) -> None:
        self._add("step", self._step_start, self._mark())
        self.steps += 1

    @property
    def busy(self) -> float:
        """Seconds this rank's stages computed."""
        self._drain(wait=True)
        return self._busy

    @property
    def step_time(self) -> float:
        """Seconds of the training steps measured."""
        self._drain(wait=True)
        return self._step_time

    @property
    def idle_fraction(self) -> Optional[float]:
        step_time = self.step_time
        return None if step_time <= 0 else max(0.0, 1.0 - self.busy / step_time)


def gather_bubble_report(timer: StageTimer, pp_rank: int, world_size: int, theoretical: float) -> dict[str, Any]:
    """Every stage's measured idle fraction (mean over its ranks) next to the schedule's theoretical bubble.

    A collective over the world: every rank calls it, each with its own timer.
    """
    import torch.distributed as dist

    mine = {"pp_rank": pp_rank, "idle": timer.idle_fraction}
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine)
    per_stage: dict[int, list[float]] = {}
    for item in gathered:
        if item["idle"] is not None:
            per_stage.setdefault(item["pp_rank"], []).append(item["idle"])
    return {"theoretical": theoretical, "measured": {r: sum(v) / len(v) for r, v in sorted(per_stage.items())}}


def format_bubble_report(report: dict[str, Any], schedule: str, pp: int, microbatches: int,
                         virtual_stages: int) -> str:
    """One line: the measured idle fraction per pipeline rank and the theoretical bubble."""
    measured = ", ".join(f"rank {r}: {100 * v:.1f}%" for r, v in report["measured"].items())
    return (f"pipeline bubble ({schedule}, pp={pp}, microbatches={microbatches}, virtual_stages={virtual_stages}): "
            f"measured idle {measured}; theoretical {100 * report['theoretical']:.1f}%")
