"""lightning-hybrid: tensor x pipeline x data parallel training for PyTorch Lightning."""

from lightning_hybrid.callbacks.fault_tolerant import FaultTolerantCheckpoint
from lightning_hybrid.strategy import HybridParallelStrategy
from lightning_hybrid.version import __version__

__all__ = ["FaultTolerantCheckpoint", "HybridParallelStrategy", "__version__"]
