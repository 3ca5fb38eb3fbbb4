"""The collectives one pipeline rank issues in one training step, per mesh dimension: ``{dim: {kind: [calls, bytes]}}``.

A closed form of what this project's code issues (held call for call against the dry run's and the real run's
``CollectiveCounter`` in ``tests/test_dry_run.py`` and ``tests/test_planner_collectives.py``). The bytes of a call
are its largest buffer, as the counter counts them: the gathered output of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce, send, receive or broadcast. ``T`` is the tokens of one micro-batch,
``A = T h b`` an activation of the residual stream and ``L = T V b`` the logits, at ``b`` bytes per element: the
stage's dtype (bf16 when FSDP gathers bf16 weights under ``bf16-mixed`` or under ``bf16-true``, else fp32; DTensor
runs the TP matmuls on the gathered weights' dtype, so autocast does not make them bf16 on fp32 weights).

**tp** (per micro-batch; torch's ``ColwiseParallel``/``RowwiseParallel`` plans of ``tensor_parallel.py``):

* Without sequence parallel, per block: forward 2 all-reduces ``A`` (o_proj and down_proj outputs); backward 2
  with fused projections (``Runtime.fused_projections``, this project's decoder: the input gradient of q/k/v and of
  gate/up leaves each fused GEMM as one partial sum, as in Megatron), else 5 (the input gradient of each colwise
  projection q, k, v, gate and up: each module turns its plain input into its own replicated DTensor, so their
  gradients are reduced one by one).
  The embedding: 1 all-reduce forward. The head: 1 all-reduce of its input gradient and 1 all-gather of the
  logits ``L`` (the loss sees the full vocabulary).
* With sequence parallel, per block: forward 2 all-gathers ``A`` (attention and MLP inputs) and 2 reduce-scatters
  ``A`` (their outputs), backward the same; the 2 norm weights' gradients are partial sums over the sequence shards
  and are all-reduced (``h`` elements each) by FSDP's gradient reduction; without FSDP (``replicate``, or a
  pipeline with ``dp=1``) no collective reduces them: the traced steps issue none, and each TP rank keeps its own
  partial gradient. The embedding: 1 reduce-scatter forward, 1 all-gather backward. The
  head: 1 all-gather of its input and 1 of the logits forward, 1 reduce-scatter backward, and its norm's gradient
  all-reduced. The norm all-reduces come once per FSDP gradient reduction: per micro-batch in the parameters'
  dtype without a pipeline, once per step in the reduction dtype (fp32) when a pipeline accumulates them.
* Loss parallel (``loss_parallel=True``, the strategy's default): the head's logits stay vocabulary shards, no
  all-gather of ``L``; the cross-entropy all-reduces 3 fp32 values per token forward (maximum, sum of exponentials,
  target logit): 3 all-reduces of ``T x 4`` bytes.
* Recompute: ``full`` (and every k-th block of ``selective_ac=k``) replays the block's forward up to its last saved
  tensor (torch's non-reentrant checkpoint stops there): the 2 all-reduces minus the last (+1), or under sequence
  parallel the 2 all-gathers and the first reduce-scatter (+2, +1). ``selective`` with ``op`` saves collective
  outputs: nothing repeats; ``attention`` replays attention up to its last saved tensor, before o_proj's collective.

**dp**, FSDP2 (one unit per block, a root unit of the embedding, final norm and head the rank holds):

* Without a pipeline, per micro-batch: every unit all-gathered in forward, each block again in backward (the root
  stays gathered, ``reshard_after_forward=False``), every unit reduce-scattered: ``1 + 2 n`` all-gathers and
  ``n + 1`` reduce-scatters for ``n`` blocks.
* Under a 1F1B or GPipe pipeline torch keeps the units gathered after each backward and reduce-scatters once per
  step. With ``fsdp_reshard_after_forward="auto"`` (the strategy's default) or ``False`` a block stays gathered
  after forward too: 1 all-gather per unit per step. With ``True`` a block is resharded after each forward, so it
  is gathered by every forward that follows a forward (the warm-up) and every backward that follows a forward:
  ``m + 1`` times for ``m`` micro-batches, on every rank.
  The root is gathered once.
* Bytes: the unit's TP-local elements padded to ``dp`` equal dim-0 shards, times the gather dtype (bf16 under
  bf16 precisions) or times the reduction dtype (fp32).
* ``replicate``: the gradients are all-reduced once per step in buckets of about 25 MiB (greedily, in parameter
  order; torch's vocabulary-parallel embedding has a full-table gradient), in fp32.
* With a pipeline, the last stage all-reduces the label-token count and the loss sum (4 bytes each).

**pp**: per micro-batch a stage that has a next stage sends its output and receives its gradient, one that has a
previous stage receives its input and sends its gradient (``mbs x seq x h``, the sequence shard under sequence
parallel); once per step the loss statistics are broadcast from the last stage (8 bytes).

**world**: the gradient-norm clipping's all-reduce of the squared norm (a float64); without a pipeline also the
loss statistics' all-reduce (8 bytes). A mesh dimension as large as the world is reported as ``world``.

**A mixture of experts** (``planner/experts.py``; uniform routing, as the dry run routes), per sparse block and
micro-batch: over **ep** one all-to-all of the per-expert counts (``8 E`` bytes) and four of the rows (the dispatch and
the combine forward, their gradients backward), ``T k h b`` each (the buffer; ``(ep - 1) / ep`` of it leaves the rank);
over **dp** one all-reduce of the load statistics (``8 (2E + 2)`` bytes). A recompute replays the counts and the load
sum (``selective`` with ``op``), and under ``full`` (or a k-th block) the forward's two row all-to-alls too. Once per
step the layers' statistics are summed over the **world** (``8 x 4 L`` bytes). Under ``ep > 1`` each sparse block's
experts are an FSDP unit of their own over **edp** (``dp / ep`` ranks; none when that is one rank), gathered and
reduce-scattered like the block; the block's own unit leaves them out. Under tp the experts are whole on every rank:
a sparse block issues the attention half's TP collectives only (1 all-reduce forward, 3 backward), and under
sequence parallel the experts' input all-gather forward and their output gradient's all-gather backward.

Not modelled (``ValueError``): context parallelism, HSDP, and schedules other than 1F1B and GPipe with one stage
per rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Optional, Union

from lightning_hybrid.distributed.options import GRADIENT_BUCKET_BYTES
from lightning_hybrid.models.decoder.moe_config import is_expert_tensor
from lightning_hybrid.planner.experts import INDEX_BYTES, LOAD_STAT_BYTES, all_to_all_buffer, is_moe, sparse_flags
from lightning_hybrid.planner.layout import Layout, Problem
from lightning_hybrid.planner.memory import chunk_rows, rank_parameter_shapes, split_blocks

__all__ = ["predicted_collectives", "COLWISE_PER_BLOCK", "FUSED_COLWISE_PER_BLOCK", "colwise_all_reduces",
           "tp_all_reduce_equivalents", "fsdp_block_gathers"]

Table = dict[str, dict[str, list[int]]]
Add = Callable[[str, str, int, int], None]  # (dimension, kind, calls, bytes of each call)

COLWISE_PER_BLOCK = 5  # q, k, v, gate, up: one input-gradient all-reduce each without sequence parallel
FUSED_COLWISE_PER_BLOCK = 2  # fused q/k/v and gate/up: one input-gradient all-reduce per fused GEMM
# what a sparse layer logs per step (models/decoder/moe.py's METRICS: load balance, load-balancing loss, dropped
# tokens), summed over the world with a presence flag: the planner does not import the model code
METRICS_PER_LAYER = ("load_max_over_mean", "aux_loss", "dropped_tokens")
_SCHEDULES = ("none", "1f1b", "gpipe")
_SCALAR = 4  # a float32 loss statistic
_NORM_SQUARED = 8  # the float64 squared gradient norm


def colwise_all_reduces(fused_projections: bool) -> int:
    """Backward all-reduces of the colwise projections' input gradients per dense block without sequence parallel:
    one per fused GEMM (q/k/v, gate/up) or one per projection."""
    return FUSED_COLWISE_PER_BLOCK if fused_projections else COLWISE_PER_BLOCK


def sparse_block_saving(fused_projections: bool) -> int:
    """All-reduces a sparse block (a mixture of experts, whole on every tp rank) has fewer than a dense one without
    sequence parallel: the down projection's forward all-reduce and the gate/up input gradients (1 fused, 2 not)."""
    return 1 + (1 if fused_projections else 2)


