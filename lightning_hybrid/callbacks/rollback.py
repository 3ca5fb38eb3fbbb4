"""What :class:`~lightning_hybrid.callbacks.TrainingHealth` does beyond skipping a step: roll back in process, stop.

A rollback reloads the newest committed checkpoint of :class:`~lightning_hybrid.callbacks.FaultTolerantCheckpoint`
into the running processes (weights, optimizer states, RNG, LR schedulers, the optimizer step counter; no
restart) and leaves the data window since that checkpoint out for good: the data loader is already past it (it is
not rewound), the range goes into the sampler's skip list, which every later checkpoint's manifest carries, and is
written into the manifests already committed, so a run resumed from any of them, on any mesh, leaves it out again.
With ``skip_batches`` only the last batches of the window are skipped: the data is rewound to the checkpoint's
position (batch counters and Lightning's data iterator anew, as on a resume) and the batches before are read again.
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


def _rewind(trainer: "pl.Trainer", state: dict[str, Any], sampler: Any, then: dict[str, Any],
            skipped: tuple[int, int, int]) -> None:
    """Put the data back where the checkpoint was, with ``skipped`` left out: the batches between are read again.

    The batch counters of the checkpoint come back too, and the training data iterator is made anew (Lightning's
    fetcher, told how many batches the epoch already counted, as on a resume).
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.load_state_dict(state["loops"]["fit_loop"]["epoch_loop.batch_progress"])
    # Lightning counts the step now ending as completed after the hooks.
    progress.current.completed -= 1
    progress.total.completed -= 1
    sampler.resume_from(skipped[0], then["samples_in_epoch"], then.get("counted"))
    sampler.add_skip(*skipped)
    fetcher = trainer.fit_loop._data_fetcher
    iter(fetcher)
    fetcher.fetched += progress.current.ready


def _window(now: dict[str, Any], then: dict[str, Any],
            skip_batches: Optional[int]) -> tuple[tuple[int, int, int], bool]:
    """The range to skip ``(epoch, start, end)`` and whether the data must be rewound to reach its start."""
    same_epoch = then.get("epoch") == now["epoch"] and "samples_in_epoch" in then
    begin = then["samples_in_epoch"] if same_epoch else 0
    end = now["samples_in_epoch"]
    if skip_batches is not None and same_epoch and end - skip_batches * now["global_batch"] > begin:
        return (now["epoch"], end - skip_batches * now["global_batch"], end), True
    return (now["epoch"], begin, end), False


def roll_back(trainer: "pl.Trainer", checkpointer: FaultTolerantCheckpoint,
              skip_batches: Optional[int] = None) -> Optional[RolledBack]:
    """Reload the newest committed checkpoint in place and skip the data since it (or its last ``skip_batches``
    batches, when it is of this epoch: the ones before are read again); ``None`` when no checkpoint exists.

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
    now = data_position(trainer, strategy.per_rank_batch_size,
                        strategy.distributed_sampler_kwargs["num_replicas"], sampler)
    state = sharded.load(strategy.checkpoint_context(), folder)
    _restore_counters(trainer, state)
    then = state.get("hybrid", {}).get("data_position") or {}
    skipped = None
    if now is not None and sampler is not None:
        skipped, rewind = _window(now, then, skip_batches)
        if rewind:
            _rewind(trainer, state, sampler, then, skipped)
        elif skipped[1] < skipped[2]:
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
