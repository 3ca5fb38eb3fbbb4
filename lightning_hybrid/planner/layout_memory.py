"""The planner's memory of a layout: what one pipeline rank of a candidate holds at its peak, by kind.

:func:`rank_memory_breakdown` adds the exact model state (:func:`~lightning_hybrid.planner.memory.rank_memory`) to
the activations in flight under the schedule, the working memory of a block or the loss, FSDP's gathered units (or
replication's gradient bucket) and autocast's weight copies. The cost model (:mod:`~lightning_hybrid.planner.cost`)
reads it for every candidate; :class:`LayoutShape` is what the pipeline ranks of a layout share.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from lightning_hybrid.distributed.options import GRADIENT_BUCKET_BYTES
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.activations import ActivationModel, activation_model, inflight_microbatches
from lightning_hybrid.planner.context_parallel import blockwise_working_bytes
from lightning_hybrid.planner.experts import sparse_flags
from lightning_hybrid.planner.layout import Layout, Problem
from lightning_hybrid.planner.memory import (
    PRECISIONS,
    Precision,
    rank_memory,
    rank_parameter_shapes,
    rank_stages,
    split_blocks,
)

__all__ = ["LayoutShape", "layout_shape", "rank_memory_breakdown", "rank_memory_shape_breakdown", "activation_bytes",
           "block_numel", "residual_stream_bytes", "FSDP_BLOCKS_IN_FLIGHT", "LOW_PRECISION_BYTES"]

FSDP_BLOCKS_IN_FLIGHT = 2  # without a pipeline, the running block and the prefetched one are gathered
# Low-precision (bf16) bytes of weights and activations when Runtime.low_precision_params is set.
LOW_PRECISION_BYTES = 2


@functools.lru_cache(maxsize=65536)
def _rank_memory(config: Qwen2Config, tp: int, pp: int, dp: int, mode: str, r: int, precision: str,
                 optimizer: str, v: int, ep: int = 1) -> dict[str, int]:
    return rank_memory(config, tp, pp, dp, mode, r, 0, 0, precision, optimizer, v, ep=ep)


@functools.lru_cache(maxsize=1024)
def block_numel(config: Qwen2Config, tp: int, ep: int = 1) -> int:
    """TP-local (experts: EP-local) parameters of the largest block: what FSDP gathers for one block, its experts'
    unit included."""
    return max(sum(math.prod(s) for s in rank_parameter_shapes(config, tp, 0, [i], embedding=False, head=False,
                                                                ep=ep).values())
               for i in _block_kinds(config))


@functools.lru_cache(maxsize=1024)
def _block_kinds(config: Qwen2Config) -> tuple[int, ...]:
    """One block of each kind (dense, sparse) of ``config``."""
    flags = sparse_flags(config)
    return tuple(sorted({flags.index(kind) for kind in set(flags)}))


@functools.lru_cache(maxsize=4096)
def _stage_sparse(config: Qwen2Config, stage_blocks: tuple[int, ...]) -> tuple[int, ...]:
    """Sparse blocks (mixtures of experts) per stage, the stages holding ``stage_blocks`` blocks in order."""
    flags, starts = sparse_flags(config), [sum(stage_blocks[:s]) for s in range(len(stage_blocks))]
    return tuple(sum(flags[b] for b in range(start, start + n)) for start, n in zip(starts, stage_blocks))


@dataclass(frozen=True)
class LayoutShape:
    """What every pipeline rank of a layout shares."""

    tokens: int  # tokens per micro-batch
    activations: ActivationModel
    rank_stages: list[list[int]]  # stage indices per pipeline rank
    stage_blocks: tuple[int, ...]  # blocks per stage
    last_stage: int
    fsdp: bool  # FSDP over dp > 1 (else replication or no data parallelism)
    precision: Precision
    gathered_kv: float = 0.0  # bytes per block and micro-batch of the other cp ranks' K/V kept for backward
    stage_sparse: tuple[int, ...] = ()  # of stage_blocks, the mixtures of experts per stage

    def held(self, stage: int) -> float:
        """Activation bytes per token of one micro-batch in ``stage``'s blocks (dense and sparse)."""
        sparse = self.stage_sparse[stage] if self.stage_sparse else 0
        return (self.stage_blocks[stage] - sparse) * self.activations.layer + sparse * self.activations.sparse_layer



def layout_shape(problem: Problem, layout: Layout) -> LayoutShape:
    num_stages = layout.pp * layout.virtual_stages
    fsdp = layout.data_parallel != "replicate" and layout.data_ranks > 1
    activations = activation_model(problem.config, layout.tp, layout.sequence_parallel, layout.recompute,
                                   problem.precision, problem.seq_len, problem.runtime.loss_parallel, layout.ep,
                                   residual_bytes=residual_stream_bytes(problem, fsdp),
                                   fused_projections=problem.runtime.fused_projections)
    stage_blocks = split_blocks(problem.config, num_stages)
    # a rank holds seq_len / cp tokens of each sequence: activations and per-token work divide by cp
    return LayoutShape(tokens=layout.micro_batch_size * problem.seq_len // layout.cp, activations=activations,
                        rank_stages=rank_stages(layout.pp, layout.virtual_stages),
                        stage_blocks=stage_blocks, last_stage=num_stages - 1, fsdp=fsdp,
                        precision=PRECISIONS[problem.precision], gathered_kv=_gathered_kv_bytes(problem, layout),
                        stage_sparse=_stage_sparse(problem.config, stage_blocks))


