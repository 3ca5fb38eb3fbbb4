"""tp="auto", pp="auto", ...: the planner picks the layout at setup; it trains like one process; resumes keep or
re-plan it; bad requests fail early with one line."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from user_module import UserTPModule

from helpers.compare import TOL, assert_trains_like
from helpers.launch import run_workers
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.distributed.parallel_dims import ParallelSizeError
from lightning_hybrid.models import CausalLM, Qwen2Config
from lightning_hybrid.planner.auto import TrainingShape, apply_layout, check_auto_request, plan_layout
from lightning_hybrid.planner.calibrate import calibrate_hardware, cpu_gpu_entry
from lightning_hybrid.planner.step_time import Hardware

AUTO = dict(tp="auto", pp="auto")


def _cpu(world: int, memory_gb: float = 8.0) -> Hardware:
    return Hardware(cpu_gpu_entry(0.05, 0.02, memory_gb), world, world, compute_efficiency=1.0, link_efficiency=1.0)


@pytest.fixture(scope="module")
def auto_runs(tmp_path_factory):
    """One 2-process launch writes a checkpoint under auto; one 4-process launch runs every auto configuration."""
    out = tmp_path_factory.mktemp("auto")
    two = run_workers(2, [{"name": "auto_w2_saved", **AUTO, "save_at": 2, "stop_after_save": True}], out / "two")
    four = run_workers(4, [
        {"name": "auto", **AUTO},
        {"name": "tp2_pp_auto", "tp": 2, "pp": "auto", "preflight": True},  # planned with measured links
        {"name": "resume_keeps_manifest", "tp": 2, "pp": 2, "save_at": 2, "resume_config": AUTO},
        {"name": "resume_w2_on_w4", **AUTO, "load_from": str(out / "two" / "ckpt_auto_w2_saved")},
    ], out / "four", timeout=420)
    return {**two, **four}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_auto_on_4_processes_every_rank_takes_the_planners_top_choice_and_trains_like_one_process(
        auto_runs, reference_run):
    record = auto_runs["auto"]
    layouts = record["auto"]
    assert len(layouts) == 4 and all(layout == layouts[0] for layout in layouts), layouts
    assert layouts[0]["source"] == "planner" and layouts[0]["tp"] * layouts[0]["pp"] * layouts[0]["dp"] == 4
    assert "chosen" in record["auto_table"] and "runner-up" in record["auto_table"]
    assert_trains_like(record, reference_run)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_tp2_with_pp_auto_searches_only_the_rest_with_the_preflight_calibrating_the_planner(auto_runs, reference_run):
    record = auto_runs["tp2_pp_auto"]
    assert all(layout["tp"] == 2 and layout["pp"] * layout["dp"] == 2 for layout in record["auto"])
    assert "links and matmul from the preflight" in record["auto_table"]
    assert_trains_like(record, reference_run)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_resume_under_auto_keeps_the_manifest_layout(auto_runs, reference_run):
    record = auto_runs["resume_keeps_manifest"]
    layout = record["auto"][0]
    assert (layout["tp"], layout["pp"], layout["dp"]) == (2, 2, 1), layout
    assert layout["source"].startswith("checkpoint manifest")
    assert_trains_like(record, reference_run)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_resume_on_another_world_size_replans_and_continues_with_equal_losses(auto_runs, reference_run):
    saved, resumed = auto_runs["auto_w2_saved"], auto_runs["resume_w2_on_w4"]
    assert saved["auto"][0]["tp"] * saved["auto"][0]["pp"] * saved["auto"][0]["dp"] == 2
    layout = resumed["auto"][0]
    assert layout["source"] == "planner" and layout["tp"] * layout["pp"] * layout["dp"] == 4
    assert "re-planned" in resumed["auto_table"] and "world size 2" in resumed["auto_table"]
    losses = saved["losses"] + resumed["losses"]
    assert len(losses) == len(reference_run["losses"])
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_run["losses"]))
    assert err < TOL, (losses, reference_run["losses"])


# ----------------------------------------------------------------------------- planning (one process)


def test_plan_picks_the_fastest_fitting_layout_and_names_the_runner_up():
    plan = plan_layout(ParallelOptions(**AUTO), Qwen2Config.from_preset("tiny"), _cpu(4), TrainingShape(16, 8, True),
                       "32-true")
    ranked = sorted([plan.chosen, plan.runner_up], key=lambda e: -e.tokens_per_second)
    assert ranked[0] is plan.chosen and plan.considered >= 2
    assert "why:" in plan.table() and plan.chosen.layout.describe() in plan.table()


def test_fixed_values_are_kept_and_only_auto_ones_are_searched():
    options = ParallelOptions(tp=2, pp="auto", activation_checkpointing="auto")
    plan = plan_layout(options, Qwen2Config.from_preset("tiny"), _cpu(8), TrainingShape(16, 8, True), "32-true")
    assert plan.chosen.layout.tp == 2 and plan.chosen.layout.data_parallel in ("fsdp", "replicate")
    resolved = apply_layout(options, plan.summary())
    assert resolved.tp == 2 and resolved.pp == plan.chosen.layout.pp and resolved.data_parallel == "fsdp"
    assert resolved.activation_checkpointing == plan.chosen.layout.recompute


def test_a_per_rank_batch_is_ranked_by_tokens_per_second():
    # with the DataLoader's batch per dp rank the global batch grows with dp: the planner compares tokens/s
    plan = plan_layout(ParallelOptions(**AUTO), Qwen2Config.from_preset("tiny"), _cpu(4), TrainingShape(16, 2, False),
                       "32-true")
    lay = plan.chosen.layout
    assert lay.micro_batch_size * lay.microbatches == 2


def test_nothing_fits_quotes_the_best_attempt_and_what_to_change():
    with pytest.raises(ValueError, match=r"no layout fits in .* GB per device; the planner's best attempt \(tp=") as e:
        plan_layout(ParallelOptions(**AUTO), Qwen2Config.from_preset("qwen2.5-7b"), _cpu(4, memory_gb=2.0),
                    TrainingShape(4096, 8, True), "32-true")
    assert "\n" not in str(e.value) and "use more devices" in str(e.value)


def test_preflight_report_calibrates_matmul_and_links():
    doc = {"matmul": [{"tflops": 0.1}, {"tflops": 0.3}, {"tflops": 0.2}],
           "links": [{"link": "intra-node shared memory", "busbw_gbs": 2.0,
                      "sizes": [{"bytes": 1 << 20, "seconds": 1e-3}, {"bytes": 4 << 20, "seconds": 2.5e-3}]}]}
    hw = calibrate_hardware(_cpu(4), doc)
    assert hw.peak_flops("32-true") == pytest.approx(0.2e12) and hw.bus_bandwidth(False) == pytest.approx(2e9)
    assert hw.latency(False) == pytest.approx(1e-3 - (1.5e-3 / (3 << 20)) * (1 << 20))


# ----------------------------------------------------------------------------- errors, raised before any collective


def _fit_one_process(module, **options):
    trainer = L.Trainer(strategy=HybridParallelStrategy(**options), devices=1, accelerator="cpu", max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 8, dtype=torch.long)),
                                       batch_size=2)
    trainer.fit(module, train_dataloaders=data)


def test_auto_with_a_module_that_declares_no_model_is_refused():
    with pytest.raises(ValueError, match=r"tp='auto', pp='auto' needs a LightningModule that declares its model"):
        _fit_one_process(UserTPModule(), **AUTO)  # parallelizes itself: no config to plan


def test_auto_with_split_points_for_another_pp_is_refused():
    with pytest.raises(ValueError, match=r"pp_split_points=\['layers.2'\] fix 2 pipeline stages.* pp can only be 1"):
        _fit_one_process(CausalLM("tiny"), pp="auto", pp_split_points=["layers.2"])
    with pytest.raises(ValueError, match="fix 2 pipeline stages, but with pp='auto' on 4 processes pp can only be 1"):
        check_auto_request(ParallelOptions(tp=4, pp="auto", pp_split_points=["layers.2"]),
                           Qwen2Config.from_preset("tiny"), 4, 4, "CausalLM")


def test_auto_options_are_validated_on_construction():
    with pytest.raises(ValueError, match=r"tp='Auto2' must be a positive integer or 'auto'"):
        HybridParallelStrategy(tp="Auto2")
    assert HybridParallelStrategy(tp="AUTO").options.tp == "auto"


def test_the_cli_pre_launch_check_leaves_an_auto_layout_to_setup():
    """`lightning-hybrid fit` with `tp: auto` reached check_options before launch, which refused 'auto' as a size."""
    from lightning_hybrid.cli import check_before_launch

    trainer = L.Trainer(strategy=HybridParallelStrategy(**AUTO, microbatches="auto"), accelerator="cpu", devices=4,
                        logger=False, enable_checkpointing=False)
    check_before_launch(trainer, CausalLM("tiny"), None)  # nothing to refuse: planned at setup
    trainer = L.Trainer(strategy=HybridParallelStrategy(tp=3), accelerator="cpu", devices=4, logger=False,
                        enable_checkpointing=False)
    with pytest.raises(ParallelSizeError, match=r"tp\*pp=3\*1=3"):
        check_before_launch(trainer, CausalLM("tiny"), None)  # fixed sizes are still checked before launch
