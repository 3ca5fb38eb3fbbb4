"""The communication of one block that stays in the critical path: TP collectives and context parallelism's K/V.

**TP.** Torch's TP runs its collectives on the compute stream: all of them are exposed. Overlapped TP (torch's async
TP, Megatron's ``--tp-comm-overlap``; both need sequence parallelism) splits each sequence-parallel all-gather and
reduce-scatter into ``tp`` steps and runs them under the partial GEMMs of the matmuls it feeds or is fed by: the
all-gather before q/k/v (or the fused qkv) under their forward GEMMs, the reduce-scatter after o under o's, the same
for gate/up and down, and in backward the mirror collectives under the same matmuls' input-gradient GEMMs (a third of
a GEMM's forward + backward time each). A collective longer than the GEMMs it hides under stays exposed by the
difference (Llama 3 8B at tp=8: o's GEMM is shorter than its reduce-scatter); at least
``TimeModel.tp_overlap_exposed`` of it stays exposed anyway. Two collectives find no matmul to fuse with and run
alone (torch's ``micro_pipeline_tp`` pass fuses a reduce-scatter with the one matmul that produces its input, an
all-gather with the matmuls that consume it): the backward reduce-scatter of the input gradient of unfused q/k/v
(or gate/up), a sum of three (two) matmuls; and under rowwise or MXFP8 float8, whose TP stays in bf16 (torchtitan and
``distributed/float8.py``), every all-gather, whose consumers are float8 casts.

**CP.** This project's ring attention (``Runtime.ring_attention="gather"``, ``distributed/context_parallel.py``)
all-gathers each block's K/V at their own (KV) heads in one collective and reduce-scatters their gradients.
torch's ``context_parallel`` as torchtitan runs it (``"rotate"``) passes K/V repeated to the query heads (the model
repeats them before SDPA) around the ring one step at a time: ``cp - 1`` steps forward (again when the block is
recomputed), and in backward the K/V again plus the fp32 dK/dV accumulators for ``cp`` steps; each step also merges
the partial outputs (and gradients) in fp32 (:data:`RING_MERGE_FORWARD_BYTES`, :data:`RING_MERGE_BACKWARD_BYTES`). The exchange of a step is counted in the
critical path: torchtitan's rows at 64k-256k tokens with cp 2-8 (``benchmarks/planner_published.py``) are 25-56%
slower than the planner with it overlapped per step (each step's attention outlasts its transfer), and within 15%
with it exposed.
"""

from __future__ import annotations

from lightning_hybrid.planner.layout import Layout, Problem

__all__ = ["tp_block_seconds", "cp_block_seconds", "TP_GEMM_GROUPS", "RING_MERGE_FORWARD_BYTES",
           "RING_MERGE_BACKWARD_BYTES", "RING_ATTENTION"]

# The matmuls each sequence-parallel collective of a block feeds (all-gathers) or is fed by (reduce-scatters), by the
# names of step_time.block_gemms (fused projections or not).
TP_GEMM_GROUPS = {False: (("q", "k", "v"), ("o",), ("gate", "up"), ("down",)),
                  True: (("qkv",), ("o",), ("gate_up",), ("down",))}
RING_MERGE_FORWARD_BYTES = 38
"""HBM bytes per element of a rank's attention output (tokens x query heads x head_dim) and ring step after the first,
in forward, of torch's ring outside the attention kernels (``_SDPAMerger``, fp32): the step's output cast to fp32 (2 +
4), ``out - out_b`` (8 + 4), the scale by ``sigmoid(lse_b - lse)`` (4 + 4), the subtraction (8 + 4)."""
RING_MERGE_BACKWARD_BYTES = 46
"""The same per ring step in backward (``_templated_ring_attention_backward``): the fp32 dQ, dK and dV accumulations (3
x (4 + 2 + 4)), the concatenated fp32 dK/dV sent on (8 + 8)."""
RING_ATTENTION = ("gather", "rotate")


