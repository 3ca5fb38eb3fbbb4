"""Pipeline parallelism: split a declared model into stages and drive them with a torch schedule.

``plan_stages`` cuts the blocks into ``pp * virtual_stages`` contiguous stages, balanced by the
model's declared costs (the embedding rides on the first stage, final norm + head on the last).
``build_stages`` prunes a meta-device copy of the model per stage, so every parameter keeps its
global name (``layers.57.mlp.up_proj.weight``) on every mesh. ``PipelineRunner`` runs one
training or evaluation step of the schedule over a whole per-rank batch.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_hybrid.models.spec import ParallelSpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["StagePlan", "plan_stages", "stage_ids_for_rank", "build_stages", "validate_schedule",
           "theoretical_bubble", "PipelineRunner", "SINGLE_STAGE", "LOOPED", "V_SHAPED"]

SINGLE_STAGE = ("gpipe", "1f1b")
LOOPED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
V_SHAPED = ("zbv_zero_bubble", "dualpipev")
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: blocks ``[first_block, last_block)`` and whether it holds the ends."""

    index: int
    first_block: int
    last_block: int
    has_embedding: bool
    has_head: bool
    cost: float

    @property
    def num_blocks(self) -> int:
        return self.last_block - self.first_block


def _stage_cost(spec: ParallelSpec, first: int, last: int, num_blocks: int) -> float:
    cost = (last - first) * spec.block_cost
    if first == 0:
        cost += spec.embedding_cost
    if last == num_blocks:
        cost += spec.head_cost
    return cost


