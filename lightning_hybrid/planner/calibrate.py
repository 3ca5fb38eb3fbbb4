"""The planner's hardware figures from the machine it runs on: a preflight report, or a quick CPU measurement.

``lightning-hybrid plan --calibrate preflight.json`` and ``HybridParallelStrategy(tp="auto", preflight=True)`` read a
preflight report (:mod:`lightning_hybrid.preflight.links`, ``--json``) into :class:`~.step_time.Hardware`:

* matmul: the median device's TFLOP/s. On a GPU it sets the large-GEMM efficiency (measured / datasheet peak, so
  MFU stays against the datasheet); on CPU it is the peak itself (efficiency 1).
* links: every tested group is intra-node or inter-node (the preflight names the link); per kind the median group's
  best bus bandwidth replaces the table's NVLink / network figure (link efficiency 1: it is measured), and the fixed
  cost of one collective is the intercept of the line through the group's smallest and largest message times.
  Each collective kind (all-reduce, all-gather, reduce-scatter, p2p) keeps its own measured bandwidth relative to
  that figure (``Hardware.collective_factors``).
  TP and DP collectives and pipeline transfers then cost what the mesh dimension's link measured.

Without a preflight, a CPU run measures a float32 matmul and a memory copy on the spot (a fraction of a second;
:func:`lightning_hybrid.device_speed.measure_cpu`, called on the distributed side: this module is arithmetic and
receives the figures as a :class:`DeviceFigures`) and takes gloo's link figures from :data:`CPU_GLOO_BUS_GBS` and
:data:`CPU_GLOO_LATENCY_S`. CPU processes share the cores this process may run on (``Hardware.cores_per_node``): a
step takes at least the node's compute over its cores plus its communication (``core_sharing`` in the estimate). With
no spare core (processes >= cores), a blocking collective also waits for its peers to be scheduled
(:data:`CPU_SCHEDULING_WAIT_S` per step of its ring), and prefetched FSDP collectives find no free core to hide behind.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

from lightning_hybrid.hardware import GPU, PeakFlops, gpu_from_device_name
from lightning_hybrid.planner.step_time import Hardware, TimeModel

__all__ = ["calibrate_hardware", "load_preflight", "local_hardware", "DeviceFigures", "cpu_gpu_entry", "cpu_hardware",
           "CPU_TIME_MODEL", "CPU_GLOO_BUS_GBS", "CPU_GLOO_LATENCY_S", "CPU_SCHEDULING_WAIT_S"]

CPU_GLOO_BUS_GBS = 1.0
"""gloo's bus bandwidth between processes of one machine (shared memory through TCP loopback), GB/s; a preflight
replaces it."""
CPU_GLOO_LATENCY_S = 150e-6
"""Fixed cost of one gloo collective on one machine, seconds; a preflight replaces it."""
CPU_SCHEDULING_WAIT_S = 0.008
"""No spare core (at least as many processes as cores): what one step of a blocking collective (TP's all-reduces, a
pipeline's receive) waits for its peer to be scheduled, seconds (``Hardware.scheduling_wait_s``). About one scheduler
time slice of Linux's CFS with every core busy; the one constant chosen on ``benchmarks/planner_accuracy.py``'s
measurements (28 layouts, 4 processes on 2 cores): any value from 2 to 20 ms meets the targets there (median error
6.5-15%, Spearman 0.85-0.98, the planner's choice measured fastest); 0 gives 15%, 0.76 and the 7th. It was 12 ms
while the time model counted 4 TP all-reduces per block instead of the 7 this project issues without sequence
parallel (``planner/collectives.py``): the wait made up for the missing ones. It first applied only with more
processes than cores; a second idle measurement, 2 processes on 2 cores (12 layouts), showed TP layouts 26-30% slow
without it (Spearman 0.72) and 8% median error, Spearman 0.94 with it: a core per process is not a spare core."""
CPU_TIME_MODEL = TimeModel(gemm_knee=24.0, tp_overlap_exposed=1.0, attention_efficiency=0.25, hbm_efficiency=1.0)
"""CPU kernels: small GEMMs lose less to tiling than on a GPU (knee 24, not 664); attention (SDPA's math path on
CPU) reaches about a quarter of the matmul speed; elementwise ops move bytes at the measured copy bandwidth."""


def cpu_gpu_entry(matmul_tflops: float, copy_tbs: float, memory_gb: float) -> GPU:
    """A table entry for CPU processes: the measured matmul speed as every dtype's peak, gloo's link figures."""
    peak = matmul_tflops * 1e12
    return GPU("cpu", PeakFlops(fp32=peak, tf32=peak, bf16=peak, fp16=peak), memory_gb=memory_gb, hbm_tbs=copy_tbs,
               nvlink_gbs=CPU_GLOO_BUS_GBS, nvlinks=0, network_gbits=CPU_GLOO_BUS_GBS * 8, pcie_gen=0)


def cpu_hardware(matmul_tflops: float, copy_tbs: float, world_size: int, processes_per_node: int,
                 cores: Optional[int] = None) -> Hardware:
    """CPU processes as the planner's cluster: the measured matmul and copy speeds, gloo's default link figures,
    the host memory split between the node's processes, and the cores they share (default: this process's)."""
    cores = cores or len(os.sched_getaffinity(0))
    gpu = cpu_gpu_entry(matmul_tflops, copy_tbs, _host_memory_gb(processes_per_node))
    return Hardware(gpu, world_size, processes_per_node, compute_efficiency=1.0, link_efficiency=1.0,
                    intra_latency_s=CPU_GLOO_LATENCY_S, inter_latency_s=CPU_GLOO_LATENCY_S, reserved_gb=0.5,
                    fragmentation=0.1, cores_per_node=cores,
                    scheduling_wait_s=CPU_SCHEDULING_WAIT_S if processes_per_node >= cores else 0.0)


def _host_memory_gb(processes: int) -> float:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / max(1, processes) / 1e9


def load_preflight(path: Union[str, Path]) -> dict[str, Any]:
    """A preflight report written with ``lightning-hybrid preflight --json``.

    Raises:
        ValueError: the file is missing or not a preflight report.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--calibrate {path}: cannot read a preflight JSON report ({err}); write one with "
                         f"`lightning-hybrid preflight --json > {Path(path).name}`") from None
    if not isinstance(doc, dict) or "links" not in doc or "matmul" not in doc:
        raise ValueError(f"--calibrate {path}: not a preflight report (no 'links' and 'matmul'); write one with "
                         f"`lightning-hybrid preflight --json`")
    return doc


