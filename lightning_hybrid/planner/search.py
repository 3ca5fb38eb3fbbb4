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
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator, Optional

from lightning_hybrid.distributed.data_parallel import GRADIENT_BUCKET_BYTES
from lightning_hybrid.distributed.parallel_dims import divisors, tied_embedding_error
from lightning_hybrid.distributed.pipeline.schedules import validate_schedule
from lightning_hybrid.models.qwen2.config import Qwen2Config, flops_per_token
from lightning_hybrid.planner.collectives import fsdp_block_gathers, tp_all_reduce_equivalents
from lightning_hybrid.planner.memory import (
    PRECISIONS,
    RECOMPUTE,
    ActivationModel,
    Precision,
    activation_model,
    inflight_microbatches,
    rank_memory,
    rank_parameter_shapes,
    rank_stages,
    split_blocks,
)
from lightning_hybrid.planner.step_time import (
    AUTOCAST_WEIGHT_CAST_BYTES,
    ELEMENTWISE_BACKWARD,
    FLOAT8_GEMM_EFFICIENCY,
    SELECTIVE_POLICIES,
    Hardware,
    Runtime,
    TimeModel,
    block_gemms,
    elementwise_bytes,
    gemm_efficiency,
)

__all__ = ["Layout", "Estimate", "estimate", "search", "explain", "rank_memory", "layout_reason",
           "rank_memory_breakdown"]

# (schedule, virtual stages) tried for pp > 1; pp == 1 uses ("none", 1).
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
# TP collectives of the activations per block and micro-batch, in all-reduces (a reduce-scatter + all-gather pair
# of sequence parallelism moves the same bus bytes): planner/collectives.py's tp_all_reduce_equivalents, held
# against the traced steps (without sequence parallel 2 forward + 5 backward, one per colwise projection; full
# recompute replays 1, counted as recompute).
FSDP_BLOCKS_IN_FLIGHT = 2  # without a pipeline, the running block and the prefetched one are gathered
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
# Low-precision (bf16) bytes of weights and activations when Runtime.low_precision_params is set.
LOW_PRECISION_BYTES = 2


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
    cp: int = 1  # context parallel: each sequence split over cp ranks (next to tp), FSDP over dp x cp
    dp_shard: int = 0  # HSDP's shard group (data_parallel "hsdp"); 0 otherwise

    @property
    def data_ranks(self) -> int:
        """Ranks that see different tokens of one replica position and average gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP shards the parameters over: dp x cp, or dp_shard x cp under HSDP."""
        return (self.dp_shard if self.data_parallel == "hsdp" else self.dp) * self.cp

    def describe(self) -> str:
        """One line naming every choice, as the explanations print it."""
        mode = self.data_parallel if self.dp > 1 else "none"
        if self.data_parallel == "hsdp":
            mode += f"(shard={self.dp_shard})"
        if self.cp > 1:
            mode = f"cp={self.cp} {mode}"
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
    detail: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the layout can run and its fullest rank fits in the usable memory."""
        return not self.reason and self.memory["total"] <= self.usable

    def to_dict(self) -> dict:
        """The estimate in GB and seconds, as the JSON report prints it."""
        return {"layout": asdict(self.layout), "fits": self.fits, "reason": self.reason or None,
                "memory_gb": {k: v / 1e9 for k, v in self.memory.items()}, "usable_gb": self.usable / 1e9,
                "worst_pp_rank": self.worst_stage, "time_s": self.time, "mfu": self.mfu,
                "tokens_per_second": self.tokens_per_second, "time_detail": self.detail}


@dataclass(frozen=True)
class Problem:
    """What is being planned: model, hardware and training shape, the software's features and the time constants."""

    config: Qwen2Config
    hw: Hardware
    seq_len: int
    global_batch: int
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    schedules: tuple = field(default=PIPELINE_SCHEDULES)
    runtime: Runtime = field(default_factory=Runtime)
    time_model: TimeModel = field(default_factory=TimeModel)


