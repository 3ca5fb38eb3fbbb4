"""Every family of the decoder core against ``transformers``' own model: logits, rope scalings, export, sizes, FLOPs.

Tiny random models are built with ``transformers``' classes (``LlamaForCausalLM`` with the llama3 rope scaling,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` with YaRN; :mod:`helpers.hf_models`), saved with
``save_pretrained`` and loaded with :func:`lightning_hybrid.models.from_hf`. One process; the same math on a mesh is
in ``tests/test_equivalence_families.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.hf_models import CASES, hf_logits, offline_hub_cache, save_hf_model, train_steps, write_checkpoint
from lightning_hybrid.checkpoint.export import export_main
from lightning_hybrid.models import CausalLM, Decoder, DecoderConfig, from_hf
from lightning_hybrid.models.decoder.config import RopeScaling, flops_per_token
from lightning_hybrid.models.decoder.rope import inverse_frequencies

SEQ = 16
RTOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """``<case>`` and ``<case>-tied`` folders of every case, saved by ``transformers``."""
    root = tmp_path_factory.mktemp("families")
    found = {}
    for case in CASES:
        for tie in (False, True):
            name = f"{case}-tied" if tie else case
            found[name] = save_hf_model(case, root / name, tie=tie, seed=len(found))
    return found


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(3))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", [f"{c}{t}" for c in CASES for t in ("", "-tied")])
def test_from_hf_logits_equal_transformers(folders, inputs, case):
    model = from_hf(str(folders[case]))
    family = CASES[case.removesuffix("-tied")][0].lower()
    assert model.config.model_type == family
    assert model.config.tie_word_embeddings == case.endswith("-tied")
    if case.endswith("-tied"):
        assert model.lm_head.weight is model.embed_tokens.weight
    with torch.no_grad():
        ours = model(inputs)
    reference = hf_logits(folders[case], inputs)
    assert reference.std() > 0.1  # logits large enough that 1e-5 means something
    assert _relative(ours, reference) < RTOL, _relative(ours, reference)


@pytest.mark.parametrize("case, part", [("llama", "rope_scaling"), ("qwen2-yarn", "rope_scaling"),
                                        ("qwen3", "qk_norm")])
def test_the_parity_depends_on_each_family_trait(folders, inputs, case, part):
    """The parity test can fail: without its rope scaling (or Qwen3 without its q/k norms) the model is off."""
    model = from_hf(str(folders[case]))
    if part == "rope_scaling":  # the tables made once per forward, and the layers' own
        model.rotary.scaling = None
        for block in model.layers.values():
            block.self_attn.rope_scaling = None
    else:
        for block in model.layers.values():
            block.self_attn.q_norm = block.self_attn.k_norm = None
    with torch.no_grad():
        assert _relative(model(inputs), hf_logits(folders[case], inputs)) > 1e-3


@pytest.mark.parametrize("case", ["llama", "qwen2-yarn"])
def test_both_config_layouts_give_the_same_config(folders, case, tmp_path):
    """transformers 5.x writes ``rope_parameters``; 4.x wrote ``rope_theta`` + ``rope_scaling`` (``type`` or
    ``rope_type``): all read alike."""
    values = json.loads((folders[case] / "config.json").read_text())
    assert "rope_parameters" in values and "rope_scaling" not in values
    rope = dict(values.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    for key in ("rope_type", "type"):
        folder = tmp_path / key
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**values, "rope_theta": theta,
                                                        "rope_scaling": {**rope, key: kind}}))
        classic, new = DecoderConfig.from_hf(folder), DecoderConfig.from_hf(folders[case])
        assert classic.rope_scaling == new.rope_scaling and classic.rope_theta == new.rope_theta == theta
        assert classic.rope_scaling.rope_type == kind


@pytest.mark.parametrize("rope", [
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),     # Llama 3.1
    dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),     # Llama 3.2
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),  # Qwen2.5's long context
    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
         mscale=1.0, mscale_all_dim=0.707),          # the mscale ratio
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4096, attention_factor=1.5, truncate=False),
])
@pytest.mark.parametrize("head_dim, theta", [(128, 500000.0), (64, 1000000.0)])
def test_rope_scaling_frequencies_equal_transformers_at_published_sizes(rope, head_dim, theta):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=head_dim * 32, num_attention_heads=32, head_dim=head_dim,
                     max_position_embeddings=131072, rope_parameters={**rope, "rope_theta": theta})
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    scaling = RopeScaling(**rope)
    assert torch.equal(inverse_frequencies(head_dim, theta, scaling=scaling), expected)
    assert scaling.cos_sin_scale == pytest.approx(attention_factor, rel=1e-12)
    assert not torch.equal(inverse_frequencies(head_dim, theta), expected)  # the scaling changes something


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("case", ["llama", "qwen3", "qwen3-tied", "mistral", "qwen2-yarn"])
def test_export_of_a_trained_checkpoint_loads_in_transformers_with_equal_logits(folders, inputs, tmp_path, case):
    model = from_hf(str(folders[case]))
    train_steps(model, SEQ)
    with torch.no_grad():
        trained = model(inputs)
    assert _relative(trained, hf_logits(folders[case], inputs)) > 1e-3  # the steps moved the model
    write_checkpoint(model, tmp_path / "ckpt", folders[case])
    out = tmp_path / "export"
    assert export_main([str(tmp_path / "ckpt"), str(out), "--dtype", "fp32"]) == 0
    config = json.loads((out / "config.json").read_text())
    family = CASES[case.removesuffix("-tied")][0]
    assert config["architectures"] == [f"{family}ForCausalLM"] and config["model_type"] == family.lower()
    assert DecoderConfig.from_hf(out) == DecoderConfig.from_dict({**model.config.to_dict(), "name": str(out)})
    assert _relative(hf_logits(out, inputs), trained) < RTOL


# ---------------------------------------------------------------------------------------------- configs


def test_causal_lm_builds_the_family_of_a_config_json_and_loads_its_weights(folders, inputs):
    module = CausalLM(str(folders["qwen3"]), init_from_hf=str(folders["qwen3"]))
    assert module.config.model_type == "qwen3" and module.config.head_dim == 32 and module.config.qk_norm
    module.configure_model()
    with torch.no_grad():
        assert _relative(module(inputs), hf_logits(folders["qwen3"], inputs)) < RTOL
    assert CausalLM("tiny-llama").config.rope_scaling.rope_type == "llama3"


def test_a_repo_id_is_resolved_to_its_config_from_the_offline_cache(folders, tmp_path, monkeypatch):
    offline_hub_cache(folders["llama"], tmp_path, monkeypatch, "org/tiny-llama")
    expected = DecoderConfig.from_dict({**DecoderConfig.from_hf(folders["llama"]).to_dict(), "name": "org/tiny-llama"})
    assert CausalLM("org/tiny-llama").config == expected


def _write_config(folder: Path, values: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def test_configs_the_core_cannot_compute_are_refused_in_one_line_naming_the_field(folders, tmp_path):
    values = {name: json.loads((folders[name] / "config.json").read_text()) for name in ("llama", "qwen3", "mistral")}
    cases = {
        "model_type='gpt_neox' is not supported; use one of qwen2, llama, qwen3, mistral":
            {**values["llama"], "model_type": "gpt_neox"},
        "hidden_act='gelu' is not supported; only 'silu' is": {**values["qwen3"], "hidden_act": "gelu"},
        "rope scaling type 'longrope' is not implemented": {**values["llama"], "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
        "sliding_window=4096 is not supported (sliding-window attention is not implemented); set it to null":
            {**values["mistral"], "sliding_window": 4096},
        "use_sliding_window=true is not supported": {**values["qwen3"], "use_sliding_window": True},
        "attention_bias=true is not supported for model_type='llama'": {**values["llama"], "attention_bias": True},
        "mlp_bias=true is not supported": {**values["llama"], "mlp_bias": True},
        "partial_rotary_factor=0.5 is not supported": {**values["mistral"], "partial_rotary_factor": 0.5},
        "layer_types ['full_attention', 'sliding_attention'] are not supported":
            {**values["qwen3"], "layer_types": ["full_attention", "sliding_attention"] * 2},
        "head_dim=15 must be a positive even integer": {**values["qwen3"], "head_dim": 15},
        "hidden_size=64 is not divisible by num_attention_heads=3; give head_dim explicitly":
            {**values["mistral"], "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None},
        "rope scaling 'llama3' needs low_freq_factor > 0": {**values["llama"], "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}},
    }
    for number, (message, config) in enumerate(cases.items()):
        with pytest.raises(ValueError) as err:
            DecoderConfig.from_hf(_write_config(tmp_path / str(number), config))
        assert message in str(err.value) and "\n" not in str(err.value), (message, str(err.value))


def test_every_preset_round_trips_through_its_dict_and_qwen2_dicts_keep_their_keys():
    from lightning_hybrid.models import PRESETS

    for name in PRESETS:
        config = DecoderConfig.from_preset(name)
        assert DecoderConfig.from_dict(config.to_dict()) == config, name
        assert hash(config) == hash(DecoderConfig.from_dict(config.to_dict()))
    legacy = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
              "initializer_range", "name"}
    assert set(DecoderConfig.from_preset("qwen2.5-72b").to_dict()) == legacy  # manifests of Qwen2 runs unchanged
    assert DecoderConfig.from_preset("qwen3-32b").to_dict()["head_dim"] == 128


# ---------------------------------------------------------------------------------------------- sizes and FLOPs

# Published totals (docs/models.md): the model cards on the Hugging Face Hub (Llama 3.2: 1.23B, 3.21B; Qwen3: the total
# and the non-embedding count; Mistral-7B-v0.3: its safetensors' 7.25B) and the Llama 3 report (8.03B, 70.6B,
# 405.9B). A figure agrees within 0.5%, or within its own rounding where the card gives fewer digits (Qwen3's "0.6B",
# "1.4B": half a unit of the last digit).
PUBLISHED = {
    "llama3.1-8b": ("8.03", None), "llama3.1-70b": ("70.6", None), "llama3.1-405b": ("405.9", None),
    "llama3.2-1b": ("1.23", None), "llama3.2-3b": ("3.21", None),
    "qwen3-0.6b": ("0.6", "0.44"), "qwen3-1.7b": ("1.7", "1.4"), "qwen3-4b": ("4.0", "3.6"),
    "qwen3-8b": ("8.2", "6.95"), "qwen3-14b": ("14.8", "13.2"), "qwen3-32b": ("32.8", "31.2"),
    "mistral-7b": ("7.25", None),
}


def _agrees(count: float, published: str) -> bool:
    """``count`` equals the published figure (billions) within 0.5% or within the figure's rounding."""
    value = float(published) * 1e9
    digits = len(published.split(".")[1]) if "." in published else 0
    rounding = 0.5 * 10.0 ** -digits * 1e9
    return abs(count - value) <= max(0.005 * value, rounding)


