"""Run lineages: which checkpoints of a folder belong to the run that trains now.

A run lineage is one training history: a fresh run and all its resumes (in the same layout or resharded). Its
``run_id`` is written into every checkpoint's manifest (``meta.json``) and is taken over from the checkpoint a run
resumes from, so a checkpoint folder can say which of its ``step-N`` folders are whose. A folder belongs to one
lineage: a new run that finds checkpoints of another one either refuses (the default) or, with
``on_foreign="archive"``, moves them into ``archived-<run_id>/`` (never deleting them), where that lineage can be
resumed again (``FaultTolerantCheckpoint(dirpath="<folder>/archived-<run_id>")``).

Checkpoints written before run ids existed have none: a run that resumes from one adopts every unlabelled
checkpoint of the folder as its own.

A checkpoint of another model (its manifest's model config differs from the model being trained) is always another
lineage: auto-resume never takes it for its own, so under auto-resume too it is refused or archived like any other
run's, and the refusal names its run and the fields in which the two models differ.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

from lightning_hybrid.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    CheckpointError,
    Committed,
    committed_checkpoints,
    fsync_dir,
    model_differences,
    read_manifest,
    update_latest,
)
from lightning_hybrid.checkpoint.storage import checkpoint_path, move_checkpoint

__all__ = ["ON_FOREIGN", "ForeignCheckpointsError", "new_run_id", "run_id_of", "Lineage", "foreign_checkpoints",
           "describe_foreign", "archive_foreign", "claim_folder", "check_folder", "model_config_of", "of_another_model",
           "resumable", "set_aside_same_step", "ARCHIVE_PREFIX"]

ON_FOREIGN = ("refuse", "archive")
ARCHIVE_PREFIX = "archived-"
_UNREADABLE = object()


class ForeignCheckpointsError(CheckpointError):
    """The checkpoint folder holds checkpoints of another run lineage (one line: folder, run, model, ways on)."""


def new_run_id() -> str:
    """A fresh lineage id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def run_id_of(folder: Union[str, Path]) -> object:
    """The ``run_id`` in ``folder``'s manifest: a string, ``None`` (written before run ids existed) or
    ``_UNREADABLE`` (no valid manifest: neither ours nor another run's; auto-resume sets such folders aside)."""
    try:
        return read_manifest(checkpoint_path(folder)).get("run_id")
    except CheckpointError:
        return _UNREADABLE


class Lineage:
    """The run ids a run counts as its own: its ``run_id``, plus ``None`` when it resumed an unlabelled checkpoint."""

    def __init__(self, run_id: str, adopt_unlabelled: bool = False) -> None:
        self.run_id = run_id
        self.adopt_unlabelled = adopt_unlabelled

    @classmethod
    def resuming(cls, checkpoint: Optional[Union[str, Path]]) -> "Lineage":
        """The lineage of a run that resumes from ``checkpoint`` (``None``: a new run, a new id)."""
        found = run_id_of(checkpoint) if checkpoint is not None else _UNREADABLE
        if isinstance(found, str) and found:
            return cls(found)
        return cls(new_run_id(), adopt_unlabelled=found is None)

    def owns(self, run_id: object) -> bool:
        return run_id == self.run_id or (run_id is None and self.adopt_unlabelled)

    def own_checkpoints(self, dirpath: Union[str, Path]) -> list[Committed]:
        """The committed checkpoints of ``dirpath`` of this lineage, newest first (what retention may delete)."""
        return [c for c in committed_checkpoints(dirpath) if self.owns(run_id_of(c.path))]


def foreign_checkpoints(dirpath: Union[str, Path], lineage: Lineage) -> dict[object, list[Committed]]:
    """Committed checkpoints of ``dirpath`` with a readable manifest of another lineage, by run id (newest first)."""
    found: dict[object, list[Committed]] = {}
    for candidate in committed_checkpoints(dirpath):
        run_id = run_id_of(candidate.path)
        if run_id is not _UNREADABLE and not lineage.owns(run_id):
            found.setdefault(run_id, []).append(candidate)
    return found


def model_config_of(module: Any) -> Optional[dict[str, Any]]:
    """The model config a LightningModule trains (``module.config.to_dict()``), ``None`` when it has none."""
    config = getattr(module, "config", None)
    return config.to_dict() if callable(getattr(config, "to_dict", None)) else None


def of_another_model(folder: Union[str, Path], current: Optional[dict[str, Any]]) -> bool:
    """``folder``'s manifest is readable and holds another model than ``current`` (``None``: unknown, never)."""
    try:
        saved = read_manifest(checkpoint_path(folder)).get("model_config")
    except CheckpointError:
        return False  # no valid manifest: auto-resume checks it and sets it aside as damaged
    return bool(model_differences(saved, current))


def resumable(dirpath: Union[str, Path], current: Optional[dict[str, Any]]) -> list[Committed]:
    """The committed checkpoints of ``dirpath`` that auto-resume may take, newest first: all but another model's."""
    return [c for c in committed_checkpoints(dirpath) if not of_another_model(c.path, current)]


def _model(folder: Path, current: Optional[dict[str, Any]] = None) -> str:
    """``tiny-64 (hidden_size=64, num_hidden_layers=4)``, or with ``current`` the fields that differ from it:
    ``tiny (hidden_size 64, this run's 96)``."""
    config = read_manifest(folder).get("model_config") or {}
    name = config.get("name", "unknown")
    diff = model_differences(config, current)
    if diff:
        return f"{name} (" + ", ".join(f"{k} {a}, this run's {b}" for k, (a, b) in diff.items()) + ")"
    shape = ", ".join(f"{k}={config[k]}" for k in ("hidden_size", "num_hidden_layers") if k in config)
    return name + (f" ({shape})" if shape else "")


