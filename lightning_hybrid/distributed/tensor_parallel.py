"""Tensor parallelism: turn a model's declared TP plan into torch's TP styles and apply it.

Colwise layers split their output features over the ``tp`` ranks, rowwise layers their input
features, so each attention/MLP pair costs one all-reduce forward and one backward (Megatron
layout). With ``sequence_parallel`` the norms work on a sequence shard and the all-reduce becomes
a reduce-scatter plus an all-gather, which saves activation memory at the same traffic.

Loss parallel (``loss_parallel=True``): the head keeps its logits split over the vocabulary and the cross-entropy
runs on those shards (torch's ``loss_parallel``: three all-reduces of one float per token instead of an all-gather
of ``tokens x vocab`` logits), so no rank ever holds the full-vocabulary logits.

Fused projections (a model's ``fused_projections``: q/k/v, gate/up): each part keeps its own colwise split, so a rank
holds whole heads and whole key/value groups of each; :class:`FusedColwiseParallel` makes the fused module compute
on this rank's shards (one GEMM of the concatenated local weights) and gives the input's gradient as one partial sum
(one all-reduce, or one reduce-scatter under sequence parallelism, for the three projections).

Async TP (``async_tp=True``): torch's micro-pipelined TP, inductor's pass that splits each sequence-parallel
all-gather/reduce-scatter and its matmul into chunks that overlap over symmetric memory (CUDA and NCCL only).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_hybrid.distributed.parallel_dims import tied_embedding_error
from lightning_hybrid.models.spec import ParallelSpec, holds

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_tensor_parallel", "block_plan", "outer_plan", "vocab_parallel_loss", "loss_parallel_context",
           "full_vocabulary", "backward_in_loss_parallel", "enable_async_tp", "FusedColwiseParallel"]


def _local_input(x: Tensor, mesh: "DeviceMesh", input_layout: Placement) -> Tensor:
    """This rank's copy of the whole input of a colwise product, whose gradient leaves as a partial sum over the TP
    ranks (each rank's rows of the output contribute their part): all-reduced, or reduce-scattered back onto the
    sequence shards where the input came from."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (input_layout,), run_check=False)
    if x.placements != (Replicate(),):
        x = x.redistribute(placements=(Replicate(),))
    return x.to_local(grad_placements=(Partial(),))


def _local_shard(t: Any) -> Any:
    """This rank's shard of a parameter (its gradient comes back as that shard's); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


class FusedColwiseParallel(ParallelStyle):
    """Tensor parallelism of a :class:`~lightning_hybrid.models.fused.FusedLinear`: its parts are colwise linears
    sharded on their own (``ColwiseParallel`` on each: rows split per part, so a rank holds whole heads of q, whole
    key/value groups of k and v, its slice of gate and of up), and the fused module runs on this rank's shards.

    Before each call the input becomes this rank's whole copy (from a replicated or sequence-sharded DTensor, or a
    plain tensor in ``input_layout``) with its gradient given back as a partial sum (one all-reduce, or one
    reduce-scatter under sequence parallelism, for all the parts), and the parts' weights and biases become their
    local shards. Concatenating DTensors split on dim 0 would gather them; concatenating the local shards is this
    rank's rows of every part, in order, and the module's split by the local sizes gives each part's local output
    (a plain tensor, as ``ColwiseParallel`` gives with ``use_local_output``).

    Args:
        input_layout: the layout of a plain-tensor input (``Replicate()``; the sequence-parallel input arrives as a
            DTensor from the block's input preparation).
    """

    def __init__(self, input_layout: Optional[Placement] = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _prepare(self, mesh: "DeviceMesh", module: nn.Module, args: tuple) -> tuple:
        x, weights, biases = (*args, None)[:3]
        return (_local_input(x, mesh, self.input_layout), [_local_shard(w) for w in weights],
                None if biases is None else [_local_shard(b) for b in biases])

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        module.register_forward_pre_hook(functools.partial(self._prepare, device_mesh))
        return module


def block_plan(spec: ParallelSpec, sequence_parallel: bool) -> dict:
    """The ``parallelize_module`` plan of one block (its fused modules included; :func:`apply_tensor_parallel` leaves
    out the entries a block does not hold)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict = {}
    for name, style in spec.block_plan.items():
        if style == "colwise":
            plan[name] = ColwiseParallel()
        else:
            plan[name] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    for name in spec.fused_projections:
        plan[name] = FusedColwiseParallel()
    if sequence_parallel:
        for name in spec.block_norms:
            plan[name] = SequenceParallel()
        for name in spec.block_norm_consumers:
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for name in spec.head_norms:
        # A per-head norm sees (batch, seq, heads / tp, head_dim) from a colwise projection: its input is a shard of
        # dim 2, its weight whole on every rank; torch's SequenceParallel style on that dim makes the weight a
        # replicated DTensor whose gradient (a partial sum over this rank's heads) is summed over the TP ranks.
        plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def outer_plan(spec: ParallelSpec, sequence_parallel: bool, present: set[str], loss_parallel: bool = False) -> dict:
    """The plan of the embedding, final norm and head, restricted to the parts this stage holds.

    With ``loss_parallel`` the head's output stays this rank's vocabulary shard of the logits (a plain local
    tensor, so pipeline stages pass it like any other; :func:`vocab_parallel_loss` wraps it again).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {
        # The embedding table is split over the vocabulary; each rank looks up its ids and the partial
        # results are summed (or reduce-scattered onto sequence shards).
        spec.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # The head is split over the vocabulary; logits are gathered so the loss sees the full vocabulary,
        # unless the loss runs on the vocabulary shards.
        spec.head: ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate()),
    }
    if sequence_parallel:
        plan[spec.norm] = SequenceParallel()
        if spec.rotary is not None:
            # The rotary tables see the hidden states as the sequence shard they are (no communication): their
            # global length is the sequence the attention sees after its all-gather.
            plan[spec.rotary] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),))
    return {k: v for k, v in plan.items() if k in present}


def apply_tensor_parallel(model: nn.Module, spec: ParallelSpec, tp_mesh: "DeviceMesh",
                          sequence_parallel: bool = False, loss_parallel: bool = False,
                          adjust_plan: Optional[Callable[[dict, nn.Module], dict]] = None) -> None:
    """Shard ``model`` (or a pipeline stage of it) over ``tp_mesh`` in place, block by block.

    With ``loss_parallel`` the head outputs vocabulary-sharded logits; the loss must then go through
    :func:`vocab_parallel_loss` (and its backward run inside :func:`loss_parallel_context`).
    ``adjust_plan(plan, block)`` may swap a block's styles (float8's TP styles for converted linears).

    Raises:
        ValueError: the model ties its embedding and head, which a vocabulary-sharded layout cannot share.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    embedding, head = getattr(model, spec.embedding, None), getattr(model, spec.head, None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if tied:
        raise ValueError(tied_embedding_error(tied, tp_mesh.size(), 1))
    outer = (spec.embedding, spec.norm, spec.head, spec.rotary)
    present = {name for name in outer if name is not None and getattr(model, name, None) is not None}
    plan = outer_plan(spec, sequence_parallel, present, loss_parallel)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    blocks = getattr(model, spec.blocks)
    per_block = block_plan(spec, sequence_parallel)
    for block in blocks.values():
        held = {name: style for name, style in per_block.items() if holds(block, name)}
        parallelize_module(block, tp_mesh, adjust_plan(held, block) if adjust_plan else held)




def _loss_ops_enabled() -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return all(op in handlers for op in customized_loss_ops)


@contextlib.contextmanager
def loss_parallel_context(enabled: bool = True) -> Iterator[None]:
    """torch's ``loss_parallel()`` context, re-entrant: a nested use (the loss inside a pipeline step) must not
    switch the vocabulary-parallel cross-entropy off before the outer backward has run."""
    if not enabled or _loss_ops_enabled():
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def backward_in_loss_parallel(precision_plugin: Any) -> None:
    """Run Lightning's ``precision_plugin.backward`` inside :func:`loss_parallel_context`, where the backward of the
    vocabulary-parallel cross-entropy must run (torch's rule: its custom DTensor ops are only installed there)."""
    backward = precision_plugin.backward

    def in_loss_parallel(*args: Any, **kwargs: Any) -> Any:
        with loss_parallel_context():
            return backward(*args, **kwargs)

    precision_plugin.backward = in_loss_parallel


def vocab_parallel_loss(loss_sum: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
                        tp_mesh: "DeviceMesh") -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The model's ``loss_sum(logits, labels)`` on this rank's vocabulary shard of the logits.

    The shard is wrapped as a DTensor split over the last dimension, so the model's own ``F.cross_entropy``
    (under :func:`loss_parallel_context`) all-reduces the per-token maximum, sum of exponentials and target logit
    over ``tp_mesh`` instead of gathering the logits; ``ignore_index`` and the sum reduction work as on one
    process. The returned sum is a plain tensor, equal on every TP rank.
    """
    from torch.distributed.tensor import DTensor, Shard

    def loss_on_shards(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(logits, DTensor):
            logits = DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False)
        with loss_parallel_context():
            total, count = loss_sum(logits, labels)
        return (total.to_local() if isinstance(total, DTensor) else total), count

    return loss_on_shards


def full_vocabulary(logits: Any, mesh: "DeviceMesh", sharded: bool = True) -> Any:
    """Full-vocabulary logits from this rank's shard (a collective over ``mesh["tp"]``; for prediction only);
    ``logits`` as they are when not ``sharded`` or not a tensor (a pipeline rank without the last stage)."""
    from torch.distributed.tensor import DTensor, Shard

    if not sharded or not isinstance(logits, Tensor):
        return logits
    tp_mesh = mesh["tp"]
    if not isinstance(logits, DTensor):
        logits = DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False)
    return logits.full_tensor()


def enable_async_tp(tp_mesh: "DeviceMesh") -> None:
    """Turn on inductor's micro-pipelined TP for the compiled blocks and symmetric memory for ``tp_mesh``'s group.

    Call before the blocks are compiled (the pass runs when inductor compiles them, at the first step).
    """
    import warnings

    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
    if tp_mesh.get_group().group_name and torch.cuda.is_available():
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        with warnings.catch_warnings():  # a no-op kept for torch versions that still need it (deprecated in 2.13)
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(tp_mesh.get_group().group_name)
