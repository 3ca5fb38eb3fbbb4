"""Same math at any mesh, with context parallelism and HSDP: losses and final weights equal one process (< 1e-5).

Three launches: 2 processes (cp2), 4 processes (cp2 x tp2, cp2 x pp2, cp2 x dp2 twice, hsdp 2 x 2, and a
checkpoint saved at cp2 x tp2 resumed at cp1 and at hsdp), 8 processes (cp2 x tp2 x pp2, hsdp 2 x 2 x tp2). The
sequence (16 tokens) splits into 2 * cp chunks; the global batch and data order are those of the one-process reference.
"""

from __future__ import annotations

import pytest

from helpers.compare import assert_trains_like, same_tensors
from helpers.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cp_two(tmp_path_factory):
    return run_workers(2, [{"name": "cp2", "cp": 2}], tmp_path_factory.mktemp("cp_two"))


@pytest.fixture(scope="module")
def cp_four(tmp_path_factory):
    configs = [
        {"name": "cp2_tp2", "cp": 2, "tp": 2},
        {"name": "cp2_pp2", "cp": 2, "pp": 2},
        {"name": "cp2_dp2_fsdp", "cp": 2, "data_parallel": "fsdp"},
        {"name": "cp2_dp2_fsdp_again", "cp": 2, "data_parallel": "fsdp"},  # the same mesh twice: bitwise equal
        {"name": "hsdp2x2", "data_parallel": "hsdp", "dp_shard": 2},
        # saved at step 2 on cp2 x tp2, resumed on another mesh for the last two steps
        {"name": "cp2_tp2_to_cp1", "cp": 2, "tp": 2, "save_at": 2, "resume_config": {"tp": 2}},
        {"name": "cp2_tp2_to_hsdp", "cp": 2, "tp": 2, "save_at": 2,
         "resume_config": {"data_parallel": "hsdp", "dp_shard": 2}},
    ]
    return run_workers(4, configs, tmp_path_factory.mktemp("cp_four"), timeout=600)


@pytest.fixture(scope="module")
def cp_eight(tmp_path_factory):
    configs = [
        {"name": "cp2_tp2_pp2", "cp": 2, "tp": 2, "pp": 2},
        {"name": "hsdp2x2_tp2", "tp": 2, "data_parallel": "hsdp", "dp_shard": 2},
    ]
    return run_workers(8, configs, tmp_path_factory.mktemp("cp_eight"), timeout=600)


def test_loss_and_weights_match_single_process_with_cp2(cp_two, reference_run):
    assert_trains_like(cp_two["cp2"], reference_run)


@pytest.mark.parametrize("name", ["cp2_tp2", "cp2_pp2", "cp2_dp2_fsdp", "hsdp2x2"])
def test_loss_and_weights_match_single_process_on_four_processes(cp_four, reference_run, name):
    assert_trains_like(cp_four[name], reference_run)


def test_two_runs_of_the_same_mesh_are_bitwise_equal(cp_four):
    # Runs are deterministic (same mesh, same machine: also across launches); a mesh's distance to the one process
    # is its reduction order's rounding, fixed per machine and CPU kernel, and bounded by helpers.compare.TOL.
    first, again = cp_four["cp2_dp2_fsdp"], cp_four["cp2_dp2_fsdp_again"]
    assert first["losses"] == again["losses"] and same_tensors(first["final"], again["final"])


@pytest.mark.parametrize("name", ["cp2_tp2_to_cp1", "cp2_tp2_to_hsdp"])
def test_checkpoint_saved_at_cp2_tp2_resumes_elsewhere_with_equal_losses(cp_four, reference_run, name):
    record = cp_four[name]
    assert len(record["losses"]) == len(reference_run["losses"])  # two steps before the save, two after
    assert_trains_like(record, reference_run)


@pytest.mark.parametrize("name", ["cp2_tp2_pp2", "hsdp2x2_tp2"])
def test_loss_and_weights_match_single_process_on_eight_processes(cp_eight, reference_run, name):
    assert_trains_like(cp_eight[name], reference_run)
