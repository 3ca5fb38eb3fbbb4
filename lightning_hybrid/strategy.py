"""``HybridParallelStrategy``: tensor x pipeline x data parallel training in a Lightning Trainer.

Lightning's hooks only; each calls the modules that do the work: :mod:`lightning_hybrid.distributed`
(sizes and mesh, the parallelize sequence, the pipeline, clipping), :mod:`lightning_hybrid.checkpoint`
(sharded save and load) and :mod:`lightning_hybrid.data.sampler` (the resumable sampler).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid.checkpoint import sharded
from lightning_hybrid.data.sampler import batch_size_of, data_position, resumable_dataloader
from lightning_hybrid.distributed.auto_layout import auto_fields, check_request, resolve_auto
from lightning_hybrid.distributed.clip_grad import use_global_norm_clipping
from lightning_hybrid.distributed.context_parallel import shard_batch
from lightning_hybrid.distributed.data_parallel import all_reducing, torch_dtype
from lightning_hybrid.distributed.declared import declared_model, parallelize_declared
from lightning_hybrid.distributed.elastic import init_round_process_group
from lightning_hybrid.distributed.exit_report import report_exits
from lightning_hybrid.distributed.fault_tolerance import (
    ReplicaGroups,
    check_fault_tolerance,
    data_share,
    join_replica_groups,
)
from lightning_hybrid.distributed.float8 import precompute_float8_scales
from lightning_hybrid.distributed.heartbeat import HANG_TIMEOUT, attach_hang_detector, check_hang_timeout
from lightning_hybrid.distributed.materialize import move_buffers
from lightning_hybrid.distributed.mesh import build_mesh, checkpoint_groups, lightning_mesh
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.parallelize import check_device_options
from lightning_hybrid.distributed.pipeline.runner import PipelineRunner, report_bubble
from lightning_hybrid.distributed.pipeline.schedules import PP_SCHEDULES
from lightning_hybrid.distributed.self_parallel import DataParallelReplicas, replicate_unsynchronized
from lightning_hybrid.distributed.step_guard import StepGuard
from lightning_hybrid.distributed.tensor_parallel import full_vocabulary
from lightning_hybrid.models.spec import ParallelSpec, declared_spec
from lightning_hybrid.preflight.links import PREFLIGHT_MAX_BYTES, run_preflight_or_raise

__all__ = ["HybridParallelStrategy", "PP_SCHEDULES"]

class HybridParallelStrategy(ModelParallelStrategy):
    """Tensor, pipeline, data and context parallelism combined on PyTorch's native stack.

    The mesh is ``("pp", "dp", "cp", "tp")``, TP innermost. A LightningModule that declares its model
    (``parallel_spec()``, like :class:`~lightning_hybrid.models.CausalLM`) is built by the strategy: parallelized,
    materialized from the meta device, initialized mesh-independently. One whose ``configure_model`` parallelizes
    itself (for Lightning's ``ModelParallelStrategy``) keeps working with ``pp=1`` on Lightning's 2-D mesh; what it
    leaves unsynchronized over dp is replicated. Bare: tp=1, dp=world (self-parallelizing: tp, dp = devices, nodes).

    Args:
        tp: tensor-parallel size; keep it within a node. ``"auto"`` here and in the seven options below: planned.
        pp: pipeline-parallel size.
        dp: data-parallel size; ``None`` infers ``world_size // (tp * pp)``.
        data_parallel: ``"fsdp"`` (FSDP2, ZeRO-3 over ``dp``), ``"hsdp"`` or ``"replicate"`` (gradients all-reduced).
        sequence_parallel: shard norms and residuals over the sequence inside a TP group.
        pp_schedule: a schedule of ``torch.distributed.pipelining`` (see ``PP_SCHEDULES``), case-insensitive.
        microbatches: micro-batches per pipeline step; ``None`` picks ``2 * pp * virtual_stages``.
        virtual_stages: pipeline stages per rank (interleaved and zero-bubble schedules need 2 or more).
        pp_split_points: block names where a stage starts (``["layers.40"]``), or blocks per stage; None: balanced.
        activation_checkpointing: ``"none"``, ``"selective"`` or ``"full"``; and ``selective_ac``: what ``"selective"``
            recomputes, ``"op"``, ``"attention"`` or every k-th block (see :mod:`~.distributed.activation_checkpoint`).
        compile: ``torch.compile`` each block (after TP and recompute, before FSDP).
        reduce_dtype: ``"fp32"`` or ``"bf16"``: dtype of the gradient reduction over ``dp``; ``None``: fp32 under
            bf16 precision (``"bf16-mixed"`` keeps fp32 master weights, ``"bf16-true"`` bf16 ones), else the grads'.
        preflight: run the network preflight on the training mesh before the model is built.
        save_distributed_checkpoint: each rank writes its shards (``True``) or rank 0 a full file.
        process_group_backend: ``"nccl"``/``"gloo"``; ``None`` chooses by device.
        timeout: timeout of collectives; a dead peer ends the run with a timeout error instead of a hang.
        hang_timeout: seconds without progress after which every rank exits naming the hung rank (600; None: off).
        data_parallel_size, tensor_parallel_size: Lightning's names of dp, tp; ``"auto"``: nodes, devices per node.
        cp: context-parallel size (sequences split, ring attention); ``dp_shard``: HSDP's shard group (``"hsdp"``);
            ``ep``: expert-parallel size, carved from dp (the experts split, see docs/moe.md).
        loss_parallel, bf16_compute_weights, fsdp_reshard_after_forward, async_tp: see docs/performance.md.
        float8: ``None``, ``"tensorwise"``, ``"rowwise"`` or ``"mxfp8"``: float8 block linears (:mod:`~.float8`).
        fault_tolerance, min_replica_groups, ft_timeout: ``"torchft"``: this launch is one replica group of a torchft
            job (see :mod:`~.distributed.fault_tolerance`); the fewest groups a step commits with; cross-group timeout.

    Raises:
        ValueError: an argument has an unknown value (on construction, on every rank), or the sizes do not
            fit the world size or the model (in ``setup_environment``, before any collective).
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        tp: Union[int, Literal["auto"]] = 1,
        pp: Union[int, Literal["auto"]] = 1,
        dp: Optional[Union[int, Literal["auto"]]] = None,
        data_parallel: str = "fsdp",
        sequence_parallel: bool = False,
        pp_schedule: str = "1f1b",
        microbatches: Optional[Union[int, Literal["auto"]]] = None,
        virtual_stages: Union[int, Literal["auto"]] = 1,
        pp_split_points: Optional[Union[list[str], list[int]]] = None,
        activation_checkpointing: str = "none",
        selective_ac: Union[str, int] = "op",
        compile: bool = False,
        reduce_dtype: Optional[str] = None,
        preflight: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        hang_timeout: Optional[float] = HANG_TIMEOUT,
        data_parallel_size: Optional[Union[int, Literal["auto"]]] = None,
        tensor_parallel_size: Optional[Union[int, Literal["auto"]]] = None,
        cp: int = 1, dp_shard: Optional[int] = None, ep: int = 1, loss_parallel: bool = True, async_tp: bool = False,
        bf16_compute_weights: bool = True, fsdp_reshard_after_forward: Union[bool, Literal["auto"]] = "auto",
        float8: Optional[str] = None,
        fault_tolerance: Optional[str] = None, min_replica_groups: int = 1, ft_timeout: float = 60.0,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size="auto",
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.options = ParallelOptions(**{name: value for name, value in locals().items()  # every layout argument
                                          if name in ParallelOptions.__dataclass_fields__})
        self.preflight = bool(preflight)
        self.replica_group_env, self.ft_timeout = check_fault_tolerance(fault_tolerance, min_replica_groups, ft_timeout)
        self.replica_groups: Optional[ReplicaGroups] = None  # torchft; after training its per-step history below
        self.replica_group_history, self.healed_from_peer = [], False  # healed: no auto-resume from disk
        self.hang_timeout = check_hang_timeout(hang_timeout)
        self._dims: Optional[ParallelDims] = None
        self._spec: Optional[ParallelSpec] = None
        self.pipeline: Optional[PipelineRunner] = None
        self._parallelized: Optional[torch.nn.Module] = None
        self.checkpoint_group, self.background_checkpoint_group = None, None  # gloo groups for checkpoint I/O
        self.per_rank_batch_size: Optional[int] = None
        self.resume_position: Optional[dict[str, int]] = None
        self.train_sampler, self.bubble_report = None, None  # the resumable sampler; the pipeline's bubble report
        self.step_guard = StepGuard()
        self.auto_plan: Optional[Any] = None  # the planner's decision when an option is "auto"
        self.weight_casts, self._loss_parallel = None, False  # bf16 copies made once per step, loss on shards
        self._replicas: Optional[DataParallelReplicas] = None  # a self-parallelizing module's unsynchronized params

    @property
    def dims(self) -> ParallelDims:
        """The resolved (tp, pp, dp) sizes; available from ``setup_environment`` on."""
        if self._dims is None:
            raise RuntimeError("the parallel sizes are resolved in setup_environment(); the Trainer calls it")
        return self._dims

    def declared_model_runner(self) -> Optional[PipelineRunner]:
        """The pipeline runner or ``None`` (pp=1); its presence tells a declared module the strategy builds it."""
        return self.pipeline

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # TP and PP peers see the same samples; only the dp coordinate (and a torchft replica group) selects a slice.
        return data_share(self.replica_group_env, self.dims.dp, self.dims.coordinates(self.global_rank)["dp"])

    @property
    def _precision(self) -> str:  # the Trainer's precision flag, "32-true" where the plugin has none
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def _validate(self) -> None:
        """All size checks that need no collective; identical on every rank, so every rank raises alike."""
        self._spec = declared_spec(self.lightning_module)
        check_device_options(self.options, self.root_device, self._get_process_group_backend())
        # None: "auto", planned once the process group exists
        self._dims = check_request(self, self._spec, self._precision, rank_zero_info)

    @override
    def setup_environment(self) -> None:
        report_exits(self)  # a user error or a lost peer ends a worker with one line, not a traceback per rank
        self._validate()
        init_round_process_group(self._get_process_group_backend(), self._timeout, self.root_device)
        self._setup_distributed()
        if auto_fields(self.options):
            self.options, self._dims, self.auto_plan = resolve_auto(self, self._spec, self._precision, self._timeout)
        self._device_mesh = build_mesh(self.dims, self.root_device.type, self._timeout)
        self.checkpoint_group, self.background_checkpoint_group = checkpoint_groups(self._timeout)
        attach_hang_detector(self.lightning_module.trainer, self.hang_timeout, self.global_rank, self.world_size,
                             self.dims.coordinates(self.global_rank))
        if self.preflight:
            run_preflight_or_raise(self.device_mesh, PREFLIGHT_MAX_BYTES[self.root_device.type])
        assert self.lightning_module is not None
        # A module that parallelizes itself gets Lightning's 2-D mesh (pp=1); a declared one the 3-D mesh.
        self.lightning_module._device_mesh = self._device_mesh if self._spec is not None else lightning_mesh(
            self._device_mesh, self.dims, self.root_device.type, self._timeout)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if self._spec is None:
            # The LightningModule parallelized itself in configure_model (ModelParallelStrategy style); what it left
            # unsynchronized over dp is replicated (see distributed/self_parallel.py).
            super().setup(trainer)
            self._replicas = replicate_unsynchronized(self.model, self.lightning_module, self._dims, rank_zero_info)
            return None
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        model = declared_model(self.lightning_module)
        if model is not self._parallelized:  # a validate/test/predict after fit reuses the model built for fit
            built = parallelize_declared(self, model, self._spec, self._precision)  # or this rank's stages
            self.pipeline, self.weight_casts, self._loss_parallel = built  # what it made (a Parallelized)
            self._parallelized = self.lightning_module.model
        if self.pipeline is not None:
            self.pipeline.grad_scale = 1.0 / max(1, trainer.accumulate_grad_batches)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        use_global_norm_clipping(self.precision_plugin, self.world_size // self.dims.pp)
        if self.replica_group_env is not None and trainer.state.fn == TrainerFn.FITTING:  # behind a live group: heals
            joined = join_replica_groups(self, trainer, self._get_process_group_backend(), self._timeout, self.pipeline)
            self.replica_groups, self.healed_from_peer = joined.groups, joined.healed_from_peer
            self.resume_position = joined.resume_position if joined.healed_from_peer else self.resume_position

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Lightning's reduce; in a torchft replica group's training step then averaged over the groups in it."""
        result = super().reduce(tensor, group=group, reduce_op=reduce_op)
        if self.replica_groups is None or group is not None:
            return result
        return self.replica_groups.average_in_step(result)

    @override
    def model_to_device(self) -> None:  # a declared model is on its device already: only leftover buffers move
        if self._spec is None:
            return super().model_to_device()
        move_buffers(self.model, self.root_device)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The pipeline schedule already ran backward inside training_step; only fire the hooks.
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None, **kwargs: Any) -> Any:
        reduce_dtype = torch_dtype(self.options.reduction_dtype(self._precision))
        if self._spec is not None and self.options.replicates_gradients(self.dims):
            closure = all_reducing(closure, self.lightning_module.model, self.device_mesh["dp_cp"].get_group(),
                                   self.dims.data_ranks, reduce_dtype)
        if self._replicas is not None:
            closure = self._replicas.all_reducing(closure, reduce_dtype)
        if self.replica_groups is not None:  # gradients averaged over the groups, then torchft's commit verdict
            closure = self.replica_groups.committing(closure, self.lightning_module, self.step_guard)
        with self.step_guard.guarding(optimizer):
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.options.float8 == "tensorwise":  # the float8 scales of the updated FSDP2 shards, one all-reduce
            precompute_float8_scales(self.lightning_module.model)
        if self.pipeline is not None:
            # Gradients of the next step accumulate from zero inside the schedule (Lightning's own zero_grad
            # runs after training_step, which is too late for a pipeline; CausalLM skips it).
            optimizer.zero_grad(set_to_none=True)
        return result

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:  # under loss parallel: full logits from the shards
        return full_vocabulary(super().predict_step(*args, **kwargs), self.device_mesh, self._loss_parallel)

    def skip_next_optimizer_step(self) -> None:
        """Compute this step's gradients but apply nothing (weights and optimizer state stay); every rank must ask."""
        self.step_guard.skip_next()

    def enable_step_skips(self) -> None:
        """Guard every optimizer step from now on, so that :meth:`skip_next_optimizer_step` can skip one."""
        self.step_guard.active = True

    @override
    def on_train_end(self) -> None:
        if self.replica_groups is not None:
            self.replica_group_history, self.replica_groups = self.replica_groups.shutdown(), None
        if self.pipeline is not None:
            self.bubble_report = report_bubble(self.pipeline, self.options, self.dims, self.global_rank)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Only the data position needs it: a batch without tensors (strings) takes the DataLoader's batch_size.
        self.per_rank_batch_size = batch_size_of(batch, self.lightning_module.trainer.train_dataloader)
        super().on_train_batch_start(batch, batch_idx)
        if self.replica_groups is not None:
            self.replica_groups.begin_batch()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give a distributed DataLoader a sampler that resumes mid-epoch, on any number of DP ranks."""
        dataloader, sampler, resumed = resumable_dataloader(dataloader, self.resume_position)
        if resumed:
            self.resume_position = None
        if sampler is not None:
            self.train_sampler = sampler
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        return shard_batch(super().batch_to_device(batch, device, dataloader_idx), self)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:  # a declared model's shards: the checkpoint writer's
        return super().lightning_module_state_dict() if self._spec is None else {}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return super().optimizer_state(optimizer) if self._spec is None else {}

    def checkpoint_context(self) -> sharded.CheckpointContext:
        """What the checkpoint writer and loader need of this job (a :class:`~.sharded.CheckpointContext`)."""
        dims, module, data_ranks = self.dims, self.lightning_module, self.distributed_sampler_kwargs["num_replicas"]
        position = data_position(module._trainer, self.per_rank_batch_size, data_ranks, self.train_sampler)
        return sharded.CheckpointContext(module, list(self.optimizers), self.global_rank, self.world_size,
                                         self.checkpoint_group, self.background_checkpoint_group,
                                         self.options.layout(dims), position)

    def begin_save(self, checkpoint: dict[str, Any], folder: Any, async_save: bool) -> sharded.ShardedSave:
        """Start writing a sharded checkpoint of a declared model (see :mod:`lightning_hybrid.checkpoint.sharded`)."""
        return sharded.begin_save(self.checkpoint_context(), checkpoint, folder, async_save)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self._spec is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("HybridParallelStrategy.save_checkpoint(..., storage_options=...) is not supported")
        self.begin_save(checkpoint, self.broadcast(str(filepath)), async_save=False).finish()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self._spec is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        state = sharded.load(self.checkpoint_context(), self.broadcast(str(checkpoint_path)))
        self.resume_position = state.get("hybrid", {}).get("data_position")
        return state

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Tensor x pipeline x data parallel")


if "hybrid" not in StrategyRegistry:
    HybridParallelStrategy.register_strategies(StrategyRegistry)
