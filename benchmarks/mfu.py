"""MFU of one training step of a Qwen2.5-shaped model on one device, in plain PyTorch (no Lightning).

A step is forward, token-mean cross-entropy, backward and an AdamW update. Model FLOPs per token come
from :func:`lightning_hybrid.callbacks.flops_per_token` (6N + LM head + 12*L*h*T, causal mask not
halved) and are checked against torch's FLOP counter on the meta device; MFU divides the achieved
FLOP/s by the dense peak of the device (the ThroughputMonitor's table on a GPU, a measured fp32
matmul peak on a CPU).

On one GPU (the issue's target: at least 45% MFU on an H100/H200-class GPU for the 1.5B preset at
sequence length 4096; pure bf16 weights and AdamW states, CUDA events):

    python benchmarks/mfu.py --device cuda --preset qwen2.5-1.5b --seq-len 4096 --batch-size 2 --dtype bf16 --steps 20
    python benchmarks/mfu.py --device cuda --compile          # the same with torch.compile per block

On a CPU the defaults shrink the preset so the run takes well under a minute (width / 4 with the
same heads and GQA ratio, 4 layers, an 8192-token vocabulary, 2 x 256 tokens per step):

    python benchmarks/mfu.py --device cpu

It prints a Markdown table. This is a measurement script, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Optional

import torch

from lightning_hybrid.callbacks.throughput import device_peak_flops, flops_per_token, normalize_dtype, peak_rss_bytes
from lightning_hybrid.models import Qwen2, Qwen2Config

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Defaults that differ by device: (seq_len, batch_size, steps, warmup, dtype, width_divisor, layers, vocab_size)
DEFAULTS = {"cuda": (4096, 2, 20, 3, "bf16", 1, None, None), "cpu": (256, 2, 8, 2, "fp32", 4, 4, 8192)}


def benchmark_config(preset: str, width_divisor: int = 1, layers: Optional[int] = None,
                     vocab_size: Optional[int] = None) -> Qwen2Config:
    """The preset, optionally narrower (hidden and MLP width divided, same head counts), shallower or with a
    smaller vocabulary.

    Raises:
        ValueError: an unknown preset, or a divisor that does not divide the widths or leaves heads without dimensions.
    """
    base = Qwen2Config.from_preset(preset)
    if width_divisor < 1 or base.hidden_size % (width_divisor * base.num_attention_heads) or \
            base.intermediate_size % width_divisor:
        raise ValueError(f"--width-divisor={width_divisor} does not divide hidden_size={base.hidden_size} into "
                         f"{base.num_attention_heads} heads and intermediate_size={base.intermediate_size}; "
                         f"try 1, 2 or 4")
    values = dataclasses.asdict(base)
    values.update(hidden_size=base.hidden_size // width_divisor,
                  intermediate_size=base.intermediate_size // width_divisor,
                  num_hidden_layers=layers or base.num_hidden_layers, vocab_size=vocab_size or base.vocab_size,
                  name=preset if (width_divisor, layers, vocab_size) == (1, None, None) else f"{preset}-reduced")
    return Qwen2Config(**values)


def counted_flops_per_token(config: Qwen2Config, seq_len: int) -> float:
    """Training FLOPs per token counted by torch's FLOP counter (through Lightning's ``measure_flops``) on meta."""
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        model = Qwen2(config)
        ids = torch.randint(0, config.vocab_size, (1, seq_len))
    return measure_flops(model, lambda: model(ids), lambda logits: logits.float().sum()) / seq_len


def train_steps(config: Qwen2Config, device: torch.device, dtype: torch.dtype, batch_size: int, seq_len: int,
                steps: int, warmup: int, compile_blocks: bool) -> list[float]:
    """Seconds of each timed training step (after ``warmup`` untimed ones)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2(config).to(dtype)
    if compile_blocks:
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step() -> None:
        loss_sum, count = model.loss_sum(model(inputs), labels)
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    return times


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-1.5b", help="model preset (default qwen2.5-1.5b)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (GPU 4096, CPU 256)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (GPU 20, CPU 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (GPU 3, CPU 2)")
    parser.add_argument("--dtype", default=None, help="weights and compute: bf16, fp16 or fp32 (GPU bf16, CPU fp32)")
    parser.add_argument("--width-divisor", type=int, default=None, help="divide hidden and MLP width (GPU 1, CPU 4)")
    parser.add_argument("--layers", type=int, default=None, help="number of blocks (GPU: the preset's, CPU 4)")
    parser.add_argument("--vocab-size", type=int, default=None, help="vocabulary (GPU: the preset's, CPU 8192)")
    parser.add_argument("--full-size", action="store_true",
                        help="on CPU too: the preset's own width, depth, vocabulary")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s of the device (overrides lookup)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in DEFAULTS:
        parser.error(f"--device={args.device} is not supported; use cuda or cpu")
    seq_len, batch_size, steps, warmup, dtype_name, divisor, layers, vocab = DEFAULTS[device.type]
    if args.full_size:
        divisor, layers, vocab = 1, None, None
    seq_len = args.seq_len or seq_len
    batch_size, steps = args.batch_size or batch_size, args.steps or steps
    warmup = args.warmup if args.warmup is not None else warmup
    dtype_name = normalize_dtype(args.dtype or dtype_name)
    if dtype_name not in TORCH_DTYPES:
        parser.error(f"--dtype={args.dtype} is not supported here; use bf16, fp16 or fp32")
    config = benchmark_config(args.preset, args.width_divisor or divisor, args.layers or layers,
                              args.vocab_size or vocab)

    times = train_steps(config, device, TORCH_DTYPES[dtype_name], batch_size, seq_len, steps, warmup, args.compile)
    step_time = statistics.median(times)
    tokens = batch_size * seq_len
    formula = flops_per_token(config, seq_len)
    counted = counted_flops_per_token(config, seq_len)
    achieved = formula * tokens / step_time
    peak_dtype = "tf32" if dtype_name == "fp32" and device.type == "cuda" and \
        torch.get_float32_matmul_precision() != "highest" else dtype_name
    if args.peak_tflops:
        peak, source = args.peak_tflops * 1e12, "--peak-tflops"
    else:
        peak, source = device_peak_flops(device, peak_dtype)
    if device.type == "cuda":
        memory, device_name = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_name(device)
    else:
        memory, device_name = peak_rss_bytes(), f"CPU, {torch.get_num_threads()} threads"

    shape = (f"h={config.hidden_size}, I={config.intermediate_size}, L={config.num_hidden_layers}, "
             f"heads {config.num_attention_heads}/{config.num_key_value_heads}, V={config.vocab_size}")
    rows = [
        ("model", f"{config.name} ({shape})"),
        ("parameters", f"{config.num_parameters() / 1e6:,.1f} M ({config.num_parameters(False) / 1e6:,.1f} M "
                       f"without embeddings)"),
        ("device", device_name + (", torch.compile per block" if args.compile else "")),
        ("dtype (weights, compute, AdamW states)", dtype_name),
        ("tokens per step", f"{batch_size} x {seq_len} = {tokens:,}"),
        ("step time, median of timed steps", f"{step_time:.3f} s ({len(times)} steps after {warmup} warm-up; "
                                             f"min {min(times):.3f}, max {max(times):.3f})"),
        ("tokens/s", f"{tokens / step_time:,.0f}"),
        ("model FLOPs/token (formula)", f"{formula / 1e6:,.2f} M"),
        ("model FLOPs/token (torch FLOP counter)", f"{counted / 1e6:,.2f} M (ratio {counted / formula:.4f})"),
        ("achieved TFLOP/s", f"{achieved / 1e12:.3f}"),
        ("peak TFLOP/s", f"{peak / 1e12:.3f} ({source})" if peak else f"unknown ({source}); pass --peak-tflops"),
        ("MFU", f"{achieved / peak:.1%}" if peak else "n/a"),
        ("peak memory", f"{memory / 1024 ** 3:.2f} GiB ({'CUDA max allocated' if device.type == 'cuda' else 'RSS'})"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"| {'quantity'.ljust(width)} | value |")
    print(f"|{'-' * (width + 2)}|-------|")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
