"""``tp="auto"``, ``pp="auto"``, ...: the strategy asks the planner for the layout at setup, before the model is built.

The options left ``"auto"`` (see :data:`~lightning_hybrid.distributed.options.AUTO_FIELDS`) are searched; every
other option stays as given (a fixed ``tp=8`` with ``pp="auto"`` searches only pp, micro-batches, ...). Under auto,
``microbatches=None`` is searched too (its default depends on the pipeline the planner picks).

What the planner plans from (an :class:`AutoRequest`, plain values that
:mod:`lightning_hybrid.distributed.auto_layout` reads off the job on every rank, and the device's figures it measures):

* the world size and devices per node;
* the device: a GPU's name through :mod:`lightning_hybrid.hardware` and its memory as torch reports it; on CPU the
  measured matmul speed and memory bandwidth (:mod:`lightning_hybrid.planner.calibrate`); a preflight measurement
  (``preflight=True``) replaces the tabulated link and matmul figures;
* the declared model config (``module.config``, a :class:`~lightning_hybrid.models.Qwen2Config`);
* the sequence length and batch (a :class:`TrainingShape`): a datamodule's ``seq_len`` and ``global_batch_size``
  (the global batch is then kept, whatever dp is chosen) or ``batch_size`` (sequences per dp rank, as in Lightning:
  the global batch grows with dp); for a plain DataLoader its ``batch_size`` and the first sample's length;
* the precision.

The layouts are :mod:`lightning_hybrid.planner.layout`'s one enumerator's, within the choices the fixed options leave
(as before it, the auto layout plans without context parallelism and HSDP shard groups: ``cp`` and ``dp_shard`` are
not among the auto fields).

Layouts are ranked by predicted tokens per second (with a per-dp-rank batch the global batch differs between
layouts, so step time alone would not compare them). Rank 0 decides and broadcasts, so every rank builds the same
mesh even where the CPU measurement differs between processes.

A resume keeps the layout in the checkpoint's manifest (for the options left ``"auto"``) when the world size is the
one it was written on; on another world size the planner plans again and the checkpoint is resharded on load.
The checkpoint is the one ``trainer.ckpt_path`` names (set before ``fit``) or the newest one a
:class:`~lightning_hybrid.FaultTolerantCheckpoint` with ``auto_resume`` will resume from. Lightning does not show a
strategy ``fit(ckpt_path=...)`` before the mesh is built: such a resume is planned afresh, and the checkpoint is
resharded into the planned layout on load (set ``trainer.ckpt_path`` to keep the checkpoint's layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lightning_hybrid.distributed.options import AUTO, AUTO_FIELDS, ParallelOptions
from lightning_hybrid.distributed.parallel_dims import divisors, format_choices
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.planner.layout import (
    PIPELINE_SCHEDULES,
    Choices,
    Estimate,
    Layout,
    Problem,
    layout_reason,
    layouts,
    mesh_sizes,
)
from lightning_hybrid.planner.memory import RECOMPUTE
from lightning_hybrid.planner.runtime import RUNTIME_OPTIONS, runtime_from_options
from lightning_hybrid.planner.step_time import Hardware, TimeModel

__all__ = ["TrainingShape", "AutoPlan", "AutoRequest", "auto_fields", "check_auto_request", "plan_layout",
           "plan_request", "apply_layout", "fixed_by_manifest", "enumerate_layouts"]

VIRTUAL_STAGES = (1, 2, 4)  # tried when virtual_stages is "auto" with a fixed pipeline schedule


def auto_fields(options: ParallelOptions) -> list[str]:
    """The options left to the planner."""
    return [name for name in AUTO_FIELDS if getattr(options, name) == AUTO]


@dataclass(frozen=True)
class TrainingShape:
    """Tokens per sequence and sequences per step: the global batch (``global_batch``) or per dp rank."""

    seq_len: int
    batch: int
    global_batch: bool

    def per_replica(self, dp: int) -> Optional[int]:
        """Sequences per dp rank and step (``None``: the global batch does not divide over ``dp``)."""
        if not self.global_batch:
            return self.batch
        return self.batch // dp if self.batch % dp == 0 else None


def _split_stages(options: ParallelOptions) -> Optional[int]:
    """Pipeline stages that ``pp_split_points`` fix (``None`` when not given)."""
    points = options.pp_split_points
    if not points:
        return None
    return len(points) if all(isinstance(p, int) for p in points) else len(points) + 1


def _sizes(options: ParallelOptions, world_size: int, devices_per_node: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) the fixed sizes allow: tp inside a node, the product the world size."""
    def fixed(value: Any) -> Optional[int]:
        return None if value in (None, AUTO) else value

    return mesh_sizes(world_size, devices_per_node, fixed(options.tp), fixed(options.pp), fixed(options.dp))


