"""Build one rank of a job with the strategy's own code and trace one training step.

The sequence is the one Lightning's ``Trainer.fit`` runs, hook by hook, minus the loop around it:
``setup_environment`` (validation, process groups, mesh), ``configure_model`` (the model on the meta device),
``setup`` (stage split, TP plan, recompute, compile flags, FSDP2 wrapping, precision, materialization,
initialization, optimizer and LR schedule), then one ``optimizer_step`` whose closure runs ``training_step`` and
``backward``, with gradient clipping, as Lightning's automatic optimization does. Logging (Lightning's loop) is not
run. On the fake backend (``fake=True``) the tensors are fake from materialization on (:mod:`.fake`); on a real
process group (a test's torchrun) the same function measures the real run.

Pipeline stages: torch's schedules exchange stage shapes and a static/dynamic vote with object and tensor messages
that carry nothing on the fake backend, so a dry run gives each stage its shapes (:func:`stage_examples`) and the
vote's answer (static); the schedule itself, with its micro-batches in flight, runs unchanged.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_hybrid.distributed.context_parallel import shard_batch
from lightning_hybrid.distributed.data_parallel import torch_dtype
from lightning_hybrid.dryrun.accounting import (
    CollectiveCounter,
    MemoryPeaks,
    mesh_dimension_groups,
    model_state_bytes,
    state_bytes,
)
from lightning_hybrid.dryrun.recipe import DryRunJob

__all__ = ["RankResult", "run_rank", "stage_examples", "build_trainer"]


@dataclass
class RankResult:
    """What one rank built and did in its traced step (bytes; collectives as ``{dim: {kind: [calls, bytes]}}``)."""

    rank: int
    coordinates: dict[str, int]
    stages: list[int]
    state: dict[str, int]
    kind_peaks: dict[str, int]
    peak: dict[str, int]
    collectives: dict[str, dict[str, list[int]]]
    seconds: float
    max_rss: int = 0  # the most resident bytes this rank's process held (its own memory, not the job's)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stopped(self) -> Optional[str]:
        """Why the trace stopped before the step's end, or ``None``: ``"model state"`` (parameters, gradients and
        optimizer state alone exceed the limit, known right after setup) or ``"step"`` (the bytes held went over the
        limit during the step: the peak is at least ``total_peak``)."""
        return self.extra.get("stopped")

    @property
    def activation_peak(self) -> int:
        """Most activation bytes held at once (saved for backward, recompute included)."""
        return int(self.kind_peaks.get("Activation", 0))

    @property
    def total_peak(self) -> int:
        """Most bytes held at once, all kinds together."""
        return int(self.peak.get("Total", 0))


def build_trainer(job: DryRunJob, rank: int, fake: bool) -> Any:
    """A Trainer for ``job`` on CPU with ``HybridParallelStrategy``; on the fake world when ``fake``."""
    import lightning.pytorch as pl

    from lightning_hybrid.dryrun.fake import FakeWorldEnvironment, FakeWorldStrategy
    from lightning_hybrid.strategy import HybridParallelStrategy

    cls = FakeWorldStrategy if fake else HybridParallelStrategy  # object collectives carry nothing on the fake backend
    strategy = cls(**job.strategy, process_group_backend="fake" if fake else "gloo")
    plugins = [FakeWorldEnvironment(rank, job.world_size, job.devices_per_node)] if fake else None
    return pl.Trainer(accelerator="cpu", devices=job.devices_per_node, num_nodes=job.num_nodes, strategy=strategy,
                      precision=job.precision, plugins=plugins, max_steps=1000, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      gradient_clip_val=job.gradient_clip_val, accumulate_grad_batches=job.accumulate_grad_batches,
                      num_sanity_val_steps=0)


def stage_examples(stage: Any, job: DryRunJob, dims: Any, options: Any, precision: str, config: Any,
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(inputs, outputs) of a pipeline stage for one micro-batch, as meta tensors (what the schedule would learn
    from its neighbours): token ids into the first stage, the residual stream between stages (a sequence shard
    under sequence parallel), the logits out of the last."""
    mb = job.batch_size // options.num_microbatches
    seq = job.seq_len // dims.tp if options.sequence_parallel and dims.tp > 1 else job.seq_len
    fsdp = dims.dp > 1 and options.data_parallel == "fsdp"
    fsdp_dtype = torch_dtype(options.param_dtype(precision)) if fsdp else None
    stored = torch.bfloat16 if precision == "bf16-true" or options.compute_weights(dims, precision) else torch.float32
    hidden_dtype = fsdp_dtype or stored
    # with the loss on vocabulary shards the last stage outputs its shard of the logits
    vocab = config.vocab_size // dims.tp if options.loss_on_shards(dims) else config.vocab_size
    logits_dtype = torch.float32 if precision == "32-true" else torch.bfloat16

    def meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    hidden = meta((mb, seq, config.hidden_size), hidden_dtype).requires_grad_(True)
    inputs = meta((mb, job.seq_len), torch.int64) if stage.is_first else hidden
    logits = meta((mb, job.seq_len, vocab), logits_dtype).requires_grad_(True)
    outputs = logits if stage.is_last else hidden
    return (inputs,), (outputs,)


