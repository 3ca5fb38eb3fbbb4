"""Mesh-independent parameter initialization, keyed by parameter name.

Every parameter is drawn from a random stream keyed by (seed, parameter name, row block), never by
rank, so a shard holds exactly the values the full tensor would hold at its place: the same seed
gives the same model on one process and on any tp x pp x dp mesh. A rank generates only the row
blocks its shard overlaps, one block (about a million values) at a time.

A ground-floor module: the single-device models (:mod:`lightning_hybrid.models`, which initialize and load weights
by name) and the parallel side (:mod:`lightning_hybrid.distributed`) both use it; it imports neither.
:func:`local_region` reads a DTensor's shard through torch's DTensor API, imported when a parameter is one.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import Tensor, nn

__all__ = ["init_parameters", "fill_normal_region", "canonical_name", "local_region"]

_BLOCK_ELEMENTS = 1 << 20
# Wrappers that insert a level into parameter names: activation checkpointing and torch.compile.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """The parameter name without the levels that wrappers (checkpointing, compile) insert."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _stream_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def fill_normal_region(out: Tensor, global_shape: tuple[int, ...], offset: tuple[int, ...], std: float,
                       seed: int, name: str) -> None:
    """Fill ``out`` with the values N(0, std) that the full tensor of ``global_shape`` holds at ``offset``.

    ``out`` may be any contiguous slice of a 1-D or 2-D tensor (rows and/or columns), or any box of a 3-D tensor
    (experts of a mixture, ``(experts, rows, cols)``): each expert ``e`` is the 2-D tensor of its own stream
    ``{name}.{e}``, so a rank holding some experts (or some rows of them) draws only those.

    Raises:
        ValueError: the tensor has more than three dimensions.
    """
    if len(global_shape) == 3:
        for i in range(out.shape[0]):
            fill_normal_region(out[i], global_shape[1:], offset[1:], std, seed, f"{name}.{offset[0] + i}")
        return
    if len(global_shape) > 3:
        raise ValueError(f"parameter {name} has shape {tuple(global_shape)}; only 1-D to 3-D are supported")
    rows = global_shape[0]
    cols = global_shape[1] if len(global_shape) == 2 else 1
    local = out.view(out.shape[0], -1) if out.dim() == 2 else out.view(-1, 1)
    row0 = offset[0]
    col0 = offset[1] if len(offset) == 2 else 0
    nrows, ncols = local.shape
    if nrows == 0 or ncols == 0:
        return
    block_rows = max(1, _BLOCK_ELEMENTS // cols)
    generator = torch.Generator(device=out.device)
    for block in range(row0 // block_rows, (row0 + nrows - 1) // block_rows + 1):
        start = block * block_rows
        height = min(block_rows, rows - start)
        generator.manual_seed(_stream_seed(seed, name, block))
        values = torch.empty(height, cols, device=out.device, dtype=torch.float32)
        values.normal_(0.0, std, generator=generator)
        lo, hi = max(start, row0), min(start + height, row0 + nrows)
        local[lo - row0:hi - row0].copy_(values[lo - start:hi - start, col0:col0 + ncols])


def local_region(param: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, global offset of the local tensor) for a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(f"unexpected local shard shape {tuple(local.shape)} != {tuple(shape)}")
        return local, tuple(param.shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, rule: Callable[[str], tuple[str, float]]) -> None:
    """Initialize every parameter of ``module`` (plain, TP-sharded or FSDP-sharded) independently of the mesh.

    Args:
        module: the model, possibly a pipeline stage (parameter names must be the global ones).
        seed: the run's seed.
        rule: parameter name -> ``("normal", std)``, ``("ones", _)`` or ``("zeros", _)``.

    Raises:
        ValueError: ``rule`` names an unknown kind.
    """
    for raw_name, param in module.named_parameters():
        name = canonical_name(raw_name)
        kind, std = rule(name)
        local, shape, offset = local_region(param)
        if kind == "ones":
            local.fill_(1.0)
        elif kind == "zeros":
            local.zero_()
        elif kind == "normal":
            if local.dtype == torch.float32 and local.is_contiguous():
                fill_normal_region(local, shape, offset, std, seed, name)
            else:  # draw in fp32 so every dtype starts from the same values, then cast
                buffer = torch.empty(local.shape, device=local.device, dtype=torch.float32)
                fill_normal_region(buffer, shape, offset, std, seed, name)
                local.copy_(buffer)
        else:
            raise ValueError(f"unknown init kind {kind!r} for parameter {name}; use normal, ones or zeros")
