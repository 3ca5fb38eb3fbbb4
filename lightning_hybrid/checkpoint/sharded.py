"""Save and load a whole training state for :class:`~lightning_hybrid.HybridParallelStrategy`.

``begin_save`` snapshots the state and starts writing (async or not); ``ShardedSave.finish`` is the
commit point every rank calls together: it gathers the per-rank file records, and rank 0 writes the
trainer state and the manifest. ``load`` verifies the manifest (checksums split over the ranks), checks
the model config, loads shards, RNG states and the data position.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_hybrid.checkpoint.dcp import (
    SAVE_ERRORS,
    TRAINER_STATE,
    PendingWrite,
    describe_save_error,
    load_rng,
    load_shards,
    load_trainer_state,
    model_optimizer_state,
    save_rng,
    save_trainer_state,
    write_shards,
)
from lightning_hybrid.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    file_record,
    model_differences,
    write_manifest,
)
from lightning_hybrid.checkpoint.staging import AsyncOptions
from lightning_hybrid.checkpoint.storage import checkpoint_path
from lightning_hybrid.checkpoint.verify import verify_on_all_ranks

__all__ = ["CheckpointContext", "ShardedSave", "begin_save", "load", "CheckpointWriteError", "check_model_config"]


@dataclass
class CheckpointContext:
    """What saving and loading need from the running job; the strategy builds one per call.

    Args:
        module: the LightningModule (its ``model``, ``config`` and ``hparams`` are saved).
        optimizers: the optimizers whose states are saved or loaded (empty when not training).
        global_rank / world_size: this rank and the job's size.
        group: the gloo group for checkpoint collectives (never shared with training collectives).
        background_group: the group of the background writer thread (async saves).
        layout: the parallel layout, recorded in the manifest (tp, pp, dp, world_size, ...).
        data_position: global samples of the epoch consumed so far, and the sampler's seed.
    """

    module: Any
    optimizers: list[torch.optim.Optimizer]
    global_rank: int
    world_size: int
    group: Any
    background_group: Any
    layout: dict[str, Any]
    data_position: Optional[dict[str, int]] = None


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed on at least one rank (the message names the ranks and causes)."""


def _versions() -> dict[str, str]:
    import lightning

    from lightning_hybrid.version import __version__

    return {"lightning_hybrid": __version__, "torch": torch.__version__,
            "lightning": lightning.__version__, "python": platform.python_version()}


def _by_error(failed: list[tuple[int, str]]) -> str:
    """``"ranks 0, 1, 3: OSError: ..."``: each distinct error once, with the ranks that reported it."""
    ranks: dict[str, list[int]] = {}
    for rank, error in failed:
        ranks.setdefault(error, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}" for e, r in ranks.items())


def _info(ctx: CheckpointContext, checkpoint: dict[str, Any]) -> dict[str, Any]:
    module = ctx.module
    config = getattr(module, "config", None)
    return {
        "step": int(checkpoint.get("global_step", 0)),
        "run_id": checkpoint.get("hybrid", {}).get("run_id"),  # the run lineage (checkpoint/lineage.py)
        "epoch": int(checkpoint.get("epoch", 0)),
        "data_position": checkpoint.get("hybrid", {}).get("data_position"),
        "mesh": dict(ctx.layout),
        "model_config": config.to_dict() if config is not None else None,
        "hparams": json.loads(json.dumps(dict(getattr(module, "hparams", {})), default=str)),
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class ShardedSave:
    """A checkpoint being written; call :meth:`finish` on every rank (collective) once :meth:`ready` everywhere."""

    def __init__(self, ctx: CheckpointContext, folder: Path, pending: PendingWrite,
                 info: dict[str, Any], started: float, local_error: str = "") -> None:
        self.ctx = ctx
        self.local_error = local_error  # a failure of this rank's own files (rank 0's trainer state), for finish
        self.folder = folder
        self.pending = pending
        self.info = info
        self.started = started

    def ready(self) -> bool:
        return self.pending.done()

    def staged(self) -> None:
        """Block until this rank's state is copied to host memory; call before the optimizer changes the weights."""
        self.pending.staged()

    def finish(self) -> dict[str, Any]:
        """Wait for this rank's write, gather all records, write the manifest on rank 0; returns the manifest info.

        Raises:
            CheckpointWriteError: on every rank, when any rank's write failed.
        """
        import torch.distributed as dist

        try:
            records: dict[str, Any] = {"files": self.pending.result()}
        except SAVE_ERRORS as err:  # storage errors of the background writer land here (DCP's are BaseExceptions)
            records = {"error": describe_save_error(err)}
        if self.local_error:
            records = {"error": self.local_error}
        group = self.ctx.group
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, records, group=group)
        failed = [(r, g["error"]) for r, g in enumerate(gathered) if "error" in g]
        if failed:
            raise CheckpointWriteError(f"saving {self.folder} failed: {_by_error(failed)}")
        if self.ctx.global_rank == 0:
            files: dict[str, Any] = {}
            for item in gathered:
                files.update(item["files"])
            for name in (".metadata", TRAINER_STATE):
                files[name] = file_record(self.folder / name)
            write_manifest(self.folder, files, {**self.info, "save_seconds": time.perf_counter() - self.started})
        dist.barrier(group=group)
        return self.info