def test_the_published_figures_check_has_teeth():
    assert _agrees(8.03e9, "8.03") and not _agrees(8.03e9 * 1.006, "8.03") and _agrees(1.449e9, "1.4")
    assert not _agrees(1.46e9, "1.4")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_equal_the_published_totals(name):
    config = DecoderConfig.from_preset(name)
    with torch.device("meta"):
        model = Decoder(config)  # counted from the real module's tensors, without allocating them
    assert model.num_parameters() == config.num_parameters()
    total, non_embedding = PUBLISHED[name]
    assert _agrees(config.num_parameters(), total), config.num_parameters()
    if non_embedding is not None:
        count = config.num_parameters(include_embedding=False)
        assert _agrees(count, non_embedding), count


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "tiny-qwen3", "tiny-mistral"])
@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_equal_the_module_matmuls_counted_by_torch(name, tie):
    from lightning.fabric.utilities.throughput import measure_flops

    config = DecoderConfig(**{**DecoderConfig.from_preset(name).to_dict(), "tie_word_embeddings": tie})
    with torch.device("meta"):
        model = Decoder(config)
        ids = torch.randint(0, config.vocab_size, (2, 32))
    counted = measure_flops(model, lambda: model(ids), lambda logits: logits.float().sum())
    assert counted / ids.numel() == flops_per_token(config, 32)
