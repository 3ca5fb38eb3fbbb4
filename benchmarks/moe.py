"""Expert parallelism measured: step time and all-to-all bytes per step for ep=1 and ep=2 at the same global batch.

Runs the real strategy (``HybridParallelStrategy(ep=...)`` in a Lightning Trainer) on 4 CPU processes (gloo), a
small Qwen3-MoE (4 blocks, width 128, 8 experts of width 256, 2 per token), ep=1 (every rank holds every expert,
FSDP2 over the 4 ranks) and then ep=2 (each rank holds 4 experts, FSDP2 over the 2 ranks holding the same ones, tokens
to their experts and back with all-to-all) in one launch, and prints both with the ratios ep=2 / ep=1:

    python benchmarks/moe.py                      # 4 processes, 2 warm-up + 6 measured steps, seq 128
    python benchmarks/moe.py --steps 10 --seq-len 256

Step time: the median of the measured steps (rank 0's wall time from batch start to batch end). All-to-all bytes: the
hidden states a rank sends to other ranks in one step, forward (dispatch and return) counted by the dispatcher,
backward the same again (each all-to-all's backward sends its gradient the reverse way); the mean over the ranks.

``--grouped-check`` (on a CUDA device, bf16): ``torch._grouped_mm`` against the per-expert loop for one layer's
experts at a Qwen3-30B-A3B-sized expert (2048 x 768), outputs and gradients compared and timed; part of
``benchmarks/gpu_smoke.sh``'s ``moe`` step (not run on hardware yet).

On a 2-core machine the 4 processes share 2 cores: compare the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=128, intermediate_size=384, moe_intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
             num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.01, max_position_embeddings=1024,
             name="moe-bench")


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.distributed.expert_parallel import all_to_all_bytes
    from lightning_hybrid.models import CausalLM, DecoderConfig

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.start)

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for ep in (1, 2):
        L.seed_everything(0)
        steps = args.warmup + args.steps
        tokens = torch.randint(0, 256, (args.global_batch * steps, args.seq_len + 1))
        data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.global_batch // world)
        timer = StepTimes()
        trainer = L.Trainer(strategy=HybridParallelStrategy(ep=ep), accelerator="cpu", devices=world, max_steps=steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[timer])
        module = CausalLM(DecoderConfig(**MODEL), lr=1e-4)
        trainer.fit(module, train_dataloaders=data)
        sent = torch.tensor(float(all_to_all_bytes(module.model)))
        dist.all_reduce(sent)
        results.append({"ep": ep, "step_time": statistics.median(timer.times[args.warmup:]),
                        "all_to_all_bytes": 2 * float(sent) / world / steps,
                        "tokens_per_step": args.global_batch * args.seq_len})
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out).write_text(json.dumps(results))


def grouped_check() -> None:
    """``torch._grouped_mm`` against the loop on one layer's experts (CUDA, bf16)."""
    import torch

    from lightning_hybrid.models.decoder.moe import expert_mlp, grouped_gemm_supported

    g = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, rows = 16, 2048, 768, 8192
    tokens = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    gate_up = 0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    down = 0.02 * torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g)
    counts = torch.multinomial(torch.ones(experts, device="cuda"), rows, replacement=True, generator=g)
    counts = torch.bincount(counts, minlength=experts).tolist()
    upstream = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    assert grouped_gemm_supported(tokens, gate_up), "grouped GEMM not selected on this device"
    found, times = {}, {}
    for grouped in (True, False):
        x, a, b = (t.clone().requires_grad_() for t in (tokens, gate_up, down))
        for _ in range(3):  # warm-up, then the timed pass
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = expert_mlp(x, counts, a, b, grouped=grouped)
            out.backward(upstream)
            torch.cuda.synchronize()
            times[grouped] = time.perf_counter() - start
            found[grouped] = [out.float(), x.grad.float(), a.grad.float(), b.grad.float()]
            x.grad = a.grad = b.grad = None
    worst = max(float((p - q).norm() / q.norm()) for p, q in zip(found[True], found[False]))
    print(f"grouped GEMM vs loop: max relative difference {worst:.2e} (bf16), forward+backward "
          f"{times[True] * 1e3:.2f} ms vs {times[False] * 1e3:.2f} ms ({times[False] / times[True]:.2f}x)")
    if worst > 2e-2:
        raise SystemExit(f"grouped GEMM differs from the loop by {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="measured steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--grouped-check", action="store_true", help="grouped GEMM vs loop on CUDA (bf16)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.grouped_check:
        return grouped_check()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", __file__, "--worker",
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq-len", str(args.seq_len),
               "--global-batch", str(args.global_batch), "--out", str(out)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    one, two = rows
    print(f"4 CPU processes, global batch {args.global_batch} x {args.seq_len} tokens, {args.steps} measured steps")
    print("| ep | step time (s) | all-to-all bytes / step / rank | tokens/s |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['ep']} | {r['step_time']:.3f} | {r['all_to_all_bytes']:,.0f} | "
              f"{r['tokens_per_step'] / r['step_time']:,.0f} |")
    bytes_ratio = (f"{two['all_to_all_bytes'] / one['all_to_all_bytes']:.2f}" if one["all_to_all_bytes"]
                   else "- (ep=1 sends none)")
    print(f"| ep=2 / ep=1 | {two['step_time'] / one['step_time']:.2f} | {bytes_ratio} | "
          f"{one['step_time'] / two['step_time']:.2f} |")


if __name__ == "__main__":
    main()
