# %% [markdown]
# # Tensor x pipeline x data parallelism, explained with the reference job
#
# The reference job trains Qwen2.5-72B on **128 GPUs = 16 nodes x 8**: **tp=8** inside each node, **pp=2**,
# **dp=8** (`recipes/qwen2.5-72b-pretrain.yaml`). This notebook shows
#
# 1. which ranks share a tensor-parallel, a pipeline and a data-parallel group, drawn from the mesh the strategy
#    builds (`lightning_hybrid.distributed.parallel_dims.ParallelDims`);
# 2. how the 80 blocks of Qwen2.5-72B are cut into pipeline stages
#    (`lightning_hybrid.distributed.pipeline.split.plan_stages` on the costs the model declares in
#    `CausalLM("qwen2.5-72b").parallel_spec()`);
# 3. what the GPipe, 1F1B and interleaved 1F1B schedules do with those stages, as Gantt charts built from the
#    measured forward and backward times of the tiny model's stages, and how big the pipeline bubble is.
#
# Everything runs on one CPU process in well under a minute.

# %%
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook check, irrelevant here

import matplotlib.pyplot as plt  # noqa: E402 - after the warning filter
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.pipeline.schedules import theoretical_bubble
from lightning_hybrid.distributed.pipeline.split import build_stages, plan_stages
from lightning_hybrid.models import CausalLM, Qwen2, Qwen2Config

NODES, GPUS_PER_NODE = 16, 8
dims = ParallelDims.resolve(tp=8, pp=2, dp=None, world_size=NODES * GPUS_PER_NODE, devices_per_node=GPUS_PER_NODE)
print(dims)
for rank in (0, 1, 7, 8, 63, 64, 127):
    print(f"rank {rank:3d} (node {rank // GPUS_PER_NODE:2d}, GPU {rank % GPUS_PER_NODE}): {dims.coordinates(rank)}")

# %% [markdown]
# ## 1. The mesh: 128 ranks as `("pp", "dp", "tp")`
#
# Global rank `r = (pp_rank * dp + dp_rank) * tp + tp_rank`: TP is the fastest-varying coordinate, so the 8 ranks of
# a TP group are the 8 GPUs of one node, and the per-layer all-reduces of tensor parallelism (the heaviest
# traffic, several per block and micro-batch) stay on NVLink. DP comes next: the 8 ranks of a DP group are the
# same GPU slot on 8 different nodes and exchange gradients once per step over InfiniBand. PP is outermost:
# nodes 0-7 run stage 0 and nodes 8-15 stage 1, and a pipeline pair only sends activations to its neighbour.

# %%
world = dims.world_size
coords = [dims.coordinates(r) for r in range(world)]


def group(rank: int, dim: str) -> list[int]:
    """Global ranks that differ from ``rank`` only in coordinate ``dim``: its process group along ``dim``."""
    mine = coords[rank]
    return [r for r in range(world) if all(coords[r][d] == mine[d] for d in ("pp", "dp", "tp") if d != dim)]


node_of = lambda r: r // GPUS_PER_NODE  # noqa: E731 - torchrun hands each node consecutive ranks
tp_inside_nodes = all(len({node_of(m) for m in group(r, "tp")}) == 1 for r in range(world))
print("every TP group inside one node:", tp_inside_nodes)
print("DP group of rank 0:", group(0, "dp"), "-> nodes", sorted({node_of(m) for m in group(0, "dp")}))
print("PP group of rank 0:", group(0, "pp"), "-> nodes", sorted({node_of(m) for m in group(0, "pp")}))

fig, ax = plt.subplots(figsize=(11, 13))
stage_colors = {0: "#cfe3f5", 1: "#fbe0c4"}
for r in range(world):
    node, gpu, c = node_of(r), r % GPUS_PER_NODE, coords[r]
    ax.add_patch(Rectangle((gpu, -node - 1), 0.92, 0.88, color=stage_colors[c["pp"]]))
    ax.text(gpu + 0.46, -node - 0.45, f"r{r}\ntp{c['tp']} dp{c['dp']}", ha="center", va="center", fontsize=7)
for node in range(NODES):  # each node is one TP group
    ax.add_patch(Rectangle((-0.06, -node - 1.05), 8.04, 0.98, fill=False, lw=1.6, ec="tab:green"))
    ax.text(-0.3, -node - 0.55, f"node {node}", ha="right", va="center", fontsize=8)
dp0 = group(0, "dp")  # one DP group: GPU 0 of nodes 0-7
ax.plot([0.46] * len(dp0), [-node_of(m) - 0.12 for m in dp0], "-", color="tab:purple", lw=3, alpha=0.6)
ax.add_patch(FancyArrowPatch((3.46, -0.95), (3.46, -8.1), arrowstyle="<->", mutation_scale=14, color="tab:red",
                             lw=2))  # one PP pair: rank 3 and rank 67
