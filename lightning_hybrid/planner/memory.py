"""Per-rank memory model of a (tp, pp, dp) layout: parameters, gradients, optimizer states, activations.

Parameters, gradients and optimizer states are computed tensor by tensor with the sharding rules the
strategy applies, so they agree exactly with what a rank allocates:

* tensor parallel (``tp > 1``): q/k/v/gate/up weights and the q/k/v biases (when the config has them) are split
  on dim 0, o/down weights on dim 1 (the block's tensors and split dims are the model's
  :func:`~lightning_hybrid.models.qwen2.config.block_tensor_shapes`), the embedding and the LM head over
  the vocabulary (dim 0); norms are replicated. DTensor splits with ``torch.chunk`` semantics
  (``ceil(n / tp)`` per rank, the last ranks may get fewer).
* FSDP2 over ``dp``: every (TP-local) parameter is split on dim 0 into chunks of ``ceil(n / dp)`` rows,
  again with ``torch.chunk`` semantics (a rank may hold 0 rows). ``replicate`` keeps full copies.
* pipeline: stages hold contiguous blocks split as the strategy does
  (:func:`lightning_hybrid.distributed.pipeline.split.plan_stages`); stage 0 also holds the embedding, the
  last stage the final norm and the head. A rank holds ``virtual_stages`` stages (``r, r + pp, ...``, or ``r, 2pp-1-r``
  for V-shaped schedules).
* gradients are shaped like the local parameters, except that torch's vocabulary-parallel embedding
  produces a full-vocabulary (Replicate) gradient on every TP rank when FSDP does not shard it.
* AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the parameter (torch's ``zeros_like``, so in the
  parameter dtype) and a 4-byte fp32 ``step`` scalar per parameter tensor.

Activations (:mod:`~lightning_hybrid.planner.activations`) follow Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", but are counted tensor by tensor for this implementation instead of
with the paper's ``sbh(34 + 5as/h)``: grouped-query attention whose k/v are repeated to the query heads before
attention, a SwiGLU MLP (4 saved tensors of width ``intermediate_size``), RMSNorm computed in fp32,
and a fused (flash-style) attention that saves its output and log-sum-exp instead of the ``s x s``
scores (so the paper's ``5as/h`` term is gone, which is also what its selective recompute achieves).
With torch's sequence parallel the norms work on ``s / tp`` tokens but the linear layers after them
save the all-gathered (full) input, unlike Megatron, which saves the shard.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_hybrid.distributed.parallel_dims import tied_embedding_error
from lightning_hybrid.models.decoder.moe_config import is_expert_tensor
from lightning_hybrid.models.qwen2.config import Qwen2Config, block_tensor_shapes, parallel_spec

__all__ = ["Precision", "PRECISIONS", "OPTIMIZERS", "RECOMPUTE", "split_blocks", "rank_stages",
           "rank_parameter_shapes", "chunk_rows", "rank_memory", "checked_choice"]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor under a Lightning ``precision`` setting.

    Args:
        name: the Lightning name (``bf16-mixed``, ``bf16-true``, ``32-true``).
        param: stored parameters.
        grad: gradients (same dtype as the parameters in torch).
        state: one optimizer state element (torch's AdamW allocates states like the parameter).
        compute: matmul inputs and outputs.
        residual: the residual stream and norm outputs.
        autocast_copy: bytes per parameter of the low-precision weight copies autocast caches for backward.
        gather: bytes per element of FSDP2's all-gathered (unsharded) parameters: the strategy's ``param_dtype``,
            bf16 under ``bf16-mixed`` (the dry run's trace of the 72B recipe holds 2 bytes per gathered element,
            and its all-gathers carry as many), else the stored dtype. Autocast makes no copy of such weights.
    """

    name: str
    param: int
    grad: int
    state: int
    compute: int
    residual: int
    autocast_copy: int
    gather: int