def _static_stages(strategy: Any, module: Any, job: DryRunJob, precision: str) -> None:
    """Give every pipeline stage its shapes and the static vote (torch's own exchange carries nothing here)."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    for stage in strategy.pipeline.stages:
        inputs, outputs = stage_examples(stage, job, strategy.dims, strategy.options, precision, module.config)
        stage._user_meta = _StageMeta(inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas(outputs),
                                      input_grads=None, output_grads=None)
        stage._warmup_forward_vote = lambda *args, **kwargs: torch.ones(1, dtype=torch.int32)
        stage._warmup_backward_result = lambda *args, **kwargs: torch.ones(1, dtype=torch.int32)


def _setup(job: DryRunJob, rank: int, fake: bool) -> tuple[Any, Any]:
    """Trainer and module after the strategy's setup (model sharded and materialized, optimizer built)."""
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    from lightning_hybrid.models import CausalLM

    pl.seed_everything(job.seed, verbose=False)
    model_args = dict(job.model)
    if fake:
        model_args["init_from_hf"] = None  # shapes only: the released weights are not read
    module = CausalLM(**model_args)
    module.log = lambda *args, **kwargs: None  # Lightning's logging belongs to its loop, which is not run
    trainer = build_trainer(job, rank, fake)
    strategy = trainer.strategy
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    module.trainer = trainer
    strategy.connect(module)
    strategy.setup_environment()
    module.configure_model()
    strategy.setup(trainer)
    if fake and strategy.pipeline is not None:
        _static_stages(strategy, module, job, str(trainer.precision))
    return trainer, module


def _step(trainer: Any, module: Any, batch: tuple[torch.Tensor, torch.Tensor],
          tracker: Optional[MemoryPeaks] = None) -> dict[str, int]:
    """One optimizer step as Lightning's automatic optimization runs it; returns the gradient bytes after
    backward (a pipeline's strategy frees the gradients right after the optimizer step)."""
    strategy, optimizer = trainer.strategy, trainer.strategy.optimizers[0]
    grads: dict[str, int] = {}

    def closure() -> torch.Tensor:
        with tracker.outside_optimizer() if tracker is not None else contextlib.nullcontext():
            loss = module.training_step(batch, 0)
            module.optimizer_zero_grad(0, 0, optimizer)
            strategy.backward(loss, optimizer)
        grads.update(state_bytes(module.model))
        return loss

    strategy.optimizer_step(optimizer, closure)
    return grads


