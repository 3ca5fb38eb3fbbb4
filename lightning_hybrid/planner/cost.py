"""The planner's cost model: the predicted memory and step time of one layout (:func:`estimate`).

Per micro-batch and pipeline rank, the work of its blocks (GEMMs at their efficiency, attention, elementwise bytes,
recompute, exposed TP and CP collectives), the embedding's and the head's; per step, the pipeline's bubble, the
exposed data-parallel communication, the optimizer and, on CPU, the cores the processes share
(:mod:`lightning_hybrid.planner.step_time` describes each term and its constants). The memory of each pipeline rank
is :mod:`~lightning_hybrid.planner.layout_memory`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable

from lightning_hybrid.models.qwen2.config import flops_per_token
from lightning_hybrid.planner.collectives import fsdp_block_gathers, tp_all_reduce_equivalents
from lightning_hybrid.planner.context_parallel import blockwise_attention_seconds, cp_block_seconds
from lightning_hybrid.planner.expert_time import ExpertTime, expert_time
from lightning_hybrid.planner.experts import expert_gemms, is_moe
from lightning_hybrid.planner.kernels import gemm_seconds, hbm_seconds
from lightning_hybrid.planner.layout import Estimate, Layout, Problem
from lightning_hybrid.planner.layout_memory import (
    LOW_PRECISION_BYTES,
    LayoutShape,
    activation_bytes,
    block_numel,
    layout_shape,
    rank_memory_shape_breakdown,
)
from lightning_hybrid.planner.step_time import (
    AUTOCAST_WEIGHT_CAST_BYTES,
    ELEMENTWISE_BACKWARD,
    SELECTIVE_POLICIES,
    block_gemms,
    elementwise_bytes,
    float8_cast_elements,
    gemm_efficiency,
)
from lightning_hybrid.planner.tp_comm import tp_block_seconds

__all__ = ["estimate", "P2P_PER_BOUNDARY", "OPTIMIZER_PARAM_PASSES", "OPTIMIZER_GRAD_PASSES",
           "OPTIMIZER_STATE_PASSES", "LOSS_BYTES_PER_LOGIT"]

# TP collectives of the activations per block and micro-batch, in all-reduces (a reduce-scatter + all-gather pair
# of sequence parallelism moves the same bus bytes): planner/collectives.py's tp_all_reduce_equivalents, held
# against the traced steps (without sequence parallel 2 forward + 2 backward with fused projections, 5 without, one
# per colwise projection; full recompute replays 1, counted as recompute).
P2P_PER_BOUNDARY = 2  # warm-up sends activations forward, cool-down sends their gradients back
# Memory passes of one AdamW step per parameter element: the parameter is read and written, the gradient
# read, exp_avg and exp_avg_sq read and written and foreach's sqrt(exp_avg_sq) temporary written and read.
OPTIMIZER_PARAM_PASSES = 2
OPTIMIZER_GRAD_PASSES = 1
OPTIMIZER_STATE_PASSES = 6
# Bytes per logit and token of the cross-entropy in fp32, outside the compiled blocks in every stack here: the cast
# of the bf16 logits (2 + 4), max and exp-sum reads (4 + 4), log-softmax (4 + 4), its gradient (4 + 4), the cast
# back (4 + 2): about 36.
LOSS_BYTES_PER_LOGIT = 36


def _spans_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


@dataclass(frozen=True)
class _Work:
    """Seconds of one micro-batch on one pipeline rank, by kind, and the GEMM FLOPs behind ``gemm``."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0  # exposed TP collectives of forward and backward
    gemm_flops: float = 0.0
    cp: float = 0.0  # the K/V exchange of context parallelism, forward (all-gather) and backward (reduce-scatter)
    p2p: float = 0.0  # pipeline transfers in the critical path (only on CPU cores with none spare; else overlapped)
    ep: float = 0.0  # a mixture of experts' all-to-alls and load sums, exposed (planner/experts.py)

    def _values(self) -> tuple[float, ...]:
        # the fields' values in order (``astuple`` deep-copies each float: a third of a search's time)
        return tuple(getattr(self, name) for name in _WORK_FIELDS)

    def __add__(self, other: "_Work") -> "_Work":
        return _Work(*(x + y for x, y in zip(self._values(), other._values())))

    def __mul__(self, k: float) -> "_Work":
        return _Work(*(x * k for x in self._values()))

    @property
    def compute(self) -> float:
        """The model's own work: GEMMs, attention and elementwise ops, forward and backward."""
        return self.gemm + self.attention + self.elementwise

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp + self.cp + self.p2p + self.ep


