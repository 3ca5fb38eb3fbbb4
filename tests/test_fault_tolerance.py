"""Nothing lost: kill, preempt, corrupt and fail saves; resumed runs reach bitwise the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.compare import same_tensors
from helpers.launch import TESTS, launch, torchrun
from lightning_hybrid.callbacks.fault_tolerant import EXIT_CODE_PREEMPTED, FaultTolerantCheckpoint
from lightning_hybrid.checkpoint.manifest import CheckpointError, committed_checkpoints, set_aside_newer
from lightning_hybrid.checkpoint.sharded import check_model_config
from lightning_hybrid.checkpoint.verify import find_resumable, verify_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def _run(out: Path, ckpt: Path, check: bool = True, timeout: float = 300, agent: bool = False, **env):
    """ft_worker.py on tp=2 x pp=2; ``agent``: under torchrun's agent (its SIGTERM to the others, its exit report),
    else forked ranks (:func:`helpers.launch.launch`): the faults (SIGKILL, SIGTERM, a full disk) are the same."""
    out.mkdir(parents=True, exist_ok=True)
    variables = {"OUT": str(out), "CKPT": str(ckpt), **{k: str(v) for k, v in env.items()}}
    return (torchrun if agent else launch)(4, [str(TESTS / "ft_worker.py")], timeout=timeout, env=variables,
                                           check=check)


def _losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def _final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=False)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """tp=2 x pp=2, 8 steps (over an epoch boundary), async saves every 2 steps, weights recorded at each save; each
    save's copy to host memory starts 1.5 s late, after the next step's forward and backward (as on a GPU)."""
    out = tmp_path_factory.mktemp("baseline")
    _run(out, out / "ckpt", RECORD_WEIGHTS=1, KEEP=4, SLOW_STAGING=1.5)
    return out


def test_uninterrupted_run_commits_every_interval_and_keeps_the_newest(baseline):
    assert [c.path.name for c in committed_checkpoints(baseline / "ckpt")] == [
        "step-000008", "step-000006", "step-000004", "step-000002"]
    assert (baseline / "ckpt" / "latest").read_text().strip() == "step-000008"
    manifest = verify_checkpoint(baseline / "ckpt" / "step-000008")
    assert manifest["step"] == 8 and manifest["mesh"]["tp"] == 2 and manifest["mesh"]["pp"] == 2
    assert manifest["model_config"]["hidden_size"] == 64 and "torch" in manifest["versions"]
    assert {"__0_0.distcp", "__3_0.distcp", ".metadata", "trainer_state.pt", "rng/rank_2.pt"} <= set(manifest["files"])


def test_each_async_checkpoint_holds_the_weights_of_its_own_step(baseline):
    # The copy to host memory ends after the next step's backward (SLOW_STAGING): only the optimizer step's wait for
    # it (FaultTolerantCheckpoint.on_before_optimizer_step) keeps the next step's weights out of checkpoints 4 and 6.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    previous = previous_state = None
    for step in (4, 6, 8):
        folder = baseline / "ckpt" / f"step-{step:06d}"
        expected = torch.load(baseline / f"weights_step{step}.pt", weights_only=False)
        meta = FileSystemReader(str(folder)).read_metadata()
        state = {k: torch.empty(meta.state_dict_metadata[f"model.{k}"].size) for k in expected}
        dcp.load({"model": state}, checkpoint_id=str(folder), no_dist=True)
        assert same_tensors(state, expected), step
        if previous is not None:  # consecutive checkpoints differ exactly as the weights did
            changed = {k for k in expected if not torch.equal(expected[k], previous[k])}
            assert changed and changed == {k for k in state if not torch.equal(state[k], previous_state[k])}
        previous, previous_state = expected, state


def test_sigkill_of_one_rank_then_rerun_reaches_bitwise_the_same_weights(baseline, tmp_path):
    result = _run(tmp_path, tmp_path / "ckpt", check=False, KILL_AT=5, KILL_RANK=1)
    assert result.returncode != 0
    _run(tmp_path, tmp_path / "ckpt")
    assert _final(tmp_path)["resumed_from"].endswith("step-000004")
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])
    losses = {(d["step"], d["loss"]) for d in _losses(tmp_path)}
    assert losses == {(d["step"], d["loss"]) for d in _losses(baseline)}  # joined with no gap or change


def test_kill_during_an_async_write_leaves_the_previous_checkpoint_and_resumes_from_it(baseline, tmp_path):
    # At step 4 the save has started (state staged, files being written) when rank 1 dies.
    _run(tmp_path, tmp_path / "ckpt", check=False, KILL_AT=4, KILL_RANK=1)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000002"
    assert [c.path.name for c in committed_checkpoints(tmp_path / "ckpt")] == ["step-000002"]
    _run(tmp_path, tmp_path / "ckpt")
    assert not list((tmp_path / "ckpt").glob("*.tmp"))
    assert _final(tmp_path)["resumed_from"].endswith("step-000002")
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])


def test_a_slow_background_write_on_one_rank_does_not_deadlock_training(baseline, tmp_path):
    # Rank 1's writer starts its collectives 2 s late, while the other ranks' writers wait in theirs and every
    # main thread meets at the step boundaries (the callback's agreement all-reduce) meanwhile.
    _run(tmp_path, tmp_path / "ckpt", timeout=150, SLOW_WRITER_RANK=1)
    assert [c.step for c in committed_checkpoints(tmp_path / "ckpt")] == [8, 6, 4]
    assert verify_checkpoint(tmp_path / "ckpt" / "step-000008")["step"] == 8
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])


def test_sigterm_saves_at_the_step_boundary_exits_with_code_75_and_rerun_resumes_there(baseline, tmp_path):
    # The signal arrives after step 3's checkpoint hook ran; the next boundary (step 4) saves and exits.
    result = _run(tmp_path, tmp_path / "ckpt", check=False, agent=True, SIGTERM_AT=3)
    assert f"exitcode  : {EXIT_CODE_PREEMPTED}" in result.stderr, result.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000004"
    # step 4 trained and was saved; the exit came before the loss-logging callback of step 4 ran
    assert max(d["step"] for d in _losses(tmp_path)) == 3
    _run(tmp_path, tmp_path / "ckpt")
    second = [d for d in _losses(tmp_path) if d["pid"] != _losses(tmp_path)[0]["pid"]]
    assert second[0]["step"] == 5
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])


def test_a_failed_background_write_is_logged_removed_and_the_next_interval_saves(baseline, tmp_path):
    result = _run(tmp_path, tmp_path / "ckpt", FAIL_AT=4)
    assert "checkpoint save of step 4 failed (1 in a row): CheckpointWriteError" in result.stderr + result.stdout
    assert "rank 1: OSError: [Errno 28] No space left on device" in result.stderr + result.stdout
    names = [c.path.name for c in committed_checkpoints(tmp_path / "ckpt")]
    assert "step-000004" not in names and "step-000006" in names
    assert not list((tmp_path / "ckpt").glob("*.tmp"))
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])


def test_a_hung_peer_ends_the_surviving_ranks_with_a_timeout_message(tmp_path):
    import time

    start = time.monotonic()
    result = _run(tmp_path, tmp_path / "ckpt", check=False, agent=True, STALL_AT=3, STALL_RANK=1,
                  COLLECTIVE_TIMEOUT=15)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 110, elapsed  # well before the stalled rank wakes up (120 s)
    assert "Timed out" in result.stderr or "timed out" in result.stderr, result.stderr[-3000:]


@pytest.fixture
def damaged(baseline, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(baseline / "ckpt", copy)
    return copy


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"file __1_0.distcp has \d+ bytes, the manifest says \d+ \(truncated or partial write\)"),
    ("flip", r"file __2_0.distcp has CRC-32 [0-9a-f]{8}, the manifest says [0-9a-f]{8} \(corrupted\)"),
    ("manifest", r"has no meta.json \(incomplete or not a checkpoint\)"),
])
def test_a_damaged_newest_checkpoint_is_reported_and_the_older_one_used(damaged, damage, message):
    newest = damaged / "step-000008"
    if damage == "truncate":
        data = (newest / "__1_0.distcp").read_bytes()
        (newest / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data = bytearray((newest / "__2_0.distcp").read_bytes())
        data[len(data) // 3] ^= 0xFF
        (newest / "__2_0.distcp").write_bytes(bytes(data))
    else:
        (newest / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(newest)
    logged: list[str] = []
    assert find_resumable(damaged, log=logged.append) == damaged / "step-000006"
    assert len(logged) == 1 and logged[0].startswith("skipping damaged checkpoint:")


def test_a_leftover_tmp_folder_is_never_a_checkpoint(damaged):
    shutil.copytree(damaged / "step-000008", damaged / "step-000010.tmp")
    assert find_resumable(damaged) == damaged / "step-000008"


def test_resume_uses_the_older_checkpoint_when_the_newest_is_damaged(baseline, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(baseline / "ckpt", ckpt)
    for step in (8, 6):  # keep 4 and 2; damage 6, remove 8: resume must use 4
        if step == 8:
            shutil.rmtree(ckpt / f"step-{step:06d}")
        else:
            (ckpt / f"step-{step:06d}" / "__0_0.distcp").write_bytes(b"x")
    result = _run(tmp_path, ckpt)
    assert "skipping damaged checkpoint" in result.stderr + result.stdout
    assert _final(tmp_path)["resumed_from"].endswith("step-000004")
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])
    # The damaged step 6 was moved aside, so the resumed run saved step 6 anew (not skipped as "already saved").
    assert "moved the damaged checkpoint aside to" in result.stderr + result.stdout
    # every rank checked a slice of the chosen checkpoint's files (not rank 0 alone)
    assert "verified step-000004: " in result.stderr + result.stdout
    assert "size and CRC-32 checked by 4 rank(s)" in result.stderr + result.stdout
    assert (ckpt / "step-000006.damaged" / "__0_0.distcp").read_bytes() == b"x"
    assert verify_checkpoint(ckpt / "step-000006")["step"] == 6
    assert (ckpt / "latest").read_text().strip() == "step-000008"


def test_damaged_checkpoints_newer_than_the_chosen_one_are_set_aside_and_kept(damaged):
    (damaged / "step-000008" / "meta.json").unlink()
    (damaged / "step-000006" / "__0_0.distcp").write_bytes(b"x")
    assert find_resumable(damaged) == damaged / "step-000004"
    assert set_aside_newer(damaged, 4) == [damaged / "step-000008.damaged", damaged / "step-000006.damaged"]
    assert [c.step for c in committed_checkpoints(damaged)] == [4, 2]
    assert (damaged / "step-000006.damaged" / "__0_0.distcp").read_bytes() == b"x"  # kept for inspection
    # the same step damaged again later keeps both copies
    shutil.copytree(damaged / "step-000004", damaged / "step-000006")
    (damaged / "step-000006" / "meta.json").unlink()
    assert set_aside_newer(damaged, 4) == [damaged / "step-000006.damaged-2"]
    assert set_aside_newer(damaged, 4) == [] and find_resumable(damaged) == damaged / "step-000004"


def test_a_checkpoint_of_another_model_is_refused_naming_its_run_and_the_differing_fields(tmp_path):
    saved = {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 4}
    current = {"name": "tiny", "hidden_size": 128, "num_hidden_layers": 4}  # one name, two models: told apart
    with pytest.raises(ValueError,
                       match=r"step-000004 \(run 0123abcd4567\) is of another model: hidden_size: checkpoint 64 vs "
                             r"model 128; load it into a model with the same config, or give this model another "
                             r"checkpoint folder \(FaultTolerantCheckpoint dirpath\) or move .* away"):
        check_model_config(saved, current, tmp_path / "step-000004", "0123abcd4567")
    check_model_config(saved, {**saved, "name": "tiny-renamed"}, tmp_path / "step-000004")  # a name alone: the same


def test_a_signal_after_training_is_recorded_and_does_not_end_the_process(tmp_path):
    import os
    import signal

    class FakeTrainer:
        is_global_zero = True
        ckpt_path = None

        class strategy:  # noqa: N801 - one process: a broadcast returns its input
            broadcast = staticmethod(lambda value: value)

    before = signal.getsignal(signal.SIGUSR1)
    callback = FaultTolerantCheckpoint(tmp_path, every_n_steps=1)
    try:
        callback.on_train_start(FakeTrainer(), None)
        callback.on_train_end(FakeTrainer(), None)  # nothing pending: commits nothing, keeps a SIGUSR1 handler
        os.kill(os.getpid(), signal.SIGUSR1)       # the default action would terminate this process
        assert callback.late_signals == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_consecutive_save_failures_stop_training_with_a_clear_error(tmp_path):
    class FakeTrainer:
        is_global_zero = True

    callback = FaultTolerantCheckpoint(tmp_path, every_n_steps=1, max_consecutive_failures=2)
    (tmp_path / "step-000001.tmp").mkdir()
    callback._failed(FakeTrainer(), tmp_path / "step-000001.tmp", 1, OSError("disk full"))
    assert not (tmp_path / "step-000001.tmp").exists()
    with pytest.raises(RuntimeError, match=r"2 checkpoint saves in a row failed \(last, step 2: OSError: disk full\)"):
        callback._failed(FakeTrainer(), tmp_path / "step-000002.tmp", 2, OSError("disk full"))


def test_young_daly_interval_is_logged_from_the_measured_save_time():
    from lightning_hybrid.callbacks.fault_tolerant import suggest_interval

    # 60 s saves, 24 h MTBF: sqrt(2 * 60 * 86400) = 3220 s before Daly's correction
    assert 3100 < suggest_interval(60.0, 24.0) < 3300


def _mount_tmpfs(path: Path, size: str) -> bool:
    """A real small file system at ``path`` (root only); False where mounting is not allowed."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("async_save,leave", [(True, 256 << 10), (True, 0), (False, 256 << 10)],
                         ids=["async_in_dcp_writer", "async_before_dcp", "sync_in_dcp_writer"])