def _layout_reason(problem: Problem, tp: int, pp: int, dp: int, virtual_stages: int) -> str:
    """Why a mesh cannot run this model at all ('' when it can)."""
    config, num_stages = problem.config, pp * virtual_stages
    if tp > problem.hw.gpus_per_node:
        return f"tp={tp} leaves the node ({problem.hw.gpus_per_node} GPUs per node)"
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, name) % tp:
            return f"tp={tp} does not divide {name}={getattr(config, name)}"
    tied = tied_embedding_error(config.tie_word_embeddings, tp, num_stages)
    if tied:
        return tied
    if num_stages > config.num_hidden_layers:
        return f"pp*virtual_stages={num_stages} exceeds {config.num_hidden_layers} blocks"
    if problem.global_batch % dp:
        return f"global batch {problem.global_batch} is not divisible by dp={dp}"
    return ""


layout_reason = _layout_reason  # public name: the auto layout (planner/auto.py) asks it too


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


# ----------------------------------------------------------------------------- estimate


@dataclass(frozen=True)
class _LayoutShape:
    """What every pipeline rank of a layout shares."""

    tokens: int  # tokens per micro-batch
    activations: ActivationModel
    rank_stages: list[list[int]]  # stage indices per pipeline rank
    stage_blocks: tuple[int, ...]  # blocks per stage
    last_stage: int
    fsdp: bool  # FSDP over dp > 1 (else replication or no data parallelism)
    precision: Precision
    gathered_kv: float = 0.0  # bytes per block and micro-batch of the other cp ranks' K/V kept for backward


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
        return self.compute + self.recompute + self.tp + self.cp + self.p2p


_WORK_FIELDS = tuple(f.name for f in fields(_Work))


@dataclass(frozen=True)
class _RankCost:
    """One pipeline rank: its memory breakdown, rank_memory's figures and its work per micro-batch."""

    memory: dict[str, float]
    state: dict[str, int]
    work: _Work


def _layout_shape(problem: Problem, layout: Layout) -> _LayoutShape:
    num_stages = layout.pp * layout.virtual_stages
    activations = activation_model(problem.config, layout.tp, layout.sequence_parallel, layout.recompute,
                                   problem.precision, problem.seq_len)
    # a rank holds seq_len / cp tokens of each sequence: activations and per-token work divide by cp
    return _LayoutShape(tokens=layout.micro_batch_size * problem.seq_len // layout.cp, activations=activations,
                        rank_stages=rank_stages(layout.pp, layout.virtual_stages),
                        stage_blocks=split_blocks(problem.config, num_stages), last_stage=num_stages - 1,
                        fsdp=layout.data_parallel != "replicate" and layout.data_ranks > 1,
                        precision=PRECISIONS[problem.precision], gathered_kv=_gathered_kv_bytes(problem, layout))


def _gathered_kv_bytes(problem: Problem, layout: Layout) -> float:
    """The K/V of the other cp ranks that ring attention keeps per block for backward (at the K/V's own heads; none
    under full recompute, which keeps only the block input)."""
    if layout.cp == 1 or layout.recompute == "full":
        return 0.0
    c, a = problem.config, _activation_bytes(problem)[0]
    others = layout.micro_batch_size * problem.seq_len * (layout.cp - 1) // layout.cp
    return 2.0 * others * c.num_key_value_heads // layout.tp * c.head_dim * a


def _held_activation_bytes(layout: Layout, shape: _LayoutShape, pp_rank: int) -> float:
    """Activations a pipeline rank holds at its peak: its in-flight micro-batches on each of its stages."""
    act, counts = shape.activations, shape.stage_blocks
    inflight = inflight_microbatches(layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches, pp_rank)
    return sum(n * ((counts[s] * act.layer + (act.embedding if s == 0 else 0)
                     + (act.head if s == shape.last_stage else 0)) * shape.tokens + counts[s] * shape.gathered_kv)
               for n, s in zip(inflight, shape.rank_stages[pp_rank]))


def _data_parallel_buffer_bytes(config: Qwen2Config, layout: Layout, shape: _LayoutShape,
                                state: dict[str, int]) -> float:
    """FSDP's gathered parameters (and unsharded gradients), or the gradient all-reduce bucket."""
    prec = shape.precision
    # FSDP2 gathers in the strategy's param_dtype (bf16 under bf16-mixed), not in the stored fp32
    gathered = state["stage_param_numel"] * prec.gather
    if shape.fsdp and layout.pp > 1:  # torch's schedules keep the stage unsharded (params and grads) through the step
        return gathered + state["stage_param_numel"] * prec.grad
    if shape.fsdp:  # the root unit (embedding, norm, head) stays gathered; two blocks in flight with prefetch
        block = _block_numel(config, layout.tp) * prec.gather
        return gathered - block * state["blocks"] + FSDP_BLOCKS_IN_FLIGHT * block
    return GRADIENT_BUCKET_BYTES if layout.data_ranks > 1 else 0.0