def tp_all_reduce_equivalents(sequence_parallel: bool, sparse: bool = False,
                              fused_projections: bool = True) -> tuple[float, float]:
    """TP traffic of one block and micro-batch in all-reduces of the residual stream (an all-gather and a
    reduce-scatter make one): (forward and backward, added by a replayed forward). The planner's time model uses it.

    Without sequence parallel 2 + the colwise input gradients (2 fused, 5 one by one: :func:`colwise_all_reduces`)
    and 1 replayed (the down projection's, after the last saved tensor, is not); with it 4 pairs, and 2 all-gathers
    and 1 reduce-scatter replayed. A sparse block (``sparse``: a mixture of experts, whole on every tp rank) has the
    attention half's only (the output projection's and q/k/v's input gradients: 1 + 1 fused, 1 + 3 not; 1
    replayed), plus under sequence parallel the experts' input all-gather and their output gradient's all-gather
    (2 pairs + 2 all-gathers, 1.5 replayed).
    """
    dense = 2.0 + colwise_all_reduces(fused_projections)
    if sparse:
        return (3.0, 1.5) if sequence_parallel else (dense - sparse_block_saving(fused_projections), 1.0)
    return (4.0, 1.5) if sequence_parallel else (dense, 1.0)


def fsdp_block_gathers(pp: int, microbatches: int, reshard_after_forward: Union[bool, str] = True) -> int:
    """All-gathers of one FSDP block unit per step: forward and backward of each micro-batch without a pipeline;
    under a 1F1B or GPipe pipeline ``m + 1`` when blocks reshard after forward (the warm-up forwards and each
    backward that follows a forward), 1 when they stay gathered (``"auto"`` or ``False``)."""
    if pp == 1:
        return 2 * microbatches if reshard_after_forward in (True, "auto") else microbatches
    return microbatches + 1 if reshard_after_forward is True else 1


