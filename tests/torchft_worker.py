"""One replica group of a torchft job (``fault_tolerance="torchft"``), launched with torchrun by the torchft tests.

Environment: OUT (results folder), STEPS, TP, PP, DP_SHARD (data_parallel="hsdp" reference: 4 processes, no torchft),
REFERENCE (1: train as one launch without torchft), KILL_AT (group KILL_GROUP's rank 0 SIGKILLs every process of
its group after that step, first attempt only), STEP_SLEEP (seconds each step of group 0 waits after its end, so a
killed group can come back while the other still trains), plus torchft's REPLICA_GROUP_ID, NUM_REPLICA_GROUPS and
TORCHFT_LIGHTHOUSE. Each rank writes ``<OUT>/<group>_<rank>.pt``: per step its pid, loss and the manager's history,
and at the end its local weight shards (compared bitwise across groups) and the group's full weights.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.equivalence import GLOBAL_BATCH, SEED, make_dataset, make_trainer_kwargs, tiny_config
from helpers.gather import full_weights, gather_objects
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.models import CausalLM


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


class Record(L.Callback):
    """Per step: the pid, the logged global loss, and (torchft) the quorum's size and whether the step committed."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.group = env("REPLICA_GROUP_ID", "ref")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        groups = trainer.strategy.replica_groups
        last = groups.history[-1] if groups is not None and groups.history else {}
        self.steps.append({"step": trainer.global_step, "pid": os.getpid(), "time": time.time(),
                           "loss": float(trainer.callback_metrics["train_loss"]),
                           "restart": int(env("TORCHELASTIC_RESTART_COUNT", "0")), **last})
        kill_at = int(env("KILL_AT", "0"))
        if (kill_at and trainer.global_step == kill_at and self.group == env("KILL_GROUP", "1")
                and env("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            pids = gather_objects(os.getpid())
            if trainer.global_rank == 0:  # the whole group dies at once, as when its node is lost
                for pid in pids[1:]:
                    os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        if self.group == "0" and float(env("STEP_SLEEP", "0")):
            time.sleep(float(env("STEP_SLEEP")))


def main() -> None:
    out = Path(env("OUT"))
    steps, tp, pp = int(env("STEPS", "8")), int(env("TP", "1")), int(env("PP", "1"))
    world = int(env("WORLD_SIZE"))
    L.seed_everything(SEED)
    reference = env("REFERENCE") == "1"
    if reference:
        strategy = HybridParallelStrategy(tp=tp, pp=pp, data_parallel="hsdp", dp_shard=int(env("DP_SHARD", "1")))
        data_ranks = world // (tp * pp)
    else:
        strategy = HybridParallelStrategy(tp=tp, pp=pp, fault_tolerance="torchft",
                                          min_replica_groups=int(env("MIN_GROUPS", "1")))
        data_ranks = world // (tp * pp) * int(env("NUM_REPLICA_GROUPS"))
    kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": steps, "val_check_interval": None,
              "limit_val_batches": 0}
    record = Record()
    trainer = L.Trainer(strategy=strategy, devices=world, callbacks=[record], **kwargs)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    train, _ = make_dataset(GLOBAL_BATCH // data_ranks)
    trainer.fit(module, train_dataloaders=train)
    local = {name: (p._local_tensor if hasattr(p, "_local_tensor") else p).detach().clone()
             for name, p in module.model.named_parameters()}
    result = {"steps": record.steps, "local": local, "full": full_weights(module.model),
              "history": trainer.strategy.replica_group_history,
              "pid": os.getpid()}
    torch.save(result, out / f"{record.group}_{trainer.global_rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
    end_worker()
