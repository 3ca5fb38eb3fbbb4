"""TrainingHealth: argument checks; a NaN step skipped on every rank equals a run that never applied it; a spike rolls
back in process and equals a run whose data never held the window; a run killed after a rollback and resumed skips it
again, bitwise; max_rollbacks stops with exit code 76; the consistency check names a replica one ulp off."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from helpers.launch import TESTS, launch
from lightning_hybrid.callbacks import EXIT_CODE_PREEMPTED, EXIT_CODE_UNHEALTHY, TrainingHealth

POISON_STEP, STEPS = 2, 5
CONSISTENCY = [dict(name="dp4-bump", tp=1, pp=1, data_parallel="replicate", bump_rank=2, bump_name="proj"),
               dict(name="dp2tp2-bump", tp=2, pp=1, data_parallel="replicate", bump_rank=3, bump_name="norm")]
LAYOUTS = {"tp2pp2": dict(tp=2, pp=2), "dp2tp2": dict(tp=2, pp=1, data_parallel="replicate")}
# A spike at step 3 (logits x 100, once); checkpoints every 2 steps: the rollback returns to step 2 and skips global
# batches 2 and 3 (samples 16..32 of the epoch's permutation), then trains on batches 4 and 5 up to step 4.
SPIKE = dict(tp=2, pp=2, steps=4, poison_step=3)
KILL = dict(name="tp2pp2-rollback-kill", mode="rollback-kill", kill_step=3, kill_rank=1, **SPIKE)


@pytest.mark.parametrize("kwargs, message", [
    (dict(on_nan="ignore"), "on_nan='ignore' is not a policy"),
    (dict(on_spike="explode"), "on_spike='explode' is not a policy"),
    (dict(on_nan="rollback ", on_spike="stop"), "on_nan='rollback ' is not a policy; use one of 'skip', 'rollback'"),
    (dict(rollback_after=0), "rollback_after=0 must be an integer >= 1"),
    (dict(skip_batches=0), "skip_batches=0 must be an integer >= 1"),
    (dict(spike_factor=1.0), "spike_factor=1.0 must be a finite number > 1.0"),
    (dict(spike_factor=float("nan")), "spike_factor=nan must be a finite number > 1.0"),
    (dict(window=1), "window=1 must be an integer >= 2"),
    (dict(window=2.5), "window=2.5 must be an integer >= 2"),
    (dict(spike_zscore=0), "spike_zscore=0 must be a finite number > 0.0"),
    (dict(max_rollbacks=-1), "max_rollbacks=-1 must be an integer >= 0"),
    (dict(recheck="yes"), "recheck='yes' must be True or False"),
    (dict(on_hardware="warn"), "on_hardware='warn' is not a policy; use 'stop' or 'skip'"),
    (dict(consistency_every_n_steps=0), "consistency_every_n_steps=0 must be an integer >= 1"),
])
def test_invalid_arguments_fail_in_one_line(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as info:
        TrainingHealth(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_spike_detection_uses_the_running_median_of_healthy_losses():
    health = TrainingHealth(spike_factor=2.0, window=3)
    health._healthy.extend([1.0, 4.0, 2.0])
    assert health.spike_ratio(5.0) == 2.5 and health._is_spike(5.0, 2.5)
    assert not health._is_spike(3.9, health.spike_ratio(3.9))
    health = TrainingHealth(spike_factor=100.0, window=3, spike_zscore=2.0)
    health._healthy.extend([1.0, 1.1, 0.9])
    assert health._is_spike(1.5, health.spike_ratio(1.5)) and not health._is_spike(1.1, health.spike_ratio(1.1))


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("health")
    configs = [{"name": f"{layout}-{mode}", "mode": mode, "steps": STEPS, "poison_step": POISON_STEP, **dims}
               for layout, dims in LAYOUTS.items() for mode in ("guard", "reference")]
    configs[0]["health"] = dict(recheck=True)  # tp2pp2-guard: the NaN batch is re-run before it is skipped
    configs += [{**c, "mode": "consistency", "steps": 3, "poison_step": 1} for c in CONSISTENCY]
    configs += [dict(name="dp4-hardware", mode="hardware", steps=STEPS, poison_step=POISON_STEP, fault_rank=2, tp=1,
                     pp=1)]
    configs += [dict(name="tp2pp2-rollback", mode="rollback", **SPIKE),
                dict(name="tp2pp2-window", mode="window-reference", window=[2, 3], **SPIKE),
                dict(name="tp2pp2-rollback-last1", mode="rollback", health=dict(skip_batches=1), **SPIKE),
                dict(name="tp2pp2-window3", mode="window-reference", window=[3], **SPIKE),
                dict(name="tp2pp2-stop", mode="rollback", health=dict(max_rollbacks=0), **SPIKE), KILL]
    (out / "configs.json").write_text(json.dumps(configs))
    # The last configuration SIGKILLs rank 1 after its rollback: the launch fails there, the others are done.
    killed = launch(4, [str(TESTS / "health_worker.py"), str(out / "configs.json"), str(out)], timeout=300,
                    check=False)
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert f"rank 1 exited with {-int(signal.SIGKILL)}" in killed.stderr, killed.stderr[-3000:]  # the fork launcher
    # Launched again, the processes run the killed configuration only (the others' records exist): it resumes.
    launch(4, [str(TESTS / "health_worker.py"), str(out / "configs.json"), str(out)], timeout=300,
           env={"HEALTH_RESUMED": "1"})
    return {c["name"]: torch.load(out / f"{c['name']}.pt", weights_only=False) for c in configs}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_nan_step_is_skipped_on_every_rank_like_a_run_that_never_applied_it(records, layout):
    guard, reference = records[f"{layout}-guard"], records[f"{layout}-reference"]
    assert [(e["step"], e["kind"], e["action"]) for e in guard["events"]] == [(POISON_STEP, "nan", "skip")]
    assert guard["skipped_steps"] == 1 and guard["guard_skipped"] == 1 and reference["guard_skipped"] == 0
    assert guard["losses"][POISON_STEP] != guard["losses"][POISON_STEP]  # the logged loss of that step is NaN
    # Nothing moved across the skipped step: weights bitwise, AdamW step counts of every rank.
    before, after = guard["around"][POISON_STEP - 1], guard["around"][POISON_STEP]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert guard["adam_steps"][POISON_STEP - 1] == guard["adam_steps"][POISON_STEP]
    assert all(torch.isfinite(w).all() for w in guard["final"].values())
    assert _max_diff(guard["final"], reference["final"]) < 1e-5
    others = [i for i in range(STEPS) if i != POISON_STEP]
    assert max(abs(guard["losses"][i] - reference["losses"][i]) for i in others) < 1e-5
    assert guard["metrics"]["health/skipped_steps"] == 1.0 and guard["metrics"]["health/grad_norm"] > 0
    assert guard["summary"] == (f"training health: {STEPS} steps checked, 1 non-finite, 0 loss spikes, "
                                f"1 steps skipped, 0 rollbacks")


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", CONSISTENCY, ids=[c["name"] for c in CONSISTENCY])
def test_the_consistency_check_names_the_replica_one_ulp_off(records, config):
    record = records[config["name"]]
    found = [e for e in record["events"] if e["kind"] == "inconsistent"]
    spans = "dp" if config["tp"] == 1 else "dp x tp"
    assert [(e["step"], e["dims"], e["ranks"], e["peers"]) for e in found] == [
        (2, spans.replace(" x ", "x"), [config["bump_rank"]], [r for r in range(4) if r != config["bump_rank"]])]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_spike_rolls_back_in_process_and_equals_a_run_whose_data_never_held_the_window(records):
    run, reference = records["tp2pp2-rollback"], records["tp2pp2-window"]
    assert [(e["step"], e["kind"], e["action"], e["to_step"], e["skipped"]) for e in run["events"]] == [
        (3, "spike", "rollback", 2, [0, 16, 32])]
    # No restart: the same processes from fit start to end on every rank, none counted by torchrun.
    assert run["restarts"] == 0 and all(before == after for before, after in run["pids"])
    assert run["summary"].endswith("1 loss spikes, 1 steps skipped, 1 rollbacks")
    assert run["metrics"]["health/rollbacks"] == 1.0 and run["global_step"] == reference["global_step"] == 4
    assert run["losses"][3] > 3 * run["losses"][2]  # the spike, then the losses of the run without the window
    assert run["losses"][:2] + run["losses"][4:] == pytest.approx(reference["losses"], abs=1e-5)
    assert _max_diff(run["final"], reference["final"]) < 1e-5
    # The window is in the manifest of the checkpoint returned to and of every later one.
    assert run["manifests"]["step-000002"]["skips"] == [[0, 16, 32]]
    assert run["manifests"]["step-000004"]["skips"] == [[0, 16, 32]]
    assert run["manifests"]["step-000004"]["samples_in_epoch"] == 48 and len(run["rollback_seconds"]) == 1


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_run_killed_after_a_rollback_resumes_skipping_the_window_again_bitwise(records):
    uninterrupted, resumed = records["tp2pp2-rollback"], records[KILL["name"]]
    assert resumed["events"] == []  # resumed from step 2: no spike seen again, the window left out by the sampler
    assert resumed["manifests"]["step-000004"]["skips"] == [[0, 16, 32]]
    assert resumed["global_step"] == 4 and resumed["losses"] == uninterrupted["losses"][4:]
    assert all(torch.equal(resumed["final"][k], uninterrupted["final"][k]) for k in uninterrupted["final"])


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_spike_beyond_max_rollbacks_saves_and_stops_with_exit_code_76(records):
    stopped = records["tp2pp2-stop"]
    assert EXIT_CODE_UNHEALTHY == stopped["exit_code"] == 76 != EXIT_CODE_PREEMPTED
    assert [(e["step"], e["kind"], e["action"]) for e in stopped["events"]] == [(3, "spike", "stop")]
    assert "max_rollbacks=0 reached" in stopped["message"] and "checkpoint saved" in stopped["message"]
    assert stopped["global_step"] == 4 and "step-000004" in stopped["manifests"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_recheck_blames_a_deterministic_bad_batch_on_the_data_and_leaves_the_run_as_without_it(records):
    run, reference = records["tp2pp2-guard"], records["tp2pp2-reference"]
    assert [(e["step"], e["kind"], e["action"], e["cause"]) for e in run["events"]] == [
        (POISON_STEP, "nan", "skip", "data")]
    assert _max_diff(run["final"], reference["final"]) < 1e-5  # the re-run changed nothing of the trajectory


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_recheck_reports_a_fault_on_one_rank_first_execution_as_hardware_naming_it(records):
    import socket

    run = records["dp4-hardware"]
    assert [(e["step"], e["kind"], e["action"], e["cause"], e["ranks"]) for e in run["events"]] == [
        (POISON_STEP, "nan", "stop", "hardware", [2])]
    assert run["exit_code"] == EXIT_CODE_UNHEALTHY
    assert f"hardware suspected: rank 2 ({socket.gethostname()}) computed another result" in run["message"]


def _global_batches(dp: int, resume: int, skips: list) -> list[set]:
    """The global batches (sets of sample indices) that ``dp`` resumable samplers yield together."""
    from lightning_hybrid.data.sampler import ResumableDistributedSampler

    per_rank = []
    for rank in range(dp):
        sampler = ResumableDistributedSampler(list(range(48)), num_replicas=dp, rank=rank, seed=5)
        if resume:
            sampler.resume_from(0, resume, counted=resume)
        for skip in skips:
            sampler.add_skip(*skip)
        sampler.set_epoch(0)
        per_rank.append(list(sampler))
    size = 8 // dp
    steps = len(per_rank[0]) // size
    return [set().union(*(chunk[k * size:(k + 1) * size] for chunk in per_rank)) for k in range(steps)]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_the_sampler_leaves_a_skipped_range_out_the_same_on_any_number_of_dp_ranks(dp):
    order = torch.randperm(48, generator=torch.Generator().manual_seed(5)).tolist()
    blocks = [set(order[k * 8:(k + 1) * 8]) for k in range(6)]
    assert _global_batches(dp, 0, [(0, 16, 32)]) == [blocks[0], blocks[1], blocks[4], blocks[5]]
    # Resumed at the start of the range (the checkpoint a rollback returned to): it goes on after the range.
    assert _global_batches(dp, 16, [(0, 16, 32)]) == [blocks[4], blocks[5]]
    assert _global_batches(dp, 16, [(1, 16, 32)]) == blocks[2:]  # another epoch's range is not this one's


def test_the_data_position_passes_over_left_out_ranges_and_counts_only_what_was_trained():
    from lightning_hybrid.data.sampler import ResumableDistributedSampler

    sampler = ResumableDistributedSampler(list(range(48)), num_replicas=2, rank=0, seed=5)
    sampler.resume_from(0, 16, counted=16)
    sampler.add_skip(0, 16, 32)
    sampler.add_skip(0, 40, 48)
    list(sampler)
    # Lightning counted 16 samples at the resume, then 8 more were trained on (global positions 32..40).
    assert [sampler.position(c) for c in (16, 24)] == [16, 40]
    sampler.add_skip(0, 8, 16)  # recorded during an iteration: that iteration is unchanged
    assert sampler.position(24) == 40 and sampler.skips == [(0, 16, 32), (0, 40, 48), (0, 8, 16)]
    with pytest.raises(ValueError, match=r"skip range \[3, 9\) must be non-empty and on multiples of the 2"):
        sampler.add_skip(0, 3, 9)


def test_a_rollback_writes_the_skipped_range_into_every_committed_manifest_which_still_verifies(tmp_path):
    from lightning_hybrid.checkpoint.manifest import file_record, read_manifest, record_skips, write_manifest
    from lightning_hybrid.checkpoint.verify import verify_checkpoint

    for step in (2, 4):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "shard").write_bytes(b"x" * step)
        write_manifest(folder, {"shard": file_record(folder / "shard")},
                       {"step": step, "data_position": {"epoch": 0, "samples_in_epoch": 8 * step}})
    (tmp_path / "step-000006.tmp").mkdir()  # not committed: left alone
    assert record_skips(tmp_path, [[0, 16, 32]]) == [tmp_path / "step-000004", tmp_path / "step-000002"]
    record_skips(tmp_path, [[0, 16, 32], [1, 0, 8]])
    for step in (2, 4):
        verify_checkpoint(tmp_path / f"step-{step:06d}")
        assert read_manifest(tmp_path / f"step-{step:06d}")["data_position"]["skips"] == [[0, 16, 32], [1, 0, 8]]


def test_norm_clipping_takes_the_global_norm_training_health_computed_instead_of_all_reducing_again(monkeypatch):
    from types import SimpleNamespace

    from lightning_hybrid.distributed import clip_grad

    plugin = SimpleNamespace()
    clip_grad.use_global_norm_clipping(plugin, 1)
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 3.0)  # norm 6
    optimizer = torch.optim.SGD([param], lr=0.1)
    trainer = SimpleNamespace(strategy=SimpleNamespace(precision_plugin=plugin, world_size=1), gradient_clip_val=1.0,
                              gradient_clip_algorithm=None)
    health = TrainingHealth()
    trainer.callback_metrics = {"train_loss": torch.tensor(2.5)}
    assert health._measure(trainer, None, optimizer) == (False, 2.5, pytest.approx(6.0))

    def no_second_norm(*args, **kwargs):
        raise AssertionError("the clipping computed the norm again")

    monkeypatch.setattr(clip_grad, "global_grad_norm", no_second_norm)
    plugin.clip_grad_by_norm(optimizer, 1.0)
    assert plugin.hybrid_step_norm.reused == 1 and float(param.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(AssertionError, match="computed the norm again"):  # nothing handed: it computes its own
        plugin.clip_grad_by_norm(optimizer, 1.0)
    trainer.gradient_clip_val = None  # clipping off: nothing is handed, so nothing stale is left for later
    monkeypatch.undo()
    health._measure(trainer, None, optimizer)
    assert plugin.hybrid_step_norm.take() is None


def test_bad_steps_in_a_row_beyond_rollback_after_escalate_from_skip_to_rollback():
    from types import SimpleNamespace

    skips = []
    strategy = SimpleNamespace(world_size=1, precision_plugin=SimpleNamespace(),
                               skip_next_optimizer_step=lambda: skips.append(1))
    trainer = SimpleNamespace(strategy=strategy, callback_metrics={"train_loss": torch.tensor(float("nan"))},
                              global_step=0, is_global_zero=True, loggers=[], gradient_clip_val=None,
                              gradient_clip_algorithm=None)
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    health = TrainingHealth(rollback_after=2)
    health._checkpointer = object()  # a FaultTolerantCheckpoint is there to return to
    for step in range(3):
        trainer.global_step = step
        health.on_before_optimizer_step(trainer, None, torch.optim.SGD([param], lr=0.1))
    assert [e["action"] for e in health.events] == ["skip", "skip", "rollback"] and len(skips) == 3
    assert health._pending is health.events[-1]  # done at the end of the step, on every rank together


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_rollback_with_skip_batches_reads_the_batches_before_the_window_again(records):
    run, reference = records["tp2pp2-rollback-last1"], records["tp2pp2-window3"]
    assert [(e["step"], e["action"], e["to_step"], e["skipped"]) for e in run["events"]] == [
        (3, "rollback", 2, [0, 24, 32])]
    # Batch 2 trained twice (before and after the rollback, from the same state), batch 3 never again, then 4.
    assert run["losses"][:2] + run["losses"][4:] == pytest.approx(reference["losses"], abs=1e-5)
    assert run["losses"][2] == pytest.approx(run["losses"][4], abs=1e-6)
    assert _max_diff(run["final"], reference["final"]) < 1e-5
    assert run["manifests"]["step-000004"]["skips"] == [[0, 24, 32]]
