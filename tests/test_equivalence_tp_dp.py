"""Same math at any mesh: TP x DP training matches one process (losses, final weights, initial weights)."""

from __future__ import annotations

import pytest
import torch

from equivalence_setup import max_relative_error, run_reference
from launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOL = 1e-5


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    configs = [
        {"name": "tp2", "tp": 2},
        {"name": "dp2_fsdp", "tp": 1, "data_parallel": "fsdp"},
        {"name": "dp2_replicate", "tp": 1, "data_parallel": "replicate"},
        {"name": "tp2_sequence_parallel", "tp": 2, "sequence_parallel": True},
        {"name": "tp2_after_preflight", "tp": 2, "preflight": True},
        {"name": "user_module_dp2", "module": "model_parallel_user", "tp": 1},
        {"name": "user_module_tp2", "module": "model_parallel_user", "tp": 2},
    ]
    return run_workers(2, configs, tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def four_process_runs(tmp_path_factory):
    configs = [
        {"name": "tp2_dp2_fsdp", "tp": 2, "data_parallel": "fsdp"},
        {"name": "tp2_dp2_replicate", "tp": 2, "data_parallel": "replicate"},
        {"name": "tp2_dp2_fsdp_clip", "tp": 2, "data_parallel": "fsdp", "trainer": {"gradient_clip_val": 0.05}},
    ]
    return run_workers(4, configs, tmp_path_factory.mktemp("four"))


def _check(record, reference):
    err = max_relative_error(record, reference)
    assert err["loss"] < TOL, (err, record["losses"], reference["losses"])
    assert err["weights"] < TOL, err
    # The run really trained: weights moved well beyond the tolerance.
    moved = max(float((reference["final"][k] - v).norm() / v.norm()) for k, v in reference["initial"].items())
    assert moved > 1e-3


def test_loss_and_weights_match_single_process_with_tp2(two_process_runs, reference_run):
    _check(two_process_runs["tp2"], reference_run)


def test_preflight_on_the_training_mesh_then_training_like_one_process(two_process_runs, reference_run):
    _check(two_process_runs["tp2_after_preflight"], reference_run)


def test_loss_and_weights_match_single_process_with_tp2_sequence_parallel(two_process_runs, reference_run):
    _check(two_process_runs["tp2_sequence_parallel"], reference_run)


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_loss_and_weights_match_single_process_with_dp2(two_process_runs, reference_run, mode):
    _check(two_process_runs[f"dp2_{mode}"], reference_run)


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_loss_and_weights_match_single_process_with_tp2_dp2(four_process_runs, reference_run, mode):
    _check(four_process_runs[f"tp2_dp2_{mode}"], reference_run)


def test_validation_loss_matches_single_process(two_process_runs, four_process_runs, reference_run):
    for name in ("tp2", "dp2_fsdp", "dp2_replicate"):
        assert abs(two_process_runs[name]["val_loss"] - reference_run["val_loss"]) / reference_run["val_loss"] < TOL
    assert abs(four_process_runs["tp2_dp2_fsdp"]["val_loss"] - reference_run["val_loss"]) / reference_run["val_loss"] < TOL


def test_initial_weights_are_identical_on_every_mesh(two_process_runs, four_process_runs, reference_run):
    for name in ("tp2", "dp2_fsdp", "dp2_replicate", "tp2_sequence_parallel"):
        record = two_process_runs[name]
        for key, value in reference_run["initial"].items():
            assert torch.equal(record["initial"][key], value), (name, key)
    for key, value in reference_run["initial"].items():
        assert torch.equal(four_process_runs["tp2_dp2_fsdp"]["initial"][key], value), key


@pytest.fixture(scope="module")
def clipped_reference():
    return run_reference(gradient_clip_val=0.05)


def test_gradient_clipping_matches_single_process_with_tp2_dp2(four_process_runs, clipped_reference, reference_run):
    _check(four_process_runs["tp2_dp2_fsdp_clip"], clipped_reference)
    # the clip was active: the clipped run differs from the unclipped one
    assert max_relative_error(clipped_reference, reference_run)["weights"] > 1e-3


def test_module_written_for_model_parallel_strategy_trains_like_one_process(two_process_runs):
    from user_module import UserTPModule

    reference = run_reference(module_factory=UserTPModule)
    for name in ("user_module_dp2", "user_module_tp2"):
        _check(two_process_runs[name], reference)
