"""benchmarks/planner_accuracy.py runs (reduced: 2 processes, 2 layouts, 1 step) so it cannot rot, and ``plan
--calibrate`` plans with a preflight report's figures. The accuracy targets are not asserted: noisy machines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hybrid.planner.cli import run_plan

REPO = Path(__file__).resolve().parents[1]
PLAN = ["--model", "qwen2.5-7b", "--gpus", "16", "--gpu", "h100", "--seq-len", "4096", "--json"]
PREFLIGHT = {"matmul": [{"tflops": 400.0}], "links": [
    {"link": "intra-node NVLink", "busbw_gbs": 90.0, "sizes": [{"bytes": 1 << 20, "seconds": 1e-4},
                                                              {"bytes": 64 << 20, "seconds": 7e-4}]},
    {"link": "inter-node network", "busbw_gbs": 10.0, "sizes": [{"bytes": 1 << 20, "seconds": 3e-4},
                                                               {"bytes": 64 << 20, "seconds": 6.5e-3}]}]}


@pytest.mark.distributed  # the benchmark trains on 2 gloo processes
@pytest.mark.timeout(300)
def test_reduced_accuracy_benchmark_prints_predicted_measured_error_and_rank(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "planner_accuracy.py"), "--reduced", "--json",
                             str(tmp_path / "acc.json")], capture_output=True, text=True, timeout=280,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if re.match(r"\| tp=\d", line)]
    assert len(rows) == 2, result.stdout
    assert "Spearman rank correlation" in result.stdout and "auto's choice" in result.stdout
    doc = json.loads((tmp_path / "acc.json").read_text())
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in doc["rows"])
    assert doc["preflight"]["links"], "the preflight measured no link to calibrate with"


def _plan(argv, capsys) -> dict:
    assert run_plan(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_calibrate_takes_matmul_and_links_from_a_preflight_report(tmp_path, capsys):
    (tmp_path / "preflight.json").write_text(json.dumps(PREFLIGHT))
    table = _plan(PLAN, capsys)
    calibrated = _plan(PLAN + ["--calibrate", str(tmp_path / "preflight.json")], capsys)
    step = [doc["layouts"][0]["time_s"]["step"] for doc in (table, calibrated)]
    assert step[1] > 1.3 * step[0]  # matmuls at 400 TFLOP/s instead of 0.652 x 989, slower links: slower steps


def test_plan_calibrate_with_a_file_that_is_no_preflight_report_is_one_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert run_plan(PLAN + ["--calibrate", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "not a preflight report" in err and err.strip().count("\n") == 0


def _accuracy_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_accuracy", REPO / "benchmarks" / "planner_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("processes", "layouts"), [(4, 28), (2, 12)])
def test_the_recorded_idle_measurements_replay_within_the_accuracy_targets(processes, layouts):
    """The time model against the layouts measured on an idle machine (benchmarks/data/: 4 processes on 2 cores, and
    2): deterministic, so the targets hold here; a change of the model that breaks them fails this test."""
    bench = _accuracy_module()
    args = bench.argparse.Namespace(**{**bench.FULL, "processes": processes})
    doc = json.loads((REPO / "benchmarks" / "data" / f"planner_accuracy_{processes}proc.json").read_text())
    rows = bench.predict(args, doc)
    assert len(rows) == layouts
    errors = sorted(abs(r["error"]) for r in rows)
    assert errors[len(errors) // 2] <= 0.2, errors
    assert bench.spearman([r["predicted"] for r in rows], [r["measured"] for r in rows]) >= 0.8
    chosen = max(rows, key=lambda r: r["tokens_per_second"])
    assert chosen["measured"] <= 1.1 * min(r["measured"] for r in rows), chosen["layout"].describe()


def test_each_collective_kind_keeps_its_measured_bandwidth():
    from lightning_hybrid.planner.calibrate import calibrate_hardware, cpu_hardware

    sizes = [{"bytes": 1 << 20, "seconds": 1e-3}, {"bytes": 4 << 20, "seconds": 4e-3}]
    preflight = {"matmul": [{"tflops": 0.1}], "links": [
        {"test": kind, "link": "intra-node shared memory", "busbw_gbs": gbs, "sizes": sizes}
        for kind, gbs in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.25))]}
    hw = calibrate_hardware(cpu_hardware(0.1, 0.03, 4, 4, cores=4), preflight)
    assert dict(hw.collective_factors) == {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 0.5}
    latency = hw.latency(False)
    gather, scatter = (hw.collective(kind, 64e6, 4, False) - latency for kind in ("all_gather", "reduce_scatter"))
    assert scatter == pytest.approx(2 * gather)  # the same bus factor (n-1)/n, half the bandwidth


def test_oversubscribed_cpu_cores_add_scheduling_waits_to_blocking_collectives_only():
    from dataclasses import replace

    from lightning_hybrid.models import Qwen2Config
    from lightning_hybrid.planner.calibrate import CPU_SCHEDULING_WAIT_S, CPU_TIME_MODEL, cpu_hardware
    from lightning_hybrid.planner.search import Layout, Problem, estimate

    assert cpu_hardware(0.1, 0.03, 2, 2, cores=4).scheduling_wait_s == 0.0  # spare cores: no waiting for peers
    assert cpu_hardware(0.1, 0.03, 2, 2, cores=2).scheduling_wait_s == CPU_SCHEDULING_WAIT_S  # every core busy
    hw = cpu_hardware(0.1, 0.03, 4, 4, cores=2)
    assert hw.scheduling_wait_s == CPU_SCHEDULING_WAIT_S
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)

    def step(layout: Layout, wait: float) -> dict:
        problem = Problem(config, replace(hw, scheduling_wait_s=wait), 64, 8, "32-true", time_model=CPU_TIME_MODEL)
        return estimate(problem, layout).time

    base = dict(micro_batch_size=2, recompute="none", sequence_parallel=False)
    replicate = Layout(tp=1, pp=1, dp=4, data_parallel="replicate", microbatches=1, schedule="none", **base)
    assert step(replicate, 0.01) == step(replicate, 0.0)  # DDP's bucketed all-reduce: not between compute bursts
    tensor = Layout(tp=4, pp=1, dp=1, data_parallel="fsdp", microbatches=1, schedule="none", **base)
    # 4 blocks x 4 all-reduces (2 forward, 2 backward: one per fused q/k/v and gate/up GEMM, as traced) + the
    # embedding's all-reduce + the head's all-reduce and logits all-gather, per micro-batch: 6 ring steps per
    # all-reduce, 3 per all-gather
    assert step(tensor, 0.01)["tp_comm"] - step(tensor, 0.0)["tp_comm"] == pytest.approx((18 * 6 + 3) * 0.01)
    pipeline = Layout(tp=1, pp=2, dp=2, data_parallel="fsdp", microbatches=4, schedule="1f1b", **base)
    assert step(pipeline, 0.0)["tp_comm"] == 0.0  # with a core each, the steady state's transfers overlap
    # each rank receives once per micro-batch (activations or gradients), one wait each
    assert step(pipeline, 0.02)["tp_comm"] - step(pipeline, 0.01)["tp_comm"] == pytest.approx(4 * 0.01)
    fsdp = Layout(tp=1, pp=1, dp=4, data_parallel="fsdp", microbatches=2, schedule="none", **base)
    assert step(fsdp, 0.01)["dp_comm"] > step(fsdp, 0.0)["dp_comm"]  # no free core to hide the prefetch behind
