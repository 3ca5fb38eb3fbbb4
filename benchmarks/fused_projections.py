"""Fused projections and rotary tables made once (issue #49): step-time ratios on 4 CPU processes, and the dry run's
CPU time of rank 0 of the 72B SFT recipe before and after.

**Step time** (``python benchmarks/fused_projections.py``): ``torchrun`` launches of 4 gloo processes train at
tp2 x dp2 (FSDP2, ``32-true``):

* fused q/k/v and gate/up GEMMs against the three and two separate ones (the rotary tables made once in both);
* the rotary tables made once per forward against once per attention layer (the code before; fused in both),
  on plain rows and on packed documents (``position_ids``, the SFT recipes' layout);

for the tiny model (4 blocks, width 64, 8 x 128 tokens per dp rank) and a wider one (4 blocks, width 256,
8 query / 2 KV heads, 4 x 256 tokens), with and without sequence parallelism. Each pair is one launch (both sides in
the same processes) that runs it ``--rounds`` times in alternating order (A B, then B A, ...); a cell is the median
over rounds of the median interval between the ends of consecutive optimizer steps on rank 0 (``--steps`` after
``--warmup``), and the ratio is on / off of those medians.

**Dry run** (``--dry-run``): rank 0 of ``recipes/qwen2.5-72b-sft.yaml`` traced as ``lightning-hybrid dry-run --ranks 0``
traces it (fake process group, fake tensors, 3 micro-batches of 32,768 tokens with packed documents), each variant
in a fresh process, one after the other; the CPU seconds (user + system) of the trace itself (``run_rank``), not of
starting Python, and the CPU seconds inside ``rotary_at`` (the tables). Variants: this code; this code with the
rotary tables per layer, or the projections unfused; and with ``--before PATH``, the code of a checkout from before
the change (for example ``git archive bf4997d | tar -x -C /tmp/before``) run the same way. Each variant is traced
``--repeats`` times, the variants interleaved, and the median is reported (a shared machine's load moves a single
trace by 10-20%).

**GEMMs** (``--gemm``, one process): at the per-rank rows of Qwen2.5-72B at tp=8 (q/k/v 1,024 + 128 + 128, gate/up
3,696 + 3,696), the median seconds of ``torch.cat`` of the parts' weights, of the fused projection forward and
backward (``fused_linear``: the concatenation in both) and of the parts' separate GEMMs forward and backward. On a
GPU (``--device cuda``: bf16, width 8,192, 4,096 tokens; ``benchmarks/gpu_smoke.sh``'s ``fused`` step) this is the
GEMM efficiency the fusion is for; on CPU (fp32, the width cut to 1,024, 512 tokens) it shows the copy's share.

    python benchmarks/fused_projections.py                     # some minutes on a 2-core machine
    python benchmarks/fused_projections.py --dry-run --before /tmp/before
    python benchmarks/fused_projections.py --gemm                 # --device cuda on a GPU

It prints Markdown tables. A measurement script, not a test; CPU step times say little about a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "recipes" / "qwen2.5-72b-sft.yaml"
MODELS = {
    "tiny": ("tiny", 128, 8),
    "width256": (dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                       name="width-256"), 256, 4),
}
# comparison -> (variant "on", variant "off", packed documents)
PAIRS = {
    "fused vs unfused projections": ({"fused": True}, {"fused": False}, False),
    "rotary once vs per layer": ({"rotary_once": True}, {"rotary_once": False}, False),
    "rotary once vs per layer, packed documents": ({"rotary_once": True}, {"rotary_once": False}, True),
}


def variant_module(model: Any, fused: bool = True, rotary_once: bool = True) -> Any:
    """A ``CausalLM`` whose decoder runs its projections unfused and/or makes the rotary tables in every layer (the
    model's ``qkv``/``gate_up`` and ``rotary`` set to ``None``: the code paths of before the change)."""
    from lightning_hybrid.models import CausalLM

    class Variant(CausalLM):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            if not rotary_once:
                self.model.rotary = None
            if not fused:
                for block in self.model.layers.values():
                    block.self_attn.qkv = None
                    block.mlp.gate_up = None

    return Variant(model, lr=1e-4)


def _step_times(variant: dict, model: str, sequence_parallel: bool, documents: bool, steps: int,
                warmup: int) -> list[float]:
    """Intervals between optimizer-step ends on this rank of a ``Trainer.fit`` at tp2 x dp2."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_hybrid import HybridParallelStrategy

    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            ends.append(time.perf_counter())

    L.seed_everything(1234, verbose=False)
    spec, seq_len, rows = MODELS[model]
    module = variant_module(spec, **variant)
    vocab = module.config.vocab_size
    count = rows * 2 * (steps + warmup + 1)
    ids = torch.randint(0, vocab, (count, seq_len + 1), generator=torch.Generator().manual_seed(0))
    # documents of seq_len / 4 tokens, positions restarting at each (the packed rows of an SFT set)
    positions = torch.arange(seq_len) % (seq_len // 4)
    items = [{"input_ids": r[:-1], "labels": r[1:], **({"position_ids": positions} if documents else {})}
             for r in ids]
    trainer = L.Trainer(accelerator="cpu", devices=4, precision="32-true", max_steps=steps + warmup + 1,
                        strategy=HybridParallelStrategy(tp=2, data_parallel="fsdp", loss_parallel=False,
                                                        sequence_parallel=sequence_parallel),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=rows))
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def worker(out: Path, steps: int, warmup: int, rounds: int, model: str, sequence_parallel: bool, pair: str) -> None:
    """One torchrun process: both sides of one pair, alternating; rank 0 writes the medians as JSON.

    One launch per pair: every ``Trainer.fit`` builds its mesh's process groups anew and nothing destroys them (gloo
    keeps ~24 threads per process for each fit), so one launch for all pairs ended with over 1,000 threads per
    process."""
    on, off, documents = PAIRS[pair]
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        order = (("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on))
        for label, variant in order:
            times[label].append(statistics.median(
                _step_times(variant, model, sequence_parallel, documents, steps, warmup)))
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps({"model": model, "sp": sequence_parallel, "pair": pair,
                                   "on": statistics.median(times["on"]), "off": statistics.median(times["off"])}))


def step_table(rows: list[dict]) -> str:
    lines = ["| comparison (on vs off) | model | layout | step on (s) | step off (s) | on / off |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        layout = "tp2 x dp2" + (" + SP" if r["sp"] else "")
        lines.append(f"| {r['pair']} | {r['model']} | {layout} | {r['on']:.4f} | {r['off']:.4f} | "
                     f"{r['on'] / r['off']:.3f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ dry run

_TRACE = """
import json, sys, time
from lightning_hybrid.dryrun.rank import run_rank
from lightning_hybrid.dryrun.recipe import load_job
from lightning_hybrid.dryrun.cli import traced_microbatches, _check
from lightning_hybrid.models.decoder import model as decoder_model, rope
variant = json.loads(sys.argv[2])
if variant.get("fused") is False or variant.get("rotary_once") is False:
    from lightning_hybrid.models import causal_lm
    plain = causal_lm.CausalLM.configure_model
    def configure_model(self):
        built = self.model is None
        plain(self)
        if built and variant.get("rotary_once") is False:
            self.model.rotary = None
        if built and variant.get("fused") is False:
            for block in self.model.layers.values():
                block.self_attn.qkv = None
                block.mlp.gate_up = None
    causal_lm.CausalLM.configure_model = configure_model
