"""Activation memory per token of this project's decoder blocks, head and loss, and the micro-batches a pipeline rank
holds at its peak (the activation half of :mod:`~lightning_hybrid.planner.memory`'s model; its module docstring gives
the counting rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.experts import expert_saved_bytes, is_moe
from lightning_hybrid.planner.memory import PRECISIONS, RECOMPUTE, Precision, checked_choice

__all__ = ["ActivationModel", "activation_model", "inflight_microbatches"]


@dataclass(frozen=True)
class ActivationModel:
    """Bytes saved for backward per token of a micro-batch, on one TP rank.

    Attributes:
        layer: one decoder block.
        embedding: the embedding on the first stage (the saved token ids).
        head: final norm, LM head input and the loss's saved fp32 log-softmax, on the last stage.
        layer_working: transient bytes while one block runs backward (or is recomputed).
        loss_working: transient bytes of the loss's backward: the fp32 gradients of the NLL and of the log-softmax
            (8 bytes per logit), or under loss parallel torch's fused backward of both on the vocabulary shard
            (``zeros_like``, ``exp`` and their sum, 12 bytes per logit).
        logits: the last stage's output, the logits in the compute dtype (all-gathered to the full vocabulary,
            or this rank's vocabulary shard under loss parallel): a pipeline's last stage holds them per micro-batch in
            flight (or, when its schedule returns its outputs, per micro-batch of the step).
        sparse_layer, sparse_working: ``layer`` and ``layer_working`` of a mixture of experts' sparse block.
        stage: what every stage holds once, whatever its blocks: the rotary cos and sin tables, made once per
            forward of the stage and read by all its blocks (per position; exact for one sequence per micro-batch).
    """

    layer: float
    embedding: float
    head: float
    layer_working: float
    loss_working: float
    logits: float = 0.0
    sparse_layer: float = 0.0
    sparse_working: float = 0.0
    stage: float = 0.0


def _norm_saved(h: float, prec: Precision, tp: int, sp: bool, consumers: int, residual: int) -> float:
    """RMSNorm and the inputs its consumers save.

    The norm saves its fp32 input (4h), the normalized value in the model dtype and the fp32 rsqrt. A
    linear after it saves its input: the norm output itself when the dtypes agree (one tensor shared by
    all consumers), else one autocast copy per consumer (q, k, v: 3; gate, up: 2; head: 1). Under sequence
    parallel the norm works on a shard and the consumers save the all-gathered full sequence. ``residual``: bytes per
    element of the residual stream (the norm's input and output dtype).
    """
    own = (4 + residual) * h + 4
    consumer = residual * h if prec.compute == residual else consumers * prec.compute * h
    return (own / tp if sp else own) + consumer


def activation_model(config: Qwen2Config, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                     precision: str = "bf16-mixed", seq_len: int = 4096, loss_parallel: bool = False, ep: int = 1,
                     residual_bytes: Optional[int] = None, fused_projections: bool = True) -> ActivationModel:
    """Saved-for-backward bytes per token for this Qwen2 implementation (see the module docstring).

    ``recompute``: ``"none"``; ``"selective"`` keeps the block input and the outputs of the matmuls and of
    attention and recomputes norms, rotary, SiLU and products (an op-level policy that adds no matmul
    FLOPs); ``"full"`` keeps only each block's input and recomputes the block in backward. ``loss_parallel``: the
    head's logits stay vocabulary shards (``vocab / tp`` per rank) through the loss; else (and at ``tp == 1``) every
    TP rank holds the full vocabulary. A mixture of experts' sparse blocks (``sparse_layer``, ``sparse_working``)
    under ``ep`` (:mod:`~lightning_hybrid.planner.experts`). ``residual_bytes``: bytes per element of the residual
    stream (the blocks' inputs, the norms' dtype, what the expert path sees); ``None`` takes the precision's (fp32
    under ``bf16-mixed``: autocast on fp32 weights). When the forward runs on bf16 weights (FSDP2 gathering in bf16,
    bf16 compute weights) the stream is bf16: the embedding looks up bf16 rows and FSDP2 casts each unit's inputs to
    its ``param_dtype``. ``fused_projections``: q/k/v run as one GEMM (this project's decoder), whose one output
    Qwen3's fp32 q/k norms keep whole (their saved inputs are views of it, v's rows included).
    """
    c, prec = config, PRECISIONS[checked_choice("precision", precision, tuple(PRECISIONS))]
    r = prec.residual if residual_bytes is None else residual_bytes
    mode = checked_choice("recompute", recompute, RECOMPUTE)
    sp = sequence_parallel and tp > 1
    h, d, a = c.hidden_size, c.head_dim, prec.compute
    q = c.num_attention_heads * d
    kv = c.num_key_value_heads * d
    inter = c.intermediate_size
    kv_saved = q if c.num_attention_heads > c.num_key_value_heads else kv  # k, v repeated to the query heads
    lse = 4 * c.num_attention_heads  # fp32 log-sum-exp per head
    # cos and sin tables, made once per forward of a stage (per position; exact for one sequence per micro-batch)
    rotary = 2 * d * a
    # q, k, v and the attention output (o_proj's input is a view of it)
    attention = (a * (q + 2 * kv_saved + q) + lse) / tp
    mlp = 4 * a * inter / tp  # gate out (silu input), silu out, up out, product (down input)
    # Qwen3's per-head q/k norms: the fp32 input, the fp32 rsqrt per head and the normalized value in the compute
    # dtype (the weight's multiply saves it) for q and for k; the rotary products after them save only cos and sin.
    qk_norm = ((4 + a) * (q + kv) + 4 * (c.num_attention_heads + c.num_key_value_heads)) / tp if c.qk_norm else 0.0
    if c.qk_norm and fused_projections and a == 4:
        # in fp32 the norms' float() is the projection output itself: a view of the fused q/k/v output, which stays
        # whole, v's rows too (in a low-precision dtype float() copies and the fused output is not kept)
        qk_norm += a * kv / tp
    full = _norm_saved(h, prec, tp, sp, 3, r) + _norm_saved(h, prec, tp, sp, 2, r) + attention + mlp + qk_norm
    block_input = r * h / (tp if sp else 1)
    if mode == "none":
        layer = full
    elif mode == "selective":
        layer = block_input + _selective_kept(c, a, tp, sp)
    else:
        layer = block_input
    vocab = -(-c.vocab_size // tp) if loss_parallel else c.vocab_size  # logits per token on this rank
    head = _norm_saved(h, prec, tp, sp, 1, r) + 4 * vocab  # final norm + lm_head input + fp32 log-softmax output
    # the loss's backward, as the dry run of the 72B SFT recipe's last stage traces it (docs/dry-run.md): the NLL's and
    # the log-softmax's fp32 gradients; under loss parallel torch's fused backward holds three fp32 shards at once
    loss_working = (12 if loss_parallel and tp > 1 else 8) * vocab
    sparse = _sparse_block(c, prec, tp, sp, mode, full, layer, ep, r) \
        if is_moe(c) else (0.0, 0.0)
    return ActivationModel(layer=layer, embedding=8.0, head=head,
                           layer_working=full + (full if mode != "none" else 0.0), loss_working=loss_working,
                           logits=a * vocab, sparse_layer=sparse[0], sparse_working=sparse[1], stage=rotary)


def _selective_kept(config: Qwen2Config, a: int, tp: int, sp: bool) -> float:
    """Bytes per token a dense block keeps besides its input under the op-level selective policy.

    The matmuls' outputs; with tp > 1 also the o_proj and down_proj matmuls' own outputs before their reduction
    (all-reduce, or reduce-scatter under sequence parallel): full width, full sequence, on every TP rank (the policy
    saves every matmul output; the dry run of the 72B SFT recipe at 32,768 tokens shows them). Under sequence parallel
    the policy also keeps the outputs of the collectives: the all-gathered (full sequence) inputs of the attention and
    MLP projections, on every TP rank (the dry run of the 72B recipes). Attention's output and log-sum-exp too.
    """
    c, h = config, config.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    unreduced = 2 * a * h if tp > 1 else 0.0
    matmul_outputs = a * (q + 2 * kv + 2 * c.intermediate_size) / tp + 2 * a * h / (tp if sp else 1) + unreduced
    gathered = 2 * a * h if sp else 0.0
    return matmul_outputs + gathered + (a * q + 4 * c.num_attention_heads) / tp


def _sparse_block(config: Qwen2Config, prec: Precision, tp: int, sp: bool, mode: str, full: float, layer: float,
                  ep: int, residual: int) -> tuple[float, float]:
    """(saved, working) bytes per token of a sparse block: a dense block's attention half, its second norm feeding
    the router alone, and the expert path (:func:`~lightning_hybrid.planner.experts.expert_saved_bytes`, whole on
    every tp rank) in place of the SwiGLU's."""
    h, a, inter = config.hidden_size, prec.compute, config.intermediate_size
    dense_mlp = _norm_saved(h, prec, tp, sp, 2, residual) + 4 * a * inter / tp
    experts = _norm_saved(h, prec, tp, sp, 1, residual) + expert_saved_bytes(config, "none", a, residual, ep)
    sparse_full = full - dense_mlp + experts
    if mode == "none":
        saved = sparse_full
    elif mode == "selective":  # the SwiGLU's matmul outputs (gate, up, down, down's unreduced) give way to the experts'
        dense_outputs = 2 * a * inter / tp + a * h / (tp if sp else 1) + (a * h if tp > 1 else 0.0)
        saved = layer - dense_outputs + expert_saved_bytes(config, "selective", a, residual, ep)
    else:
        saved = layer
    return saved, sparse_full + (sparse_full if mode != "none" else 0.0)


def inflight_microbatches(schedule: str, pp: int, virtual_stages: int, microbatches: int,
                          pp_rank: int) -> list[int]:
    """Micro-batches whose activations a pipeline rank holds at its peak, per local stage (chunk).

    ``none`` (no pipeline) and ``1f1b`` hold ``min(m, pp - rank)`` for the stage; ``gpipe`` holds all ``m``;
    ``interleaved_1f1b`` follows torch's warm-up: ``(v-1) * m_round + 2 (pp-1-rank)`` forwards plus one,
    assigned to the local stages in rounds of ``m_round`` micro-batches.
    """
    m, v = microbatches, virtual_stages
    if schedule in ("none", "1f1b"):
        return [min(m, pp - pp_rank)] if schedule == "1f1b" else [1]
    if schedule == "gpipe":
        return [m] * v
    if schedule == "interleaved_1f1b":
        rounds = max(1, m // pp)
        per_round = m // rounds
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), m * v)
        inflight = min(warmup + 1, m * v)
        counts = [0] * v
        for step in range(inflight):
            counts[(step // per_round) % v] += 1
        return counts
    raise ValueError(f"schedule={schedule!r} is not modelled; use none, 1f1b, gpipe or interleaved_1f1b")
