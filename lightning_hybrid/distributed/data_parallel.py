"""Data parallelism over the ``dp`` mesh dimension: FSDP2 sharding (ZeRO-3), HSDP or plain replication.

``fsdp`` shards parameters, gradients and optimizer states over ``dp`` with ``fully_shard`` (one
unit per block, then the root), all-gathering a block's weights just before it runs.
``replicate`` keeps a full copy per rank and averages the gradients with bucketed all-reduces once
per optimizer step (not per accumulation micro-step). ``hsdp`` is FSDP2 over a 2-D
``(dp_replicate, dp_shard)`` mesh: parameters sharded inside a shard group, gradients reduce-scattered
there and then all-reduced across the replica groups. With context parallelism every mode spans dp x cp
(the ranks that see different tokens).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid.distributed.options import GRADIENT_BUCKET_BYTES
from lightning_hybrid.models.fused import FusedLinear

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_fsdp", "all_reduce_gradients", "all_reducing", "StepWeightCasts", "torch_dtype", "without_autocast"]


def torch_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """torch's dtype of a name the options give (``"bfloat16"``, ``"float32"``), ``None`` for ``None``."""
    return None if name is None else getattr(torch, name)


def apply_fsdp(model: nn.Module, blocks: nn.ModuleDict, dp_mesh: "DeviceMesh", reshard_after_forward: bool = True,
               param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None) -> None:
    """Shard each block and then the rest of ``model`` over ``dp_mesh`` with FSDP2.

    Args:
        model: the model or pipeline stage; its remaining parameters (embedding, norm, head) form the root unit.
        blocks: the blocks, each its own unit so only one block's full weights exist at a time.
        dp_mesh: the 1-D data-parallel mesh (dp, or dp x cp flattened), or HSDP's 2-D (replicate, shard) mesh.
        reshard_after_forward: free a block's gathered weights after forward (re-gather in backward).
            Zero-bubble pipeline schedules need ``False``: their separate weight-gradient pass reads the
            gathered weights. The root unit keeps its weights gathered from forward to backward: backward
            starts with the head, so re-gathering it (the largest unit: embedding and head) would only cost an
            all-gather per step. A forward without gradients (validation, test, predict) has no backward to
            wait for and reshards it at once, so the sharded parameters are registered again (what the
            optimizer and checkpoints see) and the gathered copy is freed.
        param_dtype: compute dtype of the gathered weights (mixed precision), ``None`` keeps the storage dtype.
        reduce_dtype: dtype of the gradient reduce-scatter, ``None`` uses ``param_dtype``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    model.register_forward_hook(_reshard_without_backward)  # runs after FSDP's own post-forward hook


class StepWeightCasts:
    """bf16 compute copies of the parameters that no FSDP2 unit casts (TP-only, replicated, pipeline with dp=1).

    A module's parameters are cast at its first forward after they changed; every later forward (micro-batches,
    recompute, accumulation steps) and backward reuse the copy until the optimizer updates the parameter in place
    (its version counter moves; a skipped step keeps the copies). So a parameter is cast once per optimizer step.
    Gradients flow through the cast into the fp32 parameters, so gradients, their reduction and AdamW stay fp32.
    Without gradients (evaluation) the copies are made per forward and not kept (they would carry no autograd
    graph). A module's own ``_parameters`` entries are swapped for the copies during its forward (FSDP2 does the
    same with its gathered weights) and restored after it.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype
        self.casts = 0  # copies made (a test reads it: one per parameter per step)
        self._copies: dict[int, tuple[int, Tensor]] = {}  # id(parameter) -> (its version when cast, the copy)
        self._swapped: dict[int, dict[str, Tensor]] = {}

    def install(self, module: nn.Module) -> None:
        """Hook every submodule of ``module`` that holds floating-point parameters of another dtype itself, and every
        owner of a fused projection (:class:`~lightning_hybrid.models.fused.FusedLinear`): the fused GEMM reads its
        parts' weights in the owner's forward without calling the parts, so the owner swaps their copies in."""
        for sub in module.modules():
            if any(p.is_floating_point() and p.dtype != self.dtype for p in sub.parameters(recurse=False)):
                sub.register_forward_pre_hook(self._swap_in)
                sub.register_forward_hook(self._swap_out, always_call=True)
            for name, child in sub.named_children():
                if isinstance(child, FusedLinear):
                    sub.register_forward_pre_hook(functools.partial(self._swap_parts, name, True))
                    sub.register_forward_hook(functools.partial(self._swap_parts, name, False), always_call=True)

    def _swap_parts(self, name: str, into: bool, owner: nn.Module, *_: Any) -> None:
        """The copies of the fused module ``name``'s parts in (``into``) or out, while it runs fused (a fused module
        set to ``None`` leaves its parts to their own hooks)."""
        fused = getattr(owner, name, None)
        if fused is None:
            return
        for part in (getattr(owner, p) for p in fused.parts):
            self._swap_in(part, ()) if into else self._swap_out(part, (), None)

    def _copy(self, param: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return param.detach().to(self.dtype)
        version, copy = self._copies.get(id(param), (-1, None))
        if copy is None or version != param._version:
            copy = param.to(self.dtype)
            self._copies[id(param)] = (param._version, copy)
            self.casts += 1
        return copy

    def _swap_in(self, module: nn.Module, args: Any) -> None:
        swapped = {}
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != self.dtype:
                swapped[name] = param
        for name, param in swapped.items():
            module._parameters[name] = self._copy(param)
        self._swapped[id(module)] = swapped

    def _swap_out(self, module: nn.Module, args: Any, output: Any) -> None:
        for name, param in self._swapped.pop(id(module), {}).items():
            module._parameters[name] = param


def without_autocast(precision_plugin: Any) -> None:
    """Run the forward of ``precision_plugin`` (Lightning's ``bf16-mixed``) without autocast: the weights already
    are bf16 copies, so autocast would only re-cast fp32 activations at each op (it does not cache casts there)."""
    import contextlib

    precision_plugin.forward_context = contextlib.nullcontext


def _reshard_without_backward(module: nn.Module, args: Any, output: Any) -> None:
    if not torch.is_grad_enabled():
        module.reshard()


def _local(grad: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad


@torch.no_grad()
def all_reduce_gradients(parameters: Iterable[Tensor], group: "ProcessGroup", world: int,
                         reduce_dtype: Optional[torch.dtype] = None) -> None:
    """Average the gradients of replicated parameters over ``group`` in buckets of about 25 MB.

    ``reduce_dtype`` (for example fp32 for bf16 gradients) is the dtype the buckets are summed in;
    ``None`` sums in the gradients' own dtype.

    DTensor gradients (tensor-parallel shards) are reduced through their local shard, which is the
    same shard on every rank of ``group``.
    """
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    buckets: dict[tuple, list[list[Tensor]]] = {}
    for g in grads:
        key = (g.device, g.dtype)
        bucket_list = buckets.setdefault(key, [[]])
        if sum(t.numel() * t.element_size() for t in bucket_list[-1]) > GRADIENT_BUCKET_BYTES:
            bucket_list.append([])
        bucket_list[-1].append(g)
    for bucket_list in buckets.values():
        for bucket in bucket_list:
            flat = _flatten_dense_tensors(bucket)
            if reduce_dtype is not None and flat.dtype != reduce_dtype:
                flat = flat.to(reduce_dtype)
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(reduced)  # casts back to the gradient's dtype


def all_reducing(closure: Callable[[], Any], model: nn.Module, group: "ProcessGroup", world: int,
                 reduce_dtype: Optional[torch.dtype] = None) -> Callable[[], Any]:
    """Lightning's optimizer closure (forward and backward), then the replicated gradients of ``model`` averaged over
    ``group`` with :func:`all_reduce_gradients`, before gradient clipping and the optimizer see them."""
    def reduced() -> Any:
        result = closure()
        all_reduce_gradients(model.parameters(), group, world, reduce_dtype)
        return result

    return reduced
