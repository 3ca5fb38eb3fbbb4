"""The Qwen2 / Qwen2.5 architecture: config and presets, single-device model, Hugging Face adapter."""

from lightning_hybrid.models.qwen2.config import PRESETS, Qwen2Config, flops_per_token, parallel_spec
from lightning_hybrid.models.qwen2.model import Qwen2, Qwen2Block, parameter_init

__all__ = ["PRESETS", "Qwen2", "Qwen2Block", "Qwen2Config", "flops_per_token", "parallel_spec", "parameter_init"]
