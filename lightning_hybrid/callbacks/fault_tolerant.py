"""``FaultTolerantCheckpoint``: async, atomic, verified checkpoints with retention, preemption and auto-resume."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hybrid.checkpoint.dcp import SAVE_ERRORS, describe_save_error
from lightning_hybrid.checkpoint.lineage import (
    ON_FOREIGN,
    ForeignCheckpointsError,
    Lineage,
    check_folder,
    claim_folder,
    model_config_of,
    resumable,
    run_id_of,
    set_aside_same_step,
)
from lightning_hybrid.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    fsync_dir,
    purge_old,
    set_aside_newer,
    step_dirname,
    update_latest,
)
from lightning_hybrid.checkpoint.staging import AsyncOptions
from lightning_hybrid.checkpoint.storage import ObjectPath, checkpoint_path, is_committed, remove_checkpoint
from lightning_hybrid.checkpoint.verify import verify_on_all_ranks

log = logging.getLogger(__name__)

__all__ = ["FaultTolerantCheckpoint", "Preempted", "EXIT_CODE_PREEMPTED", "CheckpointSavesFailed", "suggest_interval"]

# EX_TEMPFAIL: "try again later". SLURM requeue scripts and torchrun restarts can key on it.
EXIT_CODE_PREEMPTED = 75


class Preempted(SystemExit):
    """Raised on every rank after the checkpoint a preemption signal asked for is committed."""

    def __init__(self, step: int, saved: bool = True) -> None:
        super().__init__(EXIT_CODE_PREEMPTED)
        self.step = step
        self.saved = saved

    def __str__(self) -> str:
        what = "saved" if self.saved else "could NOT be saved (see the warning above); the last committed one stays"
        return f"preempted: checkpoint of step {self.step} {what}, exiting with code {EXIT_CODE_PREEMPTED}"


class CheckpointSavesFailed(RuntimeError):
    """Raised on every rank after ``max_consecutive_failures`` saves in a row failed; training stops."""


def _is_step_name(name: str) -> bool:
    return name.startswith("step-") and name[len("step-"):].isdigit()


def suggest_interval(save_seconds: float, mtbf_hours: float) -> float:
    """Young/Daly checkpoint interval in seconds for a save cost and a mean time between failures."""
    from lightning_hybrid.planner.interval import young_daly_interval

    return young_daly_interval(save_seconds, mtbf_hours * 3600.0)[1]


class FaultTolerantCheckpoint(pl.Callback):
    """Periodic sharded checkpoints that survive crashes, preemption and bad storage.

    Each save goes to ``dirpath/step-NNNNNN.tmp/``; once every rank finished writing, rank 0 writes the
    manifest (``meta.json``: step, epoch, data position, mesh, model config, versions, size and CRC-32 of
    every file), renames the folder to ``step-NNNNNN/`` and atomically updates ``dirpath/latest``. A
    crash at any moment leaves the previous checkpoint and ``latest`` intact.

    On an object store (``dirpath="s3://bucket/prefix"`` or any fsspec URL) there is no rename: each save is
    written straight into ``step-NNNNNN/`` and is committed when rank 0 writes its manifest object, after every
    shard was read back and checksummed; a killed upload leaves no manifest and is never chosen.

    Args:
        dirpath: folder of the checkpoints (shared by all nodes), or an fsspec URL (``s3://bucket/prefix``).
        every_n_steps: save every N optimizer steps.
        every_n_minutes: save when this much wall time passed since the last save (decided by rank 0).
        keep_last: committed checkpoints to keep; older ones are deleted (never the one written, nor the one
            resumed from until a newer one is committed). Before each save the oldest are deleted down to
            ``keep_last - 1`` (at least one stays), so the disk needs room for ``max(keep_last, 2)`` checkpoints.
        async_save: block only while the save is planned; the state is copied to host memory in the background
            while the next step's forward and backward run (its optimizer step waits for the copy), and written
            by a background writer; the next save (or the end of training) waits for the previous one.
        auto_resume: on ``fit`` without ``ckpt_path``, resume from the newest valid checkpoint in ``dirpath``.
            What is a resume and what a new run: with ``fit(ckpt_path=...)`` the run continues that checkpoint's run
            lineage; with ``auto_resume=True`` and no ``ckpt_path`` it continues the lineage of the newest valid
            checkpoint of this model in ``dirpath`` (a new run if there is none: another model's checkpoints are
            another run's, see ``on_foreign``); with ``auto_resume=False`` and no ``ckpt_path`` it is always a new
            run (a new run id). See :mod:`lightning_hybrid.checkpoint.lineage`.
        save_on_exception: try a synchronous save when training raises (if all ranks reach it within 20 s; not
            tried when the exception says the process group is broken: a dead peer, a NCCL error).
        save_on_signal: SIGTERM or SIGUSR1 trigger a synchronous save at the next step boundary on all ranks,
            then exit with code ``EXIT_CODE_PREEMPTED`` (75).
        allow_fresh_start: when ``dirpath`` holds checkpoints but none is valid, start from scratch (True) or
            raise (False).
        max_consecutive_failures: stop training after this many failed saves in a row.
        mtbf_hours: mean time between failures of the job; with it, the Young/Daly interval for the measured
            save time is logged.
        verify_checksums: check CRC-32s (not only sizes) when choosing the checkpoint to resume from.
        async_writer: the background writer of async saves: ``"thread"``, or ``"process"`` (DCP's
            ``AsyncCheckpointerType.PROCESS``: a daemon process per rank, started at the first save; the training
            script needs an ``if __name__ == "__main__":`` guard).
        storage_options: for a URL ``dirpath``: passed to fsspec and DCP (``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ...); without them the environment's credentials are used.
        on_foreign: what to do, before training, when ``dirpath`` holds checkpoints of another run lineage (also
            another model's, under auto-resume): ``"refuse"`` (raise one line naming the folder, the other run, how
            its model differs and its step, and the ways on; in every worker before the model is built) or
            ``"archive"`` (move them into ``dirpath/archived-<run_id>/``; nothing is deleted). Saves never skip
            or overwrite a folder of another lineage, and retention deletes only this lineage's checkpoints.

    Raises:
        ValueError: no interval was given, or a value is out of range; for a URL, one line when its scheme is
            unknown, its package is missing (``pip install 'lightning-hybrid[s3]'``), the bucket does not exist or
            the store refuses the credentials.
    """

    def __init__(self, dirpath: Union[str, Path], every_n_steps: Optional[int] = None,
                 every_n_minutes: Optional[float] = None, keep_last: int = 3, async_save: bool = True,
                 auto_resume: bool = True, save_on_exception: bool = True, save_on_signal: bool = True,
                 allow_fresh_start: bool = True, max_consecutive_failures: int = 3,
                 mtbf_hours: Optional[float] = None, verify_checksums: bool = True,
                 storage_options: Optional[dict[str, Any]] = None, async_writer: str = "thread",
                 on_foreign: str = "refuse") -> None:
        if every_n_steps is None and every_n_minutes is None and not save_on_signal:
            raise ValueError("FaultTolerantCheckpoint needs every_n_steps, every_n_minutes or save_on_signal=True")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be a positive integer")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes={every_n_minutes} must be positive")
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1")
        if on_foreign not in ON_FOREIGN:
            raise ValueError(f"on_foreign={on_foreign!r}; use one of {', '.join(map(repr, ON_FOREIGN))}")
        self.on_foreign = on_foreign
        self.lineage: Optional[Lineage] = None  # this run's lineage, decided at fit start
        self._resume_source: Optional[Path] = None
        self.dirpath = checkpoint_path(dirpath, storage_options, check=True)
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.keep_last = keep_last
        self.async_save = async_save
        self.async_options = AsyncOptions(writer=async_writer)
        self.auto_resume = auto_resume
        self.save_on_exception = save_on_exception
        self.save_on_signal = save_on_signal
        self.allow_fresh_start = allow_fresh_start
        self.max_consecutive_failures = max_consecutive_failures
        self.mtbf_hours = mtbf_hours
        self.verify_checksums = verify_checksums
        self.resumed_from: Optional[Any] = None
        self.last_saved_step: Optional[int] = None  # the step of the newest save started (and not failed)
        self._last_committed_step: Optional[int] = None
        self.blocking_seconds: list[float] = []  # time training was blocked by each save
        self.save_seconds: list[float] = []      # start to commit of each save
        self._pending: Optional[Any] = None
        self._pending_step: Optional[int] = None
        self._pending_staging = False  # an async save's copy to host memory may still run
        self._failures = 0
        self._signal_received = 0
        self._old_handlers: dict[int, Any] = {}
        self.late_signals: list[int] = []  # signals received after training ended (recorded, harmless)
        self._last_save_time = time.monotonic()
        self._last_checked_step = -1
        self._training_started = False

    # ------------------------------------------------------------------ resume

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if not callable(getattr(trainer.strategy, "begin_save", None)):
            raise TypeError(f"FaultTolerantCheckpoint needs HybridParallelStrategy; the Trainer uses "
                            f"{type(trainer.strategy).__name__} (set strategy=HybridParallelStrategy(...))")
        env = getattr(trainer.strategy, "replica_group_env", None)
        if env is not None and self.dirpath.name != f"replica_group_{env.group_id}":
            # torchft replica groups: each group keeps its own checkpoints (for a disaster in which all die); after
            # such a restart, the first quorum heals every group that resumed from an older step.
            self.dirpath = self.dirpath / f"replica_group_{env.group_id}"
        if stage == "fit":  # before the model is built: another model's ckpt_path, another run's folder (refuse)
            self.check_lineage(trainer.ckpt_path, model_config_of(pl_module))

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = trainer.strategy
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            for stale in self._incomplete():  # half-written saves of a crashed run
                rank_zero_info(f"removing incomplete checkpoint {stale}")
                remove_checkpoint(stale, MANIFEST)
        if trainer.ckpt_path is not None or not self.auto_resume or getattr(strategy, "healed_from_peer", False):
            return  # (a torchft replica group that healed from a live peer already holds newer state)
        # Another model's checkpoints are another run's: never resumed (refused or archived at train start).
        existing = strategy.broadcast([c.path.name for c in resumable(self.dirpath, model_config_of(pl_module))]
                                      if trainer.is_global_zero else None)
        found = self._newest_valid(trainer, [self.dirpath / name for name in existing])
        if trainer.is_global_zero:
            if found is None and existing:
                message = (f"no valid checkpoint in {self.dirpath} (all are damaged)"
                           + ("; starting from scratch" if self.allow_fresh_start else
                              "; pass allow_fresh_start=True to start from scratch or repair the folder"))
                rank_zero_warn(message)
                if not self.allow_fresh_start:
                    found = f"error:{message}"
            if existing and not str(found).startswith("error:") and (found is None or found.name != existing[0]):
                # The damaged ones are moved aside (kept, never tried again; their steps can be saved anew).
                chosen = int(found.name[len("step-"):]) if found is not None else -1
                for moved in set_aside_newer(self.dirpath, chosen, names=existing):
                    rank_zero_warn(f"moved the damaged checkpoint aside to {moved}")
                if found is not None:
                    update_latest(self.dirpath, found)
        found = strategy.broadcast(str(found) if found else "")
        if found.startswith("error:"):
            raise CheckpointError(found[len("error:"):])
        if found:
            rank_zero_info(f"auto-resuming from {found}")
            self.resumed_from = checkpoint_path(found)
            # Lightning restores from `ckpt_path` right after this hook; a callback cannot set that argument,
            # so it pre-loads the checkpoint into the connector the same way `fit(ckpt_path=...)` would.
            trainer._checkpoint_connector.resume_start(found)
            self.last_saved_step = int(trainer._checkpoint_connector._loaded_checkpoint.get("global_step", 0))

    def _incomplete(self) -> list[Any]:
        """Saves a crash left behind: ``step-N.tmp`` folders; on an object store, ``step-N`` prefixes without their
        manifest (an upload killed before its commit)."""
        if isinstance(self.dirpath, ObjectPath):
            return [p for p in self.dirpath.iterdir() if _is_step_name(p.name) and not is_committed(p, MANIFEST)]
        return list(self.dirpath.glob("step-*.tmp"))

    def _claim_folder(self, trainer: "pl.Trainer", source: Optional[Union[str, Path]]) -> None:
        """Take the lineage of ``source`` (the checkpoint resumed from; ``None``: a new run, a new run id), then
        refuse (one line, every rank) or archive (rank 0) the checkpoints of any other lineage in ``dirpath``."""
        verdict: list = []
        if trainer.is_global_zero:
            lineage, error = claim_folder(self.dirpath, source, self.on_foreign, rank_zero_warn,
                                          model_config_of(getattr(trainer, "lightning_module", None)))
            verdict = [lineage.run_id, lineage.adopt_unlabelled, error]
        run_id, adopt, error = trainer.strategy.broadcast(verdict)
        if error:
            raise ForeignCheckpointsError(error)
        self.lineage = Lineage(run_id, adopt)
        self._resume_source = checkpoint_path(source) if source else None

    def check_lineage(self, ckpt_path: Optional[Union[str, Path]] = None,
                      model_config: Optional[dict[str, Any]] = None) -> None:
        """The refusals of :meth:`_claim_folder` from the manifests alone (no collective): before any process starts
        (the CLI), and again in every worker before the model is built. Auto-resume is taken to continue the newest
        readable checkpoint of ``model_config`` (the model being trained); another model's are another run's.

        Raises:
            ValueError: ``ckpt_path`` holds another model (its run and the differing fields named).
            ForeignCheckpointsError: with ``on_foreign="refuse"``, one line naming the folder, the other run, how its
                model differs and the ways on.
        """
        check_folder(self.dirpath, ckpt_path, self.auto_resume, model_config, refuse=self.on_foreign == "refuse")

    def _newest_valid(self, trainer: "pl.Trainer", candidates: list[Path]) -> Optional[Path]:
        """The first of ``candidates`` (newest first) whose files all match the manifest, checked by all ranks.

        Every rank checks a slice of the files (sizes and CRC-32s), so a 1 TB checkpoint of a 72B model is read
        once by the whole job in parallel, not by rank 0 alone; the verdicts are gathered on the checkpoint group.
        Damaged candidates are reported in one line and skipped, the same on every rank.
        """
        import torch.distributed as dist

        world = trainer.world_size if dist.is_initialized() else 1
        for folder in candidates:
            try:
                verified = verify_on_all_ranks(folder, trainer.global_rank, world, trainer.strategy.checkpoint_group,
                                               checksums=self.verify_checksums)
            except CheckpointError as err:
                rank_zero_warn(f"skipping damaged checkpoint: {err}")
                continue
            rank_zero_info(verified.describe(folder, self.verify_checksums))
            return folder
        return None

    # ------------------------------------------------------------------ signals

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Installed after Lightning's own handlers (registered just before training starts), replacing them:
        # the handler only sets a flag; all ranks agree at the next step boundary, with no collective here.
        # The checkpoint restored is known only now: `fit(ckpt_path=...)` sets it after on_fit_start.
        self._claim_folder(trainer, trainer.ckpt_path or self.resumed_from)
        self._last_save_time = time.monotonic()
        self._training_started = True
        if not self.save_on_signal:
            return
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            self._old_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal_received = signum

    def _restore_signals(self) -> None:
        # SIGUSR1 keeps a handler until the process exits: SLURM's warning before the time limit may come while the
        # job still exports or gathers after training, and the default action (terminate) would make a finished job
        # look failed and be requeued. The late signal is only recorded and reported.
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, self._after_training if signum == signal.SIGUSR1 else handler)
        self._old_handlers.clear()

    def _after_training(self, signum: int, frame: Any) -> None:
        self.late_signals.append(signum)
        print(f"received {signal.Signals(signum).name} after training ended; the run is complete, finishing normally",
              file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ saving

    def _agree(self, trainer: "pl.Trainer", values: list[float]) -> list[float]:
        """Max over all ranks of a few flags, on the checkpoint group (one small all-reduce)."""
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=trainer.strategy.checkpoint_group)
        return tensor.tolist()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_checked_step:
            return  # an accumulation micro-batch: no optimizer step happened
        self._last_checked_step = step
        minutes_due = (self.every_n_minutes is not None and trainer.is_global_zero
                       and time.monotonic() - self._last_save_time >= 60 * self.every_n_minutes)
        pending_busy = self._pending is not None and not self._pending.ready()
        signal_flag, time_flag, busy = self._agree(trainer, [float(self._signal_received), float(minutes_due),
                                                             float(pending_busy)])
        if self._pending is not None and not busy:
            self._commit(trainer)
        if signal_flag:
            raise Preempted(step, saved=self._save(trainer, step, async_save=False))
        steps_due = self.every_n_steps is not None and step % self.every_n_steps == 0
        if (steps_due or time_flag) and step != self.last_saved_step:
            self._save(trainer, step, async_save=self.async_save)

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        # The background copy of an async save must end before the optimizer changes the weights; forward and
        # backward of this step ran alongside it. The wait counts as time the save blocked training.
        if self._pending is not None and self._pending_staging:
            start = time.perf_counter()
            self._pending.staged()
            self._pending_staging = False
            self.blocking_seconds[-1] += time.perf_counter() - start

    def _save(self, trainer: "pl.Trainer", step: int, async_save: bool) -> bool:
        """Start (and unless ``async_save`` commit) a save of ``step``; False when it failed (logged, cleaned up)."""
        if self._pending is not None:
            self._commit(trainer)  # the next save waits for the previous one
        final = self.dirpath / step_dirname(step)
        if step == self._last_committed_step or (self._resume_source is not None
                                                 and final.resolve() == self._resume_source.resolve()):
            return True  # this run committed, or resumed from, this step; a folder of it of another run is set aside
        # No rename on an object store: the save goes straight to its prefix and commits with its manifest.
        tmp = final if isinstance(final, ObjectPath) else self.dirpath / (step_dirname(step) + ".tmp")
        self._make_room(trainer)
        start = time.perf_counter()
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            checkpoint.setdefault("hybrid", {})["run_id"] = self.lineage.run_id if self.lineage else None
            self._pending = trainer.strategy.begin_save(checkpoint, tmp,
                                                        async_save=self.async_options if async_save else False)
            self._pending_step = step
            self._pending_staging = bool(async_save)
        except SAVE_ERRORS as err:
            self._failed(trainer, tmp, step, err)
            return False
        self.blocking_seconds.append(time.perf_counter() - start)
        self._last_save_time = time.monotonic()
        self.last_saved_step = step
        return self._commit(trainer) if not async_save else True

    def _make_room(self, trainer: "pl.Trainer") -> None:
        """Before a save, delete the oldest committed checkpoints down to ``keep_last - 1`` (never the last one)."""
        if trainer.is_global_zero:
            for removed in purge_old(self.dirpath, max(1, self.keep_last - 1), protect=self._protected(),
                                     owns=self._owns):
                rank_zero_info(f"removed old checkpoint {removed} to make room for the next save")

    def _owns(self, folder: Path) -> bool:
        return self.lineage is not None and self.lineage.owns(run_id_of(folder))

    def _protected(self) -> list[Path]:
        # The checkpoint resumed from stays until a newer one is committed: until then it is the only known-good one.
        return [self.resumed_from] if self.resumed_from is not None and self._last_committed_step is None else []

    def _commit(self, trainer: "pl.Trainer") -> bool:
        """Wait for the pending save on every rank and commit it; False when it failed (logged, cleaned up)."""
        pending, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        if pending is None:
            return False
        tmp = pending.folder
        try:
            info = pending.finish()
        except SAVE_ERRORS as err:
            self._failed(trainer, tmp, step, err)
            return False
        final = self.dirpath / step_dirname(step)
        if trainer.is_global_zero:
            if tmp != final:
                replaced = set_aside_same_step(final)  # never skip nor overwrite: an older folder of this step is kept
                if replaced is not None:
                    rank_zero_warn(f"{final} existed (another run's or an older branch's); moved it aside: {replaced}")
                os.replace(tmp, final)
                fsync_dir(self.dirpath)
            update_latest(self.dirpath, final)
            for removed in purge_old(self.dirpath, self.keep_last, protect=[final, *self._protected()],
                                     owns=self._owns):
                rank_zero_info(f"removed old checkpoint {removed}")
        trainer.strategy.barrier("checkpoint_commit")
        self._failures = 0
        self._last_committed_step = step
        elapsed = time.perf_counter() - pending.started
        self.save_seconds.append(elapsed)
        message = f"saved checkpoint {final} (step {step}, {elapsed:.2f} s, blocked {self.blocking_seconds[-1]:.2f} s)"
        if self.mtbf_hours:
            interval = suggest_interval(self.blocking_seconds[-1], self.mtbf_hours)
            message += f"; Young/Daly interval for MTBF {self.mtbf_hours} h: {interval / 60:.1f} min"
        rank_zero_info(message)
        del info
        return True

    def _failed(self, trainer: "pl.Trainer", tmp: Path, step: Optional[int], err: BaseException) -> None:
        """Log a failed save once with its cause, remove its folder, and stop after too many in a row."""
        self._failures += 1
        self.last_saved_step = self._last_committed_step  # nothing of this step was committed
        if trainer.is_global_zero:
            remove_checkpoint(tmp, MANIFEST)
        cause = describe_save_error(err)
        if self._failures >= self.max_consecutive_failures:
            raise CheckpointSavesFailed(
                f"{self._failures} checkpoint saves in a row failed (last, step {step}: {cause}); training stopped. "
                f"Free space or fix the storage at {self.dirpath}, then re-run to resume from the last checkpoint")
        rank_zero_warn(f"checkpoint save of step {step} failed ({self._failures} in a row): {cause}; "
                       f"removed {tmp.name}, "
                       f"training continues and the next interval tries again")

    # ------------------------------------------------------------------ end and failures

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._commit(trainer)
        self._restore_signals()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._restore_signals()
        if isinstance(exception, (Preempted, CheckpointSavesFailed)) or not self.save_on_exception \
                or not self._training_started:
            return
        if trainer.global_step == self.last_saved_step:
            return
        import torch.distributed as dist

        from lightning_hybrid.distributed.elastic import peer_failure

        broken = peer_failure(exception) if dist.is_initialized() else None
        if broken is not None:  # a peer is gone: a collective save cannot complete; do not wait 20 s for it
            # (info only: the worker's one exit line says it, distributed/exit_report.py)
            log.info(f"rank {trainer.global_rank}: no checkpoint after {type(exception).__name__}: the process "
                     f"group is broken ({broken}); a restart resumes from the last committed checkpoint")
            return
        try:
            # Only if every rank got here too (an exception raised on all ranks); never hang on a dead peer.
            if dist.is_initialized():
                dist.monitored_barrier(group=trainer.strategy.checkpoint_group, timeout=timedelta(seconds=20))
            self._commit(trainer)
            if self._save(trainer, trainer.global_step, async_save=False):
                rank_zero_warn(f"saved a checkpoint at step {trainer.global_step} after {type(exception).__name__}")
        except SAVE_ERRORS as err:  # noqa: BLE001 - the original exception is what matters; report, it re-raises
            rank_zero_warn(f"could not save a checkpoint after {type(exception).__name__}: {err}")

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved_step": self.last_saved_step, "dirpath": str(self.dirpath)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = state_dict.get("last_saved_step")
