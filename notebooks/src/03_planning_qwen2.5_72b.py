# %% [markdown]
# # Planning Qwen2.5-72B: which layout fits, and how fast it will be
#
# Before spending GPU hours, `lightning-hybrid plan` predicts for every (tp, pp, dp, data-parallel mode,
# micro-batching, schedule, recompute) the memory of the fullest GPU and the time of one optimizer step. This
# notebook calls the same functions (`lightning_hybrid.planner.search`) to
#
# 1. rank the layouts for **128 B300** at sequence 4096 with a 4M-token batch, and explain why the simplest
#    layout does or does not fit;
# 2. break the memory of a few layouts down into weights, gradients, optimizer states and activations;
# 3. compare MFU across layouts, and the recipe's layout (tp=8, pp=2, dp=8, FSDP) with the best one;
# 4. plan smaller clusters and H100s;
# 5. pick the checkpoint interval (Young/Daly) for the recipe.
#
# The parameter, gradient and optimizer bytes are exact (counted tensor by tensor with the strategy's sharding
# rules and tested against real allocations); activations follow Korthikanti et al. (2022); step times are a
# closed-form model of GEMMs (each at an efficiency that depends on its per-GPU shape), attention, elementwise ops,
# recompute and communication, held against published Llama 3, torchtitan and Megatron-Core runs (the last section
# shows the table). It all takes a few seconds on a CPU.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook check, irrelevant here

import matplotlib.pyplot as plt  # noqa: E402

from lightning_hybrid.hardware import GPUS
from lightning_hybrid.models import Qwen2Config
from lightning_hybrid.planner.cli import assumptions, explain_time, format_table
from lightning_hybrid.planner.interval import checkpoint_plan
from lightning_hybrid.planner.search import Layout, Problem, estimate, explain, search
from lightning_hybrid.planner.step_time import Hardware

MODEL = Qwen2Config.from_preset("qwen2.5-72b")
SEQ, BATCH = 4096, 1024  # 1,024 sequences x 4,096 tokens = 4.19M tokens per step


def problem(gpu: str = "b300", gpus: int = 128, precision: str = "bf16-mixed") -> Problem:
    return Problem(MODEL, Hardware(GPUS[gpu], gpus, 8), SEQ, BATCH, precision)


p128 = problem()
feasible, infeasible = search(p128)
print(f"{MODEL.name}: {MODEL.num_parameters() / 1e9:.2f}B parameters; {len(feasible)} layouts fit on 128 x B300")
print(format_table(feasible[:10]))

# %% [markdown]
# Columns: memory in GB of the fullest GPU (`wts`, `grad`, `opt`, activations `act`, `other` = working buffers,
# FSDP gathers and autocast copies) against what is usable (288 GB minus CUDA context and NCCL buffers, minus
# fragmentation); step time in seconds split into compute, recompute, exposed TP communication, pipeline bubble and
# DP communication; MFU and tokens/s of the whole job. Where the best layout's time goes (`plan --explain`):

# %%
print("\n".join(explain_time(feasible[0])))

# %% [markdown]
# The GEMMs run at the efficiency their per-GPU shape allows (`d/(d + 664)` of 0.652 of peak, `d` the smallest
# dimension: TP=4 leaves 2048-wide q/o and 7392-wide MLP matmuls); this project's eager model also spends about an
# eighth of the step in elementwise ops (fp32 norms, rotary, SiLU, casts), which `torch.compile` would fuse.
#
# Why not the plainest layouts? `explain` answers for a given mesh:

# %%
for tp, pp, mode in ((8, 1, "replicate"), (8, 1, "fsdp"), (8, 2, "replicate"), (8, 2, "fsdp")):
    print(explain(p128, tp, pp, mode)["text"], end="\n\n")

# %% [markdown]
# ## Memory, layout by layout
#
# Each bar is one layout at 1 sequence per micro-batch; the lines are the usable memory of a B300 and of an H100.
# Replication keeps full copies of the stage's fp32 weights, gradients and AdamW states on every data-parallel
# rank; FSDP divides them by dp. Recompute trades activations for time.

# %%
def layout(tp: int, pp: int, mode: str, recompute: str = "none", sp: bool = True) -> Layout:
    dp = 128 // (tp * pp)
    m = BATCH // dp
    return Layout(tp, pp, dp, mode, 1, m, "1f1b" if pp > 1 else "none", 1, recompute, sp and tp > 1)


