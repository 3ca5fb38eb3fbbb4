"""The fixed problem the mixture-of-experts equivalence tests train: tiny Qwen3-MoE, random tokens, every label kept.

Imported by ``moe_worker.py`` (the launched ranks) and by ``tests/test_moe_equivalence.py`` (the one-process
references). Every label counts, so each micro-batch has the same number of label tokens and a one-process run that
accumulates gradients over the same micro-batches has the pipeline's loss (the global token mean of the step is then
the mean of the micro-batches' means); the load-balancing loss is per micro-batch in both.

The global micro-batches of a run with ``dp`` data ranks and ``m`` micro-batches per rank (a pipeline's, or
Lightning's gradient accumulation) are, step after step, consecutive blocks of ``GLOBAL_BATCH / m`` samples of
``randperm(n, SEED)`` (Lightning's ``DistributedSampler`` hands rank ``r`` every ``dp``-th sample from ``r``), so the
reference reads that permutation in order in blocks of that size.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid.models import DecoderConfig

SEED = 1234
GLOBAL_BATCH = 8
SEQ_LEN = 16
NUM_SAMPLES = 48
STEPS = 5
MODULE = dict(lr=1e-3, weight_decay=0.1, warmup_steps=1, lr_schedule="cosine", eps=1e-6)


def moe_config(**overrides: Any) -> DecoderConfig:
    """tiny-moe (8 experts, 2 per token, layer 1 dense) with a load-balancing coefficient large enough (0.1) that
    its gradient moves the routers visibly within the steps."""
    return DecoderConfig(**{**DecoderConfig.from_preset("tiny-moe").to_dict(), "router_aux_loss_coef": 0.1,
                            **overrides})


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 256, (NUM_SAMPLES, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loaders(per_rank_batch: Optional[int] = None, microbatches: int = 1) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders: per rank (shuffled: Lightning adds its DistributedSampler) or, without
    ``per_rank_batch``, the one-process reference in blocks of ``GLOBAL_BATCH / microbatches``."""
    inputs, labels = tensors()
    train, val = TensorDataset(inputs[:40], labels[:40]), TensorDataset(inputs[40:], labels[40:])
    if per_rank_batch is None:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED)).tolist()
        return DataLoader(train, batch_size=GLOBAL_BATCH // microbatches, sampler=order), DataLoader(val, batch_size=8)
    return DataLoader(train, batch_size=per_rank_batch, shuffle=True), DataLoader(val, batch_size=per_rank_batch)


def trainer_kwargs(**extra: Any) -> dict:
    return dict(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                val_check_interval=STEPS, limit_val_batches=1, **extra)


class Recorder(L.Callback):
    """Per optimizer step: the loss (the mean of its micro-batches' logged losses under gradient accumulation), the
    load-balancing loss (the mean over the sparse layers) and the worst layer's load balance."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.aux: list[float] = []
        self.load: list[float] = []
        self._micro: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        metrics = trainer.callback_metrics
        self._micro.append(float(metrics["train_loss"]))
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.losses.append(sum(self._micro) / len(self._micro))
        self._micro = []
        self.aux.append(float(metrics["moe/aux_loss"]))
        self.load.append(float(metrics["moe/load_max_over_mean"]))
