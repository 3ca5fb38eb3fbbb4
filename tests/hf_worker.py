"""Import a Hugging Face folder into tp=2 x pp=2, predict, train 2 steps, predict again, save a checkpoint;
in between, import it into tp=2 x dp=2 (FSDP2) too.

Launched by ``tests/test_hf_interop.py`` with torchrun on 4 processes:
``hf_worker.py HF_FOLDER INPUTS_PT OUT_DIR``. Rank 0 writes ``OUT_DIR/record.pt`` (logits before and after
training, bytes read per rank) before the checkpoint is saved to ``OUT_DIR/ckpt``, so the import checks do
not depend on the checkpoint writer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from helpers.gather import first_prediction, gather_objects
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.distributed.tensor_parallel import full_vocabulary
from lightning_hybrid.init_weights import local_region
from lightning_hybrid.models import CausalLM, Qwen2Config
from lightning_hybrid.models.qwen2 import hf


def predicted_logits(trainer: L.Trainer, module: CausalLM, inputs: torch.Tensor) -> torch.Tensor:
    """Logits from trainer.predict, taken from the rank that holds the last pipeline stage."""
    return first_prediction(trainer.predict(module, dataloaders=DataLoader(inputs, batch_size=len(inputs))))


def main() -> None:
    folder, inputs_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    inputs = torch.load(inputs_path, weights_only=True)
    L.seed_everything(0)
    config = Qwen2Config.from_hf(folder)
    module = CausalLM(config, init_from_hf=str(folder), lr=1e-2, warmup_steps=0, lr_schedule="constant",
                      weight_decay=0.0, eps=1e-6)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=HybridParallelStrategy(tp=2, pp=2), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    before = predicted_logits(trainer, module, inputs)
    # What this rank holds and what it read while the strategy filled its shards.
    itemsize = 4  # the test folder is fp32
    held = sum(local_region(p)[0].numel() * itemsize for p in module.model.parameters())
    reads = gather_objects({"rank": dist.get_rank(), "bytes_read": hf.read_stats.bytes_read, "held_bytes": held,
                    "tensors_read": hf.read_stats.tensors_read})

    # The same folder into tp=2 x dp=2 with FSDP2: parameters are TP shards further split over dp.
    fsdp_module = CausalLM(config, init_from_hf=str(folder))
    fsdp_trainer = L.Trainer(accelerator="cpu", devices=4, strategy=HybridParallelStrategy(tp=2, dp=2),
                             logger=False, enable_progress_bar=False, enable_model_summary=False)
    fsdp_trainer.predict(fsdp_module, dataloaders=DataLoader(inputs, batch_size=2))  # sets the model up
    fsdp_held = sum(local_region(p)[0].numel() * itemsize for p in fsdp_module.model.parameters())
    fsdp_reads = gather_objects({"rank": dist.get_rank(), "bytes_read": hf.read_stats.bytes_read,
                                 "held_bytes": fsdp_held})
    with torch.no_grad():  # every rank runs the whole batch; under loss parallel (the default) the head's output is
        # this TP rank's vocabulary shard, which the strategy gathers for prediction (as predict_step does)
        fsdp_logits = full_vocabulary(fsdp_module.model(inputs), fsdp_trainer.strategy.device_mesh)
    del fsdp_module, fsdp_trainer

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (8, inputs.shape[1] + 1), generator=g)
    train = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=True)
    trainer.fit(module, train_dataloaders=train)
    after = predicted_logits(trainer, module, inputs)
    if dist.get_rank() == 0:
        torch.save({"before": before, "after": after, "reads": reads, "fsdp_logits": fsdp_logits,
                    "fsdp_reads": fsdp_reads}, out / "record.pt")
    dist.barrier()
    trainer.save_checkpoint(out / "ckpt")
    dist.barrier()


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
