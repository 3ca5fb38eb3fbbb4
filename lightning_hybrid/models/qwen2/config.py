"""Qwen2 / Qwen2.5 configuration: the presets, and every fact derived from the sizes alone.

Field names are Hugging Face's, so a ``config.json`` maps one to one onto :class:`Qwen2Config`. The
facts the strategy, the planner, the throughput monitor and the Hugging Face adapter all need are
written here once: the tensors of a block with their shapes and TP split dims
(:func:`block_tensor_shapes`), model FLOPs per token (:func:`flops_per_token`) and the declared
parallel structure (:func:`parallel_spec`). None of them builds a model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lightning_hybrid.models.spec import ParallelSpec

__all__ = ["Qwen2Config", "PRESETS", "BLOCK_TENSORS", "block_tensor_shapes", "block_matmul_params",
           "flops_per_token", "parallel_spec"]

# The tensors of one decoder block (names within ``layers.N.``), in the Hugging Face files' order; the q/k/v biases
# exist only with ``attention_bias`` (Qwen2), not in Llama-shaped configs.
BLOCK_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


@dataclass(frozen=True)
class Qwen2Config:
    """Sizes of a Qwen2-architecture decoder.

    Args:
        vocab_size: number of token ids.
        hidden_size: model width.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: number of decoder blocks.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention); must divide ``num_attention_heads``.
        max_position_embeddings: longest sequence the rotary table is meant for.
        rope_theta: rotary base frequency.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: share the input embedding with the LM head.
        initializer_range: standard deviation of the normal initialization of linear and embedding weights.
        attention_bias: q/k/v projections carry a bias (Qwen2: true; Llama: false, Hugging Face's ``attention_bias``).
            The output projection and the MLP never have one.
        name: preset name, for messages and checkpoints manifests.
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
    attention_bias: bool = True
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen2Config.{field}={value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str) -> "Qwen2Config":
        """The published sizes of a Qwen2.5 model (``qwen2.5-72b``, ...) or the ``tiny`` debug size.

        Raises:
            ValueError: the name is not a known preset.
        """
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
        return cls(**PRESETS[key], name=key)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Qwen2Config":
        """Build from a dict with Hugging Face field names; keys this class does not use are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def resolve(cls, model: Union[str, "Qwen2Config", dict[str, Any]]) -> "Qwen2Config":
        """A config from a preset name, a config, a dict of fields or a path to a ``config.json``."""
        if isinstance(model, cls):
            return model
        if isinstance(model, dict):
            return cls.from_dict(model)
        if isinstance(model, str) and model.lower() in PRESETS:
            return cls.from_preset(model)
        if isinstance(model, (str, Path)) and Path(model, "config.json").is_file():
            return cls.from_hf(model)  # every Qwen2 field, both config.json layouts, unsupported ones refused
        raise ValueError(f"unknown model {model!r}; use a preset ({', '.join(PRESETS)}), a Qwen2Config "
                         f"or a folder with a config.json")

    @classmethod
    def from_hf(cls, path: Union[str, Path]) -> "Qwen2Config":
        """Read a Hugging Face ``config.json`` (a folder holding one, the file itself, or a Hub repo id).

        Both the classic layout (``rope_theta``, ``rope_scaling``) and the newer ``rope_parameters`` are
        understood. A repo id is resolved with :func:`lightning_hybrid.hub.resolve_hf_path`.

        Raises:
            FileNotFoundError: no ``config.json`` there.
            ValueError: the config describes something this Qwen2 implementation does not compute
                (another ``model_type``, sliding-window attention, rope scaling, an activation other than silu).
        """
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        elif not file.exists() and isinstance(path, str) and path.count("/") == 1:
            from lightning_hybrid.hub import resolve_hf_path  # lazy: needs huggingface_hub

            file = resolve_hf_path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}; pass a Hugging Face model folder or repo id")
        values = json.loads(file.read_text())
        where = str(file)
        model_type = values.get("model_type", "qwen2")
        if model_type != "qwen2":
            raise ValueError(f"{where}: model_type={model_type!r} is not supported; only 'qwen2' (Qwen2 / Qwen2.5) is")
        if values.get("use_sliding_window", False):
            raise ValueError(f"{where}: use_sliding_window=true is not supported (only full attention is "
                             f"implemented); set it to false")
        layer_types = set(values.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(f"{where}: layer_types {sorted(layer_types)} are not supported; only full_attention is")
        hidden_act = values.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{where}: hidden_act={hidden_act!r} is not supported; only 'silu' is")
        rope = dict(values.get("rope_parameters") or {})
        scaling = values.get("rope_scaling") or {}
        rope_types = {t for t in (rope.get("rope_type"), scaling.get("rope_type"), scaling.get("type")) if t}
        rope_type = next(iter(sorted(rope_types - {"default"})), "default")
        if rope_type != "default":
            raise ValueError(f"{where}: rope scaling type {rope_type!r} is not implemented; only plain RoPE "
                             f"('default') is; remove rope_scaling to train at the native context length")
        fields = dict(values)
        fields.pop("attention_bias", None)  # Hugging Face's Qwen2 always has q/k/v biases, whatever the file says
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
            if key in fields:
                fields[key] = float(fields[key])
        fields["name"] = str(path)
        return cls.from_dict(fields)

    def to_dict(self) -> dict[str, Any]:
        """The fields by name; ``attention_bias`` only when false (Llama-shaped), so Qwen2 configs, checkpoint
        manifests and exported ``config.json`` files read exactly as before the field existed."""
        values = dataclasses.asdict(self)
        if self.attention_bias:
            del values["attention_bias"]
        return values

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Parameter count computed from the shapes (matches the published safetensors files)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        bias = 1 if self.attention_bias else 0
        attention = h * h + bias * h + 2 * (h * kv + bias * kv) + h * h  # q (+bias), k and v (+bias), o
        mlp = 3 * h * self.intermediate_size
        block = attention + mlp + 2 * h  # two RMSNorm weights
        total = self.num_hidden_layers * block + h  # final norm
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def block_parameters(self) -> int:
        """Parameters of one decoder block."""
        return (self.num_parameters(include_embedding=False) - self.hidden_size) // self.num_hidden_layers


_QWEN25_COMMON = dict(rope_theta=1000000.0)
# Llama 3 (Meta's params.json / Hugging Face config.json of Meta-Llama-3-8B, -70B and Llama-3.1-405B; "The Llama 3
# Herd of Models", table 3): a Qwen2-shaped decoder without q/k/v biases, 128,256-token vocabulary, untied head,
# rope_theta 500,000, 8 key-value heads. max_position_embeddings is the 8,192-token pre-training context: Llama 3.1's
# 131,072 needs its "llama3" rope scaling, which this implementation does not compute.
_LLAMA3_COMMON = dict(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)

PRESETS: dict[str, dict[str, Any]] = {
    # A debug size: 4 blocks, width 64, GQA 4:2, a byte-level vocabulary. Trains in seconds on a CPU.
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, **_QWEN25_COMMON),
    "qwen2.5-14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, **_QWEN25_COMMON),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, **_QWEN25_COMMON),
    "qwen2.5-72b": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, **_QWEN25_COMMON),
    # Llama 3 / 3.1 sizes; published totals 8.03B, 70.6B and 405.9B parameters (tests/test_model.py checks them).
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      **_LLAMA3_COMMON),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       **_LLAMA3_COMMON),
    "llama3-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                        **_LLAMA3_COMMON),
}


def block_tensor_shapes(config: Qwen2Config) -> dict[str, tuple[tuple[int, ...], Optional[int]]]:
    """Name within a block -> (global shape, dim that tensor parallelism splits or ``None``), for every tensor.

    Colwise projections (q, k, v, gate, up) split their output rows (dim 0, biases too), rowwise ones
    (o, down) their input columns (dim 1); norms are replicated. Without ``attention_bias`` the q/k/v biases
    are absent.
    """
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[tuple[int, ...], Optional[int]]] = {
        "self_attn.q_proj.weight": ((q, h), 0), "self_attn.q_proj.bias": ((q,), 0),
        "self_attn.k_proj.weight": ((kv, h), 0), "self_attn.k_proj.bias": ((kv,), 0),
        "self_attn.v_proj.weight": ((kv, h), 0), "self_attn.v_proj.bias": ((kv,), 0),
        "self_attn.o_proj.weight": ((h, q), 1),
        "mlp.gate_proj.weight": ((inter, h), 0), "mlp.up_proj.weight": ((inter, h), 0),
        "mlp.down_proj.weight": ((h, inter), 1),
        "input_layernorm.weight": ((h,), None), "post_attention_layernorm.weight": ((h,), None),
    }
    if not config.attention_bias:
        shapes = {name: shape for name, shape in shapes.items() if not name.endswith("_proj.bias")}
    return {name: shapes[name] for name in BLOCK_TENSORS if name in shapes}


def block_matmul_params(config: Qwen2Config) -> int:
    """Matmul weights of one block: q and o are ``h x hq``, k and v ``h x hkv`` (GQA), SwiGLU's three ``h x I``."""
    h = config.hidden_size
    hq, hkv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return 2 * h * hq + 2 * h * hkv + 3 * h * config.intermediate_size


def flops_per_token(config: Any, seq_len: int, include_head: bool = True) -> float:
    """Model FLOPs (forward + backward) per trained token of a Qwen2-shaped decoder.

    ``6 * L * (2 * h * hq + 2 * h * hkv + 3 * h * I)  +  6 * h * V  +  12 * L * hq * T`` with
    ``L`` layers, width ``h``, query width ``hq = heads * head_dim``, key/value width
    ``hkv = kv_heads * head_dim`` (grouped-query attention), SwiGLU width ``I`` (gate, up and down:
    3 matrices), vocabulary ``V`` and sequence length ``T``:

    - the first term is ``6 * N`` over the non-embedding matmul weights (q and o are ``h x hq``, k and v
      ``h x hkv``); biases and norms do no matmul and are left out (under 0.01% of N);
    - the LM head is counted (``include_head``): it is a real ``h x V`` matmul run for every token,
      tied to the embedding or not. The embedding lookup does no matmul and is not counted;
    - attention: ``Q K^T`` and ``softmax . V`` cost ``2 * hq * T`` each per token forward, times 3 with
      backward. Every query head attends over all ``T`` keys, so GQA does not shrink it, and the causal
      mask is not halved (the PaLM convention; FlashAttention skips the masked half, so real attention
      work is about half of this term).

    Args:
        config: a :class:`Qwen2Config` (or any object with its size fields).
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
    return float(6 * (layers * block_matmul_params(config) + head) + 12 * layers * hq * seq_len)


def parallel_spec(config: Qwen2Config) -> ParallelSpec:
    """Parts, TP plan and relative costs of a Qwen2 model of ``config`` (see :class:`ParallelSpec`)."""
    c = config
    block_matmul = block_matmul_params(c)
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
        block_attention="self_attn",
        attention_core="core",
        tp_divisible={"num_attention_heads": c.num_attention_heads,
                      "num_key_value_heads": c.num_key_value_heads},
        block_cost=1.0,
        # Forward + backward of the head is a (hidden x vocab) matmul; the embedding does no matmul but
        # writes a dense (vocab x hidden) gradient and its optimizer update, counted as a third of that.
        head_cost=head_matmul / block_matmul,
        embedding_cost=head_matmul / block_matmul / 3,
    )
