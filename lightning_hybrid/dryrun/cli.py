"""``lightning-hybrid dry-run``: every rank of a recipe built and a step traced on one CPU, against the planner."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

from lightning_hybrid.dryrun.compare import FIGURES, predict, usable_bytes
from lightning_hybrid.dryrun.recipe import DryRunJob, load_job
from lightning_hybrid.dryrun.roles import Role, parse_ranks, rank_roles

__all__ = ["build_parser", "dry_run_main", "dry_run", "role_pool", "trace_ranks", "EXIT_DOES_NOT_FIT"]

EXIT_DOES_NOT_FIT = 1

DESCRIPTION = """\
Build chosen ranks of a training recipe and trace one training step on one CPU, without GPUs and without memory
for the weights, then hold each rank's bytes against the planner.

Each chosen rank joins torch's fake process group as that rank of the recipe's world (num_nodes x devices) and runs
the strategy's own code: argument and size validation, the (pp, dp, tp) mesh, the pipeline split, the TP plan,
recompute and compile flags, FSDP2 wrapping, precision, materialization and initialization (on fake tensors: shapes,
no memory), the optimizer and LR schedule; then one optimizer step as Lightning runs it (training_step with the
pipeline schedule, backward, gradient clipping, AdamW). The schedule runs as many micro-batches of the recipe's size
as reach its steady-state peak (1F1B: pp + 1, a forward after the first backward; interleaved: up to 2 x pp x v;
GPipe: all). Pipeline stages are given their shapes, since torch's shape exchange carries nothing on the fake
backend. It reports per rank: parameter, gradient and optimizer-state bytes; the activation peak and the total peak
traced by torch's MemTracker; the collectives per mesh dimension (calls and bytes); and beside each figure the
planner's prediction and the ratio.

Roles: ranks with the same pipeline coordinate (the same stages, blocks, embedding or head, the same place in the
schedule) and the same local shard shapes run the same operations on the same shapes and issue the same collectives
on their own groups: they are identical by construction. TP shards are equal on every tp coordinate (sizes that do
not divide are refused); FSDP2's dim-0 chunks may leave the last dp coordinates fewer rows, which makes them a role of
their own. `--ranks all` traces one rank per role and reports it for every rank of that role (for Qwen2.5-72B at
tp=8, pp=2, dp=8: 2 roles for 128 ranks).

