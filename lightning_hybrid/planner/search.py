"""``lightning-hybrid plan``: which (tp, pp, dp, micro-batch, recompute) layout fits and is fastest.

The planner enumerates tensor parallel sizes inside a node, pipeline sizes, data parallel size and
mode (FSDP or replication), micro-batch size and count, pipeline schedule with virtual stages,
activation recompute and sequence parallelism; for each it predicts the per-GPU memory
(:mod:`lightning_hybrid.planner.memory`, exact for parameters, gradients and optimizer states) and
the step time (:mod:`lightning_hybrid.planner.step_time`), and ranks the layouts that fit by step time.

    python -m lightning_hybrid.planner --model qwen2.5-72b --gpus 128 --gpus-per-node 8 --gpu b300 --seq-len 4096
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from lightning_hybrid.distributed.parallel_dims import divisors
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.distributed.pipeline.schedules import validate_schedule
from lightning_hybrid.planner.memory import (PRECISIONS, RECOMPUTE, activation_model,
                                             inflight_microbatches, rank_memory, rank_parameter_shapes, rank_stages,
                                             split_blocks)
from lightning_hybrid.planner.step_time import Hardware, collective_seconds

__all__ = ["Layout", "Estimate", "estimate", "search", "explain", "rank_memory"]

# (schedule, virtual stages) tried for pp > 1; pp == 1 uses ("none", 1).
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
SELECTIVE_OVERHEAD = 1.03  # recomputing norms, rotary and SiLU costs ~3% of a block's time


@dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes, data parallel mode, micro-batching, schedule and recompute."""

    tp: int
    pp: int
    dp: int
    data_parallel: str
    micro_batch_size: int
    microbatches: int
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False

    def describe(self) -> str:
        mode = self.data_parallel if self.dp > 1 else "none"
        sched = self.schedule if self.pp > 1 else "-"
        if self.virtual_stages > 1:
            sched += f"(v={self.virtual_stages})"
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} {mode} mbs={self.micro_batch_size} m={self.microbatches} "
                f"{sched} recompute={self.recompute}{' sp' if self.sequence_parallel else ''}")


@dataclass
class Estimate:
    """Predicted per-GPU memory (bytes, on the fullest rank) and step time (seconds) of a layout."""

    layout: Layout
    memory: dict[str, float]
    usable: float
    time: dict[str, float]
    mfu: float
    tokens_per_second: float
    worst_stage: int
    reason: str = ""
    checkpoint_bytes: float = 0.0

    @property
    def fits(self) -> bool:
        return not self.reason and self.memory["total"] <= self.usable

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout), "fits": self.fits, "reason": self.reason or None,
                "memory_gb": {k: v / 1e9 for k, v in self.memory.items()}, "usable_gb": self.usable / 1e9,
                "worst_pp_rank": self.worst_stage, "time_s": self.time, "mfu": self.mfu,
                "tokens_per_second": self.tokens_per_second}


@dataclass(frozen=True)
class Problem:
    """What is being planned: model, hardware and training shape."""

    config: Qwen2Config
    hw: Hardware
    seq_len: int
    global_batch: int
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    schedules: tuple = field(default=PIPELINE_SCHEDULES)


def _block_matmul_params(c: Qwen2Config) -> int:
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return 2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size


