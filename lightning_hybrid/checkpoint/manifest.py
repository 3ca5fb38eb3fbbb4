"""Checkpoint folders, their manifest (``meta.json``), integrity checks, the ``latest`` pointer, retention.

A checkpoint is complete only when its folder is named ``step-NNNNNN`` (written as
``step-NNNNNN.tmp`` and renamed after every rank finished) and its ``meta.json`` lists every file with
its size and CRC-32. ``latest`` is a small text file naming the newest committed folder, replaced
atomically (write a temporary file, fsync, ``os.replace``).

On an object store (an fsspec URL, see :mod:`~lightning_hybrid.checkpoint.storage`) there is no rename: a
``step-NNNNNN/`` prefix is committed once its ``meta.json`` object exists, written last; ``latest`` is one object
written after it.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from lightning_hybrid.checkpoint.storage import ObjectPath, checkpoint_path, move_checkpoint, remove_checkpoint

__all__ = ["MANIFEST", "LATEST", "step_dirname", "file_record", "write_manifest",
           "CheckpointError", "committed_checkpoints", "set_aside_newer", "update_latest", "purge_old",
           "fsync_dir", "record_skips", "model_differences"]

MANIFEST = "meta.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete or damaged."""


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def file_record(path: Path) -> dict[str, Any]:
    """Size and CRC-32 of one file, read in 8 MB chunks."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": f"{crc:08x}"}


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable (nothing to do on an object store)."""
    if isinstance(path, ObjectPath):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    if isinstance(path, ObjectPath):  # one PUT: the object appears whole or not at all
        path.write_text(text)
        return
    tmp = path.with_name(path.name + ".writing")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Write ``meta.json``: ``info`` (step, epoch, mesh, model config, versions, ...) plus ``files``."""
    _write_atomically(folder / MANIFEST, json.dumps({**info, "files": files}, indent=1, sort_keys=True))


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of ``folder``.

    Raises:
        CheckpointError: it is missing or not valid JSON.
    """
    path = checkpoint_path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST} (incomplete or not a checkpoint)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is not valid JSON ({err})") from err


@dataclass(frozen=True)
class Committed:
    step: int
    path: Path


def committed_checkpoints(dirpath: Union[str, Path]) -> list[Committed]:
    """Committed ``step-N`` folders in ``dirpath``, newest first (``.tmp`` folders are never listed; on an object
    store, only prefixes with their manifest: one listing)."""
    root = checkpoint_path(dirpath)
    if isinstance(root, ObjectPath):
        found = [Committed(int(m.group(1)), p.parent) for p in root.glob(f"step-*/{MANIFEST}")
                 if (m := _STEP_DIR.match(p.parent.name))]
        return sorted(found, key=lambda c: c.step, reverse=True)
    if not root.is_dir():
        return []
    found = [Committed(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, key=lambda c: c.step, reverse=True)


def set_aside_newer(dirpath: Union[str, Path], step: int, names: Optional[Iterable[str]] = None) -> list[Path]:
    """Rename every committed checkpoint newer than ``step`` to ``step-N.damaged`` (``.damaged-2``, ... if taken);
    with ``names``, only those of them (the candidates that were checked; another model's are not this run's).

    Called after :func:`find_resumable` chose the checkpoint of ``step`` (``-1``: none), when every newer one
    failed its check: set aside, they are kept for inspection but never tried again, and the resumed run can
    save those steps anew. Only one process may call it. Returns the new paths.
    """
    moved = []
    only = None if names is None else set(names)
    for candidate in committed_checkpoints(dirpath):
        if candidate.step <= step:
            break
        if only is not None and candidate.path.name not in only:
            continue
        target = candidate.path.with_name(candidate.path.name + ".damaged")
        n = 1
        while target.exists():
            n += 1
            target = candidate.path.with_name(f"{candidate.path.name}.damaged-{n}")
        move_checkpoint(candidate.path, target, MANIFEST)
        moved.append(target)
    if moved:
        fsync_dir(checkpoint_path(dirpath))
    return moved


# Fields of a model config that do not make it another model (a name, the longest sequence, the init's spread).
_NOT_THE_MODEL = ("name", "max_position_embeddings", "initializer_range")


def model_differences(saved: Optional[dict[str, Any]], current: Optional[dict[str, Any]]) -> dict[str, tuple]:
    """``{field: (saved, current)}`` of the config fields in which two models differ (``{}``: the same model, or
    one of the configs is unknown); the name alone never makes two models different."""
    if saved is None or current is None:
        return {}
    return {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
            if k not in _NOT_THE_MODEL and saved.get(k) != current.get(k)}


def update_latest(dirpath: Path, folder: Path) -> None:
    """Point ``dirpath/latest`` at ``folder`` (atomic replace)."""
    _write_atomically(checkpoint_path(dirpath) / LATEST, folder.name + "\n")


def purge_old(dirpath: Path, keep_last: int, protect: Iterable[Path] = (),
              owns: Optional[Callable[[Path], bool]] = None) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep_last``, never one in ``protect``; and stale ``.tmp``
    folders. With ``owns``, only the checkpoints it accepts (a run's own lineage) are counted and deleted. Returns
    the deleted folders."""
    protected = {checkpoint_path(p).resolve() for p in protect}
    removed = []
    candidates = [c for c in committed_checkpoints(dirpath) if owns is None or owns(c.path)]
    for old in candidates[keep_last:]:
        if old.path.resolve() not in protected:
            remove_checkpoint(old.path, MANIFEST)
            removed.append(old.path)
    return removed


def record_skips(dirpath: Union[str, Path], skips: list[list[int]]) -> list[Path]:
    """Write the data ranges never to train on (``[epoch, start, end]``) into the ``data_position`` of every
    committed checkpoint's manifest in ``dirpath`` (atomic replace; the manifest lists no checksum of itself), so
    a run resumed from any of them leaves those samples out. Only one process may call it. Returns the folders."""
    amended = []
    for candidate in committed_checkpoints(dirpath):
        try:
            manifest = read_manifest(candidate.path)
        except CheckpointError:
            continue  # a damaged one is set aside at resume
        position = manifest.get("data_position")
        if position:
            position["skips"] = sorted({tuple(s) for s in [*position.get("skips", []), *skips]})
            _write_atomically(candidate.path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            amended.append(candidate.path)
    return amended
