"""The planner's mixture-of-experts terms: expert parallelism's sizes, the expert path's bytes, FLOPs and collectives.

A sparse block (Qwen3-MoE: :func:`~lightning_hybrid.models.decoder.moe_config.is_sparse_layer`) replaces the dense
SwiGLU by a router (``h x E``) and ``E`` SwiGLU experts of width ``I`` of which a token uses ``k``. What the planner
counts for it follows the strategy's rules (``distributed/expert_parallel.py``, docs/moe.md); every figure is a
prediction, and two of its rates have not run on hardware (the grouped GEMM kernel and NCCL's all-to-all):

* **Sizes.** ``ep`` is carved from the data-parallel ranks: it divides ``dp`` and ``E``, needs FSDP2
  (``data_parallel="fsdp"``), and ``ep=1`` is always a choice (:func:`ep_sizes`, :func:`ep_reason`). The mesh is
  ``("pp", "edp", "ep", ["cp"], "tp")``: an ep group is ``ep`` consecutive data-parallel ranks, ``tp x cp`` apart.
* **Parameters.** Each ep rank holds ``E / ep`` experts of every sparse layer (``Shard(0)``), FSDP2 shards those over
  the ``edp x cp = dp x cp / ep`` data ranks left: expert weights, gradients and AdamW states are split over all
  ``dp x cp`` data ranks and **replicated over tp** (experts are not split by tensor parallelism). The router and the
  rest of the block are sharded as a dense block's (:mod:`~lightning_hybrid.planner.memory`).
* **Uniform routing.** Each token picks ``k`` experts evenly (the load-balancing loss's aim): a rank sends
  ``t k (ep - 1) / ep`` of its ``t x k`` (token, expert) rows to the other ranks of its ep group and receives as many,
  so after the dispatch it computes ``t k`` rows, ``t k ep / E`` per local expert. Real routing is uneven; the busiest
  rank computes (and holds) more, which the planner does not model.
* **FLOPs.** The router ``6 t h E`` and the experts ``6 t k h 3 I`` per micro-batch of ``t`` tokens (forward and
  backward), the active parameters' count that MFU uses. They run on **every tp rank** for all of its tokens (each tp
  rank is in its own ep group and computes whole experts; under sequence parallelism the layer's input is gathered
  first): tensor parallelism does not divide them, so a tp group computes them ``tp`` times (redundant compute that
  MFU, counting each model FLOP once, shows as a lower figure). Each expert's matmuls are timed at their own shape
  (rows per expert x ``h`` x ``2I``, and x ``I`` x ``h``) on the planner's GEMM-efficiency curve: as one
  ``torch._grouped_mm`` would run them if it reaches a plain GEMM's efficiency at that shape (not measured).
* **All-to-all.** Per sparse layer and micro-batch four all-to-alls of the rows: the dispatch and the combine in
  forward, their gradients the reverse way in backward. Each sends ``t k h x bytes`` (the dispatch in the residual
  stream's dtype, the combine in the compute dtype), of which ``(ep - 1) / ep`` leave the rank; nccl-tests' all-to-all
  bus bandwidth convention (``busbw = algbw x (n - 1) / n``) times them as the bytes leaving over the link's bus
  bandwidth. The link is NVLink when the ep group stays in a node (``ep x cp x tp <= GPUs per node``), else the
  inter-node network for all of it (conservative: the peers inside the node are reached over NVLink meanwhile). All
  of it is **exposed**: the layer waits for its rows before the experts run, and for their outputs before the next
  block (this project overlaps nothing with them; DeepEP-style overlap is not modelled). Besides, per sparse layer and
  micro-batch, the per-expert counts are exchanged (an all-to-all of ``8 E`` bytes over ep) and the load statistics
  summed over the data ranks (an all-reduce of ``8 (2E + 2)`` bytes): latency-bound, exposed. Full recompute replays
  the forward's dispatch, combine, counts and load sum; selective ("op") keeps the all-to-alls' outputs and replays
  the counts and the load sum only.
* **Activations** per token of a sparse block's expert path (:func:`expert_saved_bytes`, counted from
  ``models/decoder/moe.py`` and held against the dry run's trace of tiny-moe): the router's fp32 probabilities, the
  routing indices and weights, per routed row the experts' input, SwiGLU intermediates (``a (h + 4 I)``), the
  combined output and its weighted copy; under selective recompute the router's and experts' matmul outputs and the
  all-to-alls' outputs; under full recompute nothing beyond the block input. Not divided by tp (whole experts on
  every tp rank).
"""