def _autocast_copy_bytes(config: Qwen2Config, layout: Layout, shape: _LayoutShape, state: dict[str, int]) -> float:
    """Autocast's low-precision weight copies saved for backward.

    With recompute only the recomputed block's copies exist at a time (the rest are not saved).
    """
    copy = shape.precision.autocast_copy
    if shape.fsdp and shape.precision.gather == shape.precision.compute:
        return 0.0  # FSDP2 gathers the weights in the compute dtype already: autocast's cast returns them as they are
    autocast = state["matmul_param_numel"] * copy
    if layout.recompute != "none":
        block_copies = _block_numel(config, layout.tp) * copy
        autocast = autocast - state["blocks"] * block_copies + block_copies
    return autocast


def _rank_memory_breakdown(problem: Problem, layout: Layout, shape: _LayoutShape,
                           pp_rank: int) -> tuple[dict[str, float], dict[str, int]]:
    """(memory breakdown in bytes, :func:`rank_memory`'s figures) of pipeline rank ``pp_rank``."""
    prec, act = shape.precision, shape.activations
    state = _rank_memory(problem.config, layout.tp, layout.pp, layout.shard_ranks if shape.fsdp else layout.data_ranks,
                         "fsdp" if shape.fsdp else "replicate",
                         pp_rank, problem.precision, problem.optimizer, layout.virtual_stages)
    held = _held_activation_bytes(layout, shape, pp_rank)
    has_head = shape.last_stage in shape.rank_stages[pp_rank]
    working = max(act.layer_working, act.loss_working if has_head else 0.0) * shape.tokens
    fsdp_buffers = _data_parallel_buffer_bytes(problem.config, layout, shape, state)
    autocast = _autocast_copy_bytes(problem.config, layout, shape, state)
    optimizer_temp = state["param_numel"] * prec.state  # foreach AdamW's sqrt(exp_avg_sq) temporary
    static = state["param_bytes"] + state["grad_bytes"] + state["optimizer_bytes"]
    # the optimizer's temporary exists after backward, when activations and buffers are freed
    extra = held + working + fsdp_buffers + autocast
    memory = {"weights": state["param_bytes"], "gradients": state["grad_bytes"], "optimizer": state["optimizer_bytes"],
              "activations": held, "working": working, "fsdp_buffers": fsdp_buffers, "autocast_copies": autocast,
              "total": static + max(extra, optimizer_temp)}
    return memory, state


def rank_memory_breakdown(problem: Problem, layout: Layout, pp_rank: int) -> dict[str, float]:
    """The planner's memory breakdown (bytes) of pipeline rank ``pp_rank`` of ``layout``: weights, gradients,
    optimizer, activations (held at the peak), working, fsdp_buffers, autocast_copies, total."""
    return _rank_memory_breakdown(problem, layout, _layout_shape(problem, layout), pp_rank)[0]


def _activation_bytes(problem: Problem) -> tuple[int, int]:
    """(matmul activation bytes, residual stream bytes): the precision's, or bf16 throughout with bf16 weights."""
    prec = PRECISIONS[problem.precision]
    if problem.runtime.low_precision_params and prec.residual > prec.compute:
        return prec.compute, LOW_PRECISION_BYTES
    return prec.compute, prec.residual


def _tp_seconds(problem: Problem, layout: Layout, kind: str, nbytes: float) -> float:
    """One TP collective, as much of it as stays exposed (all of it unless TP communication is overlapped)."""
    hw = problem.hw
    seconds = hw.collective(kind, nbytes, layout.tp, False, blocking=True)
    return seconds * (problem.time_model.tp_overlap_exposed if problem.runtime.tp_overlap else 1.0)