_WORK_FIELDS = tuple(f.name for f in fields(_Work))


@dataclass(frozen=True)
class _RankCost:
    """One pipeline rank: its memory breakdown, rank_memory's figures and its work per micro-batch."""

    memory: dict[str, float]
    state: dict[str, int]
    work: _Work



def _tp_seconds(problem: Problem, layout: Layout, kind: str, nbytes: float) -> float:
    """One TP collective, as much of it as stays exposed (all of it unless TP communication is overlapped)."""
    hw = problem.hw
    seconds = hw.collective(kind, nbytes, layout.tp, False, blocking=True)
    return seconds * (problem.time_model.tp_overlap_exposed if problem.runtime.tp_overlap else 1.0)


def _float8_cast_seconds(problem: Problem, layout: Layout, tokens: int,
                         shapes: dict[str, tuple[int, int]]) -> dict[str, float]:
    """HBM seconds of torchao's dynamic float8 casts of each block linear per micro-batch (0 without float8 or with
    fused casts): :func:`~lightning_hybrid.planner.step_time.float8_cast_elements` at ``FLOAT8_CAST_BYTES`` each."""
    rt = problem.runtime
    if rt.float8 is None or rt.float8_fused_casts:
        return dict.fromkeys(shapes, 0.0)
    elements = float8_cast_elements(shapes, tokens, layout.tp, layout.sequence_parallel, rt.float8,
                                    layout.data_parallel in ("fsdp", "hsdp"))
    return {name: hbm_seconds(problem, problem.time_model.float8_cast_bytes * e) for name, e in elements.items()}


# _block_work's results by (problem, tokens and the layout fields it reads): a search asks for the same block under
# thousands of candidates that differ only in pp, dp, micro-batching and schedule
_BLOCK_WORK: dict[tuple, "_Work"] = {}
_BLOCK_WORK_LIMIT = 65536


def _block_work(problem: Problem, layout: Layout, tokens: int, sparse: bool = False) -> _Work:
    """One block on one TP rank for a micro-batch of ``tokens`` (see :mod:`~lightning_hybrid.planner.step_time`);
    ``sparse``: a mixture of experts' block (:mod:`~lightning_hybrid.planner.experts`)."""
    key = (problem, tokens, layout.tp, layout.sequence_parallel, layout.recompute, layout.cp, layout.data_parallel,
           layout.ep, layout.data_ranks if sparse else 0, sparse)
    work = _BLOCK_WORK.get(key)
    if work is None:
        if len(_BLOCK_WORK) >= _BLOCK_WORK_LIMIT:
            _BLOCK_WORK.clear()
        work = _BLOCK_WORK[key] = _compute_block_work(problem, layout, tokens, sparse)
    return work


# the matmuls of a dense block's SwiGLU (block_gemms' names, fused or not): a sparse block has the expert path instead
_MLP_GEMMS = ("gate", "up", "gate_up", "down")


