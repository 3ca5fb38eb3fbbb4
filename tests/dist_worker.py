"""Runs several training configurations inside one launched process group and saves what they did.

Launched by ``tests/launch.py:run_workers`` with torchrun. For each configuration: a fresh seed, a
Trainer with ``HybridParallelStrategy``, a few optimizer steps on fixed random tokens; rank 0 saves the
per-step global losses, the validation loss, and the full (gathered) initial and final weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import lightning as L
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.models import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from equivalence_setup import GLOBAL_BATCH, SEED, LossRecorder, make_dataset, make_trainer_kwargs, tiny_config  # noqa: E402


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, gathered from TP/FSDP shards and pipeline stages, on every rank."""
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.initialization import canonical_name

    local = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        local[canonical_name(name)] = value.detach().cpu().clone()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


class WeightRecorder(L.Callback):
    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = full_weights(pl_module.model)


def evaluate_after_fit(trainer: L.Trainer, module: L.LightningModule, val) -> dict:
    """trainer.test and trainer.predict on the fitted model; predictions gathered from the rank that has them."""
    test_loss = float(trainer.test(module, dataloaders=val, verbose=False)[0]["test_loss"])
    inputs = torch.utils.data.DataLoader([x for x, _ in val.dataset], batch_size=val.batch_size)
    predictions = trainer.predict(module, dataloaders=inputs)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, predictions[0] if predictions and predictions[0] is not None else None)
    return {"test_loss": test_loss, "logits": next(p for p in gathered if p is not None)}


def run(config: dict, out: Path) -> None:
    kind = config.pop("module", "causal_lm")
    name = config.pop("name")
    trainer_extra = config.pop("trainer", {})
    evaluate = config.pop("evaluate", False)
    L.seed_everything(SEED)
    strategy = HybridParallelStrategy(**config)
    if kind == "model_parallel_user":
        from user_module import UserTPModule

        module = UserTPModule()
    else:
        module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    losses, weights = LossRecorder(), WeightRecorder()
    trainer = L.Trainer(strategy=strategy, devices=int(os.environ["WORLD_SIZE"]),
                        callbacks=[losses, weights], **{**make_trainer_kwargs()["trainer"], **trainer_extra})
    world = int(os.environ["WORLD_SIZE"])
    dp = config.get("dp") or world // (config.get("tp", 1) * config.get("pp", 1))
    train, val = make_dataset(GLOBAL_BATCH // dp)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    final = full_weights(module.model)
    record = {"losses": losses.losses, "val_loss": float(trainer.callback_metrics["val_loss"])
              if "val_loss" in trainer.callback_metrics else None, "initial": weights.initial, "final": final}
    if evaluate:
        record.update(evaluate_after_fit(trainer, module, val))
    if trainer.global_rank == 0:
        torch.save(record, out / f"{name}.pt")
    dist.barrier()


def main() -> None:
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for config in configs:
        run(dict(config), out)


if __name__ == "__main__":
    main()
