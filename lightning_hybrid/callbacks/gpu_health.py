"""GPU health during training: NVLink, PCIe, ECC, row remapping, throttling, temperature and XIDs, per rank.

:class:`GPUHealthMonitor` reads each rank's own GPU through the preflight's reader
(:class:`~lightning_hybrid.preflight.nvml.NvmlReader`) and judges it with the preflight's judge
(:func:`~lightning_hybrid.preflight.health.check_gpu_health`) against the record taken at the start of training.
XIDs are collected between polls by a background thread (NVML's event API). At each poll the ranks exchange their
findings in one all-gather of a fixed-size byte tensor; every rank then takes the same decision. Without NVML (a CPU
run, or ``nvidia-ml-py`` missing) it says so in one line at the start and its hooks return at once.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_hybrid.callbacks.fault_tolerant import FaultTolerantCheckpoint
from lightning_hybrid.callbacks.gpu_poll import all_gather_reports, device_figures, finding_line, node_metrics
from lightning_hybrid.callbacks.rollback import EXIT_CODE_UNHEALTHY, TrainingUnhealthy, stop
from lightning_hybrid.checkpoint.manifest import step_dirname
from lightning_hybrid.preflight.health import check_gpu_health, check_thresholds
from lightning_hybrid.preflight.nvml import NvmlReader, RecordSource, XidWait, XidWatcher

__all__ = ["GPUHealthMonitor", "GPUFault", "EXCLUDE_HOSTS_FILE", "ON_FAULT"]

EXCLUDE_HOSTS_FILE = "exclude_hosts.txt"  # in the checkpoint folder; the launchers read it on requeue or restart
ON_FAULT = ("stop", "warn")
log = logging.getLogger(__name__)


def _hostname() -> str:
    return socket.gethostname()


class GPUFault(TrainingUnhealthy):
    """Raised on every rank when :class:`GPUHealthMonitor` stops the run; a ``SystemExit`` with code 76."""

    def __init__(self, step: int, lines: list[str], saved: bool, checkpoint: Optional[str],
                 exclude_file: Optional[str], hosts: list[str]) -> None:
        super().__init__(step, "; ".join(lines), saved)
        self.lines, self.checkpoint, self.exclude_file, self.hosts = lines, checkpoint, exclude_file, hosts

    def __str__(self) -> str:
        out = [f"GPU health stopped the run at step {self.step} (on_fault='stop'):", *(f"  {x}" for x in self.lines)]
        out.append(f"  checkpoint of step {self.step} committed: {self.checkpoint}" if self.saved and self.checkpoint
                   else "  no checkpoint saved (no FaultTolerantCheckpoint, or its save failed)")
        if self.exclude_file:
            out.append(f"  hosts to exclude ({', '.join(self.hosts)}) written to {self.exclude_file}")
        out.append(f"  exit code {EXIT_CODE_UNHEALTHY}: a requeued SLURM job excludes those hosts "
                   f"(recipes/slurm); elsewhere take them out of the job before restarting")
        return "\n".join(out)


def _coordinates(trainer: "pl.Trainer") -> dict[str, int]:
    try:
        coords = dict(trainer.strategy.dims.coordinates(trainer.global_rank))
    except (AttributeError, RuntimeError):  # not a hybrid strategy: no mesh to place the rank in
        return {}
    return {k: coords.get(k, 0) for k in ("pp", "dp", "tp", "cp")}


def _device_ids(trainer: "pl.Trainer") -> tuple[Optional[int], Optional[str], Optional[str]]:
    """(CUDA index, PCI bus id as NVML spells it, why there is no GPU to read) of this rank's device."""
    device = trainer.strategy.root_device
    if device.type != "cuda":
        return None, None, f"the training device is {device.type}, not a CUDA GPU"
    import torch

    props = torch.cuda.get_device_properties(device)
    bus = None
    if hasattr(props, "pci_bus_id") and hasattr(props, "pci_domain_id"):
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return device.index, bus, None