ax.set_xlim(-1.6, 8.2)
ax.set_ylim(-NODES - 0.3, 0.6)
ax.axis("off")
ax.set_title("Qwen2.5-72B on 16 nodes x 8 GPUs: tp=8, pp=2, dp=8", fontsize=12)
handles = [Rectangle((0, 0), 1, 1, color=stage_colors[0]), Rectangle((0, 0), 1, 1, color=stage_colors[1]),
           Rectangle((0, 0), 1, 1, fill=False, ec="tab:green", lw=1.6),
           plt.Line2D([], [], color="tab:purple", lw=3, alpha=0.6), plt.Line2D([], [], color="tab:red", lw=2)]
ax.legend(handles, ["pipeline stage 0 (blocks 0-39 + embedding)", "pipeline stage 1 (blocks 40-79 + head)",
                    "TP group (NVLink inside the node)", "a DP group (ranks 0, 8, ..., 56)",
                    "a PP pair (ranks 3 and 67)"], loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2)
plt.show()

# %% [markdown]
# ## 2. The stage split of Qwen2.5-72B
#
# The model declares its parts and their relative costs (`parallel_spec()`: one block = 1; the embedding lookup is
# cheap; the final norm, the 152,064-word head and the loss cost about 1.4 blocks). `plan_stages` cuts the 80 blocks
# into contiguous stages that minimize the most expensive stage, the one that sets the pipeline's pace.

# %%
module = CausalLM("qwen2.5-72b")
spec = module.parallel_spec()
config = module.config
print(f"block cost 1, embedding {spec.embedding_cost:.2f}, norm + head + loss {spec.head_cost:.2f}")
block_params = config.block_parameters()
head_params = config.hidden_size * config.vocab_size


def stage_parameters(plan) -> float:
    params = plan.num_blocks * block_params
    params += head_params if plan.has_embedding else 0
    params += head_params + config.hidden_size if plan.has_head else 0
    return params / 1e9


splits = {"2 stages: pp=2 (the recipe)": plan_stages(spec, module.num_blocks(), 2),
          "4 stages: pp=4, or pp=2 x 2 virtual": plan_stages(spec, module.num_blocks(), 4),
          "8 stages: pp=8, or pp=4 x 2 virtual": plan_stages(spec, module.num_blocks(), 8)}
fig, axes = plt.subplots(1, len(splits), figsize=(15, 3.8))
for ax, (name, plans) in zip(axes, splits.items()):
    blocks = [p.num_blocks for p in plans]
    ends = [p.cost - p.num_blocks for p in plans]
    x = range(len(plans))
    ax.bar(x, blocks, color="tab:blue", label="blocks")
    ax.bar(x, ends, bottom=blocks, color="tab:orange", label="embedding / head + loss")
    for p in plans:
        ax.text(p.index, p.cost + 0.5, f"{p.first_block}-{p.last_block - 1}\n{stage_parameters(p):.1f}B",
                ha="center", fontsize=8)
    ax.set_title(name, fontsize=10)
    ax.set_ylim(0, 1.25 * max(p.cost for p in plans))
    ax.set_xlabel("stage")
    ax.set_xticks(list(x))
axes[0].set_ylabel("cost (blocks)")
axes[0].legend(loc="lower left", fontsize=8)
fig.suptitle("Qwen2.5-72B stage split: blocks per stage and parameters (labels: block range, parameters)")
fig.tight_layout()
plt.show()
for p in splits["2 stages: pp=2 (the recipe)"]:
    print(f"stage {p.index}: blocks {p.first_block}-{p.last_block - 1}, cost {p.cost:.2f}, "
          f"{stage_parameters(p):.2f}B parameters")

# %% [markdown]
# With the recipe's split each stage holds ~36B parameters; tensor parallelism divides that by 8 and FSDP over the
# 8 data-parallel ranks by 8 again, so each GPU stores ~0.57B parameters (plus their gradients and AdamW states).
# With 2 virtual stages per rank (interleaved 1F1B) rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
#
# ## 3. Pipeline schedules, from measured stage times
#
# Next, the real cost of a stage: the tiny model cut into 4 chunks of one block (the first with the embedding, the
# last with the norm, the head and the loss), a micro-batch of 2 sequences x 128 tokens as in the quickstart run,
# forward and backward of each chunk timed on this CPU with one thread (the median of 30 runs). The two stages of
# GPipe and 1F1B are chunks 0-1 and 2-3, so their times are sums of the same measurements.

# %%
torch.manual_seed(0)
torch.set_num_threads(1)
tiny = Qwen2(Qwen2Config.from_preset("tiny"))
tiny_spec = tiny.parallel_spec()
ids = torch.randint(0, 256, (2, 128))
labels = torch.randint(0, 256, (2, 128))


