"""Models that declare their parallel structure: the Qwen2 architecture and its LightningModule."""

from lightning_hybrid.models.causal_lm import CausalLM
from lightning_hybrid.models.qwen2.config import PRESETS, Qwen2Config
from lightning_hybrid.models.qwen2.model import Qwen2
from lightning_hybrid.models.spec import ParallelSpec

__all__ = ["CausalLM", "PRESETS", "ParallelSpec", "Qwen2", "Qwen2Config"]
