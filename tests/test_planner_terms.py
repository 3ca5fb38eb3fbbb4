"""The planner's terms of issue #49, one at a time: fused projections' GEMM shapes, overlapped TP's exposed excess,
context parallelism's ring exchange and this project's blockwise core, the last stage's loss and kept logits.

Pure arithmetic (no torch): each term against its count, written out here from the code it models.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_hybrid.hardware import SYSTEM_GPUS
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.activations import activation_model
from lightning_hybrid.planner.context_parallel import (
    BLOCKWISE_BACKWARD_BYTES,
    BLOCKWISE_SAVED_BYTES,
    blockwise_working_bytes,
    cp_block_seconds,
)
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.planner.layout import Layout, Problem
from lightning_hybrid.planner.layout_memory import rank_memory_breakdown
from lightning_hybrid.planner.step_time import Hardware, Runtime, TimeModel, block_gemms
from lightning_hybrid.planner.tp_comm import tp_block_seconds

QWEN72 = Qwen2Config.resolve("qwen2.5-72b")
LLAMA8 = Qwen2Config.resolve("llama3-8b")
# the 72B pre-training recipe's runtime (compile, bf16 weights, async TP, FSDP gathered once per step, loss parallel)
RECIPE_RUNTIME = Runtime(fused_elementwise=True, low_precision_params=True, tp_overlap=True, loss_parallel=True,
                         fsdp_regather=False)


def problem(config: Qwen2Config = QWEN72, gpu: str = "b300", gpus: int = 128, seq: int = 4096, batch: int = 1024,
            **runtime) -> Problem:
    return Problem(config, Hardware(SYSTEM_GPUS[gpu], gpus, 8), seq, batch, runtime=Runtime(**runtime))


def seed_layout(**changes) -> Layout:
    return replace(Layout(8, 2, 8, "fsdp", 1, 128, "1f1b", 1, "selective", True), **changes)


@pytest.mark.parametrize("config, tp", [(QWEN72, 8), (LLAMA8, 8), (replace(LLAMA8, num_attention_heads=4,
                                                                          num_key_value_heads=2), 2)])
def test_fused_projections_are_one_wider_gemm_each_with_the_same_flops(config, tp):
    unfused, fused = block_gemms(config, tp), block_gemms(config, tp, fused=True)
    d = config.head_dim
    # each rank keeps whole heads and whole KV groups: q, k and v's columns side by side; gate's and up's
    assert fused["qkv"] == (config.hidden_size, (config.num_attention_heads + 2 * config.num_key_value_heads) * d // tp)
    assert fused["gate_up"] == (config.hidden_size, 2 * config.intermediate_size // tp)
    assert fused["o"] == unfused["o"] and fused["down"] == unfused["down"]
    flops = lambda shapes: sum(k * n for k, n in shapes.values())  # noqa: E731
    assert flops(fused) == flops(unfused)


def test_fused_projections_speed_up_the_seed_layout_and_leave_its_memory():
    fused, unfused = (estimate(replace(problem(), runtime=replace(RECIPE_RUNTIME, fused_projections=f)), seed_layout())
                      for f in (True, False))
    assert fused.memory == unfused.memory
    assert fused.detail["gemm_efficiencies"]["qkv"] > unfused.detail["gemm_efficiencies"]["k"] * 3
    assert fused.mfu > unfused.mfu * 1.05  # k and v ran at 0.11 of peak at tp=8



def _tp(problem_: Problem, layout: Layout, tokens: int) -> tuple[float, float, float]:
    """(exposed TP seconds, the all-reduce-equivalent plain seconds, one SP half collective) of one block."""
    c = problem_.config
    gemms = {name: 6 * tokens * k * n / (problem_.hw.peak_flops("bf16-mixed") * 0.5)
             for name, (k, n) in block_gemms(c, layout.tp, problem_.runtime.fused_projections).items()}
    nbytes = tokens * c.hidden_size * 2
    exposed, _ = tp_block_seconds(problem_, layout, nbytes, 4, gemms)
    half = problem_.hw.collective("all_gather", nbytes, layout.tp, False, blocking=True)
    return exposed, 4 * problem_.hw.collective("all_reduce", nbytes, layout.tp, False, blocking=True), half


def test_overlapped_tp_exposes_what_no_matmul_hides():
    layout, tokens = Layout(8, 1, 8, "fsdp", 12, 1, sequence_parallel=True), 12 * 8192
    plain, _, _ = _tp(problem(LLAMA8, "h100", 64, 8192, 96, tp_overlap=False), layout, tokens)
    overlapped = problem(LLAMA8, "h100", 64, 8192, 96, tp_overlap=True, fused_projections=False)
    exposed, all_reduces, half = _tp(overlapped, layout, tokens)
    assert plain == pytest.approx(all_reduces)
    # unfused q/k/v and gate/up: their input gradients are sums of matmuls, reduce-scattered alone (2 halves); the
    # other 6 halves hide under their matmuls down to the floor TP_OVERLAP_EXPOSED
    floor = overlapped.time_model.tp_overlap_exposed
    assert exposed >= 2 * half + 6 * floor * half * 0.99 and exposed < plain * 0.6
    fused, _, _ = _tp(replace(overlapped, runtime=replace(overlapped.runtime, fused_projections=True)), layout, tokens)
    assert fused < exposed - half  # the two reduce-scatters now hide under the fused matmuls' gradient GEMMs
    # rowwise float8 keeps TP in bf16: the all-gathers feed casts, not matmuls, and run alone too
    rowwise, _, _ = _tp(replace(overlapped, runtime=replace(overlapped.runtime, float8="rowwise")), layout, tokens)
    assert rowwise >= exposed + 2 * half * 0.99
    # a collective longer than the matmuls it hides under stays exposed by the difference: a tiny GEMM share
    starved = replace(overlapped, time_model=TimeModel(tp_overlap_exposed=0.0))
    assert _tp(starved, layout, 16)[0] > _tp(starved, layout, tokens)[0] * 16 / tokens


def test_torch_ring_exchanges_repeated_kv_at_every_step_in_the_critical_path():
    """torchtitan's ring: cp - 1 K/V steps forward (and again under full recompute), the same and cp fp32 dK/dV steps
    in backward, K/V at the query heads; per step over the link between nodes."""
    c, hw = Qwen2Config.resolve("llama3-405b"), Hardware(SYSTEM_GPUS["h100"], 512, 8)
    p = Problem(c, hw, 65536, 16, runtime=Runtime(ring_attention="rotate"))
    tokens = 32768
    kv = 2 * tokens * c.num_attention_heads // 8 * c.head_dim
    step = lambda nbytes: hw.collective("p2p", nbytes, 2, True, blocking=True)  # noqa: E731
    for cp in (2, 4, 8):
        layout = Layout(8, 8, 8 // cp, "fsdp", 1, 8, "1f1b", recompute="full", sequence_parallel=True, cp=cp)
        exchange = 3 * (cp - 1) * step(kv * 2) + cp * step(kv * 4)
        seconds = cp_block_seconds(p, layout, tokens, 2)
        assert exchange < seconds < 1.2 * exchange  # the rest: the fp32 merges at HBM bandwidth
    gathered = cp_block_seconds(replace(p, runtime=Runtime(ring_attention="gather")), layout, tokens, 2)
    assert gathered < seconds / 8  # all-gathered once at the KV heads (8 of 128)


def test_blockwise_core_holds_every_blocks_scores_through_a_blocks_backward():
    p = problem(seq=32768, batch=128)
    layout = Layout(4, 1, 16, "fsdp", 1, 8, recompute="full", sequence_parallel=True, cp=2)
    tokens = 16384
    per_block = tokens * 16384 * QWEN72.num_attention_heads / 4  # local queries x one block's keys x heads
    held = per_block * (2 * BLOCKWISE_SAVED_BYTES + BLOCKWISE_BACKWARD_BYTES)
    assert blockwise_working_bytes(p, layout, tokens) == held
    assert blockwise_working_bytes(replace(p, runtime=Runtime(ring_attention="gather")), layout, tokens) == 0
    h100 = Problem(QWEN72, Hardware(SYSTEM_GPUS["h100"], 128, 8), 32768, 128)
    assert not estimate(h100, layout).fits  # over 100 GB in the core alone: the H100 SFT recipe runs without cp


def test_the_last_stage_holds_the_loss_on_its_vocabulary_shard_and_the_logits_the_schedule_keeps():
    vocab, tp = QWEN72.vocab_size, 8
    full, shard = activation_model(QWEN72, tp, True, "full"), activation_model(QWEN72, tp, True, "full",
                                                                              loss_parallel=True)
    assert full.loss_working == 8 * vocab and shard.loss_working == 12 * -(-vocab // tp)
    assert full.head - shard.head == 4 * (vocab - -(-vocab // tp))  # the saved fp32 log-softmax
    assert full.logits == 2 * vocab and shard.logits == 2 * -(-vocab // tp)
    p = problem(seq=32768, batch=128, loss_parallel=True)
    layout = Layout(8, 2, 8, "fsdp", 1, 16, "1f1b", recompute="full", sequence_parallel=True)
    keeping = replace(p, runtime=replace(p.runtime, pipeline_keeps_outputs=True))  # torch's default step()
    kept = rank_memory_breakdown(keeping, layout, 1)["activations"]
    in_flight = rank_memory_breakdown(p, layout, 1)["activations"]  # the runner's step(return_outputs=False)
    assert kept - in_flight == pytest.approx(15 * 32768 * shard.logits)  # 16 kept, 1 in flight
    assert rank_memory_breakdown(p, layout, 0) == rank_memory_breakdown(keeping, layout, 0)  # no logits on stage 0


def test_full_recompute_keeps_each_block_input_in_the_dtype_of_the_weights_the_forward_runs_on():
    # FSDP2 gathers in bf16 under bf16-mixed: the embedding looks up bf16 rows and FSDP2 casts each block's inputs to
    # bf16, so the stream is bf16 (the dry run of the 72B SFT recipe's stage 0: 80 block inputs of 4,096 x 8,192 bf16
    # held, 5.37 GB, where 4-byte inputs planned 10.74 GB). Autocast on fp32 weights (replicate, no bf16 compute
    # weights) keeps an fp32 stream.
    from lightning_hybrid.planner.layout_memory import layout_shape, residual_stream_bytes

    p = problem(seq=32768, batch=128, loss_parallel=True)
    layout = Layout(8, 2, 8, "fsdp", 1, 16, "1f1b", recompute="full", sequence_parallel=True)
    assert residual_stream_bytes(p, fsdp=True) == 2
    assert layout_shape(p, layout).activations.layer == 2 * QWEN72.hidden_size / 8
    # 2 in flight, each: 40 bf16 block inputs of 8,192 / 8 per token, the embedding's ids, the bf16 rotary tables
    rotary = 2 * QWEN72.head_dim * 2
    assert rank_memory_breakdown(p, layout, 0)["activations"] == 2 * (40 * 2 * 1024 + 8 + rotary) * 32768
    bf16_weights = replace(p, runtime=replace(p.runtime, low_precision_params=True))
    assert residual_stream_bytes(p, fsdp=False) == 4 and residual_stream_bytes(bf16_weights, fsdp=False) == 2