def _compute_block_work(problem: Problem, layout: Layout, tokens: int, sparse: bool = False) -> _Work:
    """:func:`_block_work` without the memo (it reads only the layout fields in the memo's key)."""
    c, rt = problem.config, problem.runtime
    shapes = {name: kn for name, kn in block_gemms(c, layout.tp, rt.fused_projections).items()
              if not (sparse and name in _MLP_GEMMS)}
    casts = _float8_cast_seconds(problem, layout, tokens, shapes)  # in the GEMM's time: recompute replays them too
    gemms = {name: gemm_seconds(problem, tokens, k, n, float8=True) + casts[name] for name, (k, n) in shapes.items()}
    attention_flops = 12 * tokens * c.num_attention_heads * c.head_dim / layout.tp * problem.seq_len
    attention = attention_flops / (problem.hw.peak_flops(problem.precision) * problem.time_model.attention_efficiency)
    replayed_attention = attention / 3  # what a full recompute of the block adds
    if layout.cp > 1 and rt.ring_attention == "blockwise":  # this project's core: fp32 matmuls, block by block
        attention, replayed_attention = blockwise_attention_seconds(problem, layout, tokens)
    a, r = activation_bytes(problem)
    # the expert path: on every tp rank for all the micro-batch's tokens (gathered first under sequence parallel)
    experts = expert_time(problem, layout, tokens, a, r) if sparse else ExpertTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    forward_bytes = elementwise_bytes(c, layout.tp, layout.sequence_parallel, a, r, rt, mlp=not sparse) * tokens
    forward_bytes += experts.elementwise_bytes
    if r > a:  # autocast casts the block's fp32 matmul weights once per forward
        forward_bytes += AUTOCAST_WEIGHT_CAST_BYTES * (sum(k * n for k, n in shapes.values()) + experts.weights)
    elementwise = hbm_seconds(problem, forward_bytes)
    per_block, replayed = tp_all_reduce_equivalents(layout.sequence_parallel, sparse, rt.fused_projections)
    tp, exposed = tp_block_seconds(problem, layout, tokens * c.hidden_size * a, per_block, gemms)
    one = exposed * problem.hw.collective("all_reduce", tokens * c.hidden_size * a, layout.tp, False, blocking=True)
    gemm = sum(gemms.values()) + experts.gemm
    recompute = experts.replayed
    if layout.recompute == "full":  # the whole forward again: a third of the GEMMs and of attention
        recompute += gemm / 3 + replayed_attention + elementwise + replayed * one
    elif layout.recompute == "selective":
        policy = SELECTIVE_POLICIES[rt.selective]
        gathers = policy.tp_all_gathers / 2 * one if layout.sequence_parallel else 0.0
        rerun = [name for name in policy.rerun(rt.fused_projections) if name in gemms]
        recompute += sum(gemms[name] for name in rerun) / 3 + elementwise + gathers
    return _Work(gemm=gemm, attention=attention, elementwise=elementwise * (1 + ELEMENTWISE_BACKWARD),
                 recompute=recompute, tp=tp, ep=experts.all_to_all,
                 gemm_flops=sum(6 * tokens * k * n for k, n in shapes.values()) + experts.gemm_flops,
                 cp=cp_block_seconds(problem, layout, tokens, a))