def _link_figures(links: list[dict[str, Any]], inter: bool) -> Optional[tuple[float, float]]:
    """(bus bandwidth GB/s, latency s) of the median intra- or inter-node group, ``None`` when none was tested."""
    bandwidths, latencies = [], []
    for link in links:
        if str(link.get("link", "")).startswith("inter") != inter or not link.get("sizes"):
            continue
        bandwidths.append(float(link["busbw_gbs"]))
        sizes = sorted(link["sizes"], key=lambda s: s["bytes"])
        small, large = sizes[0], sizes[-1]
        if large["bytes"] > small["bytes"] and large["seconds"] > small["seconds"]:
            slope = (large["seconds"] - small["seconds"]) / (large["bytes"] - small["bytes"])
            latencies.append(max(0.0, small["seconds"] - slope * small["bytes"]))
    if not bandwidths:
        return None
    return statistics.median(bandwidths), statistics.median(latencies) if latencies else 0.0


def _collective_factors(links: list[dict[str, Any]]) -> tuple[tuple[str, float], ...]:
    """Per collective kind the preflight tested, its median bus bandwidth over the median of all kinds (the link
    figure): the kinds of one link differ (gloo's reduce-scatter runs at a fraction of its all-reduce)."""
    by_kind: dict[str, list[float]] = {}
    for link in links:
        if link.get("sizes") and link.get("busbw_gbs"):
            by_kind.setdefault(str(link.get("test")), []).append(float(link["busbw_gbs"]))
    if len(by_kind) < 2:
        return ()
    overall = statistics.median(v for values in by_kind.values() for v in values)
    return tuple(sorted((kind, statistics.median(values) / overall) for kind, values in by_kind.items()))


