"""The planner's prediction of the collectives one pipeline rank issues in a step (``planner/collectives.py``)."""

from __future__ import annotations

import pytest

from lightning_hybrid.hardware import SYSTEM_GPUS
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.collectives import predicted_collectives
from lightning_hybrid.planner.search import Layout, Problem
from lightning_hybrid.planner.step_time import Hardware

# qwen2.5-72b-pretrain.yaml: 128 GPUs, tp=8, pp=2, dp=8 FSDP, bf16-mixed, sequence parallel, selective recompute,
# 1F1B, 128 micro-batches of 1 x 4,096 tokens, gradient clipping.
PRETRAIN = Layout(tp=8, pp=2, dp=8, data_parallel="fsdp", micro_batch_size=1, microbatches=128, schedule="1f1b",
                  recompute="selective", sequence_parallel=True)

# By hand, Qwen2.5-72B (h = 8192, vocabulary 152,064, MLP 29,568, 64 query / 8 kv heads of 128, 80 blocks: 40 per
# stage), bf16 activations (FSDP gathers bf16 weights), T = 4,096 tokens per micro-batch:
#   A = T x h x 2 = 67,108,864 B (a residual-stream activation); logits T x 152,064 x 2 = 1,245,708,288 B.
#   tp, per micro-batch on stage 0: 4 all-gathers and 4 reduce-scatters of A per block (attention and MLP input
#     forward and backward, their outputs forward and backward) = 160 each, + the embedding's reduce-scatter
#     (forward) and all-gather (backward): 161 each; x 128 = 20,608 calls, 20,608 x A = 1,382,979,469,312 B.
#     The 80 norm weights' gradients (partial over the sequence shards) all-reduced once per step in fp32:
#     80 x 8,192 x 4 = 2,621,440 B.
#   dp, FSDP units: a block's TP-local elements q 1024x8192 + 1024, k and v 128x8192 + 128 each, o 8192x1024,
#     gate and up 3696x8192, down 8192x3696, 2 norms 8192: 109,724,928 (all divisible by dp=8: no padding); the
#     root unit of stage 0, the embedding 19,008 x 8,192 = 155,713,536. All-gathers in bf16: each block
#     m + 1 = 129 times (the warm-up forwards and every backward that follows a forward), the root once:
#     129 x 40 + 1 = 5,161 calls, 5,160 x 219,449,856 + 311,427,072 = 1,132,672,684,032 B. Reduce-scatters in
#     fp32 once per step: 41 calls, (40 x 109,724,928 + 155,713,536) x 4 = 18,178,842,624 B.
#   pp: one activation sent and one gradient received per micro-batch, the sequence shard 1 x 512 x 8,192 x 2 =
#     8,388,608 B: 128 calls, 1,073,741,824 B each way; the loss statistics broadcast (2 float32: 8 B).
#   world: the clipping's squared norm (one float64: 8 B).
PRETRAIN_RANK_0 = {
    "dp": {"all_gather": [5161, 1_132_672_684_032], "reduce_scatter": [41, 18_178_842_624]},
    "pp": {"broadcast": [1, 8], "recv": [128, 1_073_741_824], "send": [128, 1_073_741_824]},
    "tp": {"all_gather": [20608, 1_382_979_469_312], "all_reduce": [80, 2_621_440],
           "reduce_scatter": [20608, 1_382_979_469_312]},
    "world": {"all_reduce": [1, 8]},
}


def _problem(model: str, seq_len: int, global_batch: int, precision: str, gpus: int = 128) -> Problem:
    return Problem(Qwen2Config.resolve(model), Hardware(SYSTEM_GPUS["b300"], gpus, 8), seq_len, global_batch,
                   precision)


def test_72b_pretrain_rank_0_issues_the_hand_counted_collectives() -> None:
    problem = _problem("qwen2.5-72b", 4096, 1024, "bf16-mixed")
    assert predicted_collectives(problem, PRETRAIN, 0) == PRETRAIN_RANK_0


def test_72b_pretrain_dry_run_traces_two_microbatches_of_the_same_collectives() -> None:
    # The dry run traces pp = 2 micro-batches of 1F1B: per-micro-batch collectives scale to 2, per-step ones stay.
    problem = _problem("qwen2.5-72b", 4096, 1024, "bf16-mixed")
    traced = predicted_collectives(problem, PRETRAIN, 0, traced_microbatches=2)
    a = 4096 * 8192 * 2
    assert traced["tp"]["all_gather"] == traced["tp"]["reduce_scatter"] == [322, 322 * a]
    assert traced["dp"]["all_gather"] == [3 * 40 + 1, 120 * 219_449_856 + 311_427_072]
    assert traced["dp"]["reduce_scatter"] == PRETRAIN_RANK_0["dp"]["reduce_scatter"]
    assert traced["pp"]["send"] == [2, 2 * 8_388_608] and traced["world"] == PRETRAIN_RANK_0["world"]


