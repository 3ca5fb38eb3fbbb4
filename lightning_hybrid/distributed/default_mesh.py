"""What a bare ``HybridParallelStrategy()`` (no size given) builds, for each kind of LightningModule.

A module that parallelizes itself was written for Lightning's ``ModelParallelStrategy`` and applies TP to
``self.device_mesh["tensor_parallel"]``; a bare ``ModelParallelStrategy()`` gives it tp = the devices of a node and
dp = the nodes, and so does a bare ``HybridParallelStrategy()`` (otherwise such code would silently train as pure data
parallelism, every rank holding whole weights). A declared model (``parallel_spec()``) keeps the documented default:
tp=1, pp=1, dp = the world. Pure arithmetic on the options (no torch).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["bare_layout_note", "log_bare_layout"]


def bare_layout_note(options: Any, dims: Any, self_parallel: bool) -> Optional[str]:
    """The one line that says which mesh a bare strategy chose for ``dims`` (a :class:`~.parallel_dims.ParallelDims`;
    ``options`` a :class:`~.options.ParallelOptions`); ``None`` when a size was given."""
    if not options.is_bare():
        return None
    if self_parallel:
        return (f"HybridParallelStrategy() without sizes, for a module that parallelizes itself: "
                f"ModelParallelStrategy's default mesh, tensor_parallel={dims.tp} (the devices of a node) x "
                f"data_parallel={dims.dp} (the nodes); give dp/tp (or data_parallel_size/tensor_parallel_size) for "
                f"another")
    return (f"HybridParallelStrategy() without sizes, for a declared model: tp=1, pp=1, dp={dims.dp} "
            f"({options.data_parallel} over every rank); give tp/pp (or 'auto' to plan them) for another")


def log_bare_layout(options: Any, dims: Any, self_parallel: bool, log: Optional[Callable[[str], Any]]) -> None:
    """Give :func:`bare_layout_note`'s line to ``log`` (when there is one and a ``log``)."""
    note = bare_layout_note(options, dims, self_parallel)
    if note and log is not None:
        log(note)
