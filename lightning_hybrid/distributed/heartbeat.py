"""Hang detection well before the collective timeout: a per-rank heartbeat through the job's TCPStore.

Each rank runs a watchdog thread. Every ``interval`` seconds it publishes its own record under
``<round prefix>heartbeat/<rank>`` (a beat counter, the last finished training step, what the main thread is doing,
a progress counter, whether it is armed, host and pid) and reads every other rank's record. The thread beats while
the main thread is busy (a collective, a kernel, a data loader), so two things are told apart:

- a **frozen** rank: its beat counter has not moved for ``hang_timeout`` seconds (SIGSTOP, a process stuck in the
  kernel, a lost host). Always watched, also during the first step;
- a **stuck** rank: its beats go on but its main thread has made no progress (no step or validation batch
  finished) for ``hang_timeout`` seconds while armed. Ranks are armed after their first training step (compilation
  and checkpoint load are not hangs), and every validation batch counts as progress (a long validation is not one).

When a rank sees either, it prints one line naming the culprit (rank, host, ``(pp, dp, tp)``, last finished step,
what it was doing), SIGKILLs a frozen culprit on its own host (a stopped process cannot end itself) and exits with
:data:`EXIT_CODE_HANG`: torchrun then stops the remaining workers and restarts the job, which resumes from the newest
checkpoint. Every rank watches every other, so every live rank ends within ``hang_timeout`` plus one interval.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_hybrid.distributed.elastic import round_store_prefix

__all__ = ["HANG_TIMEOUT", "EXIT_CODE_HANG", "write_line", "check_hang_timeout", "Heartbeat", "HangDetector",
           "find_hang", "attach_hang_detector"]

log = logging.getLogger(__name__)

HANG_TIMEOUT = 600.0
"""The default ``hang_timeout`` in seconds: far above a step of any recipe, far below the 30 min collective timeout."""
EXIT_CODE_HANG = 70
"""Exit code of a rank that ended itself because the job hung (EX_SOFTWARE); torchrun restarts on it."""


def check_hang_timeout(value: Any) -> Optional[float]:
    """``value`` as seconds, or ``None`` (off).

    Raises:
        TypeError: not a number or ``None``.
        ValueError: not positive.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"hang_timeout={value!r} must be a number of seconds (e.g. 300) or None to turn it off")
    if not value > 0:
        raise ValueError(f"hang_timeout={value!r} must be positive (seconds, e.g. 300) or None to turn it off")
    return float(value)


def write_line(text: str, fd: Optional[int] = None) -> None:
    """Write ``text`` and its newline to stderr in one ``os.write``: the lines several ranks write at the same moment
    (each its hang report) land whole, one a line, never interleaved (``print`` may write text and newline apart)."""
    data = (" ".join(text.split()) + "\n").encode()
    fd = sys.stderr.fileno() if fd is None else fd
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    while data:  # a pipe takes up to PIPE_BUF (4096) bytes atomically; a hang line is far shorter
        written = os.write(fd, data)
        data = data[written:]


@dataclass
class Seen:
    """What this rank's watchdog knows of another rank: its last record and when it last changed (monotonic)."""

    record: dict
    beat_at: float
    progress_at: float


@dataclass
class Hang:
    """A detected hang: the culprit's record, how it hung and for how long."""

    rank: int
    record: dict
    frozen: bool
    seconds: float
    others: list[int] = field(default_factory=list)


def _where(rank: int, record: dict) -> str:
    coords = record.get("coords") or {}
    mesh = ", ".join(f"{k}={v}" for k, v in coords.items())
    return f"rank {rank} ({record.get('host', '?')}, {mesh})"


def describe(hang: Hang, timeout: float, me: int) -> str:
    """The one-line message printed by every rank that ends itself."""
    record = hang.record
    how = ("stopped responding (no heartbeat" if hang.frozen else "made no progress (heartbeat alive, main thread "
           "stuck") + f" for {hang.seconds:.0f} s, hang_timeout={timeout:g} s)"
    step = record.get("step")
    also = f"; also stuck: ranks {hang.others}" if hang.others else ""
    return (f"hang detected: {_where(hang.rank, record)} {how}; last finished step "
            f"{step if step is not None else 'none'}, then: {record.get('activity', 'unknown')}{also}; "
            f"rank {me} exits with code {EXIT_CODE_HANG} so that torchrun restarts the job")


