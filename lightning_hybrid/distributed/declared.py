"""The declared model (``parallel_spec()``) parallelized, materialized and initialized for one rank of the mesh."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_hybrid.distributed.init_weights import initialize_declared
from lightning_hybrid.distributed.parallelize import parallelize, setup_runtime
from lightning_hybrid.distributed.pipeline.runner import build_pipeline

__all__ = ["parallelize_declared"]


def parallelize_declared(strategy: Any, model: nn.Module) -> None:
    """Parallelize and materialize ``model`` (or this rank's pipeline stages) for ``strategy``'s mesh, initialize it
    mesh-independently from the broadcast seed, then set up the runtime features (bf16 weight copies, loss on
    vocabulary shards). Sets ``strategy.pipeline`` (pp > 1), ``strategy.weight_casts`` and
    ``strategy._loss_parallel``; the module's ``model`` becomes the pipeline's container under pp > 1."""
    module, dims = strategy.lightning_module, strategy.dims
    args = (strategy.options, dims, strategy.device_mesh)
    rest = (strategy.root_device, strategy._precision, strategy.precision_plugin.convert_module)
    seed = strategy.broadcast(module.init_seed())
    if dims.pp > 1:
        pp_rank = dims.coordinates(strategy.global_rank)["pp"]
        strategy.pipeline = build_pipeline(model, strategy._spec, *args, pp_rank, *rest, module.num_blocks())
        module.model = strategy.pipeline.container
    else:
        parallelize(model, strategy._spec, *args, *rest)
    initialize_declared(module, module.model, model, seed)
    strategy.weight_casts, strategy._loss_parallel = setup_runtime(strategy.options, dims, strategy._precision,
                                                                   strategy.precision_plugin, module.model)
