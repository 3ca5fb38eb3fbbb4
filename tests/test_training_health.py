"""TrainingHealth: argument checks; a NaN step skipped on every rank equals a run that never applied it; the
consistency check names a replica one ulp off."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.launch import TESTS, torchrun
from lightning_hybrid.callbacks import TrainingHealth

POISON_STEP, STEPS = 2, 5
CONSISTENCY = [dict(name="dp4-bump", tp=1, pp=1, data_parallel="replicate", bump_rank=2, bump_name="proj"),
               dict(name="dp2tp2-bump", tp=2, pp=1, data_parallel="replicate", bump_rank=3, bump_name="norm")]
LAYOUTS = {"tp2pp2": dict(tp=2, pp=2), "dp2tp2": dict(tp=2, pp=1, data_parallel="replicate")}


@pytest.mark.parametrize("kwargs, message", [
    (dict(on_nan="ignore"), "on_nan='ignore' is not a policy"),
    (dict(on_spike="explode"), "on_spike='explode' is not a policy"),
    (dict(on_spike="rollback"), "on_spike='rollback' is not available yet"),
    (dict(spike_factor=1.0), "spike_factor=1.0 must be a finite number > 1.0"),
    (dict(spike_factor=float("nan")), "spike_factor=nan must be a finite number > 1.0"),
    (dict(window=1), "window=1 must be an integer >= 2"),
    (dict(window=2.5), "window=2.5 must be an integer >= 2"),
    (dict(spike_zscore=0), "spike_zscore=0 must be a finite number > 0.0"),
    (dict(max_rollbacks=-1), "max_rollbacks=-1 must be an integer >= 0"),
    (dict(recheck=True), "recheck=True is not available yet"),
    (dict(consistency_every_n_steps=0), "consistency_every_n_steps=0 must be an integer >= 1"),
])
def test_invalid_arguments_fail_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as info:
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
    configs += [{**c, "mode": "consistency", "steps": 3, "poison_step": 1} for c in CONSISTENCY]
    (out / "configs.json").write_text(json.dumps(configs))
    torchrun(4, [str(TESTS / "health_worker.py"), str(out / "configs.json"), str(out)], timeout=300)
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