def find_hang(seen: dict[int, Seen], now: float, timeout: float, world_size: int, started: float) -> Optional[Hang]:
    """The culprit of a hang among ``seen`` (every rank's last record, this rank's own included), or ``None``.

    A frozen rank (no beat for ``timeout``; a rank never heard from counts from ``started``) is named first; else,
    among armed ranks without progress for ``timeout``, the one furthest behind (lowest ``position``: twice the
    finished step, plus one inside the next step; the others wait in a collective for it), listing the rest. A
    stuck rank also silent for ``timeout / 2`` is frozen (its last beat came after its last progress) and named first.
    """
    frozen = [(now - (seen[r].beat_at if r in seen else started), r) for r in range(world_size)
              if (r not in seen or seen[r].record.get("state") != "stopped")]
    frozen = [(age, r) for age, r in frozen if age > timeout]
    if frozen:
        age, rank = max(frozen)
        return Hang(rank, seen[rank].record if rank in seen else {}, True, age,
                    sorted(r for _, r in frozen if r != rank))
    stuck = [r for r, s in seen.items() if s.record.get("armed") and s.record.get("state") != "stopped"
             and now - s.progress_at > timeout]
    if not stuck:
        return None
    # A stuck rank whose beats also stopped (none for half the timeout: five or more missed) is frozen, not merely
    # stuck: its thread beat once after its last progress, just before it froze, so its stuck age crossed the
    # timeout a moment before its frozen age. It is named (and killed) as frozen, before any live stuck rank.
    silent = {r for r in stuck if now - seen[r].beat_at > timeout / 2}
    rank = min(stuck, key=lambda r: (r not in silent, seen[r].record.get("position", -1), r))  # furthest behind
    if rank in silent:
        return Hang(rank, seen[rank].record, True, now - seen[rank].beat_at, sorted(set(stuck) - {rank}))
    return Hang(rank, seen[rank].record, False, now - seen[rank].progress_at, sorted(set(stuck) - {rank}))


class Heartbeat:
    """A rank's watchdog thread: publishes this rank's record and ends the process when the job hangs.

    Args:
        timeout: seconds without a beat (frozen) or without progress while armed (stuck) that count as a hang.
        store: a ``torch.distributed.Store`` shared by the job (keys go under ``heartbeat/``).
        rank, world_size: this rank and the number of ranks.
        identity: extra fields of this rank's record (``host``, ``coords``).
        on_hang: called with the message instead of ending the process (tests); ``None`` ends it.
    """

    def __init__(self, timeout: float, store: Any, rank: int, world_size: int, identity: dict,
                 on_hang: Optional[Callable[[str, Hang], None]] = None, interval: Optional[float] = None) -> None:
        self.timeout, self.store, self.rank, self.world_size = timeout, store, rank, world_size
        self.interval = interval if interval is not None else max(0.2, min(5.0, timeout / 10))
        self.on_hang = on_hang
        self._record = {"beat": 0, "progress": 0, "step": None, "activity": "starting", "armed": False,
                        "state": "running", "pid": os.getpid(), **identity}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen: dict[int, Seen] = {}
        self._thread: Optional[threading.Thread] = None
        self._started = time.monotonic()

    def progress(self, activity: str, step: Optional[int] = None, arm: bool = False, position: int = -1) -> None:
        """The main thread moved on: now ``activity``; ``step`` finished (when given); ``arm`` starts stuck checks;
        ``position`` orders ranks by how far they got (the lowest of stuck ranks is named)."""
        with self._lock:
            self._record["progress"] += 1
            self._record["activity"] = activity
            self._record["position"] = position
            if step is not None:
                self._record["step"] = step
            if arm:
                self._record["armed"] = True
        if step is not None and self._thread is not None:
            # A finished step is published at once: a rank frozen right after it is then named with that step,
            # not with the record of up to one interval before. One small store write per step.
            try:
                self._publish()
            except Exception as err:  # noqa: BLE001 - the thread's next beat retries; never fail a training step
                log.debug(f"heartbeat: could not publish step {step}: {err}")

    def disarm(self, activity: str) -> None:
        """Stop the stuck check of this rank until the next ``progress(arm=True)`` (e.g. after training)."""
        with self._lock:
            self._record["armed"] = False
            self._record["activity"] = activity
            self._record["progress"] += 1

    def start(self) -> "Heartbeat":
        self._started = time.monotonic()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="lightning-hybrid-heartbeat", daemon=True)
        self._thread.start()
        # Also stopped before the interpreter finalizes (a Trainer whose fit never returned): a daemon thread caught
        # inside a store call then would be ended by pthread_exit through C++ frames, which aborts the process.
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Tell the others this rank is done (so its silence is no hang) and end the thread."""
        if self._thread is None:
            return
        atexit.unregister(self.stop)
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.interval))
        if self._thread.is_alive():
            log.warning(f"heartbeat of rank {self.rank}: the watchdog thread did not end within "
                        f"{max(5.0, 2 * self.interval):.0f} s (a store call hangs)")
        self._thread = None
        with self._lock:
            self._record["state"] = "stopped"
        try:
            self._publish()
        except Exception as err:  # noqa: BLE001 - the store may be gone at exit; the others then stop too
            log.debug(f"heartbeat: could not publish the stop: {err}")

    def _publish(self) -> None:
        with self._lock:
            self._record["beat"] += 1
            payload = json.dumps(self._record)
        self.store.set(f"heartbeat/{self.rank}", payload)

    def _read(self, now: float) -> None:
        keys = [f"heartbeat/{r}" for r in range(self.world_size)]
        present = [k for k in keys if self.store.check([k])]
        for key, raw in zip(present, self.store.multi_get(present) if present else []):
            rank, record = int(key.rsplit("/", 1)[1]), json.loads(raw)
            old = self._seen.get(rank)
            if old is None:
                self._seen[rank] = Seen(record, now, now)
                continue
            if record["beat"] != old.record["beat"]:
                old.beat_at = now
            if record["progress"] != old.record["progress"] or not record.get("armed"):
                old.progress_at = now
            old.record = record

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                now = time.monotonic()
                self._read(now)
                hang = find_hang(self._seen, now, self.timeout, self.world_size, self._started)
            except Exception as err:  # noqa: BLE001 - a store that went away (job ending): stop watching quietly
                log.debug(f"heartbeat stopped: {err}")
                return
            if hang is not None and not self._stop.is_set():
                self._end(hang)
                return

    def _end(self, hang: Hang) -> None:
        message = describe(hang, self.timeout, self.rank)
        if self.on_hang is not None:
            self.on_hang(message, hang)
            return
        write_line(f"[rank{self.rank}]: {message}")
        pid, host = hang.record.get("pid"), hang.record.get("host")
        if hang.frozen and pid and host == socket.gethostname() and hang.rank != self.rank:
            try:  # a stopped process cannot end itself; torchrun would wait its grace period for it
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os._exit(EXIT_CODE_HANG)


def job_store(timeout: timedelta) -> Any:
    """A client of the job's TCPStore (``MASTER_ADDR:MASTER_PORT``), under this torchrun round's prefix."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(round_store_prefix() or "lightning_hybrid/", store)