def _gemm_seconds(problem: Problem, tokens: int, k: int, n: int, float8: bool = False) -> float:
    """Forward and backward of a ``tokens x k`` by ``k x n`` matmul: ``6 tokens k n`` FLOPs at its efficiency (a
    float8 block GEMM at the fp8 peak and the recipe's efficiency)."""
    hw, recipe = problem.hw, problem.runtime.float8
    if float8 and recipe is not None:
        peak = problem.time_model.float8_efficiency or FLOAT8_GEMM_EFFICIENCY[recipe]
        if hw.gpu.peak.fp8 is None:
            raise ValueError(f"GPU {hw.gpu.name} lists no fp8 peak; plan it without float8")
        efficiency = gemm_efficiency(peak, problem.time_model.gemm_knee, tokens, k, n)
        return 6 * tokens * k * n / (hw.gpu.peak.fp8 * efficiency)
    efficiency = gemm_efficiency(hw.compute_efficiency, problem.time_model.gemm_knee, tokens, k, n)
    return 6 * tokens * k * n / (hw.peak_flops(problem.precision) * efficiency)


def _hbm_seconds(problem: Problem, nbytes: float) -> float:
    return nbytes / (problem.hw.gpu.hbm_tbs * 1e12 * problem.time_model.hbm_efficiency)


# _block_work's results by (problem, tokens and the layout fields it reads): a search asks for the same block under
# thousands of candidates that differ only in pp, dp, micro-batching and schedule
_BLOCK_WORK: dict[tuple, "_Work"] = {}
_BLOCK_WORK_LIMIT = 65536


def _block_work(problem: Problem, layout: Layout, tokens: int) -> _Work:
    """One block on one TP rank for a micro-batch of ``tokens`` (see :mod:`~lightning_hybrid.planner.step_time`)."""
    key = (problem, tokens, layout.tp, layout.sequence_parallel, layout.recompute, layout.cp)
    work = _BLOCK_WORK.get(key)
    if work is None:
        if len(_BLOCK_WORK) >= _BLOCK_WORK_LIMIT:
            _BLOCK_WORK.clear()
        work = _BLOCK_WORK[key] = _compute_block_work(problem, layout, tokens)
    return work


def _compute_block_work(problem: Problem, layout: Layout, tokens: int) -> _Work:
    """:func:`_block_work` without the memo (it reads only the layout fields in the memo's key)."""
    c, rt = problem.config, problem.runtime
    shapes = block_gemms(c, layout.tp)
    gemms = {name: _gemm_seconds(problem, tokens, k, n, float8=True) for name, (k, n) in shapes.items()}
    attention_flops = 12 * tokens * c.num_attention_heads * c.head_dim / layout.tp * problem.seq_len
    attention = attention_flops / (problem.hw.peak_flops(problem.precision) * problem.time_model.attention_efficiency)
    a, r = _activation_bytes(problem)
    forward_bytes = elementwise_bytes(c, layout.tp, layout.sequence_parallel, a, r, rt) * tokens
    if r > a:  # autocast casts the block's fp32 matmul weights once per forward
        forward_bytes += AUTOCAST_WEIGHT_CAST_BYTES * sum(k * n for k, n in shapes.values())
    elementwise = _hbm_seconds(problem, forward_bytes)
    one = _tp_seconds(problem, layout, "all_reduce", tokens * c.hidden_size * a) if layout.tp > 1 else 0.0
    per_block, replayed = tp_all_reduce_equivalents(layout.sequence_parallel)
    recompute = 0.0
    if layout.recompute == "full":  # the whole forward again: a third of the GEMMs and of attention
        recompute = (sum(gemms.values()) + attention) / 3 + elementwise + replayed * one
    elif layout.recompute == "selective":
        policy = SELECTIVE_POLICIES[rt.selective]
        gathers = policy.tp_all_gathers / 2 * one if layout.sequence_parallel else 0.0
        recompute = sum(gemms[name] for name in policy.matmuls) / 3 + elementwise + gathers
    return _Work(gemm=sum(gemms.values()), attention=attention, elementwise=elementwise * (1 + ELEMENTWISE_BACKWARD),
                 recompute=recompute, tp=per_block * one,
                 gemm_flops=sum(6 * tokens * k * n for k, n in shapes.values()),
                 cp=_cp_seconds(problem, layout, tokens))


