"""Straggler detection: which ranks hold the others back, named by global rank, host and mesh coordinates.

Why not compare raw step times: in synchronous training every collective waits for the slowest
rank, so a rank that waits for a straggler shows the same step period as the straggler, and when
the straggler's delay falls outside the step (slow data loading, a slow host between steps) the
*waiting* rank shows the longer step time. What differs between ranks is when each one arrives at
the start of a step. Every rank measures its arrival times from a point that all ranks leave
together (the previous gather), on its own monotonic clock, so no clock synchronization between
hosts is needed. The latest rank to arrive sets the pace; a rank that arrives ``d`` seconds earlier
spends ``d`` waiting, so its own time per step is the period minus ``d`` (:func:`own_step_times`).
A rank whose own time exceeds the (lower) median by more than the threshold is a straggler.

What host timers cannot see: a rank that is slow *inside* a step, between two collectives (a slow
GPU), makes its peers wait inside the same collectives and arrives on time; per-device compute is
checked by the preflight matmul test instead.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

__all__ = ["Straggler", "StragglerDetector", "find_stragglers", "own_step_times"]


def own_step_times(intervals: Sequence[float], arrivals: Sequence[float]) -> list[float]:
    """Per-rank time a step takes without waiting for peers.

    Args:
        intervals: per-rank mean wall time from one step's end to the next (all about equal in
            synchronous training: the group's period).
        arrivals: per-rank mean time of arriving at a step's start, measured from a common sync point.

    Returns:
        ``period - (latest arrival - arrival of the rank)``, at least 0, for each rank.

    Raises:
        ValueError: the two sequences are empty or of different lengths.
    """
    if not intervals or len(intervals) != len(arrivals):
        raise ValueError(f"need one interval and one arrival per rank; got {len(intervals)} intervals "
                         f"and {len(arrivals)} arrivals")
    period = statistics.median(intervals)
    latest = max(arrivals)
    return [max(0.0, period - (latest - arrival)) for arrival in arrivals]


def find_stragglers(step_times: Sequence[float], threshold: float) -> list[int]:
    """Ranks whose step time exceeds the median by more than ``threshold`` (a fraction: 0.2 = 20%).

    The median is the lower median, so with two ranks the faster one is the reference, and with a
    minority of stragglers it is a healthy rank's time.

    Raises:
        ValueError: ``threshold`` is not positive.
    """
    if not threshold > 0:
        raise ValueError(f"threshold={threshold!r} must be a positive fraction, for example 0.2 for 20% slower")
    if not step_times:
        return []
    median = statistics.median_low(step_times)
    if median <= 0:
        return []
    return [rank for rank, t in enumerate(step_times) if t > median * (1.0 + threshold)]


@dataclass(frozen=True)
class Straggler:
    """One rank found slower than the median.

    Args:
        rank: global rank.
        host: host name of the rank.
        coordinates: its ``pp``/``dp``/``tp`` mesh coordinates (empty without a hybrid mesh).
        own_time: its own time per step in seconds (see :func:`own_step_times`).
        median_time: the median own time of all ranks.
        step_time: its mean measured step time (batch start to batch end), for reference.
        data_wait: its mean wait for the next batch.
    """

    rank: int
    host: str
    coordinates: dict[str, int] = field(default_factory=dict)
    own_time: float = 0.0
    median_time: float = 0.0
    step_time: float = 0.0
    data_wait: float = 0.0

    @property
    def slowdown(self) -> float:
        """How much slower than the median, as a fraction (0.5 = 50% slower)."""
        return self.own_time / self.median_time - 1.0 if self.median_time > 0 else float("inf")

    def describe(self) -> str:
        coords = " ".join(f"{k}={v}" for k, v in self.coordinates.items())
        where = f"host {self.host}" + (f", {coords}" if coords else "")
        return (f"rank {self.rank} ({where}) {self.own_time:.3f} s/step, {self.slowdown:.0%} slower than the median "
                f"{self.median_time:.3f} s (its step {self.step_time:.3f} s, data wait {self.data_wait:.3f} s)")


class StragglerDetector:
    """Collects this rank's step timings and, every ``every_n_steps``, gathers them from all ranks.

    Every rank must call :meth:`start` once and :meth:`gather` at the same steps (the caller keys
    both on the optimizer step, which is the same on every rank). No collective runs in between.

    Args:
        every_n_steps: gather period in optimizer steps; 0 disables detection.
        threshold: fraction above the median own step time that makes a straggler.

    Raises:
        ValueError: a negative period or a non-positive threshold.
    """

    def __init__(self, every_n_steps: int = 50, threshold: float = 0.2) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 0:
            raise ValueError(f"straggler_every_n_steps={every_n_steps!r} must be an integer >= 0 (0 disables)")
        if not threshold > 0:
            raise ValueError(f"straggler_threshold={threshold!r} must be a positive fraction, for example 0.2")
        self.every_n_steps = every_n_steps
        self.threshold = threshold
        self.hosts: list[str] = []
        self.coordinates: list[dict[str, int]] = []
        self.history: list[tuple[int, list[Straggler]]] = []
        self._reference = time.perf_counter()
        self._sums = [0.0, 0.0, 0.0, 0.0]  # interval, arrival, step time, data wait
        self._count = 0

    @staticmethod
    def active_world() -> int:
        """World size of the default process group, 1 when there is none."""
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def enabled(self) -> bool:
        return self.every_n_steps > 0 and self.active_world() > 1

    def start(self, dims: Optional[Any] = None) -> None:
        """Gather host names (a sync point of all ranks) and start the clock from it.

        Args:
            dims: the strategy's ``ParallelDims`` for mesh coordinates, or ``None``.
        """
        if not self.enabled():
            return
        import torch.distributed as dist

        hosts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        self.hosts = [str(h) for h in hosts]
        self.coordinates = [dims.coordinates(r) if dims is not None else {} for r in range(len(hosts))]
        self._reset()

    def _reset(self) -> None:
        self._reference = time.perf_counter()
        self._sums = [0.0, 0.0, 0.0, 0.0]
        self._count = 0

    def record(self, step_start: float, interval: float, step_time: float, data_wait: float) -> None:
        """Add one optimizer step: its start (``time.perf_counter()``), period, step time and data wait."""
        values = (interval, step_start - self._reference, step_time, data_wait)
        self._sums = [s + v for s, v in zip(self._sums, values)]
        self._count += 1

    def due(self, step: int) -> bool:
        return self.enabled() and step > 0 and step % self.every_n_steps == 0

    def gather(self, step: int, device: torch.device) -> list[Straggler]:
        """All-gather the per-rank means over the world group and return the stragglers (the same on every rank)."""
        import torch.distributed as dist

        n = max(self._count, 1)
        local = torch.tensor([s / n for s in self._sums], dtype=torch.float64, device=device)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        rows = torch.stack(parts).cpu().tolist()  # waits for the collective: all ranks leave here together
        self._reset()
        intervals, arrivals, steps, waits = (list(col) for col in zip(*rows))
        own = own_step_times(intervals, arrivals)
        median = statistics.median_low(own)
        found = [Straggler(rank=r, host=self.hosts[r] if self.hosts else "?",
                           coordinates=self.coordinates[r] if self.coordinates else {},
                           own_time=own[r], median_time=median, step_time=steps[r], data_wait=waits[r])
                 for r in find_stragglers(own, self.threshold)]
        self.history.append((step, found))
        return found