def _stage_choices(options: ParallelOptions, pp: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to try for ``pp``; ``("none", 1)`` without a pipeline."""
    v_fixed = options.virtual_stages if options.virtual_stages != AUTO else None
    if pp == 1:
        return [("none", 1)] if v_fixed in (None, 1) else []
    if options.pp_schedule == AUTO:
        pairs = list(PIPELINE_SCHEDULES)
    else:
        pairs = [(options.pp_schedule, v) for v in ([v_fixed] if v_fixed else VIRTUAL_STAGES)]
    return [(s, v) for s, v in pairs if v_fixed in (None, v)]


def check_auto_request(options: ParallelOptions, config: Any, world_size: int, devices_per_node: int,
                       module_name: str) -> None:
    """The checks of an auto request that need no collective (identical on every rank).

    Raises:
        ValueError: the module declares no model config, or ``pp_split_points`` fix a number of stages no allowed
            pp can have.
    """
    names = ", ".join(f"{n}='auto'" for n in auto_fields(options))
    if not isinstance(config, Qwen2Config):
        raise ValueError(f"{names} needs a LightningModule that declares its model (parallel_spec() and a `config` "
                         f"the planner knows, like lightning_hybrid.models.CausalLM); {module_name} does not: give "
                         f"fixed sizes instead")
    stages = _split_stages(options)
    if stages is None:
        return
    possible = sorted({pp for _, pp, _ in _sizes(options, world_size, devices_per_node)
                       for _, v in _stage_choices(options, pp) if pp * v == stages})
    if not possible:
        allowed = sorted({pp for _, pp, _ in _sizes(options, world_size, devices_per_node)})
        raise ValueError(f"pp_split_points={options.pp_split_points!r} fix {stages} pipeline stages, but with "
                         f"{names} on {world_size} processes pp can only be {format_choices(allowed)}; give "
                         f"split points for one of those or leave pp_split_points=None")


@dataclass
class AutoPlan:
    """The planner's decision: the chosen layout's estimate, the runner-up, and where the layout came from."""

    chosen: Estimate
    runner_up: Optional[Estimate]
    considered: int
    fields: list[str]
    shape: TrainingShape
    device: str
    source: str = "planner"
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The chosen layout as plain data (what every rank logs and tests compare)."""
        lay = self.chosen.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "data_parallel": lay.data_parallel,
                "microbatches": lay.microbatches, "pp_schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
                "activation_checkpointing": lay.recompute, "source": self.source}

    def why(self) -> str:
        """Why the choice beat the runner-up: the step-time terms where they differ most."""
        if self.runner_up is None:
            return "the only layout that fits"
        a, b = self.chosen, self.runner_up
        ratio = a.tokens_per_second / b.tokens_per_second
        terms = sorted((k for k in a.time if k != "step"), key=lambda k: abs(b.time[k] - a.time[k]), reverse=True)
        diffs = ", ".join(f"{k} {a.time[k] * 1e3:.2f} vs {b.time[k] * 1e3:.2f} ms" for k in terms[:2])
        return f"{ratio:.2f}x the runner-up's predicted tokens/s ({diffs})"

    def table(self) -> str:
        """The one table the strategy logs."""
        rows = [("chosen", self.chosen)] + ([("runner-up", self.runner_up)] if self.runner_up else [])
        lines = [f"auto layout ({', '.join(self.fields)} = 'auto'; from the {self.source}; {self.device}; seq_len "
                 f"{self.shape.seq_len}, {'global' if self.shape.global_batch else 'per-dp-rank'} batch "
                 f"{self.shape.batch}; {self.considered} layouts considered)",
                 f"{'':<10} {'layout':<58} {'memory GB':>10} {'step ms':>10} {'tokens/s':>10} {'MFU':>7}"]
        for name, e in rows:
            lines.append(f"{name:<10} {e.layout.describe():<58} {e.memory['total'] / 1e9:>10.3f} "
                         f"{e.time['step'] * 1e3:>10.2f} {e.tokens_per_second:>10.0f} {e.mfu:>7.1%}")
        lines.append(f"why: {self.why()}")
        lines.extend(self.notes)
        return "\n".join(lines)