candidates = {
    "tp8 pp1\nreplicate": layout(8, 1, "replicate"),
    "tp8 pp1\nfsdp": layout(8, 1, "fsdp"),
    "tp8 pp2\nreplicate": layout(8, 2, "replicate"),
    "tp8 pp2 fsdp\nselective (recipe)": layout(8, 2, "fsdp", "selective"),
    "tp8 pp2 fsdp\nfull recompute": layout(8, 2, "fsdp", "full"),
    "tp4 pp4\nfsdp": layout(4, 4, "fsdp"),
    "tp2 pp4\nfsdp": layout(2, 4, "fsdp"),
}
parts = ["weights", "gradients", "optimizer", "activations", "working", "fsdp_buffers", "autocast_copies"]
estimates = {name: estimate(p128, lay) for name, lay in candidates.items()}
fig, ax = plt.subplots(figsize=(13, 5))
bottom = [0.0] * len(estimates)
for part in parts:
    values = [e.memory[part] / 1e9 for e in estimates.values()]
    ax.bar(list(estimates), values, bottom=bottom, label=part)
    bottom = [b + v for b, v in zip(bottom, values)]
ax.axhline(Hardware(GPUS["b300"], 128, 8).usable_bytes / 1e9, color="black", ls="--", label="usable on B300")
ax.axhline(Hardware(GPUS["h100"], 128, 8).usable_bytes / 1e9, color="gray", ls=":", label="usable on H100 80 GB")
for i, e in enumerate(estimates.values()):
    ax.text(i, bottom[i] + 3, f"{bottom[i]:.0f} GB", ha="center", fontsize=8)
ax.set_ylabel("GB on the fullest GPU")
ax.set_title("Qwen2.5-72B, 128 GPUs, seq 4096, bf16-mixed AdamW: memory per GPU by layout")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The recipe's layout built for real: the dry run against the planner
#
# `lightning-hybrid dry-run` plays ranks of the 128-GPU job on one CPU: torch's fake process group stands in for
# the other 127 processes and fake tensors for the weights, so the strategy's own code builds the rank (mesh, stage
# split, TP plan, recompute, FSDP2, precision, AdamW) and runs one training step through the 1F1B schedule, while
# torch's MemTracker counts every byte. One rank per pipeline stage stands for all 64 ranks of that stage (identical
# by construction, see `lightning-hybrid dry-run --help`). The traced step takes minutes, so this cell reads the
# report the command wrote:
#
#     lightning-hybrid dry-run --config recipes/qwen2.5-72b-pretrain.yaml --ranks all --json \
#         > notebooks/data/dryrun-qwen2.5-72b-pretrain.json
#
# Left bar of each pair: what the traced rank held at its peak; right bar: the planner's prediction for that rank.

# %%
import json
from pathlib import Path

report_file = Path("data/dryrun-qwen2.5-72b-pretrain.json")
report = json.loads(report_file.read_text())
kinds = ["parameters", "gradients", "optimizer", "activations"]
fig, ax = plt.subplots(figsize=(9, 4.5))
for i, role in enumerate(report["roles"]):
    for j, (source, color) in enumerate((("traced", "tab:blue"), ("planner", "tab:orange"))):
        figures = role[source]
        bottom = 0.0
        for k, kind in enumerate(kinds + ["rest"]):
            value = (figures["total"] - sum(figures[x] for x in kinds)) if kind == "rest" else figures[kind]
            value = max(value, 0.0) / 1e9
            ax.bar(2.5 * i + j, value, bottom=bottom, color=plt.cm.tab10(k), edgecolor=color, linewidth=2,
                   label=kind if i == 0 and j == 0 else None)
            bottom += value
        ax.text(2.5 * i + j, bottom + 1, f"{source}\n{bottom:.0f} GB", ha="center", fontsize=8)
ax.set_xticks([2.5 * i + 0.5 for i in range(len(report["roles"]))],
              [f"stage {r['coordinates']['pp']} ({len(r['ranks'])} ranks)" for r in report["roles"]])
ax.axhline(report["usable_bytes"] / 1e9, color="black", ls="--", label=f"usable on {report['gpu'].upper()}")
ax.set_ylabel("GB per GPU")
ax.set_title("Qwen2.5-72B recipe: dry run (traced) vs planner, per pipeline stage")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()
for role in report["roles"]:
    ratios = ", ".join(f"{k} {v:.3f}" for k, v in role["ratio"].items() if v is not None)
    print(f"stage {role['coordinates']['pp']}: traced / planner: {ratios}")

