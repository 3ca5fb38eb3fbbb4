"""Trains the tiny model on packed chat rows (document masking) under several meshes in one process group.

Launched by ``tests/test_sft_equivalence.py`` with torchrun; for each configuration rank 0 saves the per-step global
losses and the gathered initial and final weights, compared there with one process (``helpers.compare``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.equivalence import SEED, LossRecorder, make_trainer_kwargs, tiny_config
from helpers.gather import full_weights
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.data import PackedTokenDataModule
from lightning_hybrid.models import CausalLM

VOCAB = 264  # the tiny chat tokenizer's 259 ids, rounded up to split over tp=2
GLOBAL_BATCH = 4


class Initial(L.Callback):
    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = full_weights(pl_module.model)


def run(config: dict, data: str, out: Path) -> None:
    name = config.pop("name")
    document_mask = config.pop("document_mask", True)
    L.seed_everything(SEED)
    kwargs = make_trainer_kwargs()
    module = CausalLM(tiny_config(vocab_size=VOCAB), **kwargs["module"])
    losses, initial = LossRecorder(), Initial()
    trainer = L.Trainer(strategy=HybridParallelStrategy(**config), devices=int(os.environ["WORLD_SIZE"]),
                        callbacks=[losses, initial], **{**kwargs["trainer"], "limit_val_batches": 0})
    datamodule = PackedTokenDataModule(data, global_batch_size=GLOBAL_BATCH, val_fraction=0.0,
                                       document_mask=document_mask)
    trainer.fit(module, datamodule=datamodule)
    record = {"losses": losses.losses, "initial": initial.weights, "final": full_weights(module.model)}
    if trainer.global_rank == 0:
        torch.save(record, out / f"{name}.pt")
    dist.barrier()


if __name__ == "__main__":
    spec, out = Path(sys.argv[1]), Path(sys.argv[2])
    setup = json.loads(spec.read_text())
    for config in setup["configs"]:
        run(dict(config), setup["data"], out)
    end_worker()
