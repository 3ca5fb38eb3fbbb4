"""Training under FaultTolerantCheckpoint for the fault-tolerance tests (launched with torchrun). Environment: OUT
(folder for results), CKPT (checkpoint folder), STEPS, EVERY (save interval), ASYNC (0/1), KILL_AT (step at which
KILL_RANK SIGKILLs itself, right after that step's save started; the previous save committed first, whatever the
load: helpers.settle), KILL_ONLY_FIRST_ATTEMPT (1: only when torchrun's restart count is 0), SIGTERM_AT (every
rank sends itself SIGTERM at that step), SLOW_WRITER_RANK (that rank's background writer pauses 2 s before its first
collective), TP, PP. FILL_DISK_AT (rank 0 fills the checkpoint file
system after that step, before the next step's save, leaving FILL_DISK_LEAVE bytes), FREE_DISK_AT (rank 0 waits for
the pending save to end after that step, then frees the space again), FAIL_LIKE_DCP_AT (every rank's DCP file writer
raises ENOSPC for that step's checkpoint, where no file system can be mounted), ASYNC_WRITER (thread or process).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.equivalence import GLOBAL_BATCH, SEED, make_dataset, make_trainer_kwargs, tiny_config
from helpers.gather import full_weights
from helpers.settle import SettleSaves, wait_for_pending_write
from helpers.worker_exit import end_worker
from lightning_hybrid import FaultTolerantCheckpoint, HybridParallelStrategy
from lightning_hybrid.models import CausalLM


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


class Faults(L.Callback):
    """Logs each step's loss (rank 0) and injects the failure the test asked for."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def fill_or_free_disk(self, trainer, step: int) -> None:
        if int(env("FILL_DISK_AT", "0")) == step and trainer.global_rank == 0:
            fill_disk(_ballast(), leave=int(env("FILL_DISK_LEAVE", "0")))
        if int(env("FREE_DISK_AT", "0")) == step:
            checkpoint = next(c for c in trainer.callbacks if isinstance(c, FaultTolerantCheckpoint))
            wait_for_pending_write(checkpoint, 60)  # the failing background write of the previous save ends first
            if trainer.global_rank == 0:
                _ballast().unlink()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0:
            with open(self.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(trainer.callback_metrics["train_loss"]),
                                    "attempt": int(env("TORCHELASTIC_RESTART_COUNT", "0")),
                                    "pid": os.getpid()}) + "\n")
        every = int(env("EVERY", "2"))
        if env("RECORD_WEIGHTS") == "1" and step % every == 0:
            weights = full_weights(pl_module.model)
            if trainer.global_rank == 0:
                torch.save(weights, self.out / f"weights_step{step}.pt")
        if int(env("STALL_AT", "0")) == step and trainer.global_rank == int(env("STALL_RANK", "1")):
            # torchrun's SIGTERM (sent once the survivors failed) ends it at once; FaultTolerantCheckpoint's handler
            # would only note it and torchrun wait out its 30 s grace period before SIGKILL. The test is the survivors'.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(120)  # a hung peer: alive, never joins the next collective
        kill_at = int(env("KILL_AT", "0"))
        first_only = env("KILL_ONLY_FIRST_ATTEMPT") == "1"
        if kill_at and step == kill_at and trainer.global_rank == int(env("KILL_RANK", "1")):
            if not first_only or env("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
        if int(env("KILL_ALL_AT", "0")) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        self.fill_or_free_disk(trainer, step)
        if int(env("SIGTERM_AT", "0")) == step and not (self.out / f"sigterm_sent_{trainer.global_rank}").exists():
            (self.out / f"sigterm_sent_{trainer.global_rank}").touch()
            os.kill(os.getpid(), signal.SIGTERM)


def _ballast() -> Path:
    return Path(env("CKPT")) / "ballast.bin"


def fill_disk(path: Path, leave: int = 0) -> None:
    """Write zeros into ``path`` until the file system is full (ENOSPC), unbuffered so closing cannot fail; then give
    back ``leave`` bytes (room for small files, not for a checkpoint's shards)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 4096, 1):  # big blocks, then fill the last partial ones
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)


def inject_dcp_like_failures() -> None:
    """FAIL_LIKE_DCP_AT=N: DCP's own file writer raises ENOSPC while writing the step-N checkpoint, so DCP wraps it
    exactly as for a full disk (CheckpointException, from the background thread when async)."""
    def no_space_left() -> None:
        raise OSError(28, "No space left on device")

    fail_at = int(env("FAIL_LIKE_DCP_AT", "0"))
    if fail_at:
        before_writing(fail_at, no_space_left)


def before_writing(step: int, action) -> None:
    """Run ``action`` in DCP's file writer (local or fsspec) before it writes the step-``step`` checkpoint's data."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if f"step-{step:06d}" in str(self.path):
            action()
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data


def inject_write_failures() -> None:
    """FAIL_AT=N: rank 1's background write of the step-N checkpoint fails like a full disk."""
    fail_at = int(env("FAIL_AT", "0"))
    if not fail_at or int(env("RANK")) != 1:
        return
    from concurrent.futures import Future

    import lightning_hybrid.checkpoint.sharded as sharded
    from lightning_hybrid.checkpoint.dcp import PendingWrite

    original = sharded.write_shards

    def failing(folder, *args, **kwargs):
        pending = original(folder, *args, **kwargs)
        if folder.name.startswith(f"step-{fail_at:06d}"):
            pending.result()
            broken: Future = Future()
            broken.set_exception(OSError(28, "No space left on device"))
            return PendingWrite(broken)
        return pending

    sharded.write_shards = failing


def slow_down_background_writer() -> None:
    """SLOW_WRITER_RANK=R: rank R's background DCP write sleeps 2 s before planning (before its first collective),
    so the other ranks' writers are already waiting in a collective while every main thread trains on and meets
    at the next step boundary. Shared by the two threads, one process group would match their collectives
    across ranks in different orders and hang."""
    if env("SLOW_WRITER_RANK") == "" or int(env("RANK")) != int(env("SLOW_WRITER_RANK")):
        return
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.prepare_local_plan

    def slow(self, plan):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(2.0)
        return original(self, plan)

    FileSystemWriter.prepare_local_plan = slow


def slow_down_staging() -> None:
    """SLOW_STAGING=S: the background copy of each async save's state to host memory starts S seconds late, after the
    next step's forward and backward (on a GPU the copy from device memory can end that late; on CPU it always ends
    first). Unless the optimizer step waits for it (FaultTolerantCheckpoint.on_before_optimizer_step), the copy then
    reads the next step's weights and the checkpoint is not of its own step."""
    seconds = float(env("SLOW_STAGING", "0"))
    if not seconds:
        return
    from concurrent.futures import Future, ThreadPoolExecutor

    import lightning_hybrid.checkpoint.staging as staging

    original, late = staging._stager, ThreadPoolExecutor(1, thread_name_prefix="late-stager")

    class LateStager:
        """DCP's stager, started ``seconds`` late in a thread of its own (its ``stage`` returns a Future, as an
        asynchronous stager's does)."""

        should_synchronize_after_execute = False

        def __init__(self, inner) -> None:
            self.inner = inner

        def stage(self, state_dict):
            def copy():
                time.sleep(seconds)
                staged = self.inner.stage(state_dict)
                return staged.result() if isinstance(staged, Future) else staged

            return late.submit(copy)

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            self.inner.close()

    staging._stager = lambda options: LateStager(original(options))


def slow_down_daemon_write() -> None:
    """SLOW_DAEMON_WRITE_AT=N: in a process writer daemon (which imports this script as ``__mp_main__``), the write of
    the step-N checkpoint sleeps 60 s before it starts: a daemon busy with a long upload when its training process
    dies."""
    step = int(env("SLOW_DAEMON_WRITE_AT", "0"))
    if step:
        before_writing(step, lambda: time.sleep(60))


def main() -> None:
    slow_down_staging()
    inject_write_failures()
    inject_dcp_like_failures()
    slow_down_background_writer()
    out, ckpt = Path(env("OUT")), env("CKPT")  # a folder or an fsspec URL (s3://...)
    tp, pp = int(env("TP", "2")), int(env("PP", "2"))
    world = int(env("WORLD_SIZE"))
    dp = world // (tp * pp)
    L.seed_everything(SEED)
    checkpoint = FaultTolerantCheckpoint(ckpt, every_n_steps=int(env("EVERY", "2")),
                                         async_save=env("ASYNC", "1") == "1",
                                         keep_last=int(env("KEEP", "3")), async_writer=env("ASYNC_WRITER", "thread"))
    kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": int(env("STEPS", "8")), "val_check_interval": None,
              "limit_val_batches": 0}
    from datetime import timedelta

    timeout = timedelta(seconds=int(env("COLLECTIVE_TIMEOUT", "1800")))
    trainer = L.Trainer(strategy=HybridParallelStrategy(tp=tp, pp=pp, timeout=timeout), devices=world,
                        callbacks=[SettleSaves(checkpoint, lambda step: step == int(env("KILL_AT", "0"))), checkpoint,
                                   Faults(out)], **kwargs)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    train, _ = make_dataset(GLOBAL_BATCH // dp)
    trainer.fit(module, train_dataloaders=train)
    weights = full_weights(module.model)
    if trainer.global_rank == 0:
        torch.save({"final": weights, "resumed_from": str(checkpoint.resumed_from),
                    "blocking": checkpoint.blocking_seconds}, out / "final.pt")
    dist.barrier()


if __name__ == "__mp_main__":  # a process writer daemon, spawned by a training process of this script
    slow_down_daemon_write()
if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
