"""Expert parallelism: the experts of each mixture-of-experts layer split over the ``ep`` ranks, tokens sent to their
experts' ranks and back with all-to-all; the load statistics summed over the data ranks.

The ep group is carved from the data-parallel ranks (``ep`` divides ``dp``; ep innermost, so an ep group is
consecutive ranks, see :mod:`~.parallel_dims`). Each rank of an ep group holds ``num_experts / ep`` experts of every
sparse layer (its experts' 3-D weights are DTensors ``Shard(0)`` over ``mesh["ep"]``), and FSDP2 shards those over
the data ranks left (``mesh["edp"]``, with cp ``mesh["edp_cp"]``). A layer's forward (:class:`AllToAllDispatch`):

1. the layer hands over its (token, expert) pairs' rows sorted by expert, so those of each destination rank are
   contiguous (the layer sorts them and sums the outputs back per token itself);
2. the pair counts per expert exchanged (one small ``all_to_all_single``), giving every rank its split sizes;
3. the pairs' hidden states sent with ``all_to_all_single`` of those split sizes (dropless: every pair reaches its
   expert), regrouped by local expert, computed (grouped GEMM where the device has it), ungrouped;
4. the outputs sent back with the reverse all-to-all, in the order they came.

The all-to-alls are torch's differentiable functional collectives: backward sends the gradients the reverse way.

Gradient scale: an expert's weight gradient collects the pairs of every rank of its ep group (through the backward
all-to-all), each rank's loss scaled by the data ranks as everywhere (:func:`~lightning_hybrid.models.spec.
token_mean_loss`); FSDP2 then reduces it over the ``dp * cp / ep`` ranks holding the same experts. Its gradient
divide factor is set to ``dp * cp`` (not FSDP2's default, its mesh size), so the result is the gradient of the global
token mean, as for every other weight.

Tensor parallelism: the experts are not split by tp; every tp rank of a block computes the mixture for the same
tokens with whole experts (each tp rank is in its own ep group), so their gradients are equal and need no
reduction over tp. Attention and the dense layers are sharded as always. With sequence parallelism the layer's
input is gathered over the sequence like a dense MLP's and its output handed back as this rank's sequence shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.models.spec import ParallelSpec, experts_layers, is_experts_layer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_expert_parallel", "AllToAllDispatch", "LoadReduction", "experts_tp_plan", "shard_experts",
           "experts_mesh", "set_balance_grad_scale", "all_to_all_bytes", "keep_step_statistics"]


class LoadReduction:
    """A layer's ``reduce_load``: its load statistics summed over the data ranks (``dp x cp``), without gradient."""

    def __init__(self, group: "ProcessGroup") -> None:
        self.group = group

    def __call__(self, stats: Tensor) -> Tensor:
        import torch.distributed as dist

        total = stats.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total


