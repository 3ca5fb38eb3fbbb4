"""The strategy's options checked at setup against the world, the model and the precision; no collective, no torch.

:func:`check_options` resolves the sizes (:class:`~lightning_hybrid.distributed.parallel_dims.ParallelDims`) and
raises the one-line message of the first thing that cannot run: sizes that do not fit, a feature the module or the
precision cannot use (:func:`float8_error`, :func:`context_parallel_error`), a schedule, split points or virtual
stages that do not go together. Identical on every rank, so every rank raises alike before the first collective. The
values themselves are checked when :class:`~lightning_hybrid.distributed.options.ParallelOptions` is built; the
device's side (async TP's CUDA and NCCL, float8's compute capability) in
:func:`lightning_hybrid.distributed.parallelize.check_device_options`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning_hybrid.distributed.default_mesh import log_bare_layout
from lightning_hybrid.distributed.options import ParallelOptions, float8_precision_error
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.pipeline.schedules import validate_schedule
from lightning_hybrid.distributed.pipeline.split import plan_stages
from lightning_hybrid.models.spec import ParallelSpec
from lightning_hybrid.planner.experts import selective_recompute_reason

__all__ = ["check_options", "float8_error", "context_parallel_error", "experts_error", "DECLARED_PRECISIONS",
           "FLOAT8_EXTRA"]

DECLARED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
FLOAT8_EXTRA = "pip install 'lightning-hybrid[float8]'"


def _torchao_missing() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return True
    return False


def float8_error(float8: Optional[str], precision: str, spec: Optional[ParallelSpec],
                 module_name: str, fsdp: bool = True) -> Optional[str]:
    """What is wrong with ``float8`` for this precision and module (one line), or ``None``; needs no collective.

    ``fsdp``: FSDP2 shards the weights over dp > 1 (under ``bf16-mixed`` it gathers them in bf16). The device's side
    (compute capability) is :func:`lightning_hybrid.distributed.float8.float8_device_error`'s."""
    if float8 is None:
        return None
    if float8_precision_error(float8, precision):
        return float8_precision_error(float8, precision)
    if spec is None:
        return (f"float8={float8!r} needs a LightningModule that declares its blocks (parallel_spec()); {module_name} "
                f"does not (convert its linears with torchao in its own configure_model)")
    if _torchao_missing():
        return f"float8={float8!r} needs torchao, which is not installed: {FLOAT8_EXTRA}"
    if float8 == "mxfp8" and precision == "bf16-mixed" and not fsdp:
        # torchao's MXFP8 linear takes bf16 weights; only FSDP2's bf16 gather gives them under bf16-mixed
        return ("float8='mxfp8' with precision='bf16-mixed' needs FSDP2 over dp>1 (it gathers bf16 weights); "
                "without it use precision='bf16-true'")
    return None


def context_parallel_error(spec: Optional[ParallelSpec], cp: int, module_name: str) -> str:
    """Why a module cannot run with this cp ('' when it can): cp>1 needs a model that declares its attention core."""
    if cp == 1:
        return ""
    if spec is None or spec.attention_core is None or spec.block_attention is None:
        return (f"cp={cp} needs a model that declares its attention (ParallelSpec.block_attention and "
                f"attention_core, see lightning_hybrid.models.CausalLM); {module_name} does not; use cp=1")
    return ""


