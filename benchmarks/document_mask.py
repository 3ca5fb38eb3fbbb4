"""Document-masked attention against per-document attention: exactness and time.

    python benchmarks/document_mask.py --device cuda     # FlexAttention with a document BlockMask (compiled)
    python benchmarks/document_mask.py --device cpu      # SDPA with the block-diagonal causal mask

Packs random documents into rows, runs the model's attention core with ``position_ids`` (forward and backward), and
compares output and input gradients with causal SDPA run on each document alone. Prints one table: the largest
relative errors and the milliseconds of the masked core and of plain causal SDPA over the whole row (what the
row would cost without masking).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lightning_hybrid.models.attention import CausalAttention


def documents(seq_len: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """position_ids (batch, seq_len) of random documents filling each row."""
    rows = []
    for _ in range(batch):
        positions, left = [], seq_len
        while left:
            n = min(left, int(torch.randint(1, max(2, seq_len // 3), (1,), generator=generator)))
            positions.append(torch.arange(n))
            left -= n
        rows.append(torch.cat(positions))
    return torch.stack(rows)


def per_document(q, k, v, position_ids):
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        starts = (position_ids[b] == 0).nonzero().flatten().tolist() + [q.shape[2]]
        for s, e in zip(starts[:-1], starts[1:]):
            kk = k[b:b + 1, :, s:e].repeat_interleave(groups, 1)
            vv = v[b:b + 1, :, s:e].repeat_interleave(groups, 1)
            out[b:b + 1, :, s:e] = F.scaled_dot_product_attention(q[b:b + 1, :, s:e], kk, vv, is_causal=True)
    return out


def timed(fn, repeats: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 4096 on CUDA, 256 on CPU")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = args.device
    seq = args.seq_len or (4096 if device == "cuda" else 256)
    g = torch.Generator().manual_seed(0)
    position_ids = documents(seq, args.batch, g).to(device)
    shape = (args.batch, args.heads, seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, seq, args.head_dim)
    q, k, v = (torch.randn(s, generator=g).to(device).requires_grad_() for s in (shape, kv_shape, kv_shape))
    core = CausalAttention()
    out = core(q, k, v, position_ids=position_ids)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = per_document(q, k, v, position_ids)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    out, ref = out.detach(), ref.detach()
    out_err = float((out - ref).norm() / ref.norm())
    grad_err = max(float((a - b).norm() / b.norm()) for a, b in zip(grads, ref_grads))
    masked_ms = timed(lambda: core(q, k, v, position_ids=position_ids).sum().backward(), args.repeats, device)
    causal_ms = timed(lambda: core(q, k, v).sum().backward(), args.repeats, device)
    path = "FlexAttention + document BlockMask" if device == "cuda" else "SDPA + block-diagonal causal mask"
    print("| device | path | seq | docs/row | output rel. err | grad rel. err | masked fwd+bwd ms "
          "| causal fwd+bwd ms |")
    print(f"| {device} | {path} | {seq} | {float((position_ids == 0).sum()) / args.batch:.1f} | {out_err:.2e} | "
          f"{grad_err:.2e} | {masked_ms:.2f} | {causal_ms:.2f} |")
    return 0 if out_err < 1e-4 and grad_err < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
