"""The attention core a model declares, so a strategy can replace it (context parallelism) without the model
knowing about processes.

A block's attention module projects q, k, v and applies rotary embeddings; what follows (causal attention over
the sequence) is a :class:`CausalAttention` held in an attribute that the model names in its
:class:`~lightning_hybrid.models.spec.ParallelSpec` (``attention_core``). The core also answers the *global*
position of each local token (for RoPE): ``0 .. seq_len-1`` here, the positions of the tokens this rank holds
under context parallelism (:class:`lightning_hybrid.distributed.context_parallel.RingAttention`).

Document masking (padding-free packing, the Hugging Face ``DataCollatorWithFlattening`` convention): a batch may
carry ``position_ids`` of shape (batch, seq) that restart at 0 at each document and count up by one inside it.
Then token ``i`` sees token ``j`` only when ``j <= i`` and ``i - j <= position_ids[i]`` (``j`` is not before the
start of ``i``'s document). The rule needs only the query's own position id and the two global token indices, so
it holds unchanged for the sequence shards of context parallelism.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CausalAttention", "expand_kv_heads", "document_mask"]


def expand_kv_heads(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """k and v with each of their heads repeated for the ``heads // kv_heads`` query heads it serves."""
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def document_mask(position_ids: Tensor, q_index: Tensor, k_index: Tensor) -> Tensor:
    """Boolean mask (batch, 1, q, k): query at global index ``q_index`` may see key ``k_index``.

    Args:
        position_ids: (batch, q) position of each query inside its document.
        q_index: (q,) global indices of the queries in the packed row.
        k_index: (k,) global indices of the keys.
    """
    distance = q_index.unsqueeze(1) - k_index.unsqueeze(0)  # (q, k)
    return (distance >= 0) & (distance <= position_ids.unsqueeze(-1)).unsqueeze(1)


def _flex_document_attention(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor) -> Tensor:
    """FlexAttention with a document BlockMask (CUDA): blocks of the mask that are empty are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex, _block_mask_cache
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    # Every block of one forward gets the same position_ids tensor: build its BlockMask once, not once per layer.
    key = (position_ids.data_ptr(), tuple(position_ids.shape), position_ids._version, q.shape[2], k.shape[2])
    if _block_mask_cache is None or _block_mask_cache[0] != key:
        pos = position_ids

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= pos[b, q_idx])

        # _compile: the mask is evaluated block by block, never as a (seq x seq) tensor.
        mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device, _compile=True)
        _block_mask_cache = (key, mask)
    return _compiled_flex(q, k, v, block_mask=_block_mask_cache[1], enable_gqa=k.shape[1] != q.shape[1])


_compiled_flex: Optional[Any] = None
_block_mask_cache: Optional[tuple[Any, Any]] = None


class CausalAttention:
    """Causal attention over a sequence this process holds whole.

    ``core(q, k, v, position_ids=None)`` takes (batch, heads, seq, head_dim) tensors, k and v with a divisor of q's
    heads (grouped-query attention: each k/v head serves consecutive q heads), and returns the attention output in
    q's shape; with ``position_ids`` (batch, seq) each token attends only within its document (see the module
    docstring): SDPA with the block-diagonal causal mask (exact, any device), or FlexAttention with a document
    BlockMask on CUDA when ``flex=True``. ``core.positions(seq_len, device)`` gives the global position of each of
    the ``seq_len`` local tokens.
    """

    flex: bool = True

    def positions(self, seq_len: int, device: torch.device) -> Tensor:
        """Global positions of the local tokens: ``0 .. seq_len - 1``."""
        return torch.arange(seq_len, device=device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        if position_ids is None:
            k, v = expand_kv_heads(k, v, q.shape[1])
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.is_cuda and self.flex:
            return _flex_document_attention(q, k, v, position_ids)
        k, v = expand_kv_heads(k, v, q.shape[1])
        index = self.positions(q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(position_ids, index, index))
