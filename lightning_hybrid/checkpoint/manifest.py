"""Checkpoint folders, their manifest (``meta.json``), integrity checks, the ``latest`` pointer, retention.

A checkpoint is complete only when its folder is named ``step-NNNNNN`` (written as
``step-NNNNNN.tmp`` and renamed after every rank finished) and its ``meta.json`` lists every file with
its size and CRC-32. ``latest`` is a small text file naming the newest committed folder, replaced
atomically (write a temporary file, fsync, ``os.replace``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

__all__ = ["MANIFEST", "LATEST", "step_dirname", "file_record", "write_manifest", "verify_checkpoint",
           "CheckpointError", "committed_checkpoints", "find_resumable", "set_aside_newer", "update_latest", "purge_old",
           "fsync_dir"]

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
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": f"{crc:08x}"}


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
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
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST} (incomplete or not a checkpoint)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is not valid JSON ({err})") from err


def verify_checkpoint(folder: Union[str, Path], files: Optional[Iterable[str]] = None,
                      checksums: bool = True) -> dict[str, Any]:
    """Check that every file the manifest lists is present with its size (and CRC-32); return the manifest.

    Args:
        folder: the checkpoint folder.
        files: check only these names (to split the work over ranks); ``None`` checks all.
        checksums: also compare CRC-32s (reads every byte), not just sizes.

    Raises:
        CheckpointError: naming the first missing, truncated or corrupted file.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    listed = manifest.get("files", {})
    for name in (sorted(listed) if files is None else files):
        expected = listed[name]
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: file {name} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint {folder}: file {name} has {size} bytes, the manifest says "
                                  f"{expected['size']} (truncated or partial write)")
        if checksums:
            crc = file_record(path)["crc32"]
            if crc != expected["crc32"]:
                raise CheckpointError(f"checkpoint {folder}: file {name} has CRC-32 {crc}, the manifest says "
                                      f"{expected['crc32']} (corrupted)")
    return manifest


@dataclass(frozen=True)
class Committed:
    step: int
    path: Path


def committed_checkpoints(dirpath: Union[str, Path]) -> list[Committed]:
    """Committed ``step-N`` folders in ``dirpath``, newest first (``.tmp`` folders are never listed)."""
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found = [Committed(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, key=lambda c: c.step, reverse=True)


def find_resumable(dirpath: Union[str, Path], log: Any = print, checksums: bool = True) -> Optional[Path]:
    """The newest checkpoint in ``dirpath`` that passes :func:`verify_checkpoint`; damaged ones are reported
    in one line each and skipped. ``None`` when there is none."""
    for candidate in committed_checkpoints(dirpath):
        try:
            verify_checkpoint(candidate.path, checksums=checksums)
        except CheckpointError as err:
            log(f"skipping damaged checkpoint: {err}")
            continue
        return candidate.path
    return None


def set_aside_newer(dirpath: Union[str, Path], step: int) -> list[Path]:
    """Rename every committed checkpoint newer than ``step`` to ``step-N.damaged`` (``.damaged-2``, ... if taken).

    Called after :func:`find_resumable` chose the checkpoint of ``step`` (``-1``: none), when every newer one
    failed its check: set aside, they are kept for inspection but never tried again, and the resumed run can
    save those steps anew. Only one process may call it. Returns the new paths.
    """
    moved = []
    for candidate in committed_checkpoints(dirpath):
        if candidate.step <= step:
            break
        target = candidate.path.with_name(candidate.path.name + ".damaged")
        n = 1
        while target.exists():
            n += 1
            target = candidate.path.with_name(f"{candidate.path.name}.damaged-{n}")
        os.replace(candidate.path, target)
        moved.append(target)
    if moved:
        fsync_dir(Path(dirpath))
    return moved


def update_latest(dirpath: Path, folder: Path) -> None:
    """Point ``dirpath/latest`` at ``folder`` (atomic replace)."""
    _write_atomically(Path(dirpath) / LATEST, folder.name + "\n")


def purge_old(dirpath: Path, keep_last: int, protect: Iterable[Path] = ()) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep_last``, never one in ``protect``; and stale ``.tmp``
    folders. Returns the deleted folders."""
    protected = {Path(p).resolve() for p in protect}
    removed = []
    for old in committed_checkpoints(dirpath)[keep_last:]:
        if old.path.resolve() not in protected:
            shutil.rmtree(old.path, ignore_errors=True)
            removed.append(old.path)
    return removed