rotary = {"calls": 0, "cpu_s": 0.0}
def counted(*args, _inner=rope.rotary_at, **kwargs):
    start = time.process_time()
    try:
        return _inner(*args, **kwargs)
    finally:
        rotary["calls"] += 1
        rotary["cpu_s"] += time.process_time() - start
rope.rotary_at = decoder_model.rotary_at = counted
job = load_job(sys.argv[1])
options, dims, _, _ = _check(job)
job = job.with_microbatches(traced_microbatches(options, dims))
cpu = time.process_time()
result = run_rank(job, 0)
print(json.dumps({"cpu_s": time.process_time() - cpu, "total_peak": result.total_peak,
                  "activation_peak": result.activation_peak, "rotary_calls": rotary["calls"],
                  "rotary_cpu_s": rotary["cpu_s"]}))
"""


def trace_rank0(tree: Path, variant: dict) -> dict:
    """CPU seconds of rank 0's trace of the SFT recipe with the code of ``tree``, in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _TRACE, str(SFT), json.dumps(variant)], env=env, cwd=tree,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"dry run of rank 0 failed with {tree}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def dry_run_table(before: Path | None, repeats: int) -> str:
    """The variants traced ``repeats`` times each, interleaved (variant 1..n, then again), medians of CPU seconds."""
    runs = [("after: fused projections, rotary tables once", ROOT, {}),
            ("after, rotary tables per layer", ROOT, {"rotary_once": False}),
            ("after, projections unfused", ROOT, {"fused": False})]
    if before is not None:
        runs.insert(0, (f"before ({before})", before, {}))
    results: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    for _ in range(repeats):
        for label, tree, variant in runs:
            results[label].append(trace_rank0(tree, variant))
    base = statistics.median(r["cpu_s"] for r in results[runs[0][0]])
    lines = [f"Rank 0 of {SFT.name} (dry run, 3 micro-batches traced): CPU seconds of the trace, median of "
             f"{repeats} (each run)", "",
             "| code | CPU s | / first row | CPU s of each run | in rotary_at: calls, CPU s | traced total peak (GB) "
             "| activation peak (GB) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, rs in results.items():
        cpu = statistics.median(r["cpu_s"] for r in rs)
        rot = statistics.median(r["rotary_cpu_s"] for r in rs)
        each = ", ".join(f"{r['cpu_s']:.1f}" for r in rs)
        lines.append(f"| {label} | {cpu:.1f} | {cpu / base:.3f} | {each} | "
                     f"{rs[0]['rotary_calls']}, {rot:.2f} | {rs[0]['total_peak'] / 1e9:.2f} | "
                     f"{rs[0]['activation_peak'] / 1e9:.2f} |")
    return "\n".join(lines)


def gemm_table(device: str, width: int, tokens: int, repeats: int = 7) -> str:
    """Seconds of the weights' concatenation, the fused projection (concatenation and one GEMM, forward and
    backward) and the separate GEMMs (forward and backward), at the per-rank rows of Qwen2.5-72B at tp=8."""
    import torch
    import torch.nn.functional as F

    from lightning_hybrid.models.fused import fused_linear

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    groups = {"q/k/v": (1024, 128, 128), "gate/up": (3696, 3696)}
    lines = [f"Per-rank rows of Qwen2.5-72B at tp=8, input width {width} (of 8,192), {tokens} tokens, {dtype}, "
             f"{device}: median seconds of {repeats} (forward and backward)", "",
             "| group | cat of the weights | fused (cat + 1 GEMM) | separate GEMMs | cat / fused | fused / separate |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, rows in groups.items():
        weights = [torch.randn(r, width, device=device, dtype=dtype, requires_grad=True) for r in rows]
        x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
        grads = [torch.randn(tokens, r, device=device, dtype=dtype) for r in rows]

        def median(fn) -> float:
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - start)
            return statistics.median(times[1:])

        def backward(outs: list) -> None:
            torch.autograd.backward(outs, grads)

        with torch.no_grad():
            cat = median(lambda: torch.cat(weights))
        fused = median(lambda: backward(fused_linear(x, weights)))
        separate = median(lambda: backward([F.linear(x, w) for w in weights]))
        lines.append(f"| {name} | {cat:.5f} | {fused:.5f} | {separate:.5f} | {cat / fused:.3f} | "
                     f"{fused / separate:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side of a pair, alternating the order")
    parser.add_argument("--models", default=",".join(MODELS), help=f"some of: {', '.join(MODELS)}")
    parser.add_argument("--dry-run", action="store_true", help="the dry run's CPU time of rank 0 instead")
    parser.add_argument("--before", type=Path, default=None, help="a checkout of the code before, for --dry-run")
    parser.add_argument("--repeats", type=int, default=3, help="traces of each variant for --dry-run, interleaved")
    parser.add_argument("--gemm", action="store_true",
                        help="the fused projection's GEMMs and weight copy against separate GEMMs (72B tp=8 rows)")
    parser.add_argument("--device", default="cpu", help="for --gemm: cpu or cuda")
    parser.add_argument("--width", type=int, default=None, help="for --gemm: input width (cpu 1024, cuda 8192)")
    parser.add_argument("--tokens", type=int, default=None, help="for --gemm: tokens (cpu 512, cuda 4096)")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # a worker's model, sp (0/1), pair index
    args = parser.parse_args()
    if args.gemm:
        cuda = args.device == "cuda"
        print(gemm_table(args.device, args.width or (8192 if cuda else 1024), args.tokens or (4096 if cuda else 512)))
        return
    if args.dry_run:
        print(dry_run_table(args.before, args.repeats))
        return
    if args.worker_out:
        model, sp, pair = args.cell.split(",")
        return worker(Path(args.worker_out), args.steps, args.warmup, args.rounds, model, sp == "1",
                      list(PAIRS)[int(pair)])
    from runtime import run_workers  # benchmarks/runtime.py, beside this script

    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    cells = [f"{model},{sp},{pair}" for model in args.models.split(",") for sp in (0, 1) for pair in range(len(PAIRS))]
    print(step_table([run_workers(__file__, [*common, "--cell", cell]) for cell in cells]))


if __name__ == "__main__":
    sys.exit(main())
