# ruff: noqa: E402
"""Training under torchrun --max-restarts for the in-job recovery tests (tests/test_elastic_recovery.py).

Environment: OUT (results), CKPT (checkpoint folder), STEPS, EVERY (save interval, async saves), TP, PP,
HANG_TIMEOUT (seconds, or "none"), FAULTS ("attempt:step:rank:kill|stop|node,...": on that torchrun attempt
(the launch's restart round: launch_round), right after that step's checkpoint hook (a save step: its async write is
in flight), that rank sends itself SIGKILL or SIGSTOP, or ends its whole node: agent and workers; rank ``nodeB``:
local rank 0 of the node started with NODE_TAG=B), SLOW_FIRST_STEP (seconds rank 1 sleeps inside its first training
step), VAL_BATCHES and VAL_SLEEP (a validation of that many batches, each VAL_SLEEP s, after step VAL_AT).
Rank 0 appends every step's loss to OUT/losses.jsonl and saves the final full weights to OUT/final.pt.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: when torchrun started this process

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.equivalence import GLOBAL_BATCH, SEED, make_dataset, make_trainer_kwargs, tiny_config
from helpers.gather import full_weights
from helpers.settle import SettleSaves
from helpers.worker_exit import end_worker
from lightning_hybrid import FaultTolerantCheckpoint, HybridParallelStrategy
from lightning_hybrid.models import CausalLM


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


ATTEMPT = int(env("TORCHELASTIC_RESTART_COUNT", "0"))  # replaced by the launch-wide round in Faults.setup


def launch_round(out: Path) -> int:
    """This launch's restart round, the same on every node: the rounds rank 0 began before (``round_N`` files).

    torchrun's restart count cannot name it with several agents: an agent whose workers were healthy when another
    agent began a new round restarts them for the membership change without counting a restart.
    """
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        box[0] = len(list(out.glob("round_*")))
        (out / f"round_{box[0]}").write_text(str(time.time()))
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


class Faults(L.Callback):
    """Logs each step's loss (rank 0) and injects this attempt's faults."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.faults = [tuple(f.split(":")) for f in env("FAULTS").split(",") if f]

    def injects_at(self, step: int) -> bool:
        """This attempt injects a fault right after ``step``."""
        return any(int(attempt) == ATTEMPT and int(at) == step for attempt, at, _, _ in self.faults)

    def _mark(self, trainer, what: str) -> None:
        (self.out / f"{what}_{ATTEMPT}_rank{trainer.global_rank}").write_text(str(time.time()))

    def setup(self, trainer, pl_module, stage) -> None:
        global ATTEMPT
        ATTEMPT = launch_round(self.out)
        self._mark(trainer, "setup")  # the process group is up

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark(trainer, "loaded")  # model built, checkpoint (if any) loaded

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        slow = float(env("SLOW_FIRST_STEP", "0"))
        if slow and trainer.global_step == 0 and trainer.global_rank == 1 and ATTEMPT == 0:
            time.sleep(slow)  # a first step slower than hang_timeout (compilation, a cold cache)
            (self.out / "slow_first_step").write_text(str(slow))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0:
            with open(self.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(trainer.callback_metrics["train_loss"]),
                                    "attempt": ATTEMPT, "world": trainer.world_size, "time": time.time(),
                                    "pid": os.getpid()}) + "\n")
        for attempt, at, rank, kind in self.faults:
            if int(attempt) == ATTEMPT and int(at) == step and _is(rank, trainer.global_rank):
                (self.out / f"fault_{attempt}_{kind}_rank{rank}").write_text(f"{time.time()} {os.getpid()}")
                if kind == "node":  # this rank's whole "node" is lost for good: its torchrun agent and workers
                    lose_node()
                os.kill(os.getpid(), signal.SIGKILL if kind in ("kill", "node") else signal.SIGSTOP)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        time.sleep(float(env("VAL_SLEEP", "0")))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(self.out / "validations.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "end": time.time()}) + "\n")

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(self.out / "validations.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "start": time.time()}) + "\n")


def _is(who: str, rank: int) -> bool:
    """``who`` is a global rank, or ``node<TAG>``: local rank 0 of the node started with NODE_TAG=TAG."""
    if who.startswith("node"):
        return env("NODE_TAG") == who[4:] and env("LOCAL_RANK") == "0"
    return int(who) == rank


def lose_node() -> None:
    from lightning_hybrid.launch.torchrun import worker_pids

    agent = os.getppid()
    workers = [pid for pid in worker_pids(agent).values() if pid != os.getpid()]
    os.kill(agent, signal.SIGKILL)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)


def main() -> None:
    out, ckpt = Path(env("OUT")), Path(env("CKPT"))
    (out / f"start_{ATTEMPT}_rank{env('RANK')}").write_text(str(STARTED))
    tp, pp = int(env("TP", "2")), int(env("PP", "2"))
    world, local = int(env("WORLD_SIZE")), int(env("LOCAL_WORLD_SIZE"))
    dp = world // (tp * pp)
    L.seed_everything(SEED)
    checkpoint = FaultTolerantCheckpoint(ckpt, every_n_steps=int(env("EVERY", "2")), async_save=True, keep_last=3)
    val_batches = int(env("VAL_BATCHES", "0"))
    kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": int(env("STEPS", "8")),
              "val_check_interval": int(env("VAL_AT", "2")) if val_batches else None,
              "limit_val_batches": val_batches, "check_val_every_n_epoch": None if val_batches else 1}
    hang = None if env("HANG_TIMEOUT", "none") == "none" else float(env("HANG_TIMEOUT"))
    strategy = HybridParallelStrategy(tp=tp, pp=pp, hang_timeout=hang, timeout=timedelta(seconds=300))
    faults = Faults(out)
    trainer = L.Trainer(strategy=strategy, devices=local, num_nodes=world // local,
                        callbacks=[SettleSaves(checkpoint, faults.injects_at), checkpoint, faults], **kwargs)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    train, val = make_dataset(GLOBAL_BATCH // dp)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val if val_batches else None)
    weights = full_weights(module.model)
    if trainer.global_rank == 0:
        torch.save({"final": weights, "resumed_from": str(checkpoint.resumed_from), "attempt": ATTEMPT},
                   out / "final.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