Exit status: 0 when every chosen rank fits; 1 when one does not (named on stderr with its mesh coordinates and its
breakdown); 2 for a bad argument or a recipe the strategy refuses."""


def build_parser() -> argparse.ArgumentParser:
    """The ``dry-run`` flags."""
    p = argparse.ArgumentParser(prog="lightning-hybrid dry-run", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a `lightning-hybrid fit` recipe (YAML)")
    p.add_argument("--ranks", default="all", help="'all' (one trace per role) or ranks, e.g. 0,93,127 (all)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.add_argument("--gpu", default=None,
                   help="GPU of the hardware table whose memory a rank must fit (default: the recipe's `# plan:` "
                        "line's --gpu, else h100)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="device memory in GiB instead of the GPU table's (the planner's reserve still applies)")
    return p


def _check(job: DryRunJob) -> tuple[Any, Any, Any, Any]:
    """(options, dims, model config, spec): the strategy's own checks, before any process group exists.

    Raises:
        ValueError: the strategy's one-line message.
    """
    from lightning_hybrid.distributed.option_checks import check_options
    from lightning_hybrid.distributed.options import ParallelOptions
    from lightning_hybrid.distributed.pipeline.schedules import check_batch_splits
    from lightning_hybrid.models.qwen2.config import Qwen2Config, parallel_spec

    options = ParallelOptions(**job.strategy)
    config = Qwen2Config.resolve(job.model.get("model", "tiny"))
    spec = parallel_spec(config)
    dims = check_options(options, job.world_size, job.devices_per_node if job.num_nodes > 1 else None, spec,
                         config.num_hidden_layers, job.precision, "CausalLM")
    if options.pp > 1:
        check_batch_splits(job.batch_size, options.num_microbatches)
    return options, dims, config, spec


def traced_microbatches(options: Any, dims: Any) -> int:
    """Micro-batches a dry run traces, of the recipe's size: enough to reach the schedule's steady-state peak.

    A 1F1B rank holds at most ``pp - rank`` micro-batches' activations, and its peak comes in the steady state: the
    first forward after its first backward, with ``pp - rank`` micro-batches in flight again while the stage's
    unsharded FSDP gradients (kept through the step under a pipeline) are already held. So ``pp + 1`` of them reach
    every rank's peak (``pp`` alone would end the step with backwards only and miss it: 20 GB at the 72B SFT
    recipe's stage 0). An interleaved or zero-bubble rank holds fewer than ``2 x pp x v``, whose steady state
    follows its warm-up; GPipe holds all of them. The traced peaks are the full step's; the collectives listed are
    those of the traced micro-batches.
    """
    m = options.num_microbatches
    if dims.pp == 1 or options.pp_schedule == "gpipe":
        return m if dims.pp > 1 else 1
    if options.pp_schedule == "1f1b":
        return min(m, dims.pp + 1)
    return min(m, 2 * dims.pp * options.virtual_stages)


# What a rank's process needs, imported once by multiprocessing's fork server (one per process that traces ranks),
# from which every rank's process is then forked: a spawned rank imported torch and Lightning again (~5-7 s of CPU).
ROLE_PRELOAD = ["lightning_hybrid.dryrun.rank", "lightning_hybrid.dryrun.fake", "lightning_hybrid.strategy",
                "lightning_hybrid.models", "lightning.pytorch"]


def _take_environment(environ: dict[str, str]) -> None:
    """A rank's process starts with the environment of the process that asked for it (the fork server's is the one
    it started with)."""
    import os

    os.environ.clear()
    os.environ.update(environ)


def role_pool(workers: int) -> Any:
    """A process pool whose every task runs in a fresh process (a process joins one world: torch keeps process
    groups and meshes by name for the life of a process), forked from a fork server that imported
    :data:`ROLE_PRELOAD` once, with this process's current environment."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(ROLE_PRELOAD)  # takes effect when this process starts its fork server
    return ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1, initializer=_take_environment,
                               initargs=(dict(os.environ),))


def _run_rank_in_pool(job: DryRunJob, rank: int, *args: Any) -> Any:
    """:func:`~lightning_hybrid.dryrun.rank.run_rank` in a pool process: an error comes back as one that pickles
    (a fake-tensor or pybind exception does not, and the pool would report only that)."""
    import traceback

    from lightning_hybrid.dryrun.rank import run_rank

    try:
        return run_rank(job, rank, *args)
    except ValueError as error:  # the strategy's one-line errors for a layout that does not fit
        raise ValueError(str(error)) from None
    except Exception:
        raise RuntimeError(f"the dry run of rank {rank} failed:\n{traceback.format_exc()}") from None


def trace_ranks(job: DryRunJob, ranks: list[int], limit: Optional[float] = None) -> list[Any]:
    """:func:`~lightning_hybrid.dryrun.rank.run_rank` for each rank, each in a fresh process of :func:`role_pool`,
    several at once on a machine with the cores for it. A rank stops as soon as it is certain to hold more than
    ``limit`` bytes."""
    import os

    workers = max(1, min(len(ranks), os.cpu_count() or 1))
    with role_pool(workers) as pool:
        return list(pool.map(_run_rank_in_pool, [job] * len(ranks), ranks, [True] * len(ranks), [0] * len(ranks),
                             [None] * len(ranks), [limit] * len(ranks)))


def _ratio(traced: float, planned: float) -> Optional[float]:
    return traced / planned if planned else None


