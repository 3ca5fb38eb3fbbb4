"""Recipes, launch scripts and deployment files: each loads, its mesh fits by the planner, the tiny recipe trains.

No GPU and no container engine are needed: recipes are resolved with the CLI's ``--print_config``, the planner is
asked about each recipe's exact layout, the SLURM and torchrun scripts run against stand-in ``srun``/``scontrol``/
``torchrun`` commands that record their arguments, and the Dockerfile and the Kubernetes manifest are parsed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from helpers.fork_server import fork_server
from helpers.launch import launch

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
TINY = REPO / "recipes" / "tiny-cpu.yaml"
SBATCH = REPO / "recipes" / "slurm" / "qwen2.5-72b.sbatch"
MULTINODE = REPO / "recipes" / "torchrun-multinode.sh"
DOCKERFILE = REPO / "Dockerfile"
MANIFEST = REPO / "deploy" / "kubernetes" / "qwen2.5-72b-pytorchjob.yaml"
# Recipes document the planner question they were made with in a `# plan: lightning-hybrid plan ...` line; the tiny
# CPU recipe has none, and is planned as 4 processes of one "node" with 16 GB each (any figure fits a tiny model).
DEFAULT_PLAN = {"tiny-cpu.yaml": "lightning-hybrid plan --model tiny --gpus 4 --gpus-per-node 4 --gpu h100 "
                                 "--gpu-memory-gb 16 --seq-len 128 --global-batch 16 --precision 32-true"}


def recipe_id(path: Path) -> str:
    return path.stem


@functools.lru_cache(maxsize=None)
def printed_config(recipe: Path) -> dict[str, Any]:
    """The complete configuration ``lightning-hybrid fit --config RECIPE --print_config`` prints, parsed (the command
    line run in a process forked from one that imported the package once: :mod:`helpers.fork_server`)."""
    result = fork_server().run(["fit", "--config", str(recipe), "--print_config"], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert result.returncode == 0, f"{recipe.name}: --print_config failed:\n{result.stderr[-4000:]}"
    config = yaml.safe_load(result.stdout)
    config[RECIPE_KEY] = str(recipe)  # where strategy_args() finds the planner question of an auto recipe
    return config


RECIPE_KEY = "__recipe__"


def resolve_auto(config: dict[str, Any], gpu: Optional[str] = None, gpus: Optional[int] = None) -> dict[str, Any]:
    """The strategy arguments of an auto recipe as the strategy resolves them for its planner question (or for
    ``gpus`` x ``gpu``): what ``HybridParallelStrategy`` does at setup, without the devices."""
    from lightning_hybrid.distributed.options import ParallelOptions
    from lightning_hybrid.hardware import SYSTEM_GPUS
    from lightning_hybrid.planner.auto import TrainingShape, apply_layout, plan_layout

    args = config["trainer"]["strategy"]["init_args"]
    problem, _ = planner_problem(Path(config[RECIPE_KEY]))
    hw = problem.hw
    if gpu is not None:
        hw = type(hw)(SYSTEM_GPUS[gpu], gpus, hw.gpus_per_node)
    names = [f.name for f in dataclasses.fields(ParallelOptions)]
    options = ParallelOptions(**{k: v for k, v in args.items() if k in names})
    data = config["data"]["init_args"]
    shape = TrainingShape(int(data["seq_len"]), int(data.get("global_batch_size") or data["batch_size"]),
                          data.get("global_batch_size") is not None)
    plan = plan_layout(options, problem.config, hw, shape, problem.precision)
    resolved = apply_layout(options, plan.summary())
    return {**args, **{k: getattr(resolved, k) for k in names if k in args}}


def strategy_args(config: dict[str, Any]) -> dict[str, Any]:
    """The recipe's strategy arguments, with "auto" resolved as the strategy would."""
    args = config["trainer"]["strategy"]["init_args"]
    from lightning_hybrid.distributed.options import AUTO_FIELDS

    planned = any(args.get(name) == "auto" for name in AUTO_FIELDS)  # not fsdp_reshard_after_forward's "auto"
    return resolve_auto(config) if planned else args


