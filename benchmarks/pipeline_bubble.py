"""Measured vs theoretical pipeline bubble for GPipe, 1F1B and interleaved 1F1B.

Runs the real strategy (``HybridParallelStrategy(pp=...)`` in a Lightning Trainer) on CPU processes
and reads the bubble report the strategy computes from its stage timings: each rank's idle fraction
is ``1 - (time inside its stages' forward/backward compute) / (time of the schedule step)``, averaged
over the steps after warm-up and over the ranks of each pipeline position.

    python benchmarks/pipeline_bubble.py                 # pp 2 and 4, micro-batches 4, 8, 16
    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 8 16 --steps 6

On a 2-core machine pp=4 runs 4 processes on 2 cores: time spent waiting for a core counts as busy
or idle depending on when the scheduler preempts, so compare pp=4 figures with care.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.models import CausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, name="bubble-bench")
    results = []

    class ResetAfterWarmup(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == args.warmup - 1:
                trainer.strategy.pipeline.timer.reset()

    for schedule, virtual in SCHEDULES:
        for m in args.microbatches:
            if schedule == "interleaved_1f1b" and m % args.pp:
                continue
            L.seed_everything(0)
            tokens = torch.randint(0, 256, (m * (args.steps + args.warmup), args.seq_len + 1))
            data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=m)
            strategy = HybridParallelStrategy(pp=args.pp, pp_schedule=schedule, virtual_stages=virtual, microbatches=m)
            trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.pp,
                                max_steps=args.steps + args.warmup,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[ResetAfterWarmup()])
            trainer.fit(CausalLM(config, lr=1e-4), train_dataloaders=data)
            report = strategy.bubble_report
            measured = sum(report["measured"].values()) / len(report["measured"])
            results.append({"schedule": schedule, "pp": args.pp, "microbatches": m, "virtual_stages": virtual,
                            "theoretical": report["theoretical"], "measured": measured,
                            "per_rank": report["measured"]})
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=4, help="measured steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.pp = args.pp[0]
        return worker(args)
    rows = []
    for pp in args.pp:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "result.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(pp), __file__, "--worker",
                   "--pp", str(pp), "--microbatches", *map(str, args.microbatches), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--seq-len", str(args.seq_len), "--hidden", str(args.hidden),
                   "--out", str(out)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows.extend(json.loads(out.read_text()))
    print("| schedule | pp | micro-batches | virtual stages | theoretical bubble | measured bubble "
          "| difference (points) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['virtual_stages']} "
              f"| {100 * r['theoretical']:.1f}% "
              f"| {100 * r['measured']:.1f}% | {100 * (r['measured'] - r['theoretical']):+.1f} |")


if __name__ == "__main__":
    main()
