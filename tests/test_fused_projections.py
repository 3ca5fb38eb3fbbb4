"""Fused projections (q/k/v and gate/up as one GEMM each) and rotary tables made once per forward (issue #49).

One process: fused equals unfused (fp32, relative error < 1e-6, logits and gradients) for every family, with packed
documents too; the rotary tables made once give bitwise the logits of the tables made in every layer (the code
before), made once per forward; the parameter names stay Hugging Face's; the fused weight is not kept for backward;
float8 runs one GEMM per fused group. A checkpoint written by the code before the change
(``fixtures/pre_fusion_checkpoint``, see ``fixtures/make_pre_fusion_checkpoint.py``) exports to a folder transformers
reads, with the old code's logits.

Four processes, one launch (``fused_worker.py``): fused equals unfused and one process on tp2 x dp2 with FSDP2 and GQA
(4 heads, 2 KV heads), with sequence parallelism and packed documents, and on tp=4 where the KV heads equal tp; the
rotary tables at cp2 x tp2 with sequence parallelism, with and without packed documents; the old checkpoint loaded
at tp2 x dp2, weights and AdamW states bitwise. ``compile=True`` with the fused modules under TP, sequence
parallelism, FSDP2 and recompute is trained against one process by ``tests/test_compile_tp.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.launch import TESTS, launch
from lightning_hybrid.models.decoder.config import DecoderConfig
from lightning_hybrid.models.decoder.model import MLP, Decoder
from lightning_hybrid.models.decoder.moe import MoE
from lightning_hybrid.models.decoder.rope import rotary_at
from lightning_hybrid.models.fused import FusedLinear
from lightning_hybrid.models.spec import ParallelSpec

FIXTURE = TESTS / "fixtures" / "pre_fusion_checkpoint"
EXACT = 1e-6  # fp32: the fused GEMM sums the input gradient in another order than three GEMMs do
FAMILIES = {"qwen2": {}, "llama": {"model_type": "llama"}, "qwen3": {"model_type": "qwen3", "head_dim": 16},
            "llama3-rope": {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 16}},
            # Qwen3-MoE: attention fused in every block, gate/up in the dense block (1); the experts of block 0 keep
            # their own 3-D gate_up_proj (one grouped GEMM already)
            "qwen3-moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 16, "mlp_only_layers": (1,), "router_aux_loss_coef": 0.1}}


def config(**overrides) -> DecoderConfig:
    values = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, name="fused-test")
    return DecoderConfig(**{**values, **overrides})


def model(cfg: DecoderConfig, fused: bool = True) -> Decoder:
    from lightning_hybrid.init_weights import init_parameters

    m = Decoder(cfg, fused_projections=fused)
    init_parameters(m, 0, m.parameter_init)
    with torch.no_grad():  # biases and norms away from their 0 / 1 start, so a dropped one shows
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return m


def inputs(cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(5), torch.arange(11)]).expand(3, 16).contiguous()
    return ids, positions


def forward_backward(m: Decoder, ids: torch.Tensor, positions) -> tuple[torch.Tensor, torch.Tensor]:
    logits = m(ids, positions)
    (logits.float() ** 2).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in m.parameters()])
    return logits.detach(), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ----------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_fused_projections_equal_unfused_on_one_process(family, documents):
    cfg = config(**FAMILIES[family])
    ids, positions = inputs(cfg)
    fused, unfused = model(cfg, True), model(cfg, False)
    dense = [block.mlp for block in fused.layers.values() if isinstance(block.mlp, MLP)]
    assert dense and all(isinstance(mlp.gate_up, FusedLinear) for mlp in dense)
    assert all(isinstance(block.self_attn.qkv, FusedLinear) for block in fused.layers.values())
    assert all(block.self_attn.qkv is None and getattr(block.mlp, "gate_up", None) is None
               for block in unfused.layers.values())
    assert (family == "qwen3-moe") == any(isinstance(block.mlp, MoE) for block in fused.layers.values())
    a = forward_backward(fused, ids, positions if documents else None)
    b = forward_backward(unfused, ids, positions if documents else None)
    assert relative(a[0], b[0]) < EXACT and relative(a[1], b[1]) < EXACT, (relative(a[0], b[0]), relative(a[1], b[1]))


def test_fused_projections_under_autocast_cast_like_autocast():
    """bf16 autocast: the fused GEMM computes in bf16 like autocast's three, the gradients come back in fp32."""
    cfg = config()
    ids, _ = inputs(cfg)
    runs = {}
    for fused in (True, False):
        m = model(cfg, fused)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[fused] = forward_backward(m, ids, None)
        assert runs[fused][0].dtype == torch.bfloat16 and all(p.grad.dtype == torch.float32 for p in m.parameters())
    assert relative(runs[True][0], runs[False][0]) < 1e-2 and relative(runs[True][1], runs[False][1]) < 2e-2


