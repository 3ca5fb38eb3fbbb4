# %% [markdown]
# # Fault tolerance: kill a rank, resume, and skip a damaged checkpoint
#
# On a 128-GPU job something fails every day or two: a GPU falls off the bus, a node reboots, a job is preempted.
# `FaultTolerantCheckpoint` makes such a failure cost only the steps since the last checkpoint:
#
# * every `every_n_steps` each rank writes its own shards with Distributed Checkpoint, in the background
#   (`async_save=True`), into `step-NNNNNN.tmp/`; only when every rank has finished does rank 0 write
#   `meta.json` (step, data position, mesh, size and CRC-32 of every file) and rename the folder to
#   `step-NNNNNN/`. A crash at any moment leaves the previous checkpoint intact;
# * re-running the same command resumes from the newest checkpoint that passes the size and checksum check,
#   with the model, AdamW states, LR schedule, data position and every rank's random state, so the resumed run
#   computes exactly what the uninterrupted one would have.
#
# This notebook shows all of it with the quick start's tiny Qwen2 on 2 CPU processes, data parallel with FSDP2
# (each rank holds half of the weights and optimizer states and reads its own half of every batch):
#
# 1. train with a checkpoint every 10 steps and **kill rank 1 with SIGKILL** as soon as step 20 is saved,
#    as a dying GPU would (no handler runs, nothing is flushed);
# 2. **re-run the same command**: it resumes from `step-000020`, and the loss curve joins without a gap or a
#    repeated step; the steps trained twice give bitwise the same losses;
# 3. **damage the newest checkpoint** (flip one byte of a shard) and re-run: the damage is detected, reported in one
#    line, the folder is moved aside, and training resumes from the checkpoint before it.
#
# It takes two to three minutes on a 2-core laptop, most of it starting processes.

# %%
import json
import signal
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook check, irrelevant here

import matplotlib.pyplot as plt  # noqa: E402 - after the warning filter

from lightning_hybrid.checkpoint import committed_checkpoints, verify_checkpoint  # noqa: E402
from lightning_hybrid.notebook import launch_cli  # noqa: E402


def find_repo(start: Path = Path.cwd()) -> Path:
    """The repository root: the first folder upwards that holds recipes/tiny-cpu.yaml."""
    for folder in (start, *start.parents):
        if (folder / "recipes" / "tiny-cpu.yaml").is_file():
            return folder
    raise FileNotFoundError("run this notebook from inside the lightning-hybrid repository")


REPO = find_repo()
WORK = Path(tempfile.mkdtemp(prefix="lh-fault-tolerance-"))
CKPT = WORK / "ckpt"            # on a cluster: a shared file system every node sees
NPROC, TOTAL_STEPS, EVERY = 2, 60, 10

# The quick start's recipe plus a fault-tolerant checkpoint callback, written as a second YAML file: later
# files override earlier ones, key by key (a list such as trainer.callbacks is replaced as a whole).
OVERRIDES = WORK / "fault-tolerance.yaml"
OVERRIDES.write_text(f"""
trainer:
  devices: {NPROC}                 # processes on this machine
  strategy:
    init_args:
      tp: 1                      # no tensor parallelism: dp = 2 / (tp * pp) = 2 FSDP2 ranks
  max_steps: {TOTAL_STEPS}
  log_every_n_steps: 1           # one loss point per optimizer step
  limit_val_batches: 0           # no validation: the curve to watch is the training loss
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_hybrid.FaultTolerantCheckpoint
      init_args:
        dirpath: {CKPT}
        every_n_steps: {EVERY}   # save every 10 optimizer steps
        keep_last: 3             # older checkpoints are deleted once a newer one is committed
        async_save: true         # write in the background; training blocks only to copy the state
data:
  init_args:
    max_bytes: 1000000           # 1 MB of the standard library's source is plenty here
""")
COMMAND = ["fit", "--config", str(REPO / "recipes" / "tiny-cpu.yaml"), "--config", str(OVERRIDES)]
SHOW = ("auto-resuming", "verified", "saved checkpoint", "skipping damaged", "moved", "killed", "Error", "exitcode")
print(" ".join(["lightning-hybrid", *COMMAND]))

