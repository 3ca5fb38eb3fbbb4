"""The one NVML reader: a GPU's health record and its XID events, for the preflight and for
:class:`~lightning_hybrid.callbacks.GPUHealthMonitor`.

:class:`NvmlReader` opens NVML once, finds the device (by PCI bus id, else index) and reads a plain dict per call
(the record's keys are listed in :mod:`lightning_hybrid.preflight.health`, which judges it). A ``source`` replaces
NVML: a callable returning records, or a sequence of them (the last one repeats), in the same shape; tests and
replays use it. :func:`read_nvml` is one open, read, close. XID events come from NVML's event API
(``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents`` for ``nvmlEventTypeXidCriticalError``, ``nvmlEventSetWait``)
through :meth:`NvmlReader.xid_waiter`, which :class:`XidWatcher` calls in a background thread so that an XID between
two polls is kept until the next one.

Never raises for a missing ``nvidia-ml-py``, driver or device, or a query the installed ``nvidia-ml-py`` lacks:
:meth:`NvmlReader.open` returns the reason instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

__all__ = ["NvmlReader", "XidWatcher", "read_nvml", "RecordSource", "XidWait"]

# A record source: a callable giving the next record, or a sequence of records (the last one repeats).
RecordSource = Union[Callable[[], dict], Iterable[dict]]
# Wait up to ``timeout`` seconds for the next XID: its code, or None when none came.
XidWait = Callable[[float], Optional[int]]

# Links to probe when nvidia-ml-py predates NVML_NVLINK_MAX_LINKS: NVLink 4 and 5 GPUs have 18.
_DEFAULT_MAX_NVLINKS = 18
_XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError (every XID the driver reports)

logger = logging.getLogger(__name__)


class NvmlReader:
    """Reads one GPU's health record, from NVML or from an injected ``source``.

    Args:
        index: NVML index of the device (used when ``pci_bus_id`` is not given or not found).
        pci_bus_id: the device's PCI bus id as CUDA reports it (NVML may order devices differently).
        source: records instead of NVML: a callable returning one per call, or a sequence (the last repeats).
    """

    def __init__(self, index: Optional[int] = None, pci_bus_id: Optional[str] = None,
                 source: Optional[RecordSource] = None) -> None:
        self.index, self.pci_bus_id = index, pci_bus_id
        self._source = source
        self._records: Optional[list[dict]] = None
        self._nvml: Any = None
        self._handle: Any = None

    def open(self) -> Optional[str]:
        """Initialize NVML and find the device; ``None`` when readable, else why not (one line)."""
        if self._source is not None:
            if not callable(self._source):
                self._records = list(self._source)
                if not self._records:
                    return "the injected record source is empty"
            return None
        try:
            import pynvml
        except ImportError:
            return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:  # no driver, or no libnvidia-ml (NVMLError_LibraryNotFound)
            return f"NVML is not available: {err}"
        self._nvml = pynvml
        try:
            self._handle = _device_handle(pynvml, self.index, self.pci_bus_id)
        except (pynvml.NVMLError, AttributeError) as err:  # no such device, or an nvidia-ml-py without the query
            self.close()
            return f"NVML query failed: {err}"
        return None

    def read(self) -> dict[str, Any]:
        """The device's record now (``{"status": "skipped", "reason": ...}`` when a query fails)."""
        if self._source is not None:
            if self._records is None:
                return dict(self._source())  # type: ignore[operator]
            return dict(self._records.pop(0) if len(self._records) > 1 else self._records[0])
        try:
            return _read_record(self._nvml, self._handle)
        except (self._nvml.NVMLError, AttributeError) as err:
            return {"status": "skipped", "reason": f"NVML query failed: {err}"}

    def xid_waiter(self) -> Optional[XidWait]:
        """A function that waits for the device's next XID (NVML's event API), or ``None`` when NVML (or this
        device) cannot deliver them. Call :meth:`close` after the waiter's thread has ended."""
        n = self._nvml
        if n is None:
            return None
        try:
            events = n.nvmlEventSetCreate()
            n.nvmlDeviceRegisterEvents(self._handle, getattr(n, "nvmlEventTypeXidCriticalError", _XID_CRITICAL_ERROR),
                                       events)
        except (n.NVMLError, AttributeError) as err:  # e.g. NVML_ERROR_NOT_SUPPORTED in some containers
            logger.info("XID events unavailable: %s", err)
            return None
        self._events = events

        def wait(timeout: float) -> Optional[int]:
            try:
                data = n.nvmlEventSetWait(events, int(timeout * 1000))
            except n.NVMLError as err:
                if getattr(err, "value", None) == getattr(n, "NVML_ERROR_TIMEOUT", 10):  # no event in time
                    return None
                raise
            return int(data.eventData)

        return wait

    def close(self) -> None:
        """Free the event set and shut NVML down (NVML counts its initializations); nothing for a source."""
        n, self._nvml = self._nvml, None
        if n is None:
            return
        events = getattr(self, "_events", None)
        try:
            if events is not None:
                n.nvmlEventSetFree(events)
            n.nvmlShutdown()
        except n.NVMLError as err:  # the records are complete; a failed shutdown only leaks NVML's handle
            logger.debug("nvmlShutdown failed: %s", err)


def read_nvml(index: Optional[int] = None, pci_bus_id: Optional[str] = None,
              source: Optional[RecordSource] = None) -> dict[str, Any]:
    """The health record of one GPU (by PCI bus id, else NVML index), or ``{"status": "skipped", "reason": ...}``.

    Never raises for a missing ``nvidia-ml-py``, driver or device, or a query the installed ``nvidia-ml-py``
    lacks: those give a skipped record with the reason.
    """
    reader = NvmlReader(index, pci_bus_id, source)
    reason = reader.open()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    try:
        return reader.read()
    finally:
        reader.close()


class XidWatcher:
    """Collects XIDs in a daemon thread, so that one between two polls waits for the next poll.

    Args:
        wait: waits up to the given seconds for the next XID and returns its code, or ``None``.
        timeout: seconds of each wait (how long :meth:`stop` may take).
    """

    def __init__(self, wait: XidWait, timeout: float = 1.0) -> None:
        self._wait, self._timeout = wait, timeout
        self._lock = threading.Lock()
        self._xids: list[int] = []
        self._stopping = threading.Event()
        self.error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="xid-watcher", daemon=True)

    def start(self) -> "XidWatcher":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                xid = self._wait(self._timeout)
            except Exception as err:  # noqa: BLE001 - reported at the next poll; the thread must not die silently
                self.error = f"XID watcher stopped: {err}"
                return
            if xid is not None:
                with self._lock:
                    self._xids.append(int(xid))

    def drain(self) -> list[int]:
        """The XIDs seen since the last call, in order."""
        with self._lock:
            out, self._xids = self._xids, []
        return out

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._timeout + 1.0)


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


def _nvml_call(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``None`` when the device does not support the query."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
