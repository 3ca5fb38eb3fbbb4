"""Each runtime feature of ``HybridParallelStrategy`` on and off: step time (as a ratio) and peak memory per rank.

Features: ``loss_parallel``, ``bf16_compute_weights`` (under ``bf16-mixed``), ``fsdp_reshard_after_forward``
(``"auto"``/``False`` against ``True``) and ``async_tp`` (CUDA and NCCL only: reported as not runnable here).
Layouts: tp2 x dp2 (FSDP) and tp2 x pp2 (1F1B, 4 micro-batches) on 4 CPU processes (gloo), the tiny Qwen2 at
128 tokens x 8 sequences per dp rank. Every configuration runs inside one process group, on and off one after the
other, so the ratio compares runs of the same machine state:

* step time: the median interval between the ends of consecutive optimizer steps on rank 0 (``--steps`` after
  ``--warmup``) of a ``Trainer.fit``;
* peak memory: the most tensor bytes each rank held during one traced training step (torch's ``MemTracker``, as
  the dry run measures a real rank), parameters, gradients, optimizer state, activations and temporaries.

    python benchmarks/runtime.py                # some minutes on a 2-core machine
    python benchmarks/runtime.py --steps 12 --warmup 3

It prints a Markdown table. A measurement script, not a test; CPU step times say little about a GPU's.

On GPUs (``benchmarks/gpu_smoke.sh``'s ``async-tp`` step; never run here, where there is no GPU), ``--async-tp`` under
``torchrun --nproc_per_node 2`` trains qwen2.5-0.5b at tp=2 with sequence parallel, compile and bf16-mixed, with
``async_tp`` off and then on, and prints both losses per step, whether they agree within bf16 tolerance (relative
1e-2) and the step-time ratio on / off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-cpu.yaml"
LAYOUTS = {"tp2 x dp2": {"tp": 2, "pp": 1}, "tp2 x pp2": {"tp": 2, "pp": 2, "microbatches": 4},
           "pp2 x dp2": {"tp": 1, "pp": 2, "microbatches": 4}}
# feature -> (strategy options on, options off, precision, layouts); the reshard policy matters only with FSDP
# (dp > 1): at tp2 x pp2 dp is 1, so it is measured at pp2 x dp2 too ("auto" there is False, at tp2 x dp2 True)
FEATURES = {
    "loss_parallel": ({"loss_parallel": True}, {"loss_parallel": False}, "32-true", ("tp2 x dp2", "tp2 x pp2")),
    "bf16_compute_weights": ({"bf16_compute_weights": True}, {"bf16_compute_weights": False}, "bf16-mixed",
                             ("tp2 x dp2", "tp2 x pp2")),
    "fsdp_reshard_after_forward": ({"fsdp_reshard_after_forward": False}, {"fsdp_reshard_after_forward": True},
                                   "32-true", ("tp2 x dp2", "pp2 x dp2")),
}


def _step_times(strategy: dict, precision: str, steps: int, warmup: int, model: str = "tiny", seq_len: int = 128,
                accelerator: str = "cpu", losses: Optional[list] = None) -> list[float]:
    """Intervals between optimizer-step ends on this rank of a ``Trainer.fit`` of ``model`` (the training losses
    appended to ``losses``)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.models import CausalLM

    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if accelerator == "gpu":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            if losses is not None:
                losses.append(float(trainer.callback_metrics["train_loss"]))

    L.seed_everything(1234, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (strategy["tp"] * strategy["pp"])
    module = CausalLM(model, lr=1e-4)
    vocab = module.config.vocab_size
    ids = torch.randint(0, vocab, (8 * dp * (steps + warmup + 1), seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8)
    trainer = L.Trainer(accelerator=accelerator, devices=world, strategy=HybridParallelStrategy(**strategy),
                        precision=precision, max_steps=steps + warmup + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
                        gradient_clip_val=1.0)
    trainer.fit(module, train_dataloaders=data)
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def _peak(strategy: dict, precision: str, rank: int) -> int:
    """Most tensor bytes this rank held in one traced training step (after one untraced one)."""
    from lightning_hybrid.dryrun.rank import run_rank
    from lightning_hybrid.dryrun.recipe import load_job

    job = dataclasses.replace(load_job(str(TINY)).with_strategy(**strategy), precision=precision)
    return run_rank(job, rank, fake=False, warmup_steps=1).total_peak


def worker(out: Path, steps: int, warmup: int) -> None:
    """One torchrun process: every layout and feature, on then off; rank 0 writes the results as JSON."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    rows = []
    for feature, (on, off, precision, layouts) in FEATURES.items():
        for layout in layouts:
            sizes = LAYOUTS[layout]
            result = {"layout": layout, "feature": feature, "precision": precision}
            for label, options in (("on", on), ("off", off)):
                strategy = {**sizes, "data_parallel": "fsdp", **options}
                result[f"{label}_s"] = statistics.median(_step_times(strategy, precision, steps, warmup))
                peaks = [None] * int(os.environ["WORLD_SIZE"])
                dist.all_gather_object(peaks, _peak(strategy, precision, rank))
                result[f"{label}_peak"] = peaks
            rows.append(result)
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.barrier()


def async_tp_compare(steps: int, warmup: int) -> None:
    """Under torchrun on 2 GPUs: async_tp off, then on; losses and the step-time ratio on rank 0."""
    import torch.distributed as dist

    strategy = {"tp": 2, "sequence_parallel": True, "compile": True, "process_group_backend": "nccl"}
    times, losses = {}, {}
    for label, on in (("off", False), ("on", True)):
        losses[label] = []
        times[label] = statistics.median(_step_times({**strategy, "async_tp": on}, "bf16-mixed", steps, warmup,
                                                     model="qwen2.5-0.5b", seq_len=2048, accelerator="gpu",
                                                     losses=losses[label]))
    failed = False
    if int(os.environ["RANK"]) == 0:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses["on"], losses["off"]))
        print(f"async_tp losses off: {losses['off']}\nasync_tp losses on:  {losses['on']}")
        print(f"async_tp loss agreement: max relative difference {worst:.2e} "
              f"({'ok' if worst < 1e-2 else 'NOT within bf16 tolerance'})")
        print(f"async_tp step time: on {times['on']:.4f} s, off {times['off']:.4f} s, "
              f"ratio on/off {times['on'] / times['off']:.3f}")
        failed = worst >= 1e-2
    dist.barrier()
    if failed:
        sys.exit(1)


def _mb(values: list[int]) -> str:
    return "/".join(f"{v / 2**20:.2f}" for v in values)


def table(rows: list[dict]) -> str:
    """The Markdown table: per layout and feature, step times, their ratio and peak MiB per rank."""
    lines = ["| feature (on vs off) | layout | precision | step on (s) | step off (s) | on / off | "
             "peak MiB per rank 0-3, on | peak MiB per rank 0-3, off |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['feature']} | {r['layout']} | {r['precision']} | {r['on_s']:.3f} | {r['off_s']:.3f} | "
                     f"{r['on_s'] / r['off_s']:.2f} | {_mb(r['on_peak'])} | {_mb(r['off_peak'])} |")
    lines.append("| async_tp | tp2 x dp2, tp2 x pp2 | - | - | - | - | - | - |")
    lines.append("\nasync_tp needs CUDA and NCCL (and compile, sequence parallel): not runnable on CPU; "
                 "benchmarks/gpu_smoke.sh compares it on a GPU.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--async-tp", action="store_true",
                        help="under torchrun on 2 GPUs: compare async_tp on and off (gpu_smoke.sh)")
    args = parser.parse_args()
    if args.async_tp:
        return async_tp_compare(args.steps, args.warmup)
    if args.worker_out:
        return worker(Path(args.worker_out), args.steps, args.warmup)
    print(table(run_workers(__file__, ["--steps", str(args.steps), "--warmup", str(args.warmup)])))


def run_workers(script: str, args: list[str], nproc: int = 4) -> object:
    """``torchrun`` of ``script args --worker-out FILE`` on ``nproc`` CPU processes (one thread each); what rank 0
    wrote to FILE, read as JSON. Exits with the workers' error output if they fail."""
    import subprocess

    from lightning_hybrid.launch.torchrun import launcher_command

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "workers.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        done = subprocess.run([*launcher_command(nproc), script, *args, "--worker-out", str(out)], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"benchmark workers failed ({done.returncode}):\n{done.stderr[-6000:]}")
        return json.loads(out.read_text())


if __name__ == "__main__":
    sys.exit(main())