def _stage_bytes(problem: "Problem", layout: "Layout") -> int:
    """Bytes per element of the stage's activations (and of TP collectives, pipeline messages, FSDP gathers)."""
    if problem.precision == "bf16-true":
        return 2
    fsdp_bf16 = problem.precision == "bf16-mixed" and layout.data_parallel == "fsdp" and layout.dp > 1
    return 2 if fsdp_bf16 else 4


def _check(layout: "Layout") -> None:
    if layout.cp > 1 or layout.data_parallel == "hsdp":
        raise ValueError(f"cp={layout.cp}, data_parallel={layout.data_parallel!r}: the collectives of context "
                         f"parallelism and HSDP are not modelled; use cp=1 and fsdp or replicate")
    if layout.pp > 1 and (layout.schedule not in _SCHEDULES[1:] or layout.virtual_stages != 1):
        raise ValueError(f"schedule={layout.schedule!r} with virtual_stages={layout.virtual_stages}: only 1f1b and "
                         f"gpipe with one stage per rank are modelled")


def _dimension_names(layout: "Layout") -> dict[str, Optional[str]]:
    """Mesh dimension -> the name the counter files it under (``world`` when it spans the world, ``None`` when a
    dimension of size 1 issues nothing)."""
    world = layout.tp * layout.pp * layout.dp
    sizes = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp, "ep": layout.ep, "edp": layout.dp // layout.ep}
    names: dict[str, Optional[str]] = {d: (None if n == 1 else "world" if n == world else d) for d, n in sizes.items()}
    names["world"] = "world" if world > 1 else None
    if layout.ep == layout.dp and names["dp"] == "dp":  # the flattened dp is the ep group itself: named "ep"
        names["dp"] = "ep"
    return names


