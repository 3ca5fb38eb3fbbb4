"""Asynchronous saves that barely block the step: what Distributed Checkpoint offers, configured once per process.

- **Staging in the background** (``DefaultStager(StagingOptions(use_async_staging=True))``): the copy of the state
  to host memory (pinned where CUDA, so the copy is a DMA that overlaps compute) runs in a thread; the save call
  returns after planning only. The copy must end before the optimizer changes the weights: the caller waits for
  :meth:`AsyncSave.staged` before the next optimizer step, so forward and backward overlap it. The stager lives as
  long as the process and reuses its host buffers from one save to the next.
- **The writer**: ``"thread"`` (a background thread of the training process) or ``"process"``
  (``AsyncCheckpointerType.PROCESS``: one daemon process per rank, started at the first save and kept; the
  training script needs an ``if __name__ == "__main__":`` guard, the daemon is started with ``spawn``). With a
  process writer the staged copy is in shared memory, so the daemon reads it without a pickle of the tensors. The
  daemon exits as soon as its training process is gone (killed, crashed): DCP's own daemon would live on, waiting in a
  collective of its writer group or for the next request, until a timeout ends it (:func:`tie_writer_to_parent`).
- **Save-plan caching** (``DefaultSavePlanner(enable_plan_caching=True)``): from the second save on, ranks send
  only what changed in their plans, not whole plans.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["AsyncOptions", "ASYNC_WRITERS", "AsyncSave", "start_async_save", "close_stagers", "tie_writer_to_parent",
           "exit_with_parent"]

ASYNC_WRITERS = ("thread", "process")


@dataclass(frozen=True)
class AsyncOptions:
    """How an asynchronous save runs (see the module docstring).

    Args:
        writer: ``"thread"`` or ``"process"``.
        background_staging: copy the state to host memory in a background thread (the step waits for the copy
            only before its optimizer step); ``False`` copies during the save call.
        plan_caching: reuse the save plan of the previous save (DCP's ``enable_plan_caching``).

    Raises:
        ValueError: an unknown writer.
    """

    writer: str = "thread"
    background_staging: bool = True
    plan_caching: bool = True

    def __post_init__(self) -> None:
        if self.writer not in ASYNC_WRITERS:
            raise ValueError(f"async_writer={self.writer!r} is not supported; use one of {', '.join(ASYNC_WRITERS)}")


@dataclass
class AsyncSave:
    """The futures of one asynchronous save: the copy to host memory, and the upload."""

    staging: Optional[Future]
    upload: Future

    def staged(self) -> None:
        """Block until the state is copied to host memory (the weights may change afterwards)."""
        if self.staging is not None:
            self.staging.result()


_STAGERS: dict[AsyncOptions, Any] = {}


def _stager(options: AsyncOptions) -> Any:
    """One DCP stager per option set and process: it keeps its host buffers (pinned or shared) between saves."""
    if options not in _STAGERS:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        _STAGERS[options] = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=options.writer == "process",
            use_async_staging=options.background_staging, use_non_blocking_copy=cuda))
    return _STAGERS[options]


def close_stagers() -> None:
    """Free the host buffers of every stager of this process (the next async save makes a new one)."""
    while _STAGERS:
        _STAGERS.popitem()[1].close()


def _planner(options: AsyncOptions) -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner

    if not options.plan_caching:
        return DefaultSavePlanner()
    return DefaultSavePlanner(enable_plan_caching=True)


# The training process's pid, for the writer daemon it spawns (the environment is what a spawned child inherits).
WRITER_PARENT_ENV = "LIGHTNING_HYBRID_WRITER_PARENT"


def exit_with_parent(parent: int) -> None:
    """End this process (exit code 1) as soon as process ``parent`` is gone, from a daemon thread: at once when it is
    gone already (this process was re-parented), else when its pidfd becomes readable (Linux), else by polling."""
    import select
    import threading
    import time

    def watch() -> None:
        try:
            handle = os.pidfd_open(parent)
        except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3) or the parent is gone: poll the parent pid
            while os.getppid() == parent:
                time.sleep(1.0)
        else:
            if os.getppid() == parent:
                select.select([handle], [], [])  # readable once the process exits
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _writer_daemon(*args: Any, **kwargs: Any) -> Any:
    """DCP's writer daemon (``_AsyncCheckpointProcess._checkpointing_subprocess``), tied to its training process."""
    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    exit_with_parent(int(os.environ.get(WRITER_PARENT_ENV, os.getppid())))
    return _TORCH_WRITER_DAEMON.get("target", _AsyncCheckpointProcess._checkpointing_subprocess)(*args, **kwargs)


_TORCH_WRITER_DAEMON: dict[str, Any] = {}


def tie_writer_to_parent() -> None:
    """Make DCP's process writer exit with the training process that spawned it.

    DCP spawns the daemon from a pool thread that ends after the first save, so ``PR_SET_PDEATHSIG`` (tied to the
    creating thread) would end it early; the daemon instead watches the training process itself
    (:func:`exit_with_parent`, started before DCP's own daemon code runs). The daemon's target is pickled by name for
    ``spawn``: the child imports this module, where nothing is patched, and runs DCP's original code after the watch.
    """
    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    os.environ[WRITER_PARENT_ENV] = str(os.getpid())
    if "target" not in _TORCH_WRITER_DAEMON:
        _TORCH_WRITER_DAEMON["target"] = _AsyncCheckpointProcess._checkpointing_subprocess
        _AsyncCheckpointProcess._checkpointing_subprocess = staticmethod(_writer_daemon)


def start_async_save(state: dict[str, Any], target: dict[str, Any], group: Any, options: AsyncOptions) -> AsyncSave:
    """Start ``dcp.async_save`` of ``state`` to ``target`` (``checkpoint_id`` or ``storage_writer``) on ``group``.

    Returns when the save is planned (and, without background staging, the state copied); see :class:`AsyncSave`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if options.writer == "process" else AsyncCheckpointerType.THREAD
    if options.writer == "process":
        tie_writer_to_parent()
    response = dcp.async_save(state, **target, process_group=group, planner=_planner(options),
                              async_checkpointer_type=kind, async_stager=_stager(options))
    if hasattr(response, "upload_completion"):
        return AsyncSave(response.staging_completion, response.upload_completion)
    return AsyncSave(None, response)