# `lightning-hybrid dry-run --config recipes/qwen2.5-72b-pretrain.yaml --ranks 0,64 --json`: the traced collectives
# of 2 micro-batches of each stage (27 s per rank on the 2-core machine).
PRETRAIN_DRY_RUN = {
    0: {"dp": {"all_gather": [121, 26645409792], "reduce_scatter": [41, 18178842624]},
        "pp": {"broadcast": [1, 8], "recv": [2, 16777216], "send": [2, 16777216]},
        "tp": {"all_gather": [322, 21609054208], "all_reduce": [80, 2621440], "reduce_scatter": [322, 21609054208]},
        "world": {"all_reduce": [1, 8]}},
    1: {"dp": {"all_gather": [121, 26645426176], "all_reduce": [2, 8], "reduce_scatter": [41, 18178875392]},
        "pp": {"broadcast": [1, 8], "recv": [2, 16777216], "send": [2, 16777216]},
        "tp": {"all_gather": [324, 24100470784], "all_reduce": [81, 2654208], "reduce_scatter": [322, 21609054208]},
        "world": {"all_reduce": [1, 8]}},
}


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_72b_pretrain_prediction_equals_the_dry_run_trace(pp_rank) -> None:
    problem = _problem("qwen2.5-72b", 4096, 1024, "bf16-mixed")
    assert predicted_collectives(problem, PRETRAIN, pp_rank, traced_microbatches=2) == PRETRAIN_DRY_RUN[pp_rank]


def test_72b_pretrain_last_stage_adds_the_head_and_the_loss_statistics() -> None:
    problem = _problem("qwen2.5-72b", 4096, 1024, "bf16-mixed")
    last = predicted_collectives(problem, PRETRAIN, 1)
    a, logits = 4096 * 8192 * 2, 4096 * 152064 * 2
    # the head: its input all-gathered and the logits gathered forward, its input gradient reduce-scattered
    assert last["tp"]["all_gather"] == [128 * 162, 128 * (161 * a + logits)]
    assert last["tp"]["reduce_scatter"] == PRETRAIN_RANK_0["tp"]["reduce_scatter"]
    assert last["tp"]["all_reduce"] == [81, 81 * 8192 * 4]  # the final norm too
    assert last["dp"]["all_reduce"] == [2, 8]  # label-token count and loss sum over dp