def _rank_parts(problem: "Problem", layout: "Layout", pp_rank: int) -> tuple[list[int], bool, bool]:
    """(global block indices, holds the embedding, holds the head) of pipeline rank ``pp_rank``."""
    counts = split_blocks(problem.config, layout.pp)
    start = sum(counts[:pp_rank])
    return list(range(start, start + counts[pp_rank])), pp_rank == 0, pp_rank == layout.pp - 1


def _replayed(recompute: str, selective_ac: Union[str, int], block: int) -> bool:
    """Whether the block's whole forward is replayed in backward (full recompute, or a k-th block)."""
    if recompute == "full":
        return True
    return recompute == "selective" and not isinstance(selective_ac, str) and block % int(selective_ac) == 0


def _tensor_parallel(add: Add, problem: "Problem", layout: "Layout", pp_rank: int, m: int,
                     selective_ac: Union[str, int], loss_parallel: bool = False) -> None:
    """TP collectives of ``m`` micro-batches (see the module docstring)."""
    c, b = problem.config, _stage_bytes(problem, layout)
    blocks, embedding, head = _rank_parts(problem, layout, pp_rank)
    act = layout.micro_batch_size * problem.seq_len * c.hidden_size * b
    logits = layout.micro_batch_size * problem.seq_len * c.vocab_size * b
    replayed = sum(_replayed(layout.recompute, selective_ac, i) for i in blocks)
    sparse = sum(sparse_flags(c)[i] for i in blocks)  # whole experts: the attention half's TP collectives only
    if loss_parallel:  # the cross-entropy's 3 fp32 all-reduces per micro-batch instead of the logits' all-gather
        add("tp", "all_reduce", 3 * m * head, layout.micro_batch_size * problem.seq_len * 4)
        logits = 0
    if not layout.sequence_parallel:
        fused = problem.runtime.fused_projections
        add("tp", "all_reduce", m * (len(blocks) * (2 + colwise_all_reduces(fused))
                                     - sparse_block_saving(fused) * sparse + replayed + embedding + head), act)
        add("tp", "all_gather", m * head * bool(logits), logits)
    else:
        add("tp", "all_gather", m * (4 * len(blocks) + 2 * replayed + embedding + head), act)
        add("tp", "reduce_scatter", m * (4 * len(blocks) - 2 * sparse + replayed + embedding + head), act)
        add("tp", "all_gather", m * head * bool(logits), logits)
    # the norm weights' partial gradients (block norms under sequence parallel; Qwen3's per-head q/k norms, which see
    # a shard of the heads, always) are reduced by FSDP's gradient reduction only (none without FSDP)
    fsdp = layout.data_parallel == "fsdp" and layout.dp > 1
    reductions = [(2 * len(blocks) + head, c.hidden_size)] if layout.sequence_parallel else []
    reductions += [(2 * len(blocks), c.head_dim)] if c.qk_norm else []
    for count, width in reductions if fsdp else []:
        if layout.pp > 1:
            add("tp", "all_reduce", count, width * 4)  # accumulated in fp32, reduced at the step's end
        else:
            add("tp", "all_reduce", m * count, width * b)


def _unit_numel(shapes: dict[str, tuple[int, ...]], dp: int) -> int:
    """Elements of an FSDP unit's all-gather output: each tensor padded to ``dp`` equal dim-0 shards."""
    return sum(dp * chunk_rows(s[0], dp, 0) * math.prod(s[1:]) for s in shapes.values())


def _fsdp(add: Add, problem: "Problem", layout: "Layout", pp_rank: int, m: int,
          reshard_after_forward: Union[bool, str] = True) -> None:
    """FSDP2's all-gathers and reduce-scatters (see the module docstring)."""
    c, dp = problem.config, layout.dp
    blocks, embedding, head = _rank_parts(problem, layout, pp_rank)
    gather_bytes = 2 if problem.precision.startswith("bf16") else 4
    units = [_block_units(c, layout, i) for i in blocks]  # (the block's unit, its experts' unit under ep > 1)
    root_shapes = rank_parameter_shapes(c, layout.tp, 0, [], embedding=embedding, head=head,
                                        num_stages=layout.pp)
    root = _unit_numel(root_shapes, dp)
    roots = 1 if root else 0
    # without a pipeline every micro-batch is a step of its own; a pipeline gathers blocks m + 1 times, reduces once
    gathers = fsdp_block_gathers(layout.pp, m, reshard_after_forward)
    root_gathers, scatters = (m, m) if layout.pp == 1 else (1, 1)
    for block, experts in units:
        add("dp", "all_gather", gathers, block * gather_bytes)
        add("dp", "reduce_scatter", scatters, block * 4)
        if experts and layout.dp > layout.ep:  # an FSDP unit over one rank issues nothing
            add("edp", "all_gather", gathers, experts * gather_bytes)
            add("edp", "reduce_scatter", scatters, experts * 4)
    add("dp", "all_gather", root_gathers * roots, root * gather_bytes)
    add("dp", "reduce_scatter", scatters * roots, root * 4)