def _role_report(job: DryRunJob, role: Role, result: Any, prediction: Any) -> dict[str, Any]:
    state = result.state["parameters"] + result.state["gradients"] + result.state["optimizer"]
    traced = {**result.state, "activations": result.activation_peak, "transient": result.total_peak - state,
              "total": result.total_peak}
    planner = {name: prediction.figures[name] for name in FIGURES}
    # what the recipe's whole step holds beyond the traced micro-batches (a pipeline's last stage keeps every
    # micro-batch's logits until the step ends): the planner's difference, added to the traced peak
    full_step = result.total_peak + max(0.0, prediction.full_step_total - planner["total"])
    return {"ranks": list(role.ranks), "traced_rank": role.traced_rank, "coordinates": result.coordinates,
            "stages": list(role.stages), "traced": traced, "planner": planner,
            "ratio": {k: _ratio(traced[k], planner[k]) for k in planner},
            "peak_breakdown": result.peak, "kind_peaks": result.kind_peaks, "collectives": result.collectives,
            "planner_collectives": prediction.collectives,
            "full_step": {"traced_plus_planned": full_step, "planner": prediction.full_step_total},
            "fits": full_step <= prediction.usable and result.stopped is None, "stopped": result.stopped,
            "seconds": round(result.seconds, 2), "max_rss_bytes": result.max_rss}


def dry_run(job: DryRunJob, ranks: list[int], gpu: str, device_memory_gib: Optional[float] = None,
            ) -> dict[str, Any]:
    """Trace one rank per role among ``ranks`` and return the report (see ``--json``).

    Raises:
        ValueError: the strategy refuses the recipe, or a bad GPU name or memory size.
    """
    start = time.perf_counter()
    usable = usable_bytes(gpu, device_memory_gib)
    options, dims, config, spec = _check(job)
    wanted = set(ranks)
    roles = [r for r in rank_roles(config, spec, dims, options) if wanted & set(r.ranks)]
    reports = []
    traced = traced_microbatches(options, dims)
    traced_job = job.with_microbatches(traced) if dims.pp > 1 else job
    for role, result in zip(roles, trace_ranks(traced_job, [role.traced_rank for role in roles], usable)):
        prediction = predict(job, config, dims, options, result, gpu, usable, traced)
        report = _role_report(job, role, result, prediction)
        report["ranks"] = sorted(wanted & set(role.ranks))
        report["rank_coordinates"] = [[rank, dims.coordinates(rank)] for rank in report["ranks"]]
        reports.append(report)
    return {"recipe": job.name, "world_size": job.world_size, "layout": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp},
            "microbatches": options.num_microbatches if dims.pp > 1 else 1, "traced_microbatches": traced,
            "gpu": gpu, "usable_bytes": usable, "roles": reports, "fits": all(r["fits"] for r in reports),
            "seconds": round(time.perf_counter() - start, 1)}


def _gb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 4:
        return f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
    return ",".join(map(str, ranks))