def model_flops_per_token(c: Qwen2Config, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L q s`` (N: matmul parameters incl. the head; PaLM convention)."""
    n = c.num_hidden_layers * _block_matmul_params(c) + c.hidden_size * c.vocab_size
    return 6 * n + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_len


def _layout_reason(p: Problem, tp: int, pp: int, dp: int, v: int) -> str:
    """Why a mesh cannot run this model at all ('' when it can)."""
    c = p.config
    if tp > p.hw.gpus_per_node:
        return f"tp={tp} leaves the node ({p.hw.gpus_per_node} GPUs per node)"
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(c, name) % tp:
            return f"tp={tp} does not divide {name}={getattr(c, name)}"
    if c.tie_word_embeddings and (tp > 1 or pp > 1):
        return "tied embeddings are not supported with tp>1 or pp>1"
    if pp * v > c.num_hidden_layers:
        return f"pp*virtual_stages={pp * v} exceeds {c.num_hidden_layers} blocks"
    if p.global_batch % dp:
        return f"global batch {p.global_batch} is not divisible by dp={dp}"
    return ""


@functools.lru_cache(maxsize=65536)
def _rank_memory(config: Qwen2Config, tp: int, pp: int, dp: int, mode: str, r: int, precision: str,
                 optimizer: str, v: int) -> dict[str, int]:
    return rank_memory(config, tp, pp, dp, mode, r, 0, 0, precision, optimizer, v)


def _spans_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


@functools.lru_cache(maxsize=1024)
def _block_numel(config: Qwen2Config, tp: int) -> int:
    """TP-local parameters of one block (an FSDP unit)."""
    shapes = rank_parameter_shapes(config, tp, 0, [0], embedding=False, head=False)
    return sum(math.prod(s) for s in shapes.values())


def estimate(p: Problem, layout: Layout) -> Estimate:
    """Memory and step time of ``layout`` for problem ``p`` (memory of the fullest pipeline rank)."""
    c, hw, L = p.config, p.hw, layout
    prec = PRECISIONS[p.precision]
    tokens = L.micro_batch_size * p.seq_len
    act = activation_model(c, L.tp, L.sequence_parallel, L.recompute, p.precision, p.seq_len)
    stages = rank_stages(L.pp, L.virtual_stages)
    counts = split_blocks(c, L.pp * L.virtual_stages)
    last = L.pp * L.virtual_stages - 1
    fsdp = L.data_parallel == "fsdp" and L.dp > 1
    mode = "fsdp" if fsdp else "replicate"
    td = L.tp * L.dp
    dp_inter = _spans_nodes([d * L.tp for d in range(L.dp)], hw.gpus_per_node)
    # pipeline neighbours are tp*dp ranks apart; the slowest boundary sets the pace
    pp_inter = any(i // hw.gpus_per_node != (i + td) // hw.gpus_per_node for i in range((L.pp - 1) * td))
    peak = hw.peak_flops(p.precision)
    size = min(tokens, c.hidden_size // L.tp, c.intermediate_size // L.tp)
    eff = hw.compute_efficiency * size / (size + 128)
    tp_bw, tp_lat = hw.bus_bandwidth(False), hw.latency(False)
    block_flops = (6 * _block_matmul_params(c) + 12 * c.num_attention_heads * c.head_dim * p.seq_len)
    if L.recompute == "full":
        block_flops *= 4 / 3
    head_flops = 6 * c.hidden_size * c.vocab_size
    ar = functools.partial(collective_seconds, ranks=L.tp, bus_bandwidth=tp_bw, latency=tp_lat)
    block_tp = (6 if L.recompute == "full" else 4) * ar("all_reduce", tokens * c.hidden_size * prec.compute)

    worst, worst_stage, stage_times = None, 0, []
    for r in range(L.pp):
        mem = _rank_memory(c, L.tp, L.pp, L.dp, mode, r, p.precision, p.optimizer, L.virtual_stages)
        inflight = inflight_microbatches(L.schedule, L.pp, L.virtual_stages, L.microbatches, r)
        held = sum(n * (counts[s] * act.layer + (act.embedding if s == 0 else 0) + (act.head if s == last else 0))
                   for n, s in zip(inflight, stages[r])) * tokens
        has_head = last in stages[r]
        working = max(act.layer_working, act.loss_working if has_head else 0.0) * tokens
        gathered = mem["stage_param_numel"] * prec.param
        if fsdp and L.pp > 1:  # torch's schedules keep the stage unsharded (params and grads) through the step
            fsdp_buffers = gathered + mem["stage_param_numel"] * prec.grad
        elif fsdp:  # the root unit (embedding, norm, head) stays gathered; two blocks in flight with prefetch
            block = _block_numel(c, L.tp) * prec.param
            fsdp_buffers = gathered - block * mem["blocks"] + 2 * block
        else:
            fsdp_buffers = 50e6 if L.dp > 1 else 0.0  # the all-reduce buckets
        # autocast's low-precision weight copies are saved for backward unless the block is recomputed
        # (then only the recomputed block's copies exist, counted with its working set)
        autocast = mem["matmul_param_numel"] * prec.autocast_copy
        if L.recompute != "none":
            autocast = (autocast - mem["blocks"] * _block_numel(c, L.tp) * prec.autocast_copy
                        + _block_numel(c, L.tp) * prec.autocast_copy)
        optimizer_temp = mem["param_numel"] * prec.state  # foreach AdamW's sqrt(exp_avg_sq) temporary
        static = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        extra = held + working + fsdp_buffers + autocast
        memory = {"weights": mem["param_bytes"], "gradients": mem["grad_bytes"], "optimizer": mem["optimizer_bytes"],
                  "activations": held, "working": working, "fsdp_buffers": fsdp_buffers, "autocast_copies": autocast,
                  "total": static + max(extra, optimizer_temp)}
        if worst is None or memory["total"] > worst[0]["total"]:
            worst, worst_stage = (memory, mem), r
        flops = sum(counts[s] * block_flops + (head_flops if s == last else 0) for s in stages[r]) * tokens / L.tp
        if L.recompute == "selective":
            flops *= SELECTIVE_OVERHEAD
        tp_time = 0.0
        if L.tp > 1:
            tp_time = sum(counts[s] for s in stages[r]) * block_tp
            if 0 in stages[r]:
                tp_time += ar("all_reduce", tokens * c.hidden_size * prec.residual)
            if has_head:
                tp_time += ar("all_gather", tokens * c.vocab_size * prec.compute)
                tp_time += ar("all_reduce", tokens * c.hidden_size * prec.compute)
        stage_times.append((flops / (peak * eff), tp_time, mem))
    assert worst is not None
    memory, _ = worst

    m = L.microbatches
    slowest = max(range(L.pp), key=lambda r: stage_times[r][0] + stage_times[r][1])
    compute_mb, tp_mb, mem = stage_times[slowest]
    dp_bw, dp_lat = hw.bus_bandwidth(dp_inter), hw.latency(dp_inter)
    stage_bytes = mem["stage_param_numel"] * prec.param
    if L.dp == 1:
        dp_time = 0.0
    elif not fsdp:
        dp_time = collective_seconds("all_reduce", mem["grad_numel"] * prec.grad, L.dp, dp_bw, dp_lat)
    elif L.pp > 1:
        dp_time = (collective_seconds("all_gather", stage_bytes, L.dp, dp_bw, dp_lat)
                   + collective_seconds("reduce_scatter", mem["stage_param_numel"] * prec.grad, L.dp, dp_bw, dp_lat))
    else:
        per_mb = (2 * collective_seconds("all_gather", stage_bytes, L.dp, dp_bw, dp_lat)
                  + collective_seconds("reduce_scatter", mem["stage_param_numel"] * prec.grad, L.dp, dp_bw, dp_lat))
        first_unit = collective_seconds("all_gather", _block_numel(c, L.tp) * prec.param, L.dp, dp_bw, dp_lat)
        dp_time = m * max(0.0, per_mb - compute_mb) + first_unit
    p2p = 0.0
    if L.pp > 1:
        one = collective_seconds("p2p", tokens * c.hidden_size * prec.residual, 2, hw.bus_bandwidth(pp_inter),
                                 hw.latency(pp_inter))
        p2p = 2 * (L.pp - 1) * L.virtual_stages * one
    bubble = (L.pp - 1) / L.virtual_stages * (compute_mb + tp_mb) + p2p
    optimizer_s = mem["param_numel"] * (2 * prec.param + prec.grad + 6 * prec.state) / (hw.gpu.hbm_tbs * 1e12)
    time = {"compute": m * compute_mb, "tp_comm": m * tp_mb, "pp_bubble": bubble, "dp_comm": dp_time,
            "optimizer": optimizer_s}
    time["step"] = sum(time.values())
    step_tokens = p.global_batch * p.seq_len
    mfu = step_tokens * model_flops_per_token(c, p.seq_len) / (time["step"] * hw.gpus * peak)
    checkpoint_bytes = max(s[2]["param_bytes"] + s[2]["optimizer_bytes"] for s in stage_times)
    return Estimate(L, memory, hw.usable_bytes, time, mfu, step_tokens / time["step"], worst_stage,
                    checkpoint_bytes=checkpoint_bytes)


def candidates(p: Problem, tp: int, pp: int, modes: Optional[tuple[str, ...]] = None):
    """Every micro-batching, schedule, recompute and sequence-parallel variant of one mesh."""
    dp = p.hw.gpus // (tp * pp)
    per_replica = p.global_batch // dp
    for mode in modes or (("fsdp", "replicate") if dp > 1 else ("replicate",)):
        for mbs in MICRO_BATCH_SIZES:
            if per_replica % mbs:
                continue
            m = per_replica // mbs
            for schedule, v in (p.schedules if pp > 1 else (("none", 1),)):
                if _layout_reason(p, tp, pp, dp, v):
                    continue
                if pp > 1:
                    try:
                        validate_schedule(schedule, pp, v, m)
                    except ValueError:
                        continue
                for recompute in RECOMPUTE:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        yield Layout(tp, pp, dp, mode, mbs, m, schedule, v, recompute, sp)


def meshes(p: Problem) -> list[tuple[int, int, str]]:
    """(tp, pp, why-not) for every tp inside a node and pp that divide the GPU count."""
    out = []
    for tp in divisors(p.hw.gpus_per_node):
        if p.hw.gpus % tp:
            continue
        for pp in divisors(p.hw.gpus // tp):
            out.append((tp, pp, _layout_reason(p, tp, pp, p.hw.gpus // (tp * pp), 1)))
    return out


def _better(a: Estimate, b: Optional[Estimate]) -> bool:
    if b is None:
        return True
    if a.fits != b.fits:
        return a.fits
    if a.fits:
        return (a.time["step"], a.memory["total"]) < (b.time["step"], b.memory["total"])
    return a.memory["total"] < b.memory["total"]


def search(p: Problem) -> tuple[list[Estimate], list[Estimate]]:
    """(feasible layouts ranked by step time, the smallest-memory infeasible variant of each other mesh).

    Variants that differ only in recompute and sequence parallelism are collapsed to the best one.
    """
    best: dict[tuple, Estimate] = {}
    smallest: dict[tuple, Estimate] = {}
    for tp, pp, reason in meshes(p):
        if reason:
            continue
        for layout in candidates(p, tp, pp):
            e = estimate(p, layout)
            key = (tp, pp, layout.data_parallel, layout.micro_batch_size, layout.schedule, layout.virtual_stages)
            if _better(e, best.get(key)):
                best[key] = e
            mesh_key = (tp, pp, layout.data_parallel)
            if smallest.get(mesh_key) is None or e.memory["total"] < smallest[mesh_key].memory["total"]:
                smallest[mesh_key] = e
    feasible = sorted((e for e in best.values() if e.fits), key=lambda e: (e.time["step"], e.memory["total"]))
    fitting_meshes = {(e.layout.tp, e.layout.pp, e.layout.data_parallel) for e in feasible}
    infeasible = sorted((e for k, e in smallest.items() if k not in fitting_meshes), key=lambda e: e.memory["total"])
    return feasible, infeasible


def explain(p: Problem, tp: int, pp: int, data_parallel: str) -> dict:
    """Why a mesh fits or not: its plainest variant (mbs=1, no recompute) and its smallest-memory variant.

    Returns a dict with ``fits``, ``text`` (one paragraph), ``plain`` and ``smallest`` estimates.
    """
    dp = p.hw.gpus // (tp * pp) if p.hw.gpus % (tp * pp) == 0 else 0
    reason = "" if dp else f"tp*pp={tp * pp} does not divide {p.hw.gpus} GPUs"
    reason = reason or _layout_reason(p, tp, pp, dp, 1)
    name = f"tp={tp}, pp={pp}, {data_parallel if dp > 1 else 'no data parallel'}"
    if reason:
        return {"layout": name, "fits": False, "text": f"{name}: not possible: {reason}.", "plain": None,
                "smallest": None}
    variants = [e for e in (estimate(p, l) for l in candidates(p, tp, pp, (data_parallel,)))]
    if not variants:
        return {"layout": name, "fits": False, "plain": None, "smallest": None,
                "text": f"{name}: no micro-batching satisfies the schedule's constraints"}
    smallest = min(variants, key=lambda e: e.memory["total"])
    plain = next((e for e in variants if e.layout.micro_batch_size == smallest.layout.micro_batch_size
                  and e.layout.recompute == "none" and not e.layout.sequence_parallel), smallest)
    usable = p.hw.usable_bytes / 1e9
    m = smallest.memory
    static = (m["weights"] + m["gradients"] + m["optimizer"]) / 1e9
    params = m["weights"] / PRECISIONS[p.precision].param
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