def _block_units(config: object, layout: "Layout", block: int) -> tuple[int, int]:
    """(elements of block ``block``'s FSDP unit, of its experts' own unit: 0 unless ``ep > 1``), each tensor padded to
    its unit's equal dim-0 shards (dp, or dp / ep for the experts)."""
    shapes = rank_parameter_shapes(config, layout.tp, 0, [block], embedding=False, head=False, ep=layout.ep)
    if layout.ep == 1:
        return _unit_numel(shapes, layout.dp), 0
    experts = {name: shape for name, shape in shapes.items() if is_expert_tensor(name)}
    dense = {name: shape for name, shape in shapes.items() if name not in experts}
    return _unit_numel(dense, layout.dp), _unit_numel(experts, layout.dp // layout.ep)


def _experts(add: Add, problem: "Problem", layout: "Layout", pp_rank: int, m: int,
             selective_ac: Union[str, int]) -> None:
    """A mixture of experts' collectives (module docstring): per sparse block and micro-batch the all-to-alls over
    ep and the load sum over dp, with what a recompute replays; once per step the statistics' sum over the world."""
    c = problem.config
    blocks, _, _ = _rank_parts(problem, layout, pp_rank)
    flags = sparse_flags(c)
    sparse = [i for i in blocks if flags[i]]
    tokens = layout.micro_batch_size * problem.seq_len  # whole on every tp rank (gathered under sequence parallel)
    rows = all_to_all_buffer(c, tokens, _stage_bytes(problem, layout))
    for block in sparse:
        full = _replayed(layout.recompute, selective_ac, block)
        small = 1 + (full or (layout.recompute == "selective" and selective_ac == "op"))  # forward (and replay)
        add("ep", "all_to_all", m * small, INDEX_BYTES * c.num_experts)
        add("ep", "all_to_all", m * (4 + 2 * full), rows)
        add("dp", "all_reduce", m * small, LOAD_STAT_BYTES * (2 * c.num_experts + 2))
    add("world", "all_reduce", 1, LOAD_STAT_BYTES * (len(METRICS_PER_LAYER) + 1) * c.num_hidden_layers)


def _replicate(add: Add, problem: "Problem", layout: "Layout", pp_rank: int) -> None:
    """The bucketed gradient all-reduces of ``replicate`` (``all_reduce_gradients``), once per step, in fp32."""
    c = problem.config
    blocks, embedding, head = _rank_parts(problem, layout, pp_rank)
    shapes = rank_parameter_shapes(c, layout.tp, 0, blocks, embedding=embedding, head=head, num_stages=layout.pp)
    grads = [math.prod(s) for s in _registration_order(shapes).values()]
    if embedding and layout.tp > 1:  # the vocabulary-parallel embedding's gradient is the full table
        grads[0] = c.vocab_size * c.hidden_size
    grad_bytes = 2 if problem.precision == "bf16-true" else 4
    buckets: list[int] = [0]
    for numel in grads:
        if buckets[-1] * grad_bytes > GRADIENT_BUCKET_BYTES:
            buckets.append(0)
        buckets[-1] += numel
    for numel in buckets:
        add("dp", "all_reduce", 1, numel * 4)


_BLOCK_ORDER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                "mlp.gate", "mlp.experts")  # a sparse block: the router, then the experts