def test_a_full_disk_fails_one_save_training_continues_and_the_next_save_commits(baseline, tmp_path, async_save,
                                                                                 leave):
    # The real DCP writer on a real 64 MB tmpfs: rank 0 fills it after step 5, so the step-6 save fails; the space
    # comes back after step 6. With 256 KiB left, the small files fit and DCP's shard writer fails (in its background
    # thread when async, as a CheckpointException, a BaseException); with none left, the first file already fails.
    import subprocess

    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, "64m")
    faults = ({"FILL_DISK_AT": 5, "FREE_DISK_AT": 6, "FILL_DISK_LEAVE": leave} if mounted
              else {"FAIL_LIKE_DCP_AT": 6})
    try:
        result = _run(tmp_path, disk / "ckpt", ASYNC=int(async_save), KEEP=3, **faults)
        log = result.stdout + result.stderr
        assert "checkpoint save of step 6 failed (1 in a row)" in log, log[-3000:]
        assert "No space left on device" in log or "unexpected pos" in log, log[-3000:]
        assert log.count("checkpoint save of step 6 failed") == 1  # logged once, by rank 0
        assert "step-000006 (step 6" not in log and "Traceback" not in log
        names = [c.path.name for c in committed_checkpoints(disk / "ckpt")]
        assert names == ["step-000008", "step-000004", "step-000002"]
        assert not list((disk / "ckpt").glob("*.tmp"))
        assert [d["loss"] for d in _losses(tmp_path)] == [d["loss"] for d in _losses(baseline)]
        assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
