"""The job a recipe describes, as the dry run needs it: world, strategy and model arguments, batch shape."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from lightning_hybrid.recipe_file import read_recipe, recipe_gpu

__all__ = ["DryRunJob", "load_job"]

_DROPPED_STRATEGY_ARGS = ("timeout", "hang_timeout", "preflight", "process_group_backend",
                         "save_distributed_checkpoint",
                         # one replica group of a torchft job is traced (no lighthouse on the fake process group)
                         "fault_tolerance", "min_replica_groups", "ft_timeout",
                         # the blocks are traced eagerly: compiling 40 blocks' graphs per rank on fake tensors would
                         # take longer than the whole dry run, and these change kernels, not bytes held or collectives
                         "compile", "async_tp")


@dataclass(frozen=True)
class DryRunJob:
    """One training job: its world and what every rank builds.

    Attributes:
        name: the recipe's file name.
        num_nodes, devices_per_node: the Trainer's ``num_nodes`` and ``devices``.
        precision: Lightning's precision.
        strategy: ``HybridParallelStrategy`` arguments (the launch-only ones dropped: timeouts, preflight, backend).
        model: ``CausalLM`` arguments.
        batch_size, seq_len: sequences per dp rank and step, tokens per sequence.
        gradient_clip_val, accumulate_grad_batches: the Trainer's.
        seed: ``seed_everything``.
        plan_gpu: the ``--gpu`` of the recipe's ``# plan:`` line, when it has one.
    """

    name: str
    num_nodes: int
    devices_per_node: int
    precision: str
    strategy: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1
    seq_len: int = 128
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    seed: int = 0
    plan_gpu: Optional[str] = None

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return self.num_nodes * self.devices_per_node

    def with_microbatches(self, microbatches: int) -> "DryRunJob":
        """This job running ``microbatches`` micro-batches of the same size per step (a pipeline's traced step)."""
        current = self.strategy.get("microbatches")
        if current is None or current == microbatches:
            return self
        size = self.batch_size // current
        return replace(self, batch_size=size * microbatches, strategy={**self.strategy, "microbatches": microbatches})

    def with_strategy(self, **changes: Any) -> "DryRunJob":
        """This job with some strategy arguments changed (what-if runs, tests)."""
        return replace(self, strategy={**self.strategy, **changes})


def _int(section: dict, key: str, where: str, default: Optional[int] = None) -> int:
    value = section.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}.{key}={value!r} in the recipe must be a positive integer for a dry run")
    return value


def load_job(path: str) -> DryRunJob:
    """Read a ``lightning-hybrid fit`` recipe.

    Raises:
        ValueError: the file is missing, is not YAML, or lacks what the dry run needs (devices, batch size, seq_len,
            a ``HybridParallelStrategy``).
    """
    text, config, trainer, strategy = read_recipe(path, " for a dry run")
    data = (config.get("data") or {}).get("init_args") or {}
    init_args = {k: v for k, v in (strategy.get("init_args") or {}).items() if k not in _DROPPED_STRATEGY_ARGS}
    return DryRunJob(
        name=Path(path).name, num_nodes=_int(trainer, "num_nodes", "trainer", 1),
        devices_per_node=_int(trainer, "devices", "trainer"), precision=str(trainer.get("precision", "32-true")),
        strategy=init_args, model=dict(config.get("model") or {}), batch_size=_int(data, "batch_size", "data"),
        seq_len=_int(data, "seq_len", "data"), gradient_clip_val=trainer.get("gradient_clip_val"),
        accumulate_grad_batches=int(trainer.get("accumulate_grad_batches") or 1),
        seed=int(config.get("seed_everything") or 0), plan_gpu=recipe_gpu(text))
