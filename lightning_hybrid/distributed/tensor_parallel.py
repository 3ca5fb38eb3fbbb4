"""Tensor parallelism: turn a model's declared TP plan into torch's TP styles and apply it.

Colwise layers split their output features over the ``tp`` ranks, rowwise layers their input
features, so each attention/MLP pair costs one all-reduce forward and one backward (Megatron
layout). With ``sequence_parallel`` the norms work on a sequence shard and the all-reduce becomes
a reduce-scatter plus an all-gather, which saves activation memory at the same traffic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from torch import nn

from lightning_hybrid.distributed.parallel_dims import tied_embedding_error
from lightning_hybrid.models.spec import ParallelSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_tensor_parallel", "block_plan", "outer_plan"]


def block_plan(spec: ParallelSpec, sequence_parallel: bool) -> dict:
    """The ``parallelize_module`` plan of one block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict = {}
    for name, style in spec.block_plan.items():
        if style == "colwise":
            plan[name] = ColwiseParallel()
        else:
            plan[name] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    if sequence_parallel:
        for name in spec.block_norms:
            plan[name] = SequenceParallel()
        for name in spec.block_norm_consumers:
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def outer_plan(spec: ParallelSpec, sequence_parallel: bool, present: set[str]) -> dict:
    """The plan of the embedding, final norm and head, restricted to the parts this stage holds."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {
        # The embedding table is split over the vocabulary; each rank looks up its ids and the partial
        # results are summed (or reduce-scattered onto sequence shards).
        spec.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # The head is split over the vocabulary; logits are gathered so the loss sees the full vocabulary.
        spec.head: ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan[spec.norm] = SequenceParallel()
    return {k: v for k, v in plan.items() if k in present}


def apply_tensor_parallel(model: nn.Module, spec: ParallelSpec, tp_mesh: "DeviceMesh",
                          sequence_parallel: bool = False,
                          adjust_plan: Optional[Callable[[dict, nn.Module], dict]] = None) -> None:
    """Shard ``model`` (or a pipeline stage of it) over ``tp_mesh`` in place, block by block.

    ``adjust_plan(plan, block)`` may swap a block's styles (float8's TP styles for converted linears).

    Raises:
        ValueError: the model ties its embedding and head, which a vocabulary-sharded layout cannot share.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    embedding, head = getattr(model, spec.embedding, None), getattr(model, spec.head, None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if tied:
        raise ValueError(tied_embedding_error(tied, tp_mesh.size(), 1))
    present = {name for name in (spec.embedding, spec.norm, spec.head) if getattr(model, name, None) is not None}
    plan = outer_plan(spec, sequence_parallel, present)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    blocks = getattr(model, spec.blocks)
    per_block = block_plan(spec, sequence_parallel)
    for block in blocks.values():
        parallelize_module(block, tp_mesh, adjust_plan(per_block, block) if adjust_plan else per_block)
