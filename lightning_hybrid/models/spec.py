"""How a model declares its parallel structure, so the strategy never has to guess.

A model is parallelizable by :class:`~lightning_hybrid.HybridParallelStrategy` when it has a
``parallel_spec()`` method returning a :class:`ParallelSpec` and a ``loss_sum(logits, labels)``
method. This module is plain data: it does not import ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["ParallelSpec", "TP_STYLES", "IGNORE_INDEX", "declared_spec"]

# Label value that the loss ignores (padding, prompt tokens), as in torch's cross_entropy and Hugging Face.
IGNORE_INDEX = -100

# The tensor-parallel styles a plan may name; the strategy maps them onto torch's TP styles.
TP_STYLES = ("colwise", "rowwise")


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
        block_attention: attribute name of a block's attention submodule (recomputed alone by
            ``activation_checkpointing="selective", selective_ac="attention"``).
        attention_core: attribute of ``block_attention`` holding its causal attention core, a
            :class:`~lightning_hybrid.models.attention.CausalAttention` (or one with its interface) that the model
            calls for attention and for the global token positions of RoPE. Context parallelism (``cp>1``)
            replaces it with ring attention over the sequence shards; ``None``: the model declares none, and
            cannot be trained with ``cp>1``.
        tp_divisible: config field -> value that the tensor-parallel size must divide.
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
    block_attention: Optional[str] = None
    attention_core: Optional[str] = None
    tp_divisible: dict[str, int] = field(default_factory=dict)
    block_cost: float = 1.0
    embedding_cost: float = 0.0
    head_cost: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.block_plan.items() if v not in TP_STYLES}
        if bad:
            raise ValueError(f"unknown tensor-parallel style in block_plan {bad}; use one of {TP_STYLES}")


def declared_spec(module: Any) -> Optional[ParallelSpec]:
    """The :class:`ParallelSpec` that ``module`` declares, or ``None`` when it declares none (it parallelizes itself).

    The protocol is a ``parallel_spec`` method defined by the module's class that returns a ``ParallelSpec``; an
    attribute that merely answers to the name (a ``Mock``, an instance attribute) declares nothing.

    Raises:
        TypeError: the class defines ``parallel_spec()`` and it returns something else.
    """
    if not callable(getattr(type(module), "parallel_spec", None)):
        return None
    spec = module.parallel_spec()
    if not isinstance(spec, ParallelSpec):
        raise TypeError(f"{type(module).__name__}.parallel_spec() returned {type(spec).__name__}, not a ParallelSpec; "
                        f"return lightning_hybrid.models.spec.ParallelSpec(...) or remove the method")
    return spec