def experts_error(options: ParallelOptions, spec: Optional[ParallelSpec], module_name: str,
                  dims: Optional[ParallelDims] = None) -> Optional[str]:
    """Why expert parallelism (or a mixture-of-experts model) cannot run with these options (one line), or ``None``:
    ``ep>1`` needs a model with experts whose count it divides and FSDP2 over the data ranks, and not the op-level
    selective recompute when ep is all the data ranks (:func:`~lightning_hybrid.planner.experts.
    selective_recompute_reason`); a mixture of experts is not compiled (its per-expert splits are data-dependent)."""
    experts = spec is not None and spec.block_experts is not None
    if options.ep > 1 and not experts:
        return (f"ep={options.ep} needs a mixture-of-experts model (its ParallelSpec declares block_experts, e.g. "
                f"model='qwen3-30b-a3b' or 'tiny-moe'); {module_name} has none; use ep=1")
    if options.ep > 1:
        assert spec is not None
        for field, value in spec.ep_divisible.items():
            if value % options.ep:
                fits = [d for d in range(1, value + 1) if value % d == 0]
                return (f"ep={options.ep} does not divide {field}={value} (each ep rank holds num_experts / ep "
                        f"experts); use ep in {', '.join(map(str, fits))}")
        if options.data_parallel != "fsdp":
            return (f"ep={options.ep} with data_parallel={options.data_parallel!r} is not supported (the experts are "
                    f"sharded by FSDP2 over the data ranks of each ep rank); use data_parallel='fsdp'")
        recompute = dims is not None and selective_recompute_reason(options.ep, dims.data_ranks,
                                                                    options.activation_checkpointing,
                                                                    options.selective_ac)
        if recompute:
            return recompute
    if experts and options.compile:
        return ("compile=True with a mixture-of-experts model is not supported (the tokens per expert are "
                "data-dependent); use compile=False")
    return None


def _feature_error(options: ParallelOptions, dims: ParallelDims, spec: Optional[ParallelSpec], precision: str,
                   module_name: str) -> Optional[str]:
    """The first feature of ``options`` this module, precision and mesh cannot run (one line), or ``None``."""
    cp_error = context_parallel_error(spec, options.cp, module_name) or (
        options.cp > 1 and options.compile and f"compile=True with cp={options.cp} is not supported (the ring "
        f"attention's collectives are not traced); use compile=False or cp=1")
    if cp_error:
        return cp_error
    if spec is not None and precision not in DECLARED_PRECISIONS:
        return f"precision={precision!r} is not supported for a declared model; use one of {DECLARED_PRECISIONS}"
    if spec is None and options.compile:
        # activation_checkpointing: the strategy recomputes the decoder layers of a held Hugging Face model too; a
        # module that holds none is refused once its configure_model has run (hf_transformers.check_held_models)
        return ("compile=True needs a LightningModule that declares its blocks (parallel_spec()); a module that "
                "parallelizes itself or holds a Hugging Face model compiles in its own configure_model")
    if (options.compile and dims.tp > 1 and not options.sequence_parallel
            and options.activation_checkpointing == "selective" and options.selective_ac == "op"):
        import torch  # only for the version in the message

        return (f"compile=True with tp={dims.tp}, activation_checkpointing='selective' (selective_ac='op') and "
                f"sequence_parallel=False trains with wrong gradients on torch {torch.__version__} "
                f"(docs/performance.md); use sequence_parallel=True, selective_ac='attention' or a stride k, or "
                f"compile=False")
    return float8_error(options.float8, precision, spec, module_name, fsdp=options.shards_parameters(dims))


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
                                dp_shard=options.dp_shard, ep=options.ep)
    problem = _feature_error(options, dims, spec, precision, module_name) or experts_error(options, spec, module_name,
                                                                                          dims)
    if problem:
        raise ValueError(problem)
    if spec is not None and num_blocks is not None:
        dims.check_model(spec.tp_divisible, num_blocks, options.virtual_stages)
    elif options.pp > 1:
        raise ValueError(
            f"pp={options.pp} needs a LightningModule that declares its model parts and loss "
            f"(parallel_spec(), num_blocks() and a `model` with loss_sum(); see docs/custom-models.md); "
            f"{module_name} does not (a Hugging Face model held as it is trains with tp and dp only)"
        )
    if options.pp > 1:
        validate_schedule(options.pp_schedule, options.pp, options.virtual_stages, options.num_microbatches)
        options.reshards_after_forward(options.pp)
        assert spec is not None and num_blocks is not None
        plan_stages(spec, num_blocks, options.pp * options.virtual_stages, options.pp_split_points)
    elif options.virtual_stages != 1:
        raise ValueError(f"virtual_stages={options.virtual_stages} needs pp>1; use virtual_stages=1")
    log_bare_layout(options, dims, spec is None, log)
    return dims
