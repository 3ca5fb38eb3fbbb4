"""lightning-hybrid: tensor x pipeline x data parallel training for PyTorch Lightning.

The public names load on first use (PEP 562), so that the tools that are arithmetic (``lightning-hybrid plan``,
:mod:`lightning_hybrid.planner`) import neither torch nor Lightning. ``from lightning_hybrid import
HybridParallelStrategy`` registers the strategy as ``"hybrid"`` with Lightning; where Lightning is imported already
(``import lightning as L`` first, as a training script does), ``import lightning_hybrid`` registers it at once.
"""

import sys
from typing import Any

from lightning_hybrid.version import __version__

__all__ = ["FaultTolerantCheckpoint", "HybridParallelStrategy", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "HybridParallelStrategy":
        from lightning_hybrid.strategy import HybridParallelStrategy

        return HybridParallelStrategy
    if name == "FaultTolerantCheckpoint":
        from lightning_hybrid.callbacks.fault_tolerant import FaultTolerantCheckpoint

        return FaultTolerantCheckpoint
    raise AttributeError(f"module 'lightning_hybrid' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if "lightning.pytorch" in sys.modules:  # Lightning is loaded anyway: register "hybrid" as importing the package did
    from lightning_hybrid.strategy import HybridParallelStrategy  # noqa: F401