def _cp_seconds(problem: Problem, layout: Layout, tokens: int) -> float:
    """One block's K/V exchange under context parallelism, not overlapped: all-gather of this rank's K and V
    (``tokens`` local tokens, its TP share of the kv heads) in forward, reduce-scatter of their gradients in backward
    (and the all-gather again when the block is recomputed)."""
    if layout.cp == 1:
        return 0.0
    c, hw = problem.config, problem.hw
    nbytes = 2 * tokens * layout.cp * c.num_key_value_heads // layout.tp * c.head_dim * _activation_bytes(problem)[0]
    inter_node = layout.tp * layout.cp > hw.gpus_per_node  # cp ranks are tp apart
    one = functools.partial(hw.collective, nbytes=nbytes, ranks=layout.cp, inter_node=inter_node, blocking=True)
    gathers = 2 if layout.recompute == "full" else 1
    return gathers * one("all_gather") + one("reduce_scatter")


def _head_work(problem: Problem, layout: Layout, tokens: int) -> _Work:
    """Final norm, LM head and loss on the last stage: the head GEMM, the loss's fp32 passes, its TP collectives."""
    c, rt = problem.config, problem.runtime
    a, _ = _activation_bytes(problem)
    vocab = -(-c.vocab_size // layout.tp)
    loss_vocab = vocab if rt.loss_parallel else c.vocab_size
    per_logit = LOSS_BYTES_PER_LOGIT
    tp = 0.0
    if layout.tp > 1:  # the head input's gradient; this project also gathers the logits to every TP rank
        tp = _tp_seconds(problem, layout, "all_reduce", tokens * c.hidden_size * a)
        if not rt.loss_parallel:
            tp += _tp_seconds(problem, layout, "all_gather", tokens * c.vocab_size * a)
    return _Work(gemm=_gemm_seconds(problem, tokens, c.hidden_size, vocab),
                 elementwise=_hbm_seconds(problem, tokens * loss_vocab * per_logit), tp=tp,
                 gemm_flops=6 * tokens * c.hidden_size * vocab)


def _rank_work(problem: Problem, layout: Layout, shape: _LayoutShape, pp_rank: int) -> _Work:
    """One micro-batch on a pipeline rank: its blocks, the embedding on the first stage, the head on the last."""
    stages = shape.rank_stages[pp_rank]
    work = _block_work(problem, layout, shape.tokens) * sum(shape.stage_blocks[s] for s in stages)
    if 0 in stages and layout.tp > 1:  # the vocabulary-parallel embedding's output
        residual = _activation_bytes(problem)[1]
        nbytes = shape.tokens * problem.config.hidden_size * residual
        work = work + _Work(tp=_tp_seconds(problem, layout, "all_reduce", nbytes))
    if shape.last_stage in stages:
        work = work + _head_work(problem, layout, shape.tokens)
    if layout.pp > 1 and problem.hw.scheduling_wait_s:
        # CPU cores with none spare: a rank receiving its stage input (and its output gradient) waits for the sender
        # to be scheduled; on GPUs the steady state's transfers overlap with compute
        received = 2 - (0 in stages) - (shape.last_stage in stages) if layout.virtual_stages == 1 else 2
        nbytes = shape.tokens * problem.config.hidden_size * _activation_bytes(problem)[1]
        work = work + _Work(p2p=received * problem.hw.collective("p2p", nbytes, 2, False, blocking=True))
    return work


def _rank_cost(problem: Problem, layout: Layout, shape: _LayoutShape, pp_rank: int) -> _RankCost:
    memory, state = _rank_memory_breakdown(problem, layout, shape, pp_rank)
    return _RankCost(memory, state, _rank_work(problem, layout, shape, pp_rank))


def _data_parallel_seconds(problem: Problem, layout: Layout, shape: _LayoutShape, slowest: _RankCost) -> float:
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
    gather = dp_collective("all_gather", state["stage_param_numel"] * param_bytes)
    scatter = dp_collective("reduce_scatter", state["stage_param_numel"] * prec.grad) + _replica_all_reduce(
        problem, layout, state["stage_param_numel"] * prec.grad / layout.shard_ranks)
    if layout.pp > 1:  # the stage once, and each block again m times (fsdp_block_gathers), reduced once
        regather = dp_collective("all_gather", _block_numel(problem.config, layout.tp) * param_bytes) * state["blocks"]
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
    first_unit = dp_collective("all_gather", _block_numel(problem.config, layout.tp) * param_bytes)
    return layout.microbatches * max(0.0, per_microbatch - slowest.work.total) + first_unit


def _replica_all_reduce(problem: Problem, layout: Layout, nbytes: float) -> float:
    """HSDP's second level: the all-reduce of each rank's reduce-scattered gradient shard (``nbytes``) across the
    ``dp // dp_shard`` replica groups, whose peers are a shard group apart (across nodes once it fills one)."""
    if layout.data_parallel != "hsdp" or layout.dp == layout.dp_shard:
        return 0.0
    hw, stride = problem.hw, layout.tp * layout.shard_ranks
    inter_node = _spans_nodes([r * stride for r in range(layout.dp // layout.dp_shard)], hw.gpus_per_node)
    return hw.collective("all_reduce", nbytes, layout.dp // layout.dp_shard, inter_node)


def _pipeline_bubble_seconds(problem: Problem, layout: Layout, shape: _LayoutShape, slowest: _RankCost) -> float:
    """Idle time of the pipeline's warm-up and cool-down, with their point-to-point transfers."""
    p2p = 0.0
    if layout.pp > 1:
        hw, neighbours = problem.hw, layout.tp * layout.data_ranks  # pipeline neighbours are tp*dp*cp ranks apart
        # the slowest boundary sets the pace
        inter_node = any(i // hw.gpus_per_node != (i + neighbours) // hw.gpus_per_node
                         for i in range((layout.pp - 1) * neighbours))
        _, residual = _activation_bytes(problem)
        one = hw.collective("p2p", shape.tokens * problem.config.hidden_size * residual, 2, inter_node)
        # the first micro-batch's activations cross pp - 1 boundaries before the last rank starts (with any v:
        # its chunks are v times smaller, its ramp as many boundaries), the last gradients as many when draining
        p2p = P2P_PER_BOUNDARY * (layout.pp - 1) * one
    return (layout.pp - 1) / layout.virtual_stages * slowest.work.total + p2p


def _optimizer_seconds(problem: Problem, shape: _LayoutShape, slowest: _RankCost) -> float:
    """The optimizer step of the slowest rank, bound by memory bandwidth."""
    prec = shape.precision
    passes = (OPTIMIZER_PARAM_PASSES * prec.param + OPTIMIZER_GRAD_PASSES * prec.grad
              + OPTIMIZER_STATE_PASSES * prec.state)
    return slowest.state["param_numel"] * passes / (problem.hw.gpu.hbm_tbs * 1e12)


def _time_detail(problem: Problem, layout: Layout, shape: _LayoutShape, work: _Work) -> dict:
    """What the compute time is made of, per step, and the efficiency each GEMM is planned at."""
    hw, m, tokens = problem.hw, layout.microbatches, shape.tokens
    c = problem.config
    shapes = dict(block_gemms(c, layout.tp), head=(c.hidden_size, -(-c.vocab_size // layout.tp)))
    return {"gemm": m * work.gemm, "attention": m * work.attention, "elementwise": m * work.elementwise,
            "gemm_efficiency": work.gemm_flops / (hw.peak_flops(problem.precision) * work.gemm) if work.gemm else 0.0,
            "gemm_shapes": {name: [tokens, k, n] for name, (k, n) in shapes.items()},
            "gemm_efficiencies": {name: gemm_efficiency(hw.compute_efficiency, problem.time_model.gemm_knee, tokens,
                                                        k, n) for name, (k, n) in shapes.items()}}


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
    communication = sum(time.get(key, 0.0) for key in ("tp_comm", "dp_comm", "cp_comm"))
    return max(0.0, busy / hw.cores_per_node + communication - sum(time.values()))


def estimate(problem: Problem, layout: Layout) -> Estimate:
    """Memory and step time of ``layout`` for ``problem`` (memory of the fullest pipeline rank)."""
    shape = _layout_shape(problem, layout)
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
    time["core_sharing"] = _core_sharing_seconds(problem, layout, ranks, time)
    time["step"] = sum(time.values())
    step_tokens = problem.global_batch * problem.seq_len
    model_flops = step_tokens * flops_per_token(problem.config, problem.seq_len)
    mfu = model_flops / (time["step"] * problem.hw.gpus * problem.hw.peak_flops(problem.precision))
    checkpoint_bytes = max(rank.state["param_bytes"] + rank.state["optimizer_bytes"] for rank in ranks)
    return Estimate(layout, ranks[fullest].memory, problem.hw.usable_bytes, time, mfu, step_tokens / time["step"],
                    fullest, checkpoint_bytes=checkpoint_bytes, detail=_time_detail(problem, layout, shape, work))


def context_sizes(problem: Problem, tp: int) -> list[int]:
    """The cp sizes worth planning with ``tp``: 1, and powers of two with cp x tp inside a node and a sequence that
    splits into 2 x cp chunks."""
    sizes, cp = [1], 2
    while tp * cp <= problem.hw.gpus_per_node and problem.seq_len % (2 * cp) == 0:
        sizes.append(cp)
        cp *= 2
    return sizes


def _modes(dp: int, gpus_per_node: int, tp: int, cp: int) -> list[tuple[str, int]]:
    """(data parallel mode, dp_shard): FSDP, replication, and HSDP with a shard group of one node's ranks."""
    if dp == 1:
        return [("replicate", 0)]
    modes = [("fsdp", 0), ("replicate", 0)]
    shard = gpus_per_node // (tp * cp) if gpus_per_node % (tp * cp) == 0 else 0
    if 1 < shard < dp and dp % shard == 0:
        modes.append(("hsdp", shard))
    return modes


def candidates(problem: Problem, tp: int, pp: int,
               modes: Optional[tuple[str, ...]] = None, cp: int = 1) -> Iterator[Layout]:
    """Every micro-batching, schedule, recompute and sequence-parallel variant of one mesh."""
    dp = problem.hw.gpus // (tp * pp * cp)
    per_replica = problem.global_batch // dp
    choices = _modes(dp, problem.hw.gpus_per_node, tp, cp)
    for mode, shard in ([c for c in choices if c[0] in modes] if modes else choices):
        for mbs in MICRO_BATCH_SIZES:
            if per_replica % mbs:
                continue
            m = per_replica // mbs
            for schedule, v in (problem.schedules if pp > 1 else (("none", 1),)):
                if _layout_reason(problem, tp, pp, dp, v):
                    continue
                if pp > 1:
                    try:
                        validate_schedule(schedule, pp, v, m)
                    except ValueError:
                        continue
                for recompute in RECOMPUTE:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        yield Layout(tp, pp, dp, mode, mbs, m, schedule, v, recompute, sp, cp, shard)


def meshes(problem: Problem) -> list[tuple[int, int, str]]:
    """(tp, pp, why-not) for every tp inside a node and pp that divide the GPU count."""
    out = []
    for tp in divisors(problem.hw.gpus_per_node):
        if problem.hw.gpus % tp:
            continue
        for pp in divisors(problem.hw.gpus // tp):
            out.append((tp, pp, _layout_reason(problem, tp, pp, problem.hw.gpus // (tp * pp), 1)))
    return out


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
                       for c in candidates(problem, tp, pp, cp=cp)):
            e = estimate(problem, layout)
            key = (tp, pp, layout.cp, layout.data_parallel, layout.micro_batch_size, layout.schedule,
                   layout.virtual_stages)
            if _better(e, best.get(key)):
                best[key] = e
            mesh_key = (tp, pp, layout.cp, layout.data_parallel)
            if smallest.get(mesh_key) is None or e.memory["total"] < smallest[mesh_key].memory["total"]:
                smallest[mesh_key] = e
    feasible = sorted((e for e in best.values() if e.fits), key=lambda e: (e.time["step"], e.memory["total"]))
    fitting_meshes = {(e.layout.tp, e.layout.pp, e.layout.cp, e.layout.data_parallel) for e in feasible}
    infeasible = sorted((e for k, e in smallest.items() if k not in fitting_meshes), key=lambda e: e.memory["total"])
    return feasible, infeasible


def explain(problem: Problem, tp: int, pp: int, data_parallel: str) -> dict:
    """Why a mesh fits or not: its plainest variant (mbs=1, no recompute) and its smallest-memory variant.

    Returns a dict with ``fits``, ``text`` (one paragraph), ``plain`` and ``smallest`` estimates.
    """
    dp = problem.hw.gpus // (tp * pp) if problem.hw.gpus % (tp * pp) == 0 else 0
    reason = "" if dp else f"tp*pp={tp * pp} does not divide {problem.hw.gpus} GPUs"
    reason = reason or _layout_reason(problem, tp, pp, dp, 1)
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
