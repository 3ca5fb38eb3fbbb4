"""The planner's mixture-of-experts terms (``planner/experts.py``): ``plan`` answers for the Qwen3-MoE presets, ep is
searched, the experts' state is sharded over ep x edp and replicated over tp, their FLOPs run on every tp rank, the
all-to-all moves the rows that leave a rank on the ep group's link, and a sparse block's saved bytes equal what the
dry run traces. Pure arithmetic, one process (the dry run's own comparison is in tests/test_dry_run.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_hybrid.models.decoder.config import active_parameters, block_tensor_shapes
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.experts import all_to_all_buffer, all_to_all_leaving, ep_reason, ep_sizes


def _problem(model: str, gpus: int, gpu: str = "b300", seq_len: int = 4096):
    from lightning_hybrid.planner.cli import build_parser, build_problem

    return build_problem(build_parser().parse_args(["--model", model, "--gpus", str(gpus), "--gpu", gpu,
                                                    "--seq-len", str(seq_len)]))


@pytest.mark.parametrize("model, gpus, total, active, ep", [("qwen3-30b-a3b", 8, "30.53B", "3.35B", 1),
                                                            ("qwen3-235b-a22b", 64, "235.09B", "22.19B", 8)])
def test_plan_answers_for_the_qwen3_moe_presets_with_total_and_active_parameters_and_an_ep_layout(
        capsys, model, gpus, total, active, ep) -> None:
    from lightning_hybrid.cli import main

    assert main(["plan", "--model", model, "--gpus", str(gpus), "--gpu", "b300", "--top", "3", "--explain"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"plan: {model} ({total} parameters, {active} active), {gpus} x b300")
    assert "every figure below is predicted" in out and "predicted step time of " in out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    assert head.split()[:6] == ["#", "tp", "cp", "pp", "dp", "ep"] and "a2a" in head
    first = next(line for line in out.splitlines() if line.lstrip().startswith("1 "))
    assert int(first.split()[5]) == ep  # the chosen layout's ep (qwen3-235b-a22b on 64 B300: ep=8 in a node)
    recipe = next(line for line in out.splitlines() if line.startswith("the fastest as a recipe:"))
    assert f", ep: {ep}," in recipe and "data.init_args.batch_size:" in recipe
    assert "exposed EP" in out and "uniform routing" in out and "not measured on hardware" in out


def test_ep_is_searched_over_the_divisors_of_dp_that_divide_num_experts() -> None:
    moe, dense = Qwen2Config.resolve("qwen3-30b-a3b"), Qwen2Config.resolve("qwen3-32b")
    assert ep_sizes(moe, 24) == [1, 2, 4, 8] and ep_sizes(moe, 256) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert ep_sizes(dense, 16) == [1]
    assert ep_reason(moe, 8, 16, "fsdp") == "" and "does not divide dp=12" in ep_reason(moe, 8, 12, "fsdp")
    assert "data_parallel='fsdp'" in ep_reason(moe, 2, 8, "replicate") and "dense" in ep_reason(dense, 2, 8, "fsdp")
    assert "num_experts=128" in ep_reason(moe, 3, 3, "fsdp")


def _experts_and_replicated(config: Qwen2Config) -> tuple[int, int]:
    """(expert elements, all elements tp does not split) of the model's blocks."""
    experts = replicated = 0
    for layer in range(config.num_hidden_layers):
        for name, (shape, dim) in block_tensor_shapes(config, layer).items():
            experts += math.prod(shape) if ".experts." in name else 0
            replicated += math.prod(shape) if dim is None else 0
    return experts, replicated + config.hidden_size  # and the final norm


