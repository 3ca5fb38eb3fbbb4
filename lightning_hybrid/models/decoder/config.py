"""The decoder core's configuration: one dataclass for every family it computes, and the facts derived from it.

A family (``model_type``, Hugging Face's name: ``qwen2``, ``llama``, ``qwen3``, ``mistral``, ``qwen3_moe``) is a set of
traits of one pre-norm decoder (grouped-query attention with RoPE, SwiGLU MLP, RMSNorm): q/k/v biases (Qwen2), an
RMSNorm on each head of q and k before RoPE (Qwen3), a rope scaling (``llama3``, ``yarn``), mixtures of experts in
place of the MLP (Qwen3-MoE, :mod:`.moe_config`). Field names are Hugging Face's, so a
``config.json`` maps onto :class:`DecoderConfig` field by field (:mod:`.hf_config` reads and writes one).

The facts the strategy, the planner, the throughput monitor and the Hugging Face adapter need are written here once:
the tensors of a block with their shapes and TP split dims (:func:`block_tensor_shapes`), model FLOPs per token from
the parameters a token uses (:func:`flops_per_token`, :func:`active_parameters`) and the declared parallel structure
(:func:`parallel_spec`). None of them builds a model, and this module imports no torch (the planner reads it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lightning_hybrid.models.decoder.families import FAMILIES, ROPE_TYPES, Family, RopeScaling
from lightning_hybrid.models.decoder.moe_config import (
    EXPERT_TENSORS,
    MOE_FIELDS,
    experts_tensor_shapes,
    inactive_expert_parameters,
    is_sparse_layer,
    moe_to_dict,
    resolve_moe_fields,
)
from lightning_hybrid.models.decoder.presets import PRESETS
from lightning_hybrid.models.spec import ParallelSpec

__all__ = ["DecoderConfig", "RopeScaling", "Family", "FAMILIES", "ROPE_TYPES", "PRESETS", "BLOCK_TENSORS",
           "block_tensor_shapes", "block_matmul_params", "flops_per_token", "parallel_spec", "active_parameters",
           "MOE_FIELDS"]


# The tensors of one decoder block (names within ``layers.N.``), in the Hugging Face files' order; the q/k/v biases
# exist only with ``attention_bias`` (Qwen2), the q/k norms only in families with ``qk_norm`` (Qwen3).
BLOCK_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
    *EXPERT_TENSORS,  # a mixture-of-experts layer's router and experts in place of the dense MLP (Qwen3-MoE)
)


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes and family of a decoder the core computes (Qwen2 / Qwen2.5, Llama 3.x, Qwen3 dense, Mistral, Qwen3-MoE).

    Args:
        vocab_size: number of token ids.
        hidden_size: model width.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: number of decoder blocks.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention); must divide ``num_attention_heads``.
        max_position_embeddings: longest sequence the model is meant for.
        rope_theta: rotary base frequency.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: share the input embedding with the LM head.
        initializer_range: standard deviation of the normal initialization of linear and embedding weights.
        attention_bias: q/k/v projections carry a bias; ``None`` takes the family's (Qwen2: true, the others false).
            A Qwen2-family config may turn it off (a Llama-shaped decoder); the other families have none (their
            Hugging Face ``attention_bias`` would also put one on the output projection).
        name: preset name, for messages and checkpoint manifests.
        model_type: the family, Hugging Face's name (a key of :data:`FAMILIES`).
        head_dim: width of one attention head; ``None``: ``hidden_size / num_attention_heads`` (Qwen3 and Llama 3.2
            give it explicitly).
        rope_scaling: a :class:`RopeScaling` (or its dict); ``None``: plain RoPE.
        num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, router_aux_loss_coef,
            mlp_only_layers, decoder_sparse_step: a mixture of experts (``model_type="qwen3_moe"``), as in
            ``transformers``' ``Qwen3MoeConfig`` (its defaults where ``None``); see :mod:`.moe_config`. A dense
            family leaves them unset.
        router_bias_update_rate: auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the
            routing scores for the top-k choice only, moved by this rate after each optimizer step towards the
            step's mean load (no gradient); 0 (the default): no bias.

    Raises:
        ValueError: a size that is not a positive integer, heads that do not divide, an odd ``head_dim``, an
            unknown family, a bias the family does not have, or a bad rope scaling (one line each).
    """

    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_bias: Optional[bool] = None
    name: str = "custom"
    model_type: str = "qwen2"
    head_dim: Optional[int] = None
    rope_scaling: Optional[RopeScaling] = None
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: Optional[bool] = None
    router_aux_loss_coef: Optional[float] = None
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    router_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; use one of {', '.join(FAMILIES)}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecoderConfig.{field}={value!r} must be a positive integer")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                                 f"num_attention_heads={self.num_attention_heads}; give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim <= 0 \
                or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even integer (RoPE turns pairs of "
                             f"dimensions)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads={self.num_key_value_heads}")
        family = FAMILIES[self.model_type]
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", family.attention_bias)
        elif self.attention_bias and not family.attention_bias:
            raise ValueError(f"attention_bias=True is not supported for model_type={self.model_type!r} (its "
                             f"Hugging Face model would also put a bias on o_proj); set it to false")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", _rope_from_dict(self.rope_scaling, self.max_position_embeddings))
        moe = resolve_moe_fields({k: getattr(self, k) for k in MOE_FIELDS}, self.model_type, family.experts,
                                 self.num_hidden_layers)
        for key, value in moe.items():
            object.__setattr__(self, key, value)

    @property
    def family(self) -> Family:
        """The traits of this config's ``model_type``."""
        return FAMILIES[self.model_type]

    @property
    def qk_norm(self) -> bool:
        """q and k get an RMSNorm per head before RoPE (Qwen3)."""
        return self.family.qk_norm

    def mlp_kind(self, layer: int) -> str:
        """The MLP of block ``layer``: ``"experts"`` for the sparse layers of a mixture-of-experts family (see
        :func:`~.moe_config.is_sparse_layer`), ``"dense"`` (SwiGLU) otherwise."""
        return "experts" if is_sparse_layer(self, layer) else "dense"

    @property
    def has_experts(self) -> bool:
        """Whether some block is a mixture of experts."""
        return any(self.mlp_kind(i) == "experts" for i in range(self.num_hidden_layers))

    @classmethod
    def from_preset(cls, name: str) -> "DecoderConfig":
        """The published sizes of a model (``qwen2.5-72b``, ``llama3.1-70b``, ``qwen3-32b``, ...) or a debug size.

        Raises:
            ValueError: the name is not a known preset.
        """
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
        return cls(**PRESETS[key], name=key)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DecoderConfig":
        """Build from a dict with Hugging Face field names; keys this class does not use are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def resolve(cls, model: Union[str, "DecoderConfig", dict[str, Any]]) -> "DecoderConfig":
        """A config from a preset name, a config, a dict of fields, a folder with a ``config.json`` or a Hub repo id.

        Raises:
            ValueError: none of these, or a ``config.json`` this core does not compute exactly.
            FileNotFoundError: a repo id that is neither cached nor reachable.
        """
        if isinstance(model, cls):
            return model
        if isinstance(model, dict):
            return cls.from_dict(model)
        if isinstance(model, str) and model.lower() in PRESETS:
            return cls.from_preset(model)
        if isinstance(model, (str, Path)) and Path(model, "config.json").is_file():
            return cls.from_hf(model)  # every family, both config.json layouts, unsupported fields refused
        if isinstance(model, str) and not Path(model).expanduser().exists():
            from lightning_hybrid.hub import is_repo_id

            if is_repo_id(model):  # a Hub repo id: its config.json through the Hub cache
                return cls.from_hf(model)
        raise ValueError(f"unknown model {model!r}; use a preset ({', '.join(PRESETS)}), a DecoderConfig, "
                         f"a folder with a config.json or a Hugging Face repo id")

    @classmethod
    def from_hf(cls, path: Union[str, Path]) -> "DecoderConfig":
        """Read a Hugging Face ``config.json`` (a folder holding one, the file itself, or a Hub repo id); see
        :func:`~lightning_hybrid.models.decoder.hf_config.read_hf_config`.

        Raises:
            FileNotFoundError: no ``config.json`` there.
            ValueError: the config describes something this core does not compute exactly, named in one line.
        """
        from lightning_hybrid.models.decoder.hf_config import read_hf_config

        return cls.from_dict(read_hf_config(path))

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, leaving out those at the value a Qwen2 config had before they existed
        (``model_type`` qwen2, q/k/v biases on, ``head_dim`` derived, no rope scaling), so Qwen2 checkpoint manifests
        read exactly as before; :meth:`from_dict` gives the same config back."""
        values = dataclasses.asdict(self)
        if self.attention_bias:
            del values["attention_bias"]
        if self.model_type == "qwen2":
            del values["model_type"]
        if self.head_dim * self.num_attention_heads == self.hidden_size:
            del values["head_dim"]
        if self.rope_scaling is None:
            del values["rope_scaling"]
        else:
            values["rope_scaling"] = self.rope_scaling.to_dict()
        return moe_to_dict(values, self.family.experts)

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Parameter count computed from the shapes (matches the published safetensors files); a mixture of experts
        counts every expert (:func:`active_parameters` counts those a token uses)."""
        total = self.hidden_size  # final norm
        for layer in range(self.num_hidden_layers):
            total += sum(math.prod(shape) for shape, _ in block_tensor_shapes(self, layer).values())
        if include_embedding:
            total += self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return total

    def block_parameters(self) -> int:
        """Parameters of one decoder block (the mean over the blocks where dense and sparse blocks mix)."""
        return (self.num_parameters(include_embedding=False) - self.hidden_size) // self.num_hidden_layers


def _rope_from_dict(values: dict[str, Any], max_position_embeddings: int) -> Optional[RopeScaling]:
    """A :class:`RopeScaling` from Hugging Face's dict (``type`` or ``rope_type``; yarn's original length defaults to
    ``max_position_embeddings`` as in ``transformers``)."""
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    kind = values.get("rope_type", values.get("type"))
    args = {k: v for k, v in values.items() if k in fields and k != "rope_type" and v is not None}
    if kind == "yarn":
        args.setdefault("original_max_position_embeddings", max_position_embeddings)
    return RopeScaling(rope_type=kind, **args)


def block_tensor_shapes(config: DecoderConfig, layer: int = 0) -> dict[str, tuple[tuple[int, ...], Optional[int]]]:
    """Name within block ``layer`` -> (global shape, dim that tensor parallelism splits or ``None``), for every tensor.

    Colwise projections (q, k, v, gate, up) split their output rows (dim 0, biases too), rowwise ones
    (o, down) their input columns (dim 1); norms are replicated (the q/k norms act on one head each, and every TP rank
    holds whole heads). Without ``attention_bias`` the q/k/v biases are absent, without ``qk_norm`` the q/k norms. A
    sparse block (:meth:`DecoderConfig.mlp_kind` ``"experts"``) holds the router and the experts
    (:func:`~.moe_config.experts_tensor_shapes`, not split by TP) in place of the dense MLP's three matrices.
    """
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[tuple[int, ...], Optional[int]]] = {
        "self_attn.q_proj.weight": ((q, h), 0), "self_attn.q_proj.bias": ((q,), 0),
        "self_attn.k_proj.weight": ((kv, h), 0), "self_attn.k_proj.bias": ((kv,), 0),
        "self_attn.v_proj.weight": ((kv, h), 0), "self_attn.v_proj.bias": ((kv,), 0),
        "self_attn.o_proj.weight": ((h, q), 1),
        "self_attn.q_norm.weight": ((d,), None), "self_attn.k_norm.weight": ((d,), None),
        "mlp.gate_proj.weight": ((inter, h), 0), "mlp.up_proj.weight": ((inter, h), 0),
        "mlp.down_proj.weight": ((h, inter), 1),
        "input_layernorm.weight": ((h,), None), "post_attention_layernorm.weight": ((h,), None),
    }
    absent = set()
    if not config.attention_bias:
        absent |= {name for name in shapes if name.endswith("_proj.bias")}
    if not config.qk_norm:
        absent |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    if config.mlp_kind(layer) == "experts":
        absent |= {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
        shapes.update(experts_tensor_shapes(config))
    return {name: shapes[name] for name in BLOCK_TENSORS if name in shapes and name not in absent}


def block_matmul_params(config: DecoderConfig, layer: int = 0) -> int:
    """Matmul weights one token uses in block ``layer``: q and o are ``h x hq``, k and v ``h x hkv`` (GQA); a dense
    SwiGLU's three ``h x I``, or in a sparse block the router's ``h x num_experts`` and the three ``h x
    moe_intermediate_size`` of each of its ``num_experts_per_tok`` experts (the active ones only)."""
    h = config.hidden_size
    hq, hkv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    if getattr(config, "mlp_kind", None) is not None and config.mlp_kind(layer) == "experts":
        mlp = h * config.num_experts + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
    else:
        mlp = 3 * h * config.intermediate_size
    return 2 * h * hq + 2 * h * hkv + mlp


def active_parameters(config: DecoderConfig, include_embedding: bool = True) -> int:
    """Parameters one token uses: :meth:`DecoderConfig.num_parameters` less the experts it is not routed to (the
    "active" count of a mixture-of-experts model card: Qwen3-30B-A3B 3.3B of 30.5B); every parameter of a dense
    model. Torch-free, for the planner and the throughput monitor."""
    return config.num_parameters(include_embedding) - inactive_expert_parameters(config)


def flops_per_token(config: Any, seq_len: int, include_head: bool = True) -> float:
    """Model FLOPs (forward + backward) per trained token of the decoder, from the matmul weights a token uses.

    ``6 * sum over layers of (2 * h * hq + 2 * h * hkv + M_l)  +  6 * h * V  +  12 * L * hq * T`` with
    ``L`` layers, width ``h``, query width ``hq = heads * head_dim`` (``head_dim`` as configured, which need not be
    ``h / heads``: Qwen3's 32B has ``hq = 8192`` at ``h = 5120``), key/value width ``hkv = kv_heads * head_dim``
    (grouped-query attention), vocabulary ``V``, sequence length ``T`` and the MLP of layer ``l``: ``M_l = 3 * h * I``
    for a dense SwiGLU of width ``I`` (gate, up and down), ``h * E + k * 3 * h * I_e`` for a mixture of ``E`` experts
    of width ``I_e`` of which a token uses ``k`` (the router and the active experts: MFU counts active parameters):

    - the first term is ``6 * N`` over the non-embedding matmul weights a token uses (q and o are ``h x hq``, k and v
      ``h x hkv``, :func:`block_matmul_params`); biases and norms, the q/k norms of Qwen3 included, do no matmul and
      are left out (under 0.01% of N);
    - the LM head is counted (``include_head``): it is a real ``h x V`` matmul run for every token,
      tied to the embedding or not (a tied head is counted once, as the matmul it is; the embedding lookup does no
      matmul and is not counted);
    - attention: ``Q K^T`` and ``softmax . V`` cost ``2 * hq * T`` each per token forward, times 3 with
      backward. Every query head attends over all ``T`` keys, so GQA does not shrink it, and the causal
      mask is not halved (the PaLM convention; FlashAttention skips the masked half, so real attention
      work is about half of this term).

    Args:
        config: a :class:`DecoderConfig` (or any object with its size fields and ``head_dim``).
        seq_len: tokens per sequence.
        include_head: count the LM head matmul.

    Raises:
        ValueError: ``seq_len`` is not a positive integer.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    layers = config.num_hidden_layers
    head = config.hidden_size * config.vocab_size if include_head else 0
    hq = config.num_attention_heads * config.head_dim
    matmuls = sum(block_matmul_params(config, layer) for layer in range(layers))
    return float(6 * (matmuls + head) + 12 * layers * hq * seq_len)


def parallel_spec(config: DecoderConfig) -> ParallelSpec:
    """Parts, TP plan and relative costs of a decoder of ``config`` (see :class:`ParallelSpec`)."""
    c = config
    # the mean over the blocks: dense and sparse blocks of a mixture of experts cost differently
    block_matmul = sum(block_matmul_params(c, i) for i in range(c.num_hidden_layers)) / c.num_hidden_layers
    head_matmul = c.hidden_size * c.vocab_size
    return ParallelSpec(
        embedding="embed_tokens",
        blocks="layers",
        norm="norm",
        head="lm_head",
        block_plan={
            "self_attn.q_proj": "colwise",
            "self_attn.k_proj": "colwise",
            "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        },
        block_norms=("input_layernorm", "post_attention_layernorm"),
        block_norm_consumers=("self_attn", "mlp"),
        head_norms=("self_attn.q_norm", "self_attn.k_norm") if c.qk_norm else (),
        block_attention="self_attn",
        attention_core="core",
        fused_projections={"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                           "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj")},
        rotary="rotary",
        block_experts="mlp" if c.has_experts else None,
        ep_divisible={"num_experts": c.num_experts} if c.has_experts else {},
        tp_divisible={"num_attention_heads": c.num_attention_heads,
                      "num_key_value_heads": c.num_key_value_heads},
        block_cost=1.0,
        # Forward + backward of the head is a (hidden x vocab) matmul; the embedding does no matmul but
        # writes a dense (vocab x hidden) gradient and its optimizer update, counted as a third of that.
        head_cost=head_matmul / block_matmul,
        embedding_cost=head_matmul / block_matmul / 3,
    )