def _head_work(problem: Problem, layout: Layout, tokens: int) -> _Work:
    """Final norm, LM head and loss on the last stage: the head GEMM, the loss's fp32 passes, its TP collectives."""
    c, rt = problem.config, problem.runtime
    a, _ = activation_bytes(problem)
    vocab = -(-c.vocab_size // layout.tp)
    loss_vocab = vocab if rt.loss_parallel else c.vocab_size
    per_logit = LOSS_BYTES_PER_LOGIT
    tp = 0.0
    if layout.tp > 1:  # the head input's gradient; this project also gathers the logits to every TP rank
        tp = _tp_seconds(problem, layout, "all_reduce", tokens * c.hidden_size * a)
        if not rt.loss_parallel:
            tp += _tp_seconds(problem, layout, "all_gather", tokens * c.vocab_size * a)
    return _Work(gemm=gemm_seconds(problem, tokens, c.hidden_size, vocab),
                 elementwise=hbm_seconds(problem, tokens * loss_vocab * per_logit), tp=tp,
                 gemm_flops=6 * tokens * c.hidden_size * vocab)


def _rank_work(problem: Problem, layout: Layout, shape: LayoutShape, pp_rank: int) -> _Work:
    """One micro-batch on a pipeline rank: its blocks, the embedding on the first stage, the head on the last."""
    stages = shape.rank_stages[pp_rank]
    blocks = sum(shape.stage_blocks[s] for s in stages)
    sparse = sum(shape.stage_sparse[s] for s in stages) if shape.stage_sparse else 0
    work = _block_work(problem, layout, shape.tokens) * (blocks - sparse)
    if sparse:
        work = work + _block_work(problem, layout, shape.tokens, sparse=True) * sparse
    if 0 in stages and layout.tp > 1:  # the vocabulary-parallel embedding's output
        residual = activation_bytes(problem)[1]
        nbytes = shape.tokens * problem.config.hidden_size * residual
        work = work + _Work(tp=_tp_seconds(problem, layout, "all_reduce", nbytes))
    if shape.last_stage in stages:
        work = work + _head_work(problem, layout, shape.tokens)
    if layout.pp > 1 and problem.hw.scheduling_wait_s:
        # CPU cores with none spare: a rank receiving its stage input (and its output gradient) waits for the sender
        # to be scheduled; on GPUs the steady state's transfers overlap with compute
        received = 2 - (0 in stages) - (shape.last_stage in stages) if layout.virtual_stages == 1 else 2
        nbytes = shape.tokens * problem.config.hidden_size * activation_bytes(problem)[1]
        work = work + _Work(p2p=received * problem.hw.collective("p2p", nbytes, 2, False, blocking=True))
    return work


def _rank_cost(problem: Problem, layout: Layout, shape: LayoutShape, pp_rank: int) -> _RankCost:
    memory, state = rank_memory_shape_breakdown(problem, layout, shape, pp_rank)
    return _RankCost(memory, state, _rank_work(problem, layout, shape, pp_rank))


def _fsdp_seconds(problem: Problem, layout: Layout, state: dict[str, int]) -> Callable[[str, float, str], float]:
    """``seconds(kind, bytes per element, unit)`` of FSDP's collective over a pipeline rank's ``"stage"`` or one
    ``"block"``: over the shard ranks (dp x cp, ``tp`` apart), and under ``ep > 1`` the experts' part over the data
    ranks holding the same experts (dp x cp / ep, ``ep x tp`` apart; none when that is one rank)."""
    hw, config = problem.hw, problem.config
    ranks = [d * layout.tp for d in range(layout.shard_ranks)]
    dense = functools.partial(hw.collective, ranks=layout.shard_ranks, inter_node=_spans_nodes(ranks, hw.gpus_per_node))
    experts = functools.partial(hw.collective, ranks=layout.expert_shard_ranks,
                                inter_node=_spans_nodes(ranks[::layout.ep], hw.gpus_per_node))
    sparse = layout.ep > 1 and is_moe(config)
    block_experts = 3 * config.hidden_size * config.moe_intermediate_size * config.num_experts // layout.ep \
        if sparse else 0
    numel = {"stage": (state["stage_param_numel"], state["expert_param_numel"] if sparse else 0),
             "block": (block_numel(config, layout.tp, layout.ep), block_experts)}

    def seconds(kind: str, element_bytes: float, unit: str) -> float:
        total, expert_part = numel[unit]
        return dense(kind, (total - expert_part) * element_bytes) + experts(kind, expert_part * element_bytes)

    return seconds


def _data_parallel_seconds(problem: Problem, layout: Layout, shape: LayoutShape, slowest: _RankCost) -> float:
    """Exposed DP communication per step (see :mod:`lightning_hybrid.planner.step_time`)."""
    if layout.data_ranks == 1:
        return 0.0
    hw, prec, state, rt = problem.hw, shape.precision, slowest.state, problem.runtime
    # the data ranks (dp x cp, or HSDP's shard group) are tp apart
    inter_node = _spans_nodes([d * layout.tp for d in range(layout.shard_ranks)], hw.gpus_per_node)
    dp_collective = functools.partial(hw.collective, ranks=layout.shard_ranks, inter_node=inter_node)
    param_bytes = min(prec.param, LOW_PRECISION_BYTES) if rt.low_precision_params else prec.param
    # what overlapped per-step collectives hide behind: the last micro-batch and the rank's idle pipeline drain
    window = slowest.work.total * (1 + (layout.pp - 1) / layout.virtual_stages)
    if not shape.fsdp:
        if rt.dp_overlap:  # distributed optimizer: reduce-scatter the gradients, all-gather the parameters
            comm = (dp_collective("reduce_scatter", state["grad_numel"] * prec.grad)
                    + dp_collective("all_gather", state["param_numel"] * param_bytes))
            return max(0.0, comm - window)
        return dp_collective("all_reduce", state["grad_numel"] * prec.grad)
    fsdp = _fsdp_seconds(problem, layout, state)
    gather = fsdp("all_gather", param_bytes, "stage")
    scatter = fsdp("reduce_scatter", prec.grad, "stage") + _replica_all_reduce(
        problem, layout, state["stage_param_numel"] * prec.grad / layout.shard_ranks)
    if layout.pp > 1:  # the stage once, and each block again m times (fsdp_block_gathers), reduced once
        regather = fsdp("all_gather", param_bytes, "block") * state["blocks"]
        # traced for 1F1B and GPipe; the multi-stage schedules' UNSHARD/RESHARD actions are not: once per step there
        single = layout.virtual_stages == 1 and layout.schedule in ("1f1b", "gpipe")
        extra = fsdp_block_gathers(layout.pp, layout.microbatches) - 1 if single and rt.fsdp_regather else 0
        if hw.scheduling_wait_s:  # no spare core: nothing runs alongside
            return gather + scatter + extra * regather
        exposed = extra * max(0.0, regather - slowest.work.total)  # prefetched behind the micro-batch's compute
        overlapped = rt.dp_overlap or not rt.fsdp_regather  # gathered once per step: the reduce-scatter overlaps
        return (max(0.0, gather + scatter - window) if overlapped else gather + scatter) + exposed
    per_microbatch = 2 * gather + scatter  # forward and backward all-gather, one reduce-scatter
    if hw.scheduling_wait_s:  # no spare core: no core is free to run the prefetched collectives alongside
        return layout.microbatches * per_microbatch
    first_unit = fsdp("all_gather", param_bytes, "block")
    return layout.microbatches * max(0.0, per_microbatch - slowest.work.total) + first_unit


def _replica_all_reduce(problem: Problem, layout: Layout, nbytes: float) -> float:
    """HSDP's second level: the all-reduce of each rank's reduce-scattered gradient shard (``nbytes``) across the
    ``dp // dp_shard`` replica groups, whose peers are a shard group apart (across nodes once it fills one)."""
    if layout.data_parallel != "hsdp" or layout.dp == layout.dp_shard:
        return 0.0
    hw, stride = problem.hw, layout.tp * layout.shard_ranks
    inter_node = _spans_nodes([r * stride for r in range(layout.dp // layout.dp_shard)], hw.gpus_per_node)
    return hw.collective("all_reduce", nbytes, layout.dp // layout.dp_shard, inter_node)


def _pipeline_bubble_seconds(problem: Problem, layout: Layout, shape: LayoutShape, slowest: _RankCost) -> float:
    """Idle time of the pipeline's warm-up and cool-down, with their point-to-point transfers."""
    p2p = 0.0
    if layout.pp > 1:
        hw, neighbours = problem.hw, layout.tp * layout.data_ranks  # pipeline neighbours are tp*dp*cp ranks apart
        # the slowest boundary sets the pace
        inter_node = any(i // hw.gpus_per_node != (i + neighbours) // hw.gpus_per_node
                         for i in range((layout.pp - 1) * neighbours))
        _, residual = activation_bytes(problem)
        one = hw.collective("p2p", shape.tokens * problem.config.hidden_size * residual, 2, inter_node)
        # the first micro-batch's activations cross pp - 1 boundaries before the last rank starts (with any v:
        # its chunks are v times smaller, its ramp as many boundaries), the last gradients as many when draining
        p2p = P2P_PER_BOUNDARY * (layout.pp - 1) * one
    return (layout.pp - 1) / layout.virtual_stages * slowest.work.total + p2p


def _optimizer_seconds(problem: Problem, shape: LayoutShape, slowest: _RankCost) -> float:
    """The optimizer step of the slowest rank, bound by memory bandwidth."""
    prec = shape.precision
    passes = (OPTIMIZER_PARAM_PASSES * prec.param + OPTIMIZER_GRAD_PASSES * prec.grad
              + OPTIMIZER_STATE_PASSES * prec.state)
    return slowest.state["param_numel"] * passes / (problem.hw.gpu.hbm_tbs * 1e12)


def _time_detail(problem: Problem, layout: Layout, shape: LayoutShape, work: _Work) -> dict:
    """What the compute time is made of, per step, and the efficiency each GEMM is planned at (a mixture of experts'
    router and experts at their rows: tokens x k x ep / E per local expert)."""
    hw, m, tokens = problem.hw, layout.microbatches, shape.tokens
    c = problem.config
    shapes = {name: (tokens, k, n) for name, (k, n) in block_gemms(c, layout.tp, problem.runtime.fused_projections
                                                                    ).items() if not (is_moe(c) and name in _MLP_GEMMS)}
    shapes["head"] = (tokens, c.hidden_size, -(-c.vocab_size // layout.tp))
    if is_moe(c):
        shapes.update({name: (rows, k, n) for name, (rows, k, n, _) in expert_gemms(c, tokens, layout.ep).items()})
    return {"gemm": m * work.gemm, "attention": m * work.attention, "elementwise": m * work.elementwise,
            "gemm_efficiency": work.gemm_flops / (hw.peak_flops(problem.precision) * work.gemm) if work.gemm else 0.0,
            "gemm_shapes": {name: [rows, k, n] for name, (rows, k, n) in shapes.items()},
            "gemm_efficiencies": {name: gemm_efficiency(hw.compute_efficiency, problem.time_model.gemm_knee, rows,
                                                        k, n) for name, (rows, k, n) in shapes.items()}}


def _core_sharing_seconds(problem: Problem, layout: Layout, ranks: list[_RankCost], time: dict[str, float]) -> float:
    """CPU processes on fewer cores than processes: a step takes at least the node's compute over its cores, plus
    its communication.

    Every rank's compute, recompute and optimizer run on the shared cores; pipeline ranks idle in the bubble leave
    their core to others. The collectives are not spread over the cores: their times come from a preflight that
    measured them with every process taking part, sharing included, and a rank waiting in one holds no core. 0 on
    GPUs (``Hardware.cores_per_node`` unset).
    """
    hw = problem.hw
    if not hw.cores_per_node or hw.gpus_per_node <= hw.cores_per_node:
        return 0.0
    on_node = min(hw.gpus_per_node, hw.gpus)  # processes of a node: on_node / pp of them per pipeline position
    busy = on_node / layout.pp * sum(layout.microbatches * (r.work.compute + r.work.recompute) for r in ranks)
    busy += on_node * time["optimizer"]
    communication = sum(time.get(key, 0.0) for key in ("tp_comm", "dp_comm", "cp_comm", "ep_comm"))
    return max(0.0, busy / hw.cores_per_node + communication - sum(time.values()))


def estimate(problem: Problem, layout: Layout) -> Estimate:
    """Memory and step time of ``layout`` for ``problem`` (memory of the fullest pipeline rank)."""
    shape = layout_shape(problem, layout)
    ranks = [_rank_cost(problem, layout, shape, r) for r in range(layout.pp)]
    fullest = max(range(layout.pp), key=lambda r: ranks[r].memory["total"])
    slowest = max(ranks, key=lambda rank: rank.work.total)
    m, work = layout.microbatches, slowest.work
    time = {"compute": m * work.compute, "recompute": m * work.recompute, "tp_comm": m * work.tp + m * work.p2p,
            "pp_bubble": _pipeline_bubble_seconds(problem, layout, shape, slowest),
            "dp_comm": _data_parallel_seconds(problem, layout, shape, slowest),
            "optimizer": _optimizer_seconds(problem, shape, slowest)}
    if layout.cp > 1:
        time["cp_comm"] = m * work.cp
    if is_moe(problem.config):
        time["ep_comm"] = m * work.ep
    time["core_sharing"] = _core_sharing_seconds(problem, layout, ranks, time)
    time["step"] = sum(time.values())
    step_tokens = problem.global_batch * problem.seq_len
    model_flops = step_tokens * flops_per_token(problem.config, problem.seq_len)
    mfu = model_flops / (time["step"] * problem.hw.gpus * problem.hw.peak_flops(problem.precision))
    checkpoint_bytes = max(rank.state["param_bytes"] + rank.state["optimizer_bytes"] for rank in ranks)
    return Estimate(layout, ranks[fullest].memory, problem.hw.usable_bytes, time, mfu, step_tokens / time["step"],
                    fullest, checkpoint_bytes=checkpoint_bytes, detail=_time_detail(problem, layout, shape, work))

