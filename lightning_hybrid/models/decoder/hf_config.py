"""Reading a Hugging Face ``config.json``, for every family of the decoder core.

:func:`read_hf_config` turns a ``config.json`` (both layouts ``transformers`` writes: the classic ``rope_theta`` +
``rope_scaling``, and 5.x's ``rope_parameters``) into :class:`~.config.DecoderConfig` fields, and refuses in one line
naming the field and its value whatever this core would not compute exactly (:func:`.hf.hf_config_dict` writes one
back). Plain JSON: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from lightning_hybrid.models.decoder.families import FAMILIES, ROPE_TYPES

__all__ = ["read_hf_config", "config_file", "ATTENTION_BIAS_FIELD", "MLP_BIAS_FIELD", "QWEN_WINDOW"]

# Families whose transformers config has the q/k/v-and-o ``attention_bias`` switch / Llama's ``mlp_bias``.
ATTENTION_BIAS_FIELD = ("llama", "qwen3", "qwen3_moe")
MLP_BIAS_FIELD = ("llama",)
# Families whose transformers config has Qwen's sliding-window switches.
QWEN_WINDOW = ("qwen2", "qwen3", "qwen3_moe")


def config_file(path: Union[str, Path]) -> Path:
    """The ``config.json`` of a folder, the file itself, or a Hub repo id's (resolved through the Hub cache).

    Raises:
        FileNotFoundError: no ``config.json`` there.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    elif not file.exists() and isinstance(path, str) and path.count("/") == 1:
        from lightning_hybrid.hub import resolve_hf_path  # lazy: needs huggingface_hub

        file = resolve_hf_path(path, allow_patterns=("*.json",)) / "config.json"  # the config only, no weights
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {file}; pass a Hugging Face model folder or repo id")
    return file


def read_hf_config(path: Union[str, Path]) -> dict[str, Any]:
    """The :class:`DecoderConfig` fields of a Hugging Face ``config.json`` (``name`` is the path given).

    ``model_type`` picks the family (a file without one is read as ``qwen2``, as before families existed).

    Raises:
        FileNotFoundError: no ``config.json`` there.
        ValueError: another ``model_type``, an activation other than silu, a rope type other than default, llama3
            or yarn, a partial rotary factor, sliding-window attention, or a bias the family's model would put
            where this core has none; one line naming the file, the field and its value.
    """
    file = config_file(path)
    values = json.loads(file.read_text())
    where = str(file)
    model_type = values.get("model_type", "qwen2")
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type={model_type!r} is not supported; use one of {', '.join(FAMILIES)}")
    _check_supported(values, model_type, where)
    fields = dict(values, model_type=model_type, name=str(path))
    if "num_local_experts" in fields:  # transformers 5 writes Qwen3-MoE's num_experts under this name
        fields["num_experts"] = fields.pop("num_local_experts")
    if FAMILIES[model_type].experts and fields.get("mlp_only_layers") is None:
        fields["mlp_only_layers"] = []
    fields.pop("attention_bias", None)  # the family decides (Qwen2: q/k/v biases whatever the file says)
    fields.pop("rope_scaling", None)
    if fields.get("num_key_value_heads") is None:  # transformers' default: multi-head attention
        fields["num_key_value_heads"] = fields.get("num_attention_heads")
    if fields.get("head_dim") is None:
        fields.pop("head_dim", None)
    rope_theta, scaling = _rope(values, where)
    if rope_theta is not None:
        fields["rope_theta"] = rope_theta
    if scaling is not None:
        fields["rope_scaling"] = scaling
    for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
        if key in fields:
            fields[key] = float(fields[key])
    return fields


def _check_supported(values: dict[str, Any], model_type: str, where: str) -> None:
    """One-line refusals of what the family's transformers model would compute and this core does not."""
    hidden_act = values.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act={hidden_act!r} is not supported; only 'silu' is")
    if model_type in ATTENTION_BIAS_FIELD and values.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for model_type={model_type!r} (q/k/v/o "
                         f"biases); only bias-free attention is")
    if model_type in MLP_BIAS_FIELD and values.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported; only a bias-free MLP is")
    if model_type in QWEN_WINDOW and values.get("use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=true is not supported (only full attention is "
                         f"implemented); set it to false")
    if model_type == "mistral" and values.get("sliding_window") is not None:
        raise ValueError(f"{where}: sliding_window={values['sliding_window']!r} is not supported (sliding-window "
                         f"attention is not implemented); set it to null for full attention")
    layer_types = set(values.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"{where}: layer_types {sorted(layer_types)} are not supported; only full_attention is")


def _rope(values: dict[str, Any], where: str) -> tuple[Optional[float], Optional[dict[str, Any]]]:
    """(rope_theta, rope scaling dict or ``None``) from either layout.

    Raises:
        ValueError: per-layer rope parameters, a partial rotary factor, or a rope type not implemented.
    """
    rope = dict(values.get("rope_parameters") or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where}: rope_parameters per layer type ({', '.join(sorted(rope))}) are not supported; "
                         f"only one rope for every layer is")
    scaling = dict(values.get("rope_scaling") or {})
    merged = {**scaling, **rope}
    kinds = {t for t in (rope.get("rope_type"), scaling.get("rope_type"), scaling.get("type")) if t}
    rope_type = next(iter(sorted(kinds - {"default"})), "default")
    if rope_type not in ("default", *ROPE_TYPES):
        raise ValueError(f"{where}: rope scaling type {rope_type!r} is not implemented; use default, "
                         f"{', '.join(ROPE_TYPES)}, or remove rope_scaling to train at the native context length")
    partial = merged.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor={partial!r} is not supported; only 1.0 (RoPE on every "
                         f"dimension) is")
    theta = merged.get("rope_theta", values.get("rope_theta"))
    if rope_type == "default":
        return theta, None
    params = {k: v for k, v in merged.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    params["rope_type"] = rope_type
    if values.get("original_max_position_embeddings") is not None:  # a top-level value wins, as in transformers
        params["original_max_position_embeddings"] = values["original_max_position_embeddings"]
    return theta, params
