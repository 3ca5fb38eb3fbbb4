"""The equivalence runs of ``tests/test_user_models.py``: models the user brings, on 4 processes and on one.

Launched (forked ranks) as ``user_models_worker.py OUT``. Every rank trains the user's own decoder on tp=2 x pp=2
(sequence parallel) and on cp=2 x tp=2, and a held Hugging Face Llama on tp=2 x dp=2 (recompute per decoder layer);
then rank 0 trains both on one process with Lightning's default strategy, and writes ``OUT/records.pt``. Nothing is
asserted here.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from test_user_models import STEPS, HeldLlama, tiny_llama, train
from torch.utils.data import DataLoader, TensorDataset

from helpers.equivalence import GLOBAL_BATCH, SEED, LossRecorder, make_dataset, make_tensors
from helpers.gather import full_weights, gather_objects
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy


class Weights(L.Callback):
    """The whole weights at the start of fit: gathered from every rank (a collective), or this process's own (a
    reference on one process, while the other ranks wait)."""

    def __init__(self, reference: bool) -> None:
        self.reference, self.initial = reference, {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = whole(pl_module.model, self.reference)


def whole(model: torch.nn.Module, reference: bool) -> dict[str, torch.Tensor]:
    if reference:
        return {name: param.detach().clone() for name, param in model.named_parameters()}
    return full_weights(model)


def decoder_run(strategy: object, devices: int, per_rank_batch: int = GLOBAL_BATCH,
                reference: bool = False) -> dict:
    """The guide's ``train`` with recorders: its per-step global losses and its whole weights before and after."""
    losses, weights = LossRecorder(), Weights(reference)
    data, _ = make_dataset(per_rank_batch, reference=reference)
    module = train(strategy, devices, data, max_steps=STEPS, callbacks=[losses, weights])
    return {"losses": losses.losses, "initial": weights.initial, "final": whole(module.model, reference)}


def llama_data(per_rank_batch: int, reference: bool = False) -> DataLoader:
    """The equivalence problem's tokens, every label kept: a per-rank mean loss (the user's) averaged over the dp ranks
    is then the global batch's mean, as on one process."""
    inputs, _ = make_tensors()
    train_set = TensorDataset(inputs[:48, :-1], inputs[:48, 1:])
    if reference:  # the order Lightning's DistributedSampler(shuffle=True, seed) gives the dp ranks together
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(SEED)).tolist()
        return DataLoader(train_set, batch_size=GLOBAL_BATCH, sampler=order)
    return DataLoader(train_set, batch_size=per_rank_batch, shuffle=True)


class Said(logging.Handler):
    """The lines the strategy logs."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def applied(model: torch.nn.Module) -> dict:
    """What this rank's held model got: parameters TP sharded, FSDP2 units, recomputed decoder layers."""
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.distributed.activation_checkpoint import recomputed

    tp = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names]
    units = [n for n, m in model.named_modules() if callable(getattr(m, "_get_fsdp_state", None))]
    return {"sharded_by_tp": len(tp), "fsdp_units": len(units),
            "recomputed": sum(1 for m in model.modules() if recomputed(m) == "full")}


def llama_run(path: Path, strategy: object, devices: int, per_rank_batch: int, reference: bool = False) -> dict:
    L.seed_everything(SEED)
    losses, weights, said = LossRecorder(), Weights(reference), Said()
    logging.getLogger("lightning.pytorch").addHandler(said)
    module = HeldLlama(str(path))
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[losses, weights])
    trainer.fit(module, train_dataloaders=llama_data(per_rank_batch, reference))
    logging.getLogger("lightning.pytorch").removeHandler(said)
    record = {"losses": losses.losses, "initial": weights.initial, "final": whole(module.model, reference)}
    if not reference:
        record["applied"] = applied(module.model)
        record["log"] = [line for line in said.lines if "held as it is" in line]
    return record


def main() -> None:
    out = Path(sys.argv[1])
    path = out / "tiny-llama"
    if int(os.environ["RANK"]) == 0:  # the others read it only after the decoder runs, which need rank 0
        tiny_llama(path)
    records = {
        "decoder_tp2_pp2": decoder_run(HybridParallelStrategy(tp=2, pp=2, sequence_parallel=True), 4),
        "decoder_cp2_tp2": decoder_run(HybridParallelStrategy(cp=2, tp=2), 4),
        "llama_tp2_dp2": llama_run(path, HybridParallelStrategy(tp=2, dp=2, activation_checkpointing="full"), 4,
                                   GLOBAL_BATCH // 2),
    }
    records["llama_tp2_dp2"]["applied"] = gather_objects(records["llama_tp2_dp2"]["applied"])  # by rank
    if dist.get_rank() == 0:
        records["decoder_reference"] = decoder_run("auto", 1, reference=True)
        records["llama_reference"] = llama_run(path, "auto", 1, GLOBAL_BATCH, reference=True)
        torch.save(records, out / "records.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
