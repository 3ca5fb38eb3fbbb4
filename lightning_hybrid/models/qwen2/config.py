"""Qwen2 / Qwen2.5 configuration: the decoder core's config under its first name (kept for existing code).

:class:`Qwen2Config` is :class:`~lightning_hybrid.models.decoder.config.DecoderConfig`: its ``model_type`` defaults to
``qwen2``, and the same class configures Llama 3.x, Qwen3 and Mistral (``model_type="llama"``, ...). Every name this
module had is the decoder core's own.
"""

from __future__ import annotations

from lightning_hybrid.models.decoder.config import (
    BLOCK_TENSORS,
    PRESETS,
    DecoderConfig,
    block_matmul_params,
    block_tensor_shapes,
    flops_per_token,
    parallel_spec,
)

__all__ = ["Qwen2Config", "PRESETS", "BLOCK_TENSORS", "block_tensor_shapes", "block_matmul_params",
           "flops_per_token", "parallel_spec"]

Qwen2Config = DecoderConfig
