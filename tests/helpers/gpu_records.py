"""NVML-shaped device records (what :func:`lightning_hybrid.preflight.nvml.read_nvml` returns) for the preflight's
judge tests and the GPU health monitor's injected sources."""

from __future__ import annotations

import copy

HEALTHY_H100 = {
    "status": "checked", "index": 3, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-5f3c",
    "pci_bus_id": "00000000:9B:00.0",
    "nvlink": [True] * 18,
    "pcie": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
    "ecc": {"volatile_corrected": 0, "volatile_uncorrected": 0, "aggregate_corrected": 2, "aggregate_uncorrected": 0},
    "retired_pages": {"single_bit": 0, "double_bit": 0, "pending": False},
    "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
    "clocks": {"sm": 1980, "sm_max": 1980, "mem": 2619, "mem_max": 2619},
    "throttle_reasons": 0x4,  # software power cap: normal under load
    "temperature_c": 52,
}


def record(**changes) -> dict:
    """A deep copy of the healthy H100 record with top-level keys replaced."""
    out = copy.deepcopy(HEALTHY_H100)
    out.update(changes)
    return out


def gpu_of_rank(rank: int, **changes) -> dict:
    """The healthy record of the GPU that ``rank`` drives (index and PCI bus id per rank), with ``changes``."""
    return record(index=rank, pci_bus_id=f"00000000:{0x18 + 0x10 * rank:02X}:00.0", **changes)


def links_down(*links: int) -> list[bool]:
    return [i not in links for i in range(18)]
