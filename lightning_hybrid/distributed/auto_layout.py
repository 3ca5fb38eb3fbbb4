"""The auto layout at setup: what it reads off the job, the device it measures, and the decision rank 0 broadcasts.

``tp="auto"`` and the other :data:`~lightning_hybrid.distributed.options.AUTO_FIELDS`: before the mesh exists, the
strategy asks here. This side reads the job (the strategy's public attributes, its Trainer's data and checkpoint),
measures the device (:mod:`lightning_hybrid.device_speed`, a provisional mesh for the preflight) and broadcasts the
answer; the planner (:func:`lightning_hybrid.planner.auto.plan_request`) decides from plain values. Lightning shows
the training data at ``setup_environment`` only through ``trainer.datamodule`` or, for DataLoaders given to ``fit``,
its data connector's source (Lightning-private, read-only; ``None`` if it moves).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_hybrid.checkpoint.manifest import MANIFEST, committed_checkpoints
from lightning_hybrid.checkpoint.storage import checkpoint_path
from lightning_hybrid.distributed.host import StrategyHost
from lightning_hybrid.distributed.option_checks import check_options
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.models.spec import ParallelSpec
from lightning_hybrid.planner.auto import (
    AutoPlan,
    AutoRequest,
    TrainingShape,
    apply_layout,
    auto_fields,
    check_auto_request,
    plan_request,
)
from lightning_hybrid.planner.calibrate import DeviceFigures, local_hardware

__all__ = ["auto_fields", "check_request", "check_strategy_request", "resolve_auto", "resume_folder",
           "resume_layout", "training_shape", "device_figures"]

log = logging.getLogger(__name__)


def training_shape(datamodule: Any, dataloader: Any) -> TrainingShape:
    """Sequence length and batch from a datamodule's attributes (or hyperparameters), or from a DataLoader.

    Raises:
        ValueError: neither says them.
    """
    if datamodule is not None:
        def attr(name: str) -> Any:
            value = getattr(datamodule, name, None)
            return value if value is not None else getattr(datamodule, "hparams", {}).get(name)

        seq_len, global_batch, batch = attr("seq_len"), attr("global_batch_size"), attr("batch_size")
        if isinstance(seq_len, int) and isinstance(global_batch or batch, int):
            return TrainingShape(seq_len, global_batch or batch, global_batch is not None)
        raise ValueError(f"the layout planner needs the sequence length and batch: give {type(datamodule).__name__} "
                         f"int attributes seq_len and global_batch_size (or batch_size, per dp rank)")
    batch = getattr(dataloader, "batch_size", None)
    dataset = getattr(dataloader, "dataset", None)
    sample = dataset[0] if dataset is not None and hasattr(dataset, "__getitem__") else None
    if isinstance(sample, dict):
        sample = sample.get("input_ids", next(iter(sample.values()), None))
    elif isinstance(sample, (tuple, list)):
        sample = sample[0] if sample else None
    seq_len = sample.shape[-1] if getattr(sample, "ndim", 0) >= 1 else None
    if not isinstance(batch, int) or seq_len is None:
        raise ValueError("the layout planner needs the sequence length and batch: train from a DataLoader with a "
                         "batch_size over a dataset of token tensors, or a datamodule with seq_len and batch_size")
    return TrainingShape(int(seq_len), batch, False)


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


def resume_layout(folder: Optional[Path]) -> Optional[dict[str, Any]]:
    """The layout a checkpoint folder's manifest records (``None`` without one)."""
    import json

    if folder is None or not (checkpoint_path(folder) / MANIFEST).is_file():
        return None
    try:
        mesh = json.loads((checkpoint_path(folder) / MANIFEST).read_text()).get("mesh")
    except (OSError, ValueError):
        return None  # the loader's verifier names the damage
    return mesh if isinstance(mesh, dict) and "tp" in mesh else None


