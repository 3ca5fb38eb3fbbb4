"""``lightning-hybrid plan --config RECIPE.yaml``: the planner's prediction for exactly a recipe's job.

The recipe's model, GPU count, layout (tp, pp, dp, cp, data-parallel mode, micro-batching, schedule, recompute,
sequence parallelism), precision and runtime features (:func:`~lightning_hybrid.planner.runtime.runtime_from_options`)
are planned as written, next to the planner's fastest layout for the same question and runtime. A flag given beside
``--config`` (:class:`Overrides`) replaces the recipe's value, and the plan says where every value came from
(:attr:`RecipePlan.sources`). The YAML is read as plain data: nothing here builds a strategy or a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_hybrid.hardware import SYSTEM_GPUS
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.planner.layout import Estimate, Layout, Problem
from lightning_hybrid.planner.runtime import runtime_features, runtime_from_options
from lightning_hybrid.planner.search import search
from lightning_hybrid.planner.step_time import Hardware
from lightning_hybrid.recipe_file import read_recipe, recipe_gpu

__all__ = ["Overrides", "RecipePlan", "format_recipe_plan", "plan_recipe", "recipe_gpu"]

FLOAT8_OFF = "none"  # `--float8 none`: plan a float8 recipe without float8


@dataclass(frozen=True)
class Overrides:
    """Flags given beside ``--config``, each replacing the recipe's value (``None``: not given).

    Attributes:
        hardware: the hardware flags given (``--gpu-memory-gb``, ``--calibrate``, ...), by flag, with their values:
            they have no recipe value and are applied by ``plan_recipe``'s ``hardware`` argument.
    """

    model: Optional[str] = None
    gpu: Optional[str] = None
    seq_len: Optional[int] = None
    global_batch: Optional[int] = None
    precision: Optional[str] = None
    optimizer: Optional[str] = None
    float8: Optional[str] = None  # a recipe name, or FLOAT8_OFF
    fused_projections: Optional[bool] = None
    hardware: tuple[tuple[str, Any], ...] = ()


@dataclass
class RecipePlan:
    """The recipe's own layout and the fastest layout that fits, under the recipe's runtime features.

    ``sources``: each planned value (model, GPU, sizes, precision, float8, ...) with where it came from: the recipe
    (and its key), a flag (and the recipe's value it replaced), or a default.
    """

    problem: Problem
    recipe: Estimate
    fastest: Optional[Estimate]
    strategy: dict
    sources: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON report: both estimates (GB, s, MFU), the runtime features on, and each value's source."""
        return {"gpus": self.problem.hw.gpus, "gpu": self.problem.hw.gpu.name, "precision": self.problem.precision,
                "seq_len": self.problem.seq_len, "global_batch": self.problem.global_batch,
                "runtime": runtime_features(self.problem.runtime),
                "sources": {name: {"value": value, "from": source} for name, (value, source) in self.sources.items()},
                "recipe": dict(self.recipe.to_dict(), describe=self.recipe.layout.describe()),
                "fastest": dict(self.fastest.to_dict(), describe=self.fastest.layout.describe())
                if self.fastest else None}


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}={value!r} in the recipe must be a positive integer to plan it")
    return value


class _Sources(dict):
    """name -> (value, source): the recipe's value, or the flag's that replaced it."""

    def take(self, name: str, flag: Optional[Any], recipe: Any, where: str) -> Any:
        if flag is None:
            self[name] = (recipe, where)
            return recipe
        self[name] = (flag, f"--{name.replace('_', '-')}; the recipe's: {recipe}")
        return flag


