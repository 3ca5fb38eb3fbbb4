"""GPU hardware health for the preflight: read NVML, flag NVLink, PCIe, ECC, row-remapping and throttling faults.

Reading (:func:`read_nvml`) needs ``nvidia-ml-py`` and a GPU and returns a plain dict per device;
judging (:func:`check_gpu_health`) works on such a dict alone, so it is tested on recorded values.
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
from typing import Any, Optional

from lightning_hybrid.hardware import SYSTEM_GPUS, gpu_from_device_name

__all__ = ["read_nvml", "check_gpu_health", "gpu_type_from_name", "THROTTLE_REASONS", "CORRECTED_ECC_WARNING"]

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
# Links to probe when nvidia-ml-py predates NVML_NVLINK_MAX_LINKS: NVLink 4 and 5 GPUs have 18.
_DEFAULT_MAX_NVLINKS = 18

logger = logging.getLogger(__name__)


def gpu_type_from_name(name: str) -> Optional[str]:
    """The GPU type (``h100``, ...) for an NVML/CUDA device name, or ``None`` when the GPU table has no link
    figures for it (then there are no expected values for it)."""
    gpu = gpu_from_device_name(name)
    return gpu.name if gpu is not None and gpu.name in SYSTEM_GPUS else None


def _finding(severity: str, check: str, message: str, record: dict, host: str, rank: Optional[int]) -> dict:
    where = f"host {host or '?'} GPU {record.get('index', '?')}" + (f" (rank {rank})" if rank is not None else "")
    return {"severity": severity, "check": check, "host": host, "gpu": record.get("index"), "rank": rank,
            "message": f"{where}: {message}"}


def check_gpu_health(record: dict[str, Any], expected_nvlinks: Optional[int] = None, host: str = "",
                     rank: Optional[int] = None) -> list[dict]:
    """Findings for one device record: dicts with ``severity`` (``error``/``warning``), ``check`` and ``message``.

    Args:
        record: an NVML-like record (see the module docstring).
        expected_nvlinks: links that must be up; ``None`` takes the GPU type's count from its name, or else
            requires every link the device reports to be up.
        host: host name, for the messages.
        rank: global rank that drives the device, for the messages.
    """
    out: list[dict] = []

    def add(severity: str, check: str, message: str) -> None:
        out.append(_finding(severity, check, message, record, host, rank))

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
    ecc = record.get("ecc") or {}
    if (ecc.get("volatile_uncorrected") or 0) > 0:
        add("error", "ecc", f"{ecc['volatile_uncorrected']} uncorrected ECC errors since boot")
    elif (ecc.get("aggregate_uncorrected") or 0) > 0:
        add("warning", "ecc", f"{ecc['aggregate_uncorrected']} uncorrected ECC errors over the device's life")
    if (ecc.get("volatile_corrected") or 0) > CORRECTED_ECC_WARNING:
        add("warning", "ecc", f"{ecc['volatile_corrected']} corrected ECC errors since boot")
    retired = record.get("retired_pages") or {}
    if retired.get("pending"):
        add("error", "retired_pages", "page retirement pending: reset the GPU")
    if (retired.get("double_bit") or 0) > 0:
        add("warning", "retired_pages", f"{retired['double_bit']} pages retired for double-bit errors")
    rows = record.get("remapped_rows") or {}
    if rows.get("failure"):
        add("error", "remapped_rows", "row remapping failed: replace the GPU")
    if rows.get("pending"):
        add("error", "remapped_rows", "row remapping pending: reset the GPU")
    if (rows.get("uncorrectable") or 0) > 0:
        add("warning", "remapped_rows", f"{rows['uncorrectable']} rows remapped for uncorrectable errors")
    reasons = record.get("throttle_reasons")
    if reasons:
        for bit, (name, severity) in THROTTLE_REASONS.items():
            if reasons & bit and severity:
                clocks = record.get("clocks") or {}
                detail = f" (SM {clocks['sm']} of {clocks['sm_max']} MHz)" if clocks.get("sm") and clocks.get(
                    "sm_max") else ""
                add(severity, "throttle", f"clocks throttled: {name}{detail}")
    return out


def _nvml_call(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``None`` when the device does not support the query."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def read_nvml(index: Optional[int] = None, pci_bus_id: Optional[str] = None) -> dict[str, Any]:
    """The health record of one GPU (by PCI bus id, else NVML index), or ``{"status": "skipped", ...}``.

    Never raises for a missing ``nvidia-ml-py``, driver or device, or a query the installed ``nvidia-ml-py``
    lacks: those give a skipped record with the reason.
    """
    try:
        import pynvml
    except ImportError:
        return {"status": "skipped", "reason": "nvidia-ml-py is not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:  # no driver, or no libnvidia-ml (NVMLError_LibraryNotFound)
        return {"status": "skipped", "reason": f"NVML is not available: {err}"}
    try:
        return _read_record(pynvml, _device_handle(pynvml, index, pci_bus_id))
    except (pynvml.NVMLError, AttributeError) as err:  # no such device, or an nvidia-ml-py without the query
        return {"status": "skipped", "reason": f"NVML query failed: {err}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:  # the record is complete; a failed shutdown only leaks NVML's handle
            logger.debug("nvmlShutdown failed: %s", err)


def _device_handle(n: Any, index: Optional[int], pci_bus_id: Optional[str]) -> Any:
    """The device by PCI bus id (what CUDA reports), else by NVML index (which may order devices differently)."""
    handle = _nvml_call(n.nvmlDeviceGetHandleByPciBusId, pci_bus_id) if pci_bus_id else None
    return handle if handle is not None else n.nvmlDeviceGetHandleByIndex(index or 0)


def _read_record(n: Any, handle: Any) -> dict[str, Any]:
    """Every figure of the record (see the module docstring); ``None`` where the device does not report it."""
    pci = _nvml_call(n.nvmlDeviceGetPciInfo, handle)
    reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
    return {
        "status": "checked",
        "index": _nvml_call(n.nvmlDeviceGetIndex, handle),
        "name": _text(_nvml_call(n.nvmlDeviceGetName, handle)),
        "uuid": _text(_nvml_call(n.nvmlDeviceGetUUID, handle)),
        "pci_bus_id": _text(getattr(pci, "busId", None)) if pci is not None else None,
        "nvlink": _nvlink_states(n, handle),
        "pcie": {"gen": _nvml_call(n.nvmlDeviceGetCurrPcieLinkGeneration, handle),
                 "max_gen": _nvml_call(n.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                 "width": _nvml_call(n.nvmlDeviceGetCurrPcieLinkWidth, handle),
                 "max_width": _nvml_call(n.nvmlDeviceGetMaxPcieLinkWidth, handle)},
        "ecc": _ecc_errors(n, handle),
        "retired_pages": _retired_pages(n, handle),
        "remapped_rows": _remapped_rows(n, handle),
        "clocks": {"sm": _nvml_call(n.nvmlDeviceGetClockInfo, handle, n.NVML_CLOCK_SM),
                   "sm_max": _nvml_call(n.nvmlDeviceGetMaxClockInfo, handle, n.NVML_CLOCK_SM),
                   "mem": _nvml_call(n.nvmlDeviceGetClockInfo, handle, n.NVML_CLOCK_MEM),
                   "mem_max": _nvml_call(n.nvmlDeviceGetMaxClockInfo, handle, n.NVML_CLOCK_MEM)},
        "throttle_reasons": _nvml_call(reasons, handle),
        "temperature_c": _nvml_call(n.nvmlDeviceGetTemperature, handle, n.NVML_TEMPERATURE_GPU),
    }


def _nvlink_states(n: Any, handle: Any) -> list[bool]:
    """Up or not, for every link the device has (a link it lacks fails the query and is left out)."""
    states = (_nvml_call(n.nvmlDeviceGetNvLinkState, handle, link)
              for link in range(getattr(n, "NVML_NVLINK_MAX_LINKS", _DEFAULT_MAX_NVLINKS)))
    return [bool(state) for state in states if state is not None]


def _ecc_errors(n: Any, handle: Any) -> dict[str, Optional[int]]:
    """Corrected and uncorrected ECC errors since boot (volatile) and over the device's life (aggregate)."""
    errors = n.nvmlDeviceGetTotalEccErrors
    corrected, uncorrected = n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    return {"volatile_corrected": _nvml_call(errors, handle, corrected, n.NVML_VOLATILE_ECC),
            "volatile_uncorrected": _nvml_call(errors, handle, uncorrected, n.NVML_VOLATILE_ECC),
            "aggregate_corrected": _nvml_call(errors, handle, corrected, n.NVML_AGGREGATE_ECC),
            "aggregate_uncorrected": _nvml_call(errors, handle, uncorrected, n.NVML_AGGREGATE_ECC)}


def _retired_pages(n: Any, handle: Any) -> dict[str, Any]:
    """Pages retired for single- and double-bit errors and whether a retirement waits for a reset (pre-Hopper)."""
    pages = n.nvmlDeviceGetRetiredPages
    single = _nvml_call(pages, handle, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    double = _nvml_call(pages, handle, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    pending = _nvml_call(n.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    return {"single_bit": len(single) if single is not None else None,
            "double_bit": len(double) if double is not None else None,
            "pending": bool(pending) if pending is not None else None}


def _remapped_rows(n: Any, handle: Any) -> Optional[dict[str, Any]]:
    """Rows remapped for correctable and uncorrectable errors, a pending remap and a failed one (Ampere on)."""
    remapped = _nvml_call(n.nvmlDeviceGetRemappedRows, handle)
    if remapped is None:
        return None
    return {"correctable": int(remapped[0]), "uncorrectable": int(remapped[1]), "pending": bool(remapped[2]),
            "failure": bool(remapped[3])}
