"""Pipeline runner: build this rank's stages and schedule, and run a whole per-rank batch through it.

:func:`build_pipeline` splits a declared meta-device model into stages, parallelizes and materializes
each stage with the one parallelize sequence, and wraps them in a ``torch.distributed.pipelining``
schedule. :class:`PipelineRunner` runs one training or evaluation step of that schedule.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid.distributed.expert_parallel import keep_step_statistics, set_balance_grad_scale
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.parallelize import parallelize
from lightning_hybrid.distributed.pipeline.schedules import (
    V_SHAPED,
    check_batch_splits,
    last_stage_pp_rank,
    schedule_class,
    stage_ids_for_rank,
    theoretical_bubble,
)
from lightning_hybrid.distributed.pipeline.split import build_stages, plan_stages
from lightning_hybrid.distributed.pipeline.timer import StageTimer, format_bubble_report, gather_bubble_report
from lightning_hybrid.distributed.tensor_parallel import loss_parallel_context, vocab_parallel_loss
from lightning_hybrid.models.spec import IGNORE_INDEX, ParallelSpec, token_mean_loss

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineRunner", "build_pipeline", "forward_only_order", "forget_stage_shapes", "report_bubble"]


@contextlib.contextmanager
def forward_only_order(schedule: Any, microbatches: int) -> Iterator[None]:
    """Swap a forward-only action list into a V-shaped schedule (ZBV, DualPipeV) while it evaluates.

    ``eval()`` of ZBV and DualPipeV fails on their fused forward/backward actions
    (``can't steal_bwd_input if this stage doesn't have backward``), and a second schedule over the same
    stages corrupted later training. Their runtime runs any lowered action list: every rank runs the
    forwards of its stages, lowest stage first, all micro-batches each, and torch's lowering adds the
    sends and receives. This needs torch's private action types and lowering passes (no public API
    builds a custom order); ``tests/test_torch_private_apis.py`` fails loudly when they change.
    The training order is restored afterwards.
    """
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _add_unshard_reshard, _ComputationType

    saved = schedule.pipeline_order_with_comms
    stage_to_rank = dict(schedule.stage_index_to_group_rank)
    actions = {rank: [_Action(stage, _ComputationType.FORWARD, mb)
                      for stage in sorted(s for s, r in stage_to_rank.items() if r == rank)
                      for mb in range(microbatches)]
               for rank in sorted(set(stage_to_rank.values()))}
    # Lowered like _prepare_schedule_with_comms does, without its check that every stage runs backward.
    lowered = {rank: _add_unshard_reshard(ops) for rank, ops in actions.items()}
    schedule.pipeline_order_with_comms = _add_send_recv(lowered, stage_to_rank=lambda s: stage_to_rank[s],
                                                        num_stages=schedule._num_stages)
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = saved


def forget_stage_shapes(schedule: Any) -> None:
    """Make ``schedule`` infer its stages' activation shapes again at its next step, as a new schedule would.

    torch infers them (a forward on the meta device, metadata sent between the stages) at the first step and again
    at a switch between training and evaluation, and reuses its receive buffers otherwise: a forward-only batch of
    another shape than the last one would be received into buffers of the old shape. There is no public way to ask
    again, so this clears the schedule's private forward and backward "initialized" flags (both: a training step
    after it must infer its own shapes and gradients again); ``tests/test_torch_private_apis.py`` fails loudly when
    they change.
    """
    for flag in ("_stage_forward_initialized", "_stage_backward_initialized",  # PipelineScheduleSingle
                 "_stages_forward_initialized", "_stages_backward_initialized"):  # PipelineScheduleMulti
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)


class PipelineRunner:
    """Runs a whole per-rank batch through the pipeline schedule of this rank's stages.

    Training: forward and backward over all micro-batches (gradients accumulate in the stages'
    parameters). Evaluation: forward only. Every call returns, on every rank, the global mean loss
    over the label tokens of the global batch (the last stage computes it, the other stages receive it);
    each micro-batch's loss is normalized by :func:`~lightning_hybrid.models.spec.token_mean_loss`, as the
    one-stage path normalizes a rank's.

    Args:
        stages: this rank's ``PipelineStage`` objects (the schedule is built over them here).
        loss_sum: the model's ``loss_sum(logits, labels) -> (sum, count)``.
        pp_group / dp_group: process groups of this rank's pipeline and data-parallel peers.
        schedule_name: one of :data:`~lightning_hybrid.distributed.pipeline.schedules.PP_SCHEDULES`.
        microbatches: micro-batches per step.
        dp / pp / virtual_stages: data-parallel size, pipeline size and stages per rank.
        timer: measures the stages' busy time for the bubble report.
        container: the module holding this rank's stage parts under their global names (for the
            optimizer and checkpoints; never called).
    """

    def __init__(self, stages: list[Any], loss_sum: Callable, schedule_name: str, microbatches: int,
                 pp_group: "ProcessGroup", dp_group: Optional["ProcessGroup"], dp: int, pp: int,
                 virtual_stages: int, timer: StageTimer, container: nn.Module) -> None:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        self.stages = stages
        self._loss_sum = loss_sum
        self.schedule_name = schedule_name
        self.microbatches = microbatches
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.dp = dp
        self.pp = pp
        self.virtual_stages = virtual_stages
        self.timer = timer
        self.container = container
        self.last_stage_pp_rank = last_stage_pp_rank(schedule_name, pp)
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)
        self.grad_scale = 1.0  # 1 / accumulate_grad_batches, set by the strategy
        # torchft replica groups: averages a group's sums over the groups of the step (identity otherwise)
        self.cross_group: Callable[[Tensor], Tensor] = lambda tensor: tensor
        self._count = torch.ones(())  # the global batch's label tokens (set on the last stage before each step)
        # entered around every schedule step (the vocabulary-parallel loss's backward runs inside it)
        self.step_context: Callable[[], Any] = contextlib.nullcontext
        # forward_only(): what the last stage computes per micro-batch in place of the loss, and the last batch shape
        self._per_microbatch: Optional[Callable[[Tensor, Tensor], Tensor]] = None
        self._forward_only_shape: Optional[tuple[int, ...]] = None
        cls = schedule_class(schedule_name)
        first = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
        self.schedule = cls(first, n_microbatches=microbatches, loss_fn=self.loss_fn, scale_grads=False)

    @property
    def theoretical_bubble(self) -> float:
        """Idle fraction of a stage in the ideal version of this schedule."""
        return theoretical_bubble(self.schedule_name, self.pp, self.microbatches, self.virtual_stages)

    def loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        """Per micro-batch: its label-token loss sum as its part of the global token mean, times ``dp`` and the
        accumulation's ``grad_scale`` (:func:`~lightning_hybrid.models.spec.token_mean_loss`): what backward needs;
        inside :meth:`forward_only`, what its ``per_microbatch`` computes instead."""
        if self._per_microbatch is not None:
            return self._per_microbatch(output, target)
        total, _ = self._loss_sum(output, target)
        return token_mean_loss(total, self._count.to(total.device), self.dp, self.grad_scale)

    def _dp_sum(self, tensor: Tensor) -> Tensor:
        import torch.distributed as dist

        if self.dp_group is not None and self.dp > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def _forward_only(self) -> Any:
        if self.schedule_name in V_SHAPED:
            return forward_only_order(self.schedule, self.microbatches)
        return contextlib.nullcontext()

    def logits(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Optional[Tensor]:
        """Forward-only pass of a whole batch; the logits on the rank that holds the last stage, else ``None``."""
        self._check_batch(input_ids, forward_only=True)
        args = (input_ids,) if self.is_first else ()
        # The schedule computes its loss on the last stage; give it labels that are all ignored.
        kwargs = {"target": torch.full_like(input_ids, IGNORE_INDEX)} if self.is_last else {}
        kwargs.update(_stage_kwargs(position_ids))
        with torch.inference_mode(False), torch.no_grad(), self._forward_only(), self.step_context():
            output = self.schedule.eval(*args, **kwargs)
        return output if self.is_last else None

    def forward_only(self, input_ids: Tensor, target: Tensor,
                     per_microbatch: Callable[[Tensor, Tensor], Tensor]) -> Optional[list[Tensor]]:
        """Forward-only pass of a whole batch through the schedule, as in validation, that runs
        ``per_microbatch(output, target)`` on the last stage for each micro-batch in place of the loss; no
        micro-batch's output is kept after it (the logits of a whole batch never exist at once).

        Batches of any shape may follow each other (the stages infer their shapes again when it changes).

        Returns:
            On the rank holding the last stage, the results in micro-batch order; elsewhere ``None``.
        """
        self._check_batch(input_ids, forward_only=True)
        results: list[Tensor] = []
        args = (input_ids,) if self.is_first else ()
        kwargs = {"target": target, "losses": results} if self.is_last else {}
        self._per_microbatch = per_microbatch
        try:
            with torch.inference_mode(False), torch.no_grad(), self._forward_only(), self.step_context():
                self.schedule.eval(*args, return_outputs=False, **kwargs)
        finally:
            self._per_microbatch = None
        return results if self.is_last else None

    def _check_batch(self, input_ids: Tensor, forward_only: bool = False) -> None:
        check_batch_splits(input_ids.shape[0], self.microbatches)
        # Evaluation batches may change shape (downstream evaluation, prediction): infer the stages' shapes again
        # when a forward-only batch differs from the last one (a training step re-infers its own).
        if forward_only and self._forward_only_shape != tuple(input_ids.shape):
            forget_stage_shapes(self.schedule)
            self._forward_only_shape = tuple(input_ids.shape)

    def __call__(self, input_ids: Tensor, labels: Tensor, train: bool,
                 position_ids: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        """(loss for Lightning, global mean loss, global label-token count), the same on every rank.

        ``position_ids`` (packed documents) reaches every stage: the schedule splits keyword inputs into the
        micro-batches and hands them to each stage's forward, not only the first's."""
        import torch.distributed as dist

        self._check_batch(input_ids, forward_only=not train)
        device = input_ids.device
        stats = torch.zeros(2, dtype=torch.float32, device=device)
        if self.is_last:
            count = self.cross_group(self._dp_sum((labels != IGNORE_INDEX).sum().float().reshape(1)))
            stats[1] = self._count = count[0]
        losses: list[Tensor] = []  # the schedule's loss_fn values of this step's micro-batches
        args = (input_ids,) if self.is_first else ()
        kwargs = {"target": labels, "losses": losses} if self.is_last else {}
        kwargs.update(_stage_kwargs(position_ids))
        if train:
            # each micro-batch's load-balancing gradient weighs what its language-model loss does
            set_balance_grad_scale(self.container, self.grad_scale / self.microbatches)
            self.timer.start_step()
            with self.step_context():
                # the losses come through loss_fn; torch would otherwise keep every micro-batch's logits on the last
                # stage until the step ends, to return them (160 GB at the 72B SFT recipe's 16 x 32,768 tokens)
                self.schedule.step(*args, return_outputs=False, **kwargs)
            keep_step_statistics(self.container, self.microbatches)
            self.timer.end_step()
        else:
            # Lightning evaluates under inference_mode; stage buffers created there could not be used by a
            # later training step, so run forward-only under no_grad instead.
            with torch.inference_mode(False), torch.no_grad(), self._forward_only(), self.step_context():
                self.schedule.eval(*args, **kwargs)
        if self.is_last:  # the micro-batches' parts of the global mean, without the gradient's dp x grad_scale
            local = torch.stack([loss.detach().float() for loss in losses]).sum() / self.grad_scale
            stats[0] = self.cross_group(self._dp_sum(local.reshape(1)))[0] / self.dp
        src = dist.get_global_rank(self.pp_group, self.last_stage_pp_rank)
        dist.broadcast(stats, src=src, group=self.pp_group)
        return stats[0], stats[0], stats[1]


def _stage_kwargs(position_ids: Optional[Tensor]) -> dict[str, Tensor]:
    return {} if position_ids is None else {"position_ids": position_ids}


def build_pipeline(model: nn.Module, spec: ParallelSpec, options: ParallelOptions, dims: ParallelDims,
                   mesh: "DeviceMesh", pp_rank: int, device: torch.device, precision: str,
                   convert_module: Callable[[nn.Module], Any], num_blocks: int) -> PipelineRunner:
    """Split a meta-device model into stages, parallelize and materialize this rank's, and build the runner.

    The stages' parameters are allocated but not initialized: fill ``runner.container``. When the loss runs on
    vocabulary shards (``options.loss_on_shards``) so does the last stage's, and the schedule's steps (its backward)
    run inside torch's ``loss_parallel`` context.

    Raises:
        ValueError: split points that do not exist, or a model that ties its embedding to its head.
    """
    from torch.distributed.pipelining import PipelineStage

    num_stages = dims.pp * options.virtual_stages
    plans = plan_stages(spec, num_blocks, num_stages, options.pp_split_points)
    stage_ids = stage_ids_for_rank(pp_rank, dims.pp, options.virtual_stages, options.pp_schedule)
    container, modules = build_stages(model, spec, plans, stage_ids)
    for module in modules:
        # FSDP2's resharding follows options.fsdp_reshard_after_forward ("auto": gathered for the whole step).
        parallelize(module, spec, options, dims, mesh, device, precision, convert_module)
    pp_group = mesh["pp"].get_group()
    stages = [PipelineStage(m, stage_index=i, num_stages=num_stages, device=device, group=pp_group)
              for m, i in zip(modules, stage_ids)]
    timer = StageTimer(device)
    for stage in stages:
        timer.wrap(stage)
    on_shards = options.loss_on_shards(dims)
    loss = vocab_parallel_loss(model.loss_sum, mesh["tp"]) if on_shards else model.loss_sum
    runner = PipelineRunner(stages, loss, options.pp_schedule, options.num_microbatches, pp_group,
                            mesh["dp_cp"].get_group() if dims.data_ranks > 1 else None, dims.data_ranks, dims.pp,
                            options.virtual_stages, timer, container)
    runner.step_context = functools.partial(loss_parallel_context, on_shards)
    return runner


def report_bubble(pipeline: PipelineRunner, options: ParallelOptions, dims: ParallelDims,
                  global_rank: int) -> dict[str, Any]:
    """Gather every stage's measured idle fraction (a collective: every rank calls it) and log it on rank 0."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    report = gather_bubble_report(pipeline.timer, dims.coordinates(global_rank)["pp"], dims.world_size,
                                  pipeline.theoretical_bubble)
    rank_zero_info(format_bubble_report(report, options.pp_schedule, dims.pp, pipeline.microbatches,
                                        options.virtual_stages))
    return report
