"""The strategy as the modules below it see it: :class:`StrategyHost`, its public side, read only.

``distributed/`` never imports ``strategy.py`` (the strategy imports it). A module that needs more than a few plain
values of the running strategy (the parallelize sequence, the auto layout, torchft's join) receives it typed as this
Protocol: the attributes it may read. It never writes into it: what it makes it returns, and the strategy's own hooks
keep it (``tests/test_architecture.py`` reads every module for attribute writes on a strategy and private reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_hybrid.distributed.options import ParallelOptions
    from lightning_hybrid.distributed.parallel_dims import ParallelDims

__all__ = ["StrategyHost"]


class StrategyHost(Protocol):
    """Public attributes of :class:`~lightning_hybrid.HybridParallelStrategy` (its own and Lightning's)."""

    options: "ParallelOptions"
    preflight: bool
    replica_group_env: Optional[Any]  # torchft's ReplicaGroupEnv of this launch, or None
    ft_timeout: float

    @property
    def lightning_module(self) -> Any: ...

    @property
    def dims(self) -> "ParallelDims": ...

    @property
    def device_mesh(self) -> "DeviceMesh": ...

    @property
    def root_device(self) -> "torch.device": ...

    @property
    def precision_plugin(self) -> Any: ...

    @property
    def optimizers(self) -> list[Any]: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def checkpoint_context(self) -> Any: ...
