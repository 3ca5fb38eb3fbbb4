"""Activation recompute (checkpointing) and ``torch.compile`` of the blocks, applied after TP and before FSDP.

Modes of ``HybridParallelStrategy(activation_checkpointing=...)``:

``"none"``
    Every block keeps its activations for backward.
``"full"``
    Every block keeps only its input; backward re-runs the block's forward first. Costs one more
    forward per block (about a third more compute) and saves most of the activation memory.
``"selective"``
    Chosen by ``selective_ac``:

    * ``"op"`` (default): every block, but per operator: the outputs of matmuls, attention kernels and
      tensor-parallel collectives are kept, everything else (norms, rotary, SiLU, products, casts) is
      recomputed in backward. No matmul and no collective runs twice, so it costs a few percent of step
      time. This is the ``selective`` of the planner's memory model.
    * ``"attention"``: the attention part of every block (``ParallelSpec.block_attention``) is recomputed,
      the MLP keeps its activations.
    * an integer ``k``: every k-th block (global block index ``i`` with ``i % k == 0``) is recomputed in
      full, the others keep their activations. Global indices make the choice the same on every mesh.

Recompute changes memory and time, never the math: the forward is replayed with the same weights and
inputs (no dropout in these models), so gradients equal those without recompute.

The modules keep their names (no wrapper module is inserted): a recomputed module's ``forward`` is
replaced on the instance by one that runs the class's ``forward`` under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Parameter names, checkpoints and Hugging Face
name maps are therefore the same with and without recompute. ``torch.compile`` is applied per block with
``nn.Module.compile`` (one compiled graph reused by all blocks of the same shape), after recompute so
the recompute region is traced into the compiled graph, and before FSDP so FSDP's hooks stay outside it.
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_hybrid.distributed.options import ACTIVATION_CHECKPOINTING, resolve_selective

__all__ = ["apply_activation_checkpointing", "compile_blocks", "compiled", "recomputed", "rank_compile_cache_key",
           "TP_COMPILE_WORKAROUND",
           "RANK_COMPILE_CACHE_KEYS"]

def _saved_ops() -> set:
    """Operators whose outputs the ``"op"`` policy keeps: matmuls, attention kernels, collectives."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm"]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    funcol = getattr(torch.ops, "_c10d_functional", None)
    if funcol is not None:
        # all_to_all_single: expert parallelism's dispatch and return (never sent twice)
        for n in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "wait_tensor"):
            if hasattr(funcol, n):
                ops.add(getattr(funcol, n).default)
    return ops


@functools.lru_cache(maxsize=None)
def _op_policy_context_fn() -> Callable[[], Any]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    context_fn = self._recompute_context_fn
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    body = getattr(self, "_recompute_body", None) or type(self).forward
    return checkpoint(body, self, *args, use_reentrant=False, **extra, **kwargs)


def recomputed(module: nn.Module) -> Optional[str]:
    """``"full"`` or ``"op"`` when ``module``'s forward is recomputed in backward, else ``None``."""
    if not getattr(module, "_recompute_mode", None):
        return None
    return module._recompute_mode


def _recompute(module: nn.Module, op_level: bool) -> None:
    # A bound method on the instance (not a closure): deepcopy rebinds it to the copy.
    module._recompute_context_fn = _op_policy_context_fn() if op_level else None
    module._recompute_mode = "op" if op_level else "full"
    module.forward = types.MethodType(_recomputed_forward, module)


def apply_activation_checkpointing(blocks: nn.ModuleDict, mode: str, selective_ac: Union[str, int] = "op",
                                   attention: Optional[str] = None) -> list[str]:
    """Make the blocks (or parts of them) recompute their activations in backward; see the module docstring.

    Args:
        blocks: the blocks keyed by global index (a pipeline stage holds a slice of them).
        mode: ``"none"``, ``"selective"`` or ``"full"``.
        selective_ac: what ``"selective"`` recomputes: ``"op"``, ``"attention"`` or a block stride ``k``.
        attention: attribute name of a block's attention submodule (needed for ``"attention"``).

    Returns:
        The names (relative to ``blocks``) of the recomputed modules.

    Raises:
        ValueError: an unknown mode, or ``"attention"`` when the blocks have no such submodule.
    """
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={mode!r}; use one of {ACTIVATION_CHECKPOINTING}")
    if mode == "none":
        return []
    choice = resolve_selective(selective_ac) if mode == "selective" else None
    done = []
    for name, block in blocks.items():
        if mode == "full" or (isinstance(choice, int) and int(name) % choice == 0):
            _recompute(block, op_level=False)
            done.append(name)
        elif choice == "op":
            _recompute(block, op_level=True)
            done.append(name)
        elif choice == "attention":
            part = getattr(block, attention, None) if attention else None
            if not isinstance(part, nn.Module):
                raise ValueError(f"selective_ac='attention' needs the model's ParallelSpec.block_attention to name "
                                 f"a submodule of each block (got {attention!r}); use selective_ac='op' or a stride k")
            _recompute(part, op_level=False)
            done.append(f"{name}.{attention}")
    return done


# Test switch: False leaves torch's cache keys as they are, the same on every rank, which loads another rank's compiled
# graph for a TP block from the cache folder the ranks of a machine share (docs/compile-tp-repro.py --cache shared).
RANK_COMPILE_CACHE_KEYS = True
_RANK_TAG = re.compile(r"lh-rank[^|]*")  # this module's part of the tag


