"""How long a checkpoint blocks training, async vs sync, and save/load throughput vs the disk.

    python benchmarks/checkpoint.py                     # 4 CPU processes, tp=2 x dp=2, ~150M-parameter model
    python benchmarks/checkpoint.py --hidden 768 --layers 6 --processes 4

Each mode trains a few steps with ``FaultTolerantCheckpoint(every_n_steps=2)``; "blocked" is the time
the training step spent inside the save call (for async: the copy to host memory), "save" is start to
commit. Load time is the restore at the start of a resumed run. The disk's write speed is measured in the
same run by writing and fsyncing a file of one rank's checkpoint size from each of the processes at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import FaultTolerantCheckpoint, HybridParallelStrategy
    from lightning_hybrid.models import CausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                         name="ckpt-bench")
    results: dict = {"parameters": config.num_parameters()}
    tokens = torch.randint(0, 32000, (64, 65))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)

    class RestoreTimer(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_train_start(self, trainer, pl_module):
            self.seconds = time.perf_counter() - self.start

    for mode in ("sync", "async"):
        ckpt = Path(args.dir) / mode
        L.seed_everything(0)
        callback = FaultTolerantCheckpoint(ckpt, every_n_steps=2, async_save=mode == "async", keep_last=2)
        trainer = L.Trainer(strategy=HybridParallelStrategy(tp=2), accelerator="cpu", devices=args.processes,
                            max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[callback])
        trainer.fit(CausalLM(config, lr=1e-4), train_dataloaders=data)
        size = sum(f.stat().st_size for f in (ckpt / "latest").parent.glob("step-*/**/*") if f.is_file()) / 2
        results[mode] = {"blocked": callback.blocking_seconds, "save": callback.save_seconds, "bytes": size}
        timer = RestoreTimer()
        resumed = L.Trainer(strategy=HybridParallelStrategy(tp=2), accelerator="cpu", devices=args.processes,
                            max_steps=args.steps + 1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer, FaultTolerantCheckpoint(ckpt, every_n_steps=100)])
        resumed.fit(CausalLM(config, lr=1e-4), train_dataloaders=data)
        results[mode]["load"] = timer.seconds
    # disk write speed: every rank writes and fsyncs its share of one checkpoint at once
    share = int(results["sync"]["bytes"] / dist.get_world_size())
    path = Path(args.dir) / f"disk_{dist.get_rank()}.bin"
    block = os.urandom(8 << 20)
    dist.barrier()
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, share // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()
    results["disk_write_seconds"] = time.perf_counter() - start
    results["disk_bytes"] = max(1, share // len(block)) * len(block) * dist.get_world_size()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes), __file__,
               "--worker", "--dir", tmp, "--out", str(out), "--hidden", str(args.hidden), "--layers",
               str(args.layers), "--steps", str(args.steps), "--processes", str(args.processes)]
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"benchmark workers failed:\n{done.stderr[-4000:]}")
        r = json.loads(out.read_text())
    gb = r["sync"]["bytes"] / 1e9
    disk = r["disk_bytes"] / r["disk_write_seconds"] / 1e9
    print(f"model: {r['parameters'] / 1e6:.0f}M parameters, checkpoint {gb:.2f} GB (weights + AdamW states), "
          f"{args.processes} processes, tp=2")
    print("| mode | blocked per save (s) | save to commit (s) | save GB/s | load (s) | load GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in ("sync", "async"):
        m = r[mode]
        blocked, save = sum(m["blocked"]) / len(m["blocked"]), sum(m["save"]) / len(m["save"])
        print(f"| {mode} | {blocked:.3f} | {save:.3f} | {gb / save:.2f} | {m['load']:.2f} | {gb / m['load']:.2f} |")
    mean_async = sum(r["async"]["blocked"]) / len(r["async"]["blocked"])
    ratio = mean_async / (sum(r["sync"]["blocked"]) / len(r["sync"]["blocked"]))
    print(f"async blocks training for {100 * ratio:.1f}% of the synchronous save time; "
          f"disk write speed in the same run: {disk:.2f} GB/s")


if __name__ == "__main__":
    main()
