"""The planner: the 72B reference case, clear failures, JSON, exact per-rank state bytes, activation calibration."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from lightning_hybrid.distributed.pipeline.schedules import stage_ids_for_rank
from lightning_hybrid.distributed.pipeline.split import plan_stages, prune_to_stage
from lightning_hybrid.models import Qwen2, Qwen2Config
from lightning_hybrid.planner.activations import activation_model
from lightning_hybrid.planner.cli import build_parser, build_problem
from lightning_hybrid.planner.cli import run_plan as plan_main
from lightning_hybrid.planner.interval import checkpoint_plan, young_daly_interval
from lightning_hybrid.planner.search import Problem, explain, rank_memory, search

REFERENCE = "--model qwen2.5-72b --gpus 128 --gpus-per-node 8 --gpu b300 --seq-len 4096".split()


def problem(argv: list[str]) -> Problem:
    return build_problem(build_parser().parse_args(argv))


@pytest.fixture(scope="module")
def reference():
    p = problem(REFERENCE)
    return p, search(p)


def test_the_block_work_memo_equals_the_computation_for_every_candidate_of_a_search() -> None:
    # the memo is keyed by the layout fields the block's work reads; a field read but left out of the key would give
    # some candidate another's figures: every candidate of a search (all tp, pp, dp modes, micro-batch sizes,
    # schedules, recompute and sequence parallel choices, cp) is checked against a fresh computation
    from lightning_hybrid.planner.cost import _block_work, _compute_block_work
    from lightning_hybrid.planner.layout import context_sizes
    from lightning_hybrid.planner.layout_memory import layout_shape as _layout_shape
    from lightning_hybrid.planner.search import candidates, meshes

    p = problem("--model qwen2.5-7b --gpus 16 --gpus-per-node 8 --gpu h100 --seq-len 8192".split())
    seen = set()
    for tp, pp, reason in meshes(p):
        for cp in ([] if reason else context_sizes(p, tp)):
            for layout in (candidates(p, tp, pp, cp=cp) if p.hw.gpus % (tp * pp * cp) == 0 else []):
                tokens = _layout_shape(p, layout).tokens
                assert _block_work(p, layout, tokens) == _compute_block_work(p, layout, tokens), layout
                seen.add((layout.tp, layout.recompute, layout.sequence_parallel, layout.cp, tokens))
    assert len(seen) > 20, seen


# ----------------------------------------------------------------------------- the 72B reference case


def test_72b_on_128_b300_at_seq_4096_has_tp8_pp2_among_the_feasible_layouts(reference):
    _, (feasible, _) = reference
    tp8_pp2 = [e for e in feasible if (e.layout.tp, e.layout.pp, e.layout.dp) == (8, 2, 8)]
    assert tp8_pp2, "TP=8, PP=2, DP=8 should fit 288 GB B300s"
    best = tp8_pp2[0]
    assert best.memory["total"] <= best.usable
    assert 0.3 < best.mfu < 0.7  # the design's reference run reaches 45-50% MFU
    assert best.time["pp_bubble"] > 0 and best.time["tp_comm"] > 0


def test_72b_explains_the_unsharded_tp8_pp1_layout_from_its_memory_breakdown(reference):
    p, _ = reference
    ex = explain(p, 8, 1, "replicate")
    text = ex["text"]
    assert text.startswith("tp=8, pp=1, replicate:")
    # 72.7B parameters / tp=8 are replicated on all 16 dp ranks: 9.09B x (4 + 4 + 8) bytes of model state,
    # plus the full-vocabulary gradient torch's vocabulary-parallel embedding produces on every TP rank.
    c = p.config
    state = sum(ex["plain"]["memory_gb"][k] for k in ("weights", "gradients", "optimizer"))
    embedding_grad = c.vocab_size * c.hidden_size * (1 - 1 / 8) * 4
    assert state == pytest.approx((c.num_parameters() / 8 * 16 + embedding_grad) / 1e9, rel=1e-3)
    assert f"{state:.1f} GB" in text and "replicated on all dp=16 ranks" in text
    # The verdict follows from the numbers it prints.
    smallest = ex["smallest"]
    assert ex["fits"] == (smallest["memory_gb"]["total"] <= smallest["usable_gb"])
    assert ("does not fit" not in text) == ex["fits"]


def test_tp8_pp1_replicate_does_not_fit_72b_when_the_model_state_exceeds_the_gpu():
    p = problem(["--model", "qwen2.5-72b", "--gpus", "128", "--gpu", "h200", "--seq-len", "4096"])
    ex = explain(p, 8, 1, "replicate")
    assert not ex["fits"]
    assert "does not fit: the model state alone exceeds the GPU" in ex["text"]
    assert any(e.layout.tp == 8 and e.layout.pp >= 2 for e in search(p)[0])


def test_plan_prints_table_explanation_checkpoint_interval_and_assumptions(capsys):
    assert plan_main(REFERENCE + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit" in out and "tp=8, pp=1, replicate:" in out
    assert "checkpoint interval (Young/Daly" in out and "expected time lost" in out
    assert "assumptions:" in out and "Korthikanti" in out and "2250 TFLOP/s" in out


def test_plan_json_output_parses_and_has_every_part(capsys):
    argv = ["--model", "qwen2.5-7b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h100", "--seq-len", "2048",
            "--global-batch", "256", "--json"]
    assert plan_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible_count"] == len(doc["layouts"]) > 0
    top = doc["layouts"][0]
    assert top["fits"] and set(top["memory_gb"]) >= {"weights", "gradients", "optimizer", "activations", "total"}
    assert set(top["time_s"]) >= {"compute", "tp_comm", "pp_bubble", "dp_comm", "step"}
    assert doc["assumptions"] and doc["explanations"][0]["layout"].startswith("tp=")
    assert doc["checkpoint"]["interval_seconds"] > 0 and 0 < doc["checkpoint"]["lost_fraction"] < 1
    steps = [row["time_s"]["step"] for row in doc["layouts"]]
    assert steps == sorted(steps)


def test_python_m_planner_json_works_as_written():
    result = subprocess.run([sys.executable, "-m", "lightning_hybrid.planner", *REFERENCE, "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)
    assert doc["feasible_count"] == len(doc["layouts"])
    assert any(row["layout"]["tp"] == 8 and row["layout"]["pp"] == 2 and row["fits"] for row in doc["layouts"])


# ----------------------------------------------------------------------------- clear failures


def test_a_model_that_fits_nowhere_gets_a_clear_message(capsys):
    argv = ["--model", "qwen2.5-72b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "h100", "--seq-len", "4096"]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("nothing fits"))
    assert "qwen2.5-72b" in line and "8 x h100" in line and "needs" in line and "GB per GPU" in line
    assert "use about" in line and "GPUs" in line
    assert plan_main(argv + ["--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["layouts"] == [] and doc["message"].startswith("nothing fits")


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "0"], "--gpus=0 must be positive"),
    (["--gpus", "12", "--gpus-per-node", "8"], "use a multiple of 8"),
    (["--gpus", "8", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--gpus", "8", "--explain", "8"], "must look like TP,PP,MODE"),
])
def test_bad_flags_give_a_one_line_error(capsys, argv, words):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


# ----------------------------------------------------------------------------- exact state bytes


ODD = Qwen2Config(vocab_size=250, hidden_size=48, intermediate_size=100, num_hidden_layers=7, num_attention_heads=8,
                  num_key_value_heads=4)
TIED = Qwen2Config(vocab_size=97, hidden_size=12, intermediate_size=30, num_hidden_layers=3, num_attention_heads=2,
                   num_key_value_heads=1, tie_word_embeddings=True)


def _chunk(t: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    chunks = torch.chunk(t, parts, dim=dim)
    return chunks[index] if index < len(chunks) else t.narrow(dim, 0, 0)


def _meta_rank_numel(config, tp, pp, dp, mode, coords, v=1, schedule="1f1b") -> tuple[int, int]:
    """(parameters, tensors) of a rank: the strategy's stage pruning, then torch.chunk by the declared TP plan."""
    with torch.device("meta"):
        model = Qwen2(config)
    spec = model.parallel_spec()
    plans = plan_stages(spec, config.num_hidden_layers, pp * v)
    params: dict[int, tuple[str, torch.Tensor]] = {}
    for stage_id in stage_ids_for_rank(coords["pp"], pp, v, schedule):
        stage = prune_to_stage(model, spec, plans[stage_id])
        params.update({id(p): (n, p) for n, p in stage.named_parameters()})
    total = 0
    for name, p in params.values():
        dim = None
        if tp > 1:
            if name.startswith(("embed_tokens.", "lm_head.")):
                dim = 0
            for module, style in spec.block_plan.items():
                if f".{module}." in name:
                    dim = 0 if style == "colwise" else (1 if name.endswith("weight") else None)
        local = _chunk(p, tp, coords["tp"], dim) if dim is not None else p
        if mode == "fsdp" and dp > 1:
            local = _chunk(local, dp, coords["dp"], 0)
        total += local.numel()
    return total, len(params)


