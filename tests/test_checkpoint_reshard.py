"""A checkpoint saved on one mesh loads into any other, weights and optimizer state identical."""

from __future__ import annotations

import pytest

from helpers.compare import same_tensors
from helpers.equivalence import STEPS
from helpers.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SAVE_AT = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    configs = [
        # saves at step 2 and stops there: its final state is the checkpoint's state
        {"name": "saved_tp2_pp2", "tp": 2, "pp": 2, "save_at": SAVE_AT, "stop_after_save": True},
        # the same checkpoint loaded into tp=1, pp=1, dp=4 (FSDP): no step taken, state as loaded
        {"name": "loaded_dp4", "tp": 1, "pp": 1, "load_from": str(out / "ckpt_saved_tp2_pp2"),
         "trainer": {"max_steps": SAVE_AT}},
        # ... and training continued there to the end
        {"name": "continued_dp4", "tp": 1, "pp": 1, "load_from": str(out / "ckpt_saved_tp2_pp2")},
        {"name": "continued_tp2_pp2", "tp": 2, "pp": 2, "load_from": str(out / "ckpt_saved_tp2_pp2")},
        {"name": "uninterrupted_tp2_pp2", "tp": 2, "pp": 2},
        # a weighted data mixture: saved by a Trainer checkpoint on dp=2 (tp=2) at step 2, resumed on dp=4 (tp=1)
        {"name": "mixture_dp2_then_dp4", "tp": 2, "mixture": True, "save_at": SAVE_AT, "resume_config": {"tp": 1}},
        {"name": "mixture_dp2", "tp": 2, "mixture": True},
    ]
    records = run_workers(4, configs, out)
    single = [{"name": "loaded_single", "load_from": str(out / "ckpt_saved_tp2_pp2"),
               "trainer": {"max_steps": SAVE_AT}}]
    records.update(run_workers(1, single, out))
    return records


@pytest.mark.parametrize("name", ["loaded_dp4", "loaded_single"])
def test_weights_and_adam_states_load_identically_on_another_mesh(runs, name):
    saved, loaded = runs["saved_tp2_pp2"], runs[name]
    assert same_tensors(loaded["final"], saved["final"])
    assert len(saved["optimizer"]) == 2 * len(saved["final"])  # exp_avg and exp_avg_sq of every parameter
    assert same_tensors(loaded["optimizer"], saved["optimizer"])


def test_same_layout_resume_is_bitwise_identical_to_the_uninterrupted_run(runs):
    assert same_tensors(runs["continued_tp2_pp2"]["final"], runs["uninterrupted_tp2_pp2"]["final"])
    assert same_tensors(runs["continued_tp2_pp2"]["optimizer"], runs["uninterrupted_tp2_pp2"]["optimizer"])


def test_training_continues_on_four_dp_ranks_with_the_losses_of_the_uninterrupted_run(runs):
    uninterrupted = runs["uninterrupted_tp2_pp2"]["losses"]
    continued = runs["continued_dp4"]["losses"]
    assert len(continued) == STEPS - SAVE_AT
    # same global batches after the change of dp (1 -> 4): losses agree to fp32 reduction-order rounding
    for a, b in zip(continued, uninterrupted[SAVE_AT:]):
        assert abs(a - b) / abs(b) < 1e-5, (continued, uninterrupted)


def test_a_weighted_mixture_resumed_from_a_trainer_checkpoint_on_dp4_reads_the_samples_of_the_dp2_run(runs):
    resumed, straight = runs["mixture_dp2_then_dp4"], runs["mixture_dp2"]
    assert len(straight["samples"]) == STEPS and all(len(batch) == 8 for batch in straight["samples"])
    assert len({tuple(map(tuple, batch)) for batch in straight["samples"]}) == STEPS  # each step its own samples
    # steps 1-2 on dp=2, then the checkpoint, steps 3-4 on dp=4: the same global batches in the same order
    assert resumed["samples"] == straight["samples"]
    for a, b in zip(resumed["losses"], straight["losses"]):
        assert abs(a - b) / abs(b) < 1e-5, (resumed["losses"], straight["losses"])
