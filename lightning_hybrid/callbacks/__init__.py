"""Training callbacks: fault-tolerant checkpoints, throughput/MFU/memory monitor with straggler detection, training
health guards (non-finite and spiking losses), GPU hardware health during training."""

from lightning_hybrid.callbacks.fault_tolerant import EXIT_CODE_PREEMPTED, FaultTolerantCheckpoint, Preempted
from lightning_hybrid.callbacks.gpu_health import GPUFault, GPUHealthMonitor
from lightning_hybrid.callbacks.health import EXIT_CODE_UNHEALTHY, TrainingHealth, TrainingUnhealthy
from lightning_hybrid.callbacks.stragglers import Straggler, StragglerDetector, find_stragglers
from lightning_hybrid.callbacks.throughput import ThroughputMonitor, flops_per_token, peak_flops

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "EXIT_CODE_UNHEALTHY",
    "FaultTolerantCheckpoint",
    "GPUFault",
    "GPUHealthMonitor",
    "Preempted",
    "Straggler",
    "StragglerDetector",
    "ThroughputMonitor",
    "TrainingHealth",
    "TrainingUnhealthy",
    "find_stragglers",
    "flops_per_token",
    "peak_flops",
]
