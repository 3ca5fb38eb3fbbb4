"""The mixture-of-experts fields of the decoder core's configuration (Qwen3-MoE), their checks and their arithmetic.

A family with ``experts`` (``qwen3_moe``) replaces the dense SwiGLU MLP of its sparse layers by a router (a linear
layer without bias, ``hidden_size -> num_experts``, softmax, top-``num_experts_per_tok``, renormalized when
``norm_topk_prob``) and ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``. Which layers are sparse:
every ``decoder_sparse_step``-th (``(layer + 1) % decoder_sparse_step == 0``) that is not in ``mlp_only_layers``,
as in ``transformers``' ``Qwen3MoeDecoderLayer``. Field names and defaults are ``transformers``' ``Qwen3MoeConfig``'s;
``router_bias_update_rate`` is ours (DeepSeek-V3's auxiliary-loss-free balancing, docs/moe.md).

The experts of a layer are stored as two 3-D tensors with the experts first (what expert parallelism splits):
``mlp.experts.gate_up_proj`` ``(num_experts, 2 * moe_intermediate_size, hidden_size)`` (gate rows, then up rows) and
``mlp.experts.down_proj`` ``(num_experts, hidden_size, moe_intermediate_size)``, the layout ``transformers`` 5 holds
in memory; the router is ``mlp.gate.weight`` ``(num_experts, hidden_size)``.

Plain data and arithmetic: no torch (the planner reads it).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["MOE_FIELDS", "EXPERT_TENSORS", "ROUTER_TENSOR", "QWEN3_MOE_DEFAULTS", "resolve_moe_fields",
           "is_sparse_layer", "experts_tensor_shapes", "is_expert_tensor", "inactive_expert_parameters",
           "moe_to_dict"]

# The configuration fields of a mixture of experts, in Hugging Face's names (router_bias_update_rate is ours).
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
              "mlp_only_layers", "decoder_sparse_step", "router_bias_update_rate")
# transformers' Qwen3MoeConfig defaults, taken where a config leaves a field out (as transformers does).
QWEN3_MOE_DEFAULTS: dict[str, Any] = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                          norm_topk_prob=False, router_aux_loss_coef=0.001)
ROUTER_TENSOR = "mlp.gate.weight"
# The tensors of a sparse layer that replace the dense MLP's, in the order of the files (names within ``layers.N.``).
EXPERT_TENSORS = (ROUTER_TENSOR, "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# The values a dense config holds in each field (the first is what it gets).
_UNSET: dict[str, tuple[Any, ...]] = {
    "num_experts": (None, 0), "num_experts_per_tok": (None, 0), "moe_intermediate_size": (None, 0),
    "norm_topk_prob": (None,), "router_aux_loss_coef": (None,), "mlp_only_layers": ((), None, []),
    "decoder_sparse_step": (1, None), "router_bias_update_rate": (0.0, None),
}


def is_expert_tensor(name: str) -> bool:
    """Whether the parameter ``name`` holds experts (a leading ``num_experts`` dimension that expert parallelism
    splits): ``layers.N.mlp.experts.gate_up_proj`` and ``...down_proj``."""
    return ".experts." in f".{name}"


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"DecoderConfig.{name}={value!r} must be a positive integer")


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"DecoderConfig.{name}={value!r} must be a number >= 0")
    return float(value)


def resolve_moe_fields(values: dict[str, Any], model_type: str, experts: bool, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a config with the family's defaults filled in, checked.

    Args:
        values: the fields of :data:`MOE_FIELDS` as given (``None`` where not given).
        model_type: the family, for messages.
        experts: whether the family has experts; without, every field must be left unset.
        num_layers: ``num_hidden_layers`` (``mlp_only_layers`` must name existing layers).

    Raises:
        ValueError: a field given to a dense family, or a value out of range (one line each).
    """
    layers = tuple(values.get("mlp_only_layers") or ())
    if not experts:
        given = [k for k in MOE_FIELDS if values.get(k) not in _UNSET[k]]
        if given:
            raise ValueError(f"DecoderConfig.{given[0]}={values[given[0]]!r} is a mixture-of-experts field; "
                             f"model_type={model_type!r} is dense (use model_type='qwen3_moe')")
        return {k: _UNSET[k][0] for k in MOE_FIELDS}
    out = {k: (QWEN3_MOE_DEFAULTS[k] if values.get(k) is None and k in QWEN3_MOE_DEFAULTS else values.get(k))
           for k in MOE_FIELDS}
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        _positive_int(name, out[name])
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise ValueError(f"num_experts_per_tok={out['num_experts_per_tok']} exceeds num_experts={out['num_experts']}; "
                         f"use at most {out['num_experts']}")
    if not isinstance(out["norm_topk_prob"], bool):
        raise ValueError(f"DecoderConfig.norm_topk_prob={out['norm_topk_prob']!r} must be true or false")
    out["router_aux_loss_coef"] = _non_negative("router_aux_loss_coef", out["router_aux_loss_coef"])
    out["router_bias_update_rate"] = _non_negative("router_bias_update_rate", out["router_bias_update_rate"] or 0.0)
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"mlp_only_layers names layer {bad[0]!r}; the model has layers 0 to {num_layers - 1}")
    out["mlp_only_layers"] = tuple(sorted(set(layers)))
    return out


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether block ``layer`` of ``config`` is a mixture of experts (transformers' rule for Qwen3-MoE)."""
    if not config.family.experts:
        return False
    return layer not in config.mlp_only_layers and (layer + 1) % config.decoder_sparse_step == 0


def experts_tensor_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], Optional[int]]]:
    """Name within a sparse block -> (global shape, TP split dim: ``None``, experts are not split by tensor
    parallelism) of the router and the experts."""
    h, inter, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    return {ROUTER_TENSOR: ((e, h), None), "mlp.experts.gate_up_proj": ((e, 2 * inter, h), None),
            "mlp.experts.down_proj": ((e, h, inter), None)}


def inactive_expert_parameters(config: Any) -> int:
    """Expert weights a token does not use: ``(num_experts - num_experts_per_tok) * 3 * hidden * moe_intermediate``
    per sparse layer, summed over the sparse layers (0 for a dense model)."""
    sparse = sum(is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
    if not sparse:
        return 0
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    return sparse * (config.num_experts - config.num_experts_per_tok) * per_expert


def moe_to_dict(values: dict[str, Any], experts: bool) -> dict[str, Any]:
    """``values`` (a config's fields) without the mixture-of-experts fields when the family is dense (its manifests
    and ``config.json`` read as before), with ``mlp_only_layers`` as a list otherwise."""
    if not experts:
        return {k: v for k, v in values.items() if k not in MOE_FIELDS}
    return dict(values, mlp_only_layers=list(values["mlp_only_layers"]))
