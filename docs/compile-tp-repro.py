"""Reproduction: torch.compile + tensor parallelism with sequence parallelism, wrong gradients from a cache hit.

One Qwen2 block (the tiny preset) on tp=2 (gloo, CPU), sequence parallel (torch's ``SequenceParallel`` norms and
``PrepareModuleInput`` all-gather in front of attention and MLP), recompute (none, full or selective op-level) and
attention + MLP compiled with inductor, once per case in one process (``torch._dynamo.reset()`` between cases, so a
later case compiles the same graphs again and AOTAutograd's cache answers). Gradients are compared with the same
block on one process (no TP, eager).

    torchrun --nproc_per_node 2 docs/compile-tp-repro.py --workaround off --cache shared     # torch 2.13: the first
        # case exact (5e-7), every later one wrong (~1.2, post_attention_layernorm.weight): AOTAutograd cache hits
    torchrun --nproc_per_node 2 docs/compile-tp-repro.py --workaround off --cache per-rank   # all exact
    torchrun --nproc_per_node 2 docs/compile-tp-repro.py --workaround on                     # lightning-hybrid: exact

Root cause: ``--workaround off`` compiles each part's call (``nn.Module.compile``), so the ``PrepareModuleInput``
hook's Shard(1) -> Replicate redistribution (the SP all-gather) is traced into the graph, and its backward takes this
rank's chunk of the gradient: the compiled graph depends on the rank. AOTAutograd's cache key of the graph is the
same on both ranks, and the ranks share inductor's cache folder (``/tmp/torchinductor_<user>`` by default), so a
rank's second compile loads whichever rank's entry the cache finds: the other rank's chunk flows into the norm in
front (the gradients of the weights inside the graph stay right). Recompute plays no part (``--cases none,none``
fails the same way). ``--cache per-rank`` gives each rank's graphs cache keys of their own in the shared folder
(what ``compile_blocks`` does in a distributed job); ``--workaround on`` (the part's ``forward`` compiled, the TP
hooks eager at the graph boundary, donated buffers off) keeps the rank out of the graph. Prints one line per case;
rank 0 exits 1 if any case is wrong (relative gradient error > 1e-4). Use a new ``TORCHINDUCTOR_CACHE_DIR`` to start
from an empty cache.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
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
    parser.add_argument("--cache", choices=("shared", "per-rank"), default="shared",
                        help="cache keys: torch's default (the same on every rank) or each rank's own")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    recompute_and_compile.TP_COMPILE_WORKAROUND = args.workaround == "on"
    recompute_and_compile.RANK_COMPILE_CACHE_KEYS = args.cache == "per-rank"
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
        counters.clear()
        got = gradients(block, x, mesh, tp)
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        errors = {n: float((got[n] - g).abs().max() / g.abs().max()) for n, g in expected.items()}
        name = max(errors, key=errors.get)
        worst = max(worst, errors[name])
        if dist.get_rank() == 0:
            print(f"tp={tp} sequence_parallel recompute={mode} compile workaround={args.workaround} "
                  f"cache={args.cache} (AOTAutograd cache hits {hits}): "
                  f"max relative gradient error {errors[name]:.1e} ({name})", flush=True)
    dist.destroy_process_group()
    return 1 if worst > 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main())