def describe_foreign(dirpath: Union[str, Path], foreign: dict[object, list[Committed]],
                     current: Optional[dict[str, Any]] = None) -> str:
    """One line: the folder, each other run's id, model (with ``current``: how it differs from this run's) and newest
    step, and the two ways on."""
    runs = "; ".join(f"run {run_id or 'without run id'}: model {_model(items[0].path, current)}, newest step "
                     f"{items[0].step}, {len(items)} checkpoint{'s' if len(items) > 1 else ''}"
                     for run_id, items in foreign.items())
    return (f"checkpoint folder {dirpath} holds checkpoints of another run ({runs}); this new run would mix its "
            f"history into theirs. Give this run another dirpath, or pass FaultTolerantCheckpoint(..., "
            f"on_foreign=\"archive\") to move the other run's checkpoints into "
            f"{Path(dirpath) / ARCHIVE_PREFIX}<run_id>/ (nothing is deleted)")


def archive_foreign(dirpath: Union[str, Path], foreign: dict[object, list[Committed]]) -> list[Path]:
    """Move each other lineage's checkpoints into ``dirpath/archived-<run_id>/`` (renames only; a taken name gets
    ``-2``, ``-3``, ...). Only one process may call it. Returns the new folders of the moved checkpoints."""
    root = checkpoint_path(dirpath)
    local = isinstance(root, Path)
    moved = []
    for run_id, items in foreign.items():
        target = root / f"{ARCHIVE_PREFIX}{run_id or 'unlabelled'}"
        target.mkdir(exist_ok=True)
        for item in items:
            destination = target / item.path.name
            n = 1
            while destination.exists():
                n += 1
                destination = target / f"{item.path.name}-{n}"
            # A rename on a file system; on an object store a copy, manifest moved first (never two committed).
            os.replace(item.path, destination) if local else move_checkpoint(item.path, destination, MANIFEST)
            moved.append(destination)
        if items:
            (target / "latest").write_text(items[0].path.name + "\n")
            if local:
                fsync_dir(target)
    if moved and local:
        fsync_dir(root)
    return moved


def set_aside_same_step(final: Path) -> Optional[Path]:
    """Rename a folder that holds ``final``'s name (another lineage's or an older branch's step) to
    ``step-N.replaced`` (``-2``, ...), so the save of this step commits instead of being skipped. Returns the new
    path, or ``None`` when there was none."""
    if not final.exists():
        return None
    target = final.with_name(final.name + ".replaced")
    n = 1
    while target.exists():
        n += 1
        target = final.with_name(f"{final.name}.replaced-{n}")
    os.replace(final, target)
    return target


def claim_folder(dirpath: Union[str, Path], source: Optional[Union[str, Path]], on_foreign: str,
                 warn: Callable[[str], None], current: Optional[dict[str, Any]] = None) -> tuple[Lineage, str]:
    """The lineage of a run resuming from ``source`` (``None``: a new run) in ``dirpath``, and the one-line refusal
    when another lineage's checkpoints are there and ``on_foreign="refuse"`` (else ``""``; with ``"archive"`` they
    are moved and ``latest`` points at this lineage's newest). ``current``: the model config being trained, to name
    how another run's model differs. Only one process may call it."""
    lineage = Lineage.resuming(source)
    foreign = foreign_checkpoints(dirpath, lineage)
    if not foreign:
        return lineage, ""
    if on_foreign == "refuse":
        return lineage, describe_foreign(dirpath, foreign, current)
    moved = archive_foreign(dirpath, foreign)
    warn(f"on_foreign='archive': moved {len(moved)} checkpoint(s) of another run from {dirpath} into "
         f"{', '.join(sorted({str(m.parent) for m in moved}))}")
    own = lineage.own_checkpoints(dirpath)
    if own:
        update_latest(checkpoint_path(dirpath), own[0].path)
    else:
        (checkpoint_path(dirpath) / LATEST).unlink(missing_ok=True)
    return lineage, ""


def check_folder(dirpath: Union[str, Path], ckpt_path: Optional[Union[str, Path]], auto_resume: bool,
                 current: Optional[dict[str, Any]] = None, refuse: bool = True) -> None:
    """The refusals of :func:`claim_folder` from the manifests alone, before any process starts or any collective
    runs (auto-resume is taken to continue the newest checkpoint of this model with a readable manifest): a
    ``ckpt_path`` of another model (always), another lineage's checkpoints in ``dirpath`` (with ``refuse``).

    Raises:
        ValueError: ``ckpt_path`` holds another model (naming its run and the differing fields).
        ForeignCheckpointsError: one line naming the folder, the other run, its model and the ways on.
    """
    from lightning_hybrid.checkpoint.sharded import check_model_config

    source = ckpt_path
    if source is not None and run_id_of(source) is not _UNREADABLE:
        manifest = read_manifest(checkpoint_path(source))
        check_model_config(manifest.get("model_config"), current, checkpoint_path(source), manifest.get("run_id"))
    if source is None and auto_resume:
        readable = [c for c in resumable(dirpath, current) if run_id_of(c.path) is not _UNREADABLE]
        source = readable[0].path if readable else None
    foreign = foreign_checkpoints(dirpath, Lineage.resuming(source))
    if foreign and refuse:
        raise ForeignCheckpointsError(describe_foreign(dirpath, foreign, current))