def _plans(spec: ParallelSpec, bounds: list[int], num_blocks: int) -> list[StagePlan]:
    return [StagePlan(i, a, b, a == 0, b == num_blocks, _stage_cost(spec, a, b, num_blocks))
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def _balanced_bounds(spec: ParallelSpec, num_blocks: int, num_stages: int) -> list[int]:
    """Contiguous split minimizing the largest stage cost (exact dynamic program, ties: earliest cut)."""
    inf = float("inf")
    # best[s][j]: smallest max-cost of splitting blocks [0, j) into s stages; cut[s][j]: start of the last one.
    best = [[inf] * (num_blocks + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_blocks + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, num_blocks - (num_stages - s) + 1):
            for k in range(s - 1, j):
                if best[s - 1][k] == inf:
                    continue
                value = max(best[s - 1][k], _stage_cost(spec, k, j, num_blocks))
                if value < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = value, k
    bounds, j = [num_blocks], num_blocks
    for s in range(num_stages, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    return bounds[::-1]


def plan_stages(spec: ParallelSpec, num_blocks: int, num_stages: int,
                split_points: Optional[Sequence[Union[str, int]]] = None) -> list[StagePlan]:
    """Cut ``num_blocks`` blocks into ``num_stages`` contiguous stages.

    Args:
        spec: the model's declared parts and costs.
        num_blocks: number of blocks.
        num_stages: ``pp * virtual_stages``.
        split_points: ``None`` balances by cost; block names where stages 2..n start
            (``["layers.40"]``); or the number of blocks of every stage (``[41, 39]``).

    Raises:
        ValueError: more stages than blocks, or split points that do not exist, are not increasing,
            or do not give ``num_stages`` non-empty stages.
    """
    if num_stages > num_blocks:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {num_blocks} blocks; "
                         f"use at most {num_blocks} stages (pp * virtual_stages)")
    if split_points is None or len(split_points) == 0:
        return _plans(spec, _balanced_bounds(spec, num_blocks, num_stages), num_blocks)
    points = list(split_points)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in points):
        if len(points) != num_stages or any(p < 1 for p in points) or sum(points) != num_blocks:
            raise ValueError(f"pp_split_points={points} must be {num_stages} positive block counts summing to "
                             f"{num_blocks}")
        bounds = [0]
        for count in points:
            bounds.append(bounds[-1] + count)
        return _plans(spec, bounds, num_blocks)
    if len(points) != num_stages - 1:
        raise ValueError(f"pp_split_points={points} names {len(points)} stage starts; {num_stages} stages need "
                         f"{num_stages - 1}, like {[f'{spec.blocks}.{(i + 1) * num_blocks // num_stages}' for i in range(num_stages - 1)]}")
    starts = []
    for point in points:
        prefix, _, index = str(point).rpartition(".")
        if prefix != spec.blocks or not index.isdigit() or not 0 < int(index) < num_blocks:
            raise ValueError(f"split point {point!r} does not exist; use {spec.blocks}.N with 1 <= N <= {num_blocks - 1}")
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ValueError(f"pp_split_points={points} must be strictly increasing")
    return _plans(spec, [0, *starts, num_blocks], num_blocks)


def stage_ids_for_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices a pipeline rank holds: one stage; a loop {r, r+pp, ...}; or a V {r, 2pp-1-r}."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def validate_schedule(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> None:
    """Check that the schedule, virtual stages and micro-batch count go together.

    Raises:
        ValueError: the combination is invalid, with the values that would fit.
    """
    if schedule in SINGLE_STAGE and virtual_stages != 1:
        raise ValueError(f"pp_schedule={schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                         f"interleaved schedule ({', '.join(LOOPED + V_SHAPED)})")
    if schedule in LOOPED + V_SHAPED and virtual_stages < 2:
        raise ValueError(f"pp_schedule={schedule!r} needs virtual_stages >= 2 (got {virtual_stages}); "
                         f"set virtual_stages=2 or use gpipe/1f1b")
    if schedule in V_SHAPED and virtual_stages != 2:
        raise ValueError(f"pp_schedule={schedule!r} places exactly two stages per rank in a V; use virtual_stages=2")
    stages = pp * virtual_stages
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"microbatches={microbatches} is fewer than the {pp} stages 1f1b needs; use >= {pp}")
    if schedule in LOOPED and microbatches % pp:
        raise ValueError(f"microbatches={microbatches} must be a multiple of pp={pp} for {schedule}")
    if schedule in V_SHAPED and microbatches < stages:
        raise ValueError(f"microbatches={microbatches} is fewer than the {stages} stages {schedule} needs; "
                         f"use >= {stages}")


def theoretical_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a stage in the ideal schedule: (p-1)/(m+p-1), divided by v for interleaved ones."""
    if pp <= 1:
        return 0.0
    bubble = (pp - 1) / (microbatches + pp - 1)
    return bubble / virtual_stages if schedule in LOOPED + V_SHAPED else bubble


def prune_to_stage(model: nn.Module, spec: ParallelSpec, plan: StagePlan) -> nn.Module:
    """A deep copy of the (meta-device) model holding only the blocks and ends of ``plan``."""
    stage = copy.deepcopy(model)
    blocks = getattr(stage, spec.blocks)
    for key in list(blocks.keys()):
        if not plan.first_block <= int(key) < plan.last_block:
            del blocks[key]
    if not plan.has_embedding:
        setattr(stage, spec.embedding, None)
    if not plan.has_head:
        setattr(stage, spec.norm, None)
        setattr(stage, spec.head, None)
    return stage


def build_stages(model: nn.Module, spec: ParallelSpec, plans: list[StagePlan],
                 stage_ids: list[int]) -> tuple[nn.Module, list[nn.Module]]:
    """This rank's stage modules and one container that holds all their parts under global names.

    The container is a pruned copy of the model whose blocks and ends *are* the stage modules' (the
    same objects), so its ``named_parameters()`` are this rank's parameters with their global names,
    for the optimizer and checkpoints. It is never called.

    Raises:
        ValueError: the model ties its embedding to its head across stages.
    """
    embedding, head = getattr(model, spec.embedding, None), getattr(model, spec.head, None)
    if embedding is not None and head is not None and head.weight is embedding.weight:
        raise ValueError("tie_word_embeddings=True is not supported with pp>1 (the first and last stage would "
                         "share a weight); untie the embeddings or use pp=1")
    stages = [prune_to_stage(model, spec, plans[i]) for i in stage_ids]
    container = copy.deepcopy(model)
    blocks = getattr(container, spec.blocks)
    for key in list(blocks.keys()):
        del blocks[key]
    for name in (spec.embedding, spec.norm, spec.head):
        setattr(container, name, None)
    for stage in stages:
        for key, block in getattr(stage, spec.blocks).items():
            blocks[key] = block
        for name in (spec.embedding, spec.norm, spec.head):
            if getattr(stage, name, None) is not None:
                setattr(container, name, getattr(stage, name))
    # Keep blocks in global order so parameter order is the same on every mesh.
    ordered = sorted(blocks.items(), key=lambda kv: int(kv[0]))
    for key in list(blocks.keys()):
        del blocks[key]
    for key, block in ordered:
        blocks[key] = block
    return container, stages


class StageTimer:
    """Busy time of this rank's stages: time inside their forward/backward compute calls, and the step time.

    On CPU the wall clock around each call. On CUDA a pair of timing events per call on the current stream, read
    back once they have completed (never a ``synchronize``: that would serialise the pipeline's sends and
    receives with compute and cost the throughput it measures); :attr:`busy`, :attr:`step_time` and
    :attr:`idle_fraction` wait for the events still in flight when they are read.
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self._cuda = device is not None and device.type == "cuda"
        self._busy = 0.0
        self._step_time = 0.0
        self.steps = 0
        self._pending: deque[tuple[str, Any, Any]] = deque()  # ("busy" | "step", start, end event), CUDA only
        self._step_start: Any = None

    def reset(self) -> None:
        """Forget what was measured so far (call after warm-up steps)."""
        self._drain(wait=True)
        self._busy = self._step_time = 0.0
        self.steps = 0

    def wrap(self, stage: Any) -> None:
        # forward_one_chunk / backward_one_chunk / backward_weight_one_chunk are the per-micro-batch compute
        # calls of torch's PipelineStage; the schedule's p2p waits happen outside them.
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, name, None)
            if inner is not None:
                setattr(stage, name, self._timed(inner))

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, kind: str, start: Any, end: Any) -> None:
        if self._cuda:
            self._pending.append((kind, start, end))
            self._drain(wait=False)
        else:
            self._accumulate(kind, end - start)

    def _accumulate(self, kind: str, seconds: float) -> None:
        if kind == "busy":
            self._busy += seconds
        else:
            self._step_time += seconds

    def _drain(self, wait: bool) -> None:
        """Add up the CUDA event pairs that have completed (all of them when ``wait``), oldest first."""
        while self._pending:
            kind, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            self._accumulate(kind, start.elapsed_time(end) / 1e3)

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add("busy", start, self._mark())

        return timed

    def start_step(self) -> None:
        self._step_start = self._mark()

    def end_step(self) -> None:
        self._add("step", self._step_start, self._mark())
        self.steps += 1

    @property
    def busy(self) -> float:
        """Seconds this rank's stages computed."""
        self._drain(wait=True)
        return self._busy

    @property
    def step_time(self) -> float:
        """Seconds of the training steps measured."""
        self._drain(wait=True)
        return self._step_time

    @property
    def idle_fraction(self) -> Optional[float]:
        step_time = self.step_time
        return None if step_time <= 0 else max(0.0, 1.0 - self.busy / step_time)


