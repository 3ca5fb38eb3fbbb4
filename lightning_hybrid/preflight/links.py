"""``lightning-hybrid preflight``: measure each mesh dimension's links and each device before training.

For every dimension of the ``("pp", "dp", "tp")`` mesh larger than one, every group of that dimension
runs all-reduce, all-gather and reduce-scatter at the same time (as in training), over message sizes
from ``--min-bytes`` (1 MiB) doubling up to ``--max-bytes``. Bus bandwidth follows nccl-tests:
``algbw = bytes / time`` with the time of the slowest rank of the group, and ``busbw = algbw * 2(n-1)/n``
for all-reduce, ``algbw * (n-1)/n`` for all-gather (bytes: the gathered output) and reduce-scatter
(bytes: the input). Pipeline neighbours also send ``bytes`` point to point (``busbw = algbw``). Each
device times a square matmul. A figure below ``threshold x expected`` fails the run, naming the ranks,
their hosts and the link. Expected values come from the GPU type (NVLink per-direction bandwidth in a
node, the NIC's bandwidth across nodes, 70% of dense bf16 peak for the matmul) or from flags.

Run with torchrun on the training mesh::

    torchrun --nproc_per_node 8 -m lightning_hybrid.preflight --tp 8 --gpu h100 --json

or from the strategy with ``HybridParallelStrategy(preflight=True)``, which calls :func:`run_preflight`.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_hybrid.device_speed import matmul_flops
from lightning_hybrid.distributed.mesh import MESH_DIMS
from lightning_hybrid.hardware import SYSTEM_GPUS
from lightning_hybrid.preflight.health import check_gpu_health, gpu_type_from_name, read_nvml

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["run_preflight", "run_preflight_or_raise", "PreflightReport", "LinkResult", "bus_bandwidth_factor",
           "COLLECTIVES", "MATMUL_EFFICIENCY", "MiB", "DEFAULT_MIN_BYTES", "DEFAULT_MAX_BYTES", "PREFLIGHT_MAX_BYTES",
           "DEFAULT_THRESHOLD", "DEFAULT_ITERS", "DEFAULT_WARMUP", "DEFAULT_MATMUL_SIZE"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
MATMUL_EFFICIENCY = 0.7  # a healthy GPU's large bf16 matmul reaches ~70% of the dense datasheet peak
MiB = 1 << 20
DEFAULT_MIN_BYTES = MiB  # below about 1 MiB a collective's time is its latency, not its bandwidth
DEFAULT_MAX_BYTES = 64 * MiB  # NVLink and InfiniBand bus bandwidth reach their plateau by 64 MiB
# Largest message of the preflight the strategy runs (``preflight=True``) per device type: gloo on CPU is slow
# and has no link to saturate, so its run stays short.
PREFLIGHT_MAX_BYTES = {"cpu": 4 * MiB, "cuda": DEFAULT_MAX_BYTES}
DEFAULT_THRESHOLD = 0.8  # a figure below this fraction of the expected one fails the run
# Per device type: timed repetitions per message size, untimed warm-up repetitions and the matmul's side.
# CPU runs (gloo, tests) are kept short; on GPUs 20 repetitions of 8192^3 matmuls time well above noise.
DEFAULT_ITERS = {"cuda": 20, "cpu": 3}
DEFAULT_WARMUP = {"cuda": 5, "cpu": 1}
DEFAULT_MATMUL_SIZE = {"cuda": 8192, "cpu": 256}
_MATMUL_WARMUP = 2  # untimed matmuls: cuBLAS picks its kernel and allocates its workspace on the first
_FLOAT32_BYTES = 4  # the test buffers are float32


def bus_bandwidth_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for a collective over ``n`` ranks (1 for point to point)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


@dataclass
class LinkResult:
    """One test of one group: the group's ranks and hosts, the link type, the sizes and the best busbw."""

    dim: str
    test: str
    ranks: list[int]
    hosts: list[str]
    link: str
    sizes: list[dict[str, float]]
    busbw_gbs: float
    expected_gbs: Optional[float] = None
    ok: bool = True

    @property
    def ratio(self) -> Optional[float]:
        """Measured over expected bus bandwidth, ``None`` without an expected value."""
        return self.busbw_gbs / self.expected_gbs if self.expected_gbs else None