PRECISIONS: dict[str, Precision] = {
    "bf16-mixed": Precision("bf16-mixed", 4, 4, 4, 2, 4, 2, 2),
    "16-mixed": Precision("16-mixed", 4, 4, 4, 2, 4, 2, 4),
    "bf16-true": Precision("bf16-true", 2, 2, 2, 2, 2, 0, 2),
    "32-true": Precision("32-true", 4, 4, 4, 4, 4, 0, 4),
}

# Optimizer -> (states per parameter element, has a per-tensor ``step`` scalar).
OPTIMIZERS: dict[str, tuple[int, bool]] = {"adamw": (2, True), "adam": (2, True), "sgd": (1, False)}
RECOMPUTE = ("none", "selective", "full")
_STEP_BYTES = 4  # torch keeps AdamW's step as a float32 scalar tensor per parameter


def checked_choice(name: str, value: str, choices: Sequence[str]) -> str:
    if value.lower() not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}")
    return value.lower()


def chunk_rows(n: int, parts: int, index: int) -> int:
    """Rows of shard ``index`` when ``n`` rows are split into ``parts`` with ``torch.chunk`` semantics."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


# ----------------------------------------------------------------------------- pipeline stages


@functools.lru_cache(maxsize=4096)
def split_blocks(config: Qwen2Config, num_stages: int) -> tuple[int, ...]:
    """Block counts per stage, as the strategy splits them
    (:func:`lightning_hybrid.distributed.pipeline.split.plan_stages`).

    Raises:
        ValueError: more stages than blocks.
    """
    from lightning_hybrid.distributed.pipeline.split import plan_stages

    if num_stages == 1:
        return (config.num_hidden_layers,)
    return tuple(p.num_blocks for p in plan_stages(parallel_spec(config), config.num_hidden_layers, num_stages))


def rank_stages(pp: int, virtual_stages: int = 1, style: str = "loop") -> list[list[int]]:
    """Stage indices each pipeline rank holds: ``loop`` gives ``r, r + pp, ...``; ``v`` gives ``r, 2pp-1-r``."""
    from lightning_hybrid.distributed.pipeline.schedules import stage_ids_for_rank

    if style == "v" and virtual_stages != 2:
        raise ValueError(f"V-shaped schedules place 2 stages per rank, got virtual_stages={virtual_stages}")
    schedule = "zbv_zero_bubble" if style == "v" else "interleaved_1f1b"
    return [stage_ids_for_rank(r, pp, virtual_stages, schedule) for r in range(pp)]


# ----------------------------------------------------------------------------- parameters


def _tp_local(shape: tuple[int, ...], dim: Optional[int], tp: int, tp_rank: int) -> tuple[int, ...]:
    if dim is None or tp == 1:
        return shape
    out = list(shape)
    out[dim] = chunk_rows(shape[dim], tp, tp_rank)
    return tuple(out)


def rank_parameter_shapes(config: Qwen2Config, tp: int, tp_rank: int, blocks: Sequence[int],
                          embedding: bool, head: bool, num_stages: Optional[int] = None, ep: int = 1,
                          ep_rank: int = 0) -> dict[str, tuple[int, ...]]:
    """TP-local (and for the experts EP-local) shapes of the parameters a rank holds, by their (global) names.

    A tied embedding held together with the head is listed once, under ``embed_tokens.weight``.
    ``num_stages`` (pipeline stages of the whole model) is for the tied-embedding check; ``None`` assumes
    one stage when the rank holds both the embedding and the head or neither, else two. The experts of a sparse
    block are not split by tp; ``ep`` ranks split them on dim 0 (the rank at ``ep_rank`` holds its chunk).

    Raises:
        ValueError: ``tie_word_embeddings`` with ``tp > 1`` or several pipeline stages (the strategy refuses
            them too, with the same message).
    """
    c = config
    stages = num_stages if num_stages is not None else (1 if embedding == head else 2)
    tied_error = tied_embedding_error(c.tie_word_embeddings, tp, stages)
    if tied_error:
        raise ValueError(tied_error)
    h = c.hidden_size
    vocab_dim = 0 if tp > 1 else None
    shapes: dict[str, tuple[int, ...]] = {}
    if embedding:
        shapes["embed_tokens.weight"] = _tp_local((c.vocab_size, h), vocab_dim, tp, tp_rank)
    for i in blocks:
        for name, (shape, dim) in _block_shapes(c, i).items():
            local = _tp_local(shape, dim, tp, tp_rank)
            if ep > 1 and is_expert_tensor(name):
                local = (chunk_rows(local[0], ep, ep_rank), *local[1:])
            shapes[f"layers.{i}.{name}"] = local
    if head:
        shapes["norm.weight"] = (h,)
        if not (c.tie_word_embeddings and embedding):
            shapes["lm_head.weight"] = _tp_local((c.vocab_size, h), vocab_dim, tp, tp_rank)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@functools.lru_cache(maxsize=4096)
def _block_shapes(config: Qwen2Config, layer: int) -> dict[str, tuple[tuple[int, ...], Optional[int]]]:
    """Block ``layer``'s tensors: name -> (global shape, TP split dim); a dense and a sparse block differ."""
    return block_tensor_shapes(config, layer)