# %% [markdown]
# ## 1. Train, and kill rank 1 after the second checkpoint
#
# `launch_cli` runs the command on 2 local processes with torchrun (as `sbatch` or a Kubernetes pod would on a
# cluster) and hands every output line to `on_line`. When rank 0 reports that `step-000020` is committed (at the
# step boundary after the background write finished, so training is a step or more past it), the callback below
# sends SIGKILL to the process of rank 1. Rank 0 loses its
# peer in the middle of a collective and fails, and torchrun ends the job with an error: the run is lost from
# step 20 on, and nothing else.

# %%
def kill_after_second_checkpoint(line: str, job) -> None:
    if "saved checkpoint" in line and f"step-{2 * EVERY:06d}" in line and not job.killed:
        pid = job.kill_rank(NPROC - 1, signal.SIGKILL)
        print(f">>> killed rank {NPROC - 1} (pid {pid}) with SIGKILL")


first = launch_cli(COMMAND, nproc=NPROC, log_dir=WORK / "run1", timeout=600, check=False,
                   on_line=kill_after_second_checkpoint, keep=lambda line: any(s in line for s in SHOW))
print(f"\nexit code {first['returncode']} after {first['seconds']:.0f} s; killed: {first['killed']}")
print("committed checkpoints:", [c.path.name for c in committed_checkpoints(CKPT)])

# %%
first_loss = dict(first["scalars"]["train_loss"])
print(f"the killed run logged steps {min(first_loss)} to {max(first_loss)} before it died")
assert first["returncode"] != 0 and first["killed"] == [(NPROC - 1, int(signal.SIGKILL))]
assert max(first_loss) < TOTAL_STEPS - 1

# %% [markdown]
# ## 2. Re-run the same command: auto-resume
#
# Nothing in the command changes (a SLURM requeue or a pod restart runs it again as is). The callback finds the
# newest checkpoint that passes its check, and Lightning restores everything from it before the first step.

# %%
second = launch_cli(COMMAND, nproc=NPROC, log_dir=WORK / "run2", timeout=600,
                    keep=lambda line: any(s in line for s in SHOW))
second_loss = dict(second["scalars"]["train_loss"])
print(f"\nthe resumed run logged steps {min(second_loss)} to {max(second_loss)} in {second['seconds']:.0f} s")

# %% [markdown]
# The loss Lightning logs at step `s` is that of the batch trained at step `s`, counted from 0, so `step-000020` holds
# the state after steps 0 to 19 (the grey lines in the plot sit between two steps) and the resumed run starts at
# step 20. The first run's points up to the checkpoint and the resumed run's points after it join into one curve
# with every step exactly once. The steps between the checkpoint and the kill were trained twice, before and after
# the crash: same weights, same batches, same random state, so the same losses, bit for bit.

# %%
resumed_at = min(second_loss)
joined = {**{s: v for s, v in first_loss.items() if s < resumed_at}, **second_loss}
redone = sorted(set(first_loss) & set(second_loss))
print(f"resumed at step {resumed_at}; joined curve: steps {min(joined)}..{max(joined)}, {len(joined)} points")
print(f"steps trained twice: {redone}; largest difference in their losses: "
      f"{max(abs(first_loss[s] - second_loss[s]) for s in redone)}")
assert resumed_at == 2 * EVERY and redone, "resumed from another checkpoint than step-000020"
assert sorted(joined) == list(range(TOTAL_STEPS)), "a gap or a repeated step"
assert all(first_loss[s] == second_loss[s] for s in redone), "the replayed steps differ"

fig, (ax_runs, ax_joined) = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
ax_runs.plot(*zip(*sorted(first_loss.items())), "o-", ms=3, color="tab:red", label=f"run 1 (rank {NPROC - 1} killed)")
ax_runs.plot(*zip(*sorted(second_loss.items())), "-", lw=1.5, color="tab:blue", label="run 2 (auto-resumed)")
ax_runs.axvline(max(first_loss), color="tab:red", ls=":", label=f"kill (last step logged: {max(first_loss)})")
for step in range(EVERY, TOTAL_STEPS + 1, EVERY):  # checkpoint step-N holds the state after logged steps 0..N-1
    ax_runs.axvline(step - 0.5, color="grey", lw=0.6, alpha=0.6, label="checkpoint" if step == EVERY else None)
