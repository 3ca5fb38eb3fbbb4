"""Per-step fault tolerance with torchft replica groups: torchft's real lighthouse on localhost, gloo processes, real
SIGKILLs. In the kill scenarios each replica group is its own torchrun launch (torchrun restarts the killed group);
without a restart, the groups' ranks are forked side by side from the fork server (``run_groups(fork=True)``)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from helpers.fork_server import fork_server
from helpers.launch import TESTS, launch
from helpers.torchft_groups import run_groups

pytest.importorskip("torchft")

STEPS = 8


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def no_fault(tmp_path_factory) -> dict:
    """2 replica groups x 2 processes (tp=2) under torchft, and one launch of 4 processes, HSDP 2 replicas x 2."""
    tmp = tmp_path_factory.mktemp("torchft_no_fault")
    groups = run_groups(tmp / "ft", 2, {"TP": 2, "STEPS": STEPS, "MIN_GROUPS": 2}, min_replicas=2, timeout=600,
                        fork=True)
    ref_dir = tmp / "ref"
    ref_dir.mkdir()
    launch(4, [str(TESTS / "torchft_worker.py")], timeout=300,
           env={"OUT": str(ref_dir), "REFERENCE": "1", "TP": "2", "STEPS": str(STEPS), "DP_SHARD": "1"})
    return {"groups": groups, "reference": torch.load(ref_dir / "ref_0.pt", weights_only=False)}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(700)
def test_two_replica_groups_train_like_one_hsdp_launch(no_fault):
    ref, groups = no_fault["reference"], no_fault["groups"]
    for name in ("0_0", "1_0"):
        run = groups[name]
        losses = [s["loss"] for s in run["steps"]]
        ref_losses = [s["loss"] for s in ref["steps"]]
        assert len(losses) == STEPS
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
        errors = {k: _relative(run["full"][k], ref["full"][k]) for k in ref["full"]}
        assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        assert [h["participants"] for h in run["history"]] == [2] * STEPS
        assert all(h["committed"] for h in run["history"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(700)
def test_the_groups_hold_bitwise_equal_shards_without_a_fault(no_fault):
    groups = no_fault["groups"]
    for rank in (0, 1):
        a, b = groups[f"0_{rank}"]["local"], groups[f"1_{rank}"]["local"]
        assert all(torch.equal(a[k], b[k]) for k in a)


KILL_AT, KILL_STEPS = 4, 12
RECOVERY_BOUND_S = 60  # kill -> the survivors' next committed step: heartbeat timeout (3 s) + one step, with margin


def _kill_scenario(tmp, tp: int, pp: int) -> dict:
    """2 groups x 2 processes; group 1 SIGKILLed (all its processes) in the middle of the first step from KILL_AT on
    that both groups are in, then restarted by its torchrun (--max-restarts 1)."""
    return run_groups(tmp, 2, {"TP": tp, "PP": pp, "STEPS": KILL_STEPS, "KILL_AT": KILL_AT, "STEP_SLEEP": 1},
                      min_replicas=1, timeout=900, max_restarts=1)


def _expected_inputs(group: int, step: int, groups: int = 2, data_ranks_per_group: int = 1):
    """The samples group ``group`` reads at global step ``step``: its share of global batch ``step`` in Lightning's
    DistributedSampler order (shuffled per epoch from the seed; rank ``g`` of ``groups x dp`` data ranks)."""
    from helpers.equivalence import GLOBAL_BATCH, SEED, make_tensors

    inputs = make_tensors()[0][:48]  # the training split
    per_epoch = len(inputs) // GLOBAL_BATCH
    epoch, k = divmod(step - 1, per_epoch)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(SEED + epoch))
    ranks = groups * data_ranks_per_group
    mine = order[group::ranks]
    per_rank = GLOBAL_BATCH // ranks
    return inputs[mine[k * per_rank:(k + 1) * per_rank]]


def _check_same_weights_and_own_shares(records: dict) -> None:
    """Both groups hold bitwise-equal weight shards at the end, and each group read its own share of every global
    batch at each step it took part in. A group that healed continues at the live group's data position (the share of
    the steps it missed is skipped, not redistributed), its first step included: the peer's data position counts the
    samples of both groups' data ranks."""
    for rank in (0, 1):
        a, b = records[f"0_{rank}"]["local"], records[f"1_{rank}"]["local"]
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), rank
    for group in (0, 1):
        for s in records[f"{group}_0"]["steps"]:
            assert torch.equal(s["inputs"], _expected_inputs(group, s["step"])), (group, s["step"])


def _check_kill_and_rejoin(records: dict) -> None:
    live, back = records["0_0"], records["1_0"]
    killed_at, restarted = records["killed_at"], records["restarted"]
    # The surviving group never restarted: one pid per rank over every step, restart count 0.
    for rank in (0, 1):
        steps = records[f"0_{rank}"]["steps"]
        # (a group that started after the other heals at its first quorum: its first step may be 2 or later)
        assert [s["step"] for s in steps] == list(range(steps[0]["step"], KILL_STEPS + 1))
        assert steps[0]["step"] < KILL_AT
        assert {s["pid"] for s in steps} == {records[f"0_{rank}"]["pid"]} and {s["restart"] for s in steps} == {0}
    # The step that met the dead group was discarded; the next ones ran with the survivors only, and the first of them
    # committed within the stated bound.
    by_step = {h["step"]: h for h in live["history"]}
    during = [s for s in live["steps"] if s["time"] > killed_at]
    assert not during[0]["committed"] and during[0]["participants"] == 2, during[0]
    first_alone = next(s for s in during if s["committed"])
    assert first_alone["participants"] == 1
    assert first_alone["time"] - killed_at < RECOVERY_BOUND_S, first_alone["time"] - killed_at
    # The killed group came back (a new process), healed from the live group and took part again.
    assert restarted > killed_at
    assert {s["restart"] for s in back["steps"]} == {1}
    first_back = back["steps"][0]
    assert first_back["healed_at"] is not None and first_back["step"] > during[0]["step"], first_back
    assert first_back["participants"] == 2 and by_step[first_back["step"]]["participants"] == 2
    assert [s["step"] for s in back["steps"]] == list(range(first_back["step"], KILL_STEPS + 1))
    # Every logged loss finite; the same weights at the end and each group's own share at every step (below).
    assert all(math.isfinite(s["loss"]) for s in live["steps"] + back["steps"])
    _check_same_weights_and_own_shares(records)
    assert [h["participants"] for h in live["history"]][-1] == 2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
