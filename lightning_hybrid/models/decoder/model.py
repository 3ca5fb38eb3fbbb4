"""The decoder core: grouped-query attention with rotary embeddings, SwiGLU MLP, RMSNorm, configured per family.

One model for Qwen2 / Qwen2.5 (q/k/v biases), Llama 3.x (llama3 rope scaling), Qwen3 (an RMSNorm on each head of q and
k) and Mistral: the config's family decides which parts a block has (see :class:`~.config.DecoderConfig`).
Single-device code: parallelism is applied from outside (see :meth:`Decoder.parallel_spec`). The forward pass skips
a part that is ``None``, which is how a pipeline stage holds only its slice.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.models.attention import CausalAttention
from lightning_hybrid.models.decoder.config import DecoderConfig, parallel_spec
from lightning_hybrid.models.decoder.moe import MoE
from lightning_hybrid.models.decoder.rope import RotaryTables, apply_rotary, rotary_for
from lightning_hybrid.models.fused import FusedLinear
from lightning_hybrid.models.spec import IGNORE_INDEX, ParallelSpec

__all__ = ["Decoder", "DecoderBlock", "Attention", "MLP", "RMSNorm", "build_mlp", "parameter_init", "IGNORE_INDEX"]


def parameter_init(config: DecoderConfig, name: str) -> tuple[str, float]:
    """How the parameter ``name`` is initialized: ``("normal", std)``, ``("ones", 0)`` or ``("zeros", 0)``.

    Norm scales (block norms, the q/k norms, the final norm) start at one and biases at zero. Residual output
    projections (``o_proj``, ``down_proj``) get std scaled by 1/sqrt(2 * layers), as in GPT-2 and torchtitan, so the
    residual stream does not grow with depth; so do the experts' ``down_proj`` of a mixture of experts (3-D, all
    experts at once), while its router starts at ``std``.
    """
    if name.endswith("norm.weight"):
        return "ones", 0.0
    if name.endswith(".bias"):
        return "zeros", 0.0
    std = config.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        std = std / math.sqrt(2 * config.num_hidden_layers)
    return "normal", std


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale, computed in fp32 like the reference."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; q/k/v carry a bias when the config says so (Qwen2), q and k an
    RMSNorm per head before RoPE when the family has them (Qwen3), the output projection never a bias.

    q, k and v are one GEMM (``qkv``, a :class:`~lightning_hybrid.models.fused.FusedLinear` over the three
    projections, which keep their own parameters and names); ``fused=False`` (or ``qkv`` set to ``None``) runs
    them one by one. The number of heads is read from the projection outputs, not from the config, so the same code
    runs on a tensor-parallel shard that holds ``heads / tp`` query and ``kv_heads / tp`` kv heads.
    """

    def __init__(self, config: DecoderConfig, fused: bool = True) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.qkv: Optional[FusedLinear] = FusedLinear(("q_proj", "k_proj", "v_proj")) if fused else None
        # Per-head norms act on (batch, seq, heads, head_dim): the strategy shards them over the heads dim under TP.
        self.q_norm: Optional[RMSNorm] = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm: Optional[RMSNorm] = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        # Causal attention over the local sequence and the tokens' global positions; a strategy may replace it.
        self.core = CausalAttention()

    def _heads(self, out: Tensor, norm: Optional[RMSNorm]) -> Tensor:
        """(batch, heads, seq, head_dim) of one projection's output, normed per head first when the family norms
        it."""
        batch, seq, _ = out.shape
        out = out.view(batch, seq, -1, self.head_dim)
        if norm is not None:
            out = norm(out)
        return out.transpose(1, 2)

    def _rotary(self, x: Tensor, q: Tensor, position_ids: Optional[Tensor],
                rotary: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """cos and sin for this layer: the model's tables made once per forward, or (``rotary`` not given: this
        module used alone) computed here."""
        if rotary is not None:
            cos, sin = rotary
            return (cos, sin) if cos.dtype == q.dtype else (cos.to(q.dtype), sin.to(q.dtype))
        return rotary_for(x.shape[1], x.device, q.dtype, self.head_dim, self.rope_theta, self.rope_scaling,
                          position_ids, self.core)

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None,
                rotary: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        """Attention of ``x`` (batch, seq, hidden); ``position_ids`` (batch, seq): packed documents (RoPE at each
        token's position in its document, attention within it); ``rotary``: the model's cos and sin tables for
        these positions (:class:`~lightning_hybrid.models.decoder.rope.RotaryTables`)."""
        batch, seq, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv.run(self, x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = self._heads(q, self.q_norm), self._heads(k, self.k_norm), self._heads(v, None)
        cos, sin = self._rotary(x, q, position_ids, rotary)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v) if position_ids is None else self.core(q, k, v, position_ids=position_ids)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases; gate and up are one GEMM (``gate_up``, a
    :class:`~lightning_hybrid.models.fused.FusedLinear`) unless ``fused=False`` (or ``gate_up`` set to ``None``)."""

    def __init__(self, config: DecoderConfig, fused: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up: Optional[FusedLinear] = FusedLinear(("gate_proj", "up_proj")) if fused else None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up.run(self, x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def build_mlp(config: DecoderConfig, layer: int, fused: bool = True) -> nn.Module:
    """The MLP of block ``layer``, by the config's :meth:`~.config.DecoderConfig.mlp_kind`: the dense SwiGLU
    :class:`MLP` (gate and up as one GEMM when ``fused``), or a mixture of experts (:class:`~.moe.MoE`, its experts'
    own grouped GEMMs) in the sparse layers of a Qwen3-MoE.

    Raises:
        ValueError: a kind this core does not build.
    """
    kind = config.mlp_kind(layer)
    if kind == "dense":
        return MLP(config, fused)
    if kind == "experts":
        return MoE(config)
    raise ValueError(f"mlp kind {kind!r} of layer {layer} is not built by this decoder core; use 'dense' or 'experts'")


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.)); ``fused``: q/k/v and gate/up as one GEMM
    each."""

    def __init__(self, config: DecoderConfig, layer: int = 0, fused: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer, fused)

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None,
                rotary: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        # position_ids and rotary go by keyword: TP's input preparation of the attention module leaves them alone.
        x = x + self.self_attn(self.input_layernorm(x), position_ids=position_ids, rotary=rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Causal language model of any family the core computes: ``Decoder(config)(input_ids)`` gives logits
    (batch, seq, vocab).

    Parameter names are the Hugging Face ones without the ``model.`` prefix
    (``layers.57.mlp.up_proj.weight``); ``layers`` is keyed by the global block index. The rotary tables are made
    once per forward (``rotary``, a :class:`~lightning_hybrid.models.decoder.rope.RotaryTables`; set to ``None``,
    each attention layer makes its own). ``fused_projections``: q/k/v and gate/up run as one GEMM each (same
    parameters and names; ``False`` only to measure the difference).
    """

    def __init__(self, config: DecoderConfig, fused_projections: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: Optional[nn.Embedding] = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary: Optional[RotaryTables] = RotaryTables(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleDict({str(i): DecoderBlock(config, i, fused_projections)
                                     for i in range(config.num_hidden_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: Optional[nn.Linear] = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """Logits of ``input_ids`` (or the hidden states a pipeline stage passes on); ``position_ids`` (batch, seq)
        restarting at 0 at each document makes every token attend only within its document."""
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        if self.rotary is not None and len(self.layers) > 0:
            # One table for every block of this model or stage, at the positions its attention core gives.
            core = next(iter(self.layers.values())).self_attn.core
            kwargs["rotary"] = self.rotary(h, position_ids=position_ids, core=core)
        for block in self.layers.values():
            h = block(h, **kwargs)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h

    @classmethod
    def from_hf(cls, path: str) -> "Decoder":
        """A plain single-process model with the weights of a Hugging Face folder or repo id (fp32, CPU); the
        family comes from its ``config.json``.

        For tests, notebooks and inference checks; training loads through ``CausalLM(init_from_hf=...)``.

        Raises:
            ValueError: the config is not supported or the weights do not match it (see
                :func:`lightning_hybrid.models.decoder.hf.load_hf_weights`).
        """
        from lightning_hybrid.hub import resolve_hf_path
        from lightning_hybrid.models.decoder.hf import load_hf_weights

        folder = resolve_hf_path(path)
        config = DecoderConfig.from_hf(folder)
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
