"""Checkpoints: sharded DCP save/load with manifests, the one verifier, retention; export to Hugging Face."""

from lightning_hybrid.checkpoint.manifest import CheckpointError, committed_checkpoints
from lightning_hybrid.checkpoint.verify import find_resumable, verify_checkpoint

__all__ = ["CheckpointError", "committed_checkpoints", "find_resumable", "verify_checkpoint"]