# Traced by the dry run (``run_rank`` on the fake process group, which tests/test_dry_run.py holds equal to the real
# gloo run) for the tiny model (4 blocks, h = 64, vocabulary 256, seq 128, 8 sequences per dp rank): every data
# parallel mode, sequence parallel, recompute mode and schedule the prediction distinguishes. Without sequence
# parallel the fused q/k/v and gate/up GEMMs reduce their input gradients in 2 all-reduces per block, not 5.
TINY_TRACES = [
    ("fsdp pp2 fp32", 8, "32-true", dict(tp=2, pp=2, dp=2, m=4), 0,
     {"dp": {"all_gather": [11, 962048], "reduce_scatter": [3, 218624]},
      "pp": {"broadcast": [1, 8], "recv": [4, 262144], "send": [4, 262144]}, "tp": {"all_reduce": [36, 2359296]},
      "world": {"all_reduce": [1, 8]}}),
    ("fsdp pp2 fp32 last", 8, "32-true", dict(tp=2, pp=2, dp=2, m=4), 1,
     {"dp": {"all_gather": [11, 962304], "all_reduce": [2, 8], "reduce_scatter": [3, 218880]},
      "pp": {"broadcast": [1, 8], "recv": [4, 262144], "send": [4, 262144]},
      "tp": {"all_gather": [4, 1048576], "all_reduce": [36, 2359296]}, "world": {"all_reduce": [1, 8]}}),
    ("gpipe", 8, "32-true", dict(tp=2, pp=2, dp=2, m=4, schedule="gpipe"), 0,
     {"dp": {"all_gather": [11, 962048], "reduce_scatter": [3, 218624]},
      "pp": {"broadcast": [1, 8], "recv": [4, 262144], "send": [4, 262144]}, "tp": {"all_reduce": [36, 2359296]},
      "world": {"all_reduce": [1, 8]}}),
    ("fsdp sp selective", 4, "bf16-mixed", dict(tp=2, sp=True, recompute="selective"), 0,
     {"dp": {"all_gather": [9, 404608], "reduce_scatter": [5, 437504]},
      "tp": {"all_gather": [19, 2883584], "all_reduce": [9, 1152], "reduce_scatter": [18, 2359296]},
      "world": {"all_reduce": [2, 16]}}),
    ("replicate", 4, "bf16-mixed", dict(tp=2, mode="replicate"), 0,
     {"dp": {"all_reduce": [1, 470272]}, "tp": {"all_gather": [1, 1048576], "all_reduce": [18, 4718592]},
      "world": {"all_reduce": [2, 16]}}),
    ("replicate sp", 4, "bf16-mixed", dict(tp=2, mode="replicate", sp=True), 0,
     {"dp": {"all_reduce": [1, 470272]}, "tp": {"all_gather": [19, 5767168], "reduce_scatter": [18, 4718592]},
      "world": {"all_reduce": [2, 16]}}),
    ("pp2 sp fsdp last", 8, "bf16-mixed", dict(tp=2, pp=2, dp=2, m=4, sp=True, recompute="selective"), 1,
     {"dp": {"all_gather": [11, 481152], "all_reduce": [2, 8], "reduce_scatter": [3, 218880]},
      "pp": {"broadcast": [1, 8], "recv": [4, 65536], "send": [4, 65536]},
      "tp": {"all_gather": [40, 1703936], "all_reduce": [5, 1280], "reduce_scatter": [36, 1179648]},
      "world": {"all_reduce": [1, 8]}}),
    ("pp2 sp dp1 last", 4, "32-true", dict(tp=2, pp=2, dp=1, m=2, sp=True), 1,
     {"pp": {"broadcast": [1, 8], "recv": [2, 131072], "send": [2, 131072]},
      "tp": {"all_gather": [20, 3407872], "reduce_scatter": [18, 2359296]}, "world": {"all_reduce": [1, 8]}}),
    ("full sp", 4, "bf16-mixed", dict(tp=2, sp=True, recompute="full"), 0,
     {"dp": {"all_gather": [9, 404608], "reduce_scatter": [5, 437504]},
      "tp": {"all_gather": [27, 3932160], "all_reduce": [9, 1152], "reduce_scatter": [22, 2883584]},
      "world": {"all_reduce": [2, 16]}}),
    ("full", 4, "bf16-mixed", dict(tp=2, recompute="full"), 0,
     {"dp": {"all_gather": [9, 404608], "reduce_scatter": [5, 437504]},
      "tp": {"all_gather": [1, 524288], "all_reduce": [22, 2883584]}, "world": {"all_reduce": [2, 16]}}),
    ("pp2 replicate full last", 8, "bf16-mixed", dict(tp=2, pp=2, dp=2, m=2, mode="replicate", recompute="full"), 1,
     {"dp": {"all_reduce": [3, 218888]}, "pp": {"broadcast": [1, 8], "recv": [2, 262144], "send": [2, 262144]},
      "tp": {"all_gather": [2, 1048576], "all_reduce": [22, 2883584]}, "world": {"all_reduce": [1, 8]}}),
    ("selective attention", 4, "bf16-mixed", dict(tp=2, recompute="selective", ac="attention"), 0,
     {"dp": {"all_gather": [9, 404608], "reduce_scatter": [5, 437504]},
      "tp": {"all_gather": [1, 524288], "all_reduce": [18, 2359296]}, "world": {"all_reduce": [2, 16]}}),
    ("selective every 2nd block sp", 4, "bf16-mixed", dict(tp=2, sp=True, recompute="selective", ac=2), 0,
     {"dp": {"all_gather": [9, 404608], "reduce_scatter": [5, 437504]},
      "tp": {"all_gather": [23, 3407872], "all_reduce": [9, 1152], "reduce_scatter": [20, 2621440]},
      "world": {"all_reduce": [2, 16]}}),
]


@pytest.mark.parametrize("name, world, precision, s, pp_rank, traced", TINY_TRACES, ids=[t[0] for t in TINY_TRACES])
def test_prediction_equals_the_dry_run_trace_of_tiny_layouts(name, world, precision, s, pp_rank, traced) -> None:
    tp, pp = s["tp"], s.get("pp", 1)
    dp = world // (tp * pp)
    m = s.get("m", 1)
    layout = Layout(tp=tp, pp=pp, dp=dp, data_parallel=s.get("mode", "fsdp"), micro_batch_size=8 // m,
                    microbatches=m, schedule=s.get("schedule", "1f1b") if pp > 1 else "none",
                    recompute=s.get("recompute", "none"), sequence_parallel=s.get("sp", False))
    problem = _problem("tiny", 128, 8 * dp, precision, gpus=world)
    assert predicted_collectives(problem, layout, pp_rank, selective_ac=s.get("ac", "op")) == traced


def test_a_dimension_spanning_the_world_is_reported_as_world() -> None:
    # tp=2 on 2 ranks: the TP group is the world's, as the dry run's counter names it.
    layout = Layout(tp=2, pp=1, dp=1, data_parallel="fsdp", micro_batch_size=8, microbatches=1)
    table = predicted_collectives(_problem("tiny", 128, 8, "32-true", gpus=2), layout, 0)
    # 4 blocks x (2 forward + 2 fused input gradients) + the embedding and the head, + 2 loss statistics
    assert set(table) == {"world"} and table["world"]["all_reduce"][0] == 18 + 2


def test_layouts_that_are_not_modelled_are_refused() -> None:
    problem = _problem("tiny", 128, 16, "32-true", gpus=8)
    interleaved = Layout(tp=1, pp=2, dp=4, data_parallel="fsdp", micro_batch_size=1, microbatches=4,
                         schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="only 1f1b and gpipe"):
        predicted_collectives(problem, interleaved, 0)
    with pytest.raises(ValueError, match="pp_rank=2 is out of range"):
        predicted_collectives(problem, PRETRAIN, 2)
