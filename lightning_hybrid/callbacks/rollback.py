"""What :class:`~lightning_hybrid.callbacks.TrainingHealth` does beyond skipping a step: roll back in process, stop.

A rollback reloads the newest committed checkpoint of :class:`~lightning_hybrid.callbacks.FaultTolerantCheckpoint`
into the running processes (weights, optimizer states, RNG, LR schedulers, the optimizer step counter; no
restart) and leaves the data window since that checkpoint out for good: the data loader is already past it (it is
not rewound), the range goes into the sampler's skip list, which every later checkpoint's manifest carries, and is
written into the manifests already committed, so a run resumed from any of them, on any mesh, leaves it out again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl

from lightning_hybrid.callbacks.fault_tolerant import FaultTolerantCheckpoint
from lightning_hybrid.checkpoint import sharded
from lightning_hybrid.checkpoint.manifest import committed_checkpoints, record_skips
from lightning_hybrid.data.sampler import data_position

__all__ = ["EXIT_CODE_UNHEALTHY", "TrainingUnhealthy", "RolledBack", "find_checkpointer", "roll_back", "stop"]

# Distinct from EXIT_CODE_PREEMPTED (75): a launcher must not simply requeue a run that diverges or computes wrong.
EXIT_CODE_UNHEALTHY = 76


class TrainingUnhealthy(SystemExit):
    """Raised on every rank when TrainingHealth stops the run (after saving what it could); exit code 76."""

    def __init__(self, step: int, reason: str, saved: bool) -> None:
        super().__init__(EXIT_CODE_UNHEALTHY)
        self.step, self.reason, self.saved = step, reason, saved

    def __str__(self) -> str:
        what = "checkpoint saved" if self.saved else "no checkpoint saved (no FaultTolerantCheckpoint or it failed)"
        return f"training health stopped the run at step {self.step}: {self.reason}; {what}; exit code " \
               f"{EXIT_CODE_UNHEALTHY}"


@dataclass(frozen=True)
class RolledBack:
    """A rollback done: the step returned to, the checkpoint, the skipped range ``(epoch, start, end)`` of global
    sample positions (``None`` when the data position is unknown) and the seconds it took."""

    to_step: int
    folder: str
    skipped: Optional[tuple[int, int, int]]
    seconds: float


def find_checkpointer(trainer: "pl.Trainer", health: pl.Callback) -> Optional[FaultTolerantCheckpoint]:
    """The Trainer's FaultTolerantCheckpoint, with ``health`` moved before it in ``trainer.callbacks`` so that a
    rollback at the end of a step happens before that step could be saved."""
    found = next((c for c in trainer.callbacks if isinstance(c, FaultTolerantCheckpoint)), None)
    if found is not None and health in trainer.callbacks:
        callbacks = [c for c in trainer.callbacks if c is not health]
        callbacks.insert(callbacks.index(found), health)
        trainer.callbacks = callbacks
    return found


def _restore_counters(trainer: "pl.Trainer", state: dict[str, Any]) -> None:
    """The optimizer step counter, the scheduler states and the logging step of the loaded checkpoint; the batch
    counters stay (they count the data read, and the data is not rewound)."""
    loops = state.get("loops", {}).get("fit_loop", {})
    epoch_loop = trainer.fit_loop.epoch_loop
    if "epoch_loop.automatic_optimization.optim_progress" in loops:
        epoch_loop.automatic_optimization.optim_progress.load_state_dict(
            loops["epoch_loop.automatic_optimization.optim_progress"])
    # Saved before Lightning counted the step it ended; Lightning counts this one after the hooks.
    epoch_loop._batches_that_stepped = loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", 0)
    for config, saved in zip(trainer.lr_scheduler_configs, state.get("lr_schedulers", [])):
        config.scheduler.load_state_dict(saved)


def roll_back(trainer: "pl.Trainer", checkpointer: FaultTolerantCheckpoint) -> Optional[RolledBack]:
    """Reload the newest committed checkpoint in place and skip the data since it; ``None`` when none exists.

    Call on every rank together at the end of a step (after its optimizer step was skipped).
    """
    start = time.perf_counter()
    strategy = trainer.strategy
    checkpointer._commit(trainer)  # a save in flight counts once it is committed
    names = strategy.broadcast([c.path.name for c in committed_checkpoints(checkpointer.dirpath)]
                               if trainer.is_global_zero else None)
    if not names:
        return None
    folder = checkpointer.dirpath / names[0]
    sampler = strategy.train_sampler
    now = data_position(trainer, strategy.per_rank_batch_size, strategy.dims.dp, sampler)
    state = sharded.load(strategy.checkpoint_context(), folder)
    _restore_counters(trainer, state)
    then = state.get("hybrid", {}).get("data_position") or {}
    skipped = None
    if now is not None and sampler is not None:
        begin = then.get("samples_in_epoch", 0) if then.get("epoch") == now["epoch"] else 0
        skipped = (now["epoch"], begin, now["samples_in_epoch"])
        if begin < skipped[2]:
            sampler.add_skip(*skipped)
        if trainer.is_global_zero:
            record_skips(checkpointer.dirpath, [list(s) for s in sampler.skips])
        strategy.barrier("health_rollback")
    checkpointer.last_saved_step = trainer.global_step
    return RolledBack(trainer.global_step, str(folder), skipped, time.perf_counter() - start)


def stop(trainer: "pl.Trainer", checkpointer: Optional[FaultTolerantCheckpoint], reason: str) -> TrainingUnhealthy:
    """Save the current state (its bad step was not applied) if a checkpointer is there; the exception to raise."""
    saved = False
    if checkpointer is not None:
        checkpointer._commit(trainer)
        saved = checkpointer._save(trainer, trainer.global_step, async_save=False)
    return TrainingUnhealthy(trainer.global_step, reason, saved)
