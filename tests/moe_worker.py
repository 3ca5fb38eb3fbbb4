"""Runs several mixture-of-experts training configurations inside one launched process group and saves their records.

Launched by ``tests/test_moe_equivalence.py`` (:func:`helpers.launch.launch`). Per configuration: a fresh seed, a
Trainer with ``HybridParallelStrategy(**config)`` training tiny Qwen3-MoE (:mod:`helpers.moe_problem`) for a few
steps; rank 0 saves the per-step losses, load-balancing losses and load balance, the dropped pairs, the all-to-all
bytes, and the full (gathered) initial and final weights. Keys besides the strategy's arguments: ``accumulate``
(Lightning's gradient accumulation), ``trainer`` (more Trainer arguments), ``model`` (fields of the model's config),
``force`` (a routing bias that sends every token to expert 0), ``save_at`` (save at that step and stop; ``resume``:
go on from it in the same configuration) and ``load_from`` (start from an earlier configuration's checkpoint).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from dist_worker import SaveAt  # save at a step's end and stop there

from helpers.gather import full_weights, gather_merged
from helpers.moe_problem import GLOBAL_BATCH, MODULE, SEED, Recorder, loaders, moe_config, trainer_kwargs
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.distributed.expert_parallel import all_to_all_bytes
from lightning_hybrid.models import CausalLM


class ForceExpertZero(L.Callback):
    """Every token's top-k includes expert 0 of every sparse layer: a routing bias of 10 (the probabilities are <= 1),
    which a rate of 1e-12 per step leaves in place."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias[0] = 10.0


class Initial(L.Callback):
    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = full_weights(pl_module.model)


def fit(config: dict, accumulate: int, force: bool, callbacks: list, ckpt_path=None, model=None):
    world = int(os.environ["WORLD_SIZE"])
    overrides = {"router_bias_update_rate": 1e-12} if force else dict(model or {})
    module = CausalLM(moe_config(**overrides), **MODULE)
    extra = config.pop("trainer", {})
    trainer = L.Trainer(strategy=HybridParallelStrategy(**config), devices=world,
                        callbacks=callbacks + ([ForceExpertZero()] if force and ckpt_path is None else []),
                        **trainer_kwargs(accumulate_grad_batches=accumulate, **extra))
    dp = world // (config.get("tp", 1) * config.get("pp", 1) * config.get("cp", 1))
    train, val = loaders(GLOBAL_BATCH // dp // accumulate)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    return trainer, module


def routing_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The routing biases of auxiliary-loss-free balancing by layer name (every rank holds the same, whole)."""
    return gather_merged({name: buffer.detach().clone() for name, buffer in model.named_buffers()
                          if name.endswith("e_score_correction_bias")})


def run(config: dict, out: Path) -> None:
    name, accumulate, force = config.pop("name"), config.pop("accumulate", 1), config.pop("force", False)
    model = config.pop("model", None)
    save_at, resume, load_from = config.pop("save_at", None), config.pop("resume", False), config.pop("load_from", None)
    L.seed_everything(SEED)
    recorder, initial = Recorder(), Initial()
    callbacks = [recorder, initial] + ([SaveAt(save_at, out / f"ckpt_{name}")] if save_at else [])
    trainer, module = fit(dict(config), accumulate, force, callbacks, out / f"ckpt_{load_from}" if load_from else None,
                          model)
    saved = {"weights": full_weights(module.model), "biases": routing_biases(module.model)} if save_at else None
    if save_at and resume:
        L.seed_everything(SEED + 1)  # the resumed run must not depend on the seed it starts with
        trainer, module = fit(dict(config), accumulate, force, [recorder], out / f"ckpt_{name}", model)
    record = {"losses": recorder.losses, "aux": recorder.aux, "load": recorder.load, "initial": initial.weights,
              "final": full_weights(module.model), "saved": saved,
              "dropped": float(trainer.callback_metrics["moe/dropped_tokens"]),
              "all_to_all_bytes": all_to_all_bytes(module.model), "biases": routing_biases(module.model)}
    if trainer.global_rank == 0:
        torch.save(record, out / f"{name}.pt")
    dist.barrier()


def main() -> None:
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for config in configs:
        run(dict(config), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
