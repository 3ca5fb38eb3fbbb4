"""Command line and report of ``lightning-hybrid plan``: flags, ranked table, assumptions, JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

from lightning_hybrid.hardware import SYSTEM_GPUS
from lightning_hybrid.models.qwen2.config import PRESETS, Qwen2Config
from lightning_hybrid.planner.interval import (
    DEFAULT_GPU_MTBF_HOURS,
    DEFAULT_RESTART_SECONDS,
    DEFAULT_STORAGE_GBPS,
    checkpoint_plan,
)
from lightning_hybrid.planner.layout import Estimate, Problem
from lightning_hybrid.planner.memory import OPTIMIZERS, PRECISIONS
from lightning_hybrid.planner.recipe_cli import (
    EXPLAIN_BEST,
    check_positive,
    given_flags,
    hardware_flags,
    run_recipe_plan,
)
from lightning_hybrid.planner.recipe_plan import FLOAT8_OFF
from lightning_hybrid.planner.report import explain_time, format_table, gpu_figures
from lightning_hybrid.planner.runtime import runtime_features, runtime_from_options
from lightning_hybrid.planner.search import explain, search
from lightning_hybrid.planner.step_time import GEMM_PEAK_EFFICIENCY, Hardware

__all__ = ["build_parser", "build_problem", "run_plan", "assumptions", "explain_time", "format_table"]

DEFAULT_BATCH_TOKENS = 4 * 1024 * 1024


def build_parser() -> argparse.ArgumentParser:
    """The ``plan`` flags."""
    p = argparse.ArgumentParser(
        prog="lightning-hybrid plan",
        description="Rank tp/pp/dp/micro-batch/recompute layouts by predicted step time among those that fit.")
    p.add_argument("--model", default="qwen2.5-72b",
                   help=f"preset ({', '.join(PRESETS)}) or a folder with a Hugging Face config.json")
    p.add_argument("--config", metavar="RECIPE_YAML",
                   help="plan exactly this `lightning-hybrid fit` recipe (its model, GPUs, layout, precision and "
                        "runtime features; the GPU type from --gpu or the recipe's `# plan:` line) beside the fastest "
                        "layout")
    p.add_argument("--gpus", type=int, help="total GPUs (required without --config)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; tp stays inside a node (default 8)")
    p.add_argument("--gpu", default=None, choices=sorted(SYSTEM_GPUS), help="GPU type for the defaults below (h100)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (4096)")
    p.add_argument("--global-batch", type=int, default=None,
                   help=f"sequences per optimizer step (default: {DEFAULT_BATCH_TOKENS} tokens / seq-len)")
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS),
                   help="Lightning precision (bf16-mixed: fp32 weights, gradients and AdamW states)")
    p.add_argument("--float8", choices=("tensorwise", "rowwise", "mxfp8", FLOAT8_OFF), default=None,
                   help="float8 block linears (HybridParallelStrategy(float8=...); 'none': bf16, e.g. to plan a float8 "
                        "recipe without it); MFU stays against the bf16 peak")
    p.add_argument("--fused-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="q/k/v and gate/up run as one GEMM each (this project's model: on; off: five GEMMs, as "
                        "torchtitan and Hugging Face models run them)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS), help="optimizer (adamw)")
    p.add_argument("--gpu-memory-gb", type=float, help="GPU memory in GB (overrides the GPU type)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak TFLOP/s per GPU (overrides the GPU type)")
    p.add_argument("--intra-node-gbps", type=float, help="NVLink bandwidth per direction per GPU, GB/s (bytes)")
    p.add_argument("--inter-node-gbps", type=float, help="network bandwidth per GPU between nodes, Gb/s (bits)")
    p.add_argument("--compute-efficiency", type=float, default=GEMM_PEAK_EFFICIENCY,
                   help=f"fraction of peak large matmuls reach ({GEMM_PEAK_EFFICIENCY}, fitted on published runs)")
    p.add_argument("--link-efficiency", type=float, default=0.8, help="collective bus bandwidth / link bandwidth")
    p.add_argument("--calibrate", metavar="PREFLIGHT_JSON",
                   help="take the matmul speed and each link's bandwidth and latency from a preflight report "
                        "(`lightning-hybrid preflight --json`) measured on this cluster instead of the GPU table")
    p.add_argument("--mtbf-hours", type=float,
                   help=f"job MTBF in hours (default {DEFAULT_GPU_MTBF_HOURS:.0f} GPU-hours / gpus)")
    p.add_argument("--save-seconds", type=float,
                   help=f"blocking time of one checkpoint save (default: shard bytes / {DEFAULT_STORAGE_GBPS} GB/s)")
    p.add_argument("--restart-seconds", type=float, default=DEFAULT_RESTART_SECONDS,
                   help="time to restart and reload after a failure (600)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (10)")
    p.add_argument("--explain", action="append", default=[], metavar="TP,PP,MODE", nargs="?", const=EXPLAIN_BEST,
                   help="without a value: how the chosen layout's step time splits (compute, exposed TP and DP, "
                        "bubble, recompute, GEMM efficiency); with one, e.g. 8,1,replicate: also why that mesh fits "
                        "or not and the split of its fastest variant (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    return p


def build_problem(args: argparse.Namespace) -> Problem:
    """The :class:`Problem` described by parsed flags.

    Raises:
        ValueError: a flag is out of range (one line naming it and what would fit).
    """
    if args.gpus is None:
        raise ValueError("--gpus is required (or plan a recipe with --config RECIPE.yaml)")
    check_positive(args)
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise ValueError(f"--gpus={args.gpus} is not a whole number of nodes of --gpus-per-node={args.gpus_per_node}; "
                         f"use a multiple of {args.gpus_per_node}")
    config = Qwen2Config.resolve(args.model)
    hw = hardware_flags(args, Hardware(SYSTEM_GPUS[args.gpu or "h100"], args.gpus, min(args.gpus_per_node, args.gpus)))
    batch = args.global_batch or max(1, DEFAULT_BATCH_TOKENS // args.seq_len)
    float8 = getattr(args, "float8", None)
    fused = getattr(args, "fused_projections", None)
    # the strategy's defaults: what `fit` runs when a recipe sets none of the runtime options (and --float8)
    return Problem(config, hw, args.seq_len, batch, args.precision, args.optimizer,
                   runtime=runtime_from_options({"float8": None if float8 == FLOAT8_OFF else float8}, args.precision,
                                                fused_projections=fused is not False))


def assumptions(p: Problem) -> list[str]:
    """Every figure and simplification the prediction rests on, one sentence each."""
    g, hw, prec = p.hw.gpu, p.hw, PRECISIONS[p.precision]
    states = OPTIMIZERS[p.optimizer][0]
    return [
        f"GPU {g.name}: {g.memory_gb:g} GB, {g.peak_tflops:g} TFLOP/s dense bf16 ({g.fp32_tflops:g} fp32), "
        f"NVLink {g.nvlink_gbs:g} GB/s per direction, network {g.network_gbits:g} Gb/s per GPU, HBM {g.hbm_tbs:g} TB/s",
        f"usable memory per GPU = ({g.memory_gb:g} GB - {hw.reserved_gb:g} GB CUDA context/NCCL/workspaces) x "
        f"(1 - {hw.fragmentation:g} fragmentation) = {hw.usable_bytes / 1e9:.1f} GB",
        f"precision {prec.name}: weights {prec.param} B, gradients {prec.grad} B, {states} {p.optimizer} states x "
        f"{prec.state} B per parameter (+4 B step per tensor); matmul activations {prec.compute} B, residual stream "
        f"{prec.residual} B; autocast keeps {prec.autocast_copy} B/parameter low-precision weight copies for backward",
        "sharding as the strategy applies it: TP colwise q/k/v/gate/up"
        f"{' (and q/k/v biases)' * p.config.attention_bias} on dim 0, rowwise o/down on dim 1, embedding and head "
        "over the vocabulary; FSDP2 splits every TP-local "
        "tensor on dim 0 (torch.chunk)",
        "pipeline stages hold contiguous blocks balanced by the model's declared costs; rank r holds stages "
        "r, r+pp, ...; in-flight micro-batches: 1F1B min(m, pp-r), interleaved per torch's warm-up",
        "FSDP under a pipeline keeps the stage's parameters and gradients unsharded through the step (torch's "
        "schedules skip reshard-after-backward); without a pipeline one block is prefetched and the root unit "
        "stays gathered",
        "activations: Korthikanti et al. 2022 counted per saved tensor for this model: flash-style attention (no s x s "
        "scores), GQA k/v repeated to all heads, SwiGLU, fp32 RMSNorm; sequence parallel shards the norms only",
        "recompute memory: selective keeps block input + matmul/attention/TP-collective outputs (with tp > 1 o and "
        "down also before their reduction, full width); full keeps the block input; a block's backward working set "
        "and the fp32 loss are added as transients",
        f"compute: each GEMM (q, k, v, o, gate, up, down, head at its TP-local shape) at {hw.compute_efficiency:g} "
        f"of peak x d/(d + {p.time_model.gemm_knee:g}), d its smallest dimension; attention 12 L hq s FLOPs at "
        f"{p.time_model.attention_efficiency:g} of peak; elementwise ops (norms, rotary, SiLU, residual adds, casts, "
        f"the loss) by the bytes they move at {p.time_model.hbm_efficiency:g} x HBM bandwidth, "
        f"{'fused' if p.runtime.fused_elementwise else 'one kernel per op (eager, no torch.compile)'}; constants "
        "fitted on published Llama 3 / torchtitan / Megatron-Core runs (benchmarks/planner_published.py)",
        f"communication: nccl-tests bus bandwidth = {hw.link_efficiency:g} x link; "
        f"latency {hw.intra_latency_s * 1e6:g} us "
        f"in a node, {hw.inter_latency_s * 1e6:g} us across; TP comm in the critical path (torch's TP), the logits "
        "gathered for the loss; replicate all-reduces gradients once per step after backward; FSDP per micro-batch "
        "(no pipeline) overlaps with compute; under a pipeline the stage is gathered and reduced once per step, "
        "exposed, and each block re-gathered per micro-batch behind compute",
        "recompute: selective reruns the elementwise forward (no matmul, no collective); full reruns the whole "
        "forward (+1/3 of GEMM and attention time, and the forward TP collectives up to the last saved tensor)",
        "pipeline bubble (pp-1)/v micro-batch times of the slowest stage plus warm-up/cool-down point-to-point",
        f"global batch {p.global_batch} sequences x {p.seq_len} tokens; MFU uses 6N + 12 L h s model FLOPs",
    ]


def _nothing_fits(p: Problem, infeasible: list[Estimate]) -> str:
    usable = p.hw.usable_bytes / 1e9
    where = f"{p.config.name} at seq {p.seq_len} on {p.hw.gpus} x {p.hw.gpu.name} ({usable:.1f} GB usable per GPU)"
    if not infeasible:
        return f"nothing fits {where}: no tp/pp/dp/micro-batch combination divides the model and the batch"
    best = infeasible[0]
    need = best.memory["total"] / 1e9
    state = (best.memory["weights"] + best.memory["gradients"] + best.memory["optimizer"]) / 1e9
    more = math.ceil(p.hw.gpus * state / max(1e-9, usable - (need - state))) if usable > need - state else None
    fix = f"about {more} GPUs, " if more else ""
    return (f"nothing fits {where}: the smallest layout ({best.layout.describe()}) needs {need:.1f} GB per GPU; "
            f"use {fix}a GPU with at least {need / (1 - p.hw.fragmentation) + p.hw.reserved_gb:.0f} GB "
            f"(--gpu-memory-gb), a shorter --seq-len or a smaller model")


def run_plan(argv: Optional[list[str]] = None) -> int:
    """Parse ``argv``, search, print the report; 0 when a layout fits, 1 when none does, 2 on a bad flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        return run_recipe_plan(args, given_flags(build_parser, argv))
    try:
        p = build_problem(args)
        explain_meshes = [_parse_mesh(s) for s in args.explain if s != EXPLAIN_BEST]
    except ValueError as err:
        print(f"lightning-hybrid plan: error: {err}", file=sys.stderr)
        return 2
    feasible, infeasible = search(p)
    gpn = p.hw.gpus_per_node
    tp_max = max((t for t in range(1, gpn + 1) if gpn % t == 0 and p.config.num_key_value_heads % t == 0
                  and p.config.num_attention_heads % t == 0), default=1)
    baseline = explain(p, tp_max, 1, "replicate")
    explanations = [baseline] + [explain(p, *mesh) for mesh in explain_meshes]
    timed = _explained_estimates(EXPLAIN_BEST in args.explain, feasible, explain_meshes)
    message = "" if feasible else _nothing_fits(p, infeasible)
    checkpoint = None
    if feasible:
        top = feasible[0]
        checkpoint = checkpoint_plan(top.checkpoint_bytes, p.hw.gpus, top.time["step"], args.save_seconds,
                                     args.mtbf_hours, restart_seconds=args.restart_seconds)
    if args.json:
        doc = {"model": p.config.to_dict(), "gpus": p.hw.gpus, "gpus_per_node": gpn, "gpu": gpu_figures(p.hw.gpu),
               "seq_len": p.seq_len, "global_batch": p.global_batch, "precision": p.precision,
               "optimizer": p.optimizer, "assumptions": assumptions(p),
               "layouts": [e.to_dict() for e in feasible], "feasible_count": len(feasible),
               "infeasible": [e.to_dict() for e in infeasible], "explanations": explanations,
               "step_time_explained": [dict(e.to_dict(), lines=explain_time(e)) for e in timed],
               "checkpoint": checkpoint, "message": message or None, "runtime": runtime_features(p.runtime)}
        print(json.dumps(doc, indent=1))
        return 0 if feasible else 2  # a layout that cannot work: a configuration error (exit 2)
    _print_report(p, args.top, feasible, infeasible, explanations, timed, checkpoint)
    if not feasible:  # the reason and the fix come last, where a user looks first
        print(message, file=sys.stderr, flush=True)
    return 0 if feasible else 2