def format_report(report: dict[str, Any]) -> str:
    """The tables: per role, each figure traced vs planner (GB) and the ratio; then the collectives per dimension."""
    head = f"{'ranks':<16} {'pp,dp,tp':<9} {'stages':<7}"
    for name in FIGURES:
        head += f" | {name[:11]:>11} {'planner':>8} {'ratio':>5}"
    lines = [f"dry run of {report['recipe']}: world {report['world_size']}, layout {report['layout']}, "
             f"usable {report['usable_bytes'] / 1e9:.1f} GB per {report['gpu']}, micro-batches traced "
             f"{report['traced_microbatches']} of {report['microbatches']} ({report['seconds']} s)", head,
             "-" * len(head)]
    for r in report["roles"]:
        c = r["coordinates"]
        row = f"{_ranks_text(r['ranks']):<16} {c['pp']},{c['dp']},{c['tp']:<5} {','.join(map(str, r['stages'])):<7}"
        for name in FIGURES:
            ratio = r["ratio"][name]
            row += f" | {_gb(r['traced'][name]):>11} {_gb(r['planner'][name]):>8} " \
                   f"{('-' if ratio is None else f'{ratio:.3f}'):>5}"
        lines.append(row + ("" if r["fits"] else "  DOES NOT FIT"))
        full = r.get("full_step", {}).get("traced_plus_planned", r["traced"]["total"])
        if full > r["traced"]["total"] * 1.001:
            lines.append(f"{'':<16} the recipe's {report['microbatches']} micro-batches: {_gb(full)} GB (traced total "
                         f"+ the planner's bytes of the untraced micro-batches' logits the last stage keeps)")
    lines += ["", "collectives of the traced micro-batches per mesh dimension: calls x MB, traced / planner (MB ratio)"]
    for r in report["roles"]:
        lines.append(f"  rank {r['traced_rank']}: " + "; ".join(_collective_parts(r)))
    return "\n".join(lines)


def _collective_parts(role: dict[str, Any]) -> list[str]:
    """``dim: kind calls x MB / planner calls x MB (ratio)`` for every traced and every predicted collective."""
    traced, planned = role["collectives"], role.get("planner_collectives")
    parts = []
    for dim in sorted(set(traced) | set(planned or {})):
        kinds = []
        for kind in sorted(set(traced.get(dim, {})) | set((planned or {}).get(dim, {}))):
            n, b = traced.get(dim, {}).get(kind, (0, 0))
            text = f"{kind} {n} x {b / 1e6:.1f}"
            if planned is not None:
                pn, pb = planned.get(dim, {}).get(kind, (0, 0))
                text += f" / {pn} x {pb / 1e6:.1f} ({'-' if not pb else f'{b / pb:.3f}'})"
            kinds.append(text)
        parts.append(f"{dim}: " + ", ".join(kinds))
    return parts


def _not_fitting(report: dict[str, Any]) -> list[str]:
    out = []
    for r in report["roles"]:
        if r["fits"]:
            continue
        rank, c = r["rank_coordinates"][0]
        b = r["peak_breakdown"]
        parts = ", ".join(f"{k.lower()} {v / 1e9:.1f}" for k, v in b.items() if k != "Total" and v)
        peak, where = f"peak {r['full_step']['traced_plus_planned'] / 1e9:.1f} GB", "GB at the traced peak"
        if r.get("stopped") == "model state":
            peak, where = f"model state {r['traced']['total'] / 1e9:.1f} GB", "activations not traced; GB"
        elif r.get("stopped") == "step":
            peak, where = f"peak at least {r['traced']['total'] / 1e9:.1f} GB", "traced until then; GB held"
        out.append(f"rank {rank} (pp={c['pp']}, dp={c['dp']}, tp={c['tp']}; traced as rank {r['traced_rank']}, same "
                   f"role: {_ranks_text(r['ranks'])}) does not fit: {peak} > usable "
                   f"{report['usable_bytes'] / 1e9:.1f} GB on {report['gpu']} ({where}: {parts})")
    return out


def dry_run_main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``lightning-hybrid dry-run``.

    Raises:
        ValueError: a bad flag or a recipe the strategy refuses (``lightning-hybrid`` prints it as one line).
    """
    args = build_parser().parse_args(argv)
    job = load_job(args.config)
    ranks = parse_ranks(args.ranks, job.world_size)
    gpu = (args.gpu or job.plan_gpu or "h100").lower()
    report = dry_run(job, ranks, gpu, args.device_memory_gib)
    print(json.dumps(report, indent=1) if args.json else format_report(report), flush=True)
    problems = _not_fitting(report)
    for line in problems:
        print(f"lightning-hybrid dry-run: {line}", file=sys.stderr, flush=True)
    return EXIT_DOES_NOT_FIT if problems else 0
