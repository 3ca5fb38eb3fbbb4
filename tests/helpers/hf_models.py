"""Tiny random Hugging Face models of every family the decoder core computes, built with ``transformers``' own classes.

Each case is the shape of a tiny preset (``tiny``, ``tiny-llama``, ``tiny-qwen3``, ``tiny-mistral``; vocabulary 256,
width 64, 4 blocks, GQA 4:2) with its family's traits: Llama with the ``llama3`` rope scaling of a 64-token original
context (so a 16-token sequence uses scaled frequencies), Qwen3 with an explicit ``head_dim`` of 32 (not 64 / 4) and
q/k norms, Qwen2 with YaRN. Biases and every norm scale are perturbed away from their zero/one initialization, so a
wrong name mapping or a missing norm shows in the logits. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import torch

__all__ = ["SHAPE", "CASES", "build_hf_model", "save_hf_model", "hf_logits", "write_checkpoint", "offline_hub_cache",
           "train_steps"]

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1)
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# case -> (transformers class, config fields besides SHAPE); the case's name minus a ``-...`` suffix is its family
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6)),
    "qwen2-yarn": ("Qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 32}, rms_norm_eps=1e-6)),
    "llama": ("Llama", dict(rope_parameters=_LLAMA3, rms_norm_eps=1e-5)),
    "qwen3": ("Qwen3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, head_dim=32,
                            rms_norm_eps=1e-6)),
    "mistral": ("Mistral", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=None,
                                rms_norm_eps=1e-5)),
}


def build_hf_model(case: str, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    """A random ``transformers`` ``<Family>ForCausalLM`` of ``case`` (fp32, eval mode), biases and norms perturbed."""
    import transformers

    prefix, fields = CASES[case]
    config = getattr(transformers, f"{prefix}Config")(**SHAPE, **fields, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(case: str, folder: Path, tie: bool = False, seed: int = 0) -> Path:
    """:func:`build_hf_model` saved with ``save_pretrained`` into ``folder``."""
    build_hf_model(case, tie, seed).save_pretrained(folder)
    return folder


def hf_logits(folder_or_model: Union[str, Path, torch.nn.Module], inputs: torch.Tensor) -> torch.Tensor:
    """``transformers``' logits of ``inputs`` (a folder is loaded with ``AutoModelForCausalLM`` in fp32)."""
    from transformers import AutoModelForCausalLM

    model = folder_or_model
    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(inputs).logits


def write_checkpoint(model: torch.nn.Module, folder: Path, init_from_hf: Union[str, Path, None]) -> None:
    """A checkpoint folder in the layout of lightning_hybrid.checkpoint.dcp (model state under "model", meta.json)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optimizer_0": {"state.step": torch.tensor(2.0)}},
                 checkpoint_id=str(folder), no_dist=True)
    meta = {"model_config": model.config.to_dict(), "hparams": {"init_from_hf": str(init_from_hf)}}
    (folder / "meta.json").write_text(json.dumps(meta))


def offline_hub_cache(folder: Path, cache: Path, monkeypatch: Any, repo_id: str) -> Path:
    """``folder`` as the only snapshot of ``repo_id`` in a Hub cache at ``cache``, with the Hub offline (the
    ``monkeypatch`` undoes it); returns the snapshot folder."""
    import shutil

    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return repo / "snapshots" / commit


def train_steps(model: torch.nn.Module, seq: int, steps: int = 2) -> None:
    """A few AdamW steps (lr 1e-2) of ``model`` on fixed random tokens, so that an exported model differs from the
    one it was imported from."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (4, seq + 1), generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        total, count = model.loss_sum(model(tokens[:, :-1]), tokens[:, 1:])
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad()
