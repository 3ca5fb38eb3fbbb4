"""Training health: guards against a non-finite loss or gradient and against loss spikes.

Every optimizer step, between backward and the update, :class:`TrainingHealth` checks the monitored loss (the
global mean that the LightningModule logs) and the global gradient norm over every stage and shard. One small
all-reduce carries both (each rank's share of the squared norm, a non-finite flag, the loss) and makes every rank
decide alike; with norm clipping on, the clipping of the same step reuses that norm (no second all-reduce). A
step whose policy is ``"skip"`` is not applied on any rank (weights and optimizer state unchanged,
the step counter and LR schedule advance): the callback asks the strategy, through
``strategy.skip_next_optimizer_step()`` (:class:`~lightning_hybrid.HybridParallelStrategy`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_hybrid.callbacks.consistency import find_inconsistent, replica_checksums
from lightning_hybrid.callbacks.recheck import StepInputs, capture, differing_ranks, rerun_local_loss, same_bits
from lightning_hybrid.callbacks.rollback import (
    EXIT_CODE_UNHEALTHY,
    TrainingUnhealthy,
    find_checkpointer,
    roll_back,
    stop,
)
from lightning_hybrid.distributed.clip_grad import local_grad_square_sum

__all__ = ["TrainingHealth", "POLICIES", "EXIT_CODE_UNHEALTHY", "TrainingUnhealthy"]

POLICIES = ("skip", "rollback", "stop", "warn")


def _check_policy(name: str, value: Any) -> str:
    if value not in POLICIES:
        raise ValueError(f"{name}={value!r} is not a policy; use one of {', '.join(map(repr, POLICIES))}")
    return value


def _check_number(name: str, value: Any, low: float, inclusive: bool, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= low if inclusive else value > low)
    if not ok:
        what = "an integer" if integer else "a finite number"
        raise ValueError(f"{name}={value!r} must be {what} {'>=' if inclusive else '>'} {low}")


def _check_arguments(spike_factor: float, window: int, spike_zscore: Optional[float], max_rollbacks: int,
                     skip_batches: Any, recheck: bool, consistency_every_n_steps: Optional[int],
                     rollback_after: int) -> None:
    _check_number("spike_factor", spike_factor, 1.0, inclusive=False)
    _check_number("rollback_after", rollback_after, 1, inclusive=True, integer=True)
    _check_number("window", window, 2, inclusive=True, integer=True)
    if spike_zscore is not None:
        _check_number("spike_zscore", spike_zscore, 0.0, inclusive=False)
    _check_number("max_rollbacks", max_rollbacks, 0, inclusive=True, integer=True)
    if skip_batches is not None:
        _check_number("skip_batches", skip_batches, 1, inclusive=True, integer=True)
    if not isinstance(recheck, bool):
        raise TypeError(f"recheck={recheck!r} must be True or False")
    if consistency_every_n_steps is not None:
        _check_number("consistency_every_n_steps", consistency_every_n_steps, 1, inclusive=True, integer=True)


def _hostnames() -> list[str]:
    """Every rank's host name, by rank (one object all-gather; once per fit)."""
    import socket

    import torch.distributed as dist

    hosts = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def _ranks_per_stage(strategy: Any) -> int:
    try:
        dims = strategy.dims
    except (AttributeError, RuntimeError):
        return int(getattr(strategy, "world_size", 1))  # DDP-like: every rank holds a full copy
    return int(strategy.world_size) // int(dims.pp)


