"""Qwen2 / Qwen2.5 configuration with the published presets.

Field names are Hugging Face's, so a ``config.json`` maps one to one onto :class:`Qwen2Config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["Qwen2Config", "PRESETS"]


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
        understood. A repo id is resolved with :func:`lightning_hybrid.checkpoint.hf.resolve_hf_path`.

        Raises:
            FileNotFoundError: no ``config.json`` there.
            ValueError: the config describes something this Qwen2 implementation does not compute
                (another ``model_type``, sliding-window attention, rope scaling, an activation other than silu).
        """
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        elif not file.exists() and isinstance(path, str) and path.count("/") == 1:
            from lightning_hybrid.checkpoint.hf import resolve_hf_path  # lazy: needs huggingface_hub

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
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
            if key in fields:
                fields[key] = float(fields[key])
        fields["name"] = str(path)
        return cls.from_dict(fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Parameter count computed from the shapes (matches the published safetensors files)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k and v (+bias), o
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
}