def _data(trainer: Any) -> tuple[Any, Any]:
    """(datamodule, train DataLoader) as attached to ``fit``; either may be ``None``."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        return datamodule, None
    source = getattr(getattr(getattr(trainer, "fit_loop", None), "_data_source", None), "instance", None)
    return None, source


def check_strategy_request(host: StrategyHost, spec: Optional[ParallelSpec]) -> None:
    """All checks of a strategy's auto request that need no collective (identical on every rank).

    Raises:
        ValueError: no declared model, split points no pp allows, or no sequence length and batch to plan with.
    """
    _request_shape(host, spec)


def check_request(host: StrategyHost, spec: Optional[ParallelSpec], precision: str,
                  log: Optional[Callable[[str], Any]] = None) -> Optional[ParallelDims]:
    """The strategy's layout request checked before any collective, identical on every rank: the sizes it resolves
    to (:func:`~lightning_hybrid.distributed.options.check_options`), or ``None`` when an option is ``"auto"`` (then
    :func:`check_strategy_request`'s checks; :func:`resolve_auto` plans it once the process group exists).

    Raises:
        ValueError: the options do not fit the world or the model, or an auto request cannot be planned.
    """
    if auto_fields(host.options):
        check_strategy_request(host, spec)
        return None
    module = host.lightning_module
    return check_options(host.options, host.num_nodes * host.num_processes,
                         host.num_processes if host.num_nodes > 1 else None, spec,
                         module.num_blocks() if spec is not None else None, precision, type(module).__name__, log)


def _request_shape(host: StrategyHost, spec: Optional[ParallelSpec]) -> TrainingShape:
    """All checks of a strategy's auto request that need no collective; the training shape it plans for.

    Raises:
        ValueError: no declared model, split points no pp allows, or no sequence length and batch to plan with.
    """
    module = host.lightning_module
    world, per_node = host.num_nodes * host.num_processes, host.num_processes
    check_auto_request(host.options, getattr(module, "config", None) if spec is not None else None,
                       world, per_node, type(module).__name__)
    return training_shape(*_data(module.trainer))


def device_figures(device: Any) -> DeviceFigures:
    """What the planner needs of this process's device: a GPU's name and memory, or the CPU's measured speeds."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return DeviceFigures("cuda", name=torch.cuda.get_device_name(device),
                             memory_gb=torch.cuda.get_device_properties(device).total_memory / 1e9)
    from lightning_hybrid.device_speed import measure_cpu

    matmul, copy = measure_cpu()
    return DeviceFigures(getattr(device, "type", str(device)), matmul_tflops=matmul, copy_tbs=copy)


def _preflight(host: StrategyHost, timeout: Optional[timedelta]) -> dict[str, Any]:
    """Measure links and matmul on a provisional mesh (TP over a node's devices, DP over nodes); every rank."""
    from lightning_hybrid.distributed.mesh import build_mesh
    from lightning_hybrid.preflight.links import PREFLIGHT_MAX_BYTES, run_preflight

    world = host.num_nodes * host.num_processes
    per_node = host.num_processes if host.num_nodes > 1 else world
    dims = ParallelDims(tp=per_node, pp=1, dp=world // per_node, world_size=world)
    mesh = build_mesh(dims, host.root_device.type, timeout)
    return run_preflight(mesh, max_bytes=PREFLIGHT_MAX_BYTES[host.root_device.type], check_health=False).to_dict()


def _plan_on_rank_zero(request: AutoRequest, device: Any, calibration: Optional[dict]) -> AutoPlan:
    hw, time_model, described = local_hardware(device_figures(device), request.world_size, request.devices_per_node,
                                               calibration)
    return plan_request(request, hw, time_model, described, resume_layout(request.resume_folder))


def resolve_auto(host: StrategyHost, spec: Optional[ParallelSpec], precision: str,
                 timeout: Optional[timedelta]) -> tuple[ParallelOptions, ParallelDims, AutoPlan]:
    """Resolve a strategy's ``"auto"`` options after its process group exists; the same answer on every rank.

    Rank 0 measures (CPU) and plans, then broadcasts the layout (or the error, which every rank then raises).

    Args:
        host: the strategy (read only); ``spec`` its module's declared parts, ``precision`` the Trainer's flag,
            ``timeout`` its process groups' (for the preflight's provisional mesh).

    Raises:
        ValueError: nothing fits, or the resolved options do not fit the model.
    """
    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    assert auto_fields(host.options), "resolve_auto is only asked when an option is 'auto'"
    module = host.lightning_module
    request = AutoRequest(host.options, module.config, host.num_nodes * host.num_processes, host.num_processes,
                          precision, _request_shape(host, spec), resume_folder(module.trainer))
    calibration = _preflight(host, timeout) if host.preflight else None  # a collective: every rank takes part
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = _plan_on_rank_zero(request, host.root_device, calibration)
        except ValueError as err:
            message[0] = str(err)
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], str):
        raise ValueError(message[0])
    plan: AutoPlan = message[0]
    options = apply_layout(host.options, plan.summary())
    dims = check_options(options, request.world_size, request.devices_per_node if host.num_nodes > 1 else None,
                         spec, module.num_blocks(), precision, type(module).__name__)
    rank_zero_info(plan.table())
    log.info(f"rank {dist.get_rank()}: auto layout {plan.chosen.layout.describe()} ({plan.source})")
    return options, dims, plan
