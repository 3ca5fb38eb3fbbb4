"""Rotary position embeddings of the decoder core: plain RoPE and the ``llama3`` and ``yarn`` scalings.

The frequencies follow ``transformers``' ``modeling_rope_utils`` step by step in fp32 (the same operations in the same
order), so the tables, and the logits of a loaded checkpoint, equal the reference model's.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid.models.decoder.families import RopeScaling

__all__ = ["inverse_frequencies", "rotary_tables", "rotary_at", "rotary_for", "apply_rotary", "RotaryTables"]


def inverse_frequencies(head_dim: int, theta: float, device: Optional[torch.device] = None,
                        scaling: Optional[RopeScaling] = None) -> Tensor:
    """The ``head_dim / 2`` rotation frequencies (fp32), scaled by ``scaling`` when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    return _yarn(head_dim, theta, device, scaling)


def _llama3(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor
                                                                                   - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, device: Optional[torch.device], s: RopeScaling) -> Tensor:
    """YaRN: a linear ramp over the dimensions, from extrapolated (original) to interpolated (``/ factor``)."""
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1
    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # the share of the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                  dtype: torch.dtype, scaling: Optional[RopeScaling] = None) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (seq_len, head_dim) for the half-split rotary layout (positions ``0 .. seq_len-1``)."""
    return rotary_at(torch.arange(seq_len, device=device), head_dim, theta, dtype, scaling)


def rotary_at(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
              scaling: Optional[RopeScaling] = None) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (*positions.shape, head_dim) at the given token positions (1-D: global positions;
    (batch, seq): the per-document ``position_ids`` of a packed batch); YaRN's attention factor scales both."""
    inv_freq = inverse_frequencies(head_dim, theta, positions.device, scaling)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    scale = scaling.cos_sin_scale if scaling is not None else 1.0
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim): pairs (i, i + head_dim/2) turn by position * freq_i."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin



def rotary_for(seq: int, device: torch.device, dtype: torch.dtype, head_dim: int, theta: float,
               scaling: Optional[RopeScaling] = None, position_ids: Optional[Tensor] = None,
               core: Any = None) -> tuple[Tensor, Tensor]:
    """cos and sin for a sequence of ``seq`` tokens: with ``position_ids`` (batch, seq), a packed batch's positions
    restarting at each document, of shape (batch, 1, seq, head_dim); else at the positions the attention ``core``
    gives (``0 .. seq-1``, or this rank's head and tail chunks under context parallelism), of shape (seq, head_dim)."""
    if position_ids is not None:
        cos, sin = rotary_at(position_ids, head_dim, theta, dtype, scaling)
        return cos.unsqueeze(1), sin.unsqueeze(1)
    positions = core.positions(seq, device) if core is not None else torch.arange(seq, device=device)
    return rotary_at(positions, head_dim, theta, dtype, scaling)

class RotaryTables(nn.Module):
    """cos and sin at the positions in use, made once per forward of a model (or of a pipeline stage) and passed to
    every attention layer, instead of once per layer.

    ``tables(hidden, position_ids=None, core=None)``: with ``position_ids`` (batch, seq), a packed batch's positions
    restarting at each document, tables of shape (batch, 1, seq, head_dim); else the positions the attention
    ``core`` gives for the ``hidden.shape[1]`` tokens of the sequence (``0 .. seq-1``, or this rank's head and tail
    chunks under context parallelism), tables of shape (seq, head_dim). The values are :func:`rotary_at`'s, in the
    dtype the projections compute in (autocast's when it is on), so each layer gets what it computed before.

    Holds no parameter or buffer. Under sequence parallelism a strategy hands it the hidden states as a sequence
    shard that knows its global length (the tables cover the whole sequence the attention sees).
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def forward(self, hidden: Tensor, position_ids: Optional[Tensor] = None, core: Any = None) -> tuple[Tensor, Tensor]:
        device = hidden.device
        dtype = hidden.dtype
        if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        return rotary_for(hidden.shape[1], device, dtype, self.head_dim, self.theta, self.scaling, position_ids, core)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"
