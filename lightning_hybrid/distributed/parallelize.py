"""The one parallelize sequence, and the parallel options it follows.

A declared model (or one pipeline stage of it) is parallelized in a fixed order, the same as
torchtitan's: float8 conversion of the block linears, tensor parallelism, then activation recompute and
``torch.compile`` per block, then FSDP2 over ``dp``, then materialization from the meta device.
:class:`ParallelOptions` holds what the user chose (validated on construction, so every rank raises alike
before any collective); :func:`check_options` checks it against the world and the model at setup, still before
any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from torch import nn

from lightning_hybrid.distributed.activation_checkpoint import (
    ACTIVATION_CHECKPOINTING,
    apply_activation_checkpointing,
    compile_blocks,
    resolve_selective,
)
from lightning_hybrid.distributed.context_parallel import context_parallel_error, install_context_parallel
from lightning_hybrid.distributed.data_parallel import (
    DATA_PARALLEL_MODES,
    StepWeightCasts,
    apply_fsdp,
    check_reshard_policy,
    reshard_after_forward,
    without_autocast,
)
from lightning_hybrid.distributed.default_mesh import bare_sizes, log_bare_layout
from lightning_hybrid.distributed.float8 import check_float8, convert_float8, float8_error, float8_tp_plan
from lightning_hybrid.distributed.materialize import materialize
from lightning_hybrid.distributed.parallel_dims import ParallelDims, data_mesh
from lightning_hybrid.distributed.pipeline.schedules import (
    PP_SCHEDULES,
    ZERO_BUBBLE,
    default_microbatches,
    validate_schedule,
)
from lightning_hybrid.distributed.pipeline.split import plan_stages
from lightning_hybrid.distributed.tensor_parallel import (
    apply_tensor_parallel,
    async_tp_error,
    backward_in_loss_parallel,
    enable_async_tp,
    vocab_parallel_loss,
)
from lightning_hybrid.models.spec import ParallelSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelOptions", "check_options", "parallelize", "require_meta", "compute_weights", "loss_function",
           "setup_runtime",
           "DECLARED_PRECISIONS",
           "REDUCE_DTYPES", "choice", "positive_int", "lightning_size", "AUTO", "AUTO_FIELDS"]

DECLARED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
# Options the strategy may leave to the planner (lightning_hybrid/planner/auto.py resolves them at setup).
AUTO = "auto"
AUTO_FIELDS = ("tp", "pp", "dp", "microbatches", "virtual_stages", "pp_schedule", "activation_checkpointing",
               "data_parallel")
REDUCE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def choice(name: str, value: Any, choices: Any) -> str:
    """``value`` lower-cased when it is one of ``choices``.

    Raises:
        ValueError: naming the value and the valid choices.
    """
    if not isinstance(value, str) or value.lower() not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}")
    return value.lower()


def positive_int(name: str, value: Any, allow_none: bool = False, allow_auto: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive ``int`` (or ``None``/``"auto"`` when allowed)."""
    if (value is None and allow_none) or (value == AUTO and allow_auto):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (" or None" if allow_none else "")
                         + (" or 'auto'" if allow_auto else ""))


