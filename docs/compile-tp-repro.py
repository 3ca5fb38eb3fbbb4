"""Minimal reproduction: torch.compile + tensor parallelism with sequence parallelism + recompute, wrong gradients.

One Qwen2 block (the tiny preset) on tp=2 (gloo, CPU), sequence parallel (torch's ``SequenceParallel`` norms and
``PrepareModuleInput`` all-gather in front of attention and MLP), recompute (full or selective op-level) and
attention + MLP compiled with inductor. Gradients are compared with the same block on one process (no TP, eager).

    torchrun --nproc_per_node 2 docs/compile-tp-repro.py --workaround off   # torch 2.13: grad error ~1 with warm
                                                                            # inductor caches; exact compiled afresh
    torchrun --nproc_per_node 2 docs/compile-tp-repro.py --workaround on    # lightning-hybrid's order: ~5e-7

``--workaround off`` compiles each part's call (``nn.Module.compile``), so the ``PrepareModuleInput`` hook's
Shard(1) -> Replicate redistribution (the SP all-gather) is traced into the inductor graph; with recompute around
it the gradients are wrong (``post_attention_layernorm.weight`` is off by ~100%). ``--workaround on`` is what
``compile_blocks`` does: the part's ``forward`` is compiled, the TP hooks stay eager at the graph boundary (and
inductor's donated buffers are off for these graphs). Prints one line per case; rank 0 exits 1 if any case is
wrong (relative gradient error > 1e-4).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import lightning_hybrid.distributed.activation_checkpoint as recompute_and_compile
from lightning_hybrid.distributed.tensor_parallel import block_plan
from lightning_hybrid.models import Qwen2Config
from lightning_hybrid.models.qwen2.config import parallel_spec
from lightning_hybrid.models.qwen2.model import Qwen2Block


def gradients(block: torch.nn.Module, x: torch.Tensor, mesh, tp: int) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    out = block(x.chunk(tp, dim=1)[rank].clone() if mesh is not None else x)
    if mesh is not None:  # the block's output is this rank's sequence shard
        out = DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()
    (out ** 2).sum().backward()
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in block.named_parameters()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workaround", choices=("on", "off"), default="off")
    parser.add_argument("--cases", default="selective,full", help="recompute modes, comma-separated")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    recompute_and_compile.TP_COMPILE_WORKAROUND = args.workaround == "on"
    config = Qwen2Config(**{**Qwen2Config.from_preset("tiny").to_dict(), "name": "tiny"})
    spec = parallel_spec(config)
    torch.manual_seed(0)
    reference = Qwen2Block(config)
    x = torch.randn(2, 8, config.hidden_size)
    expected = gradients(copy.deepcopy(reference), x, None, tp)
    worst = 0.0
    for mode in args.cases.split(","):
        torch._dynamo.reset()
        block = copy.deepcopy(reference)
        parallelize_module(block, mesh, block_plan(spec, sequence_parallel=True))
        blocks = torch.nn.ModuleDict({"0": block})
        recompute_and_compile.apply_activation_checkpointing(blocks, mode, "op", spec.block_attention)
        recompute_and_compile.compile_blocks(blocks, parts=spec.block_norm_consumers)
        got = gradients(block, x, mesh, tp)
        errors = {n: float((got[n] - g).abs().max() / g.abs().max()) for n, g in expected.items()}
        name = max(errors, key=errors.get)
        worst = max(worst, errors[name])
        if dist.get_rank() == 0:
            print(f"tp={tp} sequence_parallel recompute={mode} compile workaround={args.workaround}: "
                  f"max relative gradient error {errors[name]:.1e} ({name})", flush=True)
    dist.destroy_process_group()
    return 1 if worst > 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main())