def calibrate_hardware(hw: Hardware, preflight: dict[str, Any]) -> Hardware:
    """``hw`` with the matmul speed and each link kind's bandwidth and latency a preflight report measured."""
    gpu, changes = hw.gpu, {}
    tflops = [float(m["tflops"]) for m in preflight.get("matmul", []) if m.get("tflops")]
    if tflops:
        measured = statistics.median(tflops)
        if gpu.name == "cpu" or not gpu.peak.bf16:
            peak = measured * 1e12
            gpu = replace(gpu, peak=PeakFlops(fp32=peak, tf32=peak, bf16=peak, fp16=peak))
            changes["compute_efficiency"] = 1.0
        else:
            changes["compute_efficiency"] = measured * 1e12 / gpu.peak.bf16
    intra, inter = (_link_figures(preflight.get("links", []), flag) for flag in (False, True))
    if intra is not None:
        gpu = replace(gpu, nvlink_gbs=intra[0])
        changes["intra_latency_s"] = intra[1]
    if inter is not None:
        gpu = replace(gpu, network_gbits=inter[0] * 8)
        changes["inter_latency_s"] = inter[1]
    if intra is not None or inter is not None:
        changes["link_efficiency"] = 1.0
        changes["collective_factors"] = _collective_factors(preflight.get("links", []))
        if inter is None and intra is not None:  # one node: inter-node figures are never used, keep them consistent
            gpu = replace(gpu, network_gbits=intra[0] * 8)
    return replace(hw, gpu=gpu, **changes)


@dataclass(frozen=True)
class DeviceFigures:
    """What the distributed side read or measured of this job's device, for :func:`local_hardware`.

    Args:
        type: ``"cuda"``, or another device type (planned as CPU processes).
        name: a CUDA device's name as torch reports it; ``memory_gb`` its total memory.
        matmul_tflops, copy_tbs: on CPU, the measured float32 matmul speed and memory copy bandwidth.
    """

    type: str
    name: str = ""
    memory_gb: float = 0.0
    matmul_tflops: float = 0.0
    copy_tbs: float = 0.0


def local_hardware(device: DeviceFigures, world_size: int, devices_per_node: int,
                   preflight: Optional[dict[str, Any]] = None) -> tuple[Hardware, Optional[TimeModel], str]:
    """(hardware, time model or ``None`` for the default, description) of this job's devices.

    Raises:
        ValueError: a CUDA device the GPU table does not know.
    """
    if device.type == "cuda":
        name = device.name
        gpu = gpu_from_device_name(name)
        if gpu is None or not gpu.has_system_figures:
            raise ValueError(f"device {name!r} is not in lightning_hybrid.hardware's table with memory and link "
                             f"figures; give fixed sizes (tp, pp, dp) instead of 'auto'")
        gpu = replace(gpu, memory_gb=device.memory_gb)
        hw, time_model, described = Hardware(gpu, world_size, devices_per_node), None, f"{name} x {world_size}"
    else:
        matmul, copy = device.matmul_tflops, device.copy_tbs
        hw = cpu_hardware(matmul, copy, world_size, devices_per_node)
        time_model = CPU_TIME_MODEL
        described = f"CPU x {world_size}: matmul {matmul * 1e3:.1f} GFLOP/s, copy {copy * 1e3:.1f} GB/s measured"
    if preflight is not None:
        hw = calibrate_hardware(hw, preflight)
        described += "; links and matmul from the preflight"
    return hw, time_model, described
