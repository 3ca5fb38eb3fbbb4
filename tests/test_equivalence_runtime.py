"""Runtime features train like one process: loss parallel, bf16 compute weights, FSDP2's reshard policy under pp.

Two launches share their process groups across configurations: 2 processes (tp2 and pp2) and 4 processes
(tp2 x pp2, cp2 x tp2, tp2 x dp2 FSDP, and pp2 x dp2 with each reshard policy under 1F1B and Interleaved1F1B).
fp32 runs must agree with the one-process reference to 1e-5; bf16 runs within the bf16 tolerance of
``test_equivalence_tp_dp.py`` (and really differ from fp32).
"""

from __future__ import annotations

import pytest
import torch

from helpers.compare import TOL, assert_trains_like, max_relative_error
from helpers.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1500)]

BF16 = {"precision": "bf16-mixed"}
RESHARD = {"true": True, "false": False, "auto": "auto"}
SCHEDULES = {"1f1b": {}, "interleaved": {"pp_schedule": "interleaved_1f1b", "virtual_stages": 2}}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    configs = [
        {"name": "tp2_loss_parallel", "tp": 2, "loss_parallel": True, "evaluate": True},
        {"name": "tp2_gathered_logits", "tp": 2, "loss_parallel": False},
        {"name": "pp2_bf16_weights", "pp": 2, "trainer": BF16},
        {"name": "pp2_bf16_autocast", "pp": 2, "bf16_compute_weights": False, "trainer": BF16},
    ]
    return run_workers(2, configs, tmp_path_factory.mktemp("runtime_two"), timeout=900)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    configs = [
        {"name": "tp2_pp2_loss_parallel", "tp": 2, "pp": 2, "evaluate": True},
        {"name": "cp2_tp2_loss_parallel", "cp": 2, "tp": 2},
        {"name": "tp2_dp2_fsdp_bf16_weights", "tp": 2, "trainer": BF16},
    ]
    for schedule, extra in SCHEDULES.items():
        for key, value in RESHARD.items():
            configs.append({"name": f"pp2_dp2_{schedule}_reshard_{key}", "pp": 2, "data_parallel": "fsdp",
                            "fsdp_reshard_after_forward": value, **extra})
    return run_workers(4, configs, tmp_path_factory.mktemp("runtime_four"), timeout=1400)


# ---------------------------------------------------------------- loss parallel


@pytest.mark.parametrize("fixture, name", [("two", "tp2_loss_parallel"), ("four", "tp2_pp2_loss_parallel"),
                                           ("four", "cp2_tp2_loss_parallel")])
def test_loss_parallel_trains_like_one_process(request, reference_run, fixture, name):
    record = request.getfixturevalue(fixture)[name]
    assert record["runtime"]["loss_parallel"]
    assert_trains_like(record, reference_run, same_initial_weights=True)
    assert abs(record["val_loss"] - reference_run["val_loss"]) / reference_run["val_loss"] < TOL


def test_loss_parallel_and_gathered_logits_agree_to_fp32_rounding(two):
    on, off = two["tp2_loss_parallel"], two["tp2_gathered_logits"]
    assert on["runtime"]["loss_parallel"] and not off["runtime"]["loss_parallel"]
    assert max_relative_error(on, off)["loss"] < TOL


@pytest.fixture(scope="module")
def evaluated_reference():
    from helpers.equivalence import run_reference

    return run_reference(evaluate=True)


@pytest.mark.parametrize("fixture, name", [("two", "tp2_loss_parallel"), ("four", "tp2_pp2_loss_parallel")])
def test_predict_returns_full_vocabulary_logits_under_loss_parallel(request, evaluated_reference, fixture, name):
    record = request.getfixturevalue(fixture)[name]
    assert abs(record["test_loss"] - evaluated_reference["test_loss"]) / evaluated_reference["test_loss"] < TOL
    assert record["logits"].shape == evaluated_reference["logits"].shape == (8, 16, 256)
    torch.testing.assert_close(record["logits"], evaluated_reference["logits"], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- bf16 compute weights


def _update_cosine(record, reference):
    def vec(weights):
        return torch.cat([weights[k].float().flatten() for k in sorted(reference["final"])])

    ours = vec(record["final"]) - vec(record["initial"])
    theirs = vec(reference["final"]) - vec(reference["initial"])
    return float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))


@pytest.mark.parametrize("fixture, name, mp_policy", [
    # FSDP2 gathers bf16 copies of the fp32 shards and reduce-scatters fp32 gradients
    ("four", "tp2_dp2_fsdp_bf16_weights", {("torch.bfloat16", "torch.float32")}),
    # no FSDP (pp2, dp1): each stage's weights are cast once per step
    ("two", "pp2_bf16_weights", set()),
])
def test_bf16_compute_weights_train_within_bf16_tolerance(request, reference_run, fixture, name, mp_policy):
    record = request.getfixturevalue(fixture)[name]
    assert record["switches"]["param_dtypes"] == {"torch.float32"}  # fp32 master weights (and AdamW states)
    assert record["switches"]["mp_policy"] == mp_policy
    assert not record["runtime"]["autocast"], "the forward must run on the bf16 weights, not under autocast"
    err = max_relative_error(record, reference_run)
    # bf16 has 8 mantissa bits: the losses agree to that order, and really differ from fp32 (bf16 compute ran)
    assert 1e-5 < err["loss"] < 1e-2, (err, record["losses"], reference_run["losses"])
    assert _update_cosine(record, reference_run) > 0.98


def test_step_casts_are_made_once_per_parameter_per_step(two):
    from helpers.equivalence import STEPS

    record = two["pp2_bf16_weights"]
    # 4 micro-batches per step, forward and backward: still one copy per parameter per step on each stage
    # 12 parameters per block; stage 0: embedding + 2 blocks, stage 1: 2 blocks, final norm and head
    params = {0: 1 + 2 * 12, 1: 2 * 12 + 2}
    assert record["runtime"]["weight_casts"] == [STEPS * params[0], STEPS * params[1]]


def test_bf16_compute_weights_and_autocast_agree_within_bf16_tolerance(two, reference_run):
    ours, autocast = two["pp2_bf16_weights"], two["pp2_bf16_autocast"]
    assert autocast["runtime"]["autocast"] and autocast["runtime"]["weight_casts"] == [None, None]
    assert max_relative_error(ours, autocast)["loss"] < 1e-2
    assert max_relative_error(autocast, reference_run)["loss"] < 1e-2


# ---------------------------------------------------------------- FSDP2 reshard policy under a pipeline


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("policy", sorted(RESHARD))
def test_reshard_policy_under_pp2_dp2_trains_like_one_process(four, reference_run, schedule, policy):
    record = four[f"pp2_dp2_{schedule}_reshard_{policy}"]
    assert_trains_like(record, reference_run, same_initial_weights=True)
    blocks = {k: v for k, v in record["switches"]["reshard_after_forward"].items() if k.startswith("layers.")}
    # "auto" under a pipeline keeps the blocks gathered for the whole step (ZeRO-2-like)
    assert set(blocks.values()) == {policy == "true"}, blocks
    assert record["switches"]["gathered"] == set()  # sharded again after the run's last step and evaluation
