"""The GPU table: datasheet figures of every accelerator the package knows, and the device-name lookup.

One entry per GPU model holds its dense (no sparsity) peak FLOP/s per compute dtype and, for the models
the planner and the preflight plan for, its memory, memory bandwidth, NVLink and network figures. The
throughput monitor reads the peaks (MFU), the planner all of it (memory, step time), the preflight the
link figures (expected bandwidth and NVLink count). Figures are NVIDIA's datasheet numbers; the "with
sparsity" numbers in the datasheets are twice the dense ones.

This module imports nothing from ``lightning_hybrid`` so that every part of the package can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

__all__ = ["DTYPES", "PeakFlops", "GPU", "GPUS", "SYSTEM_GPUS", "BITS_PER_BYTE", "NVLINK_LATENCY_S",
           "NETWORK_LATENCY_S", "normalize_dtype", "gpu_from_device_name"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Compute dtypes the peak table lists: fp32 is the non-tensor-core rate, tf32 what fp32 matmuls run at
when TF32 is allowed."""

_DTYPE_ALIASES = {"float32": "fp32", "32": "fp32", "32-true": "fp32", "bfloat16": "bf16", "bf16-true": "bf16",
                  "bf16-mixed": "bf16", "float16": "fp16", "16": "fp16", "16-true": "fp16", "16-mixed": "fp16",
                  "tfloat32": "tf32", "float8": "fp8", "transformer-engine": "fp8",
                  "transformer-engine-float16": "fp8"}

BITS_PER_BYTE = 8  # network figures are sold in Gb/s, bus bandwidths are measured in GB/s
NVLINK_LATENCY_S = 20e-6
"""Fixed cost of one collective between GPUs of a node (NVLink), seconds (nccl-tests small-message times)."""
NETWORK_LATENCY_S = 40e-6
"""Fixed cost of one collective across nodes (InfiniBand/RoCE), seconds."""