def _mesh_fingerprint(blocks: nn.Module) -> str:
    """A short digest of the device mesh of the first DTensor parameter in ``blocks`` (its dimension names and ranks),
    or ``""``: a rank's compiled TP graph depends on its coordinate in that mesh, not on its rank number alone."""
    import hashlib

    from torch.distributed.tensor import DTensor

    for param in blocks.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            text = f"{mesh.mesh_dim_names}:{mesh.mesh.tolist()}"
            return hashlib.sha1(text.encode()).hexdigest()[:12]
    return ""


def rank_compile_cache_key(rank: int, world_size: int, mesh: str = "") -> str:
    """Make this rank's AOTAutograd and inductor graph cache entries its own: ``lh-rank<rank>of<world>[-<mesh>]`` in
    ``torch.compiler.config.cache_key_tag``, beside any tag the user set (a second call replaces its own part).

    On torch 2.13 the AOTAutograd cache key of a graph over DTensors is the same on every rank, but the compiled
    graph can hold the rank's mesh coordinate (the backward of a traced ``Shard -> Replicate`` all-gather takes this
    rank's chunk of the gradient). The ranks of a machine share one cache folder, so a rank's second compile of such
    a graph (a restart, a second run, another block's shape) could load another rank's graph: wrong gradients, no
    error (docs/performance.md). The tag enters both keys (AOTAutograd's and inductor's FX graph cache), so every
    rank finds only its own entries; a restarted job still loads them instead of recompiling.

    The kernel cache stays shared by the ranks of a machine: a kernel's file is named by the hash of its source, and
    inductor builds each one under a file lock, so one rank compiles it and the others load it (a cache folder per
    rank compiled every kernel once per rank, and precompiled the C++ headers once per rank).

    Returns:
        The tag now in ``torch.compiler.config.cache_key_tag``.
    """
    import torch.compiler.config as compiler_config

    own = f"lh-rank{rank}of{world_size}" + (f"-{mesh}" if mesh else "")
    others = [part for part in compiler_config.cache_key_tag.split("|") if part and not _RANK_TAG.fullmatch(part)]
    compiler_config.cache_key_tag = "|".join([*others, own])
    return compiler_config.cache_key_tag


# Test switch: False compiles the TP parts as before the workaround (their call, donated buffers on), which trains
# with wrong gradients under sequence parallelism or recompute (tests/test_compile_tp.py shows it).
TP_COMPILE_WORKAROUND = True


def _compiled_part_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Inductor "donates" saved activations to its backward (overwrites them in place). Under recompute the
    # tensors a compiled region saves come back from the non-reentrant checkpoint's replay, shared with the
    # eager ops around it, and the donation overwrote them: wrong gradients (docs/performance.md). Off for
    # these graphs only; the flag is read when the graph is compiled, on its first call.
    with torch._functorch.config.patch(donated_buffer=False):
        return self._compiled_forward_fn(self, *args, **kwargs)


def compile_blocks(blocks: nn.ModuleDict, parts: Optional[tuple[str, ...]] = None,
                   **compile_kwargs: Any) -> list[str]:
    """``torch.compile`` each block in place (names and parameters unchanged).

    Without ``parts`` (no tensor parallelism) the whole block is compiled (``nn.Module.compile``). With ``parts``
    (the strategy passes attention and MLP under tensor parallelism) the ``forward`` of those submodules is
    compiled and the rest of the block (norms, residual adds) runs eagerly. Two things make this exact on
    torch 2.13 under TP with sequence parallelism and recompute (see docs/performance.md and
    docs/compile-tp-repro.py):

    * the part's ``forward`` is compiled, not its call: the TP hooks registered on the part itself (the
      sequence-parallel all-gather of ``PrepareModuleInput``) stay eager at the graph boundary, so the graph
      gets a replicated DTensor instead of redistributing its input inside;
    * inductor's donated buffers are off for these graphs (see :func:`_compiled_part_forward`).

    In a distributed job each rank's graphs get cache keys of their own (:func:`rank_compile_cache_key`): with
    torch's keys, the same on every rank, a rank could load another rank's compiled TP graph from the cache folder
    the ranks of a machine share. The compiled kernels stay shared: each is built once per machine.

    A part that is itself recomputed (``selective_ac="attention"``) runs its compiled forward inside the eager
    checkpoint.

    Returns:
        The names (relative to ``blocks``) of the compiled modules.
    """
    import torch.distributed as dist

    if RANK_COMPILE_CACHE_KEYS and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # compiling is lazy: the tag is in place before the first forward computes a cache key
        rank_compile_cache_key(dist.get_rank(), dist.get_world_size(), _mesh_fingerprint(blocks))
    done = []
    compiled_fns: dict[type, Callable[..., Any]] = {}
    for name, block in blocks.items():
        if not parts:
            block.compile(**compile_kwargs)
            done.append(name)
            continue
        for part_name in parts:
            part = getattr(block, part_name)
            if not TP_COMPILE_WORKAROUND:
                part.compile(**compile_kwargs)
                done.append(f"{name}.{part_name}")
                continue
            cls = type(part)
            if cls not in compiled_fns:  # one compiled function per class: blocks of one shape share its graph
                compiled_fns[cls] = torch.compile(cls.forward, **compile_kwargs)
            part._compiled_forward_fn = compiled_fns[cls]
            if recomputed(part):  # the checkpoint (eager) replays the compiled forward
                part._recompute_body = _compiled_part_forward
            else:
                part.forward = types.MethodType(_compiled_part_forward, part)
            done.append(f"{name}.{part_name}")
    return done


def compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module`` (its call or its forward)."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_compiled_forward_fn")
