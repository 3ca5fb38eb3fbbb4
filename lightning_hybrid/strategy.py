"""``HybridParallelStrategy``: tensor x pipeline x data parallel training in a Lightning Trainer."""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_hybrid.clipping import clip_grad_norm_global
from lightning_hybrid.data_parallel import DATA_PARALLEL_MODES, all_reduce_gradients, apply_fsdp
from lightning_hybrid.initialization import init_parameters
from lightning_hybrid.mesh import ParallelDims, build_mesh
from lightning_hybrid.models.spec import ParallelSpec
from lightning_hybrid.pipeline import (ZERO_BUBBLE, PipelineRunner, StageTimer, build_stages, plan_stages,
                                       stage_ids_for_rank, theoretical_bubble, validate_schedule)
from lightning_hybrid.recompute import (ACTIVATION_CHECKPOINTING, apply_activation_checkpointing, compile_blocks,
                                        resolve_selective)
from lightning_hybrid.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HybridParallelStrategy", "PP_SCHEDULES", "ACTIVATION_CHECKPOINTING"]

# Names accepted by `pp_schedule` (case-insensitive) -> name for torch.distributed.pipelining.get_schedule_class.
PP_SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
DECLARED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
REDUCE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _choice(name: str, value: Any, choices: Any) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}")
    return value.lower()


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (" or None" if allow_none else ""))


