"""The Qwen2 / Qwen2.5 decoder: the decoder core's model under its first names (kept for existing code).

:class:`Qwen2` is :class:`~lightning_hybrid.models.decoder.model.Decoder` (any family, chosen by the config's
``model_type``), :class:`Qwen2Block` its block.
"""

from __future__ import annotations

from lightning_hybrid.models.decoder.model import (
    IGNORE_INDEX,
    MLP,
    Attention,
    Decoder,
    DecoderBlock,
    RMSNorm,
    parameter_init,
)
from lightning_hybrid.models.decoder.rope import apply_rotary, rotary_at, rotary_tables

__all__ = ["Qwen2", "Qwen2Block", "parameter_init", "RMSNorm", "rotary_tables", "rotary_at", "apply_rotary",
           "Attention", "MLP", "IGNORE_INDEX"]

Qwen2 = Decoder
Qwen2Block = DecoderBlock
