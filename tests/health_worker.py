"""Training under TrainingHealth for tests/test_training_health.py (launched with torchrun on 4 processes).

argv: a JSON file with a list of configurations, and the output folder. Each configuration (``name``, ``tp``,
``pp``, ``data_parallel``, ``steps``, ``poison_step``, ``mode``) is one fit, in order, on the same processes.
``mode="guard"``: the embedding output of step ``poison_step`` becomes NaN (a poisoned batch) and TrainingHealth
skips that step. ``mode="reference"``: clean data, and at ``poison_step`` a plain callback drops every gradient
(``p.grad = None``) before the optimizer step, so torch's AdamW leaves those parameters and their state alone: the
run whose optimizer never applied that step, built without TrainingHealth or the strategy's skip.
``mode="consistency"``: rank ``bump_rank`` moves one weight (named like ``bump_name``) by one ulp after step 2,
and TrainingHealth checks the replicas every 2 steps.
``mode="rollback"``: FaultTolerantCheckpoint every 2 steps; the logits of the batches holding global batch
``poison_step`` are scaled by 100 (a spike in the data), TrainingHealth rolls back in process to step 2 and skips
the batches since. ``mode="window-reference"``: no callback; the data never holds global batches ``window`` (an
explicit order without them, the run's permutation).
``mode="hardware"``: rank ``fault_rank`` computes NaN in the first execution of step ``poison_step`` only, under
``TrainingHealth(recheck=True)``.
``mode="rollback-kill"``: as ``rollback``, but rank ``kill_rank`` SIGKILLs itself at the start of step ``kill_step``
when ``$HEALTH_RESUMED`` is not set (the launch then fails); launched again with ``HEALTH_RESUMED=1``, the workers
resume from the checkpoint (the records of finished configurations are kept, those configurations are not run
again).
Rank 0 writes ``<name>.pt``: losses, final weights, the weights after the steps around ``poison_step``, the
AdamW step counts, the callback's events and counters, and the callback's hook time per step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.equivalence import GLOBAL_BATCH, SEED, LossRecorder, make_dataset, make_trainer_kwargs, tiny_config
from helpers.gather import full_weights, gather_objects
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.callbacks import FaultTolerantCheckpoint, TrainingHealth, TrainingUnhealthy
from lightning_hybrid.models import CausalLM


class Poison(L.Callback):
    """NaN out the embedding output during step ``step`` (every micro-batch of it)."""

    def __init__(self, step: int) -> None:
        self.step, self.active = step, False

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.model.named_modules():
            if name.endswith("embed_tokens"):
                module.register_forward_hook(lambda _m, _i, out: out * float("nan") if self.active else out)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.active = trainer.global_step == self.step


class DropGradients(L.Callback):
    """The reference: at step ``step`` no parameter has a gradient when the optimizer runs."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None


class Around(L.Callback):
    """Full weights and this rank's AdamW step counts after the optimizer steps ``step - 1`` and ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.weights, self.adam_steps = step, {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        done = trainer.global_step - 1  # the optimizer step just taken
        if done in (self.step - 1, self.step):
            self.weights[done] = full_weights(pl_module.model)
            optimizer = trainer.optimizers[0]
            self.adam_steps[done] = gather_objects(sorted(float(s["step"]) for s in optimizer.state.values()))


class Bump(L.Callback):
    """After optimizer step ``step`` (global_step == step), rank ``rank`` moves one weight by one ulp: the first
    element of its piece of the first parameter whose name contains ``name``."""

    def __init__(self, step: int, rank: int, name: str) -> None:
        self.step, self.rank, self.name = step, rank, name

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        from torch.distributed.tensor import DTensor

        param = next(p for n, p in pl_module.model.named_parameters() if self.name in n)
        local = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            flat = local.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))


class Spike(L.Callback):
    """Scale the logits by 100 (a loss spike) on the batches that hold samples of global batch ``batch`` of epoch 0:
    bad data, read once by an uninterrupted run and never by a run that leaves that batch out."""

    def __init__(self, batch: int) -> None:
        train, _ = make_dataset(GLOBAL_BATCH)
        order = torch.randperm(len(train.dataset), generator=torch.Generator().manual_seed(SEED)).tolist()
        self.bad = train.dataset.tensors[0][order[batch * GLOBAL_BATCH:(batch + 1) * GLOBAL_BATCH]]
        self.active = False

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.model.named_modules():
            if name.endswith("lm_head"):
                module.register_forward_hook(lambda _m, _i, out: out * 100.0 if self.active else out)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.active = any(torch.equal(row, bad) for row in batch[0] for bad in self.bad)


class Fault(L.Callback):
    """A transient fault on rank ``rank``: its embedding output is NaN in the first forward of step ``step`` only
    (the re-run of that step computes right)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank, self.armed, self.fired = step, rank, False, False

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        for name, module in pl_module.model.named_modules():
            if name.endswith("embed_tokens"):
                module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, out):
        if not self.armed:
            return out
        self.armed, self.fired = False, True
        return out * float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.armed = trainer.global_step == self.step and not self.fired


