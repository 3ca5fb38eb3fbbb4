"""The Qwen2 / Qwen2.5 names of the decoder core (``Qwen2Config``, ``Qwen2``), kept for existing code.

The config's names are torch-free and load at once; the model's (``Qwen2``, ``Qwen2Block``, ``parameter_init``) load
torch on first use (PEP 562). The general names live in :mod:`lightning_hybrid.models.decoder`.
"""

from typing import Any

from lightning_hybrid.models.qwen2.config import PRESETS, Qwen2Config, flops_per_token, parallel_spec

__all__ = ["PRESETS", "Qwen2", "Qwen2Block", "Qwen2Config", "flops_per_token", "parallel_spec", "parameter_init"]


def __getattr__(name: str) -> Any:
    if name in ("Qwen2", "Qwen2Block", "parameter_init"):
        from lightning_hybrid.models.qwen2 import model

        return getattr(model, name)
    raise AttributeError(f"module 'lightning_hybrid.models.qwen2' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
