"""Data parallelism for a module that parallelizes itself in ``configure_model`` (ModelParallelStrategy style).

Such a module applies its own tensor parallelism (``parallelize_module`` over ``device_mesh["tensor_parallel"]``)
and, maybe, FSDP2 over ``device_mesh["data_parallel"]``. When it applies only TP and dp > 1, nothing would keep its
data-parallel replicas equal: each would train on its own batches. The strategy therefore checks every parameter after
``configure_model``: a parameter is synchronized over dp when it is a DTensor whose mesh spans the rank's dp group
(FSDP2's sharding), or when it belongs to a module under torch's ``replicate`` or ``DistributedDataParallel``. Every
other trainable parameter is replicated by the strategy: its value is broadcast from dp rank 0 once, and its gradient
is averaged over dp before every optimizer step (logged once). The choice over refusing: code written for
``ModelParallelStrategy`` with ``tensor_parallel_size`` smaller than the world then trains as the user meant, data
parallel over the rest, with the same math as one process with the global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from lightning_hybrid.distributed.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["unsynchronized_parameters", "DataParallelReplicas"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _replicated_modules(module: nn.Module) -> set[int]:
    """Ids of the parameters under torch's composable ``replicate`` or a ``DistributedDataParallel`` wrapper."""
    from torch.distributed._composable import _get_registry
    from torch.nn.parallel import DistributedDataParallel

    synced: set[int] = set()
    for sub in module.modules():
        registry = _get_registry(sub) or {}
        if isinstance(sub, DistributedDataParallel) or "replicate" in registry:
            synced.update(id(p) for p in sub.parameters())
    return synced


def unsynchronized_parameters(module: nn.Module, dp_ranks: list[int]) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of ``module`` that nothing keeps equal over the data-parallel ranks ``dp_ranks``
    (this rank's dp group): neither a DTensor whose mesh spans them nor under ``replicate``/DDP."""
    from torch.distributed.tensor import DTensor

    synced = _replicated_modules(module)
    found = []
    for name, param in module.named_parameters():
        if not param.requires_grad or id(param) in synced:
            continue
        if isinstance(param, DTensor) and set(dp_ranks) <= set(param.device_mesh.mesh.flatten().tolist()):
            continue
        found.append((name, param))
    return found


class DataParallelReplicas:
    """Parameters the strategy replicates over dp: broadcast once, gradients averaged before each optimizer step.

    Args:
        params: the parameters (from :func:`unsynchronized_parameters`).
        group: the dp process group of this rank.
        src: the global rank of dp coordinate 0 in ``group`` (the weights every replica starts from).
        world: the size of ``group``.
    """

    def __init__(self, params: list[nn.Parameter], group: "ProcessGroup", src: int, world: int) -> None:
        self.params, self.group, self.src, self.world = params, group, src, world

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """Give every replica dp rank 0's values (as DDP does on construction)."""
        import torch.distributed as dist

        for param in self.params:
            dist.broadcast(_local(param), src=self.src, group=self.group)

    def all_reducing(self, closure: Callable[[], Any], reduce_dtype: Optional[torch.dtype] = None
                     ) -> Callable[[], Any]:
        """Lightning's optimizer closure, then the gradients of the replicated parameters averaged over dp."""
        from lightning_hybrid.distributed.data_parallel import all_reduce_gradients

        def reduced() -> Any:
            result = closure()
            all_reduce_gradients(self.params, self.group, self.world, reduce_dtype)
            return result

        return reduced


def replicate_unsynchronized(module: nn.Module, lightning_module: Any, dims: Optional[ParallelDims],
                             log: Callable[[str], None]) -> Optional[DataParallelReplicas]:
    """After ``configure_model`` of a self-parallelizing ``lightning_module`` (its ``device_mesh`` is Lightning's 2-D
    mesh ``("data_parallel", "tensor_parallel")``): replicate, over dp, the parameters of ``module`` nothing
    synchronizes (see the module docstring), logging that once. ``None`` when dp is 1 (or unknown: the sizes were not
    resolved) or every parameter is synchronized."""
    if dims is None or dims.dp <= 1:
        return None
    import torch.distributed as dist

    dp, module_name = dims.dp, type(lightning_module).__name__
    dp_mesh = lightning_module.device_mesh["data_parallel"]
    group = dp_mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    found = unsynchronized_parameters(module, ranks)
    if not found:
        return None
    names = ", ".join(name for name, _ in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    log(f"{module_name}: {len(found)} parameter(s) ({names}) are neither sharded nor gradient-synchronized over "
        f"data_parallel={dp} after configure_model; HybridParallelStrategy replicates them: weights broadcast from "
        f"dp rank 0, gradients averaged over dp before each optimizer step")
    replicas = DataParallelReplicas([p for _, p in found], group, ranks[0], dp)
    replicas.broadcast_weights()
    return replicas
