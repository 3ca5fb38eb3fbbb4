"""One GPUHealthMonitor poll on the real device, without training: NVML record, XID event registration, judgement.

    python benchmarks/gpu_health_poll.py [--device 0] [--xid-seconds 2]

Reads cuda:DEVICE's record through the reader the monitor uses (by the PCI bus id CUDA reports), registers for XID
events and waits ``--xid-seconds`` in the background thread, reads the record again and judges it against the first
(the monitor's poll), then prints one JSON document: the record, the findings, the XIDs seen, whether the event API
worked and the seconds of one read. Exit 0 when NVML read the device, 1 otherwise. Written for
benchmarks/gpu_smoke.sh; it has not run on hardware yet (no GPU where it was written).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_hybrid.preflight.health import check_gpu_health
from lightning_hybrid.preflight.nvml import NvmlReader, XidWatcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--xid-seconds", type=float, default=2.0, help="how long to listen for XID events")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(args.device)
    bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    reader = NvmlReader(args.device, bus)
    reason = reader.open()
    if reason is not None:
        print(json.dumps({"ok": False, "reason": reason}))
        return 1
    start = reader.read()
    wait = reader.xid_waiter()
    watcher = XidWatcher(wait, timeout=0.5).start() if wait is not None else None
    time.sleep(args.xid_seconds)
    began = time.perf_counter()
    now = reader.read()
    read_seconds = time.perf_counter() - began
    xids = watcher.drain() if watcher is not None else []
    if watcher is not None:
        watcher.stop()
    reader.close()
    findings = check_gpu_health(now, baseline=start, xids=xids, rank=0, host="localhost")
    print(json.dumps({"ok": now.get("status") == "checked", "pci_bus_id": bus, "record": now,
                      "findings": [f["message"] for f in findings], "xid_events": wait is not None, "xids": xids,
                      "read_seconds": round(read_seconds, 4)}, indent=1))
    return 0 if now.get("status") == "checked" else 1


if __name__ == "__main__":
    raise SystemExit(main())
