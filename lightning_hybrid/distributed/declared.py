"""The declared model (``parallel_spec()``) parallelized, materialized and initialized for one rank of the mesh.

:func:`parallelize_declared` returns what it made (:class:`Parallelized`); the strategy keeps it in its own hooks.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from torch import nn

from lightning_hybrid.distributed.data_parallel import StepWeightCasts
from lightning_hybrid.distributed.host import StrategyHost
from lightning_hybrid.distributed.parallelize import parallelize, require_meta, setup_runtime
from lightning_hybrid.distributed.pipeline.runner import PipelineRunner, build_pipeline
from lightning_hybrid.init_weights import init_parameters
from lightning_hybrid.models.spec import ParallelSpec

__all__ = ["Parallelized", "declared_model", "parallelize_declared", "initialize_declared"]


class Parallelized(NamedTuple):
    """What parallelizing a declared model made, for the strategy to keep (a tuple: it unpacks in that order).

    Args:
        pipeline: the pipeline runner (pp > 1), whose container became the module's ``model``; ``None`` for pp=1.
        weight_casts: the step's bf16 weight copies (``options.compute_weights == "step"``), or ``None``.
        loss_on_shards: the loss runs on vocabulary shards (``options.loss_on_shards``): predict gathers the logits.
    """

    pipeline: Optional[PipelineRunner]
    weight_casts: Optional[StepWeightCasts]
    loss_on_shards: bool


def declared_model(module: Any) -> nn.Module:
    """The model a declared LightningModule built in ``configure_model`` (its ``model`` attribute).

    Raises:
        TypeError: the module does not build its model in ``configure_model()``, did not set ``self.model``, or the
            model has no ``loss_sum`` or no initialization (its ``parameter_init`` or the module's
            ``initialize_parameters``).
    """
    from lightning.pytorch.utilities.model_helpers import is_overridden

    name = type(module).__name__
    if not is_overridden("configure_model", module):
        raise TypeError(f"{name} declares parallel_spec() but does not build its model in configure_model()")
    model = module.model
    if model is None:
        raise TypeError(f"{name}.configure_model() did not set `self.model`")
    model_name = type(model).__name__
    if not callable(getattr(model, "loss_sum", None)):
        raise TypeError(f"{model_name} (the model of {name}) has no loss_sum(logits, labels) -> (sum, count); the "
                        f"strategy computes a declared model's loss with it (docs/custom-models.md)")
    if not callable(getattr(model, "parameter_init", None)) and not callable(getattr(module, "initialize_parameters",
                                                                                      None)):
        raise TypeError(f"{model_name} has no parameter_init(name) and {name} no initialize_parameters(model, seed); "
                        f"the strategy initializes the shards with one of them (docs/custom-models.md)")
    return model


def initialize_declared(lightning_module: Any, target: nn.Module, declared: nn.Module, seed: int) -> None:
    """Fill the materialized shards of ``target``: the LightningModule's ``initialize_parameters(target, seed)``
    if it has one (``CausalLM`` loads pretrained weights there), else the mesh-independent random initialization
    with the declared model's ``parameter_init`` rule."""
    hook = getattr(lightning_module, "initialize_parameters", None)
    if callable(hook):
        hook(target, seed)
    else:
        init_parameters(target, seed, declared.parameter_init)


def parallelize_declared(host: StrategyHost, model: nn.Module, spec: ParallelSpec, precision: str) -> Parallelized:
    """Parallelize and materialize ``model`` (or this rank's pipeline stages) for ``host``'s mesh, initialize it
    mesh-independently from the broadcast seed, then set up the runtime features (bf16 weight copies, loss on
    vocabulary shards). The module's ``model`` becomes the pipeline's container under pp > 1.

    Args:
        host: the strategy (read only: its options, sizes, mesh, device, precision plugin, rank and broadcast).
        spec: the module's declared parts.
        precision: the Trainer's precision flag (``"bf16-mixed"``, ...).

    Raises:
        ValueError: ``model`` has real weights (it must be on the meta device, to be sharded before it is allocated).
    """
    module, dims, options = host.lightning_module, host.dims, host.options
    require_meta(model, type(module).__name__)
    args = (options, dims, host.device_mesh)
    rest = (host.root_device, precision, host.precision_plugin.convert_module)
    seed = host.broadcast(module.init_seed())
    pipeline = None
    if dims.pp > 1:
        pp_rank = dims.coordinates(host.global_rank)["pp"]
        pipeline = build_pipeline(model, spec, *args, pp_rank, *rest, module.num_blocks())
        module.model = pipeline.container
    else:
        parallelize(model, spec, *args, *rest)
    initialize_declared(module, module.model, model, seed)
    casts, on_shards = setup_runtime(options, dims, precision, host.precision_plugin, module.model)
    return Parallelized(pipeline, casts, on_shards)