# %% [markdown]
# ## MFU and step time across layouts
#
# The 15 fastest layouts that fit, and where the recipe's layout ranks. The stacked bars show where a step's time
# goes; MFU is model FLOPs (6N + 12 L h s per token) over the job's peak.

# %%
recipe = estimate(p128, layout(8, 2, "fsdp", "selective"))
top = feasible[:15]
labels = [f"tp{e.layout.tp} pp{e.layout.pp} dp{e.layout.dp}\n{e.layout.data_parallel} "
          f"{e.layout.schedule.replace('interleaved_1f1b', 'il')}"
          f"{'' if e.layout.virtual_stages == 1 else f' v{e.layout.virtual_stages}'}"
          f"\n{e.layout.recompute}" for e in top] + ["recipe\ntp8 pp2 dp8\nfsdp 1f1b\nselective"]
rows = top + [recipe]
fig, (ax_time, ax_mfu) = plt.subplots(2, 1, figsize=(15, 8), sharex=True)
bottom = [0.0] * len(rows)
for part in ("compute", "tp_comm", "pp_bubble", "dp_comm", "optimizer"):
    values = [e.time[part] for e in rows]
    ax_time.bar(range(len(rows)), values, bottom=bottom, label=part)
    bottom = [b + v for b, v in zip(bottom, values)]
ax_time.set_ylabel("seconds per step")
ax_time.legend(ncol=5, fontsize=8)
ax_time.set_title("predicted step time and MFU, 128 x B300, 4.19M tokens per step")
ax_mfu.bar(range(len(rows)), [100 * e.mfu for e in rows], color=["tab:blue"] * len(top) + ["tab:red"])
ax_mfu.set_ylabel("MFU (%)")
ax_mfu.set_xticks(range(len(rows)), labels, fontsize=7)
fig.tight_layout()
plt.show()
rank = 1 + sum(e.time["step"] < recipe.time["step"] for e in feasible)
print(f"recipe layout: {recipe.layout.describe()}: {recipe.memory['total'] / 1e9:.0f} GB, step "
      f"{recipe.time['step']:.1f} s, MFU {recipe.mfu:.1%}, {recipe.tokens_per_second:,.0f} tokens/s; "
      f"rank {rank} of {len(feasible)}, {recipe.time['step'] / feasible[0].time['step'] - 1:.0%} slower than the best")
print("\n".join(explain_time(recipe)))

# %% [markdown]
# The planner's fastest layouts use less tensor parallelism (tp=1 with HSDP inside a node and no pipeline, or tp=2
# with an interleaved one) than the recipe: at tp=8 every GPU's matmuls are 1024 wide (0.49 of peak instead of 0.56
# at tp=4) and the 8-way activation all-reduces, which torch's tensor parallelism runs on the compute stream, cost a
# sixth of the step. The fastest layouts lie within a few percent of each other, about the model's error, so they are
# worth a measured trial rather than a blind switch. The recipe keeps the reference layout of the design: TP on
# NVLink inside each node, a two-stage pipeline, the least traffic between nodes, and the memory headroom to run
# unchanged on H100s (see the next section). To try the planner's first layout:
# `lightning-hybrid plan --model qwen2.5-72b --gpus 128 --gpu b300 --explain` (it explains the first), then
# `--trainer.strategy.tp 1 --trainer.strategy.pp 1 --trainer.strategy.dp 128 --trainer.strategy.data_parallel hsdp
# --trainer.strategy.dp_shard 8 --trainer.strategy.sequence_parallel false --data.init_args.batch_size 1
# --trainer.accumulate_grad_batches 8` on the command line.
#
# ## Smaller clusters and other GPUs
#
# The same model and batch on fewer B300s, and on 128 H100 80 GB: the best layout, its memory and its speed.

# %%
clusters = [("b300", 128), ("b300", 64), ("b300", 32), ("b300", 16), ("h200", 128), ("h100", 128), ("h100", 64)]
summary = []
for gpu, gpus in clusters:
    found, _ = search(problem(gpu, gpus))
    best = found[0] if found else None
    summary.append((f"{gpus} x {gpu.upper()}", best, len(found)))
    if best is None:
        print(f"{gpus:4d} x {gpu}: nothing fits")
    else:
        print(f"{gpus:4d} x {gpu}: {len(found):3d} layouts fit; best {best.layout.describe()}: "
              f"{best.memory['total'] / 1e9:.0f} GB, {best.time['step']:.1f} s/step, MFU {best.mfu:.1%}, "
              f"{best.tokens_per_second / 1e3:.0f}k tokens/s, {100e9 / best.tokens_per_second / 86400:.1f} days "
              f"per 100B tokens")
