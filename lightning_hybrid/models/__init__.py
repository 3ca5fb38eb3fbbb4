"""Models that declare their parallel structure: the Qwen2 architecture and its LightningModule.

The names load on first use (PEP 562): ``lightning_hybrid.models.qwen2.config`` (sizes, presets, FLOPs) is read by
the planner without torch or Lightning; ``CausalLM`` and ``Qwen2`` load them when asked for.
"""

from typing import Any

from lightning_hybrid.models.qwen2.config import PRESETS, Qwen2Config
from lightning_hybrid.models.spec import ParallelSpec

__all__ = ["CausalLM", "PRESETS", "ParallelSpec", "Qwen2", "Qwen2Config"]


def __getattr__(name: str) -> Any:
    if name == "CausalLM":
        from lightning_hybrid.models.causal_lm import CausalLM

        return CausalLM
    if name == "Qwen2":
        from lightning_hybrid.models.qwen2.model import Qwen2

        return Qwen2
    raise AttributeError(f"module 'lightning_hybrid.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
