"""A Hugging Face ``transformers`` model held as it is by a LightningModule: its own TP plan, FSDP2, recompute.

Many Lightning users keep ``AutoModelForCausalLM.from_pretrained(...)`` (or ``from_config``) inside their own
LightningModule and compute the loss from its logits. Such a module declares no
:class:`~lightning_hybrid.models.spec.ParallelSpec` and applies no parallelism itself; after its ``configure_model``,
:func:`parallelize_held` finds each ``PreTrainedModel`` it holds that nothing has parallelized yet (no DTensor
parameter, no FSDP2 unit) and, in the order of the declared path:

1. makes every rank hold rank 0's weights (a broadcast, as DDP does: ``from_config`` without a common seed would
   otherwise give each rank another model) and converts them to the Trainer's precision;
2. tensor parallel over ``tp``: the model's own plan (``model.tp_plan``: its config's ``base_model_tp_plan`` plus the
   head's entry, with ``embed_tokens`` vocabulary-parallel), applied by transformers' own integration
   (``transformers.integrations.tensor_parallel.apply_tensor_parallelism``), whose styles are DTensor-based and
   train exactly. The styles the Llama, Qwen2/2.5, Qwen3 and Mistral plans use are accepted
   (:data:`SUPPORTED_TP_STYLES`); a plan with another (packed, per-unit, expert, MLA) is refused in one line;
3. activation recompute per decoder layer (the classes the model names in ``_no_split_modules``), the strategy's
   ``activation_checkpointing`` modes;
4. FSDP2 over the data-parallel ranks: one unit per decoder layer, then the model (embedding, final norm, head);
   ``data_parallel="replicate"`` leaves the weights whole and the strategy averages their gradients over dp
   (:mod:`~lightning_hybrid.distributed.self_parallel`).

Pipeline parallelism needs a declared model (a Hugging Face ``base_model_pp_plan`` names the stage boundaries but not
a forward a schedule can cut exactly); ``pp>1`` and ``cp>1`` are refused before any collective
(:mod:`~lightning_hybrid.distributed.option_checks`), ``sequence_parallel`` here (the plans hold no sequence-parallel
entry). The model is built whole on every rank and sharded afterwards: for models that do not fit one device, train
the decoder core from the same folder (``CausalLM(model=folder, init_from_hf=folder)``), which shards on the meta
device.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from lightning_hybrid.distributed.activation_checkpoint import apply_activation_checkpointing
from lightning_hybrid.distributed.data_parallel import apply_fsdp, torch_dtype
from lightning_hybrid.distributed.mesh import data_mesh
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.distributed.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from lightning_hybrid.distributed.host import StrategyHost

__all__ = ["SUPPORTED_TP_STYLES", "held_models", "check_held_models", "parallelize_held", "tensor_parallel_plan"]

# transformers' TP styles that train exactly with the strategy's other features (DTensor weights and activations):
# what the Llama, Qwen2/2.5, Qwen3 and Mistral plans hold (Qwen3's per-head q/k norms are replicated, their
# gradients summed over the TP ranks).
SUPPORTED_TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise",
                       "replicated_with_grad_allreduce")
# The config fields whose heads a TP rank must hold whole (the attention projections are split by head).
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def held_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Hugging Face ``PreTrainedModel`` objects ``module`` holds, outermost only, by attribute path, that nothing
    has parallelized yet; ``[]`` when ``transformers`` was never imported (it is not imported here)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    pretrained = transformers.PreTrainedModel
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(sub, pretrained) and not inside:
            found.append((name, sub))
    return [(name, model) for name, model in found if not _parallelized(model)]


def _parallelized(model: nn.Module) -> bool:
    """Whether the user's own code already sharded ``model`` (a DTensor parameter or an FSDP2 unit in it)."""
    from torch.distributed.tensor import DTensor

    return (any(isinstance(p, DTensor) for p in model.parameters())
            or any(callable(getattr(sub, "_get_fsdp_state", None)) for sub in model.modules()))


def _label(name: str, model: nn.Module) -> str:
    return f"{type(model).__name__} ({name or 'the module itself'})"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a ``PreTrainedModel``: the modules of the classes it names in ``_no_split_modules``
    (the units that Accelerate and transformers' own FSDP keep whole), in model order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [sub for sub in model.modules() if type(sub).__name__ in names]


def _check_one(name: str, model: nn.Module, options: ParallelOptions, dims: ParallelDims) -> None:
    """The one-line errors of one held model on this mesh (see :func:`check_held_models`)."""
    label = _label(name, model)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"{label} is on the meta device; a Hugging Face model held as it is is sharded from real "
                         f"weights (build it with from_pretrained/from_config), or train "
                         f"lightning_hybrid.models.CausalLM(model=<its folder>), which shards on the meta device")
    if options.activation_checkpointing != "none" and not decoder_layers(model):
        raise ValueError(f"activation_checkpointing={options.activation_checkpointing!r} needs the decoder layers of "
                         f"{label}, and its class names none in _no_split_modules; use activation_checkpointing='none'")
    if dims.tp == 1:
        return
    if options.sequence_parallel:
        raise ValueError(f"sequence_parallel=True needs a declared model (docs/custom-models.md); the tp plan of "
                         f"{label} has no sequence-parallel entries: use sequence_parallel=False")
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(f"tp={dims.tp} needs a tensor-parallel plan and {label} has none (its config sets no "
                         f"base_model_tp_plan); use tp=1")
    other = sorted({style for style in plan.values() if style not in SUPPORTED_TP_STYLES})
    if other:
        entries = ", ".join(f"{key}: {style}" for key, style in plan.items() if style in other)
        raise ValueError(f"the tp plan of {label} uses {', '.join(map(repr, other))} ({entries}), which "
                         f"HybridParallelStrategy does not train; supported: {', '.join(SUPPORTED_TP_STYLES)}; use "
                         f"tp=1")
    config = model.config.get_text_config()
    heads = {f"{type(config).__name__}.{field}": getattr(config, field) for field in HEAD_FIELDS
             if isinstance(getattr(config, field, None), int)}
    try:
        dims.check_model(heads, num_blocks=1)
    except ValueError as err:
        raise ValueError(f"{label}: {err}") from None


