"""Models that declare their parallel structure: the decoder core (Qwen2, Llama 3.x, Qwen3, Mistral) and its
LightningModule.

The names load on first use (PEP 562): the configs (``lightning_hybrid.models.decoder.config``: sizes, presets, FLOPs)
are read by the planner without torch or Lightning; ``CausalLM``, ``Decoder`` (``Qwen2``) and :func:`from_hf` load
torch when asked for.
"""

from typing import Any

from lightning_hybrid.models.decoder.config import PRESETS, DecoderConfig
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.models.spec import ParallelSpec

__all__ = ["CausalLM", "Decoder", "DecoderConfig", "PRESETS", "ParallelSpec", "Qwen2", "Qwen2Config", "from_hf"]


def from_hf(path_or_repo_id: str) -> Any:
    """The single-device :class:`~lightning_hybrid.models.decoder.model.Decoder` of a Hugging Face checkpoint (a
    local folder or a Hub repo id), with its weights, in fp32 on the CPU; ``config.json``'s ``model_type`` picks the
    family.

    Raises:
        FileNotFoundError: no such folder or repo, or no ``config.json`` or safetensors files in it.
        ValueError: a config this core does not compute exactly, or weights that do not match it (one line).
    """
    from lightning_hybrid.models.decoder.model import Decoder

    return Decoder.from_hf(path_or_repo_id)


def __getattr__(name: str) -> Any:
    if name == "CausalLM":
        from lightning_hybrid.models.causal_lm import CausalLM

        return CausalLM
    if name in ("Qwen2", "Decoder"):
        from lightning_hybrid.models.decoder.model import Decoder

        return Decoder
    raise AttributeError(f"module 'lightning_hybrid.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
