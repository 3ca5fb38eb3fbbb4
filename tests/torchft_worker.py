"""One replica group of a torchft job (``fault_tolerance="torchft"``), launched by the torchft tests (torchrun, or
forked ranks where no group restarts: ``helpers.torchft_groups.run_groups``).

Environment: OUT (results folder), STEPS, TP, PP, DP_SHARD (data_parallel="hsdp" reference: 4 processes, no torchft),
REFERENCE (1: train as one launch without torchft), KILL_AT (group KILL_GROUP's rank 0 SIGKILLs every process of
its group in the middle of the first step from there on that both groups are in, first attempt only; while
degraded, group 0 then waits until the restarted group sets up its Trainer and pauses STEP_SLEEP seconds per step,
so that it rejoins while the other still trains), LATE_AFTER (group 1 starts only once group 0 finished that many
steps alone; group 0 waits the same way until group 1 is in its quorum), plus torchft's REPLICA_GROUP_ID,
NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE. Each rank writes ``<OUT>/<group>_<rank>.pt``: per step its pid, loss
and the manager's history, and at the end its local weight shards (compared bitwise across groups) and the group's
full weights.
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

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.inputs = batch[0].detach().cpu().clone()  # the samples this group's rank trains on in this step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        groups = trainer.strategy.replica_groups
        last = groups.history[-1] if groups is not None and groups.history else {}
        weights = sum(float((p._local_tensor if hasattr(p, "_local_tensor") else p).double().sum())
                      for p in pl_module.model.parameters())
        optimizer = trainer.optimizers[0]
        adam_steps = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
        self.steps.append({"step": trainer.global_step, "pid": os.getpid(), "time": time.time(), "weights": weights,
                           "lr": optimizer.param_groups[0]["lr"], "adam_steps": adam_steps, "inputs": self.inputs,
                           "loss": float(trainer.callback_metrics["train_loss"]),
                           "restart": int(env("TORCHELASTIC_RESTART_COUNT", "0")), **last})
        if self.group == "0" and trainer.global_rank == 0 and env("LATE_AFTER"):
            Path(env("OUT"), f"step_{trainer.global_step}").write_text("")  # the late group starts at its step
        degraded = self.group == "0" and last.get("participants", 2) < 2
        late = env("LATE_AFTER") and trainer.global_step >= int(env("LATE_AFTER"))
        killed = env("KILL_AT") and Path(env("OUT"), "killed_at").exists()  # not before: a late start joins by itself
        if degraded and (late or killed):
            # Give group 1 time to come back before this one ends (a restart takes 15-60 s here): wait until its
            # Trainer is being set up (it joins the quorum at the end of the strategy's setup), then pause per step
            # until it is back in the quorum.
            marker = Path(env("OUT"), f"setup_1_{1 if killed else 0}")
            deadline = time.monotonic() + 240
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(float(env("STEP_SLEEP", "1")))

    def setup(self, trainer, pl_module, stage) -> None:
        if self.group == "1" and trainer.global_rank == 0:  # group 0 waits for this (KILL_AT, LATE_AFTER)
            Path(env("OUT"), f"setup_1_{env('TORCHELASTIC_RESTART_COUNT', '0')}").write_text("")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # Killed in the middle of a step, after the quorum with both groups formed and the loss's token count was
        # averaged across them: the survivors' gradient all-reduce meets a dead peer and torchft discards the step.
        kill_at, groups = int(env("KILL_AT", "0")), trainer.strategy.replica_groups
        if (kill_at and trainer.global_step + 1 >= kill_at and self.group == env("KILL_GROUP", "1")
                and env("TORCHELASTIC_RESTART_COUNT", "0") == "0" and groups.participants() == 2):
            pids = gather_objects(os.getpid())
            if trainer.global_rank == 0:  # the whole group dies at once, as when its node is lost
                Path(env("OUT"), "killed_at").write_text(str(time.time()))
                for pid in pids[1:]:
                    os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)


def _meet_before_the_first_quorum(out: Path, ranks: int) -> None:
    """A first start: every rank of every group waits, its torchft Manager already heartbeating to the lighthouse,
    until all have one, then asks for the first quorum. The lighthouse then waits (join timeout) for the other group
    and both groups are in the first quorum. Without this wait, on a loaded machine one group's setup lagged the
    other's by more than the join timeout: the lighthouse, not yet hearing the late group, gave the first group a
    quorum alone (min_replicas=1), which trained on alone past KILL_AT (reproduced under load: the survivor's first
    step was 8, test_a_killed_pipeline_replica_group_heals_and_rejoins). Waiting before the Trainer was built, as
    this did before, left the Managers' creation out of the wait."""
    from lightning_hybrid.distributed.fault_tolerance import ReplicaGroups

    start_step = ReplicaGroups.start_step

    def start_after_the_meeting(self) -> None:
        if not self.in_step and not getattr(self, "_met", False):
            self._met = True
            Path(out, f"ready_{env('REPLICA_GROUP_ID')}_{env('RANK')}").write_text("")
            deadline = time.monotonic() + 300  # bounded: a rank that never comes fails the test by its timeout
            while len(list(out.glob("ready_*"))) < ranks and time.monotonic() < deadline:
                time.sleep(0.05)
        start_step(self)

    ReplicaGroups.start_step = start_after_the_meeting


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
    if env("TORCHELASTIC_RESTART_COUNT", "0") != "0" and env("RANK") == "0":
        Path(out, "restarted").write_text(str(time.time()))
    elif env("LATE_AFTER"):  # group 1 starts once group 0 finished that many steps alone
        while env("REPLICA_GROUP_ID") == "1" and not Path(out, f"step_{env('LATE_AFTER')}").exists():
            time.sleep(0.1)
    elif not reference:
        _meet_before_the_first_quorum(out, world * int(env("NUM_REPLICA_GROUPS")))
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
