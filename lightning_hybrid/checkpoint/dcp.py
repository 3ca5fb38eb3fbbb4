"""Sharded checkpoints with Distributed Checkpoint: every rank writes only its own shards, in parallel.

Layout of a checkpoint folder:

- DCP files (``.metadata``, ``__R_N.distcp``) of ``{"model": model state dict, "optimizer_0": ...}`` with the
  model's global parameter names (``model.layers.57.mlp.up_proj.weight``) and optimizer states flattened
  (``StateDictOptions(flatten_optimizer_state_dict=True)``), so any mesh, pipeline split or single
  process loads it (DCP reshards on load).
- ``trainer_state.pt``: Lightning's loops, LR schedulers, callbacks and hyper-parameters (rank 0).
- ``rng/rank_R.pt``: each rank's Python, NumPy, torch CPU and CUDA random states.

Both ``.pt`` files hold only plain containers, numbers, strings and tensors, and are read with
``torch.load(weights_only=True)``: a checkpoint folder is shared storage that many can write, and a
pickle that names any other type (code to run) is refused with one line, never executed.
- ``meta.json``: the manifest (see :mod:`lightning_hybrid.checkpoint.manifest`).
"""

from __future__ import annotations

import io
import random
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from lightning_hybrid.checkpoint.manifest import CheckpointError, file_record
from lightning_hybrid.checkpoint.staging import AsyncOptions, start_async_save
from lightning_hybrid.checkpoint.storage import ObjectPath, storage_reader, storage_writer

__all__ = ["SAVE_ERRORS", "describe_save_error", "model_optimizer_state", "write_shards", "load_shards", "rng_state",
           "restore_rng_state",
           "own_files", "TRAINER_STATE", "PendingWrite"]

TRAINER_STATE = "trainer_state.pt"


def _save_errors() -> tuple[type[BaseException], ...]:
    # DCP's CheckpointException (what a failed write raises, also from the async writer's future) derives from
    # BaseException, not Exception: an `except Exception` around a save lets a full disk end training.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


# What a failed checkpoint write can raise; catch these (never a bare BaseException: Ctrl-C must still stop a run).
SAVE_ERRORS = _save_errors()


def describe_save_error(err: BaseException) -> str:
    """One line: the cause of a failed save (for DCP's CheckpointException, the first failing rank's own error)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        while cause.__cause__ is not None or (cause.__context__ is not None and not cause.__suppress_context__):
            cause = cause.__cause__ or cause.__context__
        lines = str(cause).strip().splitlines()
        return f"rank {rank}: {type(cause).__name__}: {lines[0] if lines else ''}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
RNG_DIR = "rng"


def model_optimizer_state(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The DCP state of ``module`` (global names, sharded tensors as DTensors) and its optimizers (flattened)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer, options=flat)
    return state


def rng_state() -> dict[str, Any]:
    """This process's random states as plain types and tensors (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # an array in checkpoints before 0.2
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list[Any]:
    """What unpickling a NumPy array names: checkpoints written before 0.2 kept NumPy's RNG keys as an array."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain(path: Path, allowed: Sequence[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)``: containers, numbers, strings and tensors only, plus ``allowed``.

    Raises:
        CheckpointError: the file names a type outside that allow-list (a pickle that could run code), in one
            line naming the file and the type; nothing in it is executed.
    """
    import pickle

    try:
        with torch.serialization.safe_globals(list(allowed)):
            if isinstance(path, ObjectPath):
                return torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f"it names {found.group(1)}" if found else "it holds more than tensors and plain values"
        raise CheckpointError(f"refusing to load {path}: {what}, which a checkpoint never needs (a pickle that "
                              f"could run code); nothing in it was executed. Was the file replaced by someone "
                              f"else?") from None


def own_files(folder: Path, group_rank: int, global_rank: int) -> list[str]:
    """Names (relative to ``folder``) of the files this rank wrote: its DCP shards and its RNG file."""
    names = sorted(p.name for p in folder.glob(f"__{group_rank}_*.distcp"))
    rng = Path(RNG_DIR) / f"rank_{global_rank}.pt"
    if (folder / rng).is_file():
        names.append(str(rng))
    return names