def _hold_optimizer_state(model: Any, optimizers: list[Any]) -> None:
    """Make the optimizer state that every step but the first holds from its start (AdamW's ``exp_avg``,
    ``exp_avg_sq`` and ``step``), with the optimizers' own step on zero gradients (fake tensors: the values do not
    matter): the traced step is then the job's steady state, whose peak is the one that must fit."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    for optimizer in optimizers:
        optimizer.step()
    for p in params:
        p.grad = None


def run_rank(job: DryRunJob, rank: int, fake: bool = True, warmup_steps: int = 0,
             config_name: Optional[str] = None, limit: Optional[float] = None) -> RankResult:
    """Build rank ``rank`` of ``job`` and trace one step (after ``warmup_steps`` untraced ones).

    With a ``limit`` (bytes), a rank that cannot fit stops as soon as that is certain (:attr:`RankResult.stopped`):
    right after setup when its model state alone exceeds it, else the moment the bytes held in the step do.

    On the fake backend (``fake=True``) this process joins a fake world of the job's size; otherwise the default
    process group must already be the real one (a torchrun worker).

    Raises:
        ValueError: the strategy's own one-line errors for a layout that does not fit the world or the model.
    """
    from lightning_hybrid.distributed.materialize import before_materialize
    from lightning_hybrid.dryrun.fake import DryRunTensorMode, fake_world

    start = time.perf_counter()
    mode = DryRunTensorMode()
    entered: list[bool] = []

    def enter_fake_mode() -> None:
        if not entered:
            mode.__enter__()
            entered.append(True)

    remove = before_materialize(enter_fake_mode) if fake else (lambda: None)
    try:
        with fake_world(rank, job.world_size) if fake else contextlib.nullcontext():
            try:
                return _build_and_trace(job, rank, fake, warmup_steps, start, limit)
            finally:
                if entered:
                    mode.__exit__(None, None, None)
    finally:
        remove()


def _build_and_trace(job: DryRunJob, rank: int, fake: bool, warmup_steps: int, start: float,
                     limit: Optional[float] = None) -> RankResult:
    trainer, module = _setup(job, rank, fake)
    strategy = trainer.strategy
    stages = [s.stage_index for s in strategy.pipeline.stages] if strategy.pipeline is not None else [0]
    result = RankResult(rank=rank, coordinates=strategy.dims.coordinates(rank), stages=stages, state={},
                        kind_peaks={}, peak={}, collectives={}, seconds=0.0)
    floor = model_state_bytes(module.model, strategy.optimizers)
    if limit is not None and sum(floor.values()) > limit:
        peak = {"Parameter": floor["parameters"], "Gradient": floor["gradients"], "Optstate": floor["optimizer"]}
        result.state, result.kind_peaks, result.peak = floor, dict(peak), {**peak, "Total": sum(floor.values())}
        result.extra["stopped"] = "model state"
        result.seconds, result.max_rss = time.perf_counter() - start, _max_rss()
        return result
    generator = torch.Generator().manual_seed(job.seed)
    ids = torch.randint(0, module.config.vocab_size, (job.batch_size, job.seq_len), generator=generator)
    # as the strategy's batch_to_device in Lightning's loop: under cp > 1 a rank keeps its share of each sequence
    batch = shard_batch((ids, ids.clone()), strategy)
    for _ in range(warmup_steps):
        _step(trainer, module, batch)
    if fake and warmup_steps == 0:
        _hold_optimizer_state(module.model, strategy.optimizers)
    tracker = MemoryPeaks(limit)
    tracker.track_external(module.model, *strategy.optimizers)
    counter = CollectiveCounter(mesh_dimension_groups(strategy.device_mesh, job.world_size))
    grads: dict[str, int] = {}
    try:
        with tracker, counter:
            grads = _step(trainer, module, batch, tracker)
    except Exception:
        if not tracker.exceeded:
            raise
    if tracker.exceeded:
        result.extra["stopped"] = "step"
    result.state = state_bytes(module.model, strategy.optimizers)
    result.state["gradients"] = grads.get("gradients", result.state["gradients"])
    result.kind_peaks, result.peak = dict(tracker.kind_peaks), tracker.peak_breakdown()
    result.collectives, result.seconds = counter.table(), time.perf_counter() - start
    result.max_rss = _max_rss()
    return result


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
