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
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_hybrid.distributed.options import GRADIENT_BUCKET_BYTES
from lightning_hybrid.models.fused import FusedLinear

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_fsdp", "all_reduce_gradients", "all_reducing", "reduce_gradients", "StepWeightCasts", "torch_dtype",
           "without_autocast"]


def torch_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """torch's dtype of a name the options give (``"bfloat16"``, ``"float32"``), ``None`` for ``None``."""
    return None if name is None else getattr(torch, name)


def apply_fsdp(model: nn.Module, blocks: Union[nn.ModuleDict, Iterable[nn.Module]], dp_mesh: "DeviceMesh",
               reshard_after_forward: bool = True, param_dtype: Optional[torch.dtype] = None,
               reduce_dtype: Optional[torch.dtype] = None) -> None:
    """Shard each block and then the rest of ``model`` over ``dp_mesh`` with FSDP2.

    Args:
        model: the model or pipeline stage; its remaining parameters (embedding, norm, head) form the root unit.
        blocks: the blocks (a ``ModuleDict`` or the modules themselves: a Hugging Face model's decoder layers), each
            its own unit so only one block's full weights exist at a time.
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
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):
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


def _bucketed(params: list[Tensor], bucket_bytes: Optional[int]) -> list[list[Tensor]]:
    """``params`` grouped by device and dtype into buckets of about ``bucket_bytes`` (``None``: one per group), in
    an order that depends only on the parameters (the same on every rank that holds them)."""
    groups: dict[tuple, list[list[Tensor]]] = {}
    for param in params:
        local = _local(param)
        buckets = groups.setdefault((local.device, local.dtype), [[]])
        if bucket_bytes is not None and sum(t.numel() * t.element_size() for t in buckets[-1]) > bucket_bytes:
            buckets.append([])
        buckets[-1].append(param)
    return [bucket for buckets in groups.values() for bucket in buckets]


def _as_parameter_layout(param: Tensor) -> None:
    """Give a DTensor gradient its parameter's placements (a vocabulary-sharded embedding's gradient can come out
    replicated or partial): every rank then reduces a slot of the parameter's local size, which a rank without
    gradient fills with zeros. From replicated, a local slice; from partial, a sum over the tensor-parallel group,
    whose ranks all have the gradient (they run the same batch)."""
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


@torch.no_grad()
def reduce_gradients(parameters: Iterable[Tensor], reduce: Callable[[Tensor], Any], divide_by: int = 1,
                     reduce_dtype: Optional[torch.dtype] = None,
                     bucket_bytes: Optional[int] = GRADIENT_BUCKET_BYTES) -> None:
    """Reduce the gradients of the trainable ``parameters`` with ``reduce`` (an in-place sum or average of one flat
    tensor over the ranks), then divide by ``divide_by``; a parameter without a gradient here takes part as zeros.

    Every rank must pass the same parameters (same shapes, same order), and every rank then reduces the same
    buffers, whichever parameters its own batch used: a branch, an adapter or an expert that this rank's inputs
    skipped (``grad is None`` here) would otherwise leave the ranks reducing buffers of different sizes (gloo aborts,
    NCCL hangs or mixes values). As DDP does with unused parameters, such a gradient counts as zeros; each bucket
    carries one usage flag per parameter in the same reduction (no extra collective), so a parameter that no rank
    used keeps ``grad=None`` everywhere (the optimizer skips it, as one process over the global batch would) and one
    used anywhere gets the reduced gradient everywhere. ``reduce_dtype`` is the dtype the buckets are reduced in
    (``None``: the gradients' own); DTensor gradients (tensor-parallel shards) are reduced through their local shard,
    the same shard on every rank of the reduction.
    """
    params = [p for p in parameters if p.requires_grad]
    for param in params:
        _as_parameter_layout(param)
    for bucket in _bucketed(params, bucket_bytes):
        locals_ = [_local(p) for p in bucket]
        sizes = [t.numel() for t in locals_]
        total = sum(sizes)
        flat = torch.zeros(total + len(bucket), dtype=reduce_dtype or locals_[0].dtype, device=locals_[0].device)
        values = flat[:total].split(sizes)
        for i, param in enumerate(bucket):
            if param.grad is not None:
                values[i].copy_(_local(param.grad).reshape(-1))
        flat[total:] = torch.tensor([float(p.grad is not None) for p in bucket], dtype=flat.dtype)
        reduce(flat)
        if divide_by != 1:
            flat[:total].div_(divide_by)
        # the flags are read on the host only for the parameters this rank did not use (no sync in the common case)
        missing = [i for i, param in enumerate(bucket) if param.grad is None]
        unused = {i for i, used in zip(missing, flat[total:][missing].tolist() if missing else []) if used <= 0}
        for i, (param, local, value) in enumerate(zip(bucket, locals_, values)):
            if i in unused:  # no rank used it: no gradient anywhere
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            _local(param.grad).copy_(value.view_as(local))  # casts back to the gradient's dtype


def all_reduce_gradients(parameters: Iterable[Tensor], group: "ProcessGroup", world: int,
                         reduce_dtype: Optional[torch.dtype] = None) -> None:
    """Average the gradients of replicated parameters over ``group`` in buckets of about 25 MB
    (:func:`reduce_gradients`: a parameter without a gradient on some ranks takes part as zeros there).

    ``reduce_dtype`` (for example fp32 for bf16 gradients) is the dtype the buckets are summed in;
    ``None`` sums in the gradients' own dtype.
    """
    import torch.distributed as dist

    reduce_gradients(parameters, lambda flat: dist.all_reduce(flat, group=group), world, reduce_dtype)


def all_reducing(closure: Callable[[], Any], model: nn.Module, group: "ProcessGroup", world: int,
                 reduce_dtype: Optional[torch.dtype] = None) -> Callable[[], Any]:
    """Lightning's optimizer closure (forward and backward), then the replicated gradients of ``model`` averaged over
    ``group`` with :func:`all_reduce_gradients`, before gradient clipping and the optimizer see them."""
    def reduced() -> Any:
        result = closure()
        all_reduce_gradients(model.parameters(), group, world, reduce_dtype)
        return result

    return reduced