def test_fused_projections_keep_the_hugging_face_parameter_names():
    cfg = config()
    fused, unfused = Decoder(cfg), Decoder(cfg, fused_projections=False)
    assert list(fused.state_dict()) == list(unfused.state_dict())
    assert {n.split(".", 2)[2] for n in fused.state_dict() if n.startswith("layers.")} >= {
        "self_attn.q_proj.weight", "self_attn.k_proj.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight"}


def test_the_fused_weight_is_not_kept_for_backward():
    """What autograd keeps over a forward beside the parameters (which live anyway): the fused model keeps no more
    than the unfused one (the concatenated weight is made again in backward, not held)."""
    def saved_bytes(m: Decoder) -> int:
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(inputs(m.config)[0])
        return sum(seen.values())

    cfg = config(hidden_size=64, intermediate_size=256)
    fused, unfused = saved_bytes(model(cfg, True)), saved_bytes(model(cfg, False))
    assert fused <= unfused, (fused, unfused)


@pytest.mark.parametrize("rope", [None, FAMILIES["llama3-rope"]["rope_scaling"],
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}],
                         ids=["plain", "llama3", "yarn"])
def test_rotary_tables_once_give_bitwise_the_logits_of_tables_per_layer(rope, monkeypatch):
    """The code before made the tables in every attention layer (what each layer still does when the model's
    ``rotary`` is ``None``); the model now makes them once per forward: the same logits and gradients, bitwise, with
    and without packed documents, and ``rotary_at`` runs once per forward instead of once per layer."""
    from lightning_hybrid.models.decoder import rope as rope_module

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return rotary_at(*args, **kwargs)

    monkeypatch.setattr(rope_module, "rotary_at", counted)  # the tables and each layer's fallback both call it there
    cfg = config(model_type="llama", rope_scaling=rope) if rope else config(num_hidden_layers=3)
    ids, positions = inputs(cfg)
    for pos in (None, positions):
        once = model(cfg)
        calls.clear()
        a = forward_backward(once, ids, pos)
        assert len(calls) == 1
        per_layer = model(cfg)
        per_layer.rotary = None
        calls.clear()
        b = forward_backward(per_layer, ids, pos)
        assert len(calls) == cfg.num_hidden_layers
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_fused_projection_must_name_colwise_parts():
    spec = Decoder(config()).parallel_spec()
    with pytest.raises(ValueError, match=r"fused_projections\['mlp.gate_up'\].*'colwise' entry of block_plan"):
        ParallelSpec(embedding="e", blocks="b", norm="n", head="h", block_plan=spec.block_plan,
                     fused_projections={"mlp.gate_up": ("mlp.gate_proj", "mlp.down_proj")})


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_float8_runs_one_gemm_per_fused_group(recipe, monkeypatch):
    """Float8 (torchao's emulated GEMMs): the fused groups become one float8 GEMM each. Rowwise scales each output
    row, so its forward equals the parts' exactly; tensorwise takes one scale for the fused weight (float8 noise
    apart from the parts'); MXFP8 keeps the q/k/v biases, which torchao's MXFP8 linear leaves out (so unfused biased
    linears stay bf16 under MXFP8)."""
    pytest.importorskip("torchao")
    from lightning_hybrid.distributed.float8 import FLOAT8_EMULATE_ENV, Float8FusedLinear, convert_float8

    monkeypatch.setenv(FLOAT8_EMULATE_ENV, "1")
    cfg = config(hidden_size=64, intermediate_size=96)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))  # MXFP8: tokens % 32
    runs = {}
    for name, recipe_or_none, fused in (("bf16", None, True), ("fused", recipe, True), ("unfused", recipe, False)):
        m = model(cfg, fused).to(torch.bfloat16)
        if recipe_or_none:
            convert_float8(m, m.parallel_spec(), recipe_or_none, tp=1, fsdp=False)
        if name == "fused":
            assert all(isinstance(b.get_submodule(n), Float8FusedLinear) for b in m.layers.values()
                       for n in ("self_attn.qkv", "mlp.gate_up"))
        runs[name] = forward_backward(m, ids, None)
    to_bf16 = relative(runs["fused"][0], runs["bf16"][0])
    assert 1e-3 < to_bf16 < 0.06, to_bf16  # float8 really ran, as close to bf16 as float8 gets
    between = relative(runs["fused"][0], runs["unfused"][0])
    assert (between == 0.0) if recipe == "rowwise" else (between < 0.05), between