def _explained_estimates(best: bool, feasible: list[Estimate], meshes: list[tuple[int, int, str]]) -> list[Estimate]:
    """The layouts whose step time ``--explain`` splits: the chosen one, and the fastest variant of each mesh."""
    out = [feasible[0]] if best and feasible else []
    for tp, pp, mode in meshes:
        match = [e for e in feasible if (e.layout.tp, e.layout.pp) == (tp, pp)
                 and (e.layout.data_parallel == mode or e.layout.dp == 1)]
        out += match[:1]  # feasible is sorted by step time
    return out


def _print_report(p: Problem, top: int, feasible: list[Estimate], infeasible: list[Estimate], explanations: list[dict],
                  timed: list[Estimate], checkpoint: Optional[dict]) -> None:
    """The text report: table, step-time splits asked for, why not simpler layouts, checkpoint interval, assumptions."""
    print(f"plan: {p.config.name} ({p.config.num_parameters() / 1e9:.2f}B parameters), {p.hw.gpus} x {p.hw.gpu.name} "
          f"({p.hw.gpus_per_node} per node), seq {p.seq_len}, global batch {p.global_batch}, {p.precision}, "
          f"{p.optimizer}")
    if p.runtime.float8:
        print(f"float8={p.runtime.float8}: block GEMMs at the fp8 peak ({p.hw.gpu.peak.fp8 / 1e12:.0f} TFLOP/s); MFU "
              f"is quoted against the bf16 peak ({p.hw.peak_flops(p.precision) / 1e12:.0f} TFLOP/s), as torchtitan "
              f"and Megatron quote it")
    if feasible:
        print(f"\n{len(feasible)} layouts fit; the fastest {min(top, len(feasible))} "
              "(memory in GB on the fullest rank, time in s per optimizer step):")
        print(format_table(feasible[:top]))
    if timed:
        print("\nruntime features: " + ", ".join(f"{name} {'on' if on else 'off'}"
                                                 for name, on in runtime_features(p.runtime).items()))
    for e in timed:
        print("\n" + "\n".join(explain_time(e)))
    print("\nwhy not simpler layouts:")
    for ex in explanations:
        print("  " + ex["text"])
    for e in infeasible[:5]:
        print(f"  does not fit: {e.layout.describe()}: needs {e.memory['total'] / 1e9:.1f} GB of {e.usable / 1e9:.1f}")
    if checkpoint:
        print(f"\ncheckpoint interval (Young/Daly, tau = sqrt(2 x save x MTBF)): "
              f"save {checkpoint['save_seconds']:.0f} s, "
              f"job MTBF {checkpoint['mtbf_hours']:.1f} h -> every {checkpoint['interval_seconds'] / 60:.0f} min "
              f"(~{checkpoint['interval_steps']} steps); expected time lost to checkpoints and failures "
              f"{checkpoint['lost_fraction']:.1%} (restart {checkpoint['restart_seconds']:.0f} s)")
    print("\nassumptions:")
    for line in assumptions(p):
        print("  - " + line)


def _parse_mesh(text: str) -> tuple[int, int, str]:
    parts = [s.strip() for s in text.split(",")]
    try:
        tp, pp, mode = int(parts[0]), int(parts[1]), parts[2].lower()
    except (IndexError, ValueError):
        raise ValueError(f"--explain {text!r} must look like TP,PP,MODE, e.g. 8,1,replicate") from None
    if mode not in ("fsdp", "replicate"):
        raise ValueError(f"--explain mode {mode!r} must be fsdp or replicate")
    return tp, pp, mode


if __name__ == "__main__":
    import sys

    sys.exit(run_plan())
