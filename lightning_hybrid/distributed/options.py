"""The strategy's options: what the user chose, the check of each value, and each decision derived from them, once.

:class:`ParallelOptions` holds the layout and runtime arguments of :class:`~lightning_hybrid.HybridParallelStrategy`,
each value checked on construction (every rank raises alike, before any collective; the one-line messages are here);
:func:`~lightning_hybrid.distributed.option_checks.check_options` checks them together against the world and the
model at setup, still before any collective. Each decision the options imply is one method here
(:meth:`~ParallelOptions.loss_on_shards`, :meth:`~ParallelOptions.shards_parameters`,
:meth:`~ParallelOptions.replicates_gradients`, :meth:`~ParallelOptions.reshards_after_forward`,
:meth:`~ParallelOptions.compute_weights`, :meth:`~ParallelOptions.param_dtype`,
:meth:`~ParallelOptions.reduction_dtype`, :attr:`~ParallelOptions.num_microbatches`, :meth:`~ParallelOptions.layout`),
so the strategy, the parallelize sequence, the pipeline, the planner, the CLI and the dry run read one answer.

This module imports no torch: the planner (pure arithmetic) and ``lightning-hybrid plan`` share it. Dtypes are named
(``"bfloat16"``, ``"float32"``); :func:`lightning_hybrid.distributed.data_parallel.torch_dtype` turns a name into
torch's dtype where one is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.pipeline.schedules import PP_SCHEDULES, ZERO_BUBBLE, default_microbatches

__all__ = ["ParallelOptions", "AUTO", "AUTO_FIELDS", "REDUCE_DTYPES", "DATA_PARALLEL_MODES", "GRADIENT_BUCKET_BYTES",
           "RESHARD_POLICIES", "ACTIVATION_CHECKPOINTING", "SELECTIVE_AC", "FLOAT8_RECIPES", "choice", "positive_int",
           "lightning_size", "check_reshard_policy", "reshard_after_forward", "resolve_selective", "check_float8",
           "float8_precision_error", "FLOAT8_PRECISIONS", "async_tp_error"]

# Options the strategy may leave to the planner (lightning_hybrid/distributed/auto_layout.py resolves them at setup).
AUTO = "auto"
AUTO_FIELDS = ("tp", "pp", "dp", "microbatches", "virtual_stages", "pp_schedule", "activation_checkpointing",
               "data_parallel")
# reduce_dtype's accepted names -> torch's dtype name
REDUCE_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DATA_PARALLEL_MODES = ("fsdp", "replicate", "hsdp")
# Replicated gradients are all-reduced in buckets of about this size (also the planner's DP message size).
GRADIENT_BUCKET_BYTES = 25 * 1024 * 1024
FLOAT8_PRECISIONS = ("bf16-mixed", "bf16-true")  # float8 matmuls take bf16 activations
# fsdp_reshard_after_forward: "auto" frees a block's gathered weights after forward without a pipeline (ZeRO-3) and
# keeps them gathered for the whole step under one (ZeRO-2-like: one all-gather per unit per step, not per micro-batch).
RESHARD_POLICIES = ("auto", True, False)
ACTIVATION_CHECKPOINTING = ("none", "selective", "full")
SELECTIVE_AC = ("op", "attention")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "mxfp8")


# ------------------------------------------------------------------------------------------------ one value each

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


def check_reshard_policy(value: Any) -> Any:
    """``value`` as one of :data:`RESHARD_POLICIES` (``"auto"`` in any case, ``True`` or ``False``).

    Raises:
        ValueError: naming the value and the accepted ones.
    """
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        return value
    raise ValueError(f"fsdp_reshard_after_forward={value!r} is not supported; use 'auto', True or False")


def reshard_after_forward(policy: Any, pp: int, schedule: str) -> bool:
    """FSDP2's ``reshard_after_forward`` for the blocks under ``policy`` (:func:`check_reshard_policy`'s answer).

    Under a pipeline torch's schedules keep the units gathered from one backward to the next and reduce-scatter
    once per step (``PipelineStage.backward_maybe_with_nosync``); resharding after each forward would re-gather
    every block ``m + 1`` times per step. ``"auto"`` therefore keeps them gathered when ``pp > 1`` (ZeRO-2-like).

    Raises:
        ValueError: ``True`` with a zero-bubble schedule, whose separate weight-gradient pass needs the gathered
            weights (with resharding it trains silently wrong).
    """
    if policy == "auto":
        return pp == 1
    if policy and pp > 1 and schedule in ZERO_BUBBLE:
        raise ValueError(f"fsdp_reshard_after_forward=True with pp_schedule={schedule!r}: a zero-bubble schedule "
                         f"needs the gathered weights in its weight-gradient pass; use 'auto' or False")
    return bool(policy)


def resolve_selective(value: Union[str, int]) -> Union[str, int]:
    """``"op"``, ``"attention"`` or a positive block stride ``k`` (also given as a digit string, e.g. from YAML).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"selective_ac={value!r} is not a mode; use one of {SELECTIVE_AC} or a block stride k >= 1")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        k = int(value)
        if k < 1:
            raise ValueError(f"selective_ac={value!r}: a block stride must be >= 1 (1 recomputes every block)")
        return k
    mode = str(value).lower()
    if mode not in SELECTIVE_AC:
        raise ValueError(f"selective_ac={value!r} is not a mode; use one of {SELECTIVE_AC} or a block stride k >= 1")
    return mode