def time_stages(num_stages: int, repeats: int = 30) -> dict[tuple[str, int], float]:
    """Median forward and backward seconds of each stage of the tiny model cut into ``num_stages``."""
    plans = plan_stages(tiny_spec, 4, num_stages)
    _, stages = build_stages(tiny, tiny_spec, plans, list(range(num_stages)))
    with torch.no_grad():  # the activations each stage receives
        inputs = [ids]
        for stage in stages[:-1]:
            inputs.append(stage(inputs[-1]))
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for s, stage in enumerate(stages):
            x = inputs[s] if s == 0 else inputs[s].clone().requires_grad_(True)
            start = time.perf_counter()
            out = stage(x)
            forward = time.perf_counter() - start
            start = time.perf_counter()
            if s == num_stages - 1:
                total, count = tiny.loss_sum(out, labels)
                (total / count).backward()
            else:
                out.backward(torch.ones_like(out))
            backward = time.perf_counter() - start
            times.setdefault(("F", s), []).append(forward)
            times.setdefault(("B", s), []).append(backward)
    return {key: statistics.median(values) for key, values in times.items()}


four_chunks = time_stages(4)
two_stages = {(op, s): four_chunks[(op, 2 * s)] + four_chunks[(op, 2 * s + 1)] for op in "FB" for s in range(2)}
for name, t in (("4 chunks", four_chunks), ("2 stages", two_stages)):
    ordered = sorted(t.items(), key=lambda kv: kv[0][1])
    print(f"{name}:", ", ".join(f"{op}{s} {1e3 * v:.2f} ms" for (op, s), v in ordered))

# %% [markdown]
# A schedule is, for every pipeline rank, an order of forward (F) and backward (B) passes of (stage, micro-batch).
# The orders below are the textbook ones torch's schedules implement: **GPipe** all forwards then all backwards;
# **1F1B** `pp - r - 1` warm-up forwards, then one forward one backward, then the remaining backwards; **interleaved
# 1F1B** (Megatron's) the same with `v` stages per rank taken round-robin in groups of `pp` micro-batches. A small
# event simulation then starts each pass as soon as its rank is free and its inputs exist (F of the previous stage,
# B of the next), with the measured durations; point-to-point transfers are left out (one process here).

# %%
def gpipe(pp: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)}