def test_float8_in_a_mixture_of_experts_runs_attention_and_the_dense_mlp_as_fused_float8_gemms(monkeypatch):
    """Qwen3-MoE under float8 (rowwise, torchao's emulated GEMMs): every block's q/k/v and the dense block's gate/up
    become one float8 GEMM each; a sparse block has no dense MLP to convert (its experts stay bf16), which the
    conversion skips instead of failing on the missing ``mlp.gate_proj``."""
    pytest.importorskip("torchao")
    from lightning_hybrid.distributed.float8 import FLOAT8_EMULATE_ENV, Float8FusedLinear, convert_float8

    monkeypatch.setenv(FLOAT8_EMULATE_ENV, "1")
    cfg = config(**{**FAMILIES["qwen3-moe"], "hidden_size": 64, "intermediate_size": 96})
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    bf16, converted = model(cfg).to(torch.bfloat16), model(cfg).to(torch.bfloat16)
    chosen = convert_float8(converted, converted.parallel_spec(), "rowwise", tp=1, fsdp=False)
    assert not [name for name in chosen if name.startswith("layers.0.mlp.")], chosen  # block 0 is sparse
    assert {"layers.1.mlp.gate_proj", "layers.0.self_attn.v_proj"} <= set(chosen)
    assert all(isinstance(block.self_attn.qkv, Float8FusedLinear) for block in converted.layers.values())
    assert isinstance(converted.layers["1"].mlp.gate_up, Float8FusedLinear)
    assert isinstance(converted.layers["0"].mlp, MoE)
    to_bf16 = relative(forward_backward(converted, ids, None)[0], forward_backward(bf16, ids, None)[0])
    assert 1e-3 < to_bf16 < 0.06, to_bf16


def test_under_mxfp8_a_biased_linear_is_converted_only_inside_a_group_that_runs_fused():
    """torchao's MXFP8 linear drops ``F.linear``'s bias: the q/k/v biases are only safe inside the fused GEMM, which
    adds them. A group with a part that cannot be converted runs unfused, so its biased parts stay bf16 too."""
    pytest.importorskip("torchao")
    from lightning_hybrid.distributed.float8 import float8_skipped

    with torch.device("meta"):
        wide = Decoder(config(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128))
        unfused = Decoder(config(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                 intermediate_size=128), fused_projections=False)
    spec = wide.parallel_spec()
    assert float8_skipped(wide, spec, "mxfp8", tp=1) == {}
    biased = {f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"}
    assert set(float8_skipped(unfused, spec, "mxfp8", tp=1)) == biased
    at_tp2 = float8_skipped(wide, spec, "mxfp8", tp=2)  # k and v: 32 rows / 2 per rank, not a multiple of 32
    assert set(at_tp2) == biased
    assert at_tp2["layers.0.self_attn.q_proj"].startswith("a bias")
    assert "per rank" in at_tp2["layers.0.self_attn.k_proj"]
    assert float8_skipped(unfused, spec, "rowwise", tp=1) == {}  # the float8 recipes add the bias themselves


def test_a_checkpoint_of_the_code_before_exports_to_transformers_with_its_logits(tmp_path):
    """The pre-fusion checkpoint (Hugging Face's q/k/v and gate/up names) goes through ``export-hf``; transformers
    loads the export and gives the logits the old code gave (the export writes fp32 here)."""
    from helpers.hf_models import hf_logits
    from lightning_hybrid.checkpoint.export import export_hf

    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    out = export_hf(FIXTURE, tmp_path / "hf", dtype="fp32")
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.up_proj.weight"} <= set(names)
    assert relative(hf_logits(out, reference["ids"]), reference["logits"]["plain"]) < 1e-5


# ----------------------------------------------------------------------------------------- four processes


@pytest.fixture(scope="module")
def four_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused") / "results.json"
    cases = ["tp2_dp2_gqa_fsdp", "tp2_dp2_gqa_sp_documents", "tp4_kv_heads_equal_tp", "rotary_cp2_tp2_sp",
             "pre_fusion_checkpoint_tp2_dp2"]
    launch(4, [str(TESTS / "fused_worker.py"), str(out), *cases], timeout=400)
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["tp2_dp2_gqa_fsdp", "tp2_dp2_gqa_sp_documents", "tp4_kv_heads_equal_tp"])
def test_fused_projections_equal_unfused_and_one_process_under_tp(four_process, case):
    for rank, records in enumerate(four_process):
        r = records[case]
        assert r["fused_vs_unfused_logits"] < EXACT and r["fused_vs_unfused_grads"] < EXACT, (rank, r)
        assert max(r["fused_logits"], r["fused_grads"], r["unfused_logits"], r["unfused_grads"]) < 1e-5, (rank, r)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_rotary_tables_once_under_cp2_tp2_sequence_parallel(four_process):
    for rank, records in enumerate(four_process):
        r = records["rotary_cp2_tp2_sp"]
        assert r["plain_bitwise"] and r["documents_bitwise"], (rank, r)
        assert r["plain_vs_one_process"] < 1e-5 and r["documents_vs_one_process"] < 1e-5, (rank, r)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_a_checkpoint_of_the_code_before_loads_on_another_mesh_bitwise(four_process):
    for rank, records in enumerate(four_process):
        r = records["pre_fusion_checkpoint_tp2_dp2"]
        assert r["names_and_shapes_equal"] and r["bitwise"] == [] and r["adamw_moved"], (rank, r)
        assert r["tensors"] == 45  # 15 parameters of the 1-block model, each with AdamW's two states
        assert r["logits_plain"] < EXACT and r["logits_documents"] < EXACT, (rank, r)
