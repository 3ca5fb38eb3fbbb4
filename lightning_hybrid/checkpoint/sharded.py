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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_hybrid.checkpoint.dcp import (TRAINER_STATE, PendingWrite, load_rng, load_shards,
                                             load_trainer_state, model_optimizer_state, save_rng, save_trainer_state,
                                             write_shards)
from lightning_hybrid.checkpoint.manifest import (MANIFEST, CheckpointError, file_record, read_manifest,
                                                  verify_checkpoint, write_manifest)

if TYPE_CHECKING:
    from lightning_hybrid.strategy import HybridParallelStrategy

__all__ = ["ShardedSave", "begin_save", "load", "CheckpointWriteError", "check_model_config"]


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed on at least one rank (the message names the ranks and causes)."""


def _versions() -> dict[str, str]:
    import lightning

    import lightning_hybrid

    return {"lightning_hybrid": lightning_hybrid.__version__, "torch": torch.__version__,
            "lightning": lightning.__version__, "python": platform.python_version()}


def _info(strategy: "HybridParallelStrategy", checkpoint: dict[str, Any]) -> dict[str, Any]:
    module = strategy.lightning_module
    dims = strategy.dims
    config = getattr(module, "config", None)
    return {
        "step": int(checkpoint.get("global_step", 0)),
        "epoch": int(checkpoint.get("epoch", 0)),
        "data_position": checkpoint.get("hybrid", {}).get("data_position"),
        "mesh": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "world_size": dims.world_size,
                 "data_parallel": strategy.data_parallel, "virtual_stages": strategy.virtual_stages,
                 "pp_schedule": strategy.pp_schedule},
        "model_config": config.to_dict() if config is not None else None,
        "hparams": json.loads(json.dumps(dict(getattr(module, "hparams", {})), default=str)),
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class ShardedSave:
    """A checkpoint being written; call :meth:`finish` on every rank (collective) once :meth:`ready` everywhere."""

    def __init__(self, strategy: "HybridParallelStrategy", folder: Path, pending: PendingWrite,
                 info: dict[str, Any], started: float) -> None:
        self.strategy = strategy
        self.folder = folder
        self.pending = pending
        self.info = info
        self.started = started

    def ready(self) -> bool:
        return self.pending.done()

    def finish(self) -> dict[str, Any]:
        """Wait for this rank's write, gather all records, write the manifest on rank 0; returns the manifest info.

        Raises:
            CheckpointWriteError: on every rank, when any rank's write failed.
        """
        import torch.distributed as dist

        try:
            records: dict[str, Any] = {"files": self.pending.result()}
        except Exception as err:  # storage errors of the background writer land here
            records = {"error": f"{type(err).__name__}: {err}"}
        group = self.strategy.checkpoint_group
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, records, group=group)
        errors = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if "error" in g]
        if errors:
            raise CheckpointWriteError(f"saving {self.folder} failed: " + "; ".join(errors))
        if self.strategy.global_rank == 0:
            files: dict[str, Any] = {}
            for item in gathered:
                files.update(item["files"])
            for name in (".metadata", TRAINER_STATE):
                files[name] = file_record(self.folder / name)
            write_manifest(self.folder, files, {**self.info, "save_seconds": time.perf_counter() - self.started})
        dist.barrier(group=group)
        return self.info


def data_position(strategy: "HybridParallelStrategy") -> Optional[dict[str, int]]:
    """Global samples of the current epoch consumed so far (including the batch being finished)."""
    trainer = strategy.lightning_module._trainer
    if trainer is None or strategy.per_rank_batch_size is None:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    position = {"epoch": int(trainer.current_epoch),
                "samples_in_epoch": int(progress.processed) * strategy.per_rank_batch_size * strategy.dims.dp,
                "global_batch": strategy.per_rank_batch_size * strategy.dims.dp}
    if strategy.train_sampler is not None:
        position["seed"] = int(strategy.train_sampler.seed)
    return position


def begin_save(strategy: "HybridParallelStrategy", checkpoint: dict[str, Any], folder: Path,
               async_save: bool) -> ShardedSave:
    """Snapshot and start writing ``checkpoint`` (Lightning's dict, with its ``state_dict`` and
    ``optimizer_states`` replaced by the sharded model/optimizer state) into ``folder``."""
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    checkpoint["hybrid"] = {"data_position": data_position(strategy)}
    import torch.distributed as dist

    started = time.perf_counter()
    module = strategy.lightning_module
    group = strategy.checkpoint_group
    # Local failures (permission denied, disk full) must not leave some ranks inside DCP's collectives.
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_rng(folder, strategy.global_rank)
        error = ""
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if any(errors):
        raise CheckpointWriteError(f"saving {folder} failed: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
    state = model_optimizer_state(module.model, list(strategy.optimizers))
    # An asynchronous write runs its collectives in a background thread, on a group no other thread uses.
    writer_group = strategy.background_checkpoint_group if async_save else group
    pending = write_shards(folder, state, writer_group, dist.get_rank(writer_group), strategy.global_rank, async_save)
    if strategy.global_rank == 0:
        save_trainer_state(folder, checkpoint)
    return ShardedSave(strategy, folder, pending, _info(strategy, checkpoint), started)


def check_model_config(saved: Optional[dict[str, Any]], current: Optional[dict[str, Any]], folder: Path) -> None:
    """Raise when the checkpoint holds another model than the one being trained.

    Raises:
        ValueError: naming both configs' differing fields.
    """
    if saved is None or current is None:
        return
    ignore = {"name", "max_position_embeddings", "initializer_range"}
    diff = {k: (saved.get(k), current.get(k)) for k in set(saved) | set(current)
            if k not in ignore and saved.get(k) != current.get(k)}
    if diff:
        fields = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in sorted(diff.items()))
        raise ValueError(f"checkpoint {folder} is of another model ({saved.get('name')} vs {current.get('name')}): "
                         f"{fields}; load it into a model with the same config")


def _verify_on_all_ranks(strategy: "HybridParallelStrategy", folder: Path) -> dict[str, Any]:
    """Sizes checked by every rank, checksums split over the ranks; one verdict for all."""
    import torch.distributed as dist

    message = ""
    manifest: dict[str, Any] = {}
    try:
        manifest = verify_checkpoint(folder, checksums=False)
        names = sorted(manifest.get("files", {}))
        verify_checkpoint(folder, files=names[strategy.global_rank::strategy.world_size])
    except CheckpointError as err:
        message = str(err)
    messages: list = [None] * strategy.world_size
    dist.all_gather_object(messages, message, group=strategy.checkpoint_group)
    failures = [m for m in messages if m]
    if failures:
        raise CheckpointError(failures[0])
    return manifest


def load(strategy: "HybridParallelStrategy", folder: Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`begin_save` into the strategy's model and optimizers.

    Raises:
        CheckpointError: the folder is incomplete or damaged (same verdict on every rank).
        ValueError: the checkpoint holds another model config.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    if not (folder / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST} (incomplete or not a checkpoint)")
    manifest = _verify_on_all_ranks(strategy, folder)
    module = strategy.lightning_module
    config = getattr(module, "config", None)
    check_model_config(manifest.get("model_config"), config.to_dict() if config is not None else None, folder)
    optimizers = list(strategy.optimizers) if strategy.lightning_module.trainer.training or strategy.optimizers else []
    load_shards(folder, module.model, optimizers, strategy.checkpoint_group)
    trainer_state = load_trainer_state(folder)
    if manifest.get("mesh", {}).get("world_size") == strategy.world_size:
        load_rng(folder, strategy.global_rank, rank_zero_warn)
    strategy.resume_position = trainer_state.get("hybrid", {}).get("data_position")
    return trainer_state


def read_info(folder: Path) -> dict[str, Any]:
    return read_manifest(folder)
