"""The attention core a model declares, so a strategy can replace it (context parallelism) without the model
knowing about processes.

A block's attention module projects q, k, v and applies rotary embeddings; what follows (causal attention over
the sequence) is a :class:`CausalAttention` held in an attribute that the model names in its
:class:`~lightning_hybrid.models.spec.ParallelSpec` (``attention_core``). The core also answers the *global*
position of each local token (for RoPE): ``0 .. seq_len-1`` here, the positions of the tokens this rank holds
under context parallelism (:class:`lightning_hybrid.distributed.context_parallel.RingAttention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CausalAttention", "expand_kv_heads"]


def expand_kv_heads(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """k and v with each of their heads repeated for the ``heads // kv_heads`` query heads it serves."""
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


class CausalAttention:
    """Causal attention over a sequence this process holds whole.

    ``core(q, k, v)`` takes (batch, heads, seq, head_dim) tensors, k and v with a divisor of q's heads (grouped-query
    attention: each k/v head serves consecutive q heads), and returns the attention output in q's shape;
    ``core.positions(seq_len, device)`` gives the global position of each of the ``seq_len`` local tokens.
    """

    def positions(self, seq_len: int, device: torch.device) -> Tensor:
        """Global positions of the local tokens: ``0 .. seq_len - 1``."""
        return torch.arange(seq_len, device=device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k, v = expand_kv_heads(k, v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
