"""Inside a launched worker: a fault injected at a step meets a known checkpoint state, whatever the machine's load.

``FaultTolerantCheckpoint`` commits a finished background write at the next step end at which every rank reports
its write done. Under load a write can take longer than a step, so which checkpoint a fault at the step after a save
leaves committed (and a restart resumes from) would be a race. :class:`SettleSaves` removes it.
"""

from __future__ import annotations

import time
from typing import Callable

import lightning as L

from lightning_hybrid import FaultTolerantCheckpoint

__all__ = ["SettleSaves", "wait_for_pending_write"]


def wait_for_pending_write(checkpoint: FaultTolerantCheckpoint, seconds: float) -> None:
    """Wait (``seconds`` at most) for this rank's background write of ``checkpoint``'s previous save to end."""
    pending, deadline = checkpoint._pending, time.monotonic() + seconds
    while pending is not None and not pending.ready() and time.monotonic() < deadline:
        time.sleep(0.01)


class SettleSaves(L.Callback):
    """At a step for which ``at(step)`` holds (a step where the worker injects a fault), every rank first waits
    (120 s at most) for its own background write of the previous save to finish. Placed before the
    ``FaultTolerantCheckpoint`` in the callbacks, whose hook at that step then commits it: the checkpoint a test
    expects the restart to resume from is committed before the fault. A save started at that step itself stays in
    flight (the faults "during an async write")."""

    def __init__(self, checkpoint: FaultTolerantCheckpoint, at: Callable[[int], bool]) -> None:
        self.checkpoint, self.at = checkpoint, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.at(trainer.global_step):
            return
        wait_for_pending_write(self.checkpoint, 120)
