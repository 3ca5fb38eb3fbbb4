"""How right is the planner on this machine: predicted vs measured step time of every feasible layout.

One torchrun launch: a preflight on the world (gloo all-reduce / all-gather / reduce-scatter bandwidth and latency,
each process's matmul TFLOP/s), then every layout in turn with the real strategy (``HybridParallelStrategy`` in a
Lightning Trainer) on a Qwen2-shaped model, the median step time after warm-up on rank 0. The parent then asks the
planner, calibrated with that preflight (``plan --calibrate`` does the same), for each layout's step time, and prints
predicted vs measured, the error, Spearman's rank correlation, and where the planner's own choice (``tp="auto"``,
the fastest predicted of the same layouts) ranks among the measured ones.

The layouts: every tp x pp x dp of the world (tp inside the machine), fsdp and replicate over dp, for a pipeline
2-3 micro-batch counts (pp, 2 pp, 4 pp where they divide the batch), with and without full recompute.

    python benchmarks/planner_accuracy.py                    # 4 processes, every layout (tens of minutes on CPU)
    python benchmarks/planner_accuracy.py --processes 8         # where the machine has the cores
    python benchmarks/planner_accuracy.py --reduced          # 2 processes, 2 layouts, 1 step: the suite's smoke run

CPU processes that share cores with other work measure the sharing, not the layout: run it on an idle machine with
at least one core per process for numbers worth quoting (docs/planner.md says which were taken how).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REDUCED = dict(processes=2, hidden=128, layers=2, heads=4, kv_heads=2, vocab=512, seq_len=64, global_batch=4, steps=1,
               warmup=1, max_layouts=2)
FULL = dict(processes=4, hidden=512, layers=4, heads=8, kv_heads=4, vocab=4096, seq_len=256, global_batch=8, steps=5,
            warmup=2, max_layouts=0)


def _config(args: argparse.Namespace) -> Any:
    from lightning_hybrid.models import Qwen2Config

    return Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, name="accuracy-bench")


def layouts(args: argparse.Namespace) -> list[Any]:
    """The benchmark's layouts: every mesh and dp mode, 2-3 micro-batch counts, recompute none and full."""
    from lightning_hybrid.distributed.options import ParallelOptions
    from lightning_hybrid.planner.auto import TrainingShape, enumerate_layouts

    options = ParallelOptions(tp="auto", pp="auto", dp="auto", microbatches="auto", data_parallel="auto",
                              activation_checkpointing="auto")  # pp_schedule 1f1b, virtual_stages 1
    shape = TrainingShape(args.seq_len, args.global_batch, True)
    out = []
    for lay in enumerate_layouts(options, args.processes, args.processes, shape):
        if lay.recompute == "selective" or (lay.pp > 1 and lay.microbatches not in (lay.pp, 2 * lay.pp, 4 * lay.pp)):
            continue
        if args.heads % lay.tp or args.kv_heads % lay.tp or lay.pp > args.layers:
            continue
        out.append(lay)
    if args.max_layouts:  # the reduced run: the plainest data-parallel layout and one with a pipeline
        out = [next(x for x in out if x.pp == 1 and x.recompute == "none"),
               next(x for x in out if x.pp > 1 and x.recompute == "none")][:args.max_layouts]
    return out


# ----------------------------------------------------------------------------- worker (one torchrun launch)


