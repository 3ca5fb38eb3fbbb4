"""The planner's float8 time model: efficiencies fitted on torchtitan's and Megatron-Bridge's published float8 rows,
and ``plan --float8``.

The bf16 rows and their thresholds are tests/test_planner_published.py's; the float8 rows are a separate table.
"""

from __future__ import annotations

import json

import pytest
from test_planner_published import load_benchmark

from lightning_hybrid.planner.cli import run_plan
from lightning_hybrid.planner.step_time import FLOAT8_GEMM_EFFICIENCY

# Every float8 row, context parallel included (torch's ring per step, planner/context_parallel.py), within 20%.
FLOAT8_MEDIAN, FLOAT8_MAX = 0.10, 0.20


@pytest.fixture(scope="module")
def bench():
    return load_benchmark()


def test_float8_rows_are_predicted_within_the_thresholds(bench):
    rows = bench.float8_table()
    assert len(rows) == len(bench.FLOAT8_RUNS) == 25
    assert bench.summary(rows)["median_abs_error"] <= FLOAT8_MEDIAN, bench.format_table(rows)
    assert bench.summary(rows)["max_abs_error"] <= FLOAT8_MAX, bench.format_table(rows)
    sources = {run.source.split(" ")[0] for run in bench.FLOAT8_RUNS}
    assert sources == {"pytorch/torchtitan", "NVIDIA-NeMo/Megatron-Bridge"}
    for run in bench.FLOAT8_RUNS:
        assert run.runtime.float8 in ("tensorwise", "rowwise", "mxfp8") and run.source and run.stated


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_float8_efficiency_is_the_fitted_value(bench, recipe):
    assert bench.fit_float8(recipe) == pytest.approx(FLOAT8_GEMM_EFFICIENCY[recipe], abs=0.002)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_transformer_engine_efficiency_is_fitted_on_megatron_bridge_rows(bench, recipe):
    fitted = bench.fit_float8(recipe, kernels="transformer-engine")
    assert fitted == pytest.approx(bench.TRANSFORMER_ENGINE_FLOAT8_EFFICIENCY[recipe], abs=0.002)
    assert fitted > FLOAT8_GEMM_EFFICIENCY[recipe]  # TE's fused casts beat torchao's separate ones


def test_float8_changes_only_the_block_gemms(bench):
    """Same layout, float8 on: compute falls, memory and the MFU's bf16 reference peak stay."""
    import dataclasses

    run = bench.FLOAT8_RUNS[0]
    bf16 = bench.predict(dataclasses.replace(run, runtime=dataclasses.replace(run.runtime, float8=None)))
    f8 = bench.predict(run)
    assert f8.time["compute"] < bf16.time["compute"] and f8.memory == bf16.memory
    assert f8.mfu / bf16.mfu == pytest.approx(bf16.time["step"] / f8.time["step"])


def test_plan_float8_rowwise_predicts_and_says_mfu_is_against_bf16(capsys):
    argv = ["--model", "qwen2.5-72b", "--gpus", "128", "--gpu", "b300", "--seq-len", "4096", "--global-batch", "1024"]
    assert run_plan(argv + ["--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert run_plan(argv + ["--float8", "mxfp8", "--json"]) == 0
    mx = json.loads(capsys.readouterr().out)
    assert run_plan(argv + ["--float8", "rowwise", "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "float8=rowwise" in text and "MFU is quoted against the bf16 peak (2250 TFLOP/s)" in text
    best = lambda doc: doc["layouts"][0]["tokens_per_second"]  # noqa: E731
    assert best(mx) > 1.15 * best(bf16)
