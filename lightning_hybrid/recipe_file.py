"""Reading a ``lightning-hybrid fit`` recipe file for the tools that plan or trace it (``plan --config``, ``dry-run``):
the YAML, its ``HybridParallelStrategy`` section and the GPU type of its ``# plan:`` header line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Optional

__all__ = ["read_recipe", "recipe_gpu"]


def recipe_gpu(text: str) -> Optional[str]:
    """The ``--gpu`` of the recipe header's ``# plan:`` line, when it has one."""
    for line in text.splitlines():
        match = re.match(r"#\s*plan:\s*(.*)", line)
        if match:
            words = shlex.split(match.group(1))
            if "--gpu" in words and words.index("--gpu") + 1 < len(words):
                return words[words.index("--gpu") + 1]
    return None


def read_recipe(path: str, purpose: str = "") -> tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(text, the whole config, its trainer section, its strategy section)`` of the recipe at ``path``.

    Raises:
        ValueError: one line: no such file, not YAML, or ``trainer.strategy`` is not ``HybridParallelStrategy``
            (``purpose`` ends that message, e.g. ``" for a dry run"``).
    """
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = file.read_text()
    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy") or {}
    if not isinstance(strategy, dict) or not str(strategy.get("class_path", "")).endswith("HybridParallelStrategy"):
        raise ValueError(f"--config {path}: trainer.strategy must be lightning_hybrid.HybridParallelStrategy"
                         f"{purpose}; got {strategy!r}")
    return text, config, trainer, strategy
