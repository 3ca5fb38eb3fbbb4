"""Hardware or data? Re-run a step that went wrong from the same state and batch (``TrainingHealth(recheck=True)``).

At the start of every step the batch and the RNG states are kept (references and a few KB); the first execution's
local loss (this rank's share, before any reduction across data-parallel ranks) is taken in ``on_before_backward``.
On an event, before the optimizer step, every rank runs ``training_step`` again on the same batch from the same
weights and RNG state (gradients kept aside and put back, nothing logged, the RNG state of the run restored
after), and compares the bits of its local loss with the first execution's. One all-gather of a flag per rank:
no rank differs, the step is reproducible and the data is blamed; a rank that differs computed something else
from the same inputs, and the hardware is suspected. Under tensor parallelism a wrong value spreads to the TP
peers within the step, so they are named together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch

__all__ = ["StepInputs", "capture", "rerun_local_loss", "differing_ranks", "same_bits"]


@dataclass
class StepInputs:
    """What re-running a step needs: its batch, its index, the RNG states at its start."""

    batch: Any
    batch_idx: int
    rng: tuple[torch.Tensor, Optional[list[torch.Tensor]]]


def _rng_state() -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng(state: tuple[torch.Tensor, Optional[list[torch.Tensor]]]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def capture(batch: Any, batch_idx: int) -> StepInputs:
    """The inputs of the step starting now (the batch by reference: Lightning does not change it in place)."""
    return StepInputs(batch, batch_idx, _rng_state())


def same_bits(first: Optional[torch.Tensor], second: Optional[torch.Tensor]) -> bool:
    """Bitwise equality of two losses (NaN equals the same NaN; ``None`` only equals ``None``)."""
    if first is None or second is None:
        return first is None and second is None
    a, b = first.detach().double().cpu().reshape(-1), second.detach().double().cpu().reshape(-1)
    return a.shape == b.shape and torch.equal(a.view(torch.int64), b.view(torch.int64))


def rerun_local_loss(trainer: "pl.Trainer", pl_module: "pl.LightningModule", inputs: StepInputs) -> torch.Tensor:
    """Run ``training_step`` on ``inputs`` again (every rank together) and return this rank's local loss.

    Without a pipeline only the forward runs (under ``no_grad``); a pipeline schedule runs forward and backward
    in one call, so the gradients are set aside and put back. Nothing is logged; the RNG state is restored.
    """
    params = list(pl_module.parameters())
    saved = [p.grad for p in params]
    after = _rng_state()
    pl_module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # the first execution logged
    try:
        _set_rng(inputs.rng)
        for p in params:
            p.grad = None
        if getattr(trainer.strategy, "pipeline", None) is None:
            with torch.no_grad():
                loss = pl_module.training_step(inputs.batch, inputs.batch_idx)
        else:
            loss = pl_module.training_step(inputs.batch, inputs.batch_idx)
    finally:
        del pl_module.log
        for p, grad in zip(params, saved):
            p.grad = grad
        _set_rng(after)
    loss = loss["loss"] if isinstance(loss, dict) else loss
    return loss.detach()


def differing_ranks(differs: bool, device: torch.device) -> list[int]:
    """The ranks whose re-run differed (one all-gather of one flag per rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [0] if differs else []
    flag = torch.tensor([int(differs)], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, flag)
    return [rank for rank, f in enumerate(flags) if int(f.item())]
