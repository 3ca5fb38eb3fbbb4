"""The one GPU health judge: NVLink, PCIe, ECC, row-remapping, throttling, temperature and XID findings.

Reading is :mod:`lightning_hybrid.preflight.nvml` (:func:`read_nvml`, :class:`NvmlReader`); judging
(:func:`check_gpu_health`) works on a record alone, so it is tested on recorded values. The preflight judges one
record; :class:`~lightning_hybrid.callbacks.GPUHealthMonitor` also passes the record taken at the start of training
(``baseline``): counters (ECC errors, retired pages, remapped rows) are then judged by their increase since then.
The record's keys (any may be missing or ``None`` when the device does not report it)::

    {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-...", "pci_bus_id": "00000000:1B:00.0",
     "nvlink": [True] * 18,                          # one entry per link the device has: up or not
     "pcie": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
     "ecc": {"volatile_corrected": 0, "volatile_uncorrected": 0,
             "aggregate_corrected": 0, "aggregate_uncorrected": 0},
     "retired_pages": {"single_bit": 0, "double_bit": 0, "pending": False},
     "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
     "clocks": {"sm": 1980, "sm_max": 1980, "mem": 2619, "mem_max": 2619},
     "throttle_reasons": 0, "temperature_c": 41}
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from lightning_hybrid.hardware import SYSTEM_GPUS, gpu_from_device_name
from lightning_hybrid.preflight.nvml import read_nvml

__all__ = ["read_nvml", "check_gpu_health", "gpu_type_from_name", "THROTTLE_REASONS", "CORRECTED_ECC_WARNING",
           "DEFAULT_THRESHOLDS", "XID_SEVERITY", "check_thresholds"]

# NVML clock-event (throttle) reason bits -> (name, severity or None when harmless).
THROTTLE_REASONS: dict[int, tuple[str, Optional[str]]] = {
    0x1: ("gpu_idle", None),
    0x2: ("applications_clocks_setting", None),
    0x4: ("sw_power_cap", None),  # normal under full load
    0x8: ("hw_slowdown", "error"),
    0x10: ("sync_boost", None),
    0x20: ("sw_thermal_slowdown", "warning"),
    0x40: ("hw_thermal_slowdown", "error"),
    0x80: ("hw_power_brake_slowdown", "error"),
    0x100: ("display_clock_setting", None),
    0x200: ("board_limit", "warning"),
    0x400: ("reliability", "warning"),
}
CORRECTED_ECC_WARNING = 1000  # corrected (volatile) ECC errors since boot above which a device is suspect
# What the judge compares with; GPUHealthMonitor(thresholds=...) overrides any of them.
DEFAULT_THRESHOLDS: dict[str, float] = {
    "corrected_ecc": 100,          # new corrected ECC errors since the start of training: an error from here on
    "temperature_warning_c": 85,   # GPU temperature (C) from which a warning is given
    "temperature_error_c": 92,     # and an error (about the shutdown temperature of H100/B200 boards)
}
# XIDs (NVIDIA's "XID errors" list) -> (severity, meaning). Unlisted XIDs are warnings.
XID_SEVERITY: dict[int, tuple[str, str]] = {
    13: ("warning", "graphics engine exception"), 31: ("warning", "GPU memory page fault"),
    43: ("warning", "GPU stopped processing"), 45: ("warning", "preemptive cleanup"),
    48: ("error", "double-bit ECC error"), 61: ("error", "internal micro-controller breakpoint"),
    62: ("error", "internal micro-controller halt"), 63: ("warning", "ECC page retirement or row remap recorded"),
    64: ("error", "ECC page retirement or row remap failed"), 74: ("error", "NVLink error"),
    79: ("error", "GPU has fallen off the bus"), 92: ("warning", "high single-bit ECC error rate"),
    94: ("warning", "contained ECC error"), 95: ("error", "uncontained ECC error"),
    119: ("error", "GSP RPC timeout"), 120: ("error", "GSP error"), 140: ("error", "unrecovered ECC error"),
}

logger = logging.getLogger(__name__)


def check_thresholds(thresholds: Optional[dict[str, Any]]) -> dict[str, float]:
    """The defaults updated with ``thresholds``; a one-line ``ValueError`` for an unknown key or a bad value."""
    out = dict(DEFAULT_THRESHOLDS)
    for key, value in (thresholds or {}).items():
        if key not in DEFAULT_THRESHOLDS:
            raise ValueError(f"thresholds key {key!r} is unknown; use {', '.join(DEFAULT_THRESHOLDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"thresholds[{key!r}]={value!r} must be a number > 0")
        out[key] = value
    if out["temperature_warning_c"] > out["temperature_error_c"]:
        raise ValueError(f"thresholds: temperature_warning_c={out['temperature_warning_c']} is above "
                         f"temperature_error_c={out['temperature_error_c']}; the warning must come first")
    return out


def gpu_type_from_name(name: str) -> Optional[str]:
    """The GPU type (``h100``, ...) for an NVML/CUDA device name, or ``None`` when the GPU table has no link
    figures for it (then there are no expected values for it)."""
    gpu = gpu_from_device_name(name)
    return gpu.name if gpu is not None and gpu.name in SYSTEM_GPUS else None


def _finding(severity: str, check: str, detail: str, record: dict, host: str, rank: Optional[int]) -> dict:
    where = f"host {host or '?'} GPU {record.get('index', '?')}" + (f" (rank {rank})" if rank is not None else "")
    return {"severity": severity, "check": check, "host": host, "gpu": record.get("index"), "rank": rank,
            "detail": detail, "message": f"{where}: {detail}"}


def _new(now: Optional[int], start: Optional[int]) -> int:
    """The increase of a counter since the start (a counter that went down, as after a reset, counts from 0)."""
    now, start = now or 0, start or 0
    return now - start if now >= start else now


def check_gpu_health(record: dict[str, Any], expected_nvlinks: Optional[int] = None, host: str = "",
                     rank: Optional[int] = None, baseline: Optional[dict[str, Any]] = None,
                     thresholds: Optional[dict[str, float]] = None, xids: Sequence[int] = ()) -> list[dict]:
    """Findings for one device record: dicts with ``severity`` (``error``/``warning``), ``check``, ``detail`` (the
    check's values) and ``message`` (``detail`` after the host, GPU and rank).

    Args:
        record: an NVML-like record (see the module docstring).
        expected_nvlinks: links that must be up; ``None`` takes the GPU type's count from its name, or else
            requires every link the device reports to be up.
        host: host name, for the messages.
        rank: global rank that drives the device, for the messages.
        baseline: the record at the start of training: counters are judged by their increase since then.
        thresholds: overrides of :data:`DEFAULT_THRESHOLDS` (checked by :func:`check_thresholds`).
        xids: XID codes seen since the last judgement (:data:`XID_SEVERITY`).
    """
    out: list[dict] = []
    limits = check_thresholds(thresholds)

    def add(severity: str, check: str, detail: str) -> None:
        out.append(_finding(severity, check, detail, record, host, rank))

    _judge_links(record, expected_nvlinks, add)
    if baseline is None:
        _judge_counters_since_boot(record, add)
    else:
        _judge_counters_since_start(record, baseline, limits, add)
    _judge_states(record, limits, add)
    counts: dict[int, int] = {}
    for xid in xids:  # a storm of one XID is one finding with its count
        counts[int(xid)] = counts.get(int(xid), 0) + 1
    for xid, count in counts.items():
        severity, meaning = XID_SEVERITY.get(xid, ("warning", "see NVIDIA's XID list"))
        add(severity, "xid", f"XID {xid} ({meaning})" + (f" x {count}" if count > 1 else ""))
    return out


def _judge_links(record: dict, expected_nvlinks: Optional[int], add: Any) -> None:
    links = record.get("nvlink")
    if links is not None:
        gpu = gpu_type_from_name(record.get("name") or "")
        expected = expected_nvlinks if expected_nvlinks is not None else (
            SYSTEM_GPUS[gpu].nvlinks if gpu and links else len(links))
        up = sum(1 for link in links if link)
        if up < expected:
            down = [i for i, link in enumerate(links) if not link]
            add("error", "nvlink", f"NVLink: {up} of {expected} links up" + (f" (down: {down})" if down else ""))
    pcie = record.get("pcie") or {}
    if pcie.get("width") is not None and pcie.get("max_width") and pcie["width"] < pcie["max_width"]:
        add("error", "pcie_width", f"PCIe link trained down to x{pcie['width']} (max x{pcie['max_width']})")
    if pcie.get("gen") is not None and pcie.get("max_gen") and pcie["gen"] < pcie["max_gen"]:
        add("warning", "pcie_gen", f"PCIe gen {pcie['gen']} of {pcie['max_gen']} (an idle GPU may downshift; "
                                   f"check again under load)")


def _judge_counters_since_boot(record: dict, add: Any) -> None:
    """The preflight's view: every ECC error, retired page and remapped row the device has counted."""
    ecc = record.get("ecc") or {}
    if (ecc.get("volatile_uncorrected") or 0) > 0:
        add("error", "ecc", f"{ecc['volatile_uncorrected']} uncorrected ECC errors since boot")
    elif (ecc.get("aggregate_uncorrected") or 0) > 0:
        add("warning", "ecc", f"{ecc['aggregate_uncorrected']} uncorrected ECC errors over the device's life")
    if (ecc.get("volatile_corrected") or 0) > CORRECTED_ECC_WARNING:
        add("warning", "ecc", f"{ecc['volatile_corrected']} corrected ECC errors since boot")
    retired = record.get("retired_pages") or {}
    if (retired.get("double_bit") or 0) > 0:
        add("warning", "retired_pages", f"{retired['double_bit']} pages retired for double-bit errors")
    rows = record.get("remapped_rows") or {}
    if (rows.get("uncorrectable") or 0) > 0:
        add("warning", "remapped_rows", f"{rows['uncorrectable']} rows remapped for uncorrectable errors")


def _judge_counters_since_start(record: dict, start: dict, limits: dict[str, float], add: Any) -> None:
    """The monitor's view: what the device counted since the start of training."""
    ecc, ecc0 = record.get("ecc") or {}, start.get("ecc") or {}
    uncorrected = _new(ecc.get("volatile_uncorrected"), ecc0.get("volatile_uncorrected"))
    if uncorrected > 0:
        add("error", "ecc_uncorrected", f"{uncorrected} new uncorrected ECC errors since the start of training")
    corrected = _new(ecc.get("volatile_corrected"), ecc0.get("volatile_corrected"))
    if corrected > 0:
        limit = int(limits["corrected_ecc"])
        add("error" if corrected >= limit else "warning", "ecc_corrected",
            f"{corrected} new corrected ECC errors since the start of training (error at {limit})")
    retired, retired0 = record.get("retired_pages") or {}, start.get("retired_pages") or {}
    pages = sum(_new(retired.get(k), retired0.get(k)) for k in ("single_bit", "double_bit"))
    if pages > 0:
        add("warning", "retired_pages", f"{pages} pages retired since the start of training")
    rows, rows0 = record.get("remapped_rows") or {}, start.get("remapped_rows") or {}
    remapped = sum(_new(rows.get(k), rows0.get(k)) for k in ("correctable", "uncorrectable"))
    if remapped > 0:
        add("warning", "remapped_rows", f"{remapped} rows remapped since the start of training")


def _judge_states(record: dict, limits: dict[str, float], add: Any) -> None:
    """States judged as they are now: pending retirements and remaps, throttling, temperature."""
    if (record.get("retired_pages") or {}).get("pending"):
        add("error", "retired_pages", "page retirement pending: reset the GPU")
    rows = record.get("remapped_rows") or {}
    if rows.get("failure"):
        add("error", "remapped_rows", "row remapping failed: replace the GPU")
    if rows.get("pending"):
        add("error", "remapped_rows", "row remapping pending: reset the GPU")
    reasons = record.get("throttle_reasons")
    if reasons:
        for bit, (name, severity) in THROTTLE_REASONS.items():
            if reasons & bit and severity:
                clocks = record.get("clocks") or {}
                detail = f" (SM {clocks['sm']} of {clocks['sm_max']} MHz)" if clocks.get("sm") and clocks.get(
                    "sm_max") else ""
                add(severity, "throttle", f"clocks throttled: {name}{detail}")
    temperature = record.get("temperature_c")
    if temperature is not None and temperature >= limits["temperature_warning_c"]:
        error = temperature >= limits["temperature_error_c"]
        level = limits["temperature_error_c" if error else "temperature_warning_c"]
        add("error" if error else "warning", "temperature", f"temperature {temperature} C (>= {level:g} C)")
