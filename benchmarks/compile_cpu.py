"""CPU step time of ``compile=True`` against eager, on 4 gloo processes, tp=2 with sequence parallelism + recompute.

Two meshes, as the equivalence tests of tests/test_compile_tp.py: tp2 x dp2 FSDP with selective (op) recompute, and
tp2 x pp2 (1F1B) with full recompute; each trained eager and compiled, one after the other in one process group.
The step time is the median interval between the ends of consecutive optimizer steps on rank 0 after ``--warmup``
steps (the first compiled step builds inductor's C++ kernels and is left out). Ratios within one run are what to
read: the machine is shared and noisy, and a CPU says nothing about GPU speed-ups.

    torchrun --nproc_per_node 4 benchmarks/compile_cpu.py --steps 12 --warmup 3

Prints a Markdown table on rank 0. A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.models import CausalLM, Qwen2Config

MESHES = {"tp2 x dp2, SP, selective": dict(tp=2, dp=2, data_parallel="fsdp", activation_checkpointing="selective"),
          "tp2 x pp2, SP, full": dict(tp=2, pp=2, microbatches=2, activation_checkpointing="full")}


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())


def run(mesh: dict, compile_: bool, steps: int) -> list[float]:
    L.seed_everything(0)
    config = Qwen2Config(**{**Qwen2Config.from_preset("tiny").to_dict(), "name": "tiny", "hidden_size": 128,
                            "intermediate_size": 352})
    tokens = torch.randint(0, 256, (64, 129))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    timer = StepTimer()
    trainer = L.Trainer(strategy=HybridParallelStrategy(sequence_parallel=True, compile=compile_, **mesh),
                        accelerator="cpu", devices=4, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(CausalLM(config, lr=1e-4), train_dataloaders=data)
    return [b - a for a, b in zip(timer.ends, timer.ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name, mesh in MESHES.items():
        eager = statistics.median(run(mesh, False, args.steps)[args.warmup:])
        compiled = statistics.median(run(mesh, True, args.steps)[args.warmup:])
        rows.append(f"| {name} | {eager * 1e3:.0f} ms | {compiled * 1e3:.0f} ms | {compiled / eager:.2f} |")
    if torch.distributed.get_rank() == 0:
        print("| mesh (4 CPU processes, gloo) | eager step | compiled step | compiled / eager |")
        print("| --- | --- | --- | --- |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