on_h100 = estimate(problem("h100"), layout(8, 2, "fsdp", "selective"))
print(f"\nthe recipe's layout on 128 x H100: {on_h100.memory['total'] / 1e9:.0f} of "
      f"{on_h100.usable / 1e9:.0f} GB usable "
      f"({'fits' if on_h100.fits else 'does not fit'}), {on_h100.time['step']:.1f} s/step, MFU {on_h100.mfu:.1%}")
names = [s[0] for s in summary if s[1] is not None]
fig, (ax_tps, ax_mfu) = plt.subplots(1, 2, figsize=(13, 4))
ax_tps.bar(names, [s[1].tokens_per_second / 1e3 for s in summary if s[1] is not None], color="tab:green")
ax_tps.set_ylabel("thousand tokens / s (job)")
ax_tps.set_title("throughput of the best layout")
ax_mfu.bar(names, [100 * s[1].mfu for s in summary if s[1] is not None], color="tab:purple")
ax_mfu.set_ylabel("MFU (%)")
ax_mfu.set_title("MFU of the best layout")
for ax in (ax_tps, ax_mfu):
    ax.tick_params(axis="x", rotation=30)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## How often to checkpoint
#
# A save blocks training for `save` seconds; a failure loses on average half an interval plus the restart. Young's
# interval `sqrt(2 x save x MTBF)` (with Daly's refinement) minimizes the sum. The defaults: the job's shards
# written at 1 GB/s per GPU, and the Llama 3 paper's failure rate (419 interruptions in 54 days on 16,384 GPUs, about
# one per 50,000 GPU-hours), so 128 GPUs see one every ~390 hours.

# %%
plan = checkpoint_plan(recipe.checkpoint_bytes, 128, recipe.time["step"])
print(f"save {plan['save_seconds']:.1f} s, job MTBF {plan['mtbf_hours']:.0f} h -> checkpoint every "
      f"{plan['interval_seconds'] / 60:.0f} min (~{plan['interval_steps']} steps); "
      f"time lost {plan['lost_fraction']:.2%}")
minutes = [m for m in range(5, 400, 5)]
lost = [plan["save_seconds"] / (60 * m) + (60 * m / 2 + plan["restart_seconds"]) / (3600 * plan["mtbf_hours"])
        for m in minutes]
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.plot(minutes, [100 * x for x in lost])
ax.axvline(plan["interval_seconds"] / 60, color="tab:red", ls="--", label="Young/Daly interval")
ax.axvline(70, color="tab:green", ls=":", label="recipe: every_n_minutes=70")
ax.set_xlabel("checkpoint interval (minutes)")
ax.set_ylabel("expected time lost (%)")
ax.set_title("checkpoints + failures, 128 GPUs, tp8 pp2 dp8 fsdp")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The curve is flat near its minimum: anything from half to twice the Young/Daly interval loses a fraction of a
# percent, which is why the recipe rounds it to 70 minutes. `FaultTolerantCheckpoint(mtbf_hours=...)` logs the
# interval again from the save time it actually measures.
#
# ## How far to trust the step times
#
# The time model is held against published training runs: Llama 3 405B on 8,192 and 16,384 H100s, torchtitan's
# Llama 3 8B and 70B runs, Megatron-Core's 1.7B-70B weak-scaling table. For each, the planner gets the model's shape,
# the cluster, the layout, the sequence length, the batch and the precision as the source states them, and
# predicts the throughput (`benchmarks/planner_published.py`, which also refits the three fitted constants and
# prints the leave-one-out errors; `tests/test_planner_published.py` asserts the median error is at most 10% and
# no row is off by more than 20%).

# %%
import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

spec = importlib.util.spec_from_file_location("planner_published", Path("..") / "benchmarks" / "planner_published.py")
published = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = published
spec.loader.exec_module(published)
rows = published.table()
print(published.format_table(rows))
s = published.summary(rows)
print(f"median |error| {s['median_abs_error']:.1%}, largest {s['max_abs_error']:.1%} over {s['rows']} runs")

# %% [markdown]
# Every figure above rests on these assumptions (also printed by `lightning-hybrid plan`):

# %%
for line in assumptions(p128):
    print("-", line)