def test_a_killed_replica_group_heals_and_rejoins_while_the_other_trains_on(tmp_path):
    _check_kill_and_rejoin(_kill_scenario(tmp_path, tp=2, pp=1))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
def test_a_killed_pipeline_replica_group_heals_and_rejoins(tmp_path):
    _check_kill_and_rejoin(_kill_scenario(tmp_path, tp=1, pp=2))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
def test_a_replica_group_that_starts_late_heals_and_reads_its_share_from_its_first_step(tmp_path):
    """Group 1 starts once group 0 trained 2 steps alone: it heals at its first quorum (weights, optimizer, loops,
    data position) and from its first step on reads its own share of each global batch."""
    records = run_groups(tmp_path, 2, {"TP": 2, "STEPS": STEPS, "LATE_AFTER": 2, "STEP_SLEEP": 2}, min_replicas=1,
                         timeout=900, fork=True)
    live, late = records["0_0"], records["1_0"]
    assert [s["step"] for s in live["steps"]] == list(range(1, STEPS + 1))
    assert [s["participants"] for s in live["steps"][:2]] == [1, 1]
    first = late["steps"][0]
    assert first["step"] > 2 and first["healed_at"] == first["step"] - 1 and first["participants"] == 2, first
    assert [s["step"] for s in late["steps"]] == list(range(first["step"], STEPS + 1))
    assert all(s["committed"] for s in live["steps"] + late["steps"])
    _check_same_weights_and_own_shares(records)
    # The healed group took the live group's LR schedule and optimizer step count with it.
    by_step = {s["step"]: s for s in live["steps"]}
    assert all(s["lr"] == by_step[s["step"]]["lr"] and s["adam_steps"] == by_step[s["step"]]["adam_steps"]
               for s in late["steps"])


# ---------------------------------------------------------------- bad input (one process, no launch)

from lightning_hybrid.distributed.fault_tolerance import check_fault_tolerance  # noqa: E402

GOOD_ENV = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510"}


def test_the_replica_group_comes_from_torchfts_environment():
    env, timeout = check_fault_tolerance("torchft", 2, 30, GOOD_ENV)
    assert timeout == 30.0
    assert (env.group_id, env.num_groups, env.lighthouse, env.min_replica_groups) == (1, 2, GOOD_ENV[
        "TORCHFT_LIGHTHOUSE"], 2)
    assert check_fault_tolerance(None, 1, 60, {}) == (None, 60.0)


def test_torchft_without_its_environment_names_the_missing_variables():
    with pytest.raises(ValueError, match=r"needs NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE in the environment"):
        check_fault_tolerance("torchft", 1, 60, {"REPLICA_GROUP_ID": "0"})


@pytest.mark.parametrize("env, match", [
    ({**GOOD_ENV, "REPLICA_GROUP_ID": "2"}, r"REPLICA_GROUP_ID=2 with NUM_REPLICA_GROUPS=2: .* in 0\.\.1"),
    ({**GOOD_ENV, "REPLICA_GROUP_ID": "one"}, r"REPLICA_GROUP_ID='one' is not an integer"),
])
def test_an_inconsistent_replica_group_environment_is_one_line(env, match):
    with pytest.raises(ValueError, match=match) as err:
        check_fault_tolerance("torchft", 1, 60, env)
    assert "\n" not in str(err.value)


def test_more_min_replica_groups_than_groups_is_refused():
    with pytest.raises(ValueError, match=r"min_replica_groups=3 is larger than NUM_REPLICA_GROUPS=2; use 1\.\.2"):
        check_fault_tolerance("torchft", 3, 60, GOOD_ENV)


def test_a_non_positive_cross_group_timeout_is_refused():
    with pytest.raises(ValueError, match=r"ft_timeout=0 must be a positive number of seconds"):
        check_fault_tolerance("torchft", 1, 0, GOOD_ENV)


def test_an_unknown_fault_tolerance_is_refused():
    with pytest.raises(ValueError, match=r"fault_tolerance='torchelastic' is not known; use None or 'torchft'"):
        check_fault_tolerance("torchelastic", 1, 60, GOOD_ENV)


def test_torchft_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning-hybrid\[ft\]'"):
        check_fault_tolerance("torchft", 1, 60, GOOD_ENV)


def test_the_strategy_refuses_torchft_without_environment_on_construction(monkeypatch):
    from lightning_hybrid import HybridParallelStrategy

    for name in GOOD_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE"):
        HybridParallelStrategy(tp=2, fault_tolerance="torchft")


def test_the_cli_reports_a_bad_lighthouse_request_in_one_line():
    result = fork_server().run(["lighthouse", "--min-replicas", "0"], cwd=TESTS, env=dict(os.environ))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "--min-replicas 0 must be a positive integer (replica groups a quorum needs)")
    assert "Traceback" not in result.stderr