def normalize_dtype(dtype: str) -> str:
    """``"bf16"``, ``"fp16"``, ``"fp32"``, ``"tf32"`` or ``"fp8"`` from a dtype or Lightning precision name.

    Raises:
        ValueError: the name is not known.
    """
    key = str(dtype).lower().replace("torch.", "")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not known; use one of {', '.join(DTYPES)} (or a Lightning precision)")
    return key


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s of one GPU per compute dtype; ``None`` where the datasheet lists none."""

    fp32: Optional[float] = None
    tf32: Optional[float] = None
    bf16: Optional[float] = None
    fp16: Optional[float] = None
    fp8: Optional[float] = None

    def get(self, dtype: str) -> Optional[float]:
        """The peak for a dtype or Lightning precision name (``None`` when not listed).

        Raises:
            ValueError: the dtype is not known.
        """
        return getattr(self, normalize_dtype(dtype))


@dataclass(frozen=True)
class GPU:
    """Datasheet figures of one accelerator model; the system figures are ``None`` where not tabulated.

    Args:
        name: table key (``h100`` is the SXM part; PCIe and NVL parts have their own keys).
        peak: dense peak FLOP/s per dtype.
        memory_gb: HBM capacity in GB (1e9 bytes) as sold.
        hbm_tbs: memory bandwidth, TB/s.
        nvlink_gbs: NVLink bandwidth per direction per GPU, GB/s.
        nvlinks: NVLink links per GPU.
        network_gbits: inter-node network bandwidth per GPU (one NIC per GPU), Gb/s.
        pcie_gen: PCIe generation of the host link.
    """

    name: str
    peak: PeakFlops
    memory_gb: Optional[float] = None
    hbm_tbs: Optional[float] = None
    nvlink_gbs: Optional[float] = None
    nvlinks: Optional[int] = None
    network_gbits: Optional[float] = None
    pcie_gen: Optional[int] = None

    @property
    def peak_tflops(self) -> float:
        """Dense bf16 tensor-core peak, TFLOP/s (0 when not listed)."""
        return (self.peak.bf16 or 0.0) / 1e12

    @property
    def fp32_tflops(self) -> float:
        """fp32 peak without tensor cores, TFLOP/s (0 when not listed)."""
        return (self.peak.fp32 or 0.0) / 1e12

    @property
    def network_gbs(self) -> Optional[float]:
        """Inter-node network bandwidth per GPU in GB/s (bytes), as bus bandwidths are given."""
        return self.network_gbits / BITS_PER_BYTE if self.network_gbits is not None else None

    @property
    def has_system_figures(self) -> bool:
        """Whether memory, bandwidths and links are all tabulated (what the planner and preflight need)."""
        return all(getattr(self, f.name) is not None for f in fields(self))


# Shared compute figures: parts of one family with the same chip and clocks have the same peaks.
HOPPER_SXM = PeakFlops(fp32=66.9e12, tf32=494.7e12, bf16=989.4e12, fp16=989.4e12, fp8=1978.9e12)
HOPPER_NVL = PeakFlops(fp32=60e12, tf32=417.5e12, bf16=835.5e12, fp16=835.5e12, fp8=1670.5e12)
BLACKWELL_HGX = PeakFlops(fp32=75e12, tf32=1.125e15, bf16=2.25e15, fp16=2.25e15, fp8=4.5e15)  # HGX B200/B300 / 8
GRACE_BLACKWELL = PeakFlops(tf32=1.25e15, bf16=2.5e15, fp16=2.5e15, fp8=5e15)  # GB200/GB300 NVL72 / 72

GPUS: dict[str, GPU] = {
    "a100": GPU("a100", PeakFlops(fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12)),  # Ampere has no fp8
    # H100/H200 SXM: NVLink 4 (18 links x 25 GB/s per direction), ConnectX-7 400 Gb/s per GPU.
    "h100": GPU("h100", HOPPER_SXM, memory_gb=80, hbm_tbs=3.35, nvlink_gbs=450, nvlinks=18, network_gbits=400,
                pcie_gen=5),
    "h100 pcie": GPU("h100 pcie", PeakFlops(fp32=51.2e12, tf32=378e12, bf16=756e12, fp16=756e12, fp8=1513e12)),
    "h100 nvl": GPU("h100 nvl", HOPPER_NVL),
    # H200: the H100 SXM's compute with more and faster memory.
    "h200": GPU("h200", HOPPER_SXM, memory_gb=141, hbm_tbs=4.8, nvlink_gbs=450, nvlinks=18, network_gbits=400,
                pcie_gen=5),
    "h200 nvl": GPU("h200 nvl", HOPPER_NVL),
    # B200: NVLink 5 (18 links x 50 GB/s per direction), ConnectX-7 400 Gb/s per GPU.
    "b200": GPU("b200", BLACKWELL_HGX, memory_gb=180, hbm_tbs=8.0, nvlink_gbs=900, nvlinks=18, network_gbits=400,
                pcie_gen=5),
    # B300 (Blackwell Ultra): adds dense fp4, not bf16/fp8; 288 GB, ConnectX-8 800 Gb/s per GPU.
    "b300": GPU("b300", BLACKWELL_HGX, memory_gb=288, hbm_tbs=8.0, nvlink_gbs=900, nvlinks=18, network_gbits=800,
                pcie_gen=6),
    "gb200": GPU("gb200", GRACE_BLACKWELL),
    "gb300": GPU("gb300", GRACE_BLACKWELL),
}

SYSTEM_GPUS: dict[str, GPU] = {key: gpu for key, gpu in GPUS.items() if gpu.has_system_figures}
"""The GPUs with memory, bandwidth and link figures: those the planner and the preflight know."""


def gpu_from_device_name(device_name: str) -> Optional[GPU]:
    """The table entry for a ``torch.cuda.get_device_name()`` or NVML name, ``None`` when not listed.

    ``"NVIDIA H100 80GB HBM3"`` is ``h100`` (SXM), ``"NVIDIA H100 PCIe"`` ``h100 pcie``, ``"NVIDIA GH200"``
    ``h200`` (it holds an H200-class GPU), ``"NVIDIA GB200"`` ``gb200``.
    """
    name = device_name.lower()
    for key in ("gb300", "gb200", "b300", "b200"):  # "gb200" contains "b200": test it first
        if key in name:
            return GPUS[key]
    for family in ("h200", "h100"):
        if family in name:
            if "nvl" in name:
                return GPUS[f"{family} nvl"]
            if family == "h100" and ("pcie" in name or "hbm2e" in name):  # the PCIe part has HBM2e
                return GPUS["h100 pcie"]
            return GPUS[family]
    return GPUS["a100"] if "a100" in name else None
