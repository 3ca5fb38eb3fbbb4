"""Training callbacks: fault-tolerant checkpoints, throughput/MFU/memory monitor with straggler detection, training
health guards (non-finite and spiking losses)."""

from lightning_hybrid.callbacks.fault_tolerant import EXIT_CODE_PREEMPTED, FaultTolerantCheckpoint, Preempted
from lightning_hybrid.callbacks.health import TrainingHealth
from lightning_hybrid.callbacks.stragglers import Straggler, StragglerDetector, find_stragglers
from lightning_hybrid.callbacks.throughput import ThroughputMonitor, flops_per_token, peak_flops

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "FaultTolerantCheckpoint",
    "Preempted",
    "Straggler",
    "StragglerDetector",
    "ThroughputMonitor",
    "TrainingHealth",
    "find_stragglers",
    "flops_per_token",
    "peak_flops",
]
