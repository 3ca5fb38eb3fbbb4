"""The one parallelize sequence of a declared model (or one pipeline stage of it), and what it sets up around it.

A declared model is parallelized in a fixed order, the same as torchtitan's: float8 conversion of the block
linears, tensor parallelism, expert parallelism (and the mixture-of-experts layers' load statistics over the data
ranks), then activation recompute and ``torch.compile`` per block, then FSDP2 over ``dp`` (the experts of each ep
rank over the data ranks left), then materialization from the meta device. What to apply comes from
:class:`~lightning_hybrid.distributed.options.ParallelOptions` (the options and their derived decisions live there);
this module applies it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from lightning_hybrid.distributed.activation_checkpoint import apply_activation_checkpointing, compile_blocks
from lightning_hybrid.distributed.context_parallel import install_context_parallel
from lightning_hybrid.distributed.data_parallel import StepWeightCasts, apply_fsdp, torch_dtype, without_autocast
from lightning_hybrid.distributed.expert_parallel import apply_expert_parallel, experts_tp_plan, shard_experts
from lightning_hybrid.distributed.float8 import convert_float8, float8_tp_plan
from lightning_hybrid.distributed.materialize import materialize
from lightning_hybrid.distributed.mesh import data_mesh
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.tensor_parallel import (
    apply_tensor_parallel,
    backward_in_loss_parallel,
    enable_async_tp,
    vocab_parallel_loss,
)
from lightning_hybrid.models.spec import ParallelSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["parallelize", "require_meta", "check_device_options", "setup_runtime"]


def check_device_options(options: ParallelOptions, device: torch.device, backend: str) -> None:
    """Raise the one-line errors of the options the device and backend decide (async TP, float8's recipe), on every
    rank before the process group exists."""
    from lightning_hybrid.distributed.float8 import check_float8_device
    from lightning_hybrid.distributed.options import async_tp_error

    error = options.async_tp and async_tp_error(options.compile, options.sequence_parallel, device.type, backend)
    if error:
        raise ValueError(error)
    check_float8_device(options.float8, device)


def require_meta(model: nn.Module, module_name: str) -> None:
    """Raise unless ``model`` is still on the meta device (so it can be sharded before it is allocated)."""
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError(f"{module_name}.configure_model() built real weights; build the declared model on the "
                         f"meta device so the strategy can shard it first")


def setup_runtime(options: ParallelOptions, dims: ParallelDims, precision: str, precision_plugin: Any,
                  model: nn.Module) -> tuple[Optional[StepWeightCasts], bool]:
    """After :func:`parallelize`: ``(the step's bf16 weight copies or None, whether the loss runs on vocabulary
    shards)``. Turns Lightning's autocast off when the weights are bf16 copies (``options.compute_weights``), hooks
    the copies into ``model`` (the parallelized model or this rank's stage parts) when no FSDP2 unit makes them,
    and runs the precision plugin's backward inside torch's ``loss_parallel`` context under loss parallel (a
    pipeline's backward runs inside its schedule step, which enters it itself)."""
    weights = options.compute_weights(dims, precision)
    if weights is not None:
        without_autocast(precision_plugin)
    casts = StepWeightCasts() if weights == "step" else None
    if casts is not None:
        casts.install(model)
    if options.loss_on_shards(dims):
        backward_in_loss_parallel(precision_plugin)
    return casts, options.loss_on_shards(dims)


def parallelize(module: nn.Module, spec: ParallelSpec, options: ParallelOptions, dims: ParallelDims,
                mesh: "DeviceMesh", device: torch.device, precision: str,
                convert_module: Callable[[nn.Module], Any]) -> None:
    """Float8 conversion, TP, EP, recompute/compile, FSDP2, then materialization, of a meta-device model or pipeline
    stage.

    The parameters are allocated (uninitialized) on ``device``; the caller fills them
    (:func:`lightning_hybrid.init_weights.init_parameters` or pretrained weights).

    Args:
        module: the model or one pipeline stage, on the meta device.
        convert_module: the precision plugin's ``convert_module`` (bf16 storage under ``bf16-true``, cheap on meta).

    FSDP2 frees a block's gathered weights after forward per ``options.reshards_after_forward`` (``"auto"`` keeps
    them gathered under a pipeline). When the loss runs on vocabulary shards (``options.loss_on_shards``) the head
    keeps sharded logits and ``module.loss_sum`` (when the module holds the head) becomes
    :func:`~.tensor_parallel.vocab_parallel_loss`.
    """
    convert_module(module)
    if options.float8 is not None:
        convert_float8(module, spec, options.float8, dims.tp, fsdp=options.shards_parameters(dims))
    if dims.cp > 1:
        cp_mesh = mesh["cp"]
        install_context_parallel(module, spec, cp_mesh.get_group(), dims.cp, cp_mesh.get_local_rank())
    if dims.tp > 1:
        loss_on_shards = options.loss_on_shards(dims) and getattr(module, spec.head, None) is not None
        def adjust_plan(plan: dict, block: nn.Module) -> dict:
            plan = experts_tp_plan(plan, block, spec, options.sequence_parallel)
            return float8_tp_plan(plan, block, options.float8, mesh["tp"])

        apply_tensor_parallel(module, spec, mesh["tp"], options.sequence_parallel, loss_on_shards,
                              adjust_plan=adjust_plan)
        if loss_on_shards and callable(getattr(module, "loss_sum", None)):
            module.loss_sum = vocab_parallel_loss(module.loss_sum, mesh["tp"])
        if options.async_tp:
            enable_async_tp(mesh["tp"])
    apply_expert_parallel(module, dims, mesh)
    blocks = getattr(module, spec.blocks, None)
    if blocks is not None and len(blocks) > 0:
        apply_activation_checkpointing(blocks, options.activation_checkpointing, options.selective_ac,
                                       spec.block_attention)
        if options.compile:
            compile_blocks(blocks, parts=spec.block_norm_consumers if dims.tp > 1 else None)
    if options.shards_parameters(dims):
        shard_experts(module, mesh, dims, options.reshards_after_forward(dims.pp),
                      torch_dtype(options.param_dtype(precision)), torch_dtype(options.reduction_dtype(precision)))
        apply_fsdp(module, getattr(module, spec.blocks), data_mesh(mesh, dims),
                   param_dtype=torch_dtype(options.param_dtype(precision)),
                   reduce_dtype=torch_dtype(options.reduction_dtype(precision)),
                   reshard_after_forward=options.reshards_after_forward(dims.pp))
    materialize(module, device)