def plan_line(recipe: Path) -> str:
    for line in recipe.read_text().splitlines():
        match = re.match(r"#\s*plan:\s*(lightning-hybrid plan .*)$", line.strip())
        if match:
            return match.group(1)
    assert recipe.name in DEFAULT_PLAN, f"{recipe.name} has no '# plan: lightning-hybrid plan ...' line"
    return DEFAULT_PLAN[recipe.name]


def mesh_of(config: dict[str, Any]) -> dict[str, int]:
    trainer = config["trainer"]
    args = strategy_args(config)
    devices, nodes = int(trainer["devices"]), int(trainer["num_nodes"])
    world = devices * nodes
    tp, pp, cp = int(args["tp"]), int(args["pp"]), int(args.get("cp") or 1)
    dp = int(args["dp"]) if args.get("dp") is not None else world // (tp * pp * cp)
    return {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "dp_shard": int(args.get("dp_shard") or 0), "devices": devices,
            "nodes": nodes, "world": world}


def layout_of(config: dict[str, Any]):
    """The planner's :class:`Layout` for what the recipe runs (micro-batching as the strategy does it)."""
    from lightning_hybrid.planner.search import Layout

    args = strategy_args(config)
    mesh = mesh_of(config)
    data = config["data"]["init_args"]
    batch = int(data["global_batch_size"]) // mesh["dp"] if data.get("global_batch_size") else int(data["batch_size"])
    accumulate = int(config["trainer"].get("accumulate_grad_batches") or 1)
    if mesh["pp"] > 1:
        microbatches = int(args["microbatches"] or 2 * mesh["pp"])
        assert batch % microbatches == 0, f"batch_size={batch} does not split into microbatches={microbatches}"
        mbs, count, schedule, virtual = batch // microbatches, microbatches * accumulate, args["pp_schedule"], \
            int(args["virtual_stages"])
    else:  # without a pipeline the whole per-rank batch runs at once; accumulation gives the micro-batches
        mbs, count, schedule, virtual = batch, accumulate, "none", 1
    return Layout(mesh["tp"], mesh["pp"], mesh["dp"], args["data_parallel"], mbs, count, schedule, virtual,
                  args["activation_checkpointing"], bool(args["sequence_parallel"]) and mesh["tp"] > 1, mesh["cp"],
                  mesh["dp_shard"])


def planner_problem(recipe: Path):
    from lightning_hybrid.planner.cli import build_parser, build_problem

    words = shlex.split(plan_line(recipe))
    assert words[:2] == ["lightning-hybrid", "plan"], words
    args = build_parser().parse_args(words[2:])
    return build_problem(args), args


def callback(config: dict[str, Any], name: str) -> Optional[dict[str, Any]]:
    for cb in config["trainer"].get("callbacks") or []:
        if cb["class_path"].rsplit(".", 1)[-1] == name:
            return cb["init_args"]
    return None


# ---------------------------------------------------------------------- every recipe