def one_f_one_b(pp: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    orders = {}
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", r, warmup + i), ("B", r, i)]
        order += [("B", r, i) for i in range(m - warmup, m)]
        orders[r] = order
    return orders


def interleaved(pp: int, m: int, v: int) -> dict[int, list[tuple[str, int, int]]]:
    assert m % pp == 0, "interleaved 1F1B needs micro-batches in multiples of pp"
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:  # k-th (chunk, micro-batch) of a rank
        chunk = (k // pp) % v
        return (v - 1 - chunk if backward else chunk), (k // (pp * v)) * pp + k % pp

    orders = {}
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        order, f, b = [], 0, 0
        for _ in range(warmup):
            chunk, mb = unit(f, False); order.append(("F", chunk * pp + r, mb)); f += 1  # noqa: E702
        while f < total:
            chunk, mb = unit(f, False); order.append(("F", chunk * pp + r, mb)); f += 1  # noqa: E702
            chunk, mb = unit(b, True); order.append(("B", chunk * pp + r, mb)); b += 1  # noqa: E702
        while b < total:
            chunk, mb = unit(b, True); order.append(("B", chunk * pp + r, mb)); b += 1  # noqa: E702
        orders[r] = order
    return orders


def simulate(orders, durations, num_stages: int):
    """Start times of every pass: (rank, op, stage, micro-batch, start, end), ranks running their order in turn."""
    done, free, nxt, events = {}, {r: 0.0 for r in orders}, {r: 0 for r in orders}, []
    while any(nxt[r] < len(orders[r]) for r in orders):
        progressed = False
        for r, order in orders.items():
            if nxt[r] == len(order):
                continue
            op, s, mb = order[nxt[r]]
            deps = [("F", s - 1, mb)] if op == "F" and s > 0 else []
            if op == "B":
                deps = [("F", s, mb)] + ([("B", s + 1, mb)] if s < num_stages - 1 else [])
            if all(d in done for d in deps):
                start = max([free[r]] + [done[d] for d in deps])
                end = start + durations[(op, s)]
                done[(op, s, mb)], free[r] = end, end
                nxt[r] += 1
                events.append((r, op, s, mb, start, end))
                progressed = True
        if not progressed:
            raise RuntimeError("the orders deadlock")
    return events


PP, M = 2, 8
cases = [("GPipe", "gpipe", 1, gpipe(PP, M), two_stages),
         ("1F1B", "1f1b", 1, one_f_one_b(PP, M), two_stages),
         ("interleaved 1F1B, v=2", "interleaved_1f1b", 2, interleaved(PP, M, 2), four_chunks)]
results = {}
fig, axes = plt.subplots(len(cases), 1, figsize=(13, 7.5), sharex=True)
colors = plt.get_cmap("tab10")
for ax, (title, name, v, orders, durations) in zip(axes, cases):
    events = simulate(orders, durations, PP * v)
    makespan = max(e[5] for e in events)
    idle = [1 - sum(e[5] - e[4] for e in events if e[0] == r) / makespan for r in range(PP)]
    inflight = []
    for r in range(PP):  # forwards whose backward has not run yet, at worst
        live = peak = 0
        for e in sorted((e for e in events if e[0] == r), key=lambda e: e[4]):
            live += 1 if e[1] == "F" else -1
            peak = max(peak, live)
        inflight.append(peak)
    results[title] = {"makespan_ms": 1e3 * makespan, "bubble": sum(idle) / PP,
                      "theory": theoretical_bubble(name, PP, M, v), "peak_in_flight": inflight}
    for r, op, s, mb, start, end in events:
        ax.barh(PP - 1 - r, 1e3 * (end - start), left=1e3 * start, height=0.8, color=colors(mb % 10),
                alpha=0.55 if op == "F" else 1.0, edgecolor="black", lw=0.4)
        label = f"{mb}" if v == 1 else f"{mb}.{s // PP}"
        ax.text(1e3 * (start + end) / 2, PP - 1 - r, label, ha="center", va="center", fontsize=7 if v == 1 else 5)
    ax.set_yticks(range(PP), [f"rank {PP - 1 - i}" for i in range(PP)])
    ax.set_title(f"{title}: step {1e3 * makespan:.1f} ms, bubble {100 * results[title]['bubble']:.1f}% "
                 f"(theory {100 * results[title]['theory']:.1f}%), at most {max(inflight)} micro-batches of "
                 f"activations held", fontsize=10)
axes[-1].set_xlabel("time (ms); light = forward, dark = backward; label = micro-batch (.chunk)")
fig.suptitle(f"pp={PP}, {M} micro-batches, measured tiny-model stage times", fontsize=12)
fig.tight_layout()
plt.show()


def balanced(durations: dict) -> dict:
    """Every stage as fast as the average one (forward and backward separately): the textbook assumption."""
    mean = {op: statistics.mean(v for (o, _), v in durations.items() if o == op) for op in "FB"}
    return {(op, s): mean[op] for (op, s) in durations}


print(f"{'schedule':24s} {'step':>9s} {'bubble':>8s} {'balanced':>9s} {'theory':>7s}  peak in flight per rank")
for title, name, v, orders, durations in cases:
    r = results[title]
    even = simulate(orders, balanced(durations), PP * v)
    span = max(e[5] for e in even)
    even_idle = sum(1 - sum(e[5] - e[4] for e in even if e[0] == k) / span for k in range(PP)) / PP
    print(f"{title:24s} {r['makespan_ms']:6.1f} ms {100 * r['bubble']:7.1f}% {100 * even_idle:8.1f}% "
          f"{100 * r['theory']:6.1f}%  {r['peak_in_flight']}")

# %% [markdown]
# What the charts and the table show (`balanced`: the same schedules with every stage as fast as the average one,
# the assumption behind the textbook formula; `theory`: `theoretical_bubble` of
# `lightning_hybrid.distributed.pipeline.schedules`):
#
# * With balanced stages **GPipe and 1F1B have the same bubble**, `(pp - 1) / (m + pp - 1)` = 1/9 for pp=2 and 8
#   micro-batches. With the measured stages (the last one also runs the norm, the head and the loss) every
#   schedule runs at the pace of its slowest stage and the bubble grows beyond the formula; GPipe can lose more
#   than 1F1B when one stage is the slowest in forward and another in backward. What 1F1B saves above all is
#   **memory**: GPipe keeps the activations of all 8 micro-batches until their backward, 1F1B at most `pp - rank`.
# * **Interleaving** gives each rank `v` smaller stages, so the warm-up and cool-down are made of passes `v` times
#   shorter: the bubble shrinks to about `1/v` of 1F1B's (`(pp - 1) / (v m + pp - 1)` for balanced stages, which
#   the formula rounds to `1/v` of 1F1B's), paid for with `v` times more point-to-point sends and more
#   activations in flight.
# * More micro-batches shrink every bubble; at 72B scale the recipe uses 128 micro-batches per step (1 sequence
#   each), so 1F1B's bubble is 1/129 < 1% and interleaving is not needed there.
#
# In a real run the strategy measures the bubble itself: at the end of `fit` it logs each stage's idle fraction
# next to this theoretical value (`pipeline bubble (...)` in notebook 01, `strategy.bubble_report` in code, and
# `benchmarks/pipeline_bubble.py` for a sweep).