class PipelineRunner:
    """Runs a whole per-rank batch through the pipeline schedule of this rank's stages.

    Training: forward and backward over all micro-batches (gradients accumulate in the stages'
    parameters). Evaluation: forward only. Every call returns, on every rank, the global mean loss
    over the label tokens of the global batch (the last stage computes it, the other stages receive it).

    Args:
        schedule: the torch pipeline schedule (built with ``loss_fn=self.loss_fn``, ``scale_grads=False``).
        stages: this rank's ``PipelineStage`` objects.
        loss_sum: the model's ``loss_sum(logits, labels) -> (sum, count)``.
        pp_group / dp_group: process groups of this rank's pipeline and data-parallel peers.
        last_stage_pp_rank: pipeline rank that holds the last stage.
        dp: data-parallel size.
        microbatches: micro-batches per step.
        schedule_name: the schedule's name (for reports).
        timer: measures the stages' busy time for the bubble report.
    """

    def __init__(self, schedule: Any, stages: list[Any], loss_sum: Callable, pp_group: "ProcessGroup",
                 dp_group: Optional["ProcessGroup"], last_stage_pp_rank: int, dp: int, microbatches: int,
                 schedule_name: str, timer: StageTimer) -> None:
        self.schedule = schedule
        self.stages = stages
        self._loss_sum = loss_sum
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.last_stage_pp_rank = last_stage_pp_rank
        self.dp = dp
        self.microbatches = microbatches
        self.schedule_name = schedule_name
        self.timer = timer
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)
        self.grad_scale = 1.0  # 1 / accumulate_grad_batches, set by the strategy
        self._normalizer = torch.ones(())

    @property
    def active(self) -> bool:
        return True

    def loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        """Per micro-batch: its label-token loss sum scaled so the gradient is that of the global token mean."""
        total, _ = self._loss_sum(output, target)
        return total * self._normalizer.to(total.device)

    def _dp_sum(self, tensor: Tensor) -> Tensor:
        import torch.distributed as dist

        if self.dp_group is not None and self.dp > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    @contextlib.contextmanager
    def _forward_only_order(self) -> Iterator[None]:
        """For the V-shaped schedules, swap in a forward-only action list while evaluating.

        ``eval()`` of ZBV and DualPipeV fails on their fused forward/backward actions. Their runtime
        runs any lowered action list: every rank runs the forwards of its stages, lowest stage first,
        all micro-batches each, and torch's lowering adds the sends and receives. The training order is restored
        afterwards; the same schedule and stage objects are used throughout.
        """
        if self.schedule_name not in V_SHAPED:
            yield
            return
        from torch.distributed.pipelining.schedules import (_Action, _add_send_recv, _add_unshard_reshard,
                                                            _ComputationType)

        schedule = self.schedule
        saved = schedule.pipeline_order_with_comms
        stage_to_rank = dict(schedule.stage_index_to_group_rank)
        actions = {rank: [_Action(stage, _ComputationType.FORWARD, mb)
                          for stage in sorted(s for s, r in stage_to_rank.items() if r == rank)
                          for mb in range(self.microbatches)]
                   for rank in sorted(set(stage_to_rank.values()))}
        # Lowered like _prepare_schedule_with_comms does, without its check that every stage runs backward.
        lowered = {rank: _add_unshard_reshard(ops) for rank, ops in actions.items()}
        schedule.pipeline_order_with_comms = _add_send_recv(lowered, stage_to_rank=lambda s: stage_to_rank[s],
                                                            num_stages=schedule._num_stages)
        try:
            yield
        finally:
            schedule.pipeline_order_with_comms = saved

    def logits(self, input_ids: Tensor) -> Optional[Tensor]:
        """Forward-only pass of a whole batch; the logits on the rank that holds the last stage, else ``None``."""
        self._check_batch(input_ids)
        args = (input_ids,) if self.is_first else ()
        # The schedule computes its loss on the last stage; give it labels that are all ignored.
        kwargs = {"target": torch.full_like(input_ids, -100)} if self.is_last else {}
        with torch.inference_mode(False), torch.no_grad(), self._forward_only_order():
            output = self.schedule.eval(*args, **kwargs)
        return output if self.is_last else None

    def _check_batch(self, input_ids: Tensor) -> None:
        if input_ids.shape[0] % self.microbatches:
            raise ValueError(
                f"the per-rank batch of {input_ids.shape[0]} sequences does not split into microbatches="
                f"{self.microbatches}; use a batch size that is a multiple of {self.microbatches} or change microbatches"
            )

    def __call__(self, input_ids: Tensor, labels: Tensor, train: bool) -> tuple[Tensor, Tensor, Tensor]:
        """(loss for Lightning, global mean loss, global label-token count), the same on every rank."""
        import torch.distributed as dist

        self._check_batch(input_ids)
        device = input_ids.device
        stats = torch.zeros(2, dtype=torch.float32, device=device)
        if self.is_last:
            count = self._dp_sum((labels != -100).sum().float().reshape(1))
            stats[1] = count[0]
            self._normalizer = self.dp * self.grad_scale / count[0].clamp(min=1.0)
        losses: list[Tensor] = []
        args = (input_ids,) if self.is_first else ()
        kwargs = {"target": labels, "losses": losses} if self.is_last else {}
        if train:
            self.timer.start_step()
            self.schedule.step(*args, **kwargs)
            self.timer.end_step()
        else:
            # Lightning evaluates under inference_mode; stage buffers created there could not be used by a
            # later training step, so run forward-only under no_grad instead.
            with torch.inference_mode(False), torch.no_grad(), self._forward_only_order():
                self.schedule.eval(*args, **kwargs)
        if self.is_last:
            local = torch.stack([l.detach().float() for l in losses]).sum() / self.grad_scale
            stats[0] = self._dp_sum(local.reshape(1))[0] / self.dp
        src = dist.get_global_rank(self.pp_group, self.last_stage_pp_rank)
        dist.broadcast(stats, src=src, group=self.pp_group)
        return stats[0], stats[0], stats[1]
