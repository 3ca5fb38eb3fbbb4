"""What the planner plans: a candidate layout, the problem it is planned for, its estimate, and the one enumerator.

:func:`mesh_sizes` gives every (tp, pp, dp) of a GPU count, :func:`layouts` every layout of one mesh within a
:class:`Choices` (data-parallel mode, micro-batching, schedule, recompute, sequence parallelism). ``lightning-hybrid
plan`` (:mod:`~lightning_hybrid.planner.search`) and the strategy's ``"auto"`` options (:mod:`~.planner.auto`) both
enumerate with them, each with its own choices; the cost model (:mod:`~.planner.cost`) predicts each layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

from lightning_hybrid.distributed.parallel_dims import divisors, tied_embedding_error
from lightning_hybrid.distributed.pipeline.schedules import validate_schedule
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.experts import ep_reason, selective_recompute_reason
from lightning_hybrid.planner.step_time import Hardware, Runtime, TimeModel

__all__ = ["Layout", "Estimate", "Problem", "Choices", "layout_reason", "mesh_sizes", "context_sizes",
           "data_parallel_modes", "layouts", "schedule_fits", "PIPELINE_SCHEDULES", "MICRO_BATCH_SIZES"]

# (schedule, virtual stages) tried for pp > 1; pp == 1 uses ("none", 1).
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes, data parallel mode, micro-batching, schedule and recompute."""

    tp: int
    pp: int
    dp: int
    data_parallel: str
    micro_batch_size: int
    microbatches: int
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    cp: int = 1  # context parallel: each sequence split over cp ranks (next to tp), FSDP over dp x cp
    dp_shard: int = 0  # HSDP's shard group (data_parallel "hsdp"); 0 otherwise
    ep: int = 1  # expert parallel: carved from dp, each ep rank holds num_experts / ep experts (planner/experts.py)

    @property
    def data_ranks(self) -> int:
        """Ranks that see different tokens of one replica position and average gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP shards the parameters over: dp x cp, or dp_shard x cp under HSDP."""
        return (self.dp_shard if self.data_parallel == "hsdp" else self.dp) * self.cp

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks FSDP shards one ep rank's experts over: the data ranks holding the same experts, dp x cp / ep."""
        return self.shard_ranks // self.ep

    def describe(self) -> str:
        """One line naming every choice, as the explanations print it."""
        mode = self.data_parallel if self.dp > 1 else "none"
        if self.data_parallel == "hsdp":
            mode += f"(shard={self.dp_shard})"
        if self.cp > 1:
            mode = f"cp={self.cp} {mode}"
        if self.ep > 1:
            mode += f" ep={self.ep}"
        sched = self.schedule if self.pp > 1 else "-"
        if self.virtual_stages > 1:
            sched += f"(v={self.virtual_stages})"
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} {mode} mbs={self.micro_batch_size} m={self.microbatches} "
                f"{sched} recompute={self.recompute}{' sp' if self.sequence_parallel else ''}")


@dataclass
class Estimate:
    """Predicted per-GPU memory (bytes, on the fullest rank) and step time (seconds) of a layout."""

    layout: Layout
    memory: dict[str, float]
    usable: float
    time: dict[str, float]
    mfu: float
    tokens_per_second: float
    worst_stage: int
    reason: str = ""
    checkpoint_bytes: float = 0.0
    detail: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the layout can run and its fullest rank fits in the usable memory."""
        return not self.reason and self.memory["total"] <= self.usable

    def to_dict(self) -> dict:
        """The estimate in GB and seconds, as the JSON report prints it."""
        return {"layout": asdict(self.layout), "fits": self.fits, "reason": self.reason or None,
                "memory_gb": {k: v / 1e9 for k, v in self.memory.items()}, "usable_gb": self.usable / 1e9,
                "worst_pp_rank": self.worst_stage, "time_s": self.time, "mfu": self.mfu,
                "tokens_per_second": self.tokens_per_second, "time_detail": self.detail}


@dataclass(frozen=True)
class Problem:
    """What is being planned: model, hardware and training shape, the software's features and the time constants."""

    config: Qwen2Config
    hw: Hardware
    seq_len: int
    global_batch: int
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    schedules: tuple = field(default=PIPELINE_SCHEDULES)
    runtime: Runtime = field(default_factory=Runtime)
    time_model: TimeModel = field(default_factory=TimeModel)



