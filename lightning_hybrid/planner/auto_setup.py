"""The auto layout at setup: what it reads off a strategy and its Trainer, and the decision on rank 0.

The strategy is read through its public attributes (duck-typed: the planner never imports the strategy); Lightning
shows the training data at ``setup_environment`` only through ``trainer.datamodule`` or, for DataLoaders given to
``fit``, its data connector's source (Lightning-private, read-only; ``None`` if it moves).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_hybrid.checkpoint.manifest import MANIFEST, committed_checkpoints
from lightning_hybrid.checkpoint.storage import checkpoint_path
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.parallelize import ParallelOptions, check_options
from lightning_hybrid.planner.auto import (
    AutoPlan,
    TrainingShape,
    apply_layout,
    auto_fields,
    check_auto_request,
    fixed_by_manifest,
    plan_layout,
    resume_layout,
    training_shape,
)
from lightning_hybrid.planner.calibrate import local_hardware

__all__ = ["AutoInputs", "auto_inputs", "check_strategy_request", "resume_folder", "resolve_auto", "auto_fields"]

log = logging.getLogger(__name__)


@dataclass
class AutoInputs:
    """Everything the planner plans from, read identically on every rank."""

    world_size: int
    devices_per_node: int
    nodes: int
    device: Any
    config: Any
    spec: Any
    num_blocks: int
    precision: str
    module_name: str
    shape: TrainingShape
    resume_folder: Optional[Path]
    run_preflight: bool
    timeout: Any = None

    def preflight(self) -> dict[str, Any]:
        """Measure links and matmul on a provisional mesh (TP over a node's devices, DP over nodes); every rank."""
        from lightning_hybrid.distributed.parallel_dims import ParallelDims, build_mesh
        from lightning_hybrid.preflight.links import PREFLIGHT_MAX_BYTES, run_preflight

        per_node = self.devices_per_node if self.nodes > 1 else self.world_size
        dims = ParallelDims(tp=per_node, pp=1, dp=self.world_size // per_node, world_size=self.world_size)
        mesh = build_mesh(dims, self.device.type, self.timeout)
        return run_preflight(mesh, max_bytes=PREFLIGHT_MAX_BYTES[self.device.type], check_health=False).to_dict()


def resume_folder(trainer: Any) -> Optional[Path]:
    """The checkpoint this fit resumes from, as far as it is known before the mesh exists.

    ``trainer.ckpt_path`` when set before ``fit`` (a sharded checkpoint folder), else the newest committed folder of
    a FaultTolerantCheckpoint callback with ``auto_resume``.
    """
    path = getattr(trainer, "ckpt_path", None)
    if path is not None and (checkpoint_path(path) / MANIFEST).is_file():  # a local folder or an s3:// URL
        return checkpoint_path(path)
    for callback in getattr(trainer, "callbacks", []):
        if getattr(callback, "auto_resume", False) and getattr(callback, "dirpath", None) is not None:
            for found in committed_checkpoints(callback.dirpath):
                if (found.path / MANIFEST).is_file():
                    return found.path
    return None


def _data(trainer: Any) -> tuple[Any, Any]:
    """(datamodule, train DataLoader) as attached to ``fit``; either may be ``None``."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        return datamodule, None
    source = getattr(getattr(getattr(trainer, "fit_loop", None), "_data_source", None), "instance", None)
    return None, source


def check_strategy_request(strategy: Any) -> None:
    """All checks of a strategy's auto request that need no collective (identical on every rank).

    Raises:
        ValueError: no declared model, split points no pp allows, or no sequence length and batch to plan with.
    """
    _request_shape(strategy)


def _request_shape(strategy: Any) -> TrainingShape:
    """All checks of a strategy's auto request that need no collective; the training shape it plans for.

    Raises:
        ValueError: no declared model, split points no pp allows, or no sequence length and batch to plan with.
    """
    module = strategy.lightning_module
    world, per_node = strategy.num_nodes * strategy.num_processes, strategy.num_processes
    check_auto_request(strategy.options, getattr(module, "config", None) if strategy._spec is not None else None,
                       world, per_node, type(module).__name__)
    return training_shape(*_data(module.trainer))


def auto_inputs(strategy: Any) -> AutoInputs:
    """What the planner needs of ``strategy`` (a :class:`~lightning_hybrid.HybridParallelStrategy` in setup)."""
    module = strategy.lightning_module
    trainer = module.trainer
    assert auto_fields(strategy.options), "auto_inputs is only asked when an option is 'auto'"
    return AutoInputs(world_size=strategy.num_nodes * strategy.num_processes, devices_per_node=strategy.num_processes,
                      nodes=strategy.num_nodes, device=strategy.root_device, config=module.config,
                      spec=strategy._spec, num_blocks=module.num_blocks(), precision=strategy._precision,
                      module_name=type(module).__name__, shape=_request_shape(strategy),
                      resume_folder=resume_folder(trainer), run_preflight=bool(strategy.preflight),
                      timeout=strategy._timeout)


def resolve_auto(strategy: Any) -> tuple[ParallelOptions, ParallelDims, AutoPlan]:
    """Resolve a strategy's ``"auto"`` options after its process group exists; the same answer on every rank.

    Rank 0 measures (CPU) and plans, then broadcasts the layout (or the error, which every rank then raises).

    Raises:
        ValueError: nothing fits, or the resolved options do not fit the model.
    """
    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    inputs = auto_inputs(strategy)
    calibration = inputs.preflight() if inputs.run_preflight else None  # a collective: every rank takes part
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = _plan_on_rank_zero(strategy.options, inputs, calibration)
        except ValueError as err:
            message[0] = str(err)
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], str):
        raise ValueError(message[0])
    plan: AutoPlan = message[0]
    options = apply_layout(strategy.options, plan.summary())
    dims = check_options(options, inputs.world_size, inputs.devices_per_node if inputs.nodes > 1 else None,
                         inputs.spec, inputs.num_blocks, inputs.precision, inputs.module_name)
    rank_zero_info(plan.table())
    log.info(f"rank {dist.get_rank()}: auto layout {plan.chosen.layout.describe()} ({plan.source})")
    return options, dims, plan


def _plan_on_rank_zero(options: ParallelOptions, inputs: Any, calibration: Optional[dict]) -> AutoPlan:
    hw, time_model, device = local_hardware(inputs.device, inputs.world_size, inputs.devices_per_node, calibration)
    requested = auto_fields(options)
    manifest = resume_layout(inputs.resume_folder)
    notes, source = [], "planner"
    if manifest is not None and manifest.get("world_size") == inputs.world_size:
        options, source = fixed_by_manifest(options, manifest), f"checkpoint manifest {inputs.resume_folder}"
    elif manifest is not None:
        notes.append(f"re-planned: the checkpoint {inputs.resume_folder} was written on world size "
                     f"{manifest.get('world_size')} (tp={manifest['tp']} pp={manifest['pp']} dp={manifest['dp']}); "
                     f"this run has {inputs.world_size}, and the checkpoint is resharded on load")
    # a manifest may fix every auto field: the planner then estimates that one layout (still logged)
    plan = plan_layout(options, inputs.config, hw, inputs.shape, inputs.precision, time_model, device)
    plan.source, plan.notes, plan.fields = source, notes, requested
    return plan