class HangDetector(Callback):
    """Runs this rank's :class:`Heartbeat` during ``fit`` and feeds it the training and validation progress.

    Added to the Trainer by ``HybridParallelStrategy(hang_timeout=...)``; not meant to be added by hand.
    """

    def __init__(self, timeout: float, rank: int, world_size: int, coords: dict[str, int]) -> None:
        self.timeout, self.rank, self.world_size, self.coords = timeout, rank, world_size, coords
        self.heartbeat: Optional[Heartbeat] = None

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        store = job_store(timedelta(seconds=max(60.0, self.timeout)))
        identity = {"host": socket.gethostname(), "coords": self.coords}
        self.heartbeat = Heartbeat(self.timeout, store, self.rank, self.world_size, identity).start()
        self.heartbeat.progress(f"first training step {trainer.global_step + 1} (not yet watched: compile, load)")

    def _progress(self, trainer: "pl.Trainer", activity: str, step: Optional[int] = None, arm: bool = False,
                  inside: bool = False) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(activity, step, arm, 2 * trainer.global_step + int(inside))

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._progress(trainer, f"training step {trainer.global_step + 1} (forward, backward, optimizer)", inside=True)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        self._progress(trainer, f"after step {step}: callbacks, checkpoint, next batch", step, arm=True)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._progress(trainer, "validation: first batch")

    @override
    def on_validation_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._progress(trainer, f"validation: after batch {batch_idx}")

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._progress(trainer, "after validation")

    def _stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stop()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._stop()


def attach_hang_detector(trainer: "pl.Trainer", timeout: Optional[float], rank: int, world_size: int,
                         coords: dict[str, int]) -> Optional[HangDetector]:
    """Add a :class:`HangDetector` to ``trainer`` (once; none for one process or ``timeout=None``)."""
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, HangDetector)]
    if timeout is None or world_size < 2:
        return None
    detector = HangDetector(timeout, rank, world_size, coords)
    trainer.callbacks.insert(0, detector)  # first: a step counts as finished before other callbacks run
    return detector