def layout_reason(problem: Problem, tp: int, pp: int, dp: int, virtual_stages: int, ep: int = 1,
                  data_parallel: str = "fsdp") -> str:
    """Why a mesh cannot run this model at all ('' when it can)."""
    config, num_stages = problem.config, pp * virtual_stages
    refused = ep_reason(config, ep, dp, data_parallel)
    if refused:
        return refused
    if tp > problem.hw.gpus_per_node:
        return f"tp={tp} leaves the node ({problem.hw.gpus_per_node} GPUs per node)"
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, name) % tp:
            return f"tp={tp} does not divide {name}={getattr(config, name)}"
    tied = tied_embedding_error(config.tie_word_embeddings, tp, num_stages)
    if tied:
        return tied
    if num_stages > config.num_hidden_layers:
        return f"pp*virtual_stages={num_stages} exceeds {config.num_hidden_layers} blocks"
    if problem.global_batch % dp:
        return f"global batch {problem.global_batch} is not divisible by dp={dp}"
    return ""



# ----------------------------------------------------------------------------- the one enumerator


def mesh_sizes(gpus: int, gpus_per_node: int, tp: Optional[int] = None, pp: Optional[int] = None,
               dp: Optional[int] = None) -> list[tuple[int, int, int]]:
    """Every ``(tp, pp, dp)`` on ``gpus``: tp a divisor of a node's GPUs, pp of what is left, dp the rest; a size
    given is taken as it is (and must divide)."""
    out = []
    for t in [tp] if tp is not None else [t for t in divisors(gpus_per_node) if gpus % t == 0]:
        if gpus % t:
            continue
        for p in [pp] if pp is not None else divisors(gpus // t):
            if gpus % (t * p):
                continue
            if dp in (None, gpus // (t * p)):
                out.append((t, p, gpus // (t * p)))
    return out


def context_sizes(problem: Problem, tp: int) -> list[int]:
    """The cp sizes worth planning with ``tp``: 1, and powers of two with cp x tp inside a node and a sequence that
    splits into 2 x cp chunks."""
    sizes, cp = [1], 2
    while tp * cp <= problem.hw.gpus_per_node and problem.seq_len % (2 * cp) == 0:
        sizes.append(cp)
        cp *= 2
    return sizes


def data_parallel_modes(dp: int, gpus_per_node: int, tp: int, cp: int) -> list[tuple[str, int]]:
    """(data parallel mode, dp_shard): FSDP, replication, and HSDP with a shard group of one node's ranks."""
    if dp == 1:
        return [("replicate", 0)]
    modes = [("fsdp", 0), ("replicate", 0)]
    shard = gpus_per_node // (tp * cp) if gpus_per_node % (tp * cp) == 0 else 0
    if 1 < shard < dp and dp % shard == 0:
        modes.append(("hsdp", shard))
    return modes


@dataclass(frozen=True)
class Choices:
    """What :func:`layouts` varies within one mesh, each a sequence of the values to try, in order.

    Args:
        modes: ``(data-parallel mode, dp_shard)`` pairs (``dp_shard`` 0 unless HSDP).
        microbatches: micro-batch counts ``m`` per step (the micro-batch size is the per-replica batch over ``m``).
        stages: ``(schedule, virtual stages)`` pairs; ``(("none", 1),)`` without a pipeline.
        recompute: activation recompute modes.
        sequence_parallel: sequence-parallel settings.
    """

    modes: tuple[tuple[str, int], ...]
    microbatches: tuple[int, ...]
    stages: tuple[tuple[str, int], ...]
    recompute: tuple[str, ...]
    sequence_parallel: tuple[bool, ...] = (False,)


def schedule_fits(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> bool:
    """Whether the schedule, virtual stages and micro-batch count go together (the strategy's own rule)."""
    try:
        validate_schedule(schedule, pp, virtual_stages, microbatches)
    except ValueError:
        return False
    return True


def layouts(tp: int, pp: int, dp: int, per_replica: int, choices: Choices, cp: int = 1,
            ep: int = 1) -> Iterator[Layout]:
    """Every layout of the mesh ``(tp, pp, dp, cp, ep)`` within ``choices`` that the schedule allows, for a batch of
    ``per_replica`` sequences per data-parallel rank and step (``ep > 1``: FSDP only, as the strategy requires)."""
    for mode, shard in choices.modes:
        if ep > 1 and mode != "fsdp":
            continue
        for m in choices.microbatches:
            if per_replica % m:
                continue
            for schedule, v in choices.stages:
                if pp > 1 and not schedule_fits(schedule, pp, v, m):
                    continue
                for recompute in choices.recompute:
                    if selective_recompute_reason(ep, dp * cp, recompute):
                        continue  # the strategy refuses it (planner/experts.py)
                    for sp in choices.sequence_parallel:
                        yield Layout(tp, pp, dp, mode, per_replica // m, m, schedule, v, recompute, sp, cp, shard,
                                     ep)