def begin_save(ctx: CheckpointContext, checkpoint: dict[str, Any], folder: Path,
               async_save: Union[bool, AsyncOptions]) -> ShardedSave:
    """Snapshot and start writing ``checkpoint`` (Lightning's dict, with its ``state_dict`` and
    ``optimizer_states`` replaced by the sharded model/optimizer state) into ``folder`` (a local folder or an
    object-store prefix); ``async_save`` may carry the :class:`~.staging.AsyncOptions`."""
    folder = checkpoint_path(folder)  # a local Path or an object-store prefix (see checkpoint.storage)
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    checkpoint["hybrid"] = {**checkpoint.get("hybrid", {}), "data_position": ctx.data_position}  # keeps run_id
    import torch.distributed as dist

    started = time.perf_counter()
    group = ctx.group
    # Local failures (permission denied, disk full: OSError, or torch's "unexpected pos" RuntimeError) are gathered
    # first: every rank raises together, after all finished touching the folder, and none is left in DCP's collectives.
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_rng(folder, ctx.global_rank)
        error = ""
    except Exception as err:  # noqa: BLE001 - reported to every rank below and raised there
        error = f"{type(err).__name__}: {' '.join(str(err).split())}"
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if any(errors):
        raise CheckpointWriteError(f"saving {folder} failed: {_by_error([(r, e) for r, e in enumerate(errors) if e])}")
    state = model_optimizer_state(ctx.module.model, ctx.optimizers)
    # An asynchronous write runs its collectives in a background thread, on a group no other thread uses.
    writer_group = ctx.background_group if async_save else group
    pending = write_shards(folder, state, writer_group, dist.get_rank(writer_group), ctx.global_rank, async_save)
    local_error = ""
    if ctx.global_rank == 0:
        try:  # a failure here is reported to every rank in finish(), never raised on rank 0 alone
            save_trainer_state(folder, checkpoint)
        except OSError as err:
            local_error = f"{type(err).__name__}: {err}"
    return ShardedSave(ctx, folder, pending, _info(ctx, checkpoint), started, local_error)


def check_model_config(saved: Optional[dict[str, Any]], current: Optional[dict[str, Any]], folder: Path,
                       run_id: Optional[str] = None) -> None:
    """Raise when the checkpoint holds another model than the one being trained.

    Raises:
        ValueError: naming the checkpoint, its run and the differing fields.
    """
    diff = model_differences(saved, current)
    if diff:
        fields = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diff.items())
        run = f" (run {run_id})" if run_id else ""
        raise ValueError(f"checkpoint {folder}{run} is of another model: {fields}; load it into a model with the "
                         f"same config, or give this model another checkpoint folder (FaultTolerantCheckpoint "
                         f"dirpath) or move {folder.parent} away")


def load(ctx: CheckpointContext, folder: Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`begin_save` into the module's model and ``ctx.optimizers``.

    Returns Lightning's checkpoint dict (loops, schedulers, callbacks); its ``["hybrid"]["data_position"]``
    is where the data resumes.

    Raises:
        CheckpointError: the folder is incomplete or damaged (same verdict on every rank).
        ValueError: the checkpoint holds another model config.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    folder = checkpoint_path(folder)
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST} (incomplete or not a checkpoint)")
    manifest = verify_on_all_ranks(folder, ctx.global_rank, ctx.world_size, ctx.group).manifest
    config = getattr(ctx.module, "config", None)
    check_model_config(manifest.get("model_config"), config.to_dict() if config is not None else None, folder,
                       manifest.get("run_id"))
    load_shards(folder, ctx.module.model, ctx.optimizers, ctx.group)
    trainer_state = load_trainer_state(folder)
    if manifest.get("data_position"):  # the manifest's wins: a rollback may have added skipped ranges to it since
        trainer_state.setdefault("hybrid", {})["data_position"] = manifest["data_position"]
    if manifest.get("mesh", {}).get("world_size") == ctx.world_size:
        load_rng(folder, ctx.global_rank, rank_zero_warn)
    return trainer_state