def check_held_models(module: nn.Module, options: ParallelOptions, dims: Optional[ParallelDims],
                      final: bool = False) -> list[tuple[str, nn.Module]]:
    """Raise the one-line error of the first held Hugging Face model (:func:`held_models`) that cannot run on
    ``dims``, identical on every rank; the held models. ``dims=None`` (not resolved yet) checks nothing.

    ``final``: the module's ``configure_model`` has run, so a module that holds none parallelizes itself, and then
    ``activation_checkpointing`` is refused (the strategy recomputes declared blocks or held decoder layers only).

    Raises:
        ValueError: a model on the meta device, ``sequence_parallel`` with tp > 1, a plan missing or with a style
            not in :data:`SUPPORTED_TP_STYLES`, a head count tp does not divide (the field and the tp that fit), or
            recompute asked of a module that holds no Hugging Face model.
    """
    found = held_models(module)
    if final and not found and options.activation_checkpointing != "none":
        raise ValueError(f"activation_checkpointing={options.activation_checkpointing!r} needs a LightningModule that "
                         f"declares its blocks (parallel_spec()) or holds a Hugging Face transformers model; "
                         f"{type(module).__name__} parallelizes itself: apply it in its own configure_model")
    if dims is None:
        return found
    for name, model in found:
        _check_one(name, model, options, dims)
    return found


def tensor_parallel_plan(model: nn.Module) -> dict[str, str]:
    """The model's TP plan with each ``*`` expanded to the layer numbers, a parameter's entry before its module's
    (what transformers' ``apply_tensor_parallelism`` takes), without the entries of tied weights: a parameter shared
    with another module is sharded once, through its first owner (``model.embed_tokens.weight`` for a tied
    ``lm_head.weight``, both split over the vocabulary), and tied again afterwards (:func:`_tie_again`)."""
    plan = model._expand_parallel_plan(model.tp_plan)  # transformers' own expansion (private; see the API tests)
    return {name: style for name, style in plan.items() if name not in dict(_tied(model))}


def _tied(model: nn.Module) -> list[tuple[str, str]]:
    """``(alias, source)`` names of the parameters ``model`` holds twice (tied embeddings)."""
    first: dict[int, str] = {}
    aliases = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.append((name, first[id(param)]))
        first.setdefault(id(param), name)
    return aliases


def _tie_again(model: nn.Module, aliases: list[tuple[str, str]]) -> None:
    for alias, source in aliases:
        owner, _, attribute = alias.rpartition(".")
        source_owner, _, source_attribute = source.rpartition(".")
        setattr(model.get_submodule(owner), attribute, getattr(model.get_submodule(source_owner), source_attribute))


def _broadcast_weights(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (one broadcast each, over the whole job)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _parallelize_one(model: nn.Module, options: ParallelOptions, dims: ParallelDims, mesh: Any,
                     precision: str) -> None:
    """Steps 2-4 of the module docstring on one held model (weights already common and converted)."""
    if dims.tp > 1:
        from transformers.integrations.tensor_parallel import apply_tensor_parallelism

        aliases = _tied(model)
        apply_tensor_parallelism(model, mesh["tp"], tensor_parallel_plan(model))
        _tie_again(model, aliases)
    layers = {str(index): layer for index, layer in enumerate(decoder_layers(model))}
    apply_activation_checkpointing(layers, options.activation_checkpointing, options.selective_ac, "self_attn")
    if options.shards_parameters(dims):
        apply_fsdp(model, layers.values(), data_mesh(mesh, dims), options.reshards_after_forward(1),
                   param_dtype=torch_dtype(options.param_dtype(precision)),
                   reduce_dtype=torch_dtype(options.reduction_dtype(precision)))


def parallelize_held(host: "StrategyHost", precision: str, log: Optional[Callable[[str], Any]] = None
                     ) -> list[str]:
    """After a non-declared module's ``configure_model``: parallelize each Hugging Face model it holds (the module
    docstring's steps), before Lightning builds the optimizers; log one line per model.

    Args:
        host: the strategy (read only: its options, sizes, mesh, precision plugin, module).
        precision: the Trainer's precision flag (FSDP2's gather and reduction dtypes).

    Returns:
        The attribute paths of the models parallelized (``[]``: the module parallelizes itself).

    Raises:
        ValueError: see :func:`check_held_models` (``final=True``).
    """
    module, options = host.lightning_module, host.options
    # the sizes only where there is a held model to parallelize (a module that parallelizes itself needs none here)
    found = check_held_models(module, options, host.dims if held_models(module) else None, final=True)
    dims = host.dims if found else None
    for name, model in found:
        label = _label(name, model)  # before FSDP2 renames its class
        _broadcast_weights(model)
        host.precision_plugin.convert_module(model)
        _parallelize_one(model, options, dims, host.device_mesh, precision)
        if log is not None:
            tp = f"its own tp plan over tp={dims.tp}" if dims.tp > 1 else "tp=1"
            dp = f"{options.data_parallel} over dp={dims.dp}" if dims.dp > 1 else "dp=1"
            log(f"{label} held as it is: {tp}, {dp}, activation_checkpointing="
                f"{options.activation_checkpointing!r} per decoder layer")
    return [name for name, _ in found]