def _choices(options: ParallelOptions, tp: int, pp: int, dp: int, per_replica: int) -> Choices:
    """What the fixed options leave to vary on one mesh: dp mode, micro-batching, schedule and recompute (sequence
    parallelism is the option's; no cp, no HSDP shard group: ``dp_shard`` 0 as the auto layout always planned)."""
    modes = [options.data_parallel] if options.data_parallel != AUTO else (
        ["fsdp", "replicate"] if dp > 1 else ["fsdp"])
    if isinstance(options.microbatches, int):
        counts = [options.microbatches]
    else:
        counts = divisors(per_replica) if pp > 1 else [1]  # without a pipeline the step is one batch
    recomputes = [options.activation_checkpointing] if options.activation_checkpointing != AUTO else list(RECOMPUTE)
    return Choices(modes=tuple((mode, 0) for mode in modes), microbatches=tuple(counts),
                   stages=tuple(_stage_choices(options, pp)), recompute=tuple(recomputes),
                   sequence_parallel=(options.sequence_parallel and tp > 1,))


def _layouts(options: ParallelOptions, tp: int, pp: int, dp: int, per_replica: int) -> list[Layout]:
    """Every layout of one mesh the fixed options allow (micro-batching, schedule, recompute, dp mode; the ep given,
    where it divides dp)."""
    ep = getattr(options, "ep", 1)
    if dp % ep:
        return []
    return list(layouts(tp, pp, dp, per_replica, _choices(options, tp, pp, dp, per_replica), ep=ep))


def enumerate_layouts(options: ParallelOptions, world_size: int, devices_per_node: int,
                      shape: TrainingShape) -> list[Layout]:
    """Every layout the fixed options allow on ``world_size`` processes (before memory and model checks)."""
    out = []
    for tp, pp, dp in _sizes(options, world_size, devices_per_node):
        per_replica = shape.per_replica(dp)
        if per_replica is not None:
            out.extend(_layouts(options, tp, pp, dp, per_replica))
    return out


def _rank_key(e: Estimate) -> tuple[float, bool, float]:
    """Most tokens/s first; at equal speed no recompute, then less memory."""
    return (-round(e.tokens_per_second, 6), e.layout.recompute != "none", e.memory["total"])


def plan_layout(options: ParallelOptions, config: Qwen2Config, hw: Hardware, shape: TrainingShape, precision: str,
                time_model: Any = None, device: str = "") -> AutoPlan:
    """Plan the options left ``"auto"``: the layout with the most predicted tokens/s among those that fit.

    Raises:
        ValueError: nothing fits (quoting the planner's best attempt and what to change) or no layout is possible.
    """
    fits: list[Estimate] = []
    closest: Optional[Estimate] = None
    reasons: list[str] = []
    stages = _split_stages(options)
    runtime = runtime_from_options({k: getattr(options, k) for k in RUNTIME_OPTIONS if hasattr(options, k)}, precision)
    for tp, pp, dp in _sizes(options, hw.gpus, hw.gpus_per_node):
        per_replica = shape.per_replica(dp)
        if per_replica is None:
            reasons.append(f"dp={dp} does not divide the global batch {shape.batch}")
            continue
        problem = Problem(config, hw, shape.seq_len, per_replica * dp, precision, runtime=runtime,
                          **({"time_model": time_model} if time_model is not None else {}))
        for layout in _layouts(options, tp, pp, dp, per_replica):
            if stages is not None and pp * layout.virtual_stages != stages:
                continue
            reason = layout_reason(problem, tp, pp, dp, layout.virtual_stages, layout.ep, layout.data_parallel)
            if reason:
                reasons.append(reason)
                continue
            e = estimate(problem, layout)
            if e.fits:
                fits.append(e)
            elif closest is None or e.memory["total"] < closest.memory["total"]:
                closest = e
    names = auto_fields(options)
    if not fits:
        _raise_nothing_fits(names, closest, reasons, hw, shape)
    fits.sort(key=_rank_key)
    return AutoPlan(fits[0], fits[1] if len(fits) > 1 else None, len(fits), names, shape, device)


