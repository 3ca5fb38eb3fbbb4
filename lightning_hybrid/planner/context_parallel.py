"""Context parallelism's cost in one block: the K/V exchange that stays in the critical path, and the attention core.

``Runtime.ring_attention`` says which implementation runs:

* ``"blockwise"``, this project's (``distributed/context_parallel.py``): each block's K/V are all-gathered at their
  own (KV) heads in one collective and their gradients reduce-scattered; the local queries then meet the ``cp``
  gathered K/V blocks one at a time as plain fp32 matmuls, each block in full (no causal skipping inside a block),
  under activation checkpointing: the forward runs again in backward, and while a block's backward runs every
  block's scores, masks and probabilities are held at once (``(seq / cp)^2`` per query head and sequence each). The
  time is its matmul FLOPs at the fp32 peak and its elementwise passes over the scores
  (:data:`BLOCKWISE_SCORE_BYTES`); the memory :func:`blockwise_working_bytes`. Exact, and fine on CPU; on GPUs at
  long sequences it is slow and large (the 72B SFT recipe at 32,768 tokens, tp=4 x cp=2, holds over 100 GB in it).
* ``"gather"``, Llama 3's (all-gather based: K/V gathered at their own heads, then a fused attention kernel for the
  local query chunk): the same exchange, attention at the planner's fused-kernel efficiency.
* ``"rotate"``, torch's ``context_parallel`` as torchtitan runs it: K/V repeated to the query heads (the model
  repeats them before SDPA) pass around the ring one step at a time: ``cp - 1`` steps forward (again when the block
  is recomputed), and in backward the K/V again plus the fp32 dK/dV accumulators for ``cp`` steps; each step also
  merges the partial outputs (and gradients) in fp32 (:data:`RING_MERGE_FORWARD_BYTES`,
  :data:`RING_MERGE_BACKWARD_BYTES`). The exchange of a step is counted in the critical path: torchtitan's rows at
  64k-256k tokens with cp 2-8 (``benchmarks/planner_published.py``) are 25-56% slower than a model with it
  overlapped per step (each step's attention outlasts its transfer), and within 12% with it exposed.

Nothing here is fitted: bytes over bandwidths, FLOPs over peaks.
"""

from __future__ import annotations

from lightning_hybrid.planner.layout import Layout, Problem

__all__ = ["cp_block_seconds", "blockwise_attention_seconds", "blockwise_working_bytes", "RING_ATTENTION",
           "RING_MERGE_FORWARD_BYTES", "RING_MERGE_BACKWARD_BYTES", "BLOCKWISE_SCORE_BYTES", "BLOCKWISE_SAVED_BYTES",
           "BLOCKWISE_BACKWARD_BYTES"]

RING_ATTENTION = ("blockwise", "gather", "rotate")
RING_MERGE_FORWARD_BYTES = 38
"""HBM bytes per element of a rank's attention output (tokens x query heads x head_dim) and ring step after the first,
in forward, of torch's ring outside the attention kernels (``_SDPAMerger``, fp32): the step's output cast to fp32 (2 +
4), ``out - out_b`` (8 + 4), the scale by ``sigmoid(lse_b - lse)`` (4 + 4), the subtraction (8 + 4)."""
RING_MERGE_BACKWARD_BYTES = 46
"""The same per ring step in backward (``_templated_ring_attention_backward``): the fp32 dQ, dK and dV accumulations (3
x (4 + 2 + 4)), the concatenated fp32 dK/dV sent on (8 + 8)."""
BLOCKWISE_SCORE_BYTES = 147
"""HBM bytes per score element (query x key x head) of this project's blockwise core, its forward twice (the pass and
the checkpoint's replay) and its backward, counted from ``distributed/context_parallel.py``'s ``_block``: per forward
the product written (4), scaled (4 + 4), masked (1 + 4 + 4), the log-sum-exp read (4), the shift (4 + 4), the
exponential (4 + 4) and read by the second product (4): 45; the backward 57 (the probabilities' gradient 4, times the
probabilities 4 + 4 + 4, the shift's and log-sum-exp's gradients 4 + 4 + 4, the mask 1 + 4 + 4, the scale 4 + 4, the
first product's two reads 4 + 4)."""
BLOCKWISE_SAVED_BYTES = 8
"""Bytes per score element a block keeps for backward once its forward is replayed: the masked scores (the
log-sum-exp's input, 4) and the probabilities (the exponential's output, 4); the mask is per query-key pair, shared by
the heads. As the dry run traces it (``where`` and ``exp`` of every block held in the first block's backward)."""
BLOCKWISE_BACKWARD_BYTES = 12
"""Bytes per score element of one block's backward working set: the probabilities' gradient, its product with the
probabilities and the shifted scores' gradient, fp32 each (``mul``, ``sub`` and the one being made, traced)."""


