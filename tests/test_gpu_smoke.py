"""``benchmarks/gpu_smoke.sh``: its argument handling and the commands it would run, checked on CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.sh"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def test_print_lists_the_steps_with_their_settings() -> None:
    result = _run("--print", "--gpu", "h100")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert list(lines) == ["mfu", "tiny-nccl", "preflight", "ckpt", "gpu-health", "docmask", "async-tp", "float8",
                           "mxfp8", "fused", "moe", "eval"]
    assert "fused_projections.py --gemm --device cuda" in lines["fused"]
    assert "benchmarks/moe.py --grouped-check" in lines["moe"] and "tiny-moe-cpu.yaml" in lines["moe"]
    assert "--trainer.strategy.ep 1" in lines["moe"] and "process_group_backend nccl" in lines["moe"]
    assert "float8_smoke.py --preset qwen2.5-1.5b --float8 rowwise --steps 50" in lines["float8"]
    assert "get_device_capability() >= (10, 0) else 77" in lines["mxfp8"]
    assert "float8_smoke.py --preset qwen2.5-1.5b --float8 mxfp8 --steps 50" in lines["mxfp8"]
    assert "--preset qwen2.5-1.5b" in lines["mfu"] and "--seq-len 4096" in lines["mfu"] and "--dtype bf16" in lines[
        "mfu"]
    assert "--nproc_per_node 1" in lines["tiny-nccl"] and "process_group_backend nccl" in lines["tiny-nccl"]
    assert "preflight --gpu h100" in lines["preflight"] and "--no-health" not in lines["preflight"]
    assert "FaultTolerantCheckpoint" in lines["ckpt"] and "for steps in 20 30" in lines["ckpt"]
    assert "benchmarks/gpu_health_poll.py" in lines["gpu-health"] and "GPUHealthMonitor" in lines["gpu-health"]
    assert "--nproc_per_node 2" in lines["async-tp"] and "runtime.py --async-tp" in lines["async-tp"]
    assert " eval --config " in lines["eval"] and "--checkpoint gpu-smoke/ckpt/step-000030" in lines["eval"]
    assert "process_group_backend nccl" in lines["eval"] and "helpers.eval_tasks" in lines["eval"]


def test_only_selects_steps_and_refuses_unknown_ones() -> None:
    result = _run("--print", "--only", "ckpt,mfu")
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == ["mfu", "ckpt"]
    bad = _run("--only", "mfu,bogus")
    assert bad.returncode == 2 and "unknown step 'bogus'" in bad.stderr
    assert "mfu,tiny-nccl,preflight,ckpt,gpu-health,docmask" in bad.stderr


@pytest.mark.parametrize("args", [["--frobnicate"], ["--out"], ["--gpu"]])
def test_bad_arguments_exit_2_with_one_line(args) -> None:
    result = _run(*args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_help_and_no_gpu(tmp_path) -> None:
    assert _run("--help").stdout.startswith("GPU smoke test")
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU driver is present")
    result = _run("--out", str(tmp_path / "o"))
    assert result.returncode == 3 and "no NVIDIA GPU" in result.stderr and not (tmp_path / "o").exists()