ax_runs.set(xlabel="optimizer step", ylabel="training loss", title="two runs: the crash and the restart")
ax_runs.legend()
ax_joined.plot(*zip(*sorted(joined.items())), color="black")
ax_joined.axvspan(redone[0] - 0.5, redone[-1] + 0.5, color="tab:orange", alpha=0.25,
                  label="trained twice, identical losses")
ax_joined.set(xlabel="optimizer step", title=f"joined: steps 0..{TOTAL_STEPS - 1}, each exactly once")
ax_joined.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. A damaged checkpoint is skipped, never half-loaded
#
# Storage fails too: a node dies while the file system still caches a shard, a disk returns a flipped bit. Each
# checkpoint's `meta.json` lists the size and CRC-32 of every file, and the resume check reads them all. Here one
# byte in the middle of a shard of the newest checkpoint is flipped, and the same command runs once more.

# %%
checkpoints = committed_checkpoints(CKPT)
newest = checkpoints[0].path
print("checkpoints:", [c.path.name for c in checkpoints], "| latest ->", (CKPT / "latest").read_text().strip())
manifest = verify_checkpoint(newest)
shard = sorted(name for name in manifest["files"] if name.endswith(".distcp"))[0]
data = bytearray((newest / shard).read_bytes())
data[len(data) // 2] ^= 0x01   # one bit
(newest / shard).write_bytes(bytes(data))
print(f"flipped one bit of {newest.name}/{shard} ({len(data)} bytes)")

third = launch_cli(COMMAND, nproc=NPROC, log_dir=WORK / "run3", timeout=600,
                   keep=lambda line: any(s in line for s in SHOW))
third_loss = dict(third["scalars"]["train_loss"])

# %% [markdown]
# The run names the file, the CRC-32 it found and the one the manifest promised, moves the damaged folder aside
# (`step-000060.damaged`, kept for inspection), resumes from `step-000050`, trains steps 50 to 59 again, and
# saves a good `step-000060`. The replayed steps again match run 2 exactly.

# %%
print("after run 3:", sorted(p.name for p in CKPT.iterdir()))
replayed = sorted(third_loss)
print(f"run 3 trained steps {replayed[0]}..{replayed[-1]}; identical to run 2: "
      f"{all(third_loss[s] == second_loss[s] for s in replayed)}")
assert any("skipping damaged checkpoint" in line for line in third["output"])
assert replayed == list(range(TOTAL_STEPS - EVERY, TOTAL_STEPS))
assert all(third_loss[s] == second_loss[s] for s in replayed)
assert (CKPT / f"{newest.name}.damaged").is_dir()
verify_checkpoint(CKPT / newest.name)  # the re-saved checkpoint passes the check
print("what meta.json of the damaged checkpoint had recorded:", json.dumps({k: manifest[k] for k in ("step", "mesh")}))

fig, ax = plt.subplots(figsize=(8, 3.6))
ax.plot(*zip(*sorted(second_loss.items())), color="tab:blue", label="run 2")
ax.plot(*zip(*sorted(third_loss.items())), "o", ms=5, mfc="none", color="tab:green",
        label=f"run 3: resumed from step-{TOTAL_STEPS - EVERY:06d}")
ax.axvline(TOTAL_STEPS - EVERY - 0.5, color="tab:green", ls=":", label=f"step-{TOTAL_STEPS - EVERY:06d}, used")
ax.axvline(TOTAL_STEPS - 0.5, color="tab:red", ls=":", label=f"damaged step-{TOTAL_STEPS:06d}, skipped")
ax.set(xlabel="optimizer step", ylabel="training loss", xlim=(TOTAL_STEPS - 2 * EVERY, TOTAL_STEPS + 2),
       title="resume after a damaged checkpoint")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# **On a cluster.** The SLURM script and the Kubernetes manifest (`recipes/slurm/`, `deploy/kubernetes/`) run the same
# command again after a failure; with `save_on_signal` (on by default) SLURM's warning signal before a preemption
# saves at the next step boundary and exits with code 75. `mtbf_hours=` makes the callback log the Young/Daly
# checkpoint interval from its measured save time; `lightning-hybrid plan` gives it ahead of time (notebook 03).
# The tests behind these claims kill ranks at random steps, also in the middle of an asynchronous write, and compare
# the final weights of the resumed runs with an uninterrupted one bit for bit (`tests/test_fault_tolerance.py`).