@dataclass
class PreflightReport:
    """Everything the preflight measured; ``ok`` is False when anything is below threshold or unhealthy."""

    mesh: dict[str, int]
    backend: str
    device: str
    threshold: float
    hosts: list[str]
    links: list[LinkResult] = field(default_factory=list)
    matmul: list[dict[str, Any]] = field(default_factory=list)
    health: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether nothing failed."""
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (the ``--json`` output), with each link's ratio."""
        links = [{**asdict(link), "ratio": link.ratio} for link in self.links]
        return {"mesh": self.mesh, "world_size": len(self.hosts), "backend": self.backend, "device": self.device,
                "threshold": self.threshold, "hosts": self.hosts, "links": links, "matmul": self.matmul,
                "health": self.health, "failures": self.failures, "ok": self.ok}

    def format_table(self) -> str:
        """Worst group of each (dimension, test), every matmul outlier, health findings and failures."""
        lines = [f"preflight: mesh {self.mesh} on {len(self.hosts)} ranks ({self.backend}, {self.device}), "
                 f"threshold {self.threshold:g}",
                 f"{'dim':<4} {'test':<15} {'groups':>6} {'worst ranks':<22} {'link':<22} {'busbw GB/s':>11} "
                 f"{'expected':>9} {'ratio':>6}  status"]
        seen: dict[tuple[str, str], list[LinkResult]] = {}
        for link in self.links:
            seen.setdefault((link.dim, link.test), []).append(link)
        for (dim, test), group in seen.items():
            worst = min(group, key=lambda r: r.ratio if r.ratio is not None else r.busbw_gbs)
            ranks = ",".join(map(str, worst.ranks))
            lines.append(f"{dim:<4} {test:<15} {len(group):>6} {ranks[:22]:<22} {worst.link[:22]:<22} "
                         f"{worst.busbw_gbs:>11.2f} {(f'{worst.expected_gbs:.1f}' if worst.expected_gbs else '-'):>9} "
                         f"{(f'{worst.ratio:.2f}' if worst.ratio is not None else '-'):>6}  "
                         f"{'ok' if all(r.ok for r in group) else 'FAIL'}")
        tflops = [m["tflops"] for m in self.matmul]
        if tflops:
            lines.append(f"matmul: {min(tflops):.3f} .. {max(tflops):.3f} TFLOP/s per device "
                         f"(median {statistics.median(tflops):.3f})")
        if self.health.get("status") == "skipped":
            lines.append(f"hardware health: skipped ({self.health.get('reason')})")
        else:
            findings = self.health.get("findings", [])
            lines.append(f"hardware health: {len(self.health.get('devices', []))} devices checked, "
                         f"{len(findings)} findings")
            lines.extend(f"  {f['severity']}: {f['message']}" for f in findings)
        lines.append("result: " + ("ok" if self.ok else f"FAILED ({len(self.failures)})"))
        lines.extend(f"  {failure}" for failure in self.failures)
        return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective_op(kind: str, nbytes: int, n: int, group: Any, device: torch.device) -> tuple[int, Any]:
    import torch.distributed as dist

    elems = max(n, (nbytes // _FLOAT32_BYTES) // n * n)  # a multiple of n, so every rank gets a whole shard
    if kind == "all_reduce":
        buf = torch.zeros(elems, device=device)
        return elems * _FLOAT32_BYTES, lambda: dist.all_reduce(buf, group=group)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    full, shard = torch.zeros(elems, device=device), torch.zeros(elems // n, device=device)
    if kind == "all_gather":
        return elems * _FLOAT32_BYTES, lambda: gather(full, shard, group=group)
    return elems * _FLOAT32_BYTES, lambda: scatter(shard, full, group=group)


def _timed(op: Any, device: torch.device, group: Any, iters: int, warmup: int) -> float:
    import torch.distributed as dist

    for _ in range(warmup):
        op()
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        op()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _sizes(min_bytes: int, max_bytes: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes or [max_bytes]


def _link_name(hosts: list[str], device: torch.device) -> str:
    if len(set(hosts)) > 1:
        return "inter-node network"
    return "intra-node NVLink" if device.type == "cuda" else "intra-node shared memory"


def _measure_local(mesh: "DeviceMesh", device: torch.device, sizes: list[int], iters: int, warmup: int) -> list[dict]:
    """This rank's timings of every test it takes part in (all ranks must call it)."""
    import torch.distributed as dist

    records = []
    for dim in MESH_DIMS:
        n = mesh[dim].size()
        if n <= 1:
            continue
        group = mesh[dim].get_group()
        ranks = dist.get_process_group_ranks(group)
        for kind in COLLECTIVES:
            for size in sizes:
                nbytes, op = _collective_op(kind, size, n, group, device)
                records.append({"dim": dim, "test": kind, "ranks": ranks, "bytes": nbytes,
                                "seconds": _timed(op, device, group, iters, warmup)})
            dist.barrier()
        if dim == "pp":
            me = ranks.index(dist.get_rank())
            for boundary in range(n - 1):
                for size in sizes:
                    buf = torch.zeros(max(1, size // _FLOAT32_BYTES), device=device)
                    dist.barrier()
                    if me in (boundary, boundary + 1):
                        peer = ranks[boundary + 1] if me == boundary else ranks[boundary]
                        send = me == boundary

                        def op() -> None:
                            (dist.send if send else dist.recv)(buf, peer)

                        for _ in range(warmup):
                            op()
                        _sync(device)
                        start = time.perf_counter()
                        for _ in range(iters):
                            op()
                        _sync(device)
                        records.append({"dim": dim, "test": "p2p", "ranks": [ranks[boundary], ranks[boundary + 1]],
                                        "bytes": buf.numel() * _FLOAT32_BYTES,
                                        "seconds": (time.perf_counter() - start) / iters})
            dist.barrier()
    return records


def _matmul_tflops(device: torch.device, size: Optional[int], iters: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return matmul_flops(size or DEFAULT_MATMUL_SIZE[device.type], iters, device, dtype, warmup=_MATMUL_WARMUP) / 1e12


def _local_health(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "no CUDA device (CPU run)"}
    bus_id = None
    props = torch.cuda.get_device_properties(device)
    if hasattr(props, "pci_bus_id") and hasattr(props, "pci_domain_id"):
        bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return read_nvml(index=device.index, pci_bus_id=bus_id)


def _expected_link(dim: str, test: str, link: str, gpu: Optional[str], expected_busbw: dict[str, float],
                   expected_p2p: Optional[float]) -> Optional[float]:
    if test == "p2p" and expected_p2p is not None:
        return expected_p2p
    for key in (f"{dim}.{test}", dim):
        if key in expected_busbw:
            return expected_busbw[key]
    if gpu is None:
        return None
    spec = SYSTEM_GPUS[gpu]
    return spec.network_gbs if link.startswith("inter") else spec.nvlink_gbs


def run_preflight(mesh: "DeviceMesh", gpu: Optional[str] = None, expected_busbw: Optional[dict[str, float]] = None,
                  expected_p2p: Optional[float] = None, expected_tflops: Optional[float] = None,
                  expected_nvlinks: Optional[int] = None, threshold: float = DEFAULT_THRESHOLD,
                  min_bytes: int = DEFAULT_MIN_BYTES, max_bytes: int = DEFAULT_MAX_BYTES, iters: Optional[int] = None,
                  warmup: Optional[int] = None, matmul_size: Optional[int] = None,
                  check_health: bool = True) -> PreflightReport:
    """Measure the mesh's links, the devices' matmul speed and hardware health; the same report on every rank.

    Must be called on every rank of the default process group (it runs collectives on each mesh dimension).

    Args:
        mesh: the training mesh ``("pp", "dp", "tp")`` from
            :func:`lightning_hybrid.distributed.mesh.build_mesh`.
        gpu: GPU type (``h100``, ``h200``, ``b200``, ``b300``) for the expected values; ``None`` infers it
            from the CUDA device name, and on CPU there are no expected values unless given.
        expected_busbw: GB/s by dimension (``{"tp": 360}``) or by ``"dim.test"`` (``{"dp.all_gather": 40}``).
        expected_p2p: GB/s between pipeline neighbours.
        expected_tflops: matmul TFLOP/s per device; default ``MATMUL_EFFICIENCY`` x the GPU's dense peak.
        expected_nvlinks: NVLink links per GPU that must be up; default from the GPU type.
        threshold: fail below ``threshold x expected`` (and, on GPUs, a matmul below ``threshold x`` the median).
        min_bytes, max_bytes: message sizes, doubling from ``min_bytes`` up to ``max_bytes``.
        iters, warmup: timed and untimed repetitions per size (default 20/5 on GPU, 3/1 on CPU).
        matmul_size: side of the square matmul (default 8192 on GPU, 256 on CPU).
        check_health: read NVML on GPUs.

    Returns:
        A :class:`PreflightReport`; ``report.ok`` is False when a figure is below threshold or a device is
        unhealthy, with one line per failure in ``report.failures``.

    Raises:
        ValueError: ``threshold`` is not in (0, 1], or ``min_bytes``/``max_bytes`` are not positive and ordered.
    """
    import torch.distributed as dist

    if not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold} must be in (0, 1], e.g. 0.8")
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"message sizes min_bytes={min_bytes}, max_bytes={max_bytes} must satisfy 0 < min <= max")
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    on_gpu = device.type == "cuda"
    iters = iters or DEFAULT_ITERS[device.type]
    warmup = warmup if warmup is not None else DEFAULT_WARMUP[device.type]
    gpu = _resolve_gpu(gpu, device)
    gathered = _gather_measurements(mesh, device, _sizes(min_bytes, max_bytes), iters, warmup, matmul_size,
                                    check_health)
    hosts = [g["host"] for g in sorted(gathered, key=lambda g: g["rank"])]
    report = PreflightReport(mesh={d: mesh[d].size() for d in MESH_DIMS}, backend=dist.get_backend(),
                             device=torch.cuda.get_device_name(device) if on_gpu else "cpu", threshold=threshold,
                             hosts=hosts)
    _judge_links(report, gathered, device, gpu, expected_busbw or {}, expected_p2p)
    _judge_matmul(report, gathered, gpu, expected_tflops, on_gpu)
    _judge_health(report, gathered, gpu, expected_nvlinks)
    return report


def _resolve_gpu(gpu: Optional[str], device: torch.device) -> Optional[str]:
    """The GPU type for the expected values: as given, else from the CUDA device's name (none on CPU).

    Raises:
        ValueError: a given type is not in the GPU table.
    """
    if gpu is None and device.type == "cuda":
        gpu = gpu_type_from_name(torch.cuda.get_device_name(device))
    if gpu is not None and gpu not in SYSTEM_GPUS:
        raise ValueError(f"gpu={gpu!r} is not known; use one of {', '.join(SYSTEM_GPUS)} or give expected values")
    return gpu


def _gather_measurements(mesh: "DeviceMesh", device: torch.device, sizes: list[int], iters: int, warmup: int,
                         matmul_size: Optional[int], check_health: bool) -> list[dict[str, Any]]:
    """Every rank's link timings, matmul TFLOP/s and health record, on every rank (all ranks must call it)."""
    import torch.distributed as dist

    records = _measure_local(mesh, device, sizes, iters, warmup)
    local = {"rank": dist.get_rank(), "host": socket.gethostname(), "records": records,
             "tflops": _matmul_tflops(device, matmul_size, iters),
             "health": _local_health(device) if check_health else {"status": "skipped", "reason": "disabled"}}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def _judge_links(report: PreflightReport, gathered: list[dict], device: torch.device, gpu: Optional[str],
                 expected_busbw: dict[str, float], expected_p2p: Optional[float]) -> None:
    # (dim, test, ranks) -> bytes -> slowest rank's time
    times: dict[tuple, dict[int, float]] = {}
    for g in gathered:
        for rec in g["records"]:
            key = (rec["dim"], rec["test"], tuple(rec["ranks"]))
            per_size = times.setdefault(key, {})
            per_size[rec["bytes"]] = max(per_size.get(rec["bytes"], 0.0), rec["seconds"])
    order = {name: i for i, name in enumerate(("tp", "dp", "pp") + COLLECTIVES + ("p2p",))}
    for (dim, test, ranks), per_size in sorted(times.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]],
                                                                            kv[0][2])):
        hosts = [report.hosts[r] for r in ranks]
        link = _link_name(hosts, device)
        factor = bus_bandwidth_factor(test, len(ranks))
        sizes = [{"bytes": b, "seconds": t, "algbw_gbs": b / t / 1e9, "busbw_gbs": b / t / 1e9 * factor}
                 for b, t in sorted(per_size.items())]
        best = max(s["busbw_gbs"] for s in sizes)
        expected = _expected_link(dim, test, link, gpu, expected_busbw, expected_p2p)
        ok = expected is None or best >= report.threshold * expected
        report.links.append(LinkResult(dim, test, list(ranks), hosts, link, sizes, best, expected, ok))
        if not ok:
            names = ", ".join(sorted(set(hosts)))
            report.failures.append(
                f"{dim} {test}: bus bandwidth {best:.2f} GB/s is below {report.threshold:g} x expected "
                f"{expected:g} GB/s on ranks {list(ranks)} (hosts {names}), link {link}")


def _judge_matmul(report: PreflightReport, gathered: list[dict], gpu: Optional[str],
                  expected_tflops: Optional[float], relative: bool) -> None:
    expected = expected_tflops if expected_tflops is not None else (
        SYSTEM_GPUS[gpu].peak_tflops * MATMUL_EFFICIENCY if gpu is not None else None)
    median = statistics.median(g["tflops"] for g in gathered)
    for g in sorted(gathered, key=lambda g: g["rank"]):
        reasons = []
        if expected is not None and g["tflops"] < report.threshold * expected:
            reasons.append(f"below {report.threshold:g} x expected {expected:g} TFLOP/s")
        if relative and g["tflops"] < report.threshold * median:  # CPU ranks share cores: no relative check
            reasons.append(f"below {report.threshold:g} x the median {median:.1f} TFLOP/s")
        report.matmul.append({"rank": g["rank"], "host": g["host"], "tflops": g["tflops"],
                              "expected_tflops": expected, "ok": not reasons})
        for reason in reasons:
            report.failures.append(f"matmul on rank {g['rank']} (host {g['host']}): {g['tflops']:.1f} TFLOP/s is "
                                   f"{reason}")


def _judge_health(report: PreflightReport, gathered: list[dict], gpu: Optional[str],
                  expected_nvlinks: Optional[int]) -> None:
    records = [g for g in gathered if g["health"].get("status") == "checked"]
    if not records:
        reasons = sorted({g["health"].get("reason", "") for g in gathered})
        report.health = {"status": "skipped", "reason": "; ".join(reasons)}
        return
    nvlinks = expected_nvlinks if expected_nvlinks is not None else (SYSTEM_GPUS[gpu].nvlinks if gpu else None)
    findings: list[dict] = []
    for g in records:
        findings.extend(check_gpu_health(g["health"], nvlinks, g["host"], g["rank"]))
    report.health = {"status": "checked", "devices": [{"rank": g["rank"], "host": g["host"], **g["health"]}
                                                      for g in records], "findings": findings}
    report.failures.extend(f"health: {f['message']}" for f in findings if f["severity"] == "error")


def run_preflight_or_raise(mesh: "DeviceMesh", max_bytes: int) -> PreflightReport:
    """:func:`run_preflight` on the training mesh with the default expectations; logs the table on rank 0.

    Raises:
        RuntimeError: on every rank, when a link or device is below threshold (the report names them).
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    report = run_preflight(mesh, max_bytes=max_bytes)
    rank_zero_info(report.format_table())
    if not report.ok:
        raise RuntimeError("preflight failed: " + "; ".join(report.failures))
    return report

