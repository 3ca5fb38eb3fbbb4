"""lightning-hybrid: tensor x pipeline x data parallel training for PyTorch Lightning."""

from lightning_hybrid.strategy import HybridParallelStrategy

__version__ = "0.1.0"

__all__ = ["HybridParallelStrategy", "__version__"]
