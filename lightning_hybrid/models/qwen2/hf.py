"""Hugging Face Qwen2 weights: the decoder core's name table and loading (kept under its first module path).

Every family of the decoder core shares one name table; see :mod:`lightning_hybrid.models.decoder.hf`.
"""

from __future__ import annotations

from lightning_hybrid.models.decoder.hf import (
    ARCHITECTURE_FIELDS,
    HF_NAME_TABLE,
    TOKENIZER_FILES,
    SafetensorsFolder,
    check_hf_folder,
    expected_hf_tensors,
    hf_config_dict,
    hf_to_ours,
    load_hf_weights,
    ours_to_hf,
    read_stats,
)

__all__ = ["HF_NAME_TABLE", "hf_to_ours", "ours_to_hf", "load_hf_weights", "check_hf_folder", "expected_hf_tensors",
           "SafetensorsFolder", "read_stats", "ARCHITECTURE_FIELDS", "TOKENIZER_FILES", "hf_config_dict"]
