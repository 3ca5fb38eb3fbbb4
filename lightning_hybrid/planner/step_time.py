"""GPU table, step-time model and checkpoint interval of the planner.

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

import math
from dataclasses import dataclass, replace
from typing import Optional

__all__ = ["GPU", "GPUS", "Hardware", "collective_seconds", "young_daly_interval", "checkpoint_plan",
           "DEFAULT_GPU_MTBF_HOURS", "DEFAULT_STORAGE_GBPS", "DEFAULT_RESTART_SECONDS"]


@dataclass(frozen=True)
class GPU:
    """Datasheet figures of one accelerator model.

    Args:
        name: table key.
        memory_gb: HBM capacity in GB (1e9 bytes) as sold.
        peak_tflops: dense (no sparsity) bf16/fp16 tensor-core peak, TFLOP/s.
        fp32_tflops: fp32 peak without tensor cores (``32-true`` with torch's default matmul precision).
        nvlink_gbs: NVLink bandwidth per direction per GPU, GB/s.
        network_gbits: inter-node network bandwidth per GPU (one NIC per GPU), Gb/s.
        hbm_tbs: memory bandwidth, TB/s.
        nvlinks: NVLink links per GPU.
        pcie_gen: PCIe generation of the host link.
    """

    name: str
    memory_gb: float
    peak_tflops: float
    fp32_tflops: float
    nvlink_gbs: float
    network_gbits: float
    hbm_tbs: float
    nvlinks: int
    pcie_gen: int


GPUS: dict[str, GPU] = {
    # H100/H200 SXM: NVLink 4 (18 links x 25 GB/s per direction), ConnectX-7 400 Gb/s per GPU.
    "h100": GPU("h100", 80, 989, 67, 450, 400, 3.35, 18, 5),
    "h200": GPU("h200", 141, 989, 67, 450, 400, 4.8, 18, 5),
    # B200: NVLink 5 (18 links x 50 GB/s per direction), ConnectX-7 400 Gb/s per GPU.
    "b200": GPU("b200", 180, 2250, 80, 900, 400, 8.0, 18, 5),
    # B300 (Blackwell Ultra): same dense bf16 and NVLink 5, 288 GB, ConnectX-8 800 Gb/s per GPU.
    "b300": GPU("b300", 288, 2250, 75, 900, 800, 8.0, 18, 6),
}

DEFAULT_GPU_MTBF_HOURS = 50_000.0
"""Mean time between job-interrupting failures per GPU, hours. The Llama 3 paper (Meta, 2024) reports
419 unexpected interruptions in 54 days on 16,384 H100s (GPUs, hosts, network, software), one per
~3.1 h for the job, i.e. about 50,000 GPU-hours per interruption; a job of N GPUs sees MTBF/N."""
DEFAULT_STORAGE_GBPS = 1.0
"""Checkpoint write bandwidth per GPU to shared storage, GB/s, for the estimated save time."""
DEFAULT_RESTART_SECONDS = 600.0
"""Time to detect a failure, restart the job and reload the last checkpoint, seconds."""


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
    intra_latency_s: float = 20e-6
    inter_latency_s: float = 40e-6
    reserved_gb: float = 4.0
    fragmentation: float = 0.05

    @property
    def usable_bytes(self) -> float:
        """Bytes a rank can fill with model, optimizer and activations."""
        return max(0.0, (self.gpu.memory_gb - self.reserved_gb) * (1 - self.fragmentation)) * 1e9

    def peak_flops(self, precision: str) -> float:
        return (self.gpu.fp32_tflops if precision == "32-true" else self.gpu.peak_tflops) * 1e12

    def bus_bandwidth(self, inter_node: bool) -> float:
        """Achievable bus bandwidth of a collective in bytes/s, inside a node or across nodes."""
        link = self.gpu.network_gbits / 8 if inter_node else self.gpu.nvlink_gbs
        return link * 1e9 * self.link_efficiency

    def latency(self, inter_node: bool) -> float:
        return self.inter_latency_s if inter_node else self.intra_latency_s

    def with_overrides(self, memory_gb: Optional[float] = None, peak_tflops: Optional[float] = None,
                       nvlink_gbs: Optional[float] = None, network_gbits: Optional[float] = None) -> "Hardware":
        """A copy with the given GPU figures replaced (``None`` keeps the table value)."""
        changes = {k: v for k, v in dict(memory_gb=memory_gb, peak_tflops=peak_tflops, nvlink_gbs=nvlink_gbs,
                                         network_gbits=network_gbits).items() if v is not None}
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


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> tuple[float, float]:
    """(Young's ``sqrt(2 delta M)``, Daly's higher-order refinement) checkpoint intervals in seconds."""
    young = math.sqrt(2 * save_seconds * mtbf_seconds)
    if save_seconds >= 2 * mtbf_seconds:
        return young, mtbf_seconds
    ratio = save_seconds / (2 * mtbf_seconds)
    daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_seconds
    return young, daly


def checkpoint_plan(checkpoint_bytes_per_gpu: float, gpus: int, step_seconds: float,
                    save_seconds: Optional[float] = None, mtbf_hours: Optional[float] = None,
                    storage_gbps: float = DEFAULT_STORAGE_GBPS,
                    restart_seconds: float = DEFAULT_RESTART_SECONDS) -> dict[str, float]:
    """Young/Daly checkpoint interval and the expected fraction of time lost to checkpoints and failures.

    Args:
        checkpoint_bytes_per_gpu: bytes each rank writes (its parameter and optimizer shards).
        gpus: GPUs in the job.
        step_seconds: predicted optimizer step time.
        save_seconds: blocking time of one save; ``None`` estimates ``bytes / storage_gbps``.
        mtbf_hours: mean time between failures of the whole job; ``None`` uses
            ``DEFAULT_GPU_MTBF_HOURS / gpus``.
        storage_gbps: write bandwidth per GPU, GB/s, for the estimate.
        restart_seconds: restart and reload time after a failure.

    Returns:
        ``save_seconds``, ``mtbf_hours``, ``interval_seconds`` (Daly), ``young_seconds``, ``interval_steps``
        and ``lost_fraction``: ``save/T + (T/2 + restart)/MTBF``.
    """
    save = save_seconds if save_seconds is not None else checkpoint_bytes_per_gpu / (storage_gbps * 1e9)
    mtbf_h = mtbf_hours if mtbf_hours is not None else DEFAULT_GPU_MTBF_HOURS / gpus
    mtbf = mtbf_h * 3600
    young, daly = young_daly_interval(max(save, 1e-6), mtbf)
    interval = max(daly, step_seconds)
    lost = save / interval + (interval / 2 + restart_seconds) / mtbf
    return {"save_seconds": save, "mtbf_hours": mtbf_h, "young_seconds": young, "interval_seconds": interval,
            "interval_steps": max(1, round(interval / step_seconds)) if step_seconds > 0 else 1,
            "restart_seconds": restart_seconds, "lost_fraction": min(1.0, lost)}
