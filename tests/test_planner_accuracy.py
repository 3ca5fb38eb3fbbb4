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
