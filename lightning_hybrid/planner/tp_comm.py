"""The TP collectives of one block that stay in the critical path, plain or overlapped with the GEMMs.

Torch's TP runs its collectives on the compute stream: all of them are exposed. Overlapped TP (torch's async
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
"""

from __future__ import annotations

from lightning_hybrid.planner.layout import Layout, Problem

__all__ = ["tp_block_seconds", "TP_GEMM_GROUPS"]

# The matmuls each sequence-parallel collective of a block feeds (all-gathers) or is fed by (reduce-scatters), by the
# names of step_time.block_gemms (fused projections or not).
TP_GEMM_GROUPS = {False: (("q", "k", "v"), ("o",), ("gate", "up"), ("down",)),
                  True: (("qkv",), ("o",), ("gate_up",), ("down",))}


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
