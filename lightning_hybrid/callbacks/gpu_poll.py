"""What one poll of :class:`~lightning_hybrid.callbacks.GPUHealthMonitor` exchanges and reports.

Every rank packs its device's findings and figures into one fixed-size byte tensor (:func:`pack`); one all-gather
of those tensors (:func:`all_gather_reports`) gives every rank every report, so all ranks take the same decision.
:func:`finding_line` writes one finding per line, naming rank, host, GPU index, PCI bus id and mesh coordinates;
:func:`node_metrics` reduces the reports to per-node figures for the logger.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from lightning_hybrid.preflight.health import THROTTLE_REASONS

__all__ = ["REPORT_BYTES", "pack", "unpack", "all_gather_reports", "finding_line", "node_metrics", "device_figures"]

REPORT_BYTES = 4096  # per rank and poll: room for ~30 findings; beyond that the warnings are dropped first
_SEVERE_THROTTLE = sum(bit for bit, (_, severity) in THROTTLE_REASONS.items() if severity)


def device_figures(record: dict[str, Any], start: dict[str, Any]) -> dict[str, Optional[float]]:
    """The figures logged per poll: temperature, ECC errors since the start, severe throttle bits, NVLinks up."""
    ecc, ecc0 = record.get("ecc") or {}, start.get("ecc") or {}

    def new(key: str) -> Optional[float]:
        if ecc.get(key) is None:
            return None
        return float(max(0, (ecc.get(key) or 0) - (ecc0.get(key) or 0)))

    links = record.get("nvlink")
    reasons = record.get("throttle_reasons")
    return {"temperature_c": record.get("temperature_c"), "ecc_corrected_new": new("volatile_corrected"),
            "ecc_uncorrected_new": new("volatile_uncorrected"),
            "throttle_flags": float(reasons & _SEVERE_THROTTLE) if reasons is not None else None,
            "nvlink_up": float(sum(1 for link in links if link)) if links is not None else None}


def pack(report: dict[str, Any]) -> torch.Tensor:
    """``report`` as JSON in a ``uint8`` tensor of :data:`REPORT_BYTES` (zero-padded; warnings dropped to fit)."""
    data = json.dumps(report, separators=(",", ":")).encode()
    findings = list(report.get("findings", []))
    while len(data) > REPORT_BYTES and findings:
        drop = next((i for i, f in enumerate(findings) if f[0] == "warning"), len(findings) - 1)
        findings.pop(drop)
        data = json.dumps({**report, "findings": findings, "truncated": True}, separators=(",", ":")).encode()
    out = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
    out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def unpack(tensor: torch.Tensor) -> dict[str, Any]:
    data = bytes(tensor.cpu().tolist())
    return json.loads(data.rstrip(b"\0").decode())


def all_gather_reports(report: dict[str, Any], group: Any = None) -> list[dict[str, Any]]:
    """Every rank's report, by rank: one all-gather of :data:`REPORT_BYTES` per rank (CPU tensors: ``group`` must
    be a gloo group, as the strategy's checkpoint group is; ``None`` and a gloo world also work)."""
    import torch.distributed as dist

    mine = pack(report)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [unpack(mine)]
    if group is None and dist.get_backend() != "gloo":
        mine = mine.cuda()  # an NCCL world group: the tensors live on this rank's GPU
    gathered = torch.empty(dist.get_world_size(group) * REPORT_BYTES, dtype=torch.uint8, device=mine.device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    return [unpack(chunk) for chunk in gathered.view(-1, REPORT_BYTES)]


def where(report: dict[str, Any]) -> str:
    """``rank 3, host node-1, GPU 3 (PCI 00000000:9B:00.0), pp=1 dp=0 tp=1 cp=0``."""
    coords = " ".join(f"{k}={v}" for k, v in report.get("coords", {}).items())
    return (f"rank {report['rank']}, host {report['host']}, GPU {report.get('gpu', '?')} "
            f"(PCI {report.get('pci_bus_id') or '?'})" + (f", {coords}" if coords else ""))


def finding_line(report: dict[str, Any], finding: list, step: int) -> str:
    """One line: severity and check, where (rank, host, GPU, PCI bus id, coordinates), the values, the step."""
    severity, check, detail = finding
    return f"GPU health: {severity} {check}: {where(report)}: {detail} (step {step})"


def node_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Per host: the maximum temperature and ECC counts, the OR of severe throttle flags and the fewest NVLinks up
    (the worst GPU of the node; a maximum would hide it), under ``gpu_health/<host>/...``."""
    out: dict[str, float] = {}
    combine = {"temperature_c": max, "ecc_corrected_new": max, "ecc_uncorrected_new": max, "nvlink_up": min,
               "throttle_flags": lambda a, b: float(int(a) | int(b))}
    suffix = {"temperature_c": "_max", "ecc_corrected_new": "_max", "ecc_uncorrected_new": "_max",
              "nvlink_up": "_min", "throttle_flags": ""}
    for report in reports:
        for key, value in (report.get("figures") or {}).items():
            if value is None:
                continue
            name = f"gpu_health/{report['host']}/{key}{suffix[key]}"
            out[name] = combine[key](out[name], value) if name in out else float(value)
    out["gpu_health/findings"] = float(sum(len(r.get("findings", [])) for r in reports))
    out["gpu_health/errors"] = float(sum(f[0] == "error" for r in reports for f in r.get("findings", [])))
    return out
