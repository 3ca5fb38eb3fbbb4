"""Float8 against bf16 on one GPU: the same training run twice through ``HybridParallelStrategy``, bf16 and float8.

The qwen2.5-1.5b preset (or ``--preset``) trains ``--steps`` optimizer steps on fixed random tokens under
``bf16-mixed``, once with ``float8=None`` and once with ``--float8`` (default ``rowwise``; ``mxfp8`` needs a Blackwell
GPU), from the same seed. It prints the final losses, their relative difference (the run fails above
``--loss-tolerance``, 3%), and the median step times with their ratio (float8 / bf16; below 1 is faster).

    python benchmarks/float8_smoke.py                       # H100/H200: rowwise vs bf16, 50 steps
    python benchmarks/float8_smoke.py --float8 tensorwise

Not run on hardware in this project yet (written and tested on CPU only; ``benchmarks/gpu_smoke.sh`` runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.models import CausalLM


class StepTimer(L.Callback):
    """Wall time of every optimizer step (the GPU synchronized at each end) and the logged loss."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def train(float8: Optional[str], args: argparse.Namespace) -> StepTimer:
    L.seed_everything(1234)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 32000, (args.steps * args.batch_size, args.seq_len + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    module = CausalLM(args.preset, lr=3e-4, warmup_steps=5)
    timer = StepTimer()
    trainer = L.Trainer(strategy=HybridParallelStrategy(float8=float8), accelerator=args.device, devices=1,
                        precision="bf16-mixed", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
                        limit_val_batches=0)
    trainer.fit(module, train_dataloaders=data)
    return timer


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--float8", default="rowwise", choices=("tensorwise", "rowwise", "mxfp8"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="gpu")
    parser.add_argument("--loss-tolerance", type=float, default=0.03)
    args = parser.parse_args(argv)
    bf16, float8 = train(None, args), train(args.float8, args)
    skip = min(5, args.steps // 2)  # warm-up steps
    t16, t8 = statistics.median(bf16.times[skip:]), statistics.median(float8.times[skip:])
    diff = abs(float8.losses[-1] - bf16.losses[-1]) / bf16.losses[-1]
    print(f"| run | final loss | median step (s) |\n|---|---|---|\n| bf16 | {bf16.losses[-1]:.4f} | {t16:.3f} |\n"
          f"| float8 {args.float8} | {float8.losses[-1]:.4f} | {t8:.3f} |")
    print(f"loss relative difference {diff:.2%} (tolerance {args.loss_tolerance:.0%}); "
          f"step-time ratio float8/bf16 {t8 / t16:.3f}")
    return 0 if diff <= args.loss_tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