def _mesh(path: str, s: dict, trainer: dict, sources: _Sources) -> tuple[int, int, int, int, int, int]:
    """(devices per node, world, tp, pp, cp, dp) of the recipe.

    Raises:
        ValueError: an ``"auto"`` size, or sizes that do not multiply to the world.
    """
    for key in ("tp", "pp", "dp", "microbatches", "virtual_stages", "pp_schedule", "activation_checkpointing",
                "data_parallel"):
        if str(s.get(key, "")).lower() == "auto":
            raise ValueError(f"--config {path}: {key}='auto' is chosen at setup; plan it without --config")
    devices, nodes = _int(trainer.get("devices"), "trainer.devices"), _int(trainer.get("num_nodes", 1),
                                                                           "trainer.num_nodes")
    world = devices * nodes
    sources["gpus"] = (world, "recipe trainer.devices x trainer.num_nodes")
    tp, pp, cp = int(s.get("tp") or 1), int(s.get("pp") or 1), int(s.get("cp") or 1)
    dp = int(s.get("dp") or world // (tp * pp * cp))
    if tp * pp * cp * dp != world:
        raise ValueError(f"--config {path}: tp={tp} x pp={pp} x cp={cp} x dp={dp} != {world} GPUs")
    return devices, world, tp, pp, cp, dp


def _batch(doc: dict, trainer: dict, s: dict, pp: int, cp: int, dp: int, overrides: Overrides,
           sources: _Sources) -> tuple[int, int, int, int]:
    """(seq_len, global batch, micro-batch size, micro-batches per step) of the recipe, or of the flags.

    Raises:
        ValueError: a sequence that does not split over the cp ranks, a global batch that does not split over the
            dp ranks and micro-batches.
    """
    data = (doc.get("data") or {}).get("init_args") or {}
    batch = _int(data.get("batch_size"), "data.batch_size")
    seq_len = sources.take("seq_len", overrides.seq_len, _int(data.get("seq_len"), "data.seq_len"),
                           "recipe data.seq_len")
    if seq_len % (2 * cp):
        raise ValueError(f"--seq-len {seq_len} does not split into 2*cp={2 * cp} chunks of the recipe's cp={cp}; "
                         f"use a multiple of {2 * cp}")
    accumulate = int(trainer.get("accumulate_grad_batches") or 1)
    m = int(s.get("microbatches") or pp) if pp > 1 else accumulate
    mbs = batch // m if pp > 1 else batch
    global_batch = sources.take("global_batch", overrides.global_batch, mbs * m * dp,
                                "recipe data.batch_size x dp" + (" x accumulate_grad_batches" if pp == 1 else ""))
    if global_batch % (m * dp):
        raise ValueError(f"--global-batch {global_batch} does not split into the recipe's dp={dp} x {m} "
                         f"micro-batches; use a multiple of {m * dp}")
    return seq_len, global_batch, global_batch // (m * dp), m


def _problem(doc: dict, trainer: dict, s: dict, hw: Hardware, seq_len: int, global_batch: int,
             overrides: Overrides, sources: _Sources) -> Problem:
    """The recipe's model, precision, optimizer and runtime features (or the flags'), on ``hw``."""
    precision = sources.take("precision", overrides.precision, str(trainer.get("precision", "32-true")),
                             "recipe trainer.precision")
    optimizer = sources.take("optimizer", overrides.optimizer, "adamw", "the recipe's CausalLM")
    model = doc.get("model") or {}
    name = sources.take("model", overrides.model, model.get("model") if isinstance(model, dict) else model,
                        "recipe model.model")
    float8 = sources.take("float8", overrides.float8, s.get("float8") or FLOAT8_OFF,
                          "recipe trainer.strategy.init_args.float8")
    fused = sources.take("fused_projections", overrides.fused_projections, True, "this project's decoder")
    for flag, value in overrides.hardware:
        sources[flag.lstrip("-").replace("-", "_")] = (value, f"{flag}; no recipe value")
    runtime = runtime_from_options({**s, "float8": None if float8 == FLOAT8_OFF else float8}, precision,
                                   fused_projections=fused)
    return Problem(Qwen2Config.resolve(name), hw, seq_len, global_batch, precision, optimizer, runtime=runtime)


def plan_recipe(path: str, gpu: Optional[str] = None, overrides: Overrides = Overrides(),
                hardware: Optional[Callable[[Hardware], Hardware]] = None) -> RecipePlan:
    """Plan the job of the ``lightning-hybrid fit`` recipe at ``path`` (on ``gpu``, default the header's ``--gpu``),
    with the values of ``overrides`` in place of the recipe's and ``hardware`` applied to the GPU's figures.

    Raises:
        ValueError: no such file, not YAML, no ``HybridParallelStrategy``, an ``"auto"`` size (plan it without
            ``--config``), a missing GPU type, a layout that does not divide the world, or an override that does not
            fit the recipe's layout (a global batch that does not split over its dp ranks and micro-batches, a
            sequence that does not split over its cp ranks).
    """
    text, doc, trainer, strategy = read_recipe(path)
    s, sources = dict(strategy.get("init_args") or {}), _Sources()
    gpu = sources.take("gpu", overrides.gpu or gpu, recipe_gpu(text), "recipe's # plan: line")
    if gpu not in SYSTEM_GPUS:
        raise ValueError(f"--config {path}: GPU type {gpu!r} unknown; pass --gpu, one of "
                         f"{', '.join(sorted(SYSTEM_GPUS))}")
    devices, world, tp, pp, cp, dp = _mesh(path, s, trainer, sources)
    seq_len, global_batch, mbs, m = _batch(doc, trainer, s, pp, cp, dp, overrides, sources)
    hw = Hardware(SYSTEM_GPUS[gpu], world, min(devices, world))
    problem = _problem(doc, trainer, s, hardware(hw) if hardware is not None else hw, seq_len, global_batch,
                       overrides, sources)
    mode = str(s.get("data_parallel") or "fsdp")
    layout = Layout(tp=tp, pp=pp, dp=dp, data_parallel=mode, micro_batch_size=mbs, microbatches=m,
                    schedule=str(s.get("pp_schedule") or "1f1b") if pp > 1 else "none",
                    virtual_stages=int(s.get("virtual_stages") or 1),
                    recompute=str(s.get("activation_checkpointing") or "none"),
                    sequence_parallel=bool(s.get("sequence_parallel")), cp=cp,
                    dp_shard=int(s.get("dp_shard") or 0) if mode == "hsdp" else 0)
    feasible, _ = search(problem)
    return RecipePlan(problem, estimate(problem, layout), feasible[0] if feasible else None, s, dict(sources))


def format_recipe_plan(plan: RecipePlan) -> list[str]:
    """The text report: where each value came from, the recipe's layout and the fastest one (step time, MFU,
    memory), and the runtime features on."""
    p = plan.problem
    lines = [f"plan of the recipe: {p.config.name} on {p.hw.gpus} x {p.hw.gpu.name}, seq {p.seq_len}, global batch "
             f"{p.global_batch}, {p.precision}",
             "values: " + "; ".join(f"{name} {value} ({source})" for name, (value, source) in plan.sources.items()),
             "runtime features: " + ", ".join(f"{name} {'on' if on else 'off'}"
                                               for name, on in runtime_features(p.runtime).items())]
    for label, e in (("recipe ", plan.recipe), ("fastest", plan.fastest)):
        if e is None:
            lines.append(f"  {label}: nothing fits")
            continue
        fit = "fits" if e.fits else f"does NOT fit ({e.reason or 'memory'})"
        lines.append(f"  {label}: {e.layout.describe()}: {e.time['step']:.2f} s/step, MFU {e.mfu:.1%}, "
                     f"{e.memory['total'] / 1e9:.1f} GB of {e.usable / 1e9:.1f} GB usable ({fit})")
    return lines
