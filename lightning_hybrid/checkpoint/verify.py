"""The one checkpoint verifier: every file the manifest lists is present with its size and CRC-32.

:func:`verify_checkpoint` checks a folder (or a slice of its files) in one process;
:func:`verify_on_all_ranks` splits the files over the ranks of a job, so a 1 TB checkpoint of a 72B
model is read once by the whole job in parallel, and gives every rank the same verdict;
:func:`find_resumable` picks the newest committed checkpoint that passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from lightning_hybrid.checkpoint.manifest import CheckpointError, committed_checkpoints, file_record, read_manifest
from lightning_hybrid.checkpoint.storage import ObjectPath, checkpoint_path

__all__ = ["verify_checkpoint", "verify_on_all_ranks", "find_resumable", "Verified"]


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
    folder = checkpoint_path(folder)
    manifest = read_manifest(folder)
    listed = manifest.get("files", {})
    # On an object store one listing gives every size (no request per object).
    stored = folder.sizes() if isinstance(folder, ObjectPath) else None
    for name in (sorted(listed) if files is None else files):
        expected = listed[name]
        path = folder / name
        if (name not in stored) if stored is not None else not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: file {name} is missing")
        size = stored[name] if stored is not None else path.stat().st_size
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
class Verified:
    """A checkpoint that passed: its manifest and what the job read to check it."""

    manifest: dict[str, Any]
    files: int
    bytes_checked: int
    ranks: int
    seconds: float

    def describe(self, folder: Path, checksums: bool) -> str:
        size = (f"{self.bytes_checked / 1e9:.2f} GB" if self.bytes_checked >= 1e8
                else f"{self.bytes_checked / 1e6:.2f} MB")
        return (f"verified {folder.name}: {self.files} files, {size} {'size and CRC-32' if checksums else 'size'} "
                f"checked by {self.ranks} rank(s) in {self.seconds:.1f} s")


def verify_on_all_ranks(folder: Path, rank: int, world: int, group: Any = None, checksums: bool = True) -> Verified:
    """Check ``folder`` with the files split over ``world`` ranks; every rank gets the same verdict.

    A collective on ``group`` when ``world > 1``: every rank of the group calls it.

    Raises:
        CheckpointError: on every rank, naming the first damaged file any rank found.
    """
    start, error, checked = time.perf_counter(), "", 0
    manifest: dict[str, Any] = {}
    try:
        manifest = read_manifest(folder)
        names = sorted(manifest.get("files", {}))
        mine = names[rank::world]
        verify_checkpoint(folder, files=mine, checksums=checksums)
        checked = sum(manifest["files"][name]["size"] for name in mine)  # verified equal to the stored sizes
    except (CheckpointError, OSError) as err:
        error = str(err)
    verdicts: list = [(error, checked)]
    if world > 1:
        import torch.distributed as dist

        verdicts = [None] * world
        dist.all_gather_object(verdicts, (error, checked), group=group)
    errors = [e for e, _ in verdicts if e]
    if errors:
        raise CheckpointError(errors[0])
    return Verified(manifest, len(manifest.get("files", {})), sum(b for _, b in verdicts), world,
                    time.perf_counter() - start)


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
