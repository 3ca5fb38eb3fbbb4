"""``lightning-hybrid plan --config RECIPE.yaml``: the planner's prediction for exactly a recipe's job.

The recipe's model, GPU count, layout (tp, pp, dp, cp, data-parallel mode, micro-batching, schedule, recompute,
sequence parallelism), precision and runtime features (:func:`~lightning_hybrid.planner.runtime.runtime_from_options`)
are planned as written, next to the planner's fastest layout for the same question and runtime. The YAML is read
as plain data: nothing here builds a strategy or a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_hybrid.hardware import SYSTEM_GPUS
from lightning_hybrid.models.qwen2.config import Qwen2Config
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.planner.layout import Estimate, Layout, Problem
from lightning_hybrid.planner.runtime import runtime_features, runtime_from_options
from lightning_hybrid.planner.search import search
from lightning_hybrid.planner.step_time import Hardware
from lightning_hybrid.recipe_file import read_recipe, recipe_gpu

__all__ = ["RecipePlan", "format_recipe_plan", "plan_recipe", "recipe_gpu"]


@dataclass
class RecipePlan:
    """The recipe's own layout and the fastest layout that fits, under the recipe's runtime features."""

    problem: Problem
    recipe: Estimate
    fastest: Optional[Estimate]
    strategy: dict

    def to_dict(self) -> dict:
        """The JSON report: both estimates (GB, s, MFU) and the runtime features on."""
        return {"gpus": self.problem.hw.gpus, "gpu": self.problem.hw.gpu.name, "precision": self.problem.precision,
                "seq_len": self.problem.seq_len, "global_batch": self.problem.global_batch,
                "runtime": runtime_features(self.problem.runtime),
                "recipe": dict(self.recipe.to_dict(), describe=self.recipe.layout.describe()),
                "fastest": dict(self.fastest.to_dict(), describe=self.fastest.layout.describe())
                if self.fastest else None}


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}={value!r} in the recipe must be a positive integer to plan it")
    return value


def plan_recipe(path: str, gpu: Optional[str] = None) -> RecipePlan:
    """Plan the job of the ``lightning-hybrid fit`` recipe at ``path`` on ``gpu`` (default: the header's ``--gpu``).

    Raises:
        ValueError: no such file, not YAML, no ``HybridParallelStrategy``, an ``"auto"`` size (plan it without
            ``--config``), a missing GPU type, or a layout that does not divide the world.
    """
    text, doc, trainer, strategy = read_recipe(path)
    s = dict(strategy.get("init_args") or {})
    gpu = gpu or recipe_gpu(text)
    if gpu not in SYSTEM_GPUS:
        raise ValueError(f"--config {path}: GPU type {gpu!r} unknown; pass --gpu, one of "
                         f"{', '.join(sorted(SYSTEM_GPUS))}")
    for key in ("tp", "pp", "dp", "microbatches", "virtual_stages", "pp_schedule", "activation_checkpointing",
                "data_parallel"):
        if str(s.get(key, "")).lower() == "auto":
            raise ValueError(f"--config {path}: {key}='auto' is chosen at setup; plan it without --config")
    devices, nodes = _int(trainer.get("devices"), "trainer.devices"), _int(trainer.get("num_nodes", 1),
                                                                           "trainer.num_nodes")
    world = devices * nodes
    tp, pp, cp = int(s.get("tp") or 1), int(s.get("pp") or 1), int(s.get("cp") or 1)
    dp = int(s.get("dp") or world // (tp * pp * cp))
    if tp * pp * cp * dp != world:
        raise ValueError(f"--config {path}: tp={tp} x pp={pp} x cp={cp} x dp={dp} != {world} GPUs")
    data = (doc.get("data") or {}).get("init_args") or {}
    batch, seq_len = _int(data.get("batch_size"), "data.batch_size"), _int(data.get("seq_len"), "data.seq_len")
    accumulate = int(trainer.get("accumulate_grad_batches") or 1)
    m = int(s.get("microbatches") or pp) if pp > 1 else accumulate
    mbs = batch // m if pp > 1 else batch
    precision = str(trainer.get("precision", "32-true"))
    model = doc.get("model") or {}
    config = Qwen2Config.resolve(model.get("model") if isinstance(model, dict) else model)
    hw = Hardware(SYSTEM_GPUS[gpu], world, min(devices, world))
    problem = Problem(config, hw, seq_len, mbs * m * dp, precision, runtime=runtime_from_options(s, precision))
    mode = str(s.get("data_parallel") or "fsdp")
    layout = Layout(tp=tp, pp=pp, dp=dp, data_parallel=mode, micro_batch_size=mbs, microbatches=m,
                    schedule=str(s.get("pp_schedule") or "1f1b") if pp > 1 else "none",
                    virtual_stages=int(s.get("virtual_stages") or 1),
                    recompute=str(s.get("activation_checkpointing") or "none"),
                    sequence_parallel=bool(s.get("sequence_parallel")), cp=cp,
                    dp_shard=int(s.get("dp_shard") or 0) if mode == "hsdp" else 0)
    feasible, _ = search(problem)
    return RecipePlan(problem, estimate(problem, layout), feasible[0] if feasible else None, s)


def format_recipe_plan(plan: RecipePlan) -> list[str]:
    """The text report: the recipe's layout and the fastest one, step time, MFU and memory, and the runtime on."""
    p = plan.problem
    lines = [f"plan of the recipe: {p.config.name} on {p.hw.gpus} x {p.hw.gpu.name}, seq {p.seq_len}, global batch "
             f"{p.global_batch}, {p.precision}",
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