def lightning_size(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a size as Lightning's ``ModelParallelStrategy`` takes it: a positive
    ``int`` or ``"auto"`` (or ``None``: not given)."""
    if value is None or value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer or 'auto'")


def _alias(name: str, value: Any, default: Any, alias: str, alias_value: Any) -> Any:
    """``value``, or the integer ``alias_value`` given under Lightning's name when ``value`` is left at ``default``.

    Raises:
        ValueError: both are given as integers and differ.
    """
    if not isinstance(alias_value, int):  # None (not given) or "auto" (resolved in check_options)
        return value
    if value != default and value != alias_value:
        raise ValueError(f"{name}={value} and {alias}={alias_value} disagree; give one of them ({alias} is "
                         f"Lightning's name for {name})")
    return alias_value


def _auto(name: str, value: Any, default: Any, alias: str, alias_value: Any, auto: int) -> Any:
    """``value``, or ``auto`` when the size was given as ``"auto"`` under Lightning's name.

    Raises:
        ValueError: ``value`` was given too (not left at ``default``) and differs from ``auto``.
    """
    if alias_value != "auto":
        return value
    if value != default and value != auto:
        raise ValueError(f"{name}={value} and {alias}='auto' (= {auto} here) disagree; give one of them")
    return auto


@dataclass
class ParallelOptions:
    """What the user chose for the parallel layout; see :class:`~lightning_hybrid.HybridParallelStrategy`.

    ``tensor_parallel_size`` and ``data_parallel_size`` are Lightning's names of ``tp`` and ``dp``: an integer
    given there is taken when ``tp``/``dp`` is left at its default (1, ``None``); ``"auto"`` is resolved at
    setup as Lightning does (:meth:`sizes`).

    Raises:
        ValueError: an unknown name, a size that is not a positive integer, or one size given under both names
            with different values (on construction).
    """

    tp: Union[int, Literal["auto"]] = 1
    pp: Union[int, Literal["auto"]] = 1
    dp: Optional[Union[int, Literal["auto"]]] = None
    data_parallel: str = "fsdp"
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    microbatches: Optional[Union[int, Literal["auto"]]] = None
    virtual_stages: Union[int, Literal["auto"]] = 1
    pp_split_points: Optional[Union[list[str], list[int]]] = None
    activation_checkpointing: str = "none"
    selective_ac: Union[str, int] = "op"
    compile: bool = False
    reduce_dtype: Optional[str] = None
    # Lightning's ModelParallelStrategy names for dp and tp; "auto" as there: dp = nodes, tp = devices per node.
    data_parallel_size: Optional[Union[int, Literal["auto"]]] = None
    tensor_parallel_size: Optional[Union[int, Literal["auto"]]] = None
    # Context parallelism (sequence split across cp ranks) and HSDP's shard-group size.
    cp: int = 1
    dp_shard: Optional[int] = None
    # Runtime features (docs/performance.md): vocabulary-parallel loss, bf16 weight copies under bf16-mixed, when
    # FSDP2 frees gathered weights, torch's micro-pipelined TP.
    loss_parallel: bool = True
    bf16_compute_weights: bool = True
    fsdp_reshard_after_forward: Union[bool, str] = AUTO
    async_tp: bool = False
    # Float8 training of the block linears through torchao (lightning_hybrid/distributed/float8.py).
    float8: Optional[str] = None

    def __post_init__(self) -> None:
        for name in AUTO_FIELDS:  # "auto" in any case; the planner resolves it at setup
            if isinstance(getattr(self, name), str) and getattr(self, name).lower() == AUTO:
                setattr(self, name, AUTO)
        for name in ("tp", "pp", "virtual_stages"):
            positive_int(name, getattr(self, name), allow_auto=True)
        positive_int("cp", self.cp)
        positive_int("dp", self.dp, allow_none=True, allow_auto=True)
        positive_int("dp_shard", self.dp_shard, allow_none=True)
        lightning_size("data_parallel_size", self.data_parallel_size)
        lightning_size("tensor_parallel_size", self.tensor_parallel_size)
        self.tp = _alias("tp", self.tp, 1, "tensor_parallel_size", self.tensor_parallel_size)
        self.dp = _alias("dp", self.dp, None, "data_parallel_size", self.data_parallel_size)
        positive_int("microbatches", self.microbatches, allow_none=True, allow_auto=True)
        self.data_parallel = choice("data_parallel", self.data_parallel, DATA_PARALLEL_MODES + (AUTO,))
        if (self.dp_shard is not None) != (self.data_parallel == "hsdp"):
            raise ValueError(f"data_parallel={self.data_parallel!r} with dp_shard={self.dp_shard!r}: HSDP needs both "
                             f"(data_parallel='hsdp', dp_shard=ranks per shard group), other modes neither")
        self.sequence_parallel = bool(self.sequence_parallel)
        self.pp_schedule = choice("pp_schedule", self.pp_schedule, tuple(PP_SCHEDULES) + (AUTO,))
        self.activation_checkpointing = choice("activation_checkpointing", self.activation_checkpointing,
                                               tuple(ACTIVATION_CHECKPOINTING) + (AUTO,))
        self.selective_ac = resolve_selective(self.selective_ac)
        self.compile = bool(self.compile)
        if self.reduce_dtype is not None:
            self.reduce_dtype = choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        for name in ("loss_parallel", "bf16_compute_weights", "async_tp"):
            setattr(self, name, bool(getattr(self, name)))
        self.fsdp_reshard_after_forward = check_reshard_policy(self.fsdp_reshard_after_forward)
        if self.async_tp:  # what can be checked without the device (checked again at setup with it)
            error = async_tp_error(self.compile, self.sequence_parallel, None,
                                   tp=self.tp if isinstance(self.tp, int) else None)
            if error:
                raise ValueError(error)
        self.float8 = check_float8(self.float8)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline step: the given value or the schedule's default."""
        if self.microbatches is not None:
            return self.microbatches
        return default_microbatches(self.pp_schedule, self.pp, self.virtual_stages)

    def sizes(self, world_size: int, devices_per_node: Optional[int],
              self_parallel: bool = False) -> tuple[int, Optional[int]]:
        """``(tp, dp)`` with Lightning's ``"auto"`` resolved: ``tensor_parallel_size="auto"`` is the devices per node,
        ``data_parallel_size="auto"`` the number of nodes (``devices_per_node=None``: one node). A module that
        parallelizes itself (``self_parallel``) under a bare strategy (:func:`bare_sizes`) gets both as ``"auto"``.

        Raises:
            ValueError: ``tp``/``dp`` was given too and differs from what ``"auto"`` means here.
        """
        per_node = devices_per_node or world_size
        if self_parallel and bare_sizes(self):
            return per_node, world_size // per_node
        tp = _auto("tp", self.tp, 1, "tensor_parallel_size", self.tensor_parallel_size, per_node)
        dp = _auto("dp", self.dp, None, "data_parallel_size", self.data_parallel_size, world_size // per_node)
        return tp, dp

    def layout(self, dims: ParallelDims) -> dict[str, Any]:
        """The layout a checkpoint records: sizes, data-parallel mode, stages per rank and schedule."""
        layout = {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "world_size": dims.world_size,
                  "data_parallel": self.data_parallel, "virtual_stages": self.virtual_stages,
                  "pp_schedule": self.pp_schedule, "microbatches": self.microbatches,
                  "activation_checkpointing": self.activation_checkpointing}
        if dims.cp > 1:
            layout["cp"] = dims.cp
        if dims.dp_replicate > 1:
            layout.update(dp_shard=dims.dp_shard, dp_replicate=dims.dp_replicate)
        return layout

    def param_dtype(self, precision: str) -> Optional[torch.dtype]:
        """Compute dtype of FSDP2's gathered weights: bf16 under ``bf16-mixed`` (the shards stay fp32)."""
        return torch.bfloat16 if precision == "bf16-mixed" else None

    def reduction_dtype(self, precision: str) -> Optional[torch.dtype]:
        """Gradient reduction dtype over ``dp``: the given one, fp32 under bf16 precision, else the gradients'."""
        if self.reduce_dtype is not None:
            return REDUCE_DTYPES[self.reduce_dtype]
        return torch.float32 if precision.startswith("bf16") else None


def check_options(options: ParallelOptions, world_size: int, devices_per_node: Optional[int],
                  spec: Optional[ParallelSpec], num_blocks: Optional[int], precision: str,
                  module_name: str, log: Optional[Callable[[str], Any]] = None) -> ParallelDims:
    """All checks of ``options`` against the world and the model that need no collective.

    Identical on every rank, so every rank raises alike before the first collective.

    Args:
        spec: the module's declared parts, ``None`` for a module that parallelizes itself.
        num_blocks: the declared model's number of blocks.
        module_name: the LightningModule's class name, for messages.
        log: where the one line naming a bare strategy's mesh goes (:func:`~.default_mesh.bare_layout_note`).

    Raises:
        ValueError: sizes that do not fit the world or the model, or a feature the module cannot use.
    """
    tp, dp = options.sizes(world_size, devices_per_node, self_parallel=spec is None)
    dims = ParallelDims.resolve(tp, options.pp, dp, world_size, devices_per_node=devices_per_node, cp=options.cp,
                                dp_shard=options.dp_shard)
    cp_error = context_parallel_error(spec, options.cp, module_name) or (
        options.cp > 1 and options.compile and f"compile=True with cp={options.cp} is not supported (the ring "
        f"attention's collectives are not traced); use compile=False or cp=1")
    if cp_error:
        raise ValueError(cp_error)
    if spec is not None and precision not in DECLARED_PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported for a declared model; "
                         f"use one of {DECLARED_PRECISIONS}")
    if spec is None and (options.activation_checkpointing != "none" or options.compile):
        raise ValueError(f"activation_checkpointing={options.activation_checkpointing!r}/compile={options.compile} "
                         f"need a LightningModule that declares its blocks (parallel_spec()); a module that "
                         f"parallelizes itself applies them in its own configure_model")
    if (options.compile and dims.tp > 1 and not options.sequence_parallel
            and options.activation_checkpointing == "selective" and options.selective_ac == "op"):
        raise ValueError(
            f"compile=True with tp={dims.tp}, activation_checkpointing='selective' (selective_ac='op') and "
            f"sequence_parallel=False trains with wrong gradients on torch {torch.__version__} (docs/performance.md); "
            f"use sequence_parallel=True, selective_ac='attention' or a stride k, or compile=False")
    float8_problem = float8_error(options.float8, precision, spec, module_name,
                                  fsdp=dims.data_ranks > 1 and options.data_parallel != "replicate")
    if float8_problem:
        raise ValueError(float8_problem)
    if spec is not None and num_blocks is not None:
        dims.check_model(spec.tp_divisible, num_blocks, options.virtual_stages)
    elif options.pp > 1:
        raise ValueError(
            f"pp={options.pp} needs a LightningModule that declares its model parts and loss "
            f"(parallel_spec(), num_blocks() and a `model` with loss_sum(); see lightning_hybrid.models.CausalLM); "
            f"{module_name} does not"
        )
    if options.pp > 1:
        validate_schedule(options.pp_schedule, options.pp, options.virtual_stages, options.num_microbatches)
        reshard_after_forward(options.fsdp_reshard_after_forward, options.pp, options.pp_schedule,
                              options.pp_schedule in ZERO_BUBBLE)
        assert spec is not None and num_blocks is not None
        plan_stages(spec, num_blocks, options.pp * options.virtual_stages, options.pp_split_points)
    elif options.virtual_stages != 1:
        raise ValueError(f"virtual_stages={options.virtual_stages} needs pp>1; use virtual_stages=1")
    log_bare_layout(options, dims, spec is None, log)
    return dims


def check_device_options(options: ParallelOptions, device: torch.device, backend: str) -> None:
    """Raise the one-line errors of the options the device and backend decide (async TP, float8's recipe), on every
    rank before the process group exists."""
    from lightning_hybrid.distributed.float8 import check_float8_device
    from lightning_hybrid.distributed.tensor_parallel import check_async_tp

    check_async_tp(options, device.type, backend)
    check_float8_device(options.float8, device)


def require_meta(model: nn.Module, module_name: str) -> None:
    """Raise unless ``model`` is still on the meta device (so it can be sharded before it is allocated)."""
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError(f"{module_name}.configure_model() built real weights; build the declared model on the "
                         f"meta device so the strategy can shard it first")


def compute_weights(options: ParallelOptions, dims: ParallelDims, precision: str) -> Optional[str]:
    """Where the bf16 compute weights of ``bf16-mixed`` come from: ``"fsdp"`` (FSDP2 casts at each gather),
    ``"step"`` (:class:`~.data_parallel.StepWeightCasts`, once per step), or ``None``: autocast casts per op (the
    option is off, another precision, or a case the step casts do not cover: compiled blocks, whose hooks would
    run inside the compiled region, and zero-bubble schedules, whose split weight-gradient pass was not tested
    with them)."""
    if precision != "bf16-mixed" or not options.bf16_compute_weights:
        return None
    if dims.data_ranks > 1 and options.data_parallel != "replicate":
        return "fsdp"
    if options.compile or (dims.pp > 1 and options.pp_schedule in ZERO_BUBBLE):
        return None
    return "step"


def setup_runtime(options: ParallelOptions, dims: ParallelDims, precision: str, precision_plugin: Any,
                  model: nn.Module) -> tuple[Optional[StepWeightCasts], bool]:
    """After :func:`parallelize`: ``(the step's bf16 weight copies or None, whether the loss runs on vocabulary
    shards)``. Turns Lightning's autocast off when the weights are bf16 copies (:func:`compute_weights`), hooks
    the copies into ``model`` (the parallelized model or this rank's stage parts) when no FSDP2 unit makes them,
    and runs the precision plugin's backward inside torch's ``loss_parallel`` context under loss parallel (a
    pipeline's backward runs inside its schedule step, which enters it itself)."""
    weights = compute_weights(options, dims, precision)
    if weights is not None:
        without_autocast(precision_plugin)
    casts = StepWeightCasts() if weights == "step" else None
    if casts is not None:
        casts.install(model)
    loss_parallel = options.loss_parallel and dims.tp > 1
    if loss_parallel:
        backward_in_loss_parallel(precision_plugin)
    return casts, loss_parallel


def loss_function(loss_sum: Callable, options: ParallelOptions, dims: ParallelDims, mesh: "DeviceMesh") -> Callable:
    """The model's ``loss_sum``, on vocabulary shards over ``tp`` when loss parallel is on."""
    if options.loss_parallel and dims.tp > 1:
        return vocab_parallel_loss(loss_sum, mesh["tp"])
    return loss_sum


def parallelize(module: nn.Module, spec: ParallelSpec, options: ParallelOptions, dims: ParallelDims,
                mesh: "DeviceMesh", device: torch.device, precision: str,
                convert_module: Callable[[nn.Module], Any]) -> None:
    """Float8 conversion, TP, recompute/compile, FSDP2, then materialization, of a meta-device model or pipeline stage.

    The parameters are allocated (uninitialized) on ``device``; the caller fills them
    (:func:`lightning_hybrid.distributed.init_weights.init_parameters` or pretrained weights).

    Args:
        module: the model or one pipeline stage, on the meta device.
        convert_module: the precision plugin's ``convert_module`` (bf16 storage under ``bf16-true``, cheap on meta).

    FSDP2 frees a block's gathered weights after forward per ``options.fsdp_reshard_after_forward``
    (:func:`~.data_parallel.reshard_after_forward`: ``"auto"`` keeps them gathered under a pipeline).
    With ``loss_parallel`` and ``tp > 1`` the head keeps vocabulary-sharded logits and ``module.loss_sum`` (when the
    module holds the head) becomes :func:`~.tensor_parallel.vocab_parallel_loss`.
    """
    convert_module(module)
    if options.float8 is not None:
        convert_float8(module, spec, options.float8, dims.tp,
                       fsdp=dims.data_ranks > 1 and options.data_parallel != "replicate")
    if dims.cp > 1:
        cp_mesh = mesh["cp"]
        install_context_parallel(module, spec, cp_mesh.get_group(), dims.cp, cp_mesh.get_local_rank())
    if dims.tp > 1:
        loss_parallel = options.loss_parallel and getattr(module, spec.head, None) is not None
        apply_tensor_parallel(module, spec, mesh["tp"], options.sequence_parallel, loss_parallel,
                              adjust_plan=lambda plan, block: float8_tp_plan(plan, block, options.float8, mesh["tp"]))
        if loss_parallel and callable(getattr(module, "loss_sum", None)):
            module.loss_sum = loss_function(module.loss_sum, options, dims, mesh)
        if options.async_tp:
            enable_async_tp(mesh["tp"])
    blocks = getattr(module, spec.blocks, None)
    if blocks is not None and len(blocks) > 0:
        apply_activation_checkpointing(blocks, options.activation_checkpointing, options.selective_ac,
                                       spec.block_attention)
        if options.compile:
            compile_blocks(blocks, parts=spec.block_norm_consumers if dims.tp > 1 else None)
    if dims.data_ranks > 1 and options.data_parallel != "replicate":
        zero_bubble = dims.pp > 1 and options.pp_schedule in ZERO_BUBBLE
        apply_fsdp(module, getattr(module, spec.blocks), data_mesh(mesh, dims),
                   param_dtype=options.param_dtype(precision), reduce_dtype=options.reduction_dtype(precision),
                   reshard_after_forward=reshard_after_forward(options.fsdp_reshard_after_forward, dims.pp,
                                                               options.pp_schedule, zero_bubble))
    materialize(module, device)