def check_float8(value: Any) -> Optional[str]:
    """``value`` lower-cased when it is ``None`` or a recipe of :data:`FLOAT8_RECIPES`.

    Raises:
        ValueError: one line naming the value and the recipes.
    """
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in FLOAT8_RECIPES:
        raise ValueError(f"float8={value!r} is not supported; use None or one of {', '.join(FLOAT8_RECIPES)}")
    return value.lower()


def float8_precision_error(float8: Optional[str], precision: str) -> Optional[str]:
    """One line when ``float8`` cannot run under Lightning's ``precision`` (the strategy refuses it, the planner too),
    else ``None``."""
    if float8 is None or precision in FLOAT8_PRECISIONS:
        return None
    return (f"float8={float8!r} with precision={precision!r} is not supported: float8 matmuls take bf16 activations; "
            f"use precision='bf16-mixed' or 'bf16-true'")


def async_tp_error(compile: bool, sequence_parallel: bool, device_type: Optional[str],
                   backend: Optional[str] = None, tp: Optional[int] = None) -> Optional[str]:
    """Why ``async_tp=True`` cannot run here (one line naming what is missing), or ``None``.

    ``device_type``/``backend`` ``None``: not known yet (checked again at setup). The fake backend (dry run)
    passes: it plays a CUDA job's ranks on CPU without running the overlapped kernels.
    """
    missing = [what for what, ok in (("compile=True", compile), ("sequence_parallel=True", sequence_parallel))
               if not ok]
    if tp is not None and tp < 2:
        missing.append("tp>1")
    if backend != "fake":
        if device_type is not None and device_type != "cuda":
            missing.append(f"a CUDA device (this run is on {device_type})")
        if backend is not None and device_type is not None and backend != "nccl":
            missing.append(f"the NCCL backend (this run uses {backend})")
    if not missing:
        return None
    return (f"async_tp=True (micro-pipelined tensor parallelism) needs {', '.join(missing)}; "
            f"set those or use async_tp=False")


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


