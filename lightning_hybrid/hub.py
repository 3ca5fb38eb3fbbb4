"""Hugging Face Hub: a local folder for a repo id or path (download through the Hub cache).

Shared by the model configs, the weight loader, the export and ``prepare-data``; it imports nothing of ours.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Union

__all__ = ["resolve_hf_path", "HUB_PATTERNS", "is_repo_id"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a model folder needs for training and export: configs and weights, never pickled checkpoints.
HUB_PATTERNS = ("*.json", "*.safetensors")


def is_repo_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hugging Face repo id (``org/name``)."""
    return bool(_REPO_ID.match(text))


def resolve_hf_path(path_or_repo: Union[str, Path],
                    allow_patterns: Iterable[str] = HUB_PATTERNS) -> Path:
    """A local folder for a Hugging Face model: a local path as is, a repo id through the Hub cache.

    A repo id (``Qwen/Qwen2.5-72B``) is fetched with ``huggingface_hub.snapshot_download`` restricted to
    ``allow_patterns`` (progress bar included); files already in the cache are not fetched again, and
    with ``HF_HUB_OFFLINE=1`` only the cache is used. Concurrent calls from several ranks share the
    Hub's file locks.

    Raises:
        FileNotFoundError: neither an existing folder nor a repo id, or the repo is not in the offline cache.
    """
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is a file; pass the Hugging Face model folder that contains it")
    repo = str(path_or_repo)
    if not _REPO_ID.match(repo):
        raise FileNotFoundError(f"{repo}: no such folder, and not a Hugging Face repo id (org/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id=repo, allow_patterns=list(allow_patterns)))
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(f"Hugging Face repo {repo!r} not found (or gated: log in with `hf auth login`)") \
            from err
    except LocalEntryNotFoundError as err:
        how = ("HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached")
        raise FileNotFoundError(f"Hugging Face repo {repo!r} is not in the local cache ({constants.HF_HUB_CACHE}) "
                                f"and {how}; download it first (`hf download {repo}`) or pass a local folder") from err