class Kill(L.Callback):
    """SIGKILL this process at the start of step ``step`` after a rollback, on rank ``rank``, first attempt only."""

    def __init__(self, step: int, rank: int, health: TrainingHealth) -> None:
        self.step, self.rank, self.health = step, rank, health

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first = not os.environ.get("HEALTH_RESUMED")
        if first and self.health.rollbacks and trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def without_window(per_rank: int, dp: int, rank: int, tp: int, window: list[int]):
    """The training loader of a run whose data never held global batches ``window``: the permutation the
    distributed sampler gives epoch 0 (seed SEED), those batches taken out, dealt to the dp ranks in order."""
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    train, _ = make_dataset(per_rank)
    order = torch.randperm(len(train.dataset), generator=torch.Generator().manual_seed(SEED)).tolist()
    size = per_rank * dp
    kept = [i for k in range(len(order) // size) if k not in window for i in order[k * size:(k + 1) * size]]
    subset = Subset(train.dataset, kept)
    sampler = DistributedSampler(subset, num_replicas=dp, rank=(rank // tp) % dp, shuffle=False)
    return DataLoader(subset, batch_size=per_rank, sampler=sampler)


def timed(health: TrainingHealth) -> list[float]:
    seconds: list[float] = []
    hook = health.on_before_optimizer_step

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        hook(*args, **kwargs)
        seconds.append(time.perf_counter() - start)

    health.on_before_optimizer_step = wrapper
    return seconds


def run(config: dict, out: Path) -> None:
    L.seed_everything(SEED)
    tp, pp, step = config["tp"], config["pp"], config["poison_step"]
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (tp * pp)
    losses, around = LossRecorder(), Around(step)
    callbacks = [losses, around]
    health = None
    if config["mode"] == "guard":
        health = TrainingHealth(**config.get("health", {}))
        seconds = timed(health)
        callbacks += [Poison(step), health]
    elif config["mode"] == "consistency":
        health = TrainingHealth(consistency_every_n_steps=2)
        seconds = timed(health)
        callbacks += [Bump(2, config["bump_rank"], config["bump_name"]), health]
    elif config["mode"] in ("rollback", "rollback-kill"):
        health = TrainingHealth(window=2, spike_factor=3.0, **config.get("health", {}))
        seconds = timed(health)
        folder = out / f"{config['name']}-ckpt"
        callbacks += [Spike(step), FaultTolerantCheckpoint(folder, every_n_steps=2, async_save=False,
                                                           save_on_signal=False), health]
        if config["mode"] == "rollback-kill":
            callbacks.append(Kill(config["kill_step"], config["kill_rank"], health))
    elif config["mode"] == "hardware":
        health = TrainingHealth(recheck=True)
        seconds = timed(health)
        callbacks += [Fault(step, config["fault_rank"]), health]
    elif config["mode"] == "reference":
        callbacks.append(DropGradients(step))
    kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": config["steps"], "val_check_interval": None,
              "limit_val_batches": 0}
    strategy = HybridParallelStrategy(tp=tp, pp=pp, data_parallel=config.get("data_parallel", "fsdp"))
    if config["mode"] == "window-reference":
        kwargs["use_distributed_sampler"] = False
        train = without_window(GLOBAL_BATCH // dp, dp, int(os.environ["RANK"]), tp, config["window"])
    else:
        train, _ = make_dataset(GLOBAL_BATCH // dp)
    trainer = L.Trainer(strategy=strategy, devices=world, callbacks=callbacks, **kwargs)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    pid = os.getpid()
    try:
        trainer.fit(module, train_dataloaders=train)
        exit_code = None
    except TrainingUnhealthy as stopped:  # what ends the process (SystemExit) when nothing catches it
        exit_code, message = stopped.code, str(stopped)
    final = full_weights(module.model)
    record = {"losses": losses.losses, "final": final, "around": around.weights, "adam_steps": around.adam_steps,
              "guard_skipped": strategy.step_guard.skipped, "pids": gather_objects((pid, os.getpid())),
              "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "global_step": trainer.global_step}
    if config["mode"] in ("rollback", "rollback-kill"):
        from lightning_hybrid.checkpoint.manifest import committed_checkpoints, read_manifest

        record["manifests"] = {c.path.name: read_manifest(c.path).get("data_position")
                               for c in committed_checkpoints(out / f"{config['name']}-ckpt")}
        record["rollback_seconds"] = health.rollback_seconds
    if exit_code is not None:
        record.update(exit_code=exit_code, message=message)
    if health is not None:
        record.update(events=health.events, skipped_steps=health.skipped_steps, summary=health.summary,
                      metrics=health.last_metrics, hook_seconds=seconds)
    if trainer.global_rank == 0:
        torch.save(record, out / f"{config['name']}.pt")
    dist.barrier()


def main() -> None:
    configs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    for config in configs:
        if not (out / f"{config['name']}.pt").exists():  # after a restart, finished configurations stay done
            run(config, out)


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
