"""Context parallelism without a Trainer: ring attention against full attention, and activation memory.

Launched on 4 gloo processes by ``tests/test_context_parallel.py``. Every rank builds the same full inputs, keeps
its load-balanced share of the sequence, and compares the ring's output and gradients with full causal attention
on the whole sequence (cp2: two groups of 2 ranks; cp4: all 4). Then the saved-tensor bytes of one training forward
of a tiny Qwen2 on a long sequence, whole (cp1) and split over cp2. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from helpers.worker_exit import end_worker
from lightning_hybrid.distributed.context_parallel import RingAttention, install_context_parallel, sequence_positions
from lightning_hybrid.models.attention import CausalAttention


def full_inputs(seq: int, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    shapes = [(2, heads, seq, dim), (2, kv_heads, seq, dim), (2, kv_heads, seq, dim), (2, heads, seq, dim)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def attention_errors(group, cp: int, cp_rank: int, seq: int) -> dict[str, float]:
    """Max abs error of the ring's output and q/k/v gradients at this rank's tokens, vs full attention."""
    q, k, v, grad_out = full_inputs(seq)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_full = CausalAttention()(*full)
    out_full.backward(grad_out)
    idx = sequence_positions(seq, cp, cp_rank)
    local = [t.index_select(2, idx).clone().requires_grad_() for t in (q, k, v)]
    out = RingAttention(group, cp, cp_rank)(*local)
    out.backward(grad_out.index_select(2, idx))
    errors = {"out": (out - out_full.index_select(2, idx)).abs().max().item()}
    for name, mine, ref in zip("qkv", local, full):
        errors[f"grad_{name}"] = (mine.grad - ref.grad.index_select(2, idx)).abs().max().item()
    errors["positions"] = idx.tolist()
    return errors


def saved_bytes(cp: int, group, cp_rank: int, seq: int) -> int:
    """Bytes of the distinct tensors autograd keeps for backward over one forward of a tiny Qwen2 on ``seq`` tokens."""
    from lightning_hybrid.models import Qwen2, Qwen2Config

    config = Qwen2Config(**dict(Qwen2Config.from_preset("tiny").to_dict(), name="tiny", num_hidden_layers=2))
    torch.manual_seed(0)
    model = Qwen2(config)
    if cp > 1:
        install_context_parallel(model, model.parallel_spec(), group, cp, cp_rank)
    ids = torch.randint(0, config.vocab_size, (1, seq))
    if cp > 1:
        ids = ids.index_select(1, sequence_positions(seq, cp, cp_rank))
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.dtype)
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
    logits.float().sum().backward()
    return sum(seen.values())


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results: dict = {"cp2": {}, "cp4": {}}
    for seq in (8, 24):  # 24: chunks of 6 (cp2) and 3 (cp4) tokens
        results["cp2"][seq] = attention_errors(pairs[rank // 2], 2, rank % 2, seq)
        results["cp4"][seq] = attention_errors(dist.group.WORLD, 4, rank, seq)
    seq = 1024
    results["bytes_cp1"] = saved_bytes(1, None, 0, seq)
    results["bytes_cp2"] = saved_bytes(2, pairs[rank // 2], rank % 2, seq)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
