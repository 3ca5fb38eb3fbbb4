"""The predicted time of a sparse block's expert path per micro-batch: what :mod:`~lightning_hybrid.planner.experts`
counts (GEMMs at their shapes, elementwise bytes, the exposed all-to-alls and small collectives) on the cluster's
rates. :mod:`~lightning_hybrid.planner.cost` adds it to the block's attention half.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_hybrid.planner.experts import (
    INDEX_BYTES,
    LOAD_STAT_BYTES,
    all_to_all_buffer,
    expert_elementwise_bytes,
    expert_gemms,
)
from lightning_hybrid.planner.kernels import gemm_seconds
from lightning_hybrid.planner.layout import Layout, Problem

__all__ = ["ExpertTime", "expert_time", "ep_spans_nodes"]


@dataclass(frozen=True)
class ExpertTime:
    """The expert path of one sparse block and micro-batch on one rank.

    Attributes:
        gemm: seconds of the router's and the local experts' matmuls, forward and backward.
        gemm_flops: their FLOPs.
        elementwise_bytes: HBM bytes of its elementwise ops in forward.
        weights: its matmul weight elements on this rank (autocast casts them once per forward).
        all_to_all: exposed seconds of the four all-to-alls of the rows, the counts' exchange and the load sum.
        replayed: the part of those a recompute of the block replays.
    """

    gemm: float
    gemm_flops: float
    elementwise_bytes: float
    weights: float
    all_to_all: float
    replayed: float


def ep_spans_nodes(problem: Problem, layout: Layout) -> bool:
    """Whether an ep group leaves the node: its ``ep`` ranks are ``tp x cp`` apart (ep is innermost in dp)."""
    return layout.ep * layout.tp * layout.cp > problem.hw.gpus_per_node


def _collectives(problem: Problem, layout: Layout, tokens: float, compute: int, residual: int) -> tuple[float, float]:
    """(exposed seconds, replayed seconds) of one sparse block's collectives per micro-batch (planner/experts.py):
    with ``ep > 1`` the dispatch (residual dtype) and the combine (compute dtype), forward and backward, and the
    counts' exchange; over the data ranks the load statistics' sum. Full recompute replays the forward's; selective
    ("op") keeps the all-to-alls' outputs and replays the counts and the load sum."""
    c, hw = problem.config, problem.hw
    exposed = full = kept = 0.0
    if layout.ep > 1:
        inter = ep_spans_nodes(problem, layout)

        def all_to_all(nbytes: float) -> float:
            return hw.collective("all_to_all", nbytes, layout.ep, inter, blocking=True)

        rows = all_to_all(all_to_all_buffer(c, tokens, residual)) + all_to_all(all_to_all_buffer(c, tokens, compute))
        counts = all_to_all(INDEX_BYTES * c.num_experts)
        exposed, full, kept = 2 * rows + counts, rows + counts, counts
    if layout.data_ranks > 1:
        load = hw.collective("all_reduce", LOAD_STAT_BYTES * (2 * c.num_experts + 2), layout.data_ranks,
                             layout.data_ranks * layout.tp > hw.gpus_per_node, blocking=True)
        exposed, full, kept = exposed + load, full + load, kept + load
    return exposed, {"full": full, "selective": kept}.get(layout.recompute, 0.0)


def expert_time(problem: Problem, layout: Layout, tokens: float, compute: int, residual: int) -> ExpertTime:
    """The expert path of one sparse block for a micro-batch of ``tokens`` tokens on one rank (every tp rank
    computes all of them: the experts are not split by tp), ``compute`` and ``residual`` the bytes per element of
    matmul activations and of the residual stream."""
    c, gemm, flops, weights = problem.config, 0.0, 0.0, 0.0
    for rows, k, n, count in expert_gemms(c, tokens, layout.ep).values():
        gemm += count * gemm_seconds(problem, rows, k, n)  # not float8: the experts and the router are no Linear
        flops += count * 6 * rows * k * n
        weights += count * k * n
    exposed, replayed = _collectives(problem, layout, tokens, compute, residual)
    return ExpertTime(gemm=gemm, gemm_flops=flops,
                      elementwise_bytes=expert_elementwise_bytes(c, compute, residual, layout.ep) * tokens,
                      weights=weights, all_to_all=exposed, replayed=replayed)
