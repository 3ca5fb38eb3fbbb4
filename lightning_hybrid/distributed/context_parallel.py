"""Context parallelism over the ``cp`` mesh dimension: each rank holds a slice of every sequence.

Layout (load balanced for the causal mask, "head-tail" or zigzag): a sequence of length ``S`` is cut into
``2 * cp`` chunks of ``S / (2 * cp)`` tokens and rank ``i`` of the cp group holds chunks ``i`` and
``2 * cp - 1 - i``. Under a causal mask, a query chunk ``j`` attends to ``j + 1`` chunks, so every rank does the
same attention work (``(i + 1) + (2 * cp - i)`` chunk pairs); a contiguous split would leave the last rank
``2 * cp - 1`` times the work of the first.

Attention (:class:`RingAttention`): the K/V blocks of all cp ranks are gathered (the traffic a ring of
send/recv passes, in one collective: on ``cp <= 8`` inside a node the two move the same bytes), then each
rank's queries meet one source block at a time and the partial results are merged with the exact online-softmax
rule (running log-sum-exp), as a ring would as each block arrives. The block loop runs under activation
checkpointing, so a rank keeps only its queries, the gathered K/V and the output per layer, not the
(local x global) score matrices: activation memory per rank falls with cp. The backward of the gather sums each
rank's K/V gradients back to it (reduce-scatter; all-reduce on gloo, which has none).

Everything else in a block is per token, so the model runs unchanged on the local tokens; RoPE takes the global
positions of the local tokens from the same core (:meth:`RingAttention.positions`). FSDP shards over dp x cp
(see :func:`lightning_hybrid.distributed.mesh.build_mesh`), so gradients are averaged over the ranks
that see different tokens, and the loss scaled by the global label-token count stays the global token mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.models.attention import CausalAttention, document_mask, expand_kv_heads
from lightning_hybrid.models.spec import ParallelSpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["sequence_positions", "check_sequence_length", "shard_sequences", "shard_batch", "RingAttention",
           "install_context_parallel"]


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Raise ``ValueError`` unless a sequence of ``seq_len`` tokens splits into ``2 * cp`` equal chunks."""
    if seq_len % (2 * cp):
        fit = seq_len + (-seq_len) % (2 * cp)
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp={2 * cp} (the load-balanced split "
                         f"of cp={cp}); pad or pack sequences to a multiple of {2 * cp} (e.g. {fit}) or change cp")


def sequence_positions(seq_len: int, cp: int, cp_rank: int, device: Optional[torch.device] = None) -> Tensor:
    """Global positions of the tokens that cp rank ``cp_rank`` holds of a sequence of ``seq_len`` tokens.

    Chunks ``cp_rank`` and ``2 * cp - 1 - cp_rank`` of ``2 * cp`` equal chunks, in that order.

    Raises:
        ValueError: ``seq_len`` is not divisible by ``2 * cp``.
    """
    check_sequence_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([head, tail])


def shard_sequences(batch: Any, cp: int, cp_rank: int) -> Any:
    """This cp rank's tokens of every tensor in ``batch`` with a sequence dimension (dim 1 of a tensor of 2 or
    more dims: input ids, labels, masks); other values pass unchanged. ``cp=1`` returns ``batch`` itself.

    Raises:
        ValueError: a sequence length not divisible by ``2 * cp`` (the same on every rank, before any collective).
    """
    if cp == 1:
        return batch
    if isinstance(batch, Tensor):
        if batch.dim() < 2:
            return batch
        return batch.index_select(1, sequence_positions(batch.shape[1], cp, cp_rank, batch.device))
    if isinstance(batch, dict):
        return {key: shard_sequences(value, cp, cp_rank) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_sequences(value, cp, cp_rank) for value in batch)
    return batch


def shard_batch(batch: Any, strategy: Any) -> Any:
    """:func:`shard_sequences` of ``batch`` for the cp coordinate of the strategy's rank (``batch`` itself at cp=1).

    Raises:
        ValueError: a sequence length not divisible by ``2 * cp``, or a batch of ``trainer.predict`` under cp>1
            (each rank would return the logits of its share of every sequence).
    """
    dims: ParallelDims = strategy.dims
    if dims.cp == 1:
        return batch
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    if trainer is not None and trainer.predicting:
        raise ValueError(f"trainer.predict with cp={dims.cp} is not supported (each rank would return the logits of "
                         f"its share of every sequence); predict with cp=1")
    return shard_sequences(batch, dims.cp, dims.coordinates(strategy.global_rank)["cp"])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of (batch, heads, seq, head_dim)); backward sums each rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: "ProcessGroup", world: int, rank: int) -> Tensor:
        import torch.distributed as dist

        ctx.group, ctx.world, ctx.rank = group, world, rank
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        import torch.distributed as dist

        parts = list(grad.contiguous().chunk(ctx.world, dim=2))
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(parts[ctx.rank])
            dist.reduce_scatter(out, [p.contiguous() for p in parts], group=ctx.group)
            return out, None, None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.world, dim=2)[ctx.rank].contiguous(), None, None, None


