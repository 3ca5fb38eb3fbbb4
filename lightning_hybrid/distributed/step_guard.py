"""Skipping one optimizer step on request: gradients are computed, nothing is applied.

Zeroing gradients does not skip a step: AdamW still decays the weights, moves its moments and counts the
step. Lightning's ``on_before_optimizer_step`` cannot cancel it either. Lightning's precision plugins call
``optimizer.step(closure=...)`` (or, with a grad scaler, run the closure and then ``optimizer.step()``); while a
step is guarded, this optimizer's ``step`` runs the closure (forward, backward and the ``on_before_optimizer_step``
hooks, where a callback such as :class:`~lightning_hybrid.callbacks.TrainingHealth` may request the skip) and then
calls the real ``step`` only when no skip was requested. The step counter of the Trainer and the LR scheduler
advance either way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["StepGuard"]

_MISSING = object()


class StepGuard:
    """Holds a skip request for the optimizer step in progress and counts the steps it skipped."""

    def __init__(self) -> None:
        self.active = False  # set by whoever may request a skip (TrainingHealth); otherwise steps run untouched
        self.requested = False
        self.skipped = 0

    def skip_next(self) -> None:
        """Do not apply the optimizer step now running (or the next one) on this rank."""
        self.requested = True

    def _guarded(self, real_step: Callable[..., Any]) -> Callable[..., Any]:
        def step(closure: Optional[Callable[[], Any]] = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self.requested:
                self.requested = False
                self.skipped += 1
                return loss
            return real_step()

        return step

    @contextmanager
    def guarding(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Within the block, ``optimizer.step`` obeys :meth:`skip_next`; afterwards it is what it was.

        Inactive (nobody may ask for a skip), the optimizer is left alone: an optimizer that calls its closure more
        than once (L-BFGS) keeps working wherever no skip can be requested.
        """
        if not self.active:
            yield
            return
        original = optimizer.__dict__.get("step", _MISSING)  # an LR scheduler may have wrapped it on the instance
        optimizer.step = self._guarded(optimizer.step)  # type: ignore[method-assign]
        try:
            yield
        finally:
            if original is _MISSING:
                del optimizer.step
            else:
                optimizer.step = original  # type: ignore[method-assign]
            self.requested = False