from __future__ import annotations

from typing import Any

from lightning_hybrid.distributed.parallel_dims import divisors

__all__ = ["is_moe", "sparse_flags", "ep_sizes", "ep_reason", "selective_recompute_reason", "all_to_all_buffer",
           "all_to_all_leaving",
           "expert_gemms", "expert_saved_bytes", "expert_elementwise_bytes", "INDEX_BYTES", "LOAD_STAT_BYTES"]

INDEX_BYTES = 8  # an int64 index (topk's choice, the rows' order, the dispatch permutation)
LOAD_STAT_BYTES = 8  # the load statistics are float64 (exact counts beyond fp32's 2**24)


def is_moe(config: Any) -> bool:
    """Whether some block of ``config`` is a mixture of experts."""
    return bool(getattr(config, "has_experts", False))


def sparse_flags(config: Any) -> tuple[bool, ...]:
    """Per block of ``config``: whether it is a mixture of experts (its ``mlp_kind``)."""
    kind = getattr(config, "mlp_kind", None)
    return tuple(kind is not None and kind(i) == "experts" for i in range(config.num_hidden_layers))


def ep_sizes(config: Any, dp: int) -> list[int]:
    """The ep sizes to plan with ``dp`` data-parallel ranks: 1, and for a mixture of experts every divisor of ``dp``
    that divides ``num_experts``."""
    if not is_moe(config):
        return [1]
    return [e for e in divisors(dp) if config.num_experts % e == 0]


def ep_reason(config: Any, ep: int, dp: int, data_parallel: str) -> str:
    """Why ``ep`` cannot run (the strategy's own refusals), or ``''``."""
    if ep == 1:
        return ""
    if not is_moe(config):
        return f"ep={ep} needs a mixture-of-experts model; {getattr(config, 'name', 'this model')} is dense"
    if dp % ep:
        return f"ep={ep} does not divide dp={dp} (expert parallelism is carved from the data-parallel ranks)"
    if config.num_experts % ep:
        return f"ep={ep} does not divide num_experts={config.num_experts}"
    if data_parallel != "fsdp":
        return f"ep={ep} needs data_parallel='fsdp' (the experts are sharded by FSDP2), not {data_parallel!r}"
    return ""


def selective_recompute_reason(ep: int, data_ranks: int, recompute: str, selective_ac: Any = "op") -> str:
    """Why the op-level selective recompute cannot run with this ep (``''`` when it can): with ``ep = dp x cp`` each
    rank's experts are an FSDP2 unit over one rank, inside the recomputed block; its hooks enter torch's profiler
    (``record_function``) a different number of times in the forward and in its recompute (the recompute re-roots the
    unit: ``FSDP::root_pre_forward``), and torch's selective checkpoint, which replays the forward op by op, refuses
    that in backward ("invocation index 2 encountered during backward but not found in storage"). Found by the dry
    run; the real run fails alike (ep=2 x dp=2, tiny-moe). Full recompute (plain checkpointing) and the per-block
    modes run."""
    if ep > 1 and data_ranks == ep and recompute == "selective" and selective_ac == "op":
        return (f"ep={ep} = dp x cp={data_ranks} with activation_checkpointing='selective' (selective_ac='op') is not "
                f"supported: each rank's experts are an FSDP2 unit over one rank, whose hooks differ between the "
                f"forward and its recompute, which torch's selective checkpoint refuses; use ep < dp x cp, "
                f"activation_checkpointing='full' or 'none', or selective_ac='attention'")
    return ""


