"""The time of one matmul and of HBM traffic on a problem's GPU: the two rates every compute term of the planner's
step-time model (:mod:`~lightning_hybrid.planner.step_time`) is counted in."""

from __future__ import annotations

from lightning_hybrid.planner.layout import Problem
from lightning_hybrid.planner.step_time import FLOAT8_GEMM_EFFICIENCY, gemm_efficiency

__all__ = ["gemm_seconds", "hbm_seconds"]


def gemm_seconds(problem: Problem, tokens: float, k: int, n: int, float8: bool = False) -> float:
    """Forward and backward of a ``tokens x k`` by ``k x n`` matmul: ``6 tokens k n`` FLOPs at its efficiency (a
    float8 block GEMM at the fp8 peak and the recipe's efficiency).

    Raises:
        ValueError: float8 on a GPU whose table lists no fp8 peak.
    """
    hw, recipe = problem.hw, problem.runtime.float8
    if float8 and recipe is not None:
        peak = problem.time_model.float8_efficiency or FLOAT8_GEMM_EFFICIENCY[recipe]
        if hw.gpu.peak.fp8 is None:
            raise ValueError(f"GPU {hw.gpu.name} lists no fp8 peak; plan it without float8")
        efficiency = gemm_efficiency(peak, problem.time_model.gemm_knee, tokens, k, n)
        return 6 * tokens * k * n / (hw.gpu.peak.fp8 * efficiency)
    efficiency = gemm_efficiency(hw.compute_efficiency, problem.time_model.gemm_knee, tokens, k, n)
    return 6 * tokens * k * n / (hw.peak_flops(problem.precision) * efficiency)


def hbm_seconds(problem: Problem, nbytes: float) -> float:
    """Seconds to move ``nbytes`` through HBM at ``TimeModel.hbm_efficiency`` of its bandwidth."""
    return nbytes / (problem.hw.gpu.hbm_tbs * 1e12 * problem.time_model.hbm_efficiency)
