# %% [markdown]
# # Quick start: train a Qwen2 model with tensor x pipeline parallelism from a notebook
#
# This notebook trains the `tiny` Qwen2 (4 blocks, width 64, a byte vocabulary) on **4 CPU processes** with
# **tp=2** (each block's matrices split over a pair of processes) and **pp=2** (blocks 0-1 on one pair,
# blocks 2-3 and the head on the other), through the same `lightning-hybrid fit` command and recipe that run
# Qwen2.5-72B on 128 GPUs. It takes about a minute on a 2-core laptop.
#
# **Why a launcher.** Lightning starts extra processes by re-running the current script, and a notebook has no
# script to re-run. `lightning_hybrid.notebook.launch_cli` runs `torchrun ... -m lightning_hybrid.cli fit ...` as
# a child process instead: its output streams into the cell below as it runs, and when it ends the function returns
# the TensorBoard scalars the run logged. The notebook's own kernel stays one plain Python process.

# %%
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook check, irrelevant here

import matplotlib.pyplot as plt  # noqa: E402 - after the warning filter

from lightning_hybrid.notebook import launch_cli  # noqa: E402


def find_repo(start: Path = Path.cwd()) -> Path:
    """The repository root: the first folder upwards that holds recipes/tiny-cpu.yaml."""
    for folder in (start, *start.parents):
        if (folder / "recipes" / "tiny-cpu.yaml").is_file():
            return folder
    raise FileNotFoundError("run this notebook from inside the lightning-hybrid repository")


REPO = find_repo()
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
LOG_DIR = Path(tempfile.mkdtemp(prefix="lh-quickstart-"))  # the run's TensorBoard logs go here
print(RECIPE.read_text().split("trainer:")[0])

# %% [markdown]
# The recipe sets `tp: 2, pp: 1` on 4 processes (so `dp` is inferred as 2). Every argument can be overridden
# on the command line, exactly as in a shell: here `--trainer.strategy.pp 2` makes it a pipeline of two stages
# (and `dp` becomes 4 / (2 x 2) = 1), 50 optimizer steps, validation at steps 25 and 50 on 2 batches.
# The pipeline schedule is 1F1B with the default 2 x pp = 4 micro-batches per step.

# %%
ARGS = [
    "fit", "--config", str(RECIPE),
    "--trainer.strategy.pp", "2",               # tp=2 x pp=2 on 4 processes
    "--trainer.max_steps", "50",
    "--trainer.val_check_interval", "25",
    "--trainer.limit_val_batches", "2",
    "--trainer.log_every_n_steps", "2",
    "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--data.init_args.max_bytes", "1000000",    # 1 MB of the standard library's source is plenty for 50 steps
]
SHOW = ("Initializing distributed", "throughput:", "pipeline bubble", "stopped", "Error")  # lines worth showing
run = launch_cli(ARGS, nproc=4, log_dir=LOG_DIR, timeout=600, keep=lambda line: any(s in line for s in SHOW))
print(f"\nfinished in {run['seconds']:.0f} s; TensorBoard logs: {run['log_dir']}")

# %% [markdown]
# The two lines at the end come from the project's callbacks and the strategy:
#
# * `throughput:` from `ThroughputMonitor`: tokens per second of the whole job and per process, the model FLOP/s
#   and MFU against the measured fp32 matmul peak of this CPU, step time and data wait.
# * `pipeline bubble` from `HybridParallelStrategy`: how long each pipeline stage sat idle inside a step,
#   next to the theoretical bubble of 1F1B, (pp - 1) / (m + pp - 1) = 1 / 5 = 20% for pp=2, m=4.
#
# `launch_cli` returned every scalar of the run as `{tag: [(step, value), ...]}`:

# %%
scalars = run["scalars"]
print(sorted(scalars))
train = scalars["train_loss"]
val = scalars["val_loss"]
tokens = scalars["throughput/tokens_per_sec"]

fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(12, 4))
ax_loss.plot(*zip(*train), label="train loss (global batch mean)")
ax_loss.plot(*zip(*val), "o-", label="validation loss")
ax_loss.set_xlabel("optimizer step")
ax_loss.set_ylabel("cross-entropy (nats per byte)")
ax_loss.set_title("tiny Qwen2, tp=2 x pp=2 on 4 CPU processes")
ax_loss.legend()
ax_speed.plot(*zip(*tokens), color="tab:green")
ax_speed.set_xlabel("optimizer step")
ax_speed.set_ylabel("tokens / s (all processes)")
ax_speed.set_title("throughput per step")
fig.tight_layout()
plt.show()
print(f"train loss {train[0][1]:.2f} at step {train[0][0]} -> {train[-1][1]:.2f} at step {train[-1][0]}; "
      f"validation {val[-1][1]:.2f}")

# %% [markdown]
# The loss starts near ln(256) = 5.5 (a uniform guess over 256 byte values) and falls as the model learns the
# statistics of Python source. The loss is the mean over all label tokens of the global batch, computed on the
# last pipeline stage and broadcast, so it is the same number whatever the mesh: the equivalence tests check that
# tp x pp x dp training matches one process to fp32 rounding.
#
# **From here to a cluster.** The same command with another recipe:
#
# ```bash
# lightning-hybrid plan --model qwen2.5-72b --gpus 128 --gpu b300 --seq-len 4096   # which layout fits (notebook 03)
# sbatch recipes/slurm/qwen2.5-72b.sbatch                                          # preflight, then fit
# ```
#
# `recipes/qwen2.5-72b-pretrain.yaml` differs from the tiny recipe only in sizes: tp=8 inside each node, pp=2,
# dp=8, bf16, FSDP over dp, and a fault-tolerant checkpoint callback. Notebook 02 explains the layout.