def _block(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one K/V block: (output normalized within the block, log-sum-exp of its scores).

    A query row that may see nothing of the block gets a log-sum-exp at the dtype's minimum, so its weight in the
    merge is exactly 0 (no ``-inf`` arithmetic, no NaN in the gradients).
    """
    dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 inputs are attended in fp32, as SDPA does
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    scores = torch.where(allowed, scores, torch.finfo(dtype).min)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(dtype))
    return out, lse


def _ring_merge(q: Tensor, k_all: Tensor, v_all: Tensor, q_pos: Tensor, k_pos: Tensor, blocks: int,
                doc_pos: Optional[Tensor] = None) -> Tensor:
    """Causal attention of the local queries over the gathered K/V, one source block at a time, merged online.

    ``doc_pos`` (batch, local seq): the queries' positions in their documents (packed rows); a query then sees
    only keys of its own document (:func:`~lightning_hybrid.models.attention.document_mask`: the rule needs the
    global indices, which the head-tail chunks keep, and the query's own position id).

    K/V heads are repeated for grouped-query attention here, inside the recomputed region, so what is kept for
    backward is the gathered K/V at their own (fewer) heads.
    """
    scale = q.shape[-1] ** -0.5
    k_all, v_all = expand_kv_heads(k_all, v_all, q.shape[1])
    k_blocks, v_blocks, pos_blocks = k_all.chunk(blocks, 2), v_all.chunk(blocks, 2), k_pos.chunk(blocks)
    out: Optional[Tensor] = None
    lse: Optional[Tensor] = None
    for k, v, pos in zip(k_blocks, v_blocks, pos_blocks):
        allowed = q_pos.unsqueeze(1) >= pos.unsqueeze(0) if doc_pos is None else document_mask(doc_pos, q_pos, pos)
        if not bool(allowed.any()):  # a block entirely in this rank's future
            continue
        out_b, lse_b = _block(q, k, v, allowed, scale)
        if out is None or lse is None:
            out, lse = out_b, lse_b
            continue
        merged = torch.logaddexp(lse, lse_b)
        out = out * torch.exp(lse - merged).unsqueeze(-1) + out_b * torch.exp(lse_b - merged).unsqueeze(-1)
        lse = merged
    assert out is not None  # a query always sees its own position
    return out.to(q.dtype)


class RingAttention(CausalAttention):
    """Causal attention over a sequence split across the ``cp`` ranks of ``group`` in the load-balanced layout.

    Exact: the output and gradients equal those of :class:`CausalAttention` on the whole sequence, at the local
    tokens' positions (to fp32 rounding).

    Args:
        group: the cp process group.
        cp: its size.
        cp_rank: this rank's index in it.
    """

    def __init__(self, group: "ProcessGroup", cp: int, cp_rank: int) -> None:
        self.group, self.cp, self.cp_rank = group, cp, cp_rank

    def positions(self, seq_len: int, device: torch.device) -> Tensor:
        """Global positions of this rank's ``seq_len`` local tokens (its two chunks of the whole sequence)."""
        return sequence_positions(seq_len * self.cp, self.cp, self.cp_rank, device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        local = q.shape[2]
        k_all = _GatherSequence.apply(k, self.group, self.cp, self.cp_rank)
        v_all = _GatherSequence.apply(v, self.group, self.cp, self.cp_rank)
        q_pos = self.positions(local, torch.device("cpu"))
        k_pos = torch.cat([sequence_positions(local * self.cp, self.cp, r) for r in range(self.cp)])
        # Recomputed in backward: the (local x global) scores are never kept.
        return checkpoint(_ring_merge, q, k_all, v_all, q_pos.to(q.device), k_pos.to(q.device), self.cp,
                          position_ids, use_reentrant=False)


def install_context_parallel(module: nn.Module, spec: ParallelSpec, group: "ProcessGroup", cp: int,
                             cp_rank: int) -> int:
    """Replace the attention core of every block of ``module`` (a model or pipeline stage) by :class:`RingAttention`.

    Returns:
        The number of blocks changed.
    """
    assert spec.block_attention is not None and spec.attention_core is not None
    blocks = getattr(module, spec.blocks, None) or {}
    for block in blocks.values():
        setattr(getattr(block, spec.block_attention), spec.attention_core, RingAttention(group, cp, cp_rank))
    return len(blocks)
