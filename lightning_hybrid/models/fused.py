"""Linears that read the same input, run as one GEMM: q, k and v of attention, gate and up of SwiGLU.

The parts keep their own parameters (``q_proj.weight``, ``k_proj.weight``, ...): Hugging Face's names, so checkpoints,
``export-hf`` and resharding do not change, and under tensor parallelism each part keeps its own row split (whole
heads and whole key/value groups on every rank). :class:`FusedLinear` holds no parameter; its owner passes the parts'
weights and biases in each call, and it concatenates them along the output rows for one matrix product, then splits
the result back into the parts' outputs. A strategy that shards the parts hands it this rank's shards (see
``lightning_hybrid.distributed.tensor_parallel.FusedColwiseParallel``): the concatenation of local shards is then
this rank's whole heads of q, k and v in one matrix, and the split uses the local sizes.

The concatenated weight is never kept for backward (:class:`_FusedLinearFunction` keeps the parts and concatenates
them again there): it costs a copy of the parts' weights per forward and per backward, no memory between them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedLinear", "fused_linear"]


def _autocast(device: str) -> bool:
    return device in ("cpu", "cuda") and torch.is_autocast_enabled(device)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would compute in: autocast's when it is on for ``x``'s device, else ``x``'s own."""
    return torch.get_autocast_dtype(x.device.type) if _autocast(x.device.type) else x.dtype


class _FusedLinearFunction(torch.autograd.Function):
    """``x @ cat(weights).T + cat(biases)`` that keeps ``x`` and the parts for backward, not their concatenation.

    Runs in ``dtype`` (autocast's, decided by the caller) with autocast off inside, so the casts are the ones
    autocast would make: ``x`` and each weight to ``dtype``, gradients back to their own dtypes.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, dtype: torch.dtype, bias: bool, *params: Tensor) -> Tensor:
        # the parts' count from the argument tuple's length, not an int argument: torch.compile would make an int
        # that differs between calls (3 for q/k/v, 2 for gate/up) a symbolic one, which cannot slice a tuple
        count = len(params) // 2 if bias else len(params)
        weights, biases = params[:count], params[count:]
        xc = x.to(dtype)
        weight = torch.cat([w.to(dtype) for w in weights])
        bias = torch.cat([b.to(dtype) for b in biases]) if biases else None
        if _autocast(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(xc, weight, bias)
        else:
            out = F.linear(xc, weight, bias)
        ctx.save_for_backward(xc, *weights)
        ctx.count, ctx.dtype, ctx.x_dtype = count, dtype, x.dtype
        ctx.bias_dtypes = [b.dtype for b in biases]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        xc, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad = grad.to(ctx.dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        sizes = [w.shape[0] for w in weights]
        grad_x = None
        if needs[0]:
            weight = torch.cat([w.to(ctx.dtype) for w in weights])
            grad_x = (flat_grad @ weight).reshape(*grad.shape[:-1], weight.shape[1]).to(ctx.x_dtype)
        grad_weights: list[Optional[Tensor]] = [None] * ctx.count
        if any(needs[3:3 + ctx.count]):
            full = flat_grad.t() @ xc.reshape(-1, xc.shape[-1])
            grad_weights = [g.to(w.dtype) if need else None
                            for g, w, need in zip(full.split(sizes), weights, needs[3:3 + ctx.count])]
        grad_biases: list[Optional[Tensor]] = [None] * len(ctx.bias_dtypes)
        if any(needs[3 + ctx.count:]):
            summed = flat_grad.sum(0).split(sizes)
            grad_biases = [g.to(dtype) if need else None
                           for g, dtype, need in zip(summed, ctx.bias_dtypes, needs[3 + ctx.count:])]
        return (grad_x, None, None, *grad_weights, *grad_biases)


def fused_linear(x: Tensor, weights: Sequence[Tensor], biases: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
    """The outputs of the linears ``(weights[i], biases[i])`` on ``x``, computed as one GEMM.

    Args:
        x: (..., in_features).
        weights: (out_i, in_features) each.
        biases: one per weight (out_i,), or ``None``.

    Returns:
        The parts' outputs, (..., out_i) each (views of one tensor).
    """
    params = [*weights, *(biases or ())]
    out = _FusedLinearFunction.apply(x, _compute_dtype(x), bool(biases), *params)
    return list(out.split([w.shape[0] for w in weights], dim=-1))


class FusedLinear(nn.Module):
    """Several linears of one input as one GEMM; holds no parameter (the parts keep theirs, under their own names).

    ``fused(x, weights, biases)`` returns the parts' outputs in order. The module exists so a strategy can act on
    the fused product as a whole (tensor parallelism's local shards, float8's one cast and GEMM) while the model
    code stays single-device.

    Args:
        parts: the names of the linears it fuses, attributes of its owner (``("q_proj", "k_proj", "v_proj")``).
    """

    def __init__(self, parts: Sequence[str]) -> None:
        super().__init__()
        self.parts = tuple(parts)

    def forward(self, x: Tensor, weights: Sequence[Tensor], biases: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
        return fused_linear(x, weights, biases)

    def extra_repr(self) -> str:
        return f"parts={self.parts}"

    def run(self, owner: nn.Module, x: Tensor) -> list[Tensor]:
        """The outputs of ``owner``'s parts on ``x``: one call of this module with their current weights (the
        sharded, gathered or cast tensors a strategy put there) and biases."""
        linears = [getattr(owner, name) for name in self.parts]
        biases = None if linears[0].bias is None else [linear.bias for linear in linears]  # all or none
        return self(x, [linear.weight for linear in linears], biases)
