"""The families of the decoder core (what a ``model_type`` adds to the common decoder) and its rope scalings.

Plain data: no torch (the planner reads the configs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Family", "FAMILIES", "RopeScaling", "ROPE_TYPES"]


@dataclass(frozen=True)
class Family:
    """What a ``model_type`` adds to the common decoder.

    Args:
        architecture: the ``transformers`` class of its checkpoints (written into an exported ``config.json``).
        attention_bias: its q/k/v projections carry a bias (Qwen2; the output projection never does).
        qk_norm: an RMSNorm over ``head_dim`` on each head of q and of k, before RoPE (Qwen3).
        experts: its sparse layers are mixtures of experts (a router and ``num_experts`` SwiGLU experts) in place of
            the dense MLP (Qwen3-MoE).
    """

    architecture: str
    attention_bias: bool = False
    qk_norm: bool = False
    experts: bool = False


FAMILIES: dict[str, Family] = {
    "qwen2": Family("Qwen2ForCausalLM", attention_bias=True),
    "llama": Family("LlamaForCausalLM"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "mistral": Family("MistralForCausalLM"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, experts=True),
}

ROPE_TYPES = ("llama3", "yarn")  # besides plain RoPE ("default"); the others are refused by name


@dataclass(frozen=True)
class RopeScaling:
    """A rope scaling of Hugging Face's ``rope_scaling`` / ``rope_parameters`` (plain RoPE has none).

    ``llama3`` (Llama 3.1+): frequencies whose wavelength exceeds ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``, those below ``... / high_freq_factor`` kept, the band between
    blended. ``yarn`` (YaRN, Qwen2.5's long context): a ramp between interpolated (``/ factor``) and original
    frequencies over the dimensions whose rotation count at ``original_max_position_embeddings`` lies between
    ``beta_slow`` and ``beta_fast``, and cos/sin scaled by ``attention_factor`` (``0.1 ln(factor) + 1`` unless given,
    or the ``mscale`` / ``mscale_all_dim`` ratio). Both as ``transformers`` computes them
    (``modeling_rope_utils``).

    Raises:
        ValueError: another rope type, or a field the type needs is missing or not positive.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not implemented; use one of {', '.join(ROPE_TYPES)} "
                             f"or no rope scaling")
        needed = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                               if self.rope_type == "llama3" else [])
        for name in needed:
            value = getattr(self, name)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"rope scaling {self.rope_type!r} needs {name} > 0, got {name}={value!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope scaling 'llama3' needs high_freq_factor > low_freq_factor, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")

    @property
    def cos_sin_scale(self) -> float:
        """The factor on cos and sin (YaRN's attention factor; 1 for ``llama3``)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim))
        return mscale(self.factor)

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, with Hugging Face's names."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and not (k == "truncate" and v)}
