"""Training under TrainingHealth for tests/test_training_health.py (launched with torchrun on 4 processes).

argv: a JSON file with a list of configurations, and the output folder. Each configuration (``name``, ``tp``,
``pp``, ``data_parallel``, ``steps``, ``poison_step``, ``mode``) is one fit, in order, on the same processes.
``mode="guard"``: the embedding output of step ``poison_step`` becomes NaN (a poisoned batch) and TrainingHealth
skips that step. ``mode="reference"``: clean data, and at ``poison_step`` a plain callback drops every gradient
(``p.grad = None``) before the optimizer step, so torch's AdamW leaves those parameters and their state alone: the
run whose optimizer never applied that step, built without TrainingHealth or the strategy's skip.
``mode="consistency"``: rank ``bump_rank`` moves one weight (named like ``bump_name``) by one ulp after step 2,
and TrainingHealth checks the replicas every 2 steps.
Rank 0 writes ``<name>.pt``: losses, final weights, the weights after the steps around ``poison_step``, the
AdamW step counts, the callback's events and counters, and the callback's hook time per step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.equivalence import GLOBAL_BATCH, SEED, LossRecorder, make_dataset, make_trainer_kwargs, tiny_config
from helpers.gather import full_weights, gather_objects
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.callbacks import TrainingHealth
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
    else:
        callbacks.append(DropGradients(step))
    kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": config["steps"], "val_check_interval": None,
              "limit_val_batches": 0}
    strategy = HybridParallelStrategy(tp=tp, pp=pp, data_parallel=config.get("data_parallel", "fsdp"))
    trainer = L.Trainer(strategy=strategy, devices=world, callbacks=callbacks, **kwargs)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    train, _ = make_dataset(GLOBAL_BATCH // dp)
    trainer.fit(module, train_dataloaders=train)
    final = full_weights(module.model)
    record = {"losses": losses.losses, "final": final, "around": around.weights, "adam_steps": around.adam_steps,
              "guard_skipped": strategy.step_guard.skipped}
    if health is not None:
        record.update(events=health.events, skipped_steps=health.skipped_steps, summary=health.summary,
                      metrics=health.last_metrics, hook_seconds=seconds)
    if trainer.global_rank == 0:
        torch.save(record, out / f"{config['name']}.pt")
    dist.barrier()


def main() -> None:
    configs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    for config in configs:
        run(config, out)


if __name__ == "__main__":
    main()