class GPUHealthMonitor(pl.Callback):
    """Watches every rank's GPU during training and stops (or warns) naming the faulty rank, host and GPU.

    At the start of training each rank reads its GPU's record (NVML through the preflight's reader); every
    ``every_n_steps`` optimizer steps it reads it again and judges it with the preflight's judge against the start:
    NVLink links down, PCIe generation or width below the maximum, new corrected and uncorrected ECC errors, pages
    retired and rows remapped (pending ones are errors), throttling of warning or error severity, temperature, and the
    XIDs a background thread collected since the last poll. Ranks agree through one all-gather per poll (a 4 KB byte
    tensor per rank, on the strategy's gloo checkpoint group) and nowhere else. A fault already present at the start
    is reported then, once, and not acted on (the preflight's job).

    Each finding is one line (rank, host, GPU index, PCI bus id, mesh coordinates pp/dp/tp/cp, check, values), logged
    by rank 0 the first time it is seen. The logger gets per-node figures each poll: ``gpu_health/<host>/
    temperature_c_max``, ``ecc_corrected_new_max``, ``ecc_uncorrected_new_max``, ``throttle_flags`` (OR of the
    severe NVML throttle bits), ``nvlink_up_min``, and ``gpu_health/findings``, ``gpu_health/errors``.

    ``on_fault="stop"``: at a poll with an error-level finding every rank saves a checkpoint of that step through the
    Trainer's :class:`FaultTolerantCheckpoint` (when there is one), rank 0 adds the hosts with errors to
    ``<dirpath>/exclude_hosts.txt`` and every rank raises :class:`GPUFault` (exit code 76). ``on_fault="warn"``:
    findings are logged once and training goes on. Warnings never stop the run.

    Without NVML (a CPU run, no ``nvidia-ml-py``, no driver) one line at the start says why it is inactive; its hooks
    then return at once (one all-reduce of a flag at the start decides this for all ranks together).

    Args:
        every_n_steps: optimizer steps between polls (>= 1).
        on_fault: ``"stop"`` or ``"warn"`` (see above).
        thresholds: overrides of :data:`~lightning_hybrid.preflight.health.DEFAULT_THRESHOLDS`
            (``corrected_ecc``, ``temperature_warning_c``, ``temperature_error_c``).
        expected_nvlinks: NVLinks that must be up; ``None``: the GPU type's count, else all the device reports.
        dirpath: folder of ``exclude_hosts.txt``; ``None``: the FaultTolerantCheckpoint's ``dirpath``, else the
            Trainer's ``default_root_dir``.
        source: records instead of NVML, for this rank (tests, replays): see
            :class:`~lightning_hybrid.preflight.nvml.NvmlReader`. Makes the monitor active on any device.
        xid_source: instead of NVML's event API: a function waiting up to the given seconds for the next XID.

    Raises:
        ValueError: a bad ``every_n_steps``, ``on_fault`` or threshold (one line, on every rank at construction).
    """

    def __init__(self, every_n_steps: int = 100, on_fault: str = "stop", thresholds: Optional[dict] = None,
                 expected_nvlinks: Optional[int] = None, dirpath: Optional[str] = None,
                 source: Optional[RecordSource] = None, xid_source: Optional[XidWait] = None) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an integer >= 1")
        if on_fault not in ON_FAULT:
            raise ValueError(f"on_fault={on_fault!r} is not a policy; use 'stop' or 'warn'")
        self.every_n_steps, self.on_fault = every_n_steps, on_fault
        self.thresholds = check_thresholds(thresholds)
        self.expected_nvlinks, self.dirpath = expected_nvlinks, dirpath
        self._source, self._xid_source = source, xid_source
        self.active = False  # whether any rank reads a GPU (decided at the start of training)
        self.inactive_reason: Optional[str] = None
        self.findings: list[dict[str, Any]] = []  # every finding reported (once each), on every rank
        self.last_metrics: dict[str, float] = {}
        self.poll_seconds: list[float] = []
        self._reader: Optional[NvmlReader] = None
        self._watcher: Optional[XidWatcher] = None
        self._start: dict[str, Any] = {}
        self._known_at_start: set[tuple[str, str]] = set()
        self._reported: set[tuple[int, str, str]] = set()
        self._last_poll = -1
        self._me: dict[str, Any] = {}

    # ------------------------------------------------------------------ start

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._known_at_start, self._reported, self._last_poll = set(), set(), -1  # a new fit: a new start record
        reason = self._open(trainer)
        self.active = self._anyone_active(trainer, reason is None)
        if not self.active:
            self.inactive_reason = reason
            rank_zero_info(f"GPU health monitor inactive: {reason}")
            return
        if reason is not None:  # this rank cannot read its GPU while others can: a finding at every poll
            self._start = {"status": "skipped", "reason": reason}
        self._me = {"rank": trainer.global_rank, "host": _hostname(), "gpu": self._start.get("index"),
                    "pci_bus_id": self._start.get("pci_bus_id"), "coords": _coordinates(trainer)}
        if self._start.get("status") == "skipped":
            return
        for finding in self._judge(self._start, xids=()):
            self._known_at_start.add((finding["check"], finding["severity"]))
            log.warning(finding_line(self._me, [finding["severity"], finding["check"], finding["detail"]],
                                     trainer.global_step) + "; present at the start of training, not acted on")
        wait = self._xid_source or (self._reader.xid_waiter() if self._reader is not None else None)
        if wait is not None:
            self._watcher = XidWatcher(wait).start()
        rank_zero_info(f"GPU health monitor: polling every {self.every_n_steps} steps, on_fault={self.on_fault!r}"
                       + ("" if wait is not None else " (no XID events: NVML's event API unavailable)"))

    def _open(self, trainer: "pl.Trainer") -> Optional[str]:
        """Open this rank's reader and read the start record; ``None`` when it reads, else why not."""
        index, bus, reason = _device_ids(trainer) if self._source is None else (None, None, None)
        if reason is not None:
            return reason
        self._reader = NvmlReader(index, bus, self._source)
        reason = self._reader.open()
        if reason is None:
            self._start = self._reader.read()
            reason = self._start.get("reason") if self._start.get("status") == "skipped" else None
        return reason

    @staticmethod
    def _anyone_active(trainer: "pl.Trainer", mine: bool) -> bool:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return mine
        flag = torch.tensor([float(mine)])
        group = getattr(trainer.strategy, "checkpoint_group", None)
        if group is None and dist.get_backend() != "gloo":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    # ------------------------------------------------------------------ polls

    def _judge(self, record: dict[str, Any], xids: list[int]) -> list[dict]:
        return check_gpu_health(record, self.expected_nvlinks, self._me.get("host", ""), self._me.get("rank"),
                                baseline=self._start, thresholds=self.thresholds, xids=xids)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.active:
            return
        step = trainer.global_step
        if step % self.every_n_steps or step == self._last_poll or step == 0:  # 0: accumulating, nothing trained
            return
        self._last_poll = step
        started = time.perf_counter()
        reports = all_gather_reports(self._local_report(), getattr(trainer.strategy, "checkpoint_group", None))
        errors = self._report(trainer, reports, step)
        self.poll_seconds.append(time.perf_counter() - started)
        if errors and self.on_fault == "stop":
            self._stop(trainer, step, errors)

    def _local_report(self) -> dict[str, Any]:
        """This rank's findings (not those known at the start) and figures, for the all-gather."""
        if self._start.get("status") == "skipped":
            return {**self._me, "findings": [["warning", "nvml", f"GPU not readable: {self._start.get('reason')}"]]}
        record = self._reader.read() if self._reader is not None else {}
        if record.get("status") == "skipped":
            return {**self._me, "findings": [["warning", "nvml", f"GPU not readable: {record.get('reason')}"]]}
        xids = self._watcher.drain() if self._watcher is not None else []
        findings = [[f["severity"], f["check"], f["detail"]] for f in self._judge(record, xids)
                    if f["check"] == "xid" or (f["check"], f["severity"]) not in self._known_at_start]
        if self._watcher is not None and self._watcher.error:
            findings.append(["warning", "xid", self._watcher.error])
        return {**self._me, "findings": findings, "figures": device_figures(record, self._start)}

    def _report(self, trainer: "pl.Trainer", reports: list[dict[str, Any]], step: int) -> list[tuple[dict, list]]:
        """Log new findings (rank 0) and the per-node figures; the error findings of this poll."""
        errors = []
        for report in reports:
            for finding in report.get("findings", []):
                severity, check, _ = finding
                if severity == "error":
                    errors.append((report, finding))
                key = (int(report["rank"]), check, severity)
                if key in self._reported and check != "xid":
                    continue
                self._reported.add(key)
                line = finding_line(report, finding, step)
                self.findings.append({"step": step, "rank": report["rank"], "host": report["host"],
                                      "severity": severity, "check": check, "line": line})
                if trainer.is_global_zero:
                    log.warning(line)
        self.last_metrics = node_metrics(reports)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_metrics, step=step)
        return errors

    def _stop(self, trainer: "pl.Trainer", step: int, errors: list[tuple[dict, list]]) -> None:
        checkpointer = next((c for c in trainer.callbacks if isinstance(c, FaultTolerantCheckpoint)), None)
        folder = Path(self.dirpath) if self.dirpath else Path(checkpointer.dirpath) if checkpointer else Path(
            trainer.default_root_dir)
        hosts = sorted({report["host"] for report, _ in errors})
        exclude = folder / EXCLUDE_HOSTS_FILE
        if trainer.is_global_zero:
            write_exclude_hosts(exclude, hosts)
        lines = [finding_line(report, finding, step) for report, finding in errors]
        saved = stop(trainer, checkpointer, "; ".join(lines)).saved
        path = str(Path(checkpointer.dirpath) / step_dirname(step)) if checkpointer is not None else None
        self._close()
        fault = GPUFault(step, lines, saved, path, str(exclude), hosts)
        if trainer.is_global_zero:
            log.error(str(fault))
        raise fault

    # ------------------------------------------------------------------ end

    def _close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._close()


def write_exclude_hosts(path: Path, hosts: list[str]) -> list[str]:
    """Add ``hosts`` to the exclusion file (one host a line, kept across runs, no duplicates); its hosts now."""
    path.parent.mkdir(parents=True, exist_ok=True)
    known = [line.strip() for line in path.read_text().splitlines()] if path.exists() else []
    known = [h for h in known if h and not h.startswith("#")]
    merged = known + [h for h in hosts if h not in known]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("# hosts GPUHealthMonitor found faulty; the launchers exclude them on requeue or restart\n"
                   + "".join(f"{h}\n" for h in merged))
    tmp.replace(path)
    return merged
