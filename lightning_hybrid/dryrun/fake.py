"""The fake world a dry run plays one rank in: torch's fake process group, fake tensors, a Lightning environment.

torch's fake backend (``torch.testing._internal.distributed.fake_pg``) lets one process join a world of any size:
process groups and meshes are built as in the real job and every collective returns at once without touching its
buffers. ``FakeTensorMode`` gives tensors shapes, dtypes and devices but no memory, so a rank of a 72B job costs
nothing. :class:`DryRunTensorMode` is that mode with one difference: an operation whose tensor inputs are all real
runs for real. DeviceMesh and DTensor compute coordinates and shard offsets with small real index tensors
(``mesh == rank``, ``nonzero``, ``tolist``), which fake tensors cannot answer; the model's tensors are fake from
materialization on (:mod:`lightning_hybrid.distributed.materialize`), so everything they touch stays fake.

Routing is data, and fake tensors hold none: a mixture-of-experts layer counts its (token, expert) pairs per expert
(``bincount``) and exchanges those counts with its expert-parallel peers before it sends the rows. A dry run routes
**uniformly**, the planner's assumption (:mod:`lightning_hybrid.planner.experts`): the counts of ``n`` pairs over ``E``
experts are ``n // E`` each (the first ``n % E`` one more), real integers the layer can read; and the counts' exchange
(an all-to-all of real tensors, which the fake backend leaves untouched) receives what this rank sent, which is what
every peer sends when every rank routes alike. The rows themselves stay fake, with the shapes those counts give.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from lightning_hybrid.strategy import HybridParallelStrategy

__all__ = ["DryRunTensorMode", "FakeWorldEnvironment", "FakeWorldStrategy", "fake_world", "is_fake", "uniform_counts"]

_aten = torch.ops.aten
# Index tensors built from nothing (shard offsets of strided placements): real, they are a few integers.
_REAL_FACTORIES = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step}
# Factories of at most this many elements are real too: flags and counters that code reads back with .item().
_SMALL_FACTORY_ELEMENTS = 16
_ALL_TO_ALL = torch.ops.c10d.alltoall_base_.default


def uniform_counts(pairs: int, bins: int) -> torch.Tensor:
    """``bincount`` of ``pairs`` values spread evenly over ``bins``: ``pairs // bins`` each, the first ``pairs % bins``
    one more (a real int64 tensor): the dry run's routing (module docstring)."""
    counts = torch.full((bins,), pairs // bins, dtype=torch.int64)
    counts[: pairs % bins] += 1
    return counts


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` holds no memory (a fake or meta tensor)."""
    return isinstance(tensor, FakeTensor) or (isinstance(tensor, torch.Tensor) and tensor.is_meta)


def _small_factory(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in _REAL_FACTORIES:
        return True
    size = args[0] if args else kwargs.get("size")
    if isinstance(size, (list, tuple)) and all(isinstance(n, int) for n in size):
        numel = 1
        for n in size:
            numel *= n
        return numel <= _SMALL_FACTORY_ELEMENTS and kwargs.get("device") in (None, torch.device("cpu"), "cpu")
    return False


_NOT_CONTAINERS = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))


def _scan(values: tuple) -> tuple[bool, bool]:
    """(whether a tensor among ``values`` is fake or meta, whether there is a tensor), looking into lists, tuples
    and dicts: what ``tree_leaves`` finds, without building the list on every operation."""
    any_tensor = False
    for value in values:
        if isinstance(value, torch.Tensor):
            if is_fake(value):
                return True, True
            any_tensor = True
        elif isinstance(value, (list, tuple, dict)):
            fake, found = _scan(tuple(value.values()) if isinstance(value, dict) else tuple(value))
            if fake:
                return True, True
            any_tensor = any_tensor or found
        elif not isinstance(value, _NOT_CONTAINERS):
            leaves = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]  # other pytree nodes
            if any(is_fake(t) for t in leaves):
                return True, True
            any_tensor = any_tensor or bool(leaves)
    return False, any_tensor


class DryRunTensorMode(FakeTensorMode):
    """``FakeTensorMode`` that runs an operation for real when none of its tensor inputs is fake or meta, or when it
    builds a tiny tensor from nothing (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fake, any_tensor = _scan(args)
        if not fake and kwargs:
            fake, kwargs_tensor = _scan(tuple(kwargs.values()))
            any_tensor = any_tensor or kwargs_tensor
        real = not fake if any_tensor else _small_factory(func, args, kwargs)
        if fake and func is _aten.bincount.default and not _scan(args[1:2])[1]:
            bins = int(args[2] if len(args) > 2 else kwargs.get("minlength", 0))
            if bins > 0:  # routing counts: uniform (module docstring)
                with unset_fake_temporarily():
                    return uniform_counts(args[0].numel(), bins)
        if real:
            with unset_fake_temporarily():
                result = func(*args, **kwargs)
                if func is _ALL_TO_ALL and args[0].shape == args[1].shape:
                    args[0].copy_(args[1])  # the fake backend moved nothing: every peer sent what this rank sent
                return result
        return super().__torch_dispatch__(func, types, args, kwargs)


class FakeWorldEnvironment(ClusterEnvironment):
    """Lightning's view of one rank of a world that exists only on the fake process group."""

    def __init__(self, rank: int, world_size: int, devices_per_node: int) -> None:
        super().__init__()
        self._rank, self._world_size, self._per_node = rank, world_size, devices_per_node

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the recipe

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the dry run

    def local_rank(self) -> int:
        return self._rank % self._per_node

    def node_rank(self) -> int:
        return self._rank // self._per_node


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group is the fake one, as rank ``rank`` of ``world_size``, until the block ends."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group; run it in its own process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class FakeWorldStrategy(HybridParallelStrategy):
    """:class:`~lightning_hybrid.HybridParallelStrategy` on the fake backend, where object collectives carry nothing:
    every rank computes rank 0's value by construction, so a broadcast returns its object."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj
