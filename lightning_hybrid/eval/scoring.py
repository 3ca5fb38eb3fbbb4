"""Forward-only scoring and greedy decoding of token batches on the model as the strategy sharded it.

The harness adapter (:mod:`lightning_hybrid.eval.harness`) hands token ids here; nothing of lm-evaluation-harness is
imported. Every rank calls the same method with the same requests and gets the same answers back:

- **dp**: the batches are dealt round-robin to the data-parallel replicas; a replica with no batch left in a round
  runs a small stand-in batch, so every rank runs the same number of forward passes (FSDP gathers its shards in
  each). The answers are summed over the world, each coming from one rank of its replica (the others add zeros, so
  the sum is exact).
- **pp**: the forward is the pipeline's forward-only step, as in validation (``schedule.eval()``); the last stage
  scores each micro-batch as it comes out (:meth:`~lightning_hybrid.distributed.pipeline.runner.PipelineRunner.
  forward_only`), so a whole batch's logits never exist at once. Its answers reach the other stages by a sum over
  the pp group.
- **tp**: under loss parallel the logits stay vocabulary shards; log-softmax, the target token's log-probability and
  the maximum are torch's vocabulary-parallel DTensor ops (a few floats per token over tp), only at the scored
  positions; greedy decoding gathers the one row it needs.
- **cp**: every sequence is cut head-tail over the cp ranks as in training; each rank scores its own tokens at their
  global positions, summed over the cp group.

Rows are right-padded to a multiple of :data:`PAD_MULTIPLE` tokens (a causal model's earlier positions do not see
the padding) and to a multiple of the pipeline's micro-batches; targets mark the positions to score.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_hybrid.callbacks.throughput import parallel_dims
from lightning_hybrid.distributed.context_parallel import sequence_positions, shard_sequences
from lightning_hybrid.distributed.tensor_parallel import full_vocabulary, loss_parallel_context
from lightning_hybrid.models.spec import IGNORE_INDEX, declared_spec

__all__ = ["EvalLayout", "eval_layout", "ShardedScorer", "GenerationBatch", "score_tokens", "PAD_MULTIPLE"]

# Rows are padded to a multiple of this many tokens: fewer distinct shapes (each new one makes the pipeline infer its
# shapes again and compiled blocks recompile) for at most this many padding tokens per row.
PAD_MULTIPLE = 32


@dataclass(frozen=True)
class EvalLayout:
    """Where this rank sits for evaluation (the defaults: one process holding the whole model).

    Args:
        dp / dp_rank: data-parallel replicas and this rank's; the batches are dealt over them.
        tp: tensor-parallel size (a sequence-parallel model splits each row's tokens over it).
        cp / cp_rank: ranks sharing each sequence and this rank's index among them.
        microbatches: the pipeline's micro-batches per step (a batch's rows must divide into them).
        leader: this rank reports its replica's answers in the final sum (one rank per replica).
        world: ranks in the job.
        mesh: the strategy's device mesh (tp > 1: the logits may be vocabulary shards over ``mesh["tp"]``).
        cp_group / pp_group: the groups whose answers are summed (``None``: size 1).
        device: where the batches go.
        forward_context: entered around every forward (the precision plugin's, as in validation).
        runner: the strategy's pipeline runner (``declared_model_runner()``), or ``None``: the module's forward runs.
    """

    dp: int = 1
    dp_rank: int = 0
    tp: int = 1
    cp: int = 1
    cp_rank: int = 0
    microbatches: int = 1
    leader: bool = True
    world: int = 1
    mesh: Any = None
    cp_group: Any = None
    pp_group: Any = None
    device: torch.device = torch.device("cpu")
    forward_context: Callable[[], Any] = contextlib.nullcontext
    runner: Any = None


def eval_layout(strategy: Any, device: torch.device) -> EvalLayout:
    """The :class:`EvalLayout` of this rank under ``strategy`` (a HybridParallelStrategy: its resolved sizes and mesh;
    any other: every rank holds the whole model and is a replica of its own); one process without a process group."""
    import torch.distributed as dist

    context = getattr(getattr(strategy, "precision_plugin", None), "forward_context", contextlib.nullcontext)
    if strategy is None or not (dist.is_available() and dist.is_initialized()):
        return EvalLayout(device=device, forward_context=context)
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = parallel_dims(strategy)
    if dims is None:
        return EvalLayout(dp=world, dp_rank=rank, world=world, device=device, forward_context=context)
    at = dims.coordinates(strategy.global_rank)
    mesh = strategy.device_mesh
    ask = getattr(strategy, "declared_model_runner", None)
    runner = ask() if callable(ask) else None
    return EvalLayout(dp=dims.dp, dp_rank=at["dp"], tp=dims.tp, cp=dims.cp, cp_rank=at.get("cp", 0),
                      microbatches=runner.microbatches if runner is not None else 1,
                      leader=at["tp"] == 0 and at.get("cp", 0) == 0 and at["pp"] == 0, world=world,
                      mesh=mesh if dims.tp > 1 else None, cp_group=mesh["cp"].get_group() if dims.cp > 1 else None,
                      pp_group=mesh["pp"].get_group() if dims.pp > 1 else None, device=device,
                      forward_context=context, runner=runner)


def score_tokens(logits: Tensor, target: Tensor, mesh: Any = None, head_width: Optional[int] = None,
                 argmax: bool = False) -> Tensor:
    """Per position where ``target`` is not ``IGNORE_INDEX``: ``(log-probability of the target token, 1.0 if no token
    is more likely)``, or with ``argmax`` ``(the most likely token id, 1.0)``; zeros elsewhere.

    Args:
        logits: ``(batch, seq, vocab)`` or this rank's vocabulary shard of them (narrower than ``head_width``).
        target: ``(batch, seq)`` token ids.
        mesh: the device mesh whose ``"tp"`` dimension holds the vocabulary shards.
        head_width: the head's full output width (the vocabulary).

    Returns:
        ``(batch, seq, 2)`` float32, the same on every tp rank.
    """
    out = torch.zeros(*target.shape, 2, dtype=torch.float32, device=logits.device)
    chosen = target != IGNORE_INDEX
    if not bool(chosen.any()):  # the same answer on every tp rank: the targets are replicated
        return out
    rows, tokens = logits[chosen].float(), target[chosen]
    sharded = mesh is not None and head_width is not None and rows.shape[-1] != head_width
    if argmax:
        rows = full_vocabulary(rows, mesh, sharded)  # only the rows decoded, gathered over tp
        out[chosen] = torch.stack([rows.argmax(-1).float(), torch.ones_like(tokens, dtype=torch.float32)], -1)
        return out
    if sharded:
        from torch.distributed.tensor import DTensor, Shard

        shards = DTensor.from_local(rows, mesh["tp"], [Shard(1)], run_check=False)
        with loss_parallel_context():  # torch's vocabulary-parallel log-softmax, NLL and max: no full-width row
            logp = torch.log_softmax(shards, dim=-1)
            picked = (-F.nll_loss(logp, tokens, reduction="none")).full_tensor()
            best = logp.amax(dim=-1).full_tensor()
        greedy = picked >= best
    else:
        picked = torch.log_softmax(rows, dim=-1).gather(-1, tokens[:, None])[:, 0]
        greedy = rows.argmax(-1) == tokens
    out[chosen] = torch.stack([picked, greedy.float()], -1)
    return out


@dataclass
class GenerationBatch:
    """Contexts to continue greedily, at most ``max_new`` tokens each, a row stopping once ``finished(tokens)``."""

    contexts: list[list[int]]
    max_new: int
    finished: Callable[[list[int]], bool]


class ShardedScorer:
    """Scores and continues batches of token ids with a LightningModule on its strategy's mesh.

    Args:
        module: the LightningModule (:class:`~lightning_hybrid.models.CausalLM`): its forward gives next-token
            logits; under a pipeline the layout's runner (the strategy's ``declared_model_runner()``) runs the stages.
        layout: this rank's :class:`EvalLayout`.
        batch_size: rows per forward pass (rounded up to a multiple of the pipeline's micro-batches).
        pad_id: the token id of the padding.
    """

    def __init__(self, module: Any, layout: EvalLayout, batch_size: int, pad_id: int = 0) -> None:
        self.module, self.layout, self.pad_id = module, layout, int(pad_id)
        self.batch_size = math.ceil(max(1, batch_size) / layout.microbatches) * layout.microbatches
        spec = declared_spec(module)
        head = getattr(getattr(module, "model", None), spec.head, None) if spec is not None else None
        self.head_width = int(head.weight.shape[0]) if head is not None else None
        self.forward_passes = 0

    # ------------------------------------------------------------------ one batch

    def _run(self, ids: Tensor, target: Tensor, argmax: bool) -> Tensor:
        """``score_tokens`` of a whole ``(rows, seq)`` batch, ``(rows, seq, 2)`` on the CPU, the same on every rank of
        the replica."""
        lay = self.layout
        ids, target = ids.to(lay.device), target.to(lay.device)
        local_ids, local_target = (shard_sequences(t, lay.cp, lay.cp_rank) for t in (ids, target))

        def per_microbatch(logits: Tensor, part: Tensor) -> Tensor:
            return score_tokens(logits, part, lay.mesh, self.head_width, argmax)

        runner = lay.runner
        with lay.forward_context(), torch.inference_mode(False), torch.no_grad():
            if runner is not None:
                parts = runner.forward_only(local_ids, local_target, per_microbatch)
                local = torch.cat(parts) if parts is not None else None
            else:
                local = per_microbatch(self.module(local_ids), local_target)
        self.forward_passes += 1
        full = torch.zeros(*ids.shape, 2, dtype=torch.float32, device=lay.device)
        if local is not None:
            positions = sequence_positions(ids.shape[1], lay.cp, lay.cp_rank, lay.device) if lay.cp > 1 else None
            full[:, positions if positions is not None else slice(None)] = local
        for group in (lay.cp_group, lay.pp_group):  # from the ranks that hold them: the others add zeros
            if group is not None:
                import torch.distributed as dist

                dist.all_reduce(full, group=group)
        return full.cpu()

    def _shape(self, rows: int, longest: int) -> tuple[int, int]:
        """``(rows, tokens)`` of a padded batch: rows a multiple of the micro-batches, tokens of :data:`PAD_MULTIPLE`,
        of ``2 * cp`` (the head-tail split) and of ``tp`` (sequence parallelism splits the tokens over tp)."""
        multiple = math.lcm(PAD_MULTIPLE, 2 * self.layout.cp, self.layout.tp)
        return (math.ceil(max(rows, 1) / self.layout.microbatches) * self.layout.microbatches,
                math.ceil(max(longest, 1) / multiple) * multiple)

    def _rounds(self, count: int) -> list[Optional[int]]:
        """The batch indices this replica runs, one per round (``None``: a stand-in in the last round)."""
        dp, rank = self.layout.dp, self.layout.dp_rank
        return [i if i < count else None for i in range(rank, math.ceil(count / dp) * dp, dp)]

    def _sum_over_world(self, values: Tensor) -> Tensor:
        if self.layout.world == 1:
            return values
        import torch.distributed as dist

        values = (values if self.layout.leader else torch.zeros_like(values)).to(self.layout.device)
        dist.all_reduce(values)
        return values.cpu()

    # ------------------------------------------------------------------ requests

    def loglikelihood(self, batches: Sequence[Sequence[tuple[list[int], list[int]]]]) -> list[tuple[float, bool]]:
        """``(sum of log-probabilities, every token the most likely)`` of each continuation, batch after batch.

        Each request is ``(input tokens, continuation tokens)``: the input is context + continuation without its last
        token, and its last ``len(continuation)`` positions predict the continuation (the harness's convention).
        """
        offsets = [0]
        for batch in batches:
            offsets.append(offsets[-1] + len(batch))
        values = torch.zeros(offsets[-1], 2, dtype=torch.float64)
        for index in self._rounds(len(batches)):
            batch = batches[index] if index is not None else []
            rows, length = self._shape(len(batch), max((len(inp) for inp, _ in batch), default=1))
            ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
            target = torch.full((rows, length), IGNORE_INDEX, dtype=torch.long)
            for row, (inp, cont) in enumerate(batch):
                ids[row, :len(inp)] = torch.tensor(inp)
                target[row, len(inp) - len(cont):len(inp)] = torch.tensor(cont)
            scores = self._run(ids, target, argmax=False)
            for row, (inp, cont) in enumerate(batch):
                span = scores[row, len(inp) - len(cont):len(inp)]
                values[offsets[index] + row] = torch.stack([span[:, 0].double().sum(), span[:, 1].min().double()])
        values = self._sum_over_world(values)
        return [(float(total), bool(greedy > 0.5)) for total, greedy in values.tolist()]

    def generate(self, batches: Sequence[GenerationBatch]) -> list[list[int]]:
        """The greedy continuation of every context, batch after batch (a forward pass over the whole rows per new
        token: no key/value cache). Every rank steps until the last unfinished row of any replica is done."""
        offsets, longest = [0], max((b.max_new for b in batches), default=0)
        for batch in batches:
            offsets.append(offsets[-1] + len(batch.contexts))
        tokens = torch.zeros(offsets[-1], max(longest, 1), dtype=torch.long)  # token id + 1; 0: none
        for index in self._rounds(len(batches)):
            batch = batches[index] if index is not None else GenerationBatch([], 0, lambda _: True)
            for row, generated in enumerate(self._decode(batch)):
                tokens[offsets[index] + row, :len(generated)] = torch.tensor(generated, dtype=torch.long) + 1
        tokens = self._sum_over_world(tokens)
        return [[t - 1 for t in row if t > 0] for row in tokens.tolist()]

    def _decode(self, batch: GenerationBatch) -> list[list[int]]:
        lengths = [len(c) for c in batch.contexts]
        rows, width = self._shape(len(lengths), max(lengths, default=1) + batch.max_new)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        for row, context in enumerate(batch.contexts):
            ids[row, :len(context)] = torch.tensor(context)
        generated: list[list[int]] = [[] for _ in lengths]
        done = [batch.max_new <= 0 for _ in lengths]
        while self._anywhere(not all(done)):
            target = torch.full_like(ids, IGNORE_INDEX)
            for row, length in enumerate(lengths):
                if not done[row]:
                    target[row, length - 1] = 0  # decode here
            picked = self._run(ids, target, argmax=True)
            for row, length in enumerate(lengths):
                if done[row]:
                    continue
                token = int(picked[row, length - 1, 0])
                generated[row].append(token)
                ids[row, length] = token
                lengths[row] += 1
                done[row] = len(generated[row]) >= batch.max_new or batch.finished(generated[row])
        return generated

    def _anywhere(self, flag: bool) -> bool:
        """``flag`` of any rank (every rank must call it at the same step)."""
        if self.layout.world == 1:
            return flag
        import torch.distributed as dist

        value = torch.tensor([float(flag)], device=self.layout.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)
