"""A LightningModule written for Lightning's ModelParallelStrategy: it parallelizes itself in configure_model."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class TinyMLPLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.head = nn.Linear(32, 256)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h = self.embed(inputs)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


class UserTPModule(L.LightningModule):
    """TP over ``device_mesh["tensor_parallel"]``, FSDP2 over ``device_mesh["data_parallel"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyMLPLM()

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if mesh["tensor_parallel"].size() > 1:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(self.model, mesh["tensor_parallel"], plan)
        if mesh["data_parallel"].size() > 1:
            fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)
