"""The planner predicts what the configured strategy does: Runtime from the strategy's options, `plan --config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_hybrid.planner.cli import run_plan
from lightning_hybrid.planner.runtime import runtime_from_options
from lightning_hybrid.planner.step_time import Runtime

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_the_planners_option_defaults_are_the_strategys():
    import inspect

    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.planner.runtime import RUNTIME_OPTIONS

    signature = inspect.signature(HybridParallelStrategy.__init__).parameters
    assert {name: signature[name].default for name in RUNTIME_OPTIONS} == RUNTIME_OPTIONS
    default = runtime_from_options({}, "bf16-mixed")
    assert default.loss_parallel and default.low_precision_params and not default.fsdp_regather
    assert not default.fused_elementwise and not default.tp_overlap and default.float8 is None
    assert runtime_from_options(None, "32-true") == Runtime(loss_parallel=True, fsdp_regather=False)


@pytest.mark.parametrize("options, field, value", [
    ({"compile": True}, "fused_elementwise", True),
    ({"async_tp": True}, "tp_overlap", True),
    ({"loss_parallel": False}, "loss_parallel", False),
    ({"bf16_compute_weights": False}, "low_precision_params", False),
    ({"fsdp_reshard_after_forward": "auto"}, "fsdp_regather", False),
    ({"fsdp_reshard_after_forward": False}, "fsdp_regather", False),
    ({"fsdp_reshard_after_forward": True}, "fsdp_regather", True),
    ({"float8": "rowwise"}, "float8", "rowwise"),
    ({"tp": 8, "timeout": "0:30:00"}, "fused_elementwise", False),  # layout and launch options change no runtime
])
def test_each_strategy_option_switches_its_runtime_feature(options, field, value):
    runtime = runtime_from_options(options, "bf16-mixed")
    assert getattr(runtime, field) == value
    others = {k: v for k, v in vars(runtime).items() if k != field}
    default = runtime_from_options({}, "bf16-mixed")
    assert others == {k: v for k, v in vars(default).items() if k != field}


def test_bf16_true_runs_on_bf16_weights_and_bf16_compute_weights_need_a_bf16_precision():
    assert runtime_from_options({}, "bf16-true").low_precision_params
    assert not runtime_from_options({"bf16_compute_weights": True}, "32-true").low_precision_params


def test_an_unknown_reshard_value_is_refused():
    with pytest.raises(ValueError, match=r"fsdp_reshard_after_forward='sometimes'; use True, False or 'auto'"):
        runtime_from_options({"fsdp_reshard_after_forward": "sometimes"})


def _plan_json(capsys, *argv):
    code = run_plan(["--config", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_plan_config_plans_the_recipes_own_layout_beside_the_fastest(capsys):
    code, doc = _plan_json(capsys, str(RECIPES / "qwen2.5-72b-pretrain.yaml"))
    assert code == 0
    assert {"gpus", "gpu", "precision", "seq_len", "global_batch", "runtime", "recipe", "fastest"} <= doc.keys()
    assert (doc["gpus"], doc["gpu"], doc["precision"], doc["seq_len"], doc["global_batch"]) == (
        128, "b300", "bf16-mixed", 4096, 1024)
    layout = doc["recipe"]["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["data_parallel"]) == (8, 2, 8, "fsdp")
    assert (layout["microbatches"], layout["micro_batch_size"], layout["recompute"], layout["sequence_parallel"]) == (
        128, 1, "selective", True)
    for key in ("mfu", "time_s", "memory_gb", "fits"):
        assert key in doc["recipe"] and key in doc["fastest"]
    assert doc["recipe"]["fits"]
    assert doc["fastest"]["time_s"]["step"] <= doc["recipe"]["time_s"]["step"]


# The runtime options of issue #28 that the 72B pre-training recipe sets.
RUNTIME_WORK = {"compile": True, "loss_parallel": True, "async_tp": True, "fsdp_reshard_after_forward": "auto",
                "bf16_compute_weights": True}


def test_plan_config_predicts_the_seeds_mfu_for_the_72b_recipe(capsys):
    import yaml

    recipe = RECIPES / "qwen2.5-72b-pretrain.yaml"
    init_args = yaml.safe_load(recipe.read_text())["trainer"]["strategy"]["init_args"]
    assert {key: init_args.get(key) for key in RUNTIME_WORK} == RUNTIME_WORK
    _, plan = _plan_json(capsys, str(recipe), "--gpu", "b300")
    assert plan["recipe"]["fits"] and plan["recipe"]["mfu"] >= 0.45, plan["recipe"]["mfu"]


def test_plan_config_follows_the_recipes_runtime_options(tmp_path, capsys):
    text = (RECIPES / "qwen2.5-72b-pretrain.yaml").read_text()
    _, on = _plan_json(capsys, str(RECIPES / "qwen2.5-72b-pretrain.yaml"))
    import yaml

    doc = yaml.safe_load(text)
    doc["trainer"]["strategy"]["init_args"].update(compile=False, loss_parallel=False, async_tp=False,
                                                   fsdp_reshard_after_forward=True, bf16_compute_weights=False)
    off_recipe = tmp_path / "off.yaml"
    off_recipe.write_text(yaml.safe_dump(doc))
    _, off = _plan_json(capsys, str(off_recipe), "--gpu", "b300", "--no-fused-projections")
    assert not any(off["runtime"].values())
    assert off["recipe"]["time_s"]["step"] > on["recipe"]["time_s"]["step"]


def test_plan_config_takes_the_gpu_from_the_flag_over_the_header(capsys):
    _, doc = _plan_json(capsys, str(RECIPES / "qwen2.5-72b-pretrain.yaml"), "--gpu", "h100")
    assert doc["gpu"] == "h100"


def test_plan_config_text_report_and_explain_list_the_runtime_features(capsys):
    assert run_plan(["--config", str(RECIPES / "qwen2.5-72b-pretrain.yaml"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "runtime features: fused_elementwise (compile) " in out
    assert "recipe : tp=8 pp=2 dp=8" in out and "fastest: " in out and "step time of tp=8 pp=2" in out


def test_plan_explain_without_config_lists_the_runtime_features(capsys):
    run_plan("--model qwen2.5-7b --gpus 8 --gpu h100 --seq-len 2048 --explain".split())
    assert "runtime features: fused_elementwise (compile) off" in capsys.readouterr().out


def test_plan_config_bad_recipe_is_one_line(tmp_path, capsys):
    assert run_plan(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.strip().endswith("missing.yaml: no such file")


def test_a_flag_beside_config_replaces_the_recipes_value_and_the_plan_says_where_each_value_came_from(capsys):
    recipe = str(RECIPES / "qwen2.5-72b-pretrain.yaml")
    _, doc = _plan_json(capsys, recipe, "--float8", "rowwise", "--seq-len", "2048", "--gpu-memory-gb", "400")
    assert doc["runtime"]["float8 (rowwise)"] and doc["seq_len"] == 2048
    assert doc["sources"]["float8"] == {"value": "rowwise", "from": "--float8; the recipe's: none"}
    assert doc["sources"]["seq_len"] == {"value": 2048, "from": "--seq-len; the recipe's: 4096"}
    assert doc["sources"]["model"] == {"value": "qwen2.5-72b", "from": "recipe model.model"}
    assert doc["sources"]["gpu_memory_gb"] == {"value": 400.0, "from": "--gpu-memory-gb; no recipe value"}
    assert doc["recipe"]["usable_gb"] == pytest.approx((400 - 4) * 0.95)  # the hardware flag applies to the recipe
    # a float8 recipe planned without float8, in the text report
    assert run_plan(["--config", str(RECIPES / "qwen2.5-72b-pretrain-fp8.yaml"), "--float8", "none"]) == 0
    out = capsys.readouterr().out
    assert "float8 none (--float8; the recipe's: mxfp8)" in out and "float8 (None) off" in out


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "64"], "--gpus 64 cannot apply with --config: the recipe's trainer.devices x trainer.num_nodes set"),
    (["--gpus-per-node", "4"], "--gpus-per-node 4 cannot apply with --config"),
    (["--top", "3"], "--top 3 cannot apply with --config"),
    (["--explain", "8,1,fsdp"], "--explain 8,1,fsdp cannot apply with --config"),
    (["--global-batch", "100"], "--global-batch 100 does not split into the recipe's dp=8 x 128 micro-batches"),
    (["--seq-len", "0"], "--seq-len=0 must be positive"),
    # float8 under a precision the strategy refuses it in (it planned 472.9% MFU against the fp32 peak before)
    (["--float8", "rowwise", "--precision", "32-true"], "float8='rowwise' with precision='32-true' is not supported"),
])
def test_a_flag_that_cannot_apply_beside_config_is_a_one_line_error(flags, message, capsys):
    assert run_plan(["--config", str(RECIPES / "qwen2.5-72b-pretrain.yaml"), *flags]) == 2
    captured = capsys.readouterr()
    assert not captured.out and len(captured.err.strip().splitlines()) == 1 and message in captured.err, captured.err


def test_float8_under_a_precision_the_strategy_refuses_is_one_line_without_a_recipe_too(capsys):
    assert run_plan("--model qwen2.5-7b --gpus 8 --float8 mxfp8 --precision 32-true".split()) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err.strip().splitlines() == [
        "lightning-hybrid plan: error: float8='mxfp8' with precision='32-true' is not supported: float8 matmuls take "
        "bf16 activations; use precision='bf16-mixed' or 'bf16-true'"]