@pytest.mark.parametrize("tp, dp, ep", [(1, 8, 1), (1, 8, 4), (1, 8, 8), (2, 4, 2), (2, 4, 4)])
def test_expert_state_is_sharded_over_ep_times_edp_and_replicated_over_tp(tp, dp, ep) -> None:
    from lightning_hybrid.planner.memory import rank_memory

    config = Qwen2Config.resolve("tiny-moe")
    held = [rank_memory(config, tp, 1, dp, "fsdp", 0, t, d, "32-true", ep=ep, ep_rank=d % ep, expert_dp_rank=d // ep)
            for t in range(tp) for d in range(dp)]
    per_rank = {state["param_numel"] for state in held}
    assert len(per_rank) == 1  # tiny-moe's sizes divide: every rank holds as much
    experts, replicated = _experts_and_replicated(config)
    # every parameter once across the dp x ep ranks of a tp coordinate; what tp does not split, once per tp rank
    assert sum(state["param_numel"] for state in held) == config.num_parameters() + (tp - 1) * replicated
    assert held[0]["expert_param_numel"] == experts // ep  # an ep rank's share of the experts, before FSDP
    assert held[0]["optimizer_state_numel"] == 2 * held[0]["param_numel"]


def test_moe_flops_are_the_active_parameters_and_every_tp_rank_computes_all_of_them() -> None:
    from lightning_hybrid.planner.expert_time import expert_time
    from lightning_hybrid.planner.layout import Layout

    problem = _problem("qwen3-30b-a3b", 64)
    c, tokens = problem.config, 4096
    expected = 6 * tokens * (c.hidden_size * c.num_experts
                             + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size)
    for tp in (1, 2, 4):
        layout = Layout(tp=tp, pp=1, dp=64 // tp, data_parallel="fsdp", micro_batch_size=1, microbatches=1, ep=4)
        work = expert_time(problem, layout, tokens, 2, 2)
        assert work.gemm_flops == pytest.approx(expected)  # not divided by tp: redundant on each tp rank
    # the model FLOPs MFU counts: the matmuls of the active parameters (embedding lookup aside), and attention
    from lightning_hybrid.models.qwen2.config import flops_per_token

    active_matmuls = active_parameters(c) - c.vocab_size * c.hidden_size - sum(
        math.prod(s) for i in range(c.num_hidden_layers) for n, (s, _) in block_tensor_shapes(c, i).items()
        if n.endswith("norm.weight")) - c.hidden_size
    attention = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * tokens
    assert flops_per_token(c, tokens) == pytest.approx(6 * active_matmuls + attention)


def test_all_to_all_moves_the_rows_leaving_a_rank_four_times_per_sparse_block_on_the_ep_groups_link() -> None:
    from lightning_hybrid.planner.expert_time import _collectives, ep_spans_nodes
    from lightning_hybrid.planner.layout import Layout

    problem = _problem("qwen3-30b-a3b", 128, gpu="h100")
    c, hw, tokens = problem.config, problem.hw, 4096
    buffer = tokens * c.num_experts_per_tok * c.hidden_size * 2
    assert all_to_all_buffer(c, tokens, 2) == buffer and all_to_all_leaving(c, tokens, 2, 8) == buffer * 7 / 8
    load = hw.collective("all_reduce", 8 * (2 * c.num_experts + 2), 16, True)
    for ep, tp, across in ((8, 1, False), (4, 2, False), (16, 1, True), (8, 2, True)):
        layout = Layout(tp=tp, pp=1, dp=128 // tp, data_parallel="fsdp", micro_batch_size=1, microbatches=1, ep=ep)
        assert ep_spans_nodes(problem, layout) is across
        link = hw.gpu.network_gbits / 8 if across else hw.gpu.nvlink_gbs
        one = hw.latency(across) + buffer * (ep - 1) / ep / (link * 1e9 * hw.link_efficiency)
        counts = hw.collective("all_to_all", 8 * c.num_experts, ep, across)
        load = hw.collective("all_reduce", 8 * (2 * c.num_experts + 2), layout.data_ranks, True)
        exposed, replayed = _collectives(problem, layout, tokens, 2, 2)
        assert exposed == pytest.approx(4 * one + counts + load) and replayed == 0.0
        full, _ = _collectives(problem, replace(layout, recompute="full"), tokens, 2, 2)
        assert _collectives(problem, replace(layout, recompute="full"), tokens, 2, 2)[1] == pytest.approx(
            2 * one + counts + load) and full == pytest.approx(exposed)


# A sparse block's saved bytes per token, traced by the dry run (tiny-moe's config with 2 and 6 sparse blocks, one
# sequence of 128 tokens, 32-true, 4 fake ranks: (peak(6) - peak(2)) / 4 blocks / 128 tokens; docs/moe.md): ep=1, ep=2,
# selective ("op") and full recompute at ep=2. The traces hold under 1 byte per token more (the layer's per-expert
# load statistics, per micro-batch, not per token).
TRACED_SPARSE_BLOCK = {("none", 1): 8084.97, ("none", 2): 8116.97, ("selective", 2): 4144.69, ("full", 2): 256.69}


@pytest.mark.parametrize("recompute, ep", list(TRACED_SPARSE_BLOCK))
def test_a_sparse_blocks_saved_bytes_per_token_equal_the_dry_runs_trace(recompute, ep) -> None:
    from lightning_hybrid.planner.activations import activation_model

    planned = activation_model(Qwen2Config.resolve("tiny-moe"), 1, False, recompute, "32-true", 128, ep=ep)
    assert 0 <= TRACED_SPARSE_BLOCK[(recompute, ep)] - planned.sparse_layer < 1, planned.sparse_layer


def test_op_selective_recompute_with_ep_spanning_the_data_ranks_is_refused_and_not_planned() -> None:
    """ep = dp x cp leaves each rank's experts an FSDP2 unit over one rank, which torch's selective checkpoint cannot
    replay (the dry run found it; the real tiny-moe run at ep=2 x dp=2 failed alike in backward): the strategy refuses
    it in one line before any collective, and the planner does not plan it."""
    from lightning_hybrid.distributed.option_checks import check_options
    from lightning_hybrid.distributed.options import ParallelOptions
    from lightning_hybrid.models.qwen2.config import parallel_spec
    from lightning_hybrid.planner.layout import Choices, layouts

    spec = parallel_spec(Qwen2Config.resolve("tiny-moe"))
    with pytest.raises(ValueError, match=r"^ep=2 = dp x cp=2 with activation_checkpointing='selective'"):
        check_options(ParallelOptions(ep=2, activation_checkpointing="selective"), 2, None, spec, 4, "32-true", "x")
    for fine in (dict(ep=2, activation_checkpointing="full"), dict(ep=2, activation_checkpointing="selective",
                                                                     selective_ac="attention")):
        check_options(ParallelOptions(**fine), 2, None, spec, 4, "32-true", "x")
    check_options(ParallelOptions(ep=2, activation_checkpointing="selective"), 4, None, spec, 4, "32-true", "x")
    choices = Choices(modes=(("fsdp", 0),), microbatches=(1,), stages=(("none", 1),),
                      recompute=("none", "selective", "full"))
    assert [x.recompute for x in layouts(1, 1, 2, 4, choices, ep=2)] == ["none", "full"]
    assert [x.recompute for x in layouts(1, 1, 4, 4, choices, ep=2)] == ["none", "selective", "full"]


@pytest.mark.parametrize("sequence_parallel, traced", [
    (False, {"all_reduce": [23, 3159040]}),
    (True, {"all_gather": [18, 4718592], "all_reduce": [20, 15616], "reduce_scatter": [12, 3145728]}),
])
def test_tp_collectives_of_a_moe_with_fused_projections_are_those_its_dry_run_traced(sequence_parallel, traced):
    """tiny-moe at tp=2 x dp=2 with ep=2, fused projections, loss parallel: ``traced`` is what `lightning-hybrid
    dry-run` traced for recipes/tiny-moe-cpu.yaml with ``tp: 2`` (and ``sequence_parallel: true``), recorded. A sparse
    block has no dense MLP: without sequence parallel it issues 2 TP all-reduces (o_proj forward, the fused q/k/v
    input gradient), a dense block 4 (o_proj, down_proj, fused q/k/v, fused gate/up)."""
    from lightning_hybrid.hardware import SYSTEM_GPUS
    from lightning_hybrid.planner.collectives import predicted_collectives
    from lightning_hybrid.planner.layout import Layout, Problem
    from lightning_hybrid.planner.runtime import runtime_from_options
    from lightning_hybrid.planner.step_time import Hardware

    problem = Problem(Qwen2Config.resolve("tiny-moe"), Hardware(SYSTEM_GPUS["h100"], 4, 4), 128, 16, "32-true",
                      runtime=runtime_from_options({}, "32-true"))
    layout = Layout(tp=2, pp=1, dp=2, data_parallel="fsdp", micro_batch_size=8, microbatches=1,
                    sequence_parallel=sequence_parallel, ep=2)
    assert predicted_collectives(problem, layout, 0, loss_parallel=True)["tp"] == traced
    if not sequence_parallel:  # unfused: 3 + 2 more input-gradient all-reduces per dense block, 2 per sparse one
        unfused = replace(problem, runtime=replace(problem.runtime, fused_projections=False))
        assert predicted_collectives(unfused, layout, 0, loss_parallel=True)["tp"]["all_reduce"][0] == 23 + 3 + 3 * 2