def _fit(args: argparse.Namespace, lay: dict) -> list[float]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.models import CausalLM

    times: list[float] = []

    class StepTimer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.start)

    L.seed_everything(0)
    steps = args.steps + args.warmup
    tokens = torch.randint(0, args.vocab, (args.global_batch * steps, args.seq_len + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.global_batch // lay["dp"])
    pipeline = dict(pp_schedule=lay["schedule"], microbatches=lay["microbatches"]) if lay["pp"] > 1 else {}
    strategy = HybridParallelStrategy(tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], data_parallel=lay["data_parallel"],
                                      activation_checkpointing=lay["recompute"], **pipeline)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.processes, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[StepTimer()])
    trainer.fit(CausalLM(_config(args), lr=1e-4), train_dataloaders=data)
    return times[args.warmup:]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hybrid.preflight.links import MiB, run_preflight

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 1, args.processes), mesh_dim_names=("pp", "dp", "tp"))
    preflight = run_preflight(mesh, min_bytes=MiB // 16, max_bytes=4 * MiB, check_health=False).to_dict()
    from lightning_hybrid.device_speed import measure_cpu

    doc = {"preflight": preflight, "results": [], "copy_tbs": measure_cpu()[1], "cores": len(os.sched_getaffinity(0))}
    for lay in json.loads(Path(args.layouts).read_text()):
        times = _fit(args, lay)
        doc["results"].append({"layout": lay, "times": times, "median": statistics.median(times)})
        if dist.get_rank() == 0:  # after every layout: a long run that is stopped still leaves its measurements
            Path(args.out).write_text(json.dumps(doc))
    dist.barrier()
    dist.destroy_process_group()
    # Exit without interpreter finalization: a gloo worker thread still dropping the barrier's work would take the
    # GIL during it and abort the process (pytorch/pytorch#190489; tests/helpers/worker_exit.py explains).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- parent: predictions and the table


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def predict(args: argparse.Namespace, doc: dict) -> list[dict]:
    """Each measured layout with the calibrated planner's predicted step time."""
    from lightning_hybrid.device_speed import measure_cpu
    from lightning_hybrid.planner.calibrate import CPU_TIME_MODEL, calibrate_hardware, cpu_hardware
    from lightning_hybrid.planner.search import Layout, Problem, estimate

    preflight, measured = doc["preflight"], doc["results"]
    copy_tbs = doc.get("copy_tbs") or measure_cpu()[1]  # memory bandwidth (the preflight measures matmul and links)
    hw = cpu_hardware(1.0, copy_tbs, args.processes, args.processes, cores=doc.get("cores"))
    hw = calibrate_hardware(hw, preflight)
    problem = Problem(_config(args), hw, args.seq_len, args.global_batch, "32-true", time_model=CPU_TIME_MODEL)
    rows = []
    for r in measured:
        lay = Layout(**r["layout"])
        e = estimate(problem, lay)
        rows.append({"layout": lay, "predicted": e.time["step"], "measured": r["median"],
                     "error": (e.time["step"] - r["median"]) / r["median"], "tokens_per_second": e.tokens_per_second})
    return rows


def report(rows: list[dict], header: str) -> str:
    """The markdown table and the three figures: median |error|, Spearman, auto's measured rank."""
    lines = [header, "", "| layout | predicted s | measured s | error |", "| --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: r["measured"]):
        lines.append(f"| {r['layout'].describe()} | {r['predicted']:.3f} | {r['measured']:.3f} | {r['error']:+.0%} |")
    median_error = statistics.median(abs(r["error"]) for r in rows)
    rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows]) if len(rows) > 1 else float("nan")
    auto = min(rows, key=lambda r: -r["tokens_per_second"])  # what tp="auto" picks among these layouts
    by_measured = sorted(rows, key=lambda r: r["measured"])
    rank = by_measured.index(auto) + 1
    slower = auto["measured"] / by_measured[0]["measured"] - 1
    lines += ["", f"median |error| {median_error:.0%} (target <= 20%); Spearman rank correlation {rho:.2f} "
                  f"(target >= 0.8); auto's choice ({auto['layout'].describe()}) is measured #{rank} of {len(rows)}, "
                  f"{slower:.0%} slower than the measured best (target <= 10%)"]
    return "\n".join(lines)


def measure(args: argparse.Namespace, chosen: list[Any]) -> dict[str, Any]:
    """Run the worker over ``chosen`` layouts in one torchrun launch; its preflight report and timings.

    With ``--json FILE`` the measurements so far are in ``FILE.partial`` while it runs (``--replay`` reads it).
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "layouts.json")
        out = Path(args.json + ".partial") if args.json else Path(tmp, "out.json")
        spec.write_text(json.dumps([vars(lay) for lay in chosen]))
        flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in FULL]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes), __file__,
               "--worker", f"--layouts={spec}", f"--out={out}", *flags]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="2 processes, 2 layouts, 1 step (the suite's run)")
    for name, value in FULL.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"(default {value})")
    parser.add_argument("--json", default="", help="also write the measurements and predictions here")
    parser.add_argument("--replay", default="", help="predict again for the measurements of an earlier --json file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in (REDUCED if args.reduced else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.worker:
        return worker(args)
    start = time.perf_counter()
    if args.replay:  # predictions again for measurements written earlier with --json (the time model changed)
        doc = json.loads(Path(args.replay).read_text())
    else:
        doc = measure(args, layouts(args))
    rows = predict(args, doc)
    gflops = statistics.median(m["tflops"] for m in doc["preflight"]["matmul"]) * 1e3
    header = (f"planner accuracy: {args.processes} CPU processes (gloo), Qwen2-shaped h={args.hidden} L={args.layers} "
              f"heads={args.heads}/{args.kv_heads} vocab={args.vocab}, seq {args.seq_len}, global batch "
              f"{args.global_batch}, fp32; median of {args.steps} steps after {args.warmup}; {len(rows)} layouts "
              + (f"replayed from {args.replay}" if args.replay else f"in {time.perf_counter() - start:.0f} s")
              + f"; matmul {gflops:.1f} GFLOP/s per process; {doc.get('cores', '?')} cores")
    print(report(rows, header))
    if args.json:
        rows_out = [{**r, "layout": vars(r["layout"])} for r in rows]
        Path(args.json).write_text(json.dumps({**doc, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
