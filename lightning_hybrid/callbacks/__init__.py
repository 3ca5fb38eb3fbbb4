"""Training callbacks: throughput/MFU/memory monitor with straggler detection."""

from lightning_hybrid.callbacks.stragglers import Straggler, StragglerDetector, find_stragglers
from lightning_hybrid.callbacks.throughput import ThroughputMonitor, flops_per_token, peak_flops

__all__ = [
    "Straggler",
    "StragglerDetector",
    "ThroughputMonitor",
    "find_stragglers",
    "flops_per_token",
    "peak_flops",
]
