"""Qwen3-MoE against ``transformers``' own ``Qwen3MoeForCausalLM``: logits, the load-balancing loss and its
gradient, both expert layouts of a checkpoint, and ``export-hf`` back. One process, tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.hf_models import train_steps, write_checkpoint
from lightning_hybrid.checkpoint.export import export_main
from lightning_hybrid.models import CausalLM, DecoderConfig, from_hf
from lightning_hybrid.models.decoder.moe import MoE

SEQ = 16
RTOL = 1e-5
# A tiny Qwen3-MoE: 8 experts of width 32, 2 per token, layer 1 a dense MLP (so both kinds of block are read).
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=176, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, router_aux_loss_coef=0.02, mlp_only_layers=[1], max_position_embeddings=1024,
             initializer_range=0.1, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def build_hf(seed: int = 0, **fields) -> torch.nn.Module:
    """A random ``Qwen3MoeForCausalLM`` (fp32, eval mode), norm scales perturbed away from one."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**SHAPE, **fields})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_fused(model: torch.nn.Module, folder: Path) -> Path:
    """``model`` saved in ``transformers`` 5's in-memory layout: its ``state_dict`` as is (3-D experts)."""
    from safetensors.torch import save_file

    model.save_pretrained(folder)  # config.json (and per-expert weights, replaced below)
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[torch.nn.Module, Path, Path]:
    """(the transformers model, its save_pretrained folder (per expert), the fused-layout folder)."""
    root = tmp_path_factory.mktemp("moe")
    model = build_hf()
    model.save_pretrained(root / "hub")
    return model, root / "hub", save_fused(model, root / "fused")


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(3))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _reference(model: torch.nn.Module, inputs: torch.Tensor):
    with torch.no_grad():
        return model(inputs, output_router_logits=True)


def test_save_pretrained_writes_one_tensor_per_expert_and_the_fused_folder_3d_experts(hub):
    from safetensors import safe_open

    _, per_expert, fused = hub
    with safe_open(str(per_expert / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.2.mlp.experts.gate_up_proj").get_shape() == [8, 64, 64]


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_from_hf_logits_equal_transformers_in_both_expert_layouts(hub, inputs, layout):
    reference, per_expert, fused = hub
    model = from_hf(str(per_expert if layout == "per-expert" else fused))
    assert model.config.model_type == "qwen3_moe" and model.config.mlp_kind(1) == "dense"
    assert isinstance(model.layers["0"].mlp, MoE) and not isinstance(model.layers["1"].mlp, MoE)
    with torch.no_grad():
        ours = model(inputs)
    expected = _reference(reference, inputs).logits
    assert expected.std() > 0.1
    assert _relative(ours, expected) < RTOL, _relative(ours, expected)


def test_each_layers_balancing_loss_equals_transformers_load_balancing_loss_func(hub, inputs):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    reference, per_expert, _ = hub
    model = from_hf(str(per_expert))
    with torch.no_grad():
        model(inputs)
    router_logits = _reference(reference, inputs).router_logits  # one per sparse layer: 0 and 2
    for logits, layer in zip(router_logits, ("0", "2")):
        expected = load_balancing_loss_func((logits,), 8, 2)
        assert float(model.layers[layer].mlp.last_aux_loss) == pytest.approx(float(expected), rel=1e-6)


def test_with_one_sparse_layer_the_loss_and_its_gradient_equal_transformers(tmp_path, inputs):
    """transformers pools all layers' statistics into one product; with one sparse layer that is this layer's loss,
    and the gradients of ``lm loss + coef * aux`` (ours injected in backward) equal transformers' own."""
    reference = build_hf(seed=1, num_hidden_layers=2, mlp_only_layers=[0]).train()
    reference.save_pretrained(tmp_path / "one")
    model = from_hf(str(tmp_path / "one")).train()
    labels = torch.randint(0, 256, inputs.shape, generator=torch.Generator().manual_seed(4))
    out = reference(inputs, labels=labels, output_router_logits=True)
    out.loss.backward()
    # transformers shifts the labels itself; ours are given shifted
    logits = model(inputs)
    total, count = model.loss_sum(logits[:, :-1], labels[:, 1:])
    (total / count).backward()
    assert float(model.layers["1"].mlp.last_aux_loss) == pytest.approx(float(out.aux_loss), rel=1e-6)
    hf_params = dict(reference.named_parameters())
    for name in ("layers.1.mlp.gate.weight", "layers.1.mlp.experts.gate_up_proj", "layers.0.self_attn.q_proj.weight"):
        ours = dict(model.named_parameters())[name].grad
        theirs = hf_params[f"model.{name}"].grad
        assert _relative(ours, theirs) < 1e-5, (name, _relative(ours, theirs))
    # without the injected balancing gradient the router's gradient is off
    model.zero_grad()
    model.layers["1"].mlp.aux_loss_coef = 0.0
    total, count = model.loss_sum(model(inputs)[:, :-1], labels[:, 1:])
    (total / count).backward()
    assert _relative(model.layers["1"].mlp.gate.weight.grad, hf_params["model.layers.1.mlp.gate.weight"].grad) > 1e-3


def test_export_of_a_trained_checkpoint_loads_in_transformers_with_equal_logits(hub, inputs, tmp_path):
    from transformers import AutoModelForCausalLM

    _, per_expert, _ = hub
    model = from_hf(str(per_expert)).train()
    train_steps(model, SEQ)  # the load-balancing gradient included
    model.eval()
    with torch.no_grad():
        trained = model(inputs)
    write_checkpoint(model, tmp_path / "ckpt", per_expert)
    out = tmp_path / "export"
    assert export_main([str(tmp_path / "ckpt"), str(out), "--dtype", "fp32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8
    assert DecoderConfig.from_hf(out) == DecoderConfig.from_dict({**model.config.to_dict(), "name": str(out)})
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert _relative(loaded(inputs).logits, trained) < RTOL
    with torch.no_grad():
        assert _relative(trained, from_hf(str(per_expert))(inputs)) > 1e-3  # the steps moved it


def test_causal_lm_loads_a_qwen3_moe_folder_with_its_weights(hub, inputs):
    reference, per_expert, _ = hub
    module = CausalLM(str(per_expert), init_from_hf=str(per_expert))
    assert module.config.num_experts == 8 and module.config.mlp_only_layers == (1,)
    module.configure_model()
    with torch.no_grad():
        assert _relative(module(inputs), _reference(reference, inputs).logits) < RTOL