class PendingWrite:
    """A checkpoint write in progress on this rank; ``result()`` gives the records of the files it wrote."""

    def __init__(self, future: Future, staging: Optional[Future] = None) -> None:
        self._future = future
        self._staging = staging

    def staged(self) -> None:
        """Block until the state is copied to host memory (before the optimizer may change it)."""
        if self._staging is not None:
            self._staging.result()

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> dict[str, dict[str, Any]]:
        return self._future.result()


_EXECUTOR: Optional[ThreadPoolExecutor] = None


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-hybrid-ckpt")
    return _EXECUTOR


def write_shards(folder: Path, state: dict[str, Any], group: Any, group_rank: int, global_rank: int,
                 async_save: Union[bool, AsyncOptions]) -> PendingWrite:
    """Write this rank's part of ``state`` into ``folder`` with DCP (the folder exists; see :func:`save_rng`).

    With ``async_save`` (``True``: the default :class:`~.staging.AsyncOptions`) the call returns once the save is
    planned; the state is copied to host memory in the background (wait with ``PendingWrite.staged()`` before the
    weights change), the files are written by a background thread or process and checksummed in a thread here.
    Otherwise it returns after the write.
    The background thread runs collectives on ``group``: no other thread may use that group until the write
    is done, or ranks can match the two threads' collectives in different orders and hang.
    """
    import torch.distributed.checkpoint as dcp

    def records() -> dict[str, dict[str, Any]]:
        return {name: file_record(folder / name) for name in own_files(folder, group_rank, global_rank)}

    if async_save:
        options = async_save if isinstance(async_save, AsyncOptions) else AsyncOptions()
        started = start_async_save(state, _target(folder), group, options)

        def finish() -> dict[str, dict[str, Any]]:
            started.upload.result()
            return records()

        return PendingWrite(_executor().submit(finish), started.staging)
    dcp.save(state, **_target(folder), process_group=group)
    done: Future = Future()
    done.set_result(records())
    return PendingWrite(done)


def _target(folder: Path, read: bool = False) -> dict[str, Any]:
    """DCP's arguments for ``folder``: a local path, or an fsspec reader/writer carrying the storage options (DCP
    would re-open a ``checkpoint_id`` URL without them)."""
    if isinstance(folder, ObjectPath):
        return {"storage_reader": storage_reader(folder)} if read else {"storage_writer": storage_writer(folder)}
    return {"checkpoint_id": str(folder)}


def save_rng(folder: Path, global_rank: int) -> None:
    """Write this rank's random states to ``folder/rng/rank_R.pt``."""
    (folder / RNG_DIR).mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    (folder / RNG_DIR / f"rank_{global_rank}.pt").write_bytes(buffer.getvalue())


def load_shards(folder: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], group: Any) -> None:
    """Load model and optimizer states from ``folder`` into this rank's shards (any saved mesh)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    state = model_optimizer_state(module, optimizers)
    dcp.load(state, **_target(folder, read=True), process_group=group)
    set_model_state_dict(module, state["model"])
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=flat)


def save_trainer_state(folder: Path, checkpoint: dict[str, Any]) -> None:
    """Write Lightning's checkpoint dict (without model and optimizer states) to ``trainer_state.pt``."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    (folder / TRAINER_STATE).write_bytes(buffer.getvalue())


def load_trainer_state(folder: Path) -> dict[str, Any]:
    """Lightning's own state (loops, callbacks, hyper-parameters), read without running any pickled code.

    Raises:
        CheckpointError: the file holds anything but containers, numbers, strings and tensors.
    """
    return load_plain(folder / TRAINER_STATE)


def load_rng(folder: Path, global_rank: int, log: Callable[[str], None]) -> bool:
    path = folder / RNG_DIR / f"rank_{global_rank}.pt"
    if not path.is_file():
        log(f"checkpoint {folder} has no random state for rank {global_rank} (saved on another mesh); "
            f"continuing with the current random state")
        return False
    restore_rng_state(load_plain(path, allowed=_numpy_array_globals()))
    return True