def _raise_nothing_fits(names: list[str], closest: Optional[Estimate], reasons: list[str], hw: Hardware,
                        shape: TrainingShape) -> None:
    asked = ", ".join(f"{n}='auto'" for n in names)
    if closest is None:
        why = "; ".join(sorted(set(reasons))[:3]) or "the fixed options leave no layout"
        raise ValueError(f"{asked}: no layout is possible on {hw.gpus} processes ({why}); fix fewer options or "
                         f"change the number of devices")
    raise ValueError(
        f"{asked}: no layout fits in {hw.usable_bytes / 1e9:.2f} GB per device; the planner's best attempt "
        f"({closest.layout.describe()}) needs {closest.memory['total'] / 1e9:.2f} GB; use more devices or devices "
        f"with more memory, a shorter sequence (seq_len={shape.seq_len}), a smaller batch ({shape.batch}), "
        f"activation_checkpointing='auto' or fewer fixed options")


def apply_layout(options: ParallelOptions, layout: dict[str, Any]) -> ParallelOptions:
    """``options`` with each field left ``"auto"`` taken from ``layout`` (a :meth:`AutoPlan.summary`)."""
    values: dict[str, Any] = {"tp": layout["tp"], "pp": layout["pp"], "dp": layout["dp"],
                              "data_parallel": layout["data_parallel"],
                              "microbatches": layout["microbatches"] if layout["pp"] > 1 else None,
                              "virtual_stages": layout["virtual_stages"],
                              "pp_schedule": layout["pp_schedule"] if layout["pp"] > 1 else "1f1b",
                              "activation_checkpointing": layout["activation_checkpointing"]}
    changes = {name: values[name] for name in AUTO_FIELDS if getattr(options, name) == AUTO}
    if options.microbatches is None and auto_fields(options):
        changes["microbatches"] = values["microbatches"]
    return replace(options, **changes)


def fixed_by_manifest(options: ParallelOptions, layout: dict[str, Any]) -> ParallelOptions:
    """``options`` with each auto field the manifest records fixed to its value there."""
    changes = {name: layout[name] for name in auto_fields(options) if layout.get(name) is not None}
    if "microbatches" in layout and options.microbatches is None:
        changes["microbatches"] = layout["microbatches"]
    return replace(options, **changes)


@dataclass(frozen=True)
class AutoRequest:
    """What the auto layout is planned from, read off the job identically on every rank (plain values).

    Args:
        options: the strategy's options, some of them ``"auto"``.
        config: the declared model's config.
        world_size, devices_per_node: the processes, in all and per node.
        precision: Lightning's precision flag.
        shape: the sequence length and batch.
        resume_folder: the checkpoint this fit resumes from (for the notes), or ``None``.
    """

    options: ParallelOptions
    config: Qwen2Config
    world_size: int
    devices_per_node: int
    precision: str
    shape: TrainingShape
    resume_folder: Optional[Any] = None


def plan_request(request: AutoRequest, hw: Hardware, time_model: Optional[TimeModel], device: str,
                 manifest: Optional[dict[str, Any]] = None) -> AutoPlan:
    """Plan ``request`` on ``hw``: the checkpoint manifest's layout (``manifest``, what the resumed checkpoint
    recorded) when it was written on this world size, else the planner's choice (noting a re-plan).

    Raises:
        ValueError: nothing fits or no layout is possible (:func:`plan_layout`).
    """
    options, requested = request.options, auto_fields(request.options)
    notes, source = [], "planner"
    if manifest is not None and manifest.get("world_size") == request.world_size:
        options, source = fixed_by_manifest(options, manifest), f"checkpoint manifest {request.resume_folder}"
    elif manifest is not None:
        notes.append(f"re-planned: the checkpoint {request.resume_folder} was written on world size "
                     f"{manifest.get('world_size')} (tp={manifest['tp']} pp={manifest['pp']} dp={manifest['dp']}); "
                     f"this run has {request.world_size}, and the checkpoint is resharded on load")
    # a manifest may fix every auto field: the planner then estimates that one layout (still logged)
    plan = plan_layout(options, request.config, hw, request.shape, request.precision, time_model, device)
    plan.source, plan.notes, plan.fields = source, notes, requested
    return plan
