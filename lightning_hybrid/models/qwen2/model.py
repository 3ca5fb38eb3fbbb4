"""The Qwen2 / Qwen2.5 decoder: grouped-query attention with rotary embeddings, SwiGLU MLP, RMSNorm.

Single-device code: parallelism is applied from outside (see :meth:`Qwen2.parallel_spec`). The
forward pass skips a part that is ``None``, which is how a pipeline stage holds only its slice.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.models.attention import CausalAttention
from lightning_hybrid.models.qwen2.config import Qwen2Config, parallel_spec
from lightning_hybrid.models.spec import IGNORE_INDEX, ParallelSpec

__all__ = ["Qwen2", "Qwen2Block", "parameter_init", "RMSNorm", "rotary_tables", "rotary_at", "apply_rotary",
           "IGNORE_INDEX"]


def parameter_init(config: Qwen2Config, name: str) -> tuple[str, float]:
    """How the Qwen2 parameter ``name`` is initialized: ``("normal", std)``, ``("ones", 0)`` or ``("zeros", 0)``.

    Residual output projections (``o_proj``, ``down_proj``) get std scaled by 1/sqrt(2 * layers), as in
    GPT-2 and torchtitan, so the residual stream does not grow with depth.
    """
    if name.endswith("layernorm.weight") or name == "norm.weight":
        return "ones", 0.0
    if name.endswith(".bias"):
        return "zeros", 0.0
    std = config.initializer_range
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        std = std / math.sqrt(2 * config.num_hidden_layers)
    return "normal", std


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 like the reference implementation."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (seq_len, head_dim) for the half-split rotary layout Qwen2 uses."""
    return rotary_at(torch.arange(seq_len, device=device), head_dim, theta, dtype)


def rotary_at(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (*positions.shape, head_dim) at the given token positions (1-D: global positions;
    (batch, seq): the per-document ``position_ids`` of a packed batch)."""
    device = positions.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim): pairs (i, i + head_dim/2) turn by position * freq_i."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query attention; q/k/v carry a bias (unless ``attention_bias`` is false, as in Llama), the
    output projection does not.

    The number of heads is read from the projection outputs, not from the config, so the same code
    runs on a tensor-parallel shard that holds ``heads / tp`` query and ``kv_heads / tp`` kv heads.
    """

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.rope_theta = config.rope_theta
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        # Causal attention over the local sequence and the tokens' global positions; a strategy may replace it.
        self.core = CausalAttention()

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if position_ids is None:
            cos, sin = rotary_at(self.core.positions(seq, x.device), self.head_dim, self.rope_theta, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = self.core(q, k, v)
        else:  # packed documents: RoPE at each token's position in its document, attention within it
            cos, sin = rotary_at(position_ids, self.head_dim, self.rope_theta, q.dtype)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = self.core(q, k, v, position_ids=position_ids)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        # position_ids goes by keyword: TP's input preparation of the attention module then leaves it alone.
        x = x + self.self_attn(self.input_layernorm(x), position_ids=position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2(nn.Module):
    """Qwen2 causal language model: ``Qwen2(config)(input_ids)`` gives logits (batch, seq, vocab).

    Parameter names are the Hugging Face ones without the ``model.`` prefix
    (``layers.57.mlp.up_proj.weight``); ``layers`` is keyed by the global block index.
    """

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: Optional[nn.Embedding] = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): Qwen2Block(config) for i in range(config.num_hidden_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: Optional[nn.Linear] = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """Logits of ``input_ids`` (or the hidden states a pipeline stage passes on); ``position_ids`` (batch, seq)
        restarting at 0 at each document makes every token attend only within its document."""
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        for block in self.layers.values():
            h = block(h) if position_ids is None else block(h, position_ids=position_ids)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h

    @classmethod
    def from_hf(cls, path: str) -> "Qwen2":
        """A plain single-process model with the weights of a Hugging Face Qwen2 folder or repo id (fp32, CPU).

        For tests, notebooks and inference checks; training loads through ``CausalLM(init_from_hf=...)``.

        Raises:
            ValueError: the config is not supported or the weights do not match it (see
                :func:`lightning_hybrid.checkpoint.hf.load_hf_weights`).
        """
        from lightning_hybrid.hub import resolve_hf_path
        from lightning_hybrid.models.qwen2.hf import load_hf_weights

        folder = resolve_hf_path(path)
        config = Qwen2Config.from_hf(folder)
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device="cpu")
        if config.tie_word_embeddings:  # to_empty breaks the tie; restore it
            model.lm_head.weight = model.embed_tokens.weight
        load_hf_weights(model, folder, config)
        return model

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Number of distinct parameters held by this module (tied weights counted once; works on meta)."""
        seen: dict[int, int] = {}
        for name, p in self.named_parameters():
            if not include_embedding and (name.startswith("embed_tokens.") or name.startswith("lm_head.")):
                continue
            seen[id(p)] = p.numel()
        return sum(seen.values())

    @staticmethod
    def loss_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Sum of next-token cross-entropy over label tokens (``-100`` ignored) and the number of them.

        The caller divides by the token count of the *global* batch, which is how the loss stays the
        mean over all label tokens whatever the mesh and micro-batching.
        """
        loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        return loss, (labels != IGNORE_INDEX).sum()

    def parameter_init(self, name: str) -> tuple[str, float]:
        """How the parameter ``name`` is initialized (see :func:`parameter_init`)."""
        return parameter_init(self.config, name)

    def parallel_spec(self) -> ParallelSpec:
        """Parts, TP plan and relative costs of this model (see :func:`~.config.parallel_spec`)."""
        return parallel_spec(self.config)