def _registration_order(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The parameters in ``model.parameters()`` order: embedding, blocks (modules as the block registers them),
    final norm, head."""
    def key(name: str) -> tuple:
        if name.startswith("embed_tokens"):
            return (0,)
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            module = next(i for i, prefix in enumerate(_BLOCK_ORDER) if rest.startswith(prefix + "."))
            return (1, int(index), module, rest.endswith("bias"))
        return (2, name != "norm.weight")

    return {name: shapes[name] for name in sorted(shapes, key=key)}


def _pipeline_and_step(add: Add, problem: "Problem", layout: "Layout", pp_rank: int, m: int,
                       gradient_clipping: bool) -> None:
    """Pipeline messages, the loss statistics and the gradient-norm all-reduce."""
    if layout.pp > 1:
        seq = problem.seq_len // layout.tp if layout.sequence_parallel else problem.seq_len
        message = layout.micro_batch_size * seq * problem.config.hidden_size * _stage_bytes(problem, layout)
        neighbours = (pp_rank > 0) + (pp_rank < layout.pp - 1)
        add("pp", "send", m * neighbours, message)
        add("pp", "recv", m * neighbours, message)
        add("pp", "broadcast", 1, 2 * _SCALAR)
        if pp_rank == layout.pp - 1:
            add("dp", "all_reduce", 2, _SCALAR)
    else:
        add("world", "all_reduce", 1, 2 * _SCALAR)
    if gradient_clipping:
        add("world", "all_reduce", 1, _NORM_SQUARED)


def predicted_collectives(problem: "Problem", layout: "Layout", pp_rank: int,
                          traced_microbatches: Optional[int] = None, *, gradient_clipping: bool = True,
                          selective_ac: Union[str, int] = "op", loss_parallel: bool = False,
                          reshard_after_forward: Union[bool, str] = True) -> Table:
    """The collectives pipeline rank ``pp_rank`` of ``layout`` issues in one step (module docstring).

    Args:
        problem: the model, sequence length and precision (the hardware is not used).
        layout: sizes, data-parallel mode, micro-batch size, schedule, recompute, sequence parallel.
        pp_rank: the rank's pipeline coordinate.
        traced_microbatches: micro-batches of the step; ``None`` for the layout's own (``layout.microbatches``
            with a pipeline, 1 without: one Lightning step). The dry run traces fewer of a pipeline's.
        gradient_clipping: the Trainer clips by the global norm (``gradient_clip_val``).
        selective_ac: the strategy's ``selective_ac`` (``"op"``, ``"attention"`` or a block stride).
        loss_parallel: the strategy's ``loss_parallel`` (its default is ``True``; ``False`` here keeps the tables
            counted before it existed).
        reshard_after_forward: the strategy's ``fsdp_reshard_after_forward`` (its default is ``"auto"``).

    Returns:
        ``{dim: {kind: [calls, bytes]}}`` with dims ``pp``, ``dp``, ``tp``, ``world``, sorted as the dry run's.

    Raises:
        ValueError: a pipeline coordinate out of range or a layout that is not modelled (see the module docstring).
    """
    _check(layout)
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is out of range for pp={layout.pp}; use 0 to {layout.pp - 1}")
    m = traced_microbatches if traced_microbatches is not None else (layout.microbatches if layout.pp > 1 else 1)
    names = _dimension_names(layout)
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))

    def add(dim: str, kind: str, calls: int, each: int) -> None:
        name = names[dim]
        if name is None or calls == 0:
            return
        entry = table[name][kind]
        entry[0] += calls
        entry[1] += calls * each

    if layout.tp > 1:
        _tensor_parallel(add, problem, layout, pp_rank, m, selective_ac, loss_parallel)
    if is_moe(problem.config):
        _experts(add, problem, layout, pp_rank, m, selective_ac)
    if layout.dp > 1:
        if layout.data_parallel == "fsdp":
            _fsdp(add, problem, layout, pp_rank, m, reshard_after_forward)
        else:
            _replicate(add, problem, layout, pp_rank)
    _pipeline_and_step(add, problem, layout, pp_rank, m, gradient_clipping)
    return {dim: {kind: list(v) for kind, v in sorted(kinds.items())} for dim, kinds in sorted(table.items())}