class HybridParallelStrategy(ModelParallelStrategy):
    """Tensor, pipeline and data parallelism combined on PyTorch's native stack.

    The mesh is ``("pp", "dp", "tp")`` with TP innermost. A LightningModule that declares its model
    (``parallel_spec()`` and a ``model`` with the parts it names, like
    :class:`~lightning_hybrid.models.CausalLM`) is parallelized by the strategy: TP plan, then FSDP2
    or replication over ``dp``, then materialized from the meta device with mesh-independent
    initialization. A LightningModule whose ``configure_model`` parallelizes itself, written for
    Lightning's ``ModelParallelStrategy``, keeps working with ``pp=1``: its ``device_mesh`` answers to
    ``"data_parallel"`` and ``"tensor_parallel"`` too.

    Args:
        tp: tensor-parallel size; keep it within a node.
        pp: pipeline-parallel size.
        dp: data-parallel size; ``None`` infers ``world_size // (tp * pp)``.
        data_parallel: ``"fsdp"`` (FSDP2, ZeRO-3 sharding over ``dp``) or ``"replicate"`` (full copies,
            gradients all-reduced).
        sequence_parallel: shard norms and residuals over the sequence inside a TP group.
        pp_schedule: a schedule of ``torch.distributed.pipelining`` (see ``PP_SCHEDULES``), case-insensitive.
        microbatches: micro-batches per pipeline step; ``None`` picks ``2 * pp * virtual_stages``.
        virtual_stages: pipeline stages per rank (interleaved and zero-bubble schedules need 2 or more).
        pp_split_points: explicit stage boundaries: block names where a stage starts (``["layers.40"]``) or
            a list of block counts per stage; ``None`` balances by cost.
        activation_checkpointing: ``"none"``, ``"selective"`` or ``"full"`` (every block keeps only its input
            and is re-run in backward); see :mod:`lightning_hybrid.recompute`.
        selective_ac: what ``"selective"`` recomputes: ``"op"`` (every block; matmul, attention and collective
            outputs are kept, norms, rotary and activations recomputed), ``"attention"`` (the attention of
            every block) or an integer ``k`` (every k-th block in full).
        compile: ``torch.compile`` each block (after TP and recompute, before FSDP).
        reduce_dtype: ``"fp32"`` or ``"bf16"``: dtype of the gradient reduction over ``dp`` (FSDP reduce-scatter
            or the replicate all-reduce). ``None``: fp32 under bf16 precision, else the gradients' dtype.
            With Lightning's ``precision="bf16-mixed"`` the weights stay fp32 (the optimizer's master copy)
            and compute runs in bf16 (FSDP2 gathers bf16 weights; autocast elsewhere); ``"bf16-true"``
            stores the weights in bf16.
        preflight: run the network preflight on the training mesh before the model is built.
        save_distributed_checkpoint: each rank writes its shards (``True``) or rank 0 a full file.
        process_group_backend: ``"nccl"``/``"gloo"``; ``None`` chooses by device.
        timeout: timeout of collectives; a dead peer ends the run with a timeout error instead of a hang.

    Raises:
        ValueError: an argument has an unknown value (on construction, on every rank), or the sizes do not
            fit the world size or the model (in ``setup_environment``, before any collective).
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        dp: Optional[int] = None,
        data_parallel: str = "fsdp",
        sequence_parallel: bool = False,
        pp_schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        virtual_stages: int = 1,
        pp_split_points: Optional[Union[list[str], list[int]]] = None,
        activation_checkpointing: str = "none",
        selective_ac: Union[str, int] = "op",
        compile: bool = False,
        reduce_dtype: Optional[str] = None,
        preflight: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size="auto",
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        _positive_int("tp", tp)
        _positive_int("pp", pp)
        _positive_int("dp", dp, allow_none=True)
        _positive_int("virtual_stages", virtual_stages)
        _positive_int("microbatches", microbatches, allow_none=True)
        self.tp, self.pp, self.dp = tp, pp, dp
        self.data_parallel = _choice("data_parallel", data_parallel, DATA_PARALLEL_MODES)
        self.sequence_parallel = bool(sequence_parallel)
        self.pp_schedule = _choice("pp_schedule", pp_schedule, PP_SCHEDULES)
        self.microbatches = microbatches
        self.virtual_stages = virtual_stages
        self.pp_split_points = pp_split_points
        self.activation_checkpointing = _choice("activation_checkpointing", activation_checkpointing,
                                                ACTIVATION_CHECKPOINTING)
        self.selective_ac = resolve_selective(selective_ac)
        self.compile = bool(compile)
        if reduce_dtype is not None:
            _choice("reduce_dtype", reduce_dtype, REDUCE_DTYPES)
        self.reduce_dtype = reduce_dtype
        self.preflight = bool(preflight)
        self._dims: Optional[ParallelDims] = None
        self._spec: Optional[ParallelSpec] = None
        self.pipeline: Optional[PipelineRunner] = None
        self._parallelized: Optional[torch.nn.Module] = None
        self.checkpoint_group: Optional[Any] = None
        self.background_checkpoint_group: Optional[Any] = None
        self.per_rank_batch_size: Optional[int] = None
        self.resume_position: Optional[dict[str, int]] = None
        self.train_sampler: Optional[Any] = None

    # ------------------------------------------------------------------ environment and mesh

    @property
    def dims(self) -> ParallelDims:
        """The resolved (tp, pp, dp) sizes; available from ``setup_environment`` on."""
        if self._dims is None:
            raise RuntimeError("the parallel sizes are resolved in setup_environment(); the Trainer calls it")
        return self._dims

    @property
    def materializes_declared_model(self) -> bool:
        """True: a declared model may be built on the meta device; this strategy shards and initializes it."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # TP and PP peers see the same samples; only the dp coordinate selects a slice.
        coords = self.dims.coordinates(self.global_rank)
        return {"num_replicas": self.dims.dp, "rank": coords["dp"]}

    def _declared_spec(self) -> Optional[ParallelSpec]:
        module = self.lightning_module
        spec_fn = getattr(module, "parallel_spec", None)
        return spec_fn() if callable(spec_fn) else None

    def _validate(self) -> None:
        """All size checks that need no collective; identical on every rank, so every rank raises alike."""
        world_size = self.num_nodes * self.num_processes
        self._dims = ParallelDims.resolve(self.tp, self.pp, self.dp, world_size,
                                          devices_per_node=self.num_processes if self.num_nodes > 1 else None)
        self._spec = self._declared_spec()
        if self._spec is not None and self._precision not in DECLARED_PRECISIONS:
            raise ValueError(f"precision={self._precision!r} is not supported for a declared model; "
                             f"use one of {DECLARED_PRECISIONS}")
        if self._spec is None and (self.activation_checkpointing != "none" or self.compile):
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r}/compile={self.compile} "
                             f"need a LightningModule that declares its blocks (parallel_spec()); a module that "
                             f"parallelizes itself applies them in its own configure_model")
        if self.compile and self._dims.tp > 1 and (self.sequence_parallel or self.activation_checkpointing != "none"):
            raise ValueError(
                f"compile=True with tp={self._dims.tp} and sequence_parallel={self.sequence_parallel}, "
                f"activation_checkpointing={self.activation_checkpointing!r} trains with wrong gradients on torch "
                f"{torch.__version__} (measured in lightning-hybrid's equivalence tests); with tp>1 use compile=True "
                f"only without sequence_parallel and recompute, or compile=False"
            )
        if self._spec is not None:
            num_blocks = self.lightning_module.num_blocks()
            self._dims.check_model(self._spec.tp_divisible, num_blocks, self.virtual_stages)
        elif self.pp > 1:
            raise ValueError(
                f"pp={self.pp} needs a LightningModule that declares its model parts and loss "
                f"(parallel_spec(), num_blocks() and a `model` with loss_sum(); see lightning_hybrid.models.CausalLM); "
                f"{type(self.lightning_module).__name__} does not"
            )
        if self.pp > 1:
            validate_schedule(self.pp_schedule, self.pp, self.virtual_stages, self.num_microbatches)
            plan_stages(self._spec, self.lightning_module.num_blocks(), self.pp * self.virtual_stages,
                        self.pp_split_points)  # raises on split points that do not exist
        elif self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs pp>1; use virtual_stages=1")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline step: the given value, or ``2 * pp`` (``2 * pp * virtual_stages`` for V schedules)."""
        if self.microbatches is not None:
            return self.microbatches
        return 2 * self.pp * (self.virtual_stages if self.pp_schedule in ("zbv_zero_bubble", "dualpipev") else 1)

    @override
    def setup_environment(self) -> None:
        self._validate()
        self._setup_distributed()
        self._device_mesh = build_mesh(self.dims, self.root_device.type, self._timeout)
        # Checkpoint collectives get their own gloo groups: they may run while a background write is in flight and
        # must never queue behind (or ahead of) training collectives. The background writer (DCP's async save, in
        # another thread) gets a group of its own: two threads issuing collectives on one group can match them
        # across ranks in different orders and hang (the main thread meets on `checkpoint_group` at every step).
        import torch.distributed as dist

        self.checkpoint_group = dist.new_group(backend="gloo", timeout=self._timeout)
        self.background_checkpoint_group = dist.new_group(backend="gloo", timeout=self._timeout)
        if self.preflight:
            self._run_preflight()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _run_preflight(self) -> None:
        """Bandwidth of every mesh dimension, matmul speed and device health, on the training mesh itself.

        Raises:
            RuntimeError: on every rank, when a link or device is below threshold (the report names them).
        """
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        from lightning_hybrid.preflight import run_preflight

        report = run_preflight(self.device_mesh, max_bytes=4 << 20 if self.root_device.type == "cpu" else 64 << 20)
        rank_zero_info(report.format_table())
        if not report.ok:
            raise RuntimeError("preflight failed: " + "; ".join(report.failures))

    @property
    def mesh(self) -> "DeviceMesh":
        return self.device_mesh

    # ------------------------------------------------------------------ model setup

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if self._spec is None:
            # The LightningModule parallelized itself in configure_model (ModelParallelStrategy style).
            return super().setup(trainer)
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not is_overridden("configure_model", self.lightning_module):
            raise TypeError(f"{type(self.lightning_module).__name__} declares parallel_spec() but does not build "
                            f"its model in configure_model()")
        model = self.lightning_module.model
        if model is None:
            raise TypeError(f"{type(self.lightning_module).__name__}.configure_model() did not set `self.model`")
        if model is not self._parallelized:
            # Not yet sharded (a validate/test/predict after fit reuses the model built for fit).
            if self.dims.pp > 1:
                self._build_pipeline(model, self._spec, trainer)
            else:
                self._parallelize(model, self._spec)
            self._parallelized = self.lightning_module.model
        elif self.pipeline is not None:
            self.pipeline.grad_scale = 1.0 / max(1, trainer.accumulate_grad_batches)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning's clipping calls torch's clip_grad_norm_ per rank; clip by the global norm instead.
        self.precision_plugin.clip_grad_by_norm = functools.partial(self._clip_by_global_norm)

    def _parallelize(self, model: torch.nn.Module, spec: ParallelSpec) -> None:
        """TP, then FSDP or replication, then materialization and mesh-independent initialization."""
        dims, mesh = self.dims, self.device_mesh
        already_built = not any(p.is_meta for p in model.parameters())
        if already_built:
            raise ValueError(f"{type(self.lightning_module).__name__}.configure_model() built real weights; "
                             f"build the declared model on the meta device so the strategy can shard it first")
        self.precision_plugin.convert_module(model)  # bf16-true: bf16 storage (cheap on meta, before sharding)
        if dims.tp > 1:
            apply_tensor_parallel(model, spec, mesh["tp"], self.sequence_parallel)
        self._recompute_and_compile(model, spec)
        if dims.dp > 1 and self.data_parallel == "fsdp":
            apply_fsdp(model, getattr(model, spec.blocks), mesh["dp"], param_dtype=self._param_dtype(),
                       reduce_dtype=self._reduce_dtype())
        model.to_empty(device=self.root_device)
        seed = self.broadcast(self.lightning_module.init_seed())
        self._initialize(model, model, seed)

    def _shard_stage(self, stage: torch.nn.Module, spec: ParallelSpec) -> None:
        dims, mesh = self.dims, self.device_mesh
        self.precision_plugin.convert_module(stage)
        if dims.tp > 1:
            apply_tensor_parallel(stage, spec, mesh["tp"], self.sequence_parallel)
        self._recompute_and_compile(stage, spec)
        if dims.dp > 1 and self.data_parallel == "fsdp":
            # Zero-bubble schedules run the weight-gradient pass separately and need the gathered weights.
            apply_fsdp(stage, getattr(stage, spec.blocks), mesh["dp"], param_dtype=self._param_dtype(),
                       reduce_dtype=self._reduce_dtype(), reshard_after_forward=self.pp_schedule not in ZERO_BUBBLE)

    def _recompute_and_compile(self, model: torch.nn.Module, spec: ParallelSpec) -> None:
        blocks = getattr(model, spec.blocks, None)
        if blocks is None or len(blocks) == 0:
            return
        apply_activation_checkpointing(blocks, self.activation_checkpointing, self.selective_ac,
                                       spec.block_attention)
        if self.compile:
            compile_blocks(blocks, parts=spec.block_norm_consumers if self.dims.tp > 1 else None)

    def _build_pipeline(self, model: torch.nn.Module, spec: ParallelSpec, trainer: "pl.Trainer") -> None:
        """Split into stages, shard each, materialize, and build the schedule and its runner."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        dims, mesh = self.dims, self.device_mesh
        if not any(p.is_meta for p in model.parameters()):
            raise ValueError(f"{type(self.lightning_module).__name__}.configure_model() built real weights; "
                             f"build the declared model on the meta device so the strategy can split it first")
        num_stages = dims.pp * self.virtual_stages
        plans = plan_stages(spec, self.lightning_module.num_blocks(), num_stages, self.pp_split_points)
        pp_rank = dims.coordinates(self.global_rank)["pp"]
        stage_ids = stage_ids_for_rank(pp_rank, dims.pp, self.virtual_stages, self.pp_schedule)
        container, modules = build_stages(model, spec, plans, stage_ids)
        for module in modules:
            self._shard_stage(module, spec)
            module.to_empty(device=self.root_device)
        seed = self.broadcast(self.lightning_module.init_seed())
        self._initialize(container, model, seed)
        self.lightning_module.model = container
        self.stage_plans = plans
        pp_group = mesh["pp"].get_group()
        stages = [PipelineStage(m, stage_index=i, num_stages=num_stages, device=self.root_device, group=pp_group)
                  for m, i in zip(modules, stage_ids)]
        timer = StageTimer(self.root_device)
        for stage in stages:
            timer.wrap(stage)
        schedule_cls = get_schedule_class(PP_SCHEDULES[self.pp_schedule])
        last_pp_rank = 0 if self.pp_schedule in ("zbv_zero_bubble", "dualpipev") else dims.pp - 1
        runner = PipelineRunner(None, stages, model.loss_sum, pp_group,
                                mesh["dp"].get_group() if dims.dp > 1 else None, last_pp_rank, dims.dp,
                                self.num_microbatches, self.pp_schedule, timer)
        first = stages[0] if issubclass(schedule_cls, PipelineScheduleSingle) else stages
        runner.schedule = schedule_cls(first, n_microbatches=self.num_microbatches, loss_fn=runner.loss_fn,
                                       scale_grads=False)
        runner.grad_scale = 1.0 / max(1, trainer.accumulate_grad_batches)
        self.pipeline = runner

    def _initialize(self, target: torch.nn.Module, declared: torch.nn.Module, seed: int) -> None:
        """Fill the materialized shards: the LightningModule's ``initialize_parameters(model, seed)`` if it has one
        (CausalLM loads pretrained weights there), else the mesh-independent random initialization."""
        hook = getattr(self.lightning_module, "initialize_parameters", None)
        if callable(hook):
            hook(target, seed)
        else:
            init_parameters(target, seed, declared.parameter_init)

    @property
    def _precision(self) -> str:
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def _param_dtype(self) -> Optional[torch.dtype]:
        """Compute dtype of FSDP2's gathered weights: bf16 under ``bf16-mixed`` (the shards stay fp32)."""
        return torch.bfloat16 if self._precision == "bf16-mixed" else None

    def _reduce_dtype(self) -> Optional[torch.dtype]:
        """Gradient reduction dtype over ``dp``: the given one, fp32 under bf16 precision, else the gradients'."""
        if self.reduce_dtype is not None:
            return REDUCE_DTYPES[_choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)]
        return torch.float32 if self._precision.startswith("bf16") else None

    @override
    def model_to_device(self) -> None:
        # A declared model was materialized on the right device already; only move leftover buffers.
        assert self.model is not None
        if self._spec is None:
            return super().model_to_device()
        for module in self.model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != self.root_device:
                    module._buffers[key] = buf.to(self.root_device)

    # ------------------------------------------------------------------ training loop hooks

    @property
    def _replicated_dp(self) -> bool:
        return self._dims is not None and self._spec is not None and self.dims.dp > 1 and self.data_parallel == "replicate"

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The pipeline schedule already ran backward inside training_step; only fire the hooks.
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None, **kwargs: Any) -> Any:
        if self._replicated_dp:
            # Average replicated gradients once per optimizer step, before clipping sees them.
            inner = closure

            def closure() -> Any:  # noqa: F811 - wraps Lightning's closure
                result = inner()
                all_reduce_gradients(self.lightning_module.model.parameters(),
                                     self.device_mesh["dp"].get_group(), self.dims.dp, self._reduce_dtype())
                return result

        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.pipeline is not None:
            # Gradients of the next step accumulate from zero inside the schedule (Lightning's own zero_grad
            # runs after training_step, which is too late for a pipeline; CausalLM skips it).
            optimizer.zero_grad(set_to_none=True)
        return result

    @override
    def on_train_end(self) -> None:
        if self.pipeline is not None:
            self._report_bubble()

    def _report_bubble(self) -> None:
        """Log, on global rank 0, each stage's measured idle fraction next to the schedule's theoretical bubble."""
        import torch.distributed as dist

        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        timer = self.pipeline.timer
        mine = {"pp_rank": self.dims.coordinates(self.global_rank)["pp"], "idle": timer.idle_fraction}
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        per_stage: dict[int, list[float]] = {}
        for item in gathered:
            if item["idle"] is not None:
                per_stage.setdefault(item["pp_rank"], []).append(item["idle"])
        theory = theoretical_bubble(self.pp_schedule, self.dims.pp, self.num_microbatches, self.virtual_stages)
        measured = ", ".join(f"rank {r}: {100 * sum(v) / len(v):.1f}%" for r, v in sorted(per_stage.items()))
        self.bubble_report = {"theoretical": theory,
                              "measured": {r: sum(v) / len(v) for r, v in per_stage.items()}}
        rank_zero_info(f"pipeline bubble ({self.pp_schedule}, pp={self.dims.pp}, microbatches={self.num_microbatches}, "
                       f"virtual_stages={self.virtual_stages}): measured idle {measured}; theoretical {100 * theory:.1f}%")

    def _clip_by_global_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_global(params, float(clip_val), self.world_size // self.dims.pp)

    # ------------------------------------------------------------------ data position and checkpoints

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        from lightning.pytorch.utilities.data import extract_batch_size

        self.per_rank_batch_size = extract_batch_size(batch)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give a distributed DataLoader a sampler that resumes mid-epoch, on any number of DP ranks."""
        from torch.utils.data import DataLoader, DistributedSampler

        from lightning.pytorch.trainer.states import RunningStage
        from lightning.pytorch.utilities.data import _update_dataloader

        from lightning_hybrid.data.sampler import ResumableDistributedSampler

        if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not DistributedSampler:
            return dataloader
        old = dataloader.sampler
        resume = self.resume_position if old.shuffle else None
        # A resumed run keeps the permutation of the run it continues, whatever seed it was started with.
        seed = resume.get("seed", old.seed) if resume else old.seed
        sampler = ResumableDistributedSampler(old.dataset, num_replicas=old.num_replicas, rank=old.rank,
                                              shuffle=old.shuffle, seed=seed, drop_last=old.drop_last)
        if resume is not None:
            sampler.resume_from(resume["epoch"], resume["samples_in_epoch"])
            self.resume_position = None
        if old.shuffle:
            self.train_sampler = sampler
        return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING if old.shuffle else None)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._spec is None:
            return super().lightning_module_state_dict()
        return {}  # the sharded model state is collected by the checkpoint writer itself

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._spec is None:
            return super().optimizer_state(optimizer)
        return {}

    def begin_save(self, checkpoint: dict[str, Any], folder: Any, async_save: bool) -> Any:
        """Start writing a sharded checkpoint of a declared model (see ``lightning_hybrid.checkpoint.sharded``)."""
        from pathlib import Path

        from lightning_hybrid.checkpoint.sharded import begin_save

        return begin_save(self, checkpoint, Path(folder), async_save)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self._spec is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("HybridParallelStrategy.save_checkpoint(..., storage_options=...) is not supported")
        path = self.broadcast(str(filepath))
        self.begin_save(checkpoint, path, async_save=False).finish()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self._spec is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        from pathlib import Path

        from lightning_hybrid.checkpoint.sharded import load

        return load(self, Path(self.broadcast(str(checkpoint_path))))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Tensor x pipeline x data parallel")


if "hybrid" not in StrategyRegistry:
    HybridParallelStrategy.register_strategies(StrategyRegistry)