def _dp_local_numel(shape: tuple[int, ...], dp: int, dp_rank: int, fsdp: bool) -> int:
    if not fsdp or dp == 1:
        return _numel(shape)
    return chunk_rows(shape[0], dp, dp_rank) * _numel(shape[1:])


def rank_memory(config: Qwen2Config, tp: int, pp: int, dp: int, data_parallel: str = "fsdp",
                stage_index: int = 0, tp_rank: int = 0, dp_rank: int = 0, precision: str = "bf16-mixed",
                optimizer: str = "adamw", virtual_stages: int = 1, stage_style: str = "loop",
                stage_blocks: Optional[Sequence[int]] = None, ep: int = 1, ep_rank: int = 0,
                expert_dp_rank: Optional[int] = None) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes allocated by the rank at mesh coordinates (pp, dp, tp).

    Args:
        config: the model sizes.
        tp, pp, dp: mesh sizes.
        data_parallel: ``"fsdp"`` (parameters split on dim 0 over dp) or ``"replicate"``.
        stage_index: the rank's pipeline coordinate (0 .. pp-1).
        tp_rank, dp_rank: the rank's tensor and data parallel coordinates.
        precision: a key of :data:`PRECISIONS`.
        optimizer: a key of :data:`OPTIMIZERS`.
        virtual_stages: stages per pipeline rank.
        stage_style: ``"loop"`` (rank r holds r, r+pp, ...) or ``"v"`` (rank r holds r and 2pp-1-r).
        stage_blocks: block counts per stage (``pp * virtual_stages`` of them); ``None`` uses
            :func:`split_blocks`.
        ep, ep_rank: expert parallelism: each of ``ep`` ranks holds its chunk of the experts (dim 0), which FSDP
            shards over the ``dp / ep`` data ranks holding the same ones (``dp`` counts the FSDP ranks, dp x cp).
        expert_dp_rank: the rank's index among those ``dp / ep`` ranks (default ``dp_rank // ep``, right without
            cp).

    Returns:
        ``param_numel``, ``grad_numel``, ``param_tensors``, ``param_bytes``, ``grad_bytes``,
        ``optimizer_bytes`` (states plus step scalars), ``optimizer_state_numel``, ``stage_param_numel``
        (TP- and EP-local, before dp sharding: what FSDP gathers), ``expert_param_numel`` (its experts' part, a unit
        of its own over ``dp / ep`` ranks under ``ep > 1``), ``block_param_numel`` (its blocks' part),
        ``matmul_param_numel`` (the part that feeds matmuls) and ``blocks``.

    Raises:
        ValueError: a coordinate is out of range, or the stages do not cover the blocks.
    """
    for name, value, size in (("stage_index", stage_index, pp), ("tp_rank", tp_rank, tp), ("dp_rank", dp_rank, dp),
                              ("ep_rank", ep_rank, ep)):
        if not 0 <= value < size:
            raise ValueError(f"{name}={value} is out of range for size {size}; use 0 to {size - 1}")
    mode = checked_choice("data_parallel", data_parallel, ("fsdp", "replicate"))
    prec = PRECISIONS[checked_choice("precision", precision, tuple(PRECISIONS))]
    states, has_step = OPTIMIZERS[checked_choice("optimizer", optimizer, tuple(OPTIMIZERS))]
    num_stages = pp * virtual_stages
    mine, blocks = _rank_blocks(config, pp, virtual_stages, stage_index, stage_style, stage_blocks)
    holds_head = num_stages - 1 in mine
    shapes = rank_parameter_shapes(config, tp, tp_rank, blocks, embedding=0 in mine, head=holds_head,
                                   num_stages=num_stages, ep=ep, ep_rank=ep_rank)
    fsdp = mode == "fsdp" and dp > 1
    expert_index = dp_rank // ep if expert_dp_rank is None else expert_dp_rank
    numel = sum(_dp_local_numel(shape, dp // ep, expert_index, fsdp) if ep > 1 and is_expert_tensor(name)
                else _dp_local_numel(shape, dp, dp_rank, fsdp) for name, shape in shapes.items())
    grad_numel = numel
    if tp > 1 and not fsdp and "embed_tokens.weight" in shapes:
        # torch's vocabulary-parallel embedding (RowwiseParallel) produces a Replicate gradient: the full
        # (vocab x hidden) table on every TP rank. FSDP reduce-scatters it into the parameter's shard.
        grad_numel += config.vocab_size * config.hidden_size - _numel(shapes["embed_tokens.weight"])
    return {"param_numel": numel, "grad_numel": grad_numel, "param_tensors": len(shapes),
            "param_bytes": numel * prec.param, "grad_bytes": grad_numel * prec.grad,
            "optimizer_state_numel": numel * states,
            "optimizer_bytes": numel * states * prec.state + (len(shapes) * _STEP_BYTES if has_step else 0),
            **_unsharded_numel(config, shapes, holds_head), "blocks": len(blocks)}


def _unsharded_numel(config: Qwen2Config, shapes: dict[str, tuple[int, ...]], holds_head: bool) -> dict[str, int]:
    """Elements of a rank's TP- and EP-local tensors before FSDP: all (``stage_param_numel``), the experts', the
    blocks' and those feeding matmuls (see :func:`rank_memory`)."""
    return {"stage_param_numel": sum(_numel(shape) for shape in shapes.values()),
            "expert_param_numel": sum(_numel(shape) for name, shape in shapes.items() if is_expert_tensor(name)),
            "block_param_numel": sum(_numel(shape) for name, shape in shapes.items() if name.startswith("layers.")),
            "matmul_param_numel": _matmul_numel(config, shapes, holds_head)}


def _rank_blocks(config: Qwen2Config, pp: int, virtual_stages: int, stage_index: int, stage_style: str,
                 stage_blocks: Optional[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(stage indices, block indices) that pipeline rank ``stage_index`` holds.

    Raises:
        ValueError: ``stage_blocks`` does not give one count per stage covering every block.
    """
    num_stages = pp * virtual_stages
    counts = tuple(stage_blocks) if stage_blocks is not None else split_blocks(config, num_stages)
    if len(counts) != num_stages or sum(counts) != config.num_hidden_layers or min(counts) < 0:
        raise ValueError(f"stage_blocks={list(counts)} must be {num_stages} counts summing to "
                         f"{config.num_hidden_layers} blocks")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    mine = rank_stages(pp, virtual_stages, stage_style)[stage_index]
    return mine, [b for s in mine for b in range(starts[s], starts[s] + counts[s])]


def _matmul_numel(config: Qwen2Config, shapes: dict[str, tuple[int, ...]], holds_head: bool) -> int:
    """Elements of the weights and biases that feed a matmul (what autocast copies).

    All but the norms and the embedding, whose lookup is no matmul, unless it is tied to the head held here.
    """
    embedding_is_head = config.tie_word_embeddings and holds_head
    return sum(_numel(shape) for name, shape in shapes.items()
               if not name.endswith("norm.weight") and (name != "embed_tokens.weight" or embedding_is_head))
