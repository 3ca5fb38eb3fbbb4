"""The fixed problem every equivalence test trains: tiny Qwen2, random tokens with some ignored labels.

Imported by the tests and by the workers they launch (``dist_worker.py``, ``ft_worker.py``); records are compared
with :mod:`helpers.compare`.
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid.models import Qwen2Config

SEED = 1234
GLOBAL_BATCH = 8
SEQ_LEN = 16
NUM_SAMPLES = 64
STEPS = 4


def tiny_config(**overrides) -> Qwen2Config:
    values = dict(Qwen2Config.from_preset("tiny").to_dict(), name="tiny")
    values.update(overrides)
    return Qwen2Config(**values)


def make_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (NUM_SAMPLES, SEQ_LEN + 1), generator=g)
    labels = tokens[:, 1:].clone()
    # About a fifth of the labels are ignored, unevenly across samples, so the per-rank token counts
    # differ and only a global-token mean matches the single process.
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
    return tokens[:, :-1].contiguous(), labels


def make_dataset(per_rank_batch: Optional[int] = None, reference: bool = False) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders.

    Under a distributed strategy Lightning adds a ``DistributedSampler(shuffle=True, seed=SEED)``: global
    batch k is then block k of ``randperm(n, seed)``. The reference (one process, no sampler injected)
    reads that permutation in order, so both see the same global batches.
    """
    inputs, labels = make_tensors()
    train = TensorDataset(inputs[:48], labels[:48])
    val = TensorDataset(inputs[48:], labels[48:])
    if reference:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED)).tolist()
        return (DataLoader(train, batch_size=GLOBAL_BATCH, sampler=order),
                DataLoader(val, batch_size=GLOBAL_BATCH))
    return (DataLoader(train, batch_size=per_rank_batch, shuffle=True),
            DataLoader(val, batch_size=per_rank_batch))


def make_mixture_loader(per_rank_batch: int) -> DataLoader:
    """The training samples as a weighted mixture (lightning_hybrid/data/mixture.py) of two sources, 70/30: sample
    ``i`` of the mixture reads a seeded choice of source and row. The strategy's resumable sampler covers it like any
    map-style dataset."""
    from lightning_hybrid.data.mixture import MixtureDataset

    inputs, labels = make_tensors()
    sources = [TensorDataset(inputs[:32], labels[:32]), TensorDataset(inputs[32:48], labels[32:48])]
    return DataLoader(MixtureDataset(sources, [0.7, 0.3], num_samples=48, seed=5), batch_size=per_rank_batch,
                      shuffle=True)


def make_trainer_kwargs() -> dict:
    return {
        "trainer": dict(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=STEPS, limit_val_batches=2),
        # lr 1e-3, not 1e-2: at 1e-2 (weights moved ~60-95% in 4 steps) training amplified one fp32 rounding of
        # the initial weights (each element times 1 +- 2**-24) into final weights 4.3e-6 to 1.12e-5 apart (20 seeds,
        # median 8.8e-6): the rounding floor sat at the 1e-5 tolerance and meshes passed or failed by their
        # reduction order (cp2 x dp2 FSDP: 1.12e-5, deterministic). At 1e-3 (weights move 3.5%) the same
        # perturbation gives 1.1e-7 to 1.9e-7 (20 seeds): see helpers.compare.TOL.
        "module": dict(lr=1e-3, weight_decay=0.1, warmup_steps=1, lr_schedule="cosine",
                       # eps above the fp32 noise floor of near-zero gradients, which Adam would
                       # otherwise blow up to full-size updates of random sign
                       eps=1e-6),
    }


class LossRecorder(L.Callback):
    """The logged (global mean) training loss after every optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def run_reference(module_factory=None, evaluate: bool = False, **trainer_extra) -> dict:
    """Train on one process with Lightning's default strategy; the same record the workers save."""
    from lightning_hybrid.models import CausalLM

    L.seed_everything(SEED)
    kwargs = make_trainer_kwargs()
    module = module_factory() if module_factory else CausalLM(tiny_config(), **kwargs["module"])
    losses = LossRecorder()
    initial: dict = {}

    class Initial(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            initial.update({k: v.detach().clone() for k, v in pl_module.model.named_parameters()})

    trainer = L.Trainer(devices=1, callbacks=[losses, Initial()], **{**kwargs["trainer"], **trainer_extra})
    train, val = make_dataset(reference=True)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    record = {"losses": losses.losses, "val_loss": float(trainer.callback_metrics["val_loss"])
              if "val_loss" in trainer.callback_metrics else None, "initial": initial,
              "final": {k: v.detach().clone() for k, v in module.model.named_parameters()}}
    if evaluate:
        record["test_loss"] = float(trainer.test(module, dataloaders=val, verbose=False)[0]["test_loss"])
        inputs = DataLoader([x for x, _ in val.dataset], batch_size=val.batch_size)
        record["logits"] = trainer.predict(module, dataloaders=inputs)[0]
    return record