# ------------------------------------------------------------------------------------------------ the options

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
    # Expert parallelism: the experts of each mixture-of-experts layer split over ep ranks carved from dp.
    ep: int = 1
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
        positive_int("ep", self.ep)
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
                                               ACTIVATION_CHECKPOINTING + (AUTO,))
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

    def is_bare(self) -> bool:
        """No size was given: ``tp``, ``dp``, ``tensor_parallel_size``, ``data_parallel_size``, ``pp``, ``cp`` and
        ``ep`` at their defaults (a bare ``HybridParallelStrategy()``; see
        :mod:`~lightning_hybrid.distributed.default_mesh`)."""
        return (self.tp == 1 and self.dp is None and self.tensor_parallel_size is None
                and self.data_parallel_size is None and self.pp == 1 and self.cp == 1 and self.ep == 1)

    def sizes(self, world_size: int, devices_per_node: Optional[int],
              self_parallel: bool = False) -> tuple[int, Optional[int]]:
        """``(tp, dp)`` with Lightning's ``"auto"`` resolved: ``tensor_parallel_size="auto"`` is the devices per node,
        ``data_parallel_size="auto"`` the number of nodes (``devices_per_node=None``: one node). A module that
        parallelizes itself (``self_parallel``) under a bare strategy (:meth:`is_bare`) gets both as ``"auto"``:
        the mesh a bare ``ModelParallelStrategy()`` builds.

        Raises:
            ValueError: ``tp``/``dp`` was given too and differs from what ``"auto"`` means here.
        """
        per_node = devices_per_node or world_size
        if self_parallel and self.is_bare():
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
        if dims.ep > 1:
            layout["ep"] = dims.ep
        if dims.dp_replicate > 1:
            layout.update(dp_shard=dims.dp_shard, dp_replicate=dims.dp_replicate)
        return layout

    # -------------------------------------------------------------------------------------------- derived decisions

    def loss_on_shards(self, dims: ParallelDims) -> bool:
        """Whether the loss runs on the vocabulary shards of the TP group (``loss_parallel`` with tp > 1): the head
        keeps its logits sharded, the loss is :func:`~.tensor_parallel.vocab_parallel_loss`, its backward runs in
        torch's ``loss_parallel`` context and ``predict`` gathers the full logits."""
        return self.loss_parallel and dims.tp > 1

    def shards_parameters(self, dims: ParallelDims) -> bool:
        """Whether FSDP2 shards the weights over the data ranks (dp x cp > 1, ``"fsdp"`` or ``"hsdp"``)."""
        return dims.data_ranks > 1 and self.data_parallel != "replicate"

    def replicates_gradients(self, dims: ParallelDims) -> bool:
        """Whether the weights are replicated over dp x cp > 1 and the gradients all-reduced once per step."""
        return dims.data_ranks > 1 and self.data_parallel == "replicate"

    def zero_bubble(self, pp: int) -> bool:
        """Whether a pipeline runs a zero-bubble schedule (a separate weight-gradient pass)."""
        return pp > 1 and self.pp_schedule in ZERO_BUBBLE

    def reshards_after_forward(self, pp: int) -> bool:
        """FSDP2's ``reshard_after_forward`` of the blocks under ``fsdp_reshard_after_forward``
        (:func:`reshard_after_forward`: ``"auto"`` keeps them gathered under a pipeline, ZeRO-2-like).

        Raises:
            ValueError: ``True`` with a zero-bubble schedule.
        """
        return reshard_after_forward(self.fsdp_reshard_after_forward, pp, self.pp_schedule)

    def compute_weights(self, dims: ParallelDims, precision: str) -> Optional[str]:
        """Where the bf16 compute weights of ``bf16-mixed`` come from: ``"fsdp"`` (FSDP2 casts at each gather),
        ``"step"`` (:class:`~.data_parallel.StepWeightCasts`, once per step), or ``None``: autocast casts per op
        (the option is off, another precision, or a case the step casts do not cover: compiled blocks, whose hooks
        would run inside the compiled region, and zero-bubble schedules, whose split weight-gradient pass was not
        tested with them)."""
        if precision != "bf16-mixed" or not self.bf16_compute_weights:
            return None
        if self.shards_parameters(dims):
            return "fsdp"
        if self.compile or self.zero_bubble(dims.pp):
            return None
        return "step"

    def param_dtype(self, precision: str) -> Optional[str]:
        """Compute dtype of FSDP2's gathered weights: ``"bfloat16"`` under ``bf16-mixed`` (the shards stay fp32)."""
        return "bfloat16" if precision == "bf16-mixed" else None

    def reduction_dtype(self, precision: str) -> Optional[str]:
        """Gradient reduction dtype over ``dp``: the given one, fp32 under bf16 precision, else the gradients'."""
        if self.reduce_dtype is not None:
            return REDUCE_DTYPES[self.reduce_dtype]
        return "float32" if precision.startswith("bf16") else None