def test_the_recipes_folder_has_the_documented_recipes():
    names = {p.name for p in RECIPES}
    assert {"tiny-cpu.yaml", "qwen2.5-72b-pretrain.yaml", "qwen2.5-72b-sft.yaml", "qwen2.5-7b.yaml",
            "qwen2.5-72b-sft-h100.yaml", "qwen2.5-72b-auto.yaml", "llama3.1-70b-pretrain.yaml",
            "qwen3-32b-sft.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_loads_with_print_config_into_the_hybrid_strategy_and_causal_lm(recipe):
    config = printed_config(recipe)
    assert config["trainer"]["strategy"]["class_path"] == "lightning_hybrid.HybridParallelStrategy"
    from lightning_hybrid.models import Qwen2Config

    Qwen2Config.resolve(config["model"]["model"])  # a known preset
    assert config["data"]["class_path"].startswith("lightning_hybrid.data.")
    assert config["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"
    assert callback(config, "ThroughputMonitor") is not None


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_mesh_multiplies_to_the_devices_and_keeps_tp_inside_a_node(recipe):
    from lightning_hybrid.distributed.parallel_dims import ParallelDims
    from lightning_hybrid.distributed.pipeline.split import plan_stages
    from lightning_hybrid.models import CausalLM

    config = printed_config(recipe)
    mesh = mesh_of(config)
    assert mesh["tp"] * mesh["cp"] * mesh["pp"] * mesh["dp"] == mesh["world"], mesh
    assert mesh["devices"] % (mesh["tp"] * mesh["cp"]) == 0, f"tp x cp leaves the node of {mesh['devices']} devices"
    dims = ParallelDims.resolve(mesh["tp"], mesh["pp"], mesh["dp"], mesh["world"], devices_per_node=mesh["devices"],
                                cp=mesh["cp"], dp_shard=mesh["dp_shard"] or None)
    module = CausalLM(config["model"]["model"])
    virtual = int(strategy_args(config)["virtual_stages"])
    dims.check_model(module.parallel_spec().tp_divisible, module.num_blocks(), virtual)
    if mesh["pp"] > 1:
        stages = plan_stages(module.parallel_spec(), module.num_blocks(), mesh["pp"] * virtual)
        assert sum(s.num_blocks for s in stages) == module.num_blocks()


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_and_its_planner_question_describe_the_same_job(recipe):
    from lightning_hybrid.models import Qwen2Config

    config = printed_config(recipe)
    problem, args = planner_problem(recipe)
    mesh = mesh_of(config)
    data = config["data"]["init_args"]
    accumulate = int(config["trainer"].get("accumulate_grad_batches") or 1)
    assert problem.hw.gpus == mesh["world"]
    assert problem.hw.gpus_per_node == mesh["devices"]
    assert problem.config == Qwen2Config.resolve(config["model"]["model"])
    assert problem.precision == config["trainer"]["precision"]
    assert problem.seq_len == int(data["seq_len"])
    batch = int(data["global_batch_size"]) if data.get("global_batch_size") else int(data["batch_size"]) * mesh["dp"]
    assert problem.global_batch == batch * accumulate


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_planner_says_the_recipe_layout_fits(recipe):
    from lightning_hybrid.planner.search import estimate

    config = printed_config(recipe)
    problem, _ = planner_problem(recipe)
    layout = layout_of(config)
    result = estimate(problem, layout)
    assert not result.reason, f"{recipe.name}: {layout.describe()}: {result.reason}"
    assert result.fits, (f"{recipe.name}: {layout.describe()} needs {result.memory['total'] / 1e9:.1f} GB per GPU, "
                         f"{result.usable / 1e9:.1f} GB usable on {problem.hw.gpu.name}")
    assert result.time["step"] > 0 and 0 < result.mfu < 1


LARGE = [r for r in RECIPES if r.name.startswith(("qwen", "llama"))]


@pytest.mark.parametrize("recipe", LARGE, ids=recipe_id)
def test_checkpoint_interval_of_a_large_recipe_follows_the_planners_young_daly_estimate(recipe):
    from lightning_hybrid.planner.interval import checkpoint_plan
    from lightning_hybrid.planner.search import estimate

    config = printed_config(recipe)
    ckpt = callback(config, "FaultTolerantCheckpoint")
    assert ckpt is not None, f"{recipe.name} has no FaultTolerantCheckpoint"
    assert ckpt["auto_resume"] and ckpt["save_on_signal"] and ckpt["async_save"]
    problem, _ = planner_problem(recipe)
    result = estimate(problem, layout_of(config))
    plan = checkpoint_plan(result.checkpoint_bytes, problem.hw.gpus, result.time["step"])
    planned_minutes = plan["interval_seconds"] / 60
    assert ckpt["every_n_minutes"] is not None
    assert 0.5 <= ckpt["every_n_minutes"] / planned_minutes <= 2.0, (ckpt["every_n_minutes"], planned_minutes)
    assert ckpt["mtbf_hours"] == pytest.approx(plan["mtbf_hours"], rel=0.05)


AUTO_RECIPE = REPO / "recipes" / "qwen2.5-72b-auto.yaml"


def test_auto_recipe_prints_auto_and_resolves_as_its_header_says():
    config = printed_config(AUTO_RECIPE)
    args = config["trainer"]["strategy"]["init_args"]
    for name in ("tp", "pp", "dp", "microbatches", "virtual_stages", "pp_schedule", "activation_checkpointing",
                 "data_parallel"):
        assert args[name] == "auto", (name, args[name])  # --print_config shows what the user wrote
    header = AUTO_RECIPE.read_text()
    for gpu, gpus, line in (("b300", 128, "128 x B300"), ("h100", 64, "64 x H100")):
        r = resolve_auto(config, gpu, gpus)
        said = re.search(re.escape(line) + r".*?: tp=(\d+) pp=(\d+) dp=(\d+) (\w+), (\w+) v=(\d+), (\d+) micro-batches",
                         header, re.S)
        assert said, line
        assert said.groups() == (str(r["tp"]), str(r["pp"]), str(r["dp"]), r["data_parallel"], r["pp_schedule"],
                                 str(r["virtual_stages"]), str(r["microbatches"])), (line, r)


@pytest.mark.parametrize("recipe", LARGE, ids=recipe_id)
def test_every_key_of_a_large_recipe_is_commented(recipe):
    uncommented = []
    lines = recipe.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key = re.match(r"^(?:- )?([A-Za-z_][\w.]*):(.*)$", stripped)
        if key is None:
            continue
        value = key.group(2).split("#", 1)[0].strip()
        if not value or key.group(1) in ("class_path", "init_args"):
            continue  # a section or a class name: its keys carry the comments
        previous = lines[i - 1].strip() if i else ""
        if "#" not in line and not previous.startswith("#"):
            uncommented.append(f"line {i + 1}: {stripped}")
    assert not uncommented, f"{recipe.name}: keys without a comment:\n" + "\n".join(uncommented)


@pytest.mark.parametrize("recipe, family, data", [("llama3.1-70b-pretrain.yaml", "llama", "PackedTokenDataModule"),
                                                  ("qwen3-32b-sft.yaml", "qwen3", "PackedTokenDataModule")])
def test_family_recipes_train_their_family_and_the_sft_one_masks_documents(recipe, family, data):
    from lightning_hybrid.models import DecoderConfig

    config = printed_config(REPO / "recipes" / recipe)
    model = DecoderConfig.resolve(config["model"]["model"])
    assert model.model_type == family and config["data"]["class_path"].endswith(data)
    problem, _ = planner_problem(REPO / "recipes" / recipe)
    assert problem.config == model  # the planner was asked about this family's preset
    if "sft" in recipe:
        assert config["data"]["init_args"]["document_mask"] is True
        assert config["model"]["init_from_hf"] == "Qwen/Qwen3-32B"
    else:
        assert model.rope_scaling is not None and model.rope_scaling.rope_type == "llama3"


def test_sft_recipe_starts_from_the_released_base_weights_with_qwen25_sft_hyperparameters():
    config = printed_config(REPO / "recipes" / "qwen2.5-72b-sft.yaml")
    model = config["model"]
    assert model["init_from_hf"] == "Qwen/Qwen2.5-72B"
    assert model["lr"] == pytest.approx(7e-6) and model["lr"] * model["min_lr_ratio"] == pytest.approx(7e-7)
    assert config["trainer"]["max_epochs"] == 2 and config["trainer"]["gradient_clip_val"] == 1.0


def test_pretrain_recipe_is_the_reference_layout_tp8_pp2_dp8_on_16_nodes_at_seq_4096():
    config = printed_config(REPO / "recipes" / "qwen2.5-72b-pretrain.yaml")
    mesh = mesh_of(config)
    assert (mesh["tp"], mesh["pp"], mesh["dp"], mesh["nodes"], mesh["devices"]) == (8, 2, 8, 16, 8)
    assert config["trainer"]["precision"] in ("bf16-true", "bf16-mixed")
    assert config["data"]["class_path"] == "lightning_hybrid.data.PackedTokenDataModule"
    assert int(config["data"]["init_args"]["seq_len"]) == 4096
    tokens = int(config["data"]["init_args"]["batch_size"]) * mesh["dp"] * 4096
    assert 2e6 <= tokens <= 8e6  # a multi-million-token global batch, as published for models of this size


# ---------------------------------------------------------------------- the tiny recipe really trains

@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tiny_recipe_trains_five_steps_on_four_processes_with_finite_falling_loss_and_a_tokens_per_second_line(
        tmp_path):
    from lightning_hybrid.launch.torchrun import latest_version_dir, read_scalars

    # the ranks forked from the tests' fork server (the CLI under real torchrun: tests/test_multinode.py)
    result = launch(4, ["-m", "lightning_hybrid.cli", "fit", "--config", str(TINY),
                        "--trainer.max_steps", "5", "--trainer.val_check_interval", "5",
                        "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
                        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir",
                        str(tmp_path)], timeout=240)
    assert re.search(r"throughput: [\d,]+ tokens/s", result.stdout), result.stdout[-3000:]
    run_dir = latest_version_dir(tmp_path)
    assert run_dir is not None, f"no TensorBoard events under {tmp_path}"
    scalars = read_scalars(run_dir)
    losses = [value for _, value in scalars["train_loss"]]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses), losses
    assert min(losses[1:]) < losses[0], f"the loss did not fall in 5 steps: {losses}"
    val = [value for _, value in scalars["val_loss"]]
    assert val and all(math.isfinite(v) for v in val)


# ---------------------------------------------------------------------- SLURM and torchrun launch scripts

def _fake_bin(tmp_path: Path, scripts: dict[str, str]) -> Path:
    """A folder of stand-in commands: each logs its arguments to CALLS and runs the given shell body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/bash\necho "{name} $*" >> "$CALLS"\n{body}\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _run_sbatch(tmp_path: Path, fit_status: int,
                preflight_status: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    calls = tmp_path / "calls.log"
    # srun runs its command (after the srun options); torchrun exits like the step would
    bin_dir = _fake_bin(tmp_path, {
        "scontrol": 'if [ "$1" = show ]; then printf "gpu-node-001\\ngpu-node-002\\n"; fi',
        "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
        "torchrun": (f'case "$*" in *" preflight "*) echo "{{}}"; exit {preflight_status};; '
                     f'*" fit "*) exit {fit_status};; esac'),
    })
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-node-[001-016]", "SLURM_JOB_NUM_NODES": "16",
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_RESTART_COUNT": "2", "RUN_DIR": str(tmp_path / "run")}
    result = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    return result, calls.read_text().splitlines()


def test_sbatch_asks_for_16_nodes_of_8_gpus_requeue_and_a_usr1_signal_before_the_time_limit():
    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", text, flags=re.M))
    assert directives["nodes"] == "16" and directives["gpus-per-node"] == "8"
    assert directives["ntasks-per-node"] == "1"  # one torchrun agent per node
    assert "requeue" in directives
    signal, lead = re.fullmatch(r"(?:B:)?(USR1|SIGUSR1)@(\d+)", directives["signal"]).groups()
    shutdown = int(re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", text).group(1))
    assert shutdown < int(lead), "torchrun must finish waiting for the checkpoint before the time limit"
    assert "SIGUSR1" in re.search(r"TORCHELASTIC_SIGNALS_TO_HANDLE=(\S+)", text).group(1)
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0


def test_sbatch_runs_preflight_then_fit_with_rendezvous_on_the_first_node(tmp_path):
    result, calls = _run_sbatch(tmp_path, fit_status=0)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = [c for c in calls if c.startswith("torchrun ")]
    assert len(runs) == 2 and " preflight " in runs[0] and " fit --config " in runs[1], runs
    for run in runs:
        assert "--nnodes 16 --nproc_per_node 8" in run and "--rdzv_backend c10d" in run
        assert "--rdzv_endpoint gpu-node-001:" in run
    assert "--tp 8 --pp 2" in runs[0] and "--threshold 0.8" in runs[0]
    assert runs[1].endswith(f"fit --config {REPO}/recipes/qwen2.5-72b-pretrain.yaml")
    assert not any(c.startswith("scontrol requeue") for c in calls)
    assert (tmp_path / "run").is_dir()  # the run happens in RUN_DIR (shared storage)


def test_sbatch_requeues_itself_when_training_stops_after_the_preemption_checkpoint(tmp_path):
    result, calls = _run_sbatch(tmp_path, fit_status=75)
    assert "scontrol requeue 4242" in calls, calls
    assert result.returncode == 75


def test_sbatch_dry_runs_the_recipe_on_one_cpu_first_and_stops_when_it_fails(tmp_path):
    for status in (0, 1):
        calls = tmp_path / f"calls{status}.log"
        bin_dir = _fake_bin(tmp_path, {
            "scontrol": 'if [ "$1" = show ]; then printf "gpu-node-001\\n"; fi',
            "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"', "torchrun": "exit 0",
            "lightning-hybrid": f"exit {status}"})
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SLURM_JOB_ID": "7",
               "SLURM_JOB_NODELIST": "gpu-node-[001-016]", "SLURM_JOB_NUM_NODES": "16", "SLURM_SUBMIT_DIR": str(REPO),
               "SLURM_RESTART_COUNT": "0", "RUN_DIR": str(tmp_path / "run")}
        result = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
        lines = calls.read_text().splitlines()
        assert lines[1].startswith("srun --nodes=1 --ntasks=1 ") and lines[2].startswith(
            "lightning-hybrid dry-run --config ") and "--ranks all" in lines[2], lines
        assert result.returncode == status and any(" fit " in c for c in lines) == (status == 0)
        assert ("dry run failed" in result.stdout) == (status == 1)


def test_sbatch_stops_without_training_when_the_preflight_fails(tmp_path):
    result, calls = _run_sbatch(tmp_path, fit_status=0, preflight_status=1)
    assert result.returncode == 1
    assert not any(" fit " in c for c in calls) and not any("requeue" in c for c in calls)
    assert "preflight failed" in result.stdout


def test_multinode_torchrun_script_runs_preflight_then_fit_with_elastic_restarts(tmp_path):
    calls = tmp_path / "calls.log"
    bin_dir = _fake_bin(tmp_path, {"torchrun": 'case "$*" in *" preflight "*) echo "{}";; esac; exit 0',
                                   "lightning-hybrid": "exit 0"})
    base = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "NNODES": "16",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RUN_DIR": str(tmp_path / "run")}
    for rank in ("0", "5"):
        result = subprocess.run(["bash", str(MULTINODE), str(REPO / "recipes" / "qwen2.5-72b-pretrain.yaml")],
                                env={**base, "NODE_RANK": rank}, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    lines = calls.read_text().splitlines()
    dry_runs = [c for c in lines if c.startswith("lightning-hybrid dry-run")]
    assert [c.split("--ranks ")[1].split()[0] for c in dry_runs] == ["0,1,2,3,4,5,6,7", "40,41,42,43,44,45,46,47"]
    assert lines[0] == dry_runs[0] and lines[3] == dry_runs[1]  # each node: the dry run before any torchrun
    runs = [c for c in lines if c.startswith("torchrun ")]
    assert len(runs) == 4
    for i, run in enumerate(runs):
        assert "--nnodes 16 --nproc_per_node 8 --rdzv_backend c10d" in run
        assert f"is_host={1 if i < 2 else 0}" in run  # node 0 hosts the rendezvous store
    assert " preflight " in runs[0] and "--max-restarts 0" in runs[0]
    assert "--rdzv_endpoint 10.0.0.1:29500" in runs[1] and "--max-restarts 3" in runs[1]
    assert runs[1].endswith("fit --config " + str(REPO / "recipes" / "qwen2.5-72b-pretrain.yaml"))


# ---------------------------------------------------------------------- container and Kubernetes

def _dockerfile_instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_builds_on_a_cuda_pytorch_image_installs_the_package_and_documents_nccl_settings():
    instructions = _dockerfile_instructions()
    args = {k: v for word, rest in instructions if word == "ARG" for k, _, v in [rest.partition("=")]}
    base = next(rest for word, rest in instructions if word == "FROM")
    base = args.get(base.strip("${}"), base)
    assert re.match(r"(nvcr\.io/nvidia/pytorch:|pytorch/pytorch:[\d.]+-cuda)", base), base
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert re.search(r"pip install [^;&]*\s\.(\s|$)", runs), "the package itself is not pip-installed"
    copies = [rest for word, rest in instructions if word == "COPY"]
    assert any("lightning_hybrid" in c for c in copies) and any("recipes" in c for c in copies)
    env = dict(rest.split("=", 1) for word, rest in instructions if word == "ENV")
    for name in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX", "NCCL_IB_TIMEOUT",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        assert name in env, f"{name} is not set in the Dockerfile"
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("ENV "):
            above = [previous for previous in lines[max(0, i - 3):i] if previous.strip()]
            assert above and (above[-1].startswith("#") or above[-1].startswith("ENV ")), (
                f"ENV without a comment: {line}")


def _manifest() -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    return job, claims


def test_pytorchjob_has_16_pods_of_8_gpus_with_restarts_and_rendezvous():
    job, _ = _manifest()
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 16
    assert replicas["Master"]["replicas"] == 1
    assert int(job["spec"]["runPolicy"]["backoffLimit"]) > 0
    for spec in replicas.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == "pytorch")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        script = " ".join(container["command"] + container["args"])
        assert "--nnodes 16 --nproc_per_node 8" in script and "--max-restarts" in script
        preflight = script.index("lightning-hybrid)\" preflight")
        fit = script.index("lightning-hybrid)\" fit --config recipes/qwen2.5-72b-pretrain.yaml")
        assert preflight < fit
        assert "exec torchrun" in script  # torchrun is PID 1 and gets the pod's SIGTERM
        shutdown = int(dict(rest.split("=", 1) for word, rest in _dockerfile_instructions()
                            if word == "ENV")["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        assert pod["terminationGracePeriodSeconds"] > shutdown
        check = subprocess.run(["bash", "-n"], input=container["args"][0], text=True)
        assert check.returncode == 0


def test_pytorchjob_mounts_one_read_write_many_volume_at_the_recipes_checkpoint_dir():
    job, claims = _manifest()
    recipe = yaml.safe_load((REPO / "recipes" / "qwen2.5-72b-pretrain.yaml").read_text())
    dirpath = callback(recipe, "FaultTolerantCheckpoint")["dirpath"]
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        pod = spec["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == "pytorch")
        checkpoints = Path(container["workingDir"]) / dirpath
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = [m for m in container["volumeMounts"]
                  if checkpoints == Path(m["mountPath"]) or Path(m["mountPath"]) in checkpoints.parents]
        assert mounts, f"no volume mounted at {checkpoints}"
        claim = volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"]
        assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"]
        # the recipe the command names is where the image put it
        workdir = next(rest for word, rest in _dockerfile_instructions() if word == "WORKDIR")
        assert container["workingDir"] == workdir
        assert any(rest.split()[0] == "recipes" for word, rest in _dockerfile_instructions() if word == "COPY")