class AllToAllDispatch:
    """A layer's ``dispatch`` under ``ep>1``: the routed pairs to their experts' ranks and back (module docstring).

    Args:
        group: the ep group.
        ep: its size.
        num_experts: experts of the layer (all ranks together).

    ``bytes_sent`` counts the hidden states this rank sent to other ranks in forward passes (dispatch and return; the
    rows a rank keeps for its own experts never leave it; a recompute of full activation checkpointing sends them
    again, uncounted); each backward all-to-all sends as many again.
    """

    def __init__(self, group: "ProcessGroup", ep: int, num_experts: int) -> None:
        self.group, self.ep, self.num_experts = group, ep, num_experts
        self.local = num_experts // ep
        self.bytes_sent = 0

    def _exchange_counts(self, counts: list[int], device: torch.device) -> Tensor:
        """(ep, local experts): how many pairs each rank of the group sends to each of this rank's experts."""
        import torch.distributed as dist

        sent = torch.tensor(counts, dtype=torch.int64, device=device)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        return received.view(self.ep, self.local)

    def __call__(self, rows: Tensor, counts: list[int], experts: nn.Module) -> Tensor:
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        send_splits = [sum(counts[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
        received_counts = self._exchange_counts(counts, rows.device)
        recv_splits = received_counts.sum(1).tolist()
        received = all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        # received rows come by (source rank s, local expert j); the experts want them by (j, s): key j * ep + s
        device = rows.device
        key = torch.arange(self.local, device=device) * self.ep + torch.arange(self.ep, device=device)[:, None]
        by_expert = torch.argsort(torch.repeat_interleave(key.reshape(-1), received_counts.reshape(-1)), stable=True)
        out = experts(received[by_expert], received_counts.sum(0).tolist())
        back = out[torch.argsort(by_expert)]
        if not _recomputing():  # what a recompute in backward replays is counted once, in its forward
            me = dist.get_rank(self.group)
            sent = sum(send_splits) - send_splits[me] + sum(recv_splits) - recv_splits[me]
            self.bytes_sent += sent * rows.shape[-1] * rows.element_size()
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation recompute)."""
    return torch._C._current_graph_task_id() != -1


def all_to_all_bytes(module: nn.Module) -> int:
    """The hidden-state bytes this rank sent forward through the all-to-alls of ``module``'s layers so far."""
    return sum(getattr(layer.dispatch, "bytes_sent", 0) for layer in experts_layers(module))


def set_balance_grad_scale(module: nn.Module, scale: float) -> None:
    """Weigh the load-balancing gradient of the next forwards of ``module``'s layers by ``scale`` (1 / micro-batches
    of the optimizer step, the same weight their language-model loss has)."""
    for layer in experts_layers(module):
        layer.grad_scale = scale


def keep_step_statistics(module: nn.Module, microbatches: int) -> None:
    """After a pipeline step: the layers of ``module`` keep the statistics of the step's ``microbatches`` forwards
    only (torch's pipeline stages infer their shapes at a first step by running once more, on made-up inputs)."""
    for layer in experts_layers(module):
        layer.stats.keep_last(microbatches)


def apply_expert_parallel(module: nn.Module, dims: ParallelDims, mesh: "DeviceMesh") -> None:
    """Make the mixture-of-experts layers of ``module`` (a meta-device model or stage) balance over every data rank
    and, with ``ep>1``, split their experts over the ep ranks with all-to-all dispatch."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for layer in experts_layers(module):
        layer.data_ranks = dims.data_ranks
        if dims.data_ranks > 1:
            layer.reduce_load = LoadReduction(mesh["dp_cp"].get_group())
        if dims.ep == 1:
            continue
        ep_mesh = mesh["ep"]
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)])
            setattr(layer.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatch = AllToAllDispatch(ep_mesh.get_group(), dims.ep, layer.num_experts)


def experts_mesh(mesh: "DeviceMesh", dims: ParallelDims) -> "DeviceMesh":
    """The mesh FSDP2 shards one ep rank's experts over: the data ranks holding the same experts (edp x cp)."""
    return mesh["edp_cp"] if dims.cp > 1 else mesh["edp"]


def shard_experts(module: nn.Module, mesh: "DeviceMesh", dims: ParallelDims, reshard_after_forward: bool,
                  param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None) -> None:
    """With ``ep>1``: each layer's experts its own FSDP2 unit over :func:`experts_mesh` (the blocks' mixed precision),
    gradients divided by the data ranks (module docstring); before the blocks are sharded, which then leave the
    experts to these units."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dims.ep == 1:
        return
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    shard_mesh = experts_mesh(mesh, dims)
    for layer in experts_layers(module):
        unit = fully_shard(layer.experts, mesh=shard_mesh, reshard_after_forward=reshard_after_forward,
                           mp_policy=policy)
        unit.set_gradient_divide_factor(float(dims.data_ranks))
        # A sum, then the division: another factor than the mesh size is NCCL's PREMUL_SUM otherwise, which gloo lacks.
        # Not on a one-rank mesh: torch 2.13 then divides once without the collective and once more after it.
        unit.set_force_sum_reduction_for_comms(shard_mesh.size() > 1)


def experts_tp_plan(plan: dict, block: nn.Module, spec: ParallelSpec, sequence_parallel: bool) -> dict:
    """A block's TP plan where the block holds a mixture of experts: no entry inside the layer (its experts are whole
    on every tp rank); with sequence parallelism its input gathered over the sequence and its output handed back as
    this rank's sequence shard, both as plain tensors."""
    attr = spec.block_experts
    if attr is None or not is_experts_layer(getattr(block, attr, None)):
        return plan
    adjusted = {name: style for name, style in plan.items() if not name.startswith(f"{attr}.")}
    if sequence_parallel:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput

        adjusted[attr] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
    return adjusted
