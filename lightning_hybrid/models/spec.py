"""How a model declares its parallel structure, so the strategy never has to guess.

A model is parallelizable by :class:`~lightning_hybrid.HybridParallelStrategy` when it has a
``parallel_spec()`` method returning a :class:`ParallelSpec` and a ``loss_sum(logits, labels)``
method returning the loss summed over the label tokens and their count; :func:`token_mean_loss` turns such sums
into the global token-mean loss, the same on one process, under data parallelism and in a pipeline. This module is
plain data and arithmetic: it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["ParallelSpec", "holds", "held_block_plan",
           "TP_STYLES", "IGNORE_INDEX", "EXPERTS_LAYER", "declared_spec", "token_mean_loss",
           "is_experts_layer", "experts_layers"]

# Label value that the loss ignores (padding, prompt tokens), as in torch's cross_entropy and Hugging Face.
IGNORE_INDEX = -100

# What a LightningModule that declares parallel_spec() also answers: the blocks a pipeline splits and the seed of the
# mesh-independent initialization (the strategy asks both before it builds the model).
DECLARED_METHODS = ("num_blocks", "init_seed")

# The tensor-parallel styles a plan may name; the strategy maps them onto torch's TP styles.
TP_STYLES = ("colwise", "rowwise")

# What a mixture-of-experts layer (a block's ``ParallelSpec.block_experts``; the decoder core's
# ``models/decoder/moe.py``) holds for a strategy to read and set, by name:
# - ``num_experts`` (read) and ``experts``: a module whose parameters are the experts' weights with the experts first
#   (expert parallelism shards them on dim 0); calling it with ``(tokens sorted by expert, rows per expert)`` computes
#   the experts it holds;
# - ``dispatch(rows, counts, experts)``: the outputs of the routed (token, expert) rows, sorted by expert (``counts[e]``
#   rows for expert ``e``), in the same order: ``experts(rows, counts)`` on one device, an all-to-all to the experts'
#   ranks and back under ``ep>1``;
# - ``reduce_load(stats)``: sums the layer's load statistics over the ranks that see different tokens (no gradient);
# - ``data_ranks``: how many such ranks average their gradients;
# - ``grad_scale``: the weight of this micro-batch's load-balancing gradient (1 / micro-batches per optimizer step);
# - ``stats.keep_last(n)``: keep the statistics of the step's last ``n`` forwards only.
EXPERTS_LAYER = ("num_experts", "experts", "dispatch", "reduce_load", "data_ranks", "grad_scale", "stats")


@dataclass(frozen=True)
class ParallelSpec:
    """The parts of a decoder model and its tensor-parallel plan.

    The forward pass must be ``head(norm(blocks(embedding(x))))`` and must skip a part that is
    ``None`` (a pipeline stage holds a slice of the blocks and maybe the ends). ``blocks`` must be
    an ``nn.ModuleDict`` keyed by the global block index, so parameter names stay the same on
    every mesh.

    Args:
        embedding: attribute name of the token embedding (``nn.Embedding``).
        blocks: attribute name of the ``nn.ModuleDict`` of blocks.
        norm: attribute name of the final norm.
        head: attribute name of the output projection (``nn.Linear``).
        block_plan: linear submodule of a block -> ``"colwise"`` or ``"rowwise"``. Colwise layers
            split their output features (attention heads, MLP width), rowwise ones their input.
        block_norms: norms of a block, sharded on the sequence under sequence parallelism.
        block_norm_consumers: submodules fed by those norms; their input is gathered back to the
            full sequence under sequence parallelism.
        head_norms: norms inside a block that act on each attention head, fed (batch, seq, heads, head_dim) from a
            colwise projection (Qwen3's q/k norms). Under tensor parallelism a rank holds some of the heads: the norm
            keeps its weight whole and its gradient is summed over the TP ranks.
        block_attention: attribute name of a block's attention submodule (recomputed alone by
            ``activation_checkpointing="selective", selective_ac="attention"``).
        attention_core: attribute of ``block_attention`` holding its causal attention core, a
            :class:`~lightning_hybrid.models.attention.CausalAttention` (or one with its interface) that the model
            calls for attention and for the global token positions of RoPE. Context parallelism (``cp>1``)
            replaces it with ring attention over the sequence shards; ``None``: the model declares none, and
            cannot be trained with ``cp>1``.
        fused_projections: submodule of a block that runs several colwise linears of one input as one GEMM ->
            those linears (``"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")``), each
            a ``"colwise"`` entry of ``block_plan``. The linears keep their parameters and their own row split (whole
            heads on every rank); the fused module computes on this rank's shards of them (a
            :class:`~lightning_hybrid.models.fused.FusedLinear`). A block whose fused module is ``None`` runs the
            linears one by one.
        rotary: attribute of the model holding the rotary tables made once per forward (a
            :class:`~lightning_hybrid.models.decoder.rope.RotaryTables`, called with the hidden states), or
            ``None``. Under sequence parallelism it is handed the hidden states' sequence shard as a DTensor, so the
            tables cover the whole sequence the attention sees.
        block_experts: attribute of a block holding its mixture-of-experts layer in the blocks that have one (an
            experts layer: see :data:`EXPERTS_LAYER`); ``None``: the model has none. Expert parallelism
            (``ep>1``) splits those layers' experts, and ``block_plan`` entries under this attribute apply only to the
            blocks where it holds a dense MLP.
        tp_divisible: config field -> value that the tensor-parallel size must divide.
        ep_divisible: config field -> value that the expert-parallel size must divide (``num_experts``).
        block_cost: relative compute cost of one block (for pipeline balancing).
        embedding_cost: relative cost of the embedding, in the same unit.
        head_cost: relative cost of final norm plus head plus loss, in the same unit.
    """

    embedding: str
    blocks: str
    norm: str
    head: str
    block_plan: dict[str, str]
    block_norms: tuple[str, ...] = ()
    block_norm_consumers: tuple[str, ...] = ()
    head_norms: tuple[str, ...] = ()
    block_attention: Optional[str] = None
    attention_core: Optional[str] = None
    fused_projections: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rotary: Optional[str] = None
    block_experts: Optional[str] = None
    tp_divisible: dict[str, int] = field(default_factory=dict)
    ep_divisible: dict[str, int] = field(default_factory=dict)
    block_cost: float = 1.0
    embedding_cost: float = 0.0
    head_cost: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.block_plan.items() if v not in TP_STYLES}
        if bad:
            raise ValueError(f"unknown tensor-parallel style in block_plan {bad}; use one of {TP_STYLES}")
        for fused, parts in self.fused_projections.items():
            if not parts or any(self.block_plan.get(part) != "colwise" for part in parts):
                raise ValueError(f"fused_projections[{fused!r}]={parts!r}: each part must be a 'colwise' entry of "
                                 f"block_plan")


def holds(block: Any, name: str) -> bool:
    """Whether ``block`` holds a submodule at the dotted ``name`` (a block of a mixture of experts has no dense MLP; a
    fused module a block runs without is ``None``)."""
    module = block
    for part in name.split("."):
        module = getattr(module, part, None)
    return module is not None


def held_block_plan(spec: ParallelSpec, block: Any) -> dict[str, str]:
    """The entries of ``spec.block_plan`` that ``block`` holds."""
    return {name: style for name, style in spec.block_plan.items() if holds(block, name)}


def declared_spec(module: Any) -> Optional[ParallelSpec]:
    """The :class:`ParallelSpec` that ``module`` declares, or ``None`` when it declares none (it parallelizes itself).

    The protocol is a ``parallel_spec`` method defined by the module's class that returns a ``ParallelSpec``; an
    attribute that merely answers to the name (a ``Mock``, an instance attribute) declares nothing.

    Raises:
        TypeError: the class defines ``parallel_spec()`` and it returns something else, or lacks one of
            :data:`DECLARED_METHODS`.
    """
    if not callable(getattr(type(module), "parallel_spec", None)):
        return None
    spec = module.parallel_spec()
    name = type(module).__name__
    if not isinstance(spec, ParallelSpec):
        raise TypeError(f"{name}.parallel_spec() returned {type(spec).__name__}, not a ParallelSpec; "
                        f"return lightning_hybrid.models.spec.ParallelSpec(...) or remove the method")
    missing = [method for method in DECLARED_METHODS if not callable(getattr(type(module), method, None))]
    if missing:
        raise TypeError(f"{name} declares parallel_spec() but has no {'(), '.join(missing)}(); a declared "
                        f"LightningModule also needs {'(), '.join(DECLARED_METHODS)}() (docs/custom-models.md)")
    return spec


def is_experts_layer(module: Any) -> bool:
    """Whether ``module`` is a mixture-of-experts layer (it has every attribute of :data:`EXPERTS_LAYER`)."""
    return all(hasattr(module, name) for name in EXPERTS_LAYER)


def experts_layers(module: Any) -> list[Any]:
    """The mixture-of-experts layers inside ``module`` (a model, a pipeline stage), in module order."""
    return [m for m in module.modules() if is_experts_layer(m)]


def token_mean_loss(loss_sum: "Tensor", global_count: "Tensor", data_ranks: int = 1,
                    grad_scale: float = 1.0) -> "Tensor":
    """A label-token loss sum as its part of the mean over every label token of the global batch.

    The one place the loss is normalized: the one-stage path (:meth:`~lightning_hybrid.models.CausalLM`'s step) and
    the pipeline (:class:`~lightning_hybrid.distributed.pipeline.runner.PipelineRunner`, per micro-batch) both call
    it. A rank backpropagates ``loss_sum / global_count * data_ranks`` (its own tokens' sum): the strategies average
    gradients over the data ranks, so the result is the gradient of the global token mean; ``grad_scale`` is the
    ``1 / accumulate_grad_batches`` Lightning applies to a returned loss and a pipeline's schedule must apply itself.
    With the global sum, ``data_ranks=1`` and ``grad_scale=1`` it is the global mean itself (what is logged).

    Args:
        loss_sum: the cross-entropy summed over label tokens (a rank's, a micro-batch's, or the global batch's).
        global_count: the label tokens of the global batch (at least 1 is used: a batch of ignored labels has loss 0).
        data_ranks: the ranks that see different tokens and average their gradients (dp x cp).
        grad_scale: the gradient accumulation's ``1 / accumulate_grad_batches``.
    """
    return loss_sum / global_count.clamp(min=1.0) * (data_ranks * grad_scale)
