"""Cluster figures and the collective-time model of the planner's step-time estimate.

The GPU figures come from :mod:`lightning_hybrid.hardware`; :class:`Hardware` adds the cluster (GPU count,
GPUs per node) and the efficiencies the estimate assumes. :func:`lightning_hybrid.planner.search.estimate`
adds the terms up.

The step time of a layout is the sum of

* compute: the slowest pipeline stage's FLOPs per micro-batch times the number of micro-batches, at
  ``peak * efficiency``. FLOPs per token are ``6 N + 12 L h s`` (N the matmul parameters, PaLM/torchtitan
  convention), ``8 N + 16 L h s`` with full recompute.
* TP communication: per block and micro-batch, two all-reduces of the activations in forward and two
  in backward (four reduce-scatter/all-gather pairs with sequence parallel, the same bus traffic), two
  more forward with full recompute, plus the embedding's all-reduce and the gathered logits. Not
  overlapped with compute (torch's TP issues them on the compute stream).
* PP bubble: ``(pp - 1) / virtual_stages`` micro-batch times of the slowest stage, plus the point-to-point
  transfers of warm-up and cool-down (steady-state transfers overlap with compute).
* DP communication: ``replicate`` all-reduces the gradients once per step after backward (exposed);
  FSDP without a pipeline all-gathers in forward and backward and reduce-scatters per micro-batch, with
  prefetch overlapping that with compute (only the excess is exposed); FSDP under a pipeline keeps the
  stage unsharded through the step, so one all-gather and one reduce-scatter per step, exposed.
* the optimizer step, bound by memory bandwidth.

Collective times use nccl-tests' bus bandwidth: ``t = latency + bytes * f / busbw`` with ``f = 2(n-1)/n``
for all-reduce and ``(n-1)/n`` for all-gather and reduce-scatter, and ``busbw = link bandwidth *
link_efficiency``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lightning_hybrid.hardware import GPU, NETWORK_LATENCY_S, NVLINK_LATENCY_S

__all__ = ["Hardware", "collective_seconds"]


@dataclass(frozen=True)
class Hardware:
    """The cluster the planner plans for: a GPU type with its figures overridden by flags.

    Args:
        gpu: the GPU figures.
        gpus: total GPUs.
        gpus_per_node: GPUs per node (TP stays inside a node).
        compute_efficiency: fraction of peak that large matmuls reach.
        link_efficiency: fraction of link bandwidth that collectives reach (busbw / link).
        intra_latency_s, inter_latency_s: fixed cost of one collective inside a node / across nodes.
        reserved_gb: memory the framework takes before the model (CUDA context, NCCL buffers, workspaces).
        fragmentation: fraction of the remaining memory lost to allocator fragmentation.
    """

    gpu: GPU
    gpus: int
    gpus_per_node: int
    compute_efficiency: float = 0.75
    link_efficiency: float = 0.8
    intra_latency_s: float = NVLINK_LATENCY_S
    inter_latency_s: float = NETWORK_LATENCY_S
    reserved_gb: float = 4.0
    fragmentation: float = 0.05

    @property
    def usable_bytes(self) -> float:
        """Bytes a rank can fill with model, optimizer and activations."""
        return max(0.0, (self.gpu.memory_gb - self.reserved_gb) * (1 - self.fragmentation)) * 1e9

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s of one GPU: fp32 for ``32-true``, else the bf16 tensor-core peak."""
        peak = self.gpu.peak.fp32 if precision == "32-true" else self.gpu.peak.bf16
        if peak is None:
            raise ValueError(f"GPU {self.gpu.name} lists no peak for precision={precision!r}; pass --peak-tflops")
        return peak

    def bus_bandwidth(self, inter_node: bool) -> float:
        """Achievable bus bandwidth of a collective in bytes/s, inside a node or across nodes."""
        link = self.gpu.network_gbs if inter_node else self.gpu.nvlink_gbs
        return link * 1e9 * self.link_efficiency

    def latency(self, inter_node: bool) -> float:
        """Fixed cost in seconds of one collective inside a node or across nodes."""
        return self.inter_latency_s if inter_node else self.intra_latency_s

    def with_overrides(self, memory_gb: Optional[float] = None, peak_tflops: Optional[float] = None,
                       nvlink_gbs: Optional[float] = None, network_gbits: Optional[float] = None) -> "Hardware":
        """A copy with the given GPU figures replaced (``None`` keeps the table value).

        ``peak_tflops`` replaces the dense bf16 peak (TFLOP/s), the one mixed and half precision plan with.
        """
        changes: dict[str, object] = {k: v for k, v in dict(memory_gb=memory_gb, nvlink_gbs=nvlink_gbs,
                                                            network_gbits=network_gbits).items() if v is not None}
        if peak_tflops is not None:
            changes["peak"] = replace(self.gpu.peak, bf16=peak_tflops * 1e12)
        return replace(self, gpu=replace(self.gpu, **changes)) if changes else self


def collective_seconds(kind: str, nbytes: float, ranks: int, bus_bandwidth: float, latency: float) -> float:
    """Time of one collective over ``ranks`` with nccl-tests' bus-bandwidth factors.

    ``nbytes`` is the buffer nccl-tests calls the size: the all-reduce buffer, the all-gather output or
    the reduce-scatter input. ``p2p`` moves ``nbytes`` one way.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
              "reduce_scatter": (ranks - 1) / ranks, "p2p": 1.0}[kind]
    return latency + nbytes * factor / bus_bandwidth