@pytest.mark.parametrize("config", [Qwen2Config.from_preset("tiny"), ODD, Qwen2Config.from_preset("tiny-qwen3")],
                         ids=["tiny", "odd", "tiny-qwen3"])
@pytest.mark.parametrize("tp, pp, dp, mode, v", [
    (1, 1, 1, "fsdp", 1), (2, 1, 3, "fsdp", 1), (4, 1, 2, "replicate", 1), (4, 1, 5, "fsdp", 1),
    (2, 2, 2, "fsdp", 1), (1, 3, 4, "fsdp", 1), (2, 2, 1, "fsdp", 2), (1, 2, 3, "replicate", 2),
])
def test_rank_memory_equals_chunked_meta_model_on_every_rank(config, tp, pp, dp, mode, v):
    if pp * v > config.num_hidden_layers:
        pytest.skip("more stages than blocks")
    for rank in range(tp * pp * dp):
        coords = {"pp": rank // (dp * tp), "dp": (rank // tp) % dp, "tp": rank % tp}
        numel, tensors = _meta_rank_numel(config, tp, pp, dp, mode, coords, v,
                                          "interleaved_1f1b" if v > 1 else "1f1b")
        got = rank_memory(config, tp, pp, dp, mode, coords["pp"], coords["tp"], coords["dp"], precision="32-true",
                          virtual_stages=v)
        assert (got["param_numel"], got["param_tensors"]) == (numel, tensors), coords
        assert got["param_bytes"] == 4 * numel
        assert got["optimizer_bytes"] == 2 * 4 * numel + 4 * tensors  # exp_avg, exp_avg_sq, fp32 step


def test_rank_memory_counts_a_tied_embedding_once_and_bf16_states_in_bf16():
    with torch.device("meta"):
        model = Qwen2(TIED)
    full = rank_memory(TIED, 1, 1, 1, "replicate", precision="bf16-true")
    assert full["param_numel"] == model.num_parameters() == TIED.num_parameters()
    assert full["optimizer_bytes"] == 2 * 2 * full["param_numel"] + 4 * full["param_tensors"]
    with pytest.raises(ValueError, match="tie_word_embeddings=True is not supported with tp=2"):
        rank_memory(TIED, 2, 1, 1)


def test_rank_memory_rejects_coordinates_outside_the_mesh():
    with pytest.raises(ValueError, match="stage_index=2 is out of range for size 2; use 0 to 1"):
        rank_memory(ODD, 1, 2, 1, stage_index=2)


# ----------------------------------------------------------------------------- activation calibration


def measure_saved_bytes(config: Qwen2Config, dtype: torch.dtype, batch: int, seq: int, full_recompute: bool = False,
                        autocast: bool = False) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward plus loss (the measurement).

    ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor saved for backward; storages are counted
    once (by data pointer, a view shares its base's storage) and parameters are left out. This is the
    activation memory held between forward and backward: what the planner's activation term predicts.
    """
    torch.manual_seed(0)
    model = Qwen2(config).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    if full_recompute:
        from torch.utils.checkpoint import checkpoint

        for block in model.layers.values():
            # the block's keywords (the rotary tables made once per forward) pass through the checkpoint
            block.forward = (lambda f: lambda x, **kw: checkpoint(f, x, use_reentrant=False, **kw))(block.forward)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model.loss_sum(model(ids), ids)
    return sum(seen.values())


@pytest.mark.parametrize("precision, recompute", [("32-true", "none"), ("32-true", "full"), ("bf16-true", "none"),
                                                  ("bf16-true", "full"), ("bf16-mixed", "none"),
                                                  ("bf16-mixed", "full")])
def test_activation_estimate_is_within_20_percent_of_measured_for_tiny(precision, recompute):
    config, batch, seq = Qwen2Config.from_preset("tiny"), 2, 256
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    measured = measure_saved_bytes(config, dtype, batch, seq, recompute == "full", precision == "bf16-mixed")
    act = activation_model(config, 1, False, recompute, precision, seq)
    predicted = (config.num_hidden_layers * act.layer + act.stage + act.embedding + act.head) * batch * seq
    if precision == "bf16-mixed" and recompute == "none":
        # autocast's bf16 weight copies are saved too (not under recompute); the planner counts them apart
        mem = rank_memory(config, 1, 1, 1, "replicate", precision=precision)
        predicted += 2 * mem["matmul_param_numel"]
    assert predicted == pytest.approx(measured, rel=0.2)


def test_sequence_parallel_and_recompute_shrink_activations_in_order():
    c = Qwen2Config.from_preset("qwen2.5-72b")
    none, sp = activation_model(c, 8, False, "none"), activation_model(c, 8, True, "none")
    selective, full = activation_model(c, 8, True, "selective"), activation_model(c, 8, True, "full")
    assert none.layer > sp.layer > selective.layer > full.layer
    assert full.layer == 4 * c.hidden_size / 8  # the fp32 block input, sharded over the sequence


# ----------------------------------------------------------------------------- checkpoint interval


def test_young_daly_interval_and_expected_loss():
    young, daly = young_daly_interval(60, 100 * 3600)
    assert young == pytest.approx(math.sqrt(2 * 60 * 100 * 3600))
    assert young * 0.9 < daly < young * 1.05
    plan = checkpoint_plan(100e9, 128, 10.0, save_seconds=60, mtbf_hours=100)
    assert plan["interval_steps"] == round(plan["interval_seconds"] / 10)
    expected = 60 / plan["interval_seconds"] + (plan["interval_seconds"] / 2 + 600) / (100 * 3600)
    assert plan["lost_fraction"] == pytest.approx(expected)
    estimated = checkpoint_plan(10e9, 128, 10.0)  # 10 GB per GPU at 1 GB/s, 50,000 GPU-hours / 128
    assert estimated["save_seconds"] == pytest.approx(10) and estimated["mtbf_hours"] == pytest.approx(50_000 / 128)