def _exchange_passes(layout: Layout) -> int:
    return 2 if layout.recompute == "full" else 1  # the forward, and its replay under full recompute


def cp_block_seconds(problem: Problem, layout: Layout, tokens: int, attention_bytes: int) -> float:
    """One block's exposed context-parallel exchange per micro-batch (see the module docstring): ``tokens`` local
    tokens, ``attention_bytes`` per K/V element."""
    if layout.cp == 1:
        return 0.0
    c, hw, a = problem.config, problem.hw, attention_bytes
    inter_node = layout.tp * layout.cp > hw.gpus_per_node  # cp ranks are tp apart
    passes = _exchange_passes(layout)
    if problem.runtime.ring_attention != "rotate":
        nbytes = 2 * tokens * layout.cp * c.num_key_value_heads // layout.tp * c.head_dim * a
        collective = lambda kind: hw.collective(kind, nbytes, layout.cp, inter_node, blocking=True)  # noqa: E731
        return passes * collective("all_gather") + collective("reduce_scatter")
    heads = c.num_attention_heads // layout.tp  # K/V repeated to the query heads before attention
    kv = 2 * tokens * heads * c.head_dim  # this rank's K and V elements, sent on at every step
    step = lambda nbytes: hw.collective("p2p", nbytes, 2, inter_node, blocking=True)  # noqa: E731
    exchange = (passes + 1) * (layout.cp - 1) * step(kv * a) + layout.cp * step(kv * 4)
    merges = ((layout.cp - 1) * passes * RING_MERGE_FORWARD_BYTES + layout.cp * RING_MERGE_BACKWARD_BYTES) * (
        tokens * heads * c.head_dim)
    return exchange + merges / (hw.gpu.hbm_tbs * 1e12 * problem.time_model.hbm_efficiency)


def _score_elements(problem: Problem, layout: Layout, tokens: int) -> float:
    """Score elements of one K/V block of the blockwise core: the local queries of ``tokens`` tokens against the
    block's ``seq / cp`` keys, per query head on this TP rank."""
    return tokens * (problem.seq_len // layout.cp) * problem.config.num_attention_heads / layout.tp


def blockwise_attention_seconds(problem: Problem, layout: Layout, tokens: int) -> tuple[float, float]:
    """(seconds of the blockwise core per block and micro-batch, the part a full recompute of the block adds): the
    ``cp`` blocks' two products at the fp32 peak (forward, its checkpoint replay, backward twice the forward) and the
    elementwise passes over their scores."""
    hw, c = problem.hw, problem.config
    scores = _score_elements(problem, layout, tokens) * layout.cp
    forward_flops = 4 * scores * c.head_dim  # q k^T and p v, 2 FLOPs per multiply-add each
    rate = hw.gpu.peak.fp32 * hw.compute_efficiency
    hbm = hw.gpu.hbm_tbs * 1e12 * problem.time_model.hbm_efficiency
    forward = forward_flops / rate + scores * BLOCKWISE_SCORE_BYTES * 45 / 147 / hbm
    core = 4 * forward_flops / rate + scores * BLOCKWISE_SCORE_BYTES / hbm
    return core, forward if layout.recompute == "full" else 0.0


def blockwise_working_bytes(problem: Problem, layout: Layout, tokens: int) -> float:
    """Bytes the blockwise core holds while one block's backward runs: every K/V block's saved scores, masks and
    probabilities (:data:`BLOCKWISE_SAVED_BYTES`) and one block's backward (:data:`BLOCKWISE_BACKWARD_BYTES`); 0
    without context parallelism or with another core."""
    if layout.cp == 1 or problem.runtime.ring_attention != "blockwise":
        return 0.0
    return _score_elements(problem, layout, tokens) * (layout.cp * BLOCKWISE_SAVED_BYTES + BLOCKWISE_BACKWARD_BYTES)