class TrainingHealth(pl.Callback):
    """Skips optimizer steps with a non-finite loss or gradient; rolls back in process on a loss spike.

    A spike is a loss above ``spike_factor`` times the median of the last ``window`` healthy losses, or, with
    ``spike_zscore``, more than that many standard deviations above their mean; it is tested once ``window``
    healthy losses are known. Skipped losses do not enter the window.

    Logs ``health/{skipped_steps, rollbacks, grad_norm, loss_spike_ratio}`` to every logger (rank 0) each step;
    ``events`` lists what happened (step, kind, action, loss, grad norm); at the end of training rank 0 prints
    one summary line (also in ``summary``).

    Policies (the step of the event is never applied, except under ``"warn"``):

    - ``"skip"``: the optimizer step is not applied on any rank; after ``rollback_after`` bad steps in a row the
      next one rolls back instead (when a FaultTolerantCheckpoint is there).
    - ``"rollback"``: at the end of the step, every rank reloads the newest committed checkpoint of the Trainer's
      :class:`~lightning_hybrid.callbacks.FaultTolerantCheckpoint` in place (no restart: weights, optimizer
      states, RNG, LR schedulers, step counter) and the samples read since that checkpoint are never trained on:
      the loader goes on past them, and their range goes into the manifests (every committed one, every later
      one) so a resumed run on any mesh leaves them out too. After ``max_rollbacks`` rollbacks the next one stops.
      Without a FaultTolerantCheckpoint, or before its first commit, a rollback is a skip (warned once at setup).
    - ``"stop"``: the step is not applied, a checkpoint is saved (with a FaultTolerantCheckpoint) and every rank
      raises :class:`TrainingUnhealthy`, a ``SystemExit`` with code ``EXIT_CODE_UNHEALTHY`` (76; 75 is preemption).
    - ``"warn"``: reported and applied.

    Args:
        on_nan: policy for a non-finite loss or gradient norm (default ``"skip"``).
        on_spike: policy for a loss spike (default ``"rollback"``).
        spike_factor: a loss above this multiple of the running median is a spike (> 1).
        window: healthy steps of the running median (>= 2).
        consistency_every_n_steps: every this many steps (after the update) compare the weights of every group of
            replicas bitwise: DP replicas under ``data_parallel="replicate"``, and the parameters TP peers hold whole
            (norms); one all-gather of three int64 checksums per rank. A mismatch is warned about, naming the odd
            ranks (outside the largest agreeing subset) and their hosts, and recorded in ``events``.
            Needs :class:`~lightning_hybrid.HybridParallelStrategy`.
        max_rollbacks: rollbacks allowed in one fit (>= 0); the next event that would roll back stops instead.
        rollback_after: bad steps in a row (each skipped) after which the next one rolls back (>= 1).
        recheck: on an event, first re-run the step from the same weights, batch and RNG state on every rank
            (:mod:`~lightning_hybrid.callbacks.recheck`): the same local loss on every rank blames the data (the
            event's policy applies, ``cause="data"``); a rank whose loss changed is reported with its host as
            suspected hardware (``cause="hardware"``) and ``on_hardware`` applies.
        on_hardware: policy when the re-run points at hardware: ``"stop"`` (default: save, exit with code 76, the
            message names the ranks and hosts for the launcher to exclude) or ``"skip"``.
        skip_batches: on a rollback, skip only the last this many batches (>= 1) of those read since the checkpoint;
            the ones before are read again (the data is rewound to the checkpoint, when it is of the same epoch;
            otherwise everything since the epoch's start is skipped). ``None``: every batch since the checkpoint.
        spike_zscore: also a spike: a loss more than this many standard deviations above the window's mean.
        monitor: the logged metric holding the global mean training loss.

    Raises:
        ValueError: an unknown policy, a spike factor <= 1, a window under 2, or a feature not available yet.
    """

    def __init__(self, on_nan: str = "skip", on_spike: str = "rollback", spike_factor: float = 3.0,
                 window: int = 20, skip_batches: Any = None, max_rollbacks: int = 3, recheck: bool = False,
                 consistency_every_n_steps: Optional[int] = None, spike_zscore: Optional[float] = None,
                 monitor: str = "train_loss", rollback_after: int = 3, on_hardware: str = "stop") -> None:
        self.on_nan = _check_policy("on_nan", on_nan)
        self.on_spike = _check_policy("on_spike", on_spike)
        _check_arguments(spike_factor, window, spike_zscore, max_rollbacks, skip_batches, recheck,
                         consistency_every_n_steps, rollback_after)
        self.rollback_after, self.skip_batches = rollback_after, skip_batches
        if on_hardware not in ("stop", "skip"):
            raise ValueError(f"on_hardware={on_hardware!r} is not a policy; use 'stop' or 'skip'")
        self.recheck, self.on_hardware = recheck, on_hardware
        self._inputs: Optional[StepInputs] = None
        self._first_loss: Optional[torch.Tensor] = None
        self._bad_in_a_row = 0
        self._pending: Optional[dict[str, Any]] = None  # a rollback or stop decided this step, done at its end
        self.rollback_seconds: list[float] = []
        self._checkpointer: Any = None
        self.spike_factor, self.window, self.spike_zscore = float(spike_factor), window, spike_zscore
        self.max_rollbacks, self.monitor = max_rollbacks, monitor
        self.consistency_every_n_steps = consistency_every_n_steps
        self._healthy: deque = deque(maxlen=window)
        self.events: list[dict[str, Any]] = []
        self.skipped_steps = 0
        self.rollbacks = 0
        self.checked_steps = 0
        self.last_metrics: dict[str, float] = {}
        self.summary: Optional[str] = None
        self._last_consistency_step = -1
        self._hosts: list[str] = []

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        import torch.distributed as dist

        if self.recheck and dist.is_available() and dist.is_initialized():
            self._hosts = _hostnames()
        if self.consistency_every_n_steps is not None:
            if not hasattr(trainer.strategy, "dims"):
                raise ValueError(f"TrainingHealth's consistency check needs HybridParallelStrategy, not "
                                 f"{type(trainer.strategy).__name__}")
            self._hosts = self._hosts or _hostnames()
        guarded = {self.on_nan, self.on_spike, *([self.on_hardware] if self.recheck else [])} - {"warn"}
        if guarded and not callable(getattr(trainer.strategy, "enable_step_skips", None)):
            raise ValueError(f"TrainingHealth's {sorted(guarded)[0]!r} policy needs HybridParallelStrategy; "
                             f"{type(trainer.strategy).__name__} cannot skip an optimizer step")
        if guarded:
            trainer.strategy.enable_step_skips()  # the guard wraps optimizer steps from now on
        self._checkpointer = find_checkpointer(trainer, self)
        if self._checkpointer is None and ("rollback" in guarded or self.on_nan == "skip"):
            rank_zero_warn("TrainingHealth: no FaultTolerantCheckpoint among the callbacks, so a rollback (on_spike="
                           "'rollback', or after rollback_after bad steps) skips the step instead")

    def spike_ratio(self, loss: Optional[float]) -> float:
        """The loss over the running median of healthy losses (0 while fewer than ``window`` are known)."""
        if loss is None or len(self._healthy) < self.window:
            return 0.0
        median = statistics.median(self._healthy)
        return loss / median if median > 0 else 0.0

    def _is_spike(self, loss: Optional[float], ratio: float) -> bool:
        if loss is None or len(self._healthy) < self.window:
            return False
        if ratio > self.spike_factor:
            return True
        if self.spike_zscore is not None:
            mean, std = statistics.fmean(self._healthy), statistics.pstdev(self._healthy)
            return std > 0 and (loss - mean) / std > self.spike_zscore
        return False

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.recheck:
            self._inputs, self._first_loss = capture(batch, batch_idx), None

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if self.recheck:
            self._first_loss = loss.detach().clone()

    def _measure(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                 optimizer: torch.optim.Optimizer) -> tuple[bool, Optional[float], float]:
        """(any rank saw a non-finite loss, the loss or ``None`` when not logged, the global gradient norm), the same
        on every rank, from one all-reduce (SUM, float64) of ``[this rank's share of the squared grad norm,
        non-finite flag, finite loss, 1 if it reported one]``. The norm goes to the clipping of this step when on."""
        import torch.distributed as dist

        params = [p for group in optimizer.param_groups for p in group["params"]]
        square = local_grad_square_sum(params, _ranks_per_stage(trainer.strategy))
        value = trainer.callback_metrics.get(self.monitor)
        loss = float(value) if value is not None else None
        finite = loss is not None and math.isfinite(loss)
        extra = torch.tensor([float(loss is not None and not finite), loss if finite else 0.0, float(finite)],
                             dtype=torch.float64, device=square.device)
        stats = torch.cat([square.reshape(1), extra])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                stats = stats.cpu()
            dist.all_reduce(stats)
        norm = stats[0].sqrt()
        handoff = getattr(trainer.strategy.precision_plugin, "hybrid_step_norm", None)
        if handoff is not None:  # gradient clipping (if on) takes it instead of all-reducing again
            clipping = trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm")
            handoff.put(norm.to(square.device) if clipping else None)
        reported = float(stats[3])
        return bool(stats[1] > 0), (float(stats[2]) / reported if reported else None), float(norm)

    def _rechecked(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", policy: str) -> tuple[str, dict]:
        """Re-run the step; (the policy to apply, what the event records of the verdict)."""
        if not self.recheck or self._inputs is None:
            return policy, {}
        again = rerun_local_loss(trainer, pl_module, self._inputs)
        import torch.distributed as dist

        gloo = not dist.is_initialized() or dist.get_backend() == "gloo"
        device = torch.device("cpu") if gloo else pl_module.device
        ranks = differing_ranks(not same_bits(self._first_loss, again), device)
        if not ranks:
            return policy, {"cause": "data"}
        hosts = [self._hosts[r] if r < len(self._hosts) else "" for r in ranks]
        return self.on_hardware, {"cause": "hardware", "ranks": ranks, "hosts": hosts}

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        nonfinite_loss, loss, grad_norm = self._measure(trainer, pl_module, optimizer)
        ratio = self.spike_ratio(loss)
        kind = None
        if nonfinite_loss or not math.isfinite(grad_norm):
            kind, policy = "nan", self.on_nan
        elif self._is_spike(loss, ratio):
            kind, policy = "spike", self.on_spike
        self.checked_steps += 1
        step = trainer.global_step
        if kind is None:
            self._bad_in_a_row = 0
            if loss is not None:
                self._healthy.append(loss)
        else:
            self._bad_in_a_row += 1
            policy, verdict = self._rechecked(trainer, pl_module, policy)
            if policy == "skip" and self._bad_in_a_row > self.rollback_after and self._checkpointer is not None \
                    and verdict.get("cause") != "hardware":
                policy = "rollback"
            self._act(trainer, step, kind, policy, loss, grad_norm, verdict)
        self.last_metrics = {"health/skipped_steps": float(self.skipped_steps), "health/rollbacks": float(
            self.rollbacks), "health/grad_norm": grad_norm, "health/loss_spike_ratio": ratio}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_metrics, step=step)

    def _act(self, trainer: "pl.Trainer", step: int, kind: str, policy: str, loss: Optional[float],
             grad_norm: float, verdict: dict) -> None:
        if policy != "warn":
            trainer.strategy.skip_next_optimizer_step()
            self.skipped_steps += 1
        event = {"step": step, "kind": kind, "action": policy, "loss": loss, "grad_norm": grad_norm, **verdict}
        self.events.append(event)
        if policy in ("rollback", "stop"):
            self._pending = event
        what = "a non-finite loss or gradient" if kind == "nan" else "a loss spike"
        done = {"warn": "step applied", "skip": "optimizer step skipped on every rank",
                "rollback": "optimizer step skipped; rolling back", "stop": "optimizer step skipped; stopping"}
        rank_zero_warn(f"training health: step {step} has {what} (loss {loss}, grad norm {grad_norm:.4g}); "
                       f"{done[policy]}")

    def _finish_event(self, trainer: "pl.Trainer") -> None:
        """The rollback or stop decided during this step, at its end (every rank together)."""
        event, self._pending = self._pending, None
        if event["action"] == "rollback" and self.rollbacks >= self.max_rollbacks:
            event["action"] = "stop"
            reason = f"max_rollbacks={self.max_rollbacks} reached and step {event['step']} has a {event['kind']}"
        elif event.get("cause") == "hardware":
            names = ", ".join(f"rank {r} ({h})" for r, h in zip(event["ranks"], event["hosts"]))
            reason = (f"hardware suspected: {names} computed another result when step {event['step']} was re-run "
                      f"from the same state and batch; exclude that node and resume")
        else:
            reason = f"step {event['step']} has a {event['kind']} (on_{event['kind']}='stop')"
        if event["action"] == "stop":
            raise stop(trainer, self._checkpointer, reason)
        done = roll_back(trainer, self._checkpointer, self.skip_batches) if self._checkpointer is not None else None
        if done is None:
            event["action"] = "skip"  # nothing committed to return to yet: the step stays skipped
            rank_zero_warn(f"training health: no committed checkpoint to roll back to at step {event['step']}; "
                           f"the step was skipped instead")
            return
        self.rollbacks += 1
        self._bad_in_a_row = 0
        self.rollback_seconds.append(done.seconds)
        event.update(to_step=done.to_step, skipped=list(done.skipped) if done.skipped else None,
                     seconds=done.seconds)
        rank_zero_warn(f"training health: rolled back to {done.folder} (step {done.to_step}) in {done.seconds:.2f} s;"
                       f" samples {done.skipped} (epoch, start, end) are skipped for good")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._pending is not None:
            self._finish_event(trainer)
        n = self.consistency_every_n_steps
        if n and trainer.global_step % n == 0 and trainer.global_step != self._last_consistency_step:
            self._last_consistency_step = trainer.global_step
            self.check_consistency(trainer, pl_module)

    def check_consistency(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> list:
        """Compare the weight checksums of every group of replicas (one all-gather of 3 integers per rank); a
        mismatch is reported naming the odd ranks and their hosts, and recorded in ``events``."""
        import torch.distributed as dist

        strategy = trainer.strategy
        dims = strategy.dims
        replicate_dp = getattr(getattr(strategy, "options", None), "data_parallel", "fsdp") == "replicate"
        model = getattr(pl_module, "model", None)
        sums = replica_checksums(model if isinstance(model, torch.nn.Module) else pl_module, dims, replicate_dp)
        if dist.get_backend() != "gloo":
            sums = sums.to(pl_module.device)
        gathered = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, sums)
        found = find_inconsistent([g.tolist() for g in gathered], dims)
        for spans, odd, peers in found:
            names = ", ".join(f"rank {r} ({self._hosts[r]})" for r in odd)
            self.events.append({"step": trainer.global_step, "kind": "inconsistent", "action": "warn",
                                "dims": spans, "ranks": odd, "peers": peers})
            rank_zero_warn(f"training health: weights differ across {spans} replicas at step {trainer.global_step}: "
                           f"{names} disagree with ranks {', '.join(map(str, peers)) or '-'}")
        return found

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        nans = sum(e["kind"] == "nan" for e in self.events)
        spikes = sum(e["kind"] == "spike" for e in self.events)
        self.summary = (f"training health: {self.checked_steps} steps checked, {nans} non-finite, {spikes} loss "
                        f"spikes, {self.skipped_steps} steps skipped, {self.rollbacks} rollbacks")
        if trainer.is_global_zero:
            print(self.summary, flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.rollbacks = int(state_dict.get("rollbacks", 0))