def _collective(problem: Problem, layout: Layout, kind: str, nbytes: float) -> float:
    return problem.hw.collective(kind, nbytes, layout.tp, False, blocking=True)


def tp_block_seconds(problem: Problem, layout: Layout, nbytes: float, all_reduces: int,
                     gemms: dict[str, float]) -> tuple[float, float]:
    """(exposed seconds of a block's TP collectives per micro-batch, the exposed fraction for collectives replayed by
    recompute).

    Args:
        nbytes: one activation of the residual stream (``tokens x hidden x bytes``).
        all_reduces: the block's collectives in all-reduce equivalents (``collectives.tp_all_reduce_equivalents``).
        gemms: forward + backward seconds of each block matmul (``step_time.block_gemms``' names).
    """
    if layout.tp == 1:
        return 0.0, 0.0
    plain = all_reduces * _collective(problem, layout, "all_reduce", nbytes)
    if not problem.runtime.tp_overlap:
        return plain, 1.0
    floor = problem.time_model.tp_overlap_exposed
    if not layout.sequence_parallel or not plain:
        return plain * floor, floor
    half = _collective(problem, layout, "all_gather", nbytes)  # an SP all-gather or reduce-scatter of the stream
    # rowwise and MXFP8 float8 keep TP in bf16: a gathered tensor feeds float8 casts, not the matmuls
    gathers_fuse = problem.runtime.float8 in (None, "tensorwise")
    exposed = 0.0
    for i, group in enumerate(TP_GEMM_GROUPS["qkv" in gemms]):
        hidden = max(half - sum(gemms[name] for name in group) / 3, floor * half)
        gather = hidden if gathers_fuse else half
        # the input gradient of several matmuls (unfused q/k/v, gate/up) is their sum, which no single matmul
        # produces: its reduce-scatter runs alone
        scatter = hidden if len(group) == 1 else half
        # groups alternate: matmuls fed by an all-gather (forward; their input gradient reduce-scattered in
        # backward), then one feeding a reduce-scatter (forward; its output gradient all-gathered in backward)
        exposed += gather + scatter
    return exposed, exposed / plain


def cp_block_seconds(problem: Problem, layout: Layout, tokens: int, attention_bytes: int) -> float:
    """One block's exposed context-parallel exchange per micro-batch (see the module docstring): ``tokens`` local
    tokens, ``attention_bytes`` per K/V element."""
    if layout.cp == 1:
        return 0.0
    c, hw, a = problem.config, problem.hw, attention_bytes
    inter_node = layout.tp * layout.cp > hw.gpus_per_node  # cp ranks are tp apart
    passes = 2 if layout.recompute == "full" else 1  # the forward, and its replay under full recompute
    if problem.runtime.ring_attention == "gather":
        nbytes = 2 * tokens * layout.cp * c.num_key_value_heads // layout.tp * c.head_dim * a
        collective = lambda kind: hw.collective(kind, nbytes, layout.cp, inter_node, blocking=True)  # noqa: E731
        return passes * collective("all_gather") + collective("reduce_scatter")
    heads = c.num_attention_heads // layout.tp  # K/V repeated to the query heads before attention
    kv = 2 * tokens * heads * c.head_dim  # this rank's K and V elements, sent on at every step
    step = lambda nbytes: hw.collective("p2p", nbytes, 2, inter_node, blocking=True)  # noqa: E731
    exchange = (passes + 1) * (layout.cp - 1) * step(kv * a) + layout.cp * step(kv * 4)
    merges = ((layout.cp - 1) * passes * RING_MERGE_FORWARD_BYTES + layout.cp * RING_MERGE_BACKWARD_BYTES) * (
        tokens * heads * c.head_dim)
    return exchange + merges / (hw.gpu.hbm_tbs * 1e12 * problem.time_model.hbm_efficiency)