def residual_stream_bytes(problem: Problem, fsdp: bool) -> int:
    """Bytes per element of the residual stream (the blocks' inputs that recompute keeps, the norms' dtype).

    The stream takes the dtype of the weights the forward runs on: FSDP2 gathers them in its ``param_dtype`` (bf16
    under ``bf16-mixed``, :attr:`Precision.gather`), so the embedding looks up bf16 rows, and FSDP2 casts each unit's
    floating inputs to that dtype too (``MixedPrecisionPolicy.cast_forward_inputs``); bf16 compute weights
    (``low_precision_params``) do the same without FSDP. Only autocast on fp32 weights keeps an fp32 stream. (The 72B
    SFT recipe's stage 0, full recompute at 32,768 tokens: its 40 block inputs per micro-batch trace 2.7 GB, bf16.)
    """
    prec = PRECISIONS[problem.precision]
    if fsdp:
        return min(prec.residual, prec.gather)
    return activation_bytes(problem)[1]


def _gathered_kv_bytes(problem: Problem, layout: Layout) -> float:
    """The K/V of the other cp ranks that ring attention keeps per block for backward (at the K/V's own heads; none
    under full recompute, which keeps only the block input)."""
    if layout.cp == 1 or layout.recompute == "full":
        return 0.0
    c, a = problem.config, activation_bytes(problem)[0]
    others = layout.micro_batch_size * problem.seq_len * (layout.cp - 1) // layout.cp
    return 2.0 * others * c.num_key_value_heads // layout.tp * c.head_dim * a


def _held_activation_bytes(layout: Layout, shape: LayoutShape, pp_rank: int, keeps_outputs: bool) -> float:
    """Activations a pipeline rank holds at its peak: its in-flight micro-batches on each of its stages, and on the
    last stage of a pipeline the logits it outputs: those in flight, or every micro-batch's of the step when the
    schedule keeps them to return them (``keeps_outputs``: torch's ``schedule.step()`` unless
    ``return_outputs=False``)."""
    act, counts = shape.activations, shape.stage_blocks
    inflight = inflight_microbatches(layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches, pp_rank)
    held = sum(n * ((shape.held(s) + act.stage + (act.embedding if s == 0 else 0)
                     + (act.head if s == shape.last_stage else 0)) * shape.tokens + counts[s] * shape.gathered_kv)
               for n, s in zip(inflight, shape.rank_stages[pp_rank]))
    if layout.pp > 1 and shape.last_stage in shape.rank_stages[pp_rank]:
        outputs = layout.microbatches if keeps_outputs else inflight[shape.rank_stages[pp_rank].index(shape.last_stage)]
        held += outputs * act.logits * shape.tokens
    return held


def _data_parallel_buffer_bytes(config: Qwen2Config, layout: Layout, shape: LayoutShape,
                                state: dict[str, int]) -> float:
    """FSDP's gathered parameters (and unsharded gradients), or the gradient all-reduce bucket."""
    prec = shape.precision
    # FSDP2 gathers in the strategy's param_dtype (bf16 under bf16-mixed), not in the stored fp32
    gathered = state["stage_param_numel"] * prec.gather
    if shape.fsdp and layout.pp > 1:  # torch's schedules keep the stage unsharded (params and grads) through the step
        return gathered + state["stage_param_numel"] * prec.grad
    if shape.fsdp:  # the root unit (embedding, norm, head) stays gathered; two blocks in flight with prefetch
        block = block_numel(config, layout.tp, layout.ep) * prec.gather
        return gathered - state["block_param_numel"] * prec.gather + FSDP_BLOCKS_IN_FLIGHT * block
    return GRADIENT_BUCKET_BYTES if layout.data_ranks > 1 else 0.0


def _autocast_copy_bytes(config: Qwen2Config, layout: Layout, shape: LayoutShape, state: dict[str, int]) -> float:
    """Autocast's low-precision weight copies saved for backward.

    With recompute only the recomputed block's copies exist at a time (the rest are not saved).
    """
    copy = shape.precision.autocast_copy
    if shape.fsdp and shape.precision.gather == shape.precision.compute:
        return 0.0  # FSDP2 gathers the weights in the compute dtype already: autocast's cast returns them as they are
    autocast = state["matmul_param_numel"] * copy
    if layout.recompute != "none":
        block_copies = block_numel(config, layout.tp, layout.ep) * copy
        autocast = autocast - state["block_param_numel"] * copy + block_copies
    return autocast


def rank_memory_shape_breakdown(problem: Problem, layout: Layout, shape: LayoutShape,
                           pp_rank: int) -> tuple[dict[str, float], dict[str, int]]:
    """(memory breakdown in bytes, :func:`rank_memory`'s figures) of pipeline rank ``pp_rank``."""
    prec, act = shape.precision, shape.activations
    state = _rank_memory(problem.config, layout.tp, layout.pp, layout.shard_ranks if shape.fsdp else layout.data_ranks,
                         "fsdp" if shape.fsdp else "replicate",
                         pp_rank, problem.precision, problem.optimizer, layout.virtual_stages, layout.ep)
    held = _held_activation_bytes(layout, shape, pp_rank, problem.runtime.pipeline_keeps_outputs)
    has_head = shape.last_stage in shape.rank_stages[pp_rank]
    block_working = max(act.layer_working, act.sparse_working)
    working = max(block_working * shape.tokens + blockwise_working_bytes(problem, layout, shape.tokens),
                  act.loss_working * shape.tokens if has_head else 0.0)
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
    return rank_memory_shape_breakdown(problem, layout, layout_shape(problem, layout), pp_rank)[0]


def activation_bytes(problem: Problem) -> tuple[int, int]:
    """(matmul activation bytes, residual stream bytes): the precision's, or bf16 throughout with bf16 weights."""
    prec = PRECISIONS[problem.precision]
    if problem.runtime.low_precision_params and prec.residual > prec.compute:
        return prec.compute, LOW_PRECISION_BYTES
    return prec.compute, prec.residual

