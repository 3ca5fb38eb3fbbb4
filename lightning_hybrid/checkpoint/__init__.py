"""Checkpoints: sharded DCP save/load with manifests, integrity checks and retention; Hugging Face import/export."""

from lightning_hybrid.checkpoint.manifest import (CheckpointError, committed_checkpoints, find_resumable,
                                                  verify_checkpoint)

__all__ = ["CheckpointError", "committed_checkpoints", "find_resumable", "verify_checkpoint"]
