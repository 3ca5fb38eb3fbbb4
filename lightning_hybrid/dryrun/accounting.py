"""What one rank holds and sends during a step: state bytes, memory peaks by kind, collectives per mesh dimension.

The same code measures a real run and a dry run (real tensors or fake ones), so the two can be compared exactly:

* :func:`state_bytes`: parameter, gradient and optimizer-state bytes of this rank's local tensors (a DTensor
  counts its local shard).
* :class:`MemoryPeaks`: torch's ``MemTracker`` (``torch.distributed._tools``), which follows every storage by
  kind (parameter, gradient, activation, temporary, optimizer state) and works under fake tensors, extended to keep
  each kind's own peak over the step beside the breakdown at the moment of the total peak.
* :class:`CollectiveCounter`: a dispatch mode that sees every collective (c10d and functional ones, DTensor's and
  FSDP2's included) and files it under the mesh dimension whose process group it used, by the group's ranks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["state_bytes", "model_state_bytes", "MemoryPeaks", "MemoryLimitExceeded", "CollectiveCounter",
           "mesh_dimension_groups", "COLLECTIVE_NAMESPACES"]

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
_NOT_COUNTED = ("wait_tensor", "barrier", "monitored_barrier_")
_KINDS = (("reduce_scatter", "reduce_scatter"), ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
          ("allgather", "all_gather"), ("all_gather", "all_gather"), ("broadcast", "broadcast"),
          ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"), ("isend", "send"), ("irecv", "recv"),
          ("send", "send"), ("recv", "recv"), ("batch_p2p", "p2p"), ("reduce", "reduce"), ("gather", "gather"),
          ("scatter", "scatter"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer"}``: bytes of this rank's local parameters, their gradients (those
    present now) and the optimizers' state tensors (AdamW's ``step`` scalars included)."""
    params = list(module.parameters())
    result = {"parameters": sum(_nbytes(p) for p in params),
              "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None), "optimizer": 0}
    for optimizer in optimizers:
        for state in optimizer.state.values():
            result["optimizer"] += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return result


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer"}`` that the rank will hold after its first optimizer step, known
    right after setup: its local parameters, a gradient like each trainable one, and the state torch's Adam and
    AdamW allocate at their first step (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with ``amsgrad``, shaped like
    the parameter, and a 4-byte fp32 ``step``). Another optimizer's state counts 0 here (a lower bound)."""
    params = list(module.parameters())
    result = {"parameters": sum(_nbytes(p) for p in params),
              "gradients": sum(_nbytes(p) for p in params if p.requires_grad), "optimizer": 0}
    for optimizer in optimizers:
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in optimizer.param_groups:
            states = 3 if group.get("amsgrad") else 2
            result["optimizer"] += sum(states * _nbytes(p) + 4 for p in group["params"] if p.requires_grad)
    return result


class MemoryLimitExceeded(RuntimeError):
    """Raised by :class:`MemoryPeaks` the moment the bytes held exceed its ``limit``: the peak can only be higher.
    DTensor re-raises it as a plain ``RuntimeError``; :attr:`MemoryPeaks.exceeded` tells either apart."""


class MemoryPeaks(MemTracker):
    """torch's ``MemTracker``, also keeping the peak of each kind of memory on its own (``kind_peaks``).

    ``MemTracker`` alone reports the breakdown at the moment of the total peak; the activation peak of a pipeline
    rank may come at another moment than its total peak (the optimizer step), so each kind's own maximum is kept.

    Args:
        limit: bytes; the moment more are held, :class:`MemoryLimitExceeded` is raised (a rank that cannot fit
            stops there, its peak breakdown so far kept). ``None``: no limit.
    """

    def __init__(self, limit: Optional[float] = None) -> None:
        super().__init__()
        self.kind_peaks: dict[str, int] = defaultdict(int)
        self.limit = limit
        self.exceeded = False  # set when the limit was passed (libraries may wrap the exception in their own)
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._devices: set[Any] = set()
        self._uncounted = 0  # > 0 while DTensor propagates shapes (see _shape_propagation_uncounted)
        self._propagation: contextlib.ExitStack = contextlib.ExitStack()

    def __enter__(self) -> "MemoryPeaks":
        self._propagation.enter_context(self._shape_propagation_uncounted())
        try:
            super().__enter__()
        except BaseException:
            self._propagation.close()
            raise
        return self

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            self._propagation.close()

    @contextlib.contextmanager
    def _shape_propagation_uncounted(self) -> Iterator[None]:
        """DTensor's sharding propagator computes an operator's output shape by running it on fake tensors of the
        *global* shapes (``_propagate_tensor_meta_non_cached``), under the fake mode it finds active: on a GPU a fake
        mode of its own, which ``MemTracker`` ignores; in a dry run the dry run's, so ``MemTracker`` would count them.
        They hold no memory in a real run: not counted here. (Loss parallel's backward propagates the full-vocabulary
        fp32 logits this way: 40 GB of phantoms at the 72B SFT recipe's 32,768 tokens.)"""
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        original = propagator._propagate_tensor_meta_non_cached

        def uncounted(*args: Any, **kwargs: Any) -> Any:
            self._uncounted += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._uncounted -= 1

        propagator._propagate_tensor_meta_non_cached = uncounted  # the instance's, found before the class's method
        try:
            yield
        finally:
            del propagator._propagate_tensor_meta_non_cached

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if self._uncounted:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: Optional[int] = None,  # type: ignore[override]
                     old_reftype: Any = None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        snap = self._curr_mem_snap.get(winfo.device)
        if snap is None:
            return
        if winfo.device not in self._devices:  # every kind present in the peaks from the start, zeros included
            self._devices.add(winfo.device)
            for kind, value in snap.items():
                self._raise_peak(getattr(kind, "value", kind), value)
        # Only the kind of this storage and the total can have grown (a free or a move to another kind cannot).
        self._raise_peak(getattr(winfo.reftype, "value", winfo.reftype), snap[winfo.reftype])
        total = snap[_TOTAL_KEY]
        self._raise_peak(_TOTAL_KEY, total)
        if self.limit is not None and total > self.limit:
            self._update_peak_stats(None)
            self.exceeded = True
            raise MemoryLimitExceeded(f"{total} bytes held > limit {self.limit:.0f}")

    def _raise_peak(self, key: str, value: int) -> None:
        if value > self.kind_peaks[key]:
            self.kind_peaks[key] = value

    def _update_peak_stats(self, peak_state: Any) -> None:
        # ``MemTracker`` also keeps a peak per module it tracks; this class tracks none (see the hooks below), so
        # only the global peak is kept, with the snapshot copied as a flat dict (ints by kind).
        if self.memory_tracking:
            super()._update_peak_stats(peak_state)
            return
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)

    # ``MemTracker``'s own module hooks keep per-module snapshots and refuse a module that runs twice in a step
    # (every pipeline micro-batch does); only the recompute region they mark is needed here.
    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if self._mod_tracker.is_bw:
            if self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True
        elif module not in self._seen:
            self._seen.add(module)
            self._track_module_params_and_buffers(module, install_grad_hooks=True)

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod, self._in_ac = None, False

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    @contextlib.contextmanager
    def outside_optimizer(self) -> Iterator[None]:
        """Count what is allocated in the block by its own kind even inside ``optimizer.step``: Lightning runs the
        forward and backward in the closure that the optimizer step calls, which ``MemTracker`` would file as
        optimizer state."""
        saved, self._in_opt = self._in_opt, False
        try:
            yield
        finally:
            self._in_opt = saved

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes by kind at the moment of the total peak (``"Total"`` included), summed over devices."""
        out: dict[str, int] = defaultdict(int)
        for snap in self.get_tracker_snapshot("peak").values():
            for kind, value in snap.items():
                out[getattr(kind, "value", kind)] += value
        return dict(out)


def mesh_dimension_groups(mesh: Any, world_size: int) -> dict[tuple[int, ...], str]:
    """This rank's process groups by their global ranks -> the mesh dimension name (``"world"`` for all ranks).

    Any mesh works (``("pp", "dp", "tp")`` today, more dimensions later): a group is named by the dimension whose
    ranks it spans.
    """
    import torch.distributed as dist

    names: dict[tuple[int, ...], str] = {tuple(range(world_size)): "world"}
    for name in mesh.mesh_dim_names or ():
        ranks = tuple(sorted(dist.get_process_group_ranks(mesh[name].get_group())))
        names.setdefault(ranks, name)
    return names


def _kind(op_name: str) -> Optional[str]:
    """The collective an operator performs, or ``None`` for a helper of those namespaces (``wait_tensor``,
    ``_wrap_tensor_autograd``, barriers)."""
    if op_name in _NOT_COUNTED or op_name.startswith("_wrap"):
        return None
    for key, kind in _KINDS:
        if key in op_name:
            return kind
    return None


def _group_of(args: Iterable[Any]) -> Optional[Any]:
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    for arg in args:
        if isinstance(arg, ProcessGroup):
            return arg
        if isinstance(arg, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(arg)
            except RuntimeError:
                continue
        if isinstance(arg, str):
            try:
                return _resolve_process_group(arg)
            except (RuntimeError, ValueError):
                continue
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives by (mesh dimension, kind): ``counts[dim][kind] = [calls, bytes]``.

    The bytes of a call are its largest buffer: the gathered output of an all-gather, the input of a
    reduce-scatter, the tensor of an all-reduce, broadcast, send or receive (lists summed).

    Args:
        groups: :func:`mesh_dimension_groups` of this rank; a group not in it is named ``"group(r0,r1,...)"``.
    """

    def __init__(self, groups: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.groups = groups
        self._kinds: dict[Any, Optional[str]] = {}  # operator -> collective kind (None: not a collective)
        self._dimensions: dict[Any, str] = {}  # process group -> mesh dimension
        self.counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))

    def _dimension(self, args: tuple) -> str:
        import torch.distributed as dist

        group = _group_of(args)
        if group is None:
            return "unknown"
        name = self._dimensions.get(group)
        if name is None:
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            name = self._dimensions[group] = self.groups.get(ranks, "group(" + ",".join(map(str, ranks)) + ")")
        return name

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        handler = DTensor._op_dispatcher._custom_op_handlers.get(func)
        if handler is not None and any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs))):
            # A DTensor operator with a custom handler (loss parallel's cross-entropy) issues its collectives inside
            # the call, where this mode is off: run the handler with the mode on, so they are counted too.
            with self:
                result = handler(func, args, kwargs)
        else:
            result = func(*args, **kwargs)
        try:
            kind = self._kinds[func]
        except KeyError:
            name = func._schema.name.split("::")[-1]
            kind = self._kinds[func] = _kind(name) if func.namespace in COLLECTIVE_NAMESPACES else None
        if kind is not None:
            sizes = [sum(_nbytes(t) for t in tree_leaves(a) if isinstance(t, torch.Tensor)) for a in args]
            sizes.append(sum(_nbytes(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)))
            entry = self.counts[self._dimension(args)][kind]
            entry[0] += 1
            entry[1] += max(sizes)
        return result

    def table(self) -> dict[str, dict[str, list[int]]]:
        """``{dim: {kind: [calls, bytes]}}`` as plain dicts, sorted."""
        return {dim: {kind: list(v) for kind, v in sorted(kinds.items())} for dim, kinds in sorted(self.counts.items())}
