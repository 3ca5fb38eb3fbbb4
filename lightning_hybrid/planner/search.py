"""``lightning-hybrid plan``: which (tp, pp, dp, micro-batch, recompute) layout fits and is fastest.

The planner enumerates tensor parallel sizes inside a node, pipeline sizes, data parallel size and
mode (FSDP, replication or HSDP), context parallelism, micro-batch size and count, pipeline schedule with virtual
stages, activation recompute and sequence parallelism (:mod:`~lightning_hybrid.planner.layout`'s one enumerator);
for each it predicts the per-GPU memory (:mod:`lightning_hybrid.planner.memory`, exact for parameters, gradients and
optimizer states) and the step time (:mod:`lightning_hybrid.planner.cost`), and ranks the layouts that fit by
predicted step time.

    python -m lightning_hybrid.planner --model qwen2.5-72b --gpus 128 --gpus-per-node 8 --gpu b300 --seq-len 4096
"""

from __future__ import annotations

from typing import Iterator, Optional

from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.planner.experts import ep_sizes
from lightning_hybrid.planner.layout import (
    MICRO_BATCH_SIZES,
    PIPELINE_SCHEDULES,
    Choices,
    Estimate,
    Layout,
    Problem,
    context_sizes,
    data_parallel_modes,
    layout_reason,
    layouts,
    mesh_sizes,
)
from lightning_hybrid.planner.layout_memory import rank_memory_breakdown
from lightning_hybrid.planner.memory import PRECISIONS, RECOMPUTE, rank_memory

# The planner's entry points, and the types and estimate they hand out (Layout, Problem, ... live in planner.layout,
# estimate in planner.cost).
__all__ = ["Layout", "Estimate", "Problem", "estimate", "search", "explain", "candidates", "meshes", "rank_memory",
           "layout_reason", "rank_memory_breakdown", "PIPELINE_SCHEDULES"]


def candidates(problem: Problem, tp: int, pp: int,
               modes: Optional[tuple[str, ...]] = None, cp: int = 1, ep: int = 1) -> Iterator[Layout]:
    """Every micro-batch size of :data:`MICRO_BATCH_SIZES`, schedule of ``problem.schedules``, recompute and
    sequence-parallel variant of one mesh (``modes``: only these data-parallel modes; ``ep > 1``: FSDP only)."""
    dp = problem.hw.gpus // (tp * pp * cp)
    per_replica = problem.global_batch // dp
    modes_here = data_parallel_modes(dp, problem.hw.gpus_per_node, tp, cp)
    stages = problem.schedules if pp > 1 else (("none", 1),)
    choices = Choices(modes=tuple(c for c in modes_here if not modes or c[0] in modes),
                      microbatches=tuple(per_replica // mbs for mbs in MICRO_BATCH_SIZES if per_replica % mbs == 0),
                      stages=tuple((s, v) for s, v in stages if not layout_reason(problem, tp, pp, dp, v)),
                      recompute=RECOMPUTE, sequence_parallel=(False, True) if tp > 1 else (False,))
    return layouts(tp, pp, dp, per_replica, choices, cp, ep)


def meshes(problem: Problem) -> list[tuple[int, int, str]]:
    """(tp, pp, why-not) for every tp inside a node and pp that divide the GPU count."""
    return [(tp, pp, layout_reason(problem, tp, pp, dp, 1))
            for tp, pp, dp in mesh_sizes(problem.hw.gpus, problem.hw.gpus_per_node)]


def _better(a: Estimate, b: Optional[Estimate]) -> bool:
    if b is None:
        return True
    if a.fits != b.fits:
        return a.fits
    if a.fits:
        return (a.time["step"], a.memory["total"]) < (b.time["step"], b.memory["total"])
    return a.memory["total"] < b.memory["total"]


def search(problem: Problem) -> tuple[list[Estimate], list[Estimate]]:
    """(feasible layouts ranked by step time, the smallest-memory infeasible variant of each other mesh).

    Variants that differ only in recompute and sequence parallelism are collapsed to the best one.
    """
    best: dict[tuple, Estimate] = {}
    smallest: dict[tuple, Estimate] = {}
    for tp, pp, reason in meshes(problem):
        if reason:
            continue
        for layout in (c for cp in context_sizes(problem, tp) if problem.hw.gpus % (tp * pp * cp) == 0
                       for ep in ep_sizes(problem.config, problem.hw.gpus // (tp * pp * cp))
                       for c in candidates(problem, tp, pp, cp=cp, ep=ep)):
            e = estimate(problem, layout)
            key = (tp, pp, layout.cp, layout.ep, layout.data_parallel, layout.micro_batch_size, layout.schedule,
                   layout.virtual_stages)
            if _better(e, best.get(key)):
                best[key] = e
            mesh_key = (tp, pp, layout.cp, layout.ep, layout.data_parallel)
            if smallest.get(mesh_key) is None or e.memory["total"] < smallest[mesh_key].memory["total"]:
                smallest[mesh_key] = e
    feasible = sorted((e for e in best.values() if e.fits), key=lambda e: (e.time["step"], e.memory["total"]))
    fitting_meshes = {(e.layout.tp, e.layout.pp, e.layout.cp, e.layout.ep, e.layout.data_parallel) for e in feasible}
    infeasible = sorted((e for k, e in smallest.items() if k not in fitting_meshes), key=lambda e: e.memory["total"])
    return feasible, infeasible


def explain(problem: Problem, tp: int, pp: int, data_parallel: str) -> dict:
    """Why a mesh fits or not: its plainest variant (mbs=1, no recompute) and its smallest-memory variant.

    Returns a dict with ``fits``, ``text`` (one paragraph), ``plain`` and ``smallest`` estimates.
    """
    dp = problem.hw.gpus // (tp * pp) if problem.hw.gpus % (tp * pp) == 0 else 0
    reason = "" if dp else f"tp*pp={tp * pp} does not divide {problem.hw.gpus} GPUs"
    reason = reason or layout_reason(problem, tp, pp, dp, 1)
    name = f"tp={tp}, pp={pp}, {data_parallel if dp > 1 else 'no data parallel'}"
    if reason:
        return {"layout": name, "fits": False, "text": f"{name}: not possible: {reason}.", "plain": None,
                "smallest": None}
    variants = [estimate(problem, layout) for layout in candidates(problem, tp, pp, (data_parallel,))]
    if not variants:
        return {"layout": name, "fits": False, "plain": None, "smallest": None,
                "text": f"{name}: no micro-batching satisfies the schedule's constraints"}
    smallest = min(variants, key=lambda e: e.memory["total"])
    plain = next((e for e in variants if e.layout.micro_batch_size == smallest.layout.micro_batch_size
                  and e.layout.recompute == "none" and not e.layout.sequence_parallel), smallest)
    usable = problem.hw.usable_bytes / 1e9
    m = smallest.memory
    static = (m["weights"] + m["gradients"] + m["optimizer"]) / 1e9
    params = m["weights"] / PRECISIONS[problem.precision].param
    sharding = (f"split only {tp * pp}-way (tp x pp), replicated on all dp={dp} ranks" if data_parallel == "replicate"
                or dp == 1 else f"split {tp * pp * dp}-way (tp x pp x FSDP dp)")
    text = (f"{name}: weights + gradients + optimizer states are {static:.1f} GB per GPU "
            f"({params / 1e9:.2f}B parameters {sharding}); with mbs=1 and no recompute the activations add "
            f"{(plain.memory['total'] - static * 1e9) / 1e9:.1f} GB (total {plain.memory['total'] / 1e9:.1f} GB); "
            f"the smallest variant ({smallest.layout.describe()}) needs {m['total'] / 1e9:.1f} GB; "
            f"usable per GPU {usable:.1f} GB -> ")
    if smallest.fits:
        fastest = min((e for e in variants if e.fits), key=lambda e: e.time["step"])
        text += ("fits" + ("" if plain.fits else " only with recompute/sequence parallel")
                 + f"; its fastest variant ({fastest.layout.describe()}) takes {fastest.time['step']:.2f} s per step "
                 f"at {fastest.mfu:.1%} MFU.")
    elif static > usable:
        text += f"does not fit: the model state alone exceeds the GPU by {static - usable:.1f} GB."
    else:
        text += f"does not fit by {m['total'] / 1e9 - usable:.1f} GB."
    return {"layout": name, "fits": smallest.fits, "text": text, "plain": plain.to_dict(),
            "smallest": smallest.to_dict()}
