"""The decoder core: one model configured per family (``qwen2``, ``llama``, ``qwen3``, ``mistral``).

``config`` (sizes, families, presets, FLOPs, block shapes, parallel structure) and ``hf_config`` (reading a Hugging
Face ``config.json``) are torch-free and load at once; the model's names (``Decoder``, ``DecoderBlock``,
``parameter_init``) load torch on first use (PEP 562). ``hf`` holds the weight name map and loading in and out.
"""

from typing import Any

from lightning_hybrid.models.decoder.config import (
    FAMILIES,
    PRESETS,
    DecoderConfig,
    RopeScaling,
    flops_per_token,
    parallel_spec,
)

__all__ = ["FAMILIES", "PRESETS", "Decoder", "DecoderBlock", "DecoderConfig", "RopeScaling", "flops_per_token",
           "parallel_spec", "parameter_init"]


def __getattr__(name: str) -> Any:
    if name in ("Decoder", "DecoderBlock", "parameter_init"):
        from lightning_hybrid.models.decoder import model

        return getattr(model, name)
    raise AttributeError(f"module 'lightning_hybrid.models.decoder' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
