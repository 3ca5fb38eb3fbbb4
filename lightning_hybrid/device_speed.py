"""The speed of this process's device, measured: the one matmul timer, and a memory copy.

Used by the throughput monitor (the CPU's peak for MFU), the preflight (a device's matmul TFLOP/s next to its links)
and the auto layout's CPU calibration (:mod:`lightning_hybrid.distributed.auto_layout`, which hands the figures to
the planner). A ground-floor module: it imports torch and nothing of ours; the planner, which is arithmetic, only
receives its numbers.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

__all__ = ["matmul_flops", "copy_bytes_per_second", "measure_cpu", "CPU_MATMUL_SIZE", "CPU_COPY_BYTES"]

CPU_MATMUL_SIZE = 384
"""Side of the float32 matmul the auto layout times on CPU: large enough to reach the cores' GEMM speed, a few ms per
call."""
CPU_COPY_BYTES = 32 << 20  # the memory copy timed on CPU: beyond the caches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(size: int, repeats: int, device: Any = "cpu", dtype: Optional[torch.dtype] = None,
                 warmup: int = 1, best: bool = False) -> float:
    """FLOP/s of ``size x size`` by ``size x size`` matmuls on ``device`` with this process's threads.

    Args:
        size: the side of the square operands (``2 * size**3`` FLOPs per product).
        repeats: the timed products.
        device: where the operands live; a CUDA device is synchronized around the timing.
        dtype: the operands' dtype (``None``: float32).
        warmup: untimed products first (thread pool and caches; cuBLAS's kernel choice and workspace).
        best: the fastest single product's rate; else the mean rate over all of them.
    """
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype or torch.float32)
    b = torch.randn(size, size, device=device, dtype=dtype or torch.float32)
    for _ in range(warmup):
        a @ b
    _sync(device)
    flops = 2.0 * size ** 3
    if best:
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            _sync(device)
            fastest = min(fastest, time.perf_counter() - start)
        return flops / fastest
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return flops * repeats / (time.perf_counter() - start)


def copy_bytes_per_second(nbytes: int, repeats: int) -> float:
    """Bytes per second moved by copying a float32 buffer of ``nbytes`` on CPU (read + write), mean of ``repeats``
    after one untimed copy."""
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def measure_cpu(size: int = CPU_MATMUL_SIZE, repeats: int = 5) -> tuple[float, float]:
    """(float32 matmul TFLOP/s, memory copy TB/s) of this process on CPU, with the threads it has."""
    return matmul_flops(size, repeats) / 1e12, copy_bytes_per_second(CPU_COPY_BYTES, repeats) / 1e12