def all_to_all_buffer(config: Any, tokens: float, element_bytes: int) -> float:
    """Bytes one all-to-all of the rows sends (its buffer): the ``tokens x k`` routed rows of ``h`` elements; what the
    dry run counts per call."""
    return tokens * config.num_experts_per_tok * config.hidden_size * element_bytes


def all_to_all_leaving(config: Any, tokens: float, element_bytes: int, ep: int) -> float:
    """Bytes of one all-to-all of the rows that leave the rank under uniform routing: ``(ep - 1) / ep`` of the
    buffer."""
    return all_to_all_buffer(config, tokens, element_bytes) * (ep - 1) / ep


def expert_gemms(config: Any, tokens: float, ep: int) -> dict[str, tuple[float, int, int, int]]:
    """The matmuls of a sparse layer on one rank for ``tokens`` tokens: name -> (rows, in, out, count).

    ``router``: ``tokens x h x E`` once; ``experts_gate_up`` and ``experts_down``: each of the ``E / ep`` local experts
    on its ``tokens x k x ep / E`` rows (uniform routing), ``h -> 2I`` and ``I -> h``.
    """
    h, inter, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    rows = tokens * config.num_experts_per_tok * ep / e
    return {"router": (tokens, h, e, 1), "experts_gate_up": (rows, h, 2 * inter, e // ep),
            "experts_down": (rows, inter, h, e // ep)}


def _routing_bytes(config: Any, residual: int) -> float:
    """Saved per token for the routing without recompute: the fp32 probabilities, topk's indices (the gather's),
    the renormalization's inputs, the rows' token indices and the combine's order index, and the weights."""
    k = config.num_experts_per_tok
    norm = 4 * k + 4 if config.norm_topk_prob else 0  # the division keeps the top-k probabilities and their sum
    return 4 * config.num_experts + 3 * INDEX_BYTES * k + norm + residual * k


def expert_saved_bytes(config: Any, recompute: str, compute: int, residual: int, ep: int) -> float:
    """Bytes a sparse layer's expert path keeps for backward per token (module docstring), besides its input norm.

    Args:
        recompute: ``"none"``, ``"selective"`` (the ``"op"`` policy) or ``"full"``.
        compute: bytes of a matmul's inputs and outputs (``a``).
        residual: bytes of the residual stream and the layer's input (``r``).
        ep: the expert-parallel size (``ep > 1`` adds the all-to-alls and the dispatch permutation).
    """
    if recompute == "full":
        return 0.0
    h, inter, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    a, r = compute, residual
    if recompute == "selective":  # the router's and the experts' matmul outputs, and the all-to-alls' outputs
        return a * config.num_experts + k * a * (2 * inter + h) + (k * h * (r + a) if ep > 1 else 0.0)
    # per routed row: the experts' input (its compute-dtype copy), gate_up's output, SiLU's output, the product;
    # the combined output (the weights' product keeps it) and its weighted copy (index_add keeps its source)
    rows = k * (a * (h + 4 * inter) + a * h + r * h)
    return _routing_bytes(config, r) + rows + (2 * INDEX_BYTES * k if ep > 1 else 0.0)


def expert_elementwise_bytes(config: Any, compute: int, residual: int, ep: int) -> float:
    """HBM bytes the expert path's elementwise ops move per token in forward (eager, op by op; reads + writes).

    The router's fp32 softmax and top-k (``12 E``); gathering the rows (``2 k h r``) and, under ``ep > 1``, their
    permutation to the local experts and back (``2 k h (r + a)``); autocast's cast of the rows where the residual
    stream is wider (``k h (r + a)``); SiLU and the product (``5 a k I``, as a dense SwiGLU's); concatenating the
    experts' outputs (``2 k h a``); the weights' product (``k h (a + r)``) and the sum per token (``index_add`` into
    zeros: ``k h r + 3 h r``).
    """
    h, inter, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    a, r = compute, residual
    moved = 12 * config.num_experts + 2 * k * h * r + 5 * a * k * inter + 2 * k * h * a + k * h * (a + r) \
        + k * h * r + 3 * h * r
    if ep > 1:
        moved += 2 * k * h * (r + a)
    if r > a:
        moved += k * h * (r + a)
    return moved
