"""The mixture-of-experts configuration (Qwen3-MoE): presets against the model cards, active parameters, FLOPs per
token from the active parameters, the sparse-layer rule and one-line refusals. Pure arithmetic, no torch model."""

from __future__ import annotations

import json
import math

import pytest

from lightning_hybrid.models.decoder.config import (
    DecoderConfig,
    active_parameters,
    block_matmul_params,
    block_tensor_shapes,
    flops_per_token,
)
from lightning_hybrid.models.decoder.hf_config import read_hf_config

# The model cards on the Hugging Face Hub (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): "30.5B in total and 3.3B
# activated", "235B in total and 22B activated".
CARDS = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9)}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_moe_presets_count_the_model_cards_totals_and_active_parameters(name):
    config = DecoderConfig.from_preset(name)
    total, active = CARDS[name]
    assert abs(config.num_parameters() - total) / total < 0.01, config.num_parameters()
    counted = active_parameters(config)
    if name == "qwen3-30b-a3b":
        # 3,353,032,704 counted: the card's "3.3B" is truncated to one decimal (rounded it would read 3.4B), so the
        # count lies in [3.3B, 3.4B); within 1% it is not (1.6% above).
        assert 3.3e9 <= counted < 3.4e9, counted
    else:
        assert abs(counted - active) / active < 0.01, counted
    # The total is exactly what the published safetensors hold for the 30B (its index's total_size / 2 bytes).
    if name == "qwen3-30b-a3b":
        assert config.num_parameters() == 30_532_122_624


def test_active_parameters_leave_out_exactly_the_experts_a_token_does_not_use():
    config = DecoderConfig.from_preset("tiny-moe")  # 8 experts, 2 per token, layer 1 dense
    sparse = [i for i in range(config.num_hidden_layers) if config.mlp_kind(i) == "experts"]
    assert sparse == [0, 2, 3]
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    assert config.num_parameters() - active_parameters(config) == len(sparse) * 6 * per_expert
    dense = DecoderConfig.from_preset("qwen3-32b")
    assert active_parameters(dense) == dense.num_parameters()


def test_flops_per_token_count_the_active_matmuls_of_each_layer():
    config = DecoderConfig.from_preset("tiny-moe")
    h, d = config.hidden_size, config.head_dim
    attention = 2 * h * 4 * d + 2 * h * 2 * d
    assert block_matmul_params(config, 1) == attention + 3 * h * 176
    assert block_matmul_params(config, 0) == attention + h * 8 + 2 * 3 * h * 32
    seq = 32
    expected = 6 * (3 * block_matmul_params(config, 0) + block_matmul_params(config, 1) + h * 256) \
        + 12 * 4 * 4 * d * seq
    assert flops_per_token(config, seq) == expected
    big = DecoderConfig.from_preset("qwen3-30b-a3b")
    # 6 x the active parameters less the embedding lookup (norms are < 0.01%), plus attention's 12 L hq T
    matmuls = active_parameters(big) - big.vocab_size * big.hidden_size
    attention = 12 * 48 * 32 * 128 * 4096
    assert flops_per_token(big, 4096) == pytest.approx(6 * matmuls + attention, rel=1e-4)


def test_sparse_layer_rule_follows_transformers():
    config = DecoderConfig(**{**DecoderConfig.from_preset("tiny-moe").to_dict(), "mlp_only_layers": [],
                              "decoder_sparse_step": 2})
    assert [config.mlp_kind(i) for i in range(4)] == ["dense", "experts", "dense", "experts"]
    shapes = block_tensor_shapes(config, 1)
    assert shapes["mlp.experts.gate_up_proj"] == ((8, 64, 64), None)
    assert shapes["mlp.experts.down_proj"] == ((8, 64, 32), None)
    assert shapes["mlp.gate.weight"] == ((8, 64), None)
    assert "mlp.gate_proj.weight" not in shapes and "mlp.gate_proj.weight" in block_tensor_shapes(config, 0)
    with_layers = sum(math.prod(s) for i in range(4) for s, _ in block_tensor_shapes(config, i).values())
    assert config.num_parameters(include_embedding=False) == with_layers + config.hidden_size


def test_moe_configs_round_trip_and_dense_configs_keep_their_keys():
    for name in ("tiny-moe", "qwen3-30b-a3b", "qwen3-235b-a22b"):
        config = DecoderConfig.from_preset(name)
        assert DecoderConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert "num_experts" not in DecoderConfig.from_preset("qwen3-32b").to_dict()


def test_a_transformers_5_config_json_is_read_with_num_local_experts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "mlp_only_layers": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}))
    config = DecoderConfig.from_dict(read_hf_config(tmp_path))
    assert (config.num_experts, config.num_experts_per_tok, config.mlp_only_layers) == (4, 2, ())
    assert config.router_aux_loss_coef == 0.001  # transformers' default where the file leaves it out


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="qwen3", num_experts=8),
     "num_experts=8 is a mixture-of-experts field; model_type='qwen3' is dense"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds num_experts=8; use at most 8"),
    (dict(num_experts=0), "num_experts=0 must be a positive integer"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers names layer 4; the model has layers 0 to 3"),
    (dict(router_bias_update_rate=-1.0), "router_bias_update_rate=-1.0 must be a number >= 0"),
    (dict(router_aux_loss_coef="x"), "router_aux_loss_coef='x' must be a number >= 0"),
])
def test_bad_moe_fields_are_refused_in_one_line(fields, message):
    values = {**DecoderConfig.from_preset("tiny-moe").to_dict(), **fields}
    if values["model_type"] != "qwen3_moe":
        values = {k: v for k, v in values.items() if k in ("model_type", "num_experts") or k not in
                  ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
                   "mlp_only_layers", "decoder_sparse_step", "router_bias_update_rate")}
    with pytest.raises(ValueError) as err:
        DecoderConfig(**values)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
