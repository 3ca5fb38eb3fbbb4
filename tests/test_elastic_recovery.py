"""Recovery inside one torchrun launch: SIGKILL and SIGSTOP of workers, restarts, hang detection, 2 "nodes".

Each launch carries several faults (one per torchrun attempt) to keep the suite short. The tiny model at tp=2 x pp=2
on 4 processes, 8 steps, async checkpoints every 2 steps; a run without faults is the bitwise reference.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from helpers.compare import same_tensors
from helpers.launch import TESTS, free_port, kill_process_group, launch, leftover_processes, worker_env
from lightning_hybrid.distributed.elastic import peer_failure, round_store_prefix
from lightning_hybrid.distributed.heartbeat import (
    EXIT_CODE_HANG,
    Heartbeat,
    Seen,
    check_hang_timeout,
    describe,
    find_hang,
)

WORKER = str(TESTS / "elastic_worker.py")


def _torchrun(out: Path, nproc: int, max_restarts: int, nodes: Optional[str] = None, port: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--max-restarts",
           str(max_restarts), "--monitor-interval", "0.2"]
    if nodes is None:
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    else:  # one "node" of a multi-node job: the c10d rendezvous of the launchers, on 127.0.0.1
        cmd += ["--nnodes", nodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", out.name, "--local-addr", "127.0.0.1",
                "--rdzv-conf", "join_timeout=60,last_call_timeout=2"]
    return [*cmd, WORKER]


def _worker_variables(out: Path, variables: dict) -> dict[str, str]:
    """The worker's environment variables for a run writing into ``out`` (see tests/elastic_worker.py)."""
    return {"OUT": str(out), "CKPT": str(out / "ckpt"), **{k: str(v) for k, v in variables.items()}}


def _launch(out: Path, nodes: int = 1, max_restarts: int = 2, timeout: float = 400, nnodes: Optional[str] = None,
            **variables) -> list[subprocess.CompletedProcess]:
    """Run the worker under torchrun (``nodes`` agents of 4 // nodes processes each, NODE_TAG A, B, ...); fail on a
    hang. Node A starts first, so it hosts the c10d rendezvous store (a lost node B leaves it)."""
    out.mkdir(parents=True, exist_ok=True)
    env = worker_env(_worker_variables(out, variables))
    if nodes > 1:  # as the launchers: a fresh store each round (see lightning_hybrid/distributed/elastic.py)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env["LOGLEVEL"] = "INFO"  # torchrun's agents log a restart for a membership change at INFO (_agent_round_ends)
    port = free_port()
    cmds = [_torchrun(out, 4 // nodes, max_restarts, None if nodes == 1 else nnodes or f"{nodes}", port)
            for _ in range(nodes)]
    procs = []
    for i, cmd in enumerate(cmds):
        procs.append(subprocess.Popen(cmd, env={**env, "NODE_TAG": "AB"[i]}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
        if i == 0 and nodes > 1:
            _wait_for_port(port)
    results, deadline = [], time.monotonic() + timeout
    try:
        for proc, cmd in zip(procs, cmds):
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, output, ""))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_process_group(proc)
        tails = [proc.communicate()[0][-6000:] for proc in procs]
        raise AssertionError(f"torchrun ran past {timeout} s:\n" + "\n----\n".join(tails)) from None
    return results


def _wait_for_port(port: int, seconds: float = 60) -> None:
    import socket

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def _losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def _steps_by_round(out: Path) -> list[list[int]]:
    """The steps rank 0 logged, per worker process (one per restart round; torchrun's restart count is not a
    round number: with several agents, one restarted for a membership change does not count it)."""
    rounds: dict[int, list[int]] = {}
    for d in _losses(out):
        rounds.setdefault(d["pid"], []).append(d["step"])
    return list(rounds.values())


def _agent_round_ends(output: str, year: int) -> list[float]:
    """Times (epoch seconds) at which torchrun's agent ended a round of its workers: its "failed (exitcode" lines
    (logged after it stopped all its workers), or, when another agent's new round came first, its INFO line
    "Detected N new nodes ...; will restart worker group" (its still-running workers are stopped right after: a
    membership change, not counted as a restart). Which of the two an agent logs is a race between the agents."""
    import re
    from datetime import datetime

    pattern = r"^[EWI](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*\] (?:failed \(exitcode|\[\w+\] Detected \d+ new nodes)"
    found = re.findall(pattern, output, re.M)
    return [datetime.strptime(f"{year}{day} {clock}", "%Y%m%d %H:%M:%S.%f").timestamp() for day, clock in found]


def _final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=False)


def _check_clean_success(out: Path, results: list[subprocess.CompletedProcess]) -> str:
    log = "\n".join(r.stdout for r in results)
    assert all(r.returncode == 0 for r in results), log[-6000:]
    assert not leftover_processes(out)
    return log


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """No fault; rank 1's first step takes 12 s and a validation after step 4 takes 2 x 5 s, hang_timeout=8 s. Nothing
    of torchrun's agent is used (no restart), so its ranks fork from the tests' fork server."""
    out = tmp_path_factory.mktemp("reference")
    variables = dict(HANG_TIMEOUT=8, SLOW_FIRST_STEP=12, VAL_BATCHES=2, VAL_SLEEP=5, VAL_AT=4)
    launch(4, [WORKER], timeout=400, env={**_worker_variables(out, variables), "NODE_TAG": "A"})
    assert not leftover_processes(out)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_a_slow_first_step_and_a_long_validation_do_not_trip_the_hang_detector(reference):
    assert (reference / "slow_first_step").read_text() == "12.0"
    start, end = [json.loads(line) for line in (reference / "validations.jsonl").read_text().splitlines()][:2]
    assert end["end"] - start["start"] > 8  # longer than hang_timeout, every batch shorter
    assert [d["step"] for d in _losses(reference)] == list(range(1, 9))
    assert {d["attempt"] for d in _losses(reference)} == {0}


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_sigkill_mid_run_and_during_an_async_write_restart_in_job_to_bitwise_the_same_weights(reference, tmp_path):
    # attempt 0: rank 1 dies after step 5 (step 4 committed); attempt 1 resumes at 4 and rank 2 dies right after
    # step 6's async save started (never committed); attempt 2 resumes at 4 again and finishes.
    results = _launch(tmp_path, max_restarts=2, HANG_TIMEOUT="none", FAULTS="0:5:1:kill,1:6:2:kill")
    log = _check_clean_success(tmp_path, results)
    assert "Connection refused" not in log
    # What an operator reads: each surviving rank says in one line that it lost a peer (its rank, the step, what it
    # was doing, the peer's address) and exits for the restart; no traceback (there were 3 per kill)
    assert log.count("Traceback") == 0, log[-6000:]
    lost = re.findall(r"^rank (\d): lost a peer in step (\d+) \((.+?)\): (.+?); exiting with code 1 so that the "
                      r"launcher restarts the job", log, re.M)
    assert sorted((rank, step) for rank, step, _, _ in lost) == [("0", "6"), ("0", "7"), ("1", "7"), ("2", "6"),
                                                                 ("3", "6"), ("3", "7")], log[-6000:]
    assert len([line for line in log.splitlines() if "lost a peer" in line]) == 6
    assert any(re.fullmatch(r"the connection to the peer at 127\.0\.0\.1:\d+ closed", cause) for *_, cause in lost)
    assert _steps_by_round(tmp_path) == [[1, 2, 3, 4, 5], [5, 6], [5, 6, 7, 8]]
    final = _final(tmp_path)
    assert final["attempt"] == 2 and final["resumed_from"].endswith("step-000004")
    assert same_tensors(final["final"], _final(reference)["final"])
    reference_losses = {d["step"]: d["loss"] for d in _losses(reference)}
    assert all(d["loss"] == reference_losses[d["step"]] for d in _losses(tmp_path))


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_two_nodes_recover_in_job_from_a_sigstop_hang_and_a_sigkill_during_an_async_write(reference, tmp_path):
    # 2 agents x 2 processes, c10d rendezvous. attempt 0: rank 1 is SIGSTOPped after step 3; the heartbeat of the
    # others names it within hang_timeout, its neighbour on the host SIGKILLs it, all exit, torchrun restarts.
    # attempt 1: rank 2 SIGKILLed right after step 6's async save started. attempt 2 finishes from step 4.
    hang_timeout = 8
    results = _launch(tmp_path, nodes=2, max_restarts=2, HANG_TIMEOUT=hang_timeout, FAULTS="0:3:1:stop,1:6:2:kill")
    log = _check_clean_success(tmp_path, results)
    hangs = [line for line in log.splitlines() if "hang detected" in line]
    assert any("hang detected: rank 1 (" in line and "pp=0, dp=0, tp=1) stopped responding" in line
               for line in hangs), hangs or log[-6000:]
    assert "last finished step 3, then: after step 3" in log
    assert f"exits with code {EXIT_CODE_HANG}" in log
    stopped_at = float((tmp_path / "fault_0_stop_rank1").read_text().split()[0])
    from datetime import datetime

    for result in results:  # each agent ends its first round: its workers failed, or the other agent's restart
        ended = _agent_round_ends(result.stdout, datetime.fromtimestamp(stopped_at).year)[0]
        assert 0 < ended - stopped_at < hang_timeout + 30, ended - stopped_at
    assert _steps_by_round(tmp_path) == [[1, 2, 3], [3, 4, 5, 6], [5, 6, 7, 8]]
    assert same_tensors(_final(tmp_path)["final"], _final(reference)["final"])


def test_round_store_prefix_names_the_run_and_restart_only_for_the_agent_store():
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert round_store_prefix(env) == "lightning_hybrid/job7/restart-2/"
    assert round_store_prefix({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a fresh store each round
    assert round_store_prefix({}) is None


@pytest.mark.parametrize("value, error, message", [
    ("300", TypeError, r"hang_timeout='300' must be a number of seconds \(e.g. 300\) or None to turn it off"),
    (True, TypeError, r"hang_timeout=True must be a number"),
    (0, ValueError, r"hang_timeout=0 must be positive \(seconds, e.g. 300\) or None to turn it off"),
    (-5.0, ValueError, r"hang_timeout=-5.0 must be positive"),
])
def test_a_bad_hang_timeout_is_refused_in_one_line(value, error, message):
    from lightning_hybrid import HybridParallelStrategy

    with pytest.raises(error, match=message):
        HybridParallelStrategy(hang_timeout=value)
    assert check_hang_timeout(None) is None and check_hang_timeout(30) == 30.0


def _seen(**records: dict) -> dict[int, Seen]:
    return {int(k[1:]): Seen(dict(v), v.pop("beat_at"), v.pop("progress_at")) for k, v in records.items()}


def test_find_hang_names_a_frozen_rank_first_then_the_stuck_rank_furthest_behind():
    base = {"armed": True, "state": "running", "host": "n1", "coords": {"pp": 0, "dp": 0, "tp": 1}}
    seen = _seen(r0={**base, "beat_at": 99, "progress_at": 80, "position": 9, "step": 4},
                 r1={**base, "beat_at": 85, "progress_at": 80, "position": 8, "step": 4, "activity": "after step 4"},
                 r2={**base, "beat_at": 99, "progress_at": 99, "position": 9, "step": 4})
    hang = find_hang(seen, now=100, timeout=10, world_size=3, started=0)
    assert hang.rank == 1 and hang.frozen and hang.seconds == 15
    message = describe(hang, 10, me=0)
    assert message.startswith("hang detected: rank 1 (n1, pp=0, dp=0, tp=1) stopped responding (no heartbeat for 15 s")
    assert "last finished step 4, then: after step 4" in message
    seen[1].beat_at = 99  # alive: then the stuck one furthest behind is named, the others listed
    hang = find_hang(seen, now=100, timeout=10, world_size=3, started=0)
    assert (hang.rank, hang.frozen, hang.others) == (1, False, [0])
    seen[0].record["armed"] = seen[1].record["armed"] = False  # first step or not started: not watched
    assert find_hang(seen, now=100, timeout=10, world_size=3, started=0) is None
    seen[2].record["state"] = "stopped"
    seen[2].beat_at = 0  # a rank that finished is silent, not frozen
    assert find_hang(seen, now=100, timeout=10, world_size=3, started=0) is None
    assert find_hang({}, now=100, timeout=10, world_size=2, started=95) is None  # not heard from yet, not late
    assert find_hang({}, now=100, timeout=10, world_size=2, started=80).frozen


def test_a_rank_frozen_just_after_one_last_beat_is_named_frozen_not_stuck():
    # Rank 1 finished step 3 (progress seen at 10.0); its thread beat once more (seen at 10.8) before SIGSTOP; the
    # others started step 4 in between and wait for it. Its stuck age crosses the timeout before its frozen age:
    # it must still be named as frozen (and so be SIGKILLed by a rank on its host), not as a live stuck rank.
    base = {"armed": True, "state": "running", "host": "n1", "coords": {"pp": 0, "dp": 0, "tp": 1}, "step": 3}
    seen = _seen(r1={**base, "beat_at": 10.8, "progress_at": 10.0, "position": 6, "activity": "after step 3"},
                 r0={**base, "beat_at": 18.0, "progress_at": 10.1, "position": 7},
                 r2={**base, "beat_at": 18.0, "progress_at": 10.2, "position": 7})
    hang = find_hang(seen, now=18.1, timeout=8, world_size=3, started=0)
    assert (hang.rank, hang.frozen, hang.others) == (1, True, [0])
    assert round(hang.seconds, 1) == 7.3
    assert describe(hang, 8, me=2).startswith("hang detected: rank 1 (n1, pp=0, dp=0, tp=1) stopped responding")
    seen[1].beat_at = 17.9  # its beats go on: then it is stuck, the main thread is the problem
    hang = find_hang(seen, now=18.1, timeout=8, world_size=3, started=0)
    assert (hang.rank, hang.frozen) == (1, False)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_error_gloo_raises_for_a_dead_peer_is_seen_as_a_broken_process_group():
    # FaultTolerantCheckpoint.on_exception skips its save (and its 20 s barrier) on such an error: a save cannot
    # complete without the dead peer, and torchrun is already restarting the job.
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(TESTS / "dead_peer_worker.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=worker_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "RANK": str(rank), "WORLD_SIZE": "2"})) for rank in range(2)]
    try:
        outputs = [proc.communicate(timeout=100) for proc in procs]
    finally:
        for proc in procs:
            kill_process_group(proc)
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert result["type"] == "RuntimeError", result  # gloo's own error type, not a DistError
    # gloo says "Connection closed by peer" (pair.cc: EOF) or "Read error ... Connection reset by peer", by timing
    assert "closed by peer" in result["direct"] or "reset by peer" in result["direct"], result
    assert result["wrapped"] == result["direct"], result
    assert peer_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    assert peer_failure(ValueError("loss is nan")) is None
    assert peer_failure(ConnectionResetError(104, "Connection reset by peer")) is None  # a data loader's pipe
    import torch.distributed as dist

    assert peer_failure(dist.DistBackendError("NCCL error: remote process exited\nmore")) == (
        "NCCL error: remote process exited")


def test_the_save_on_exception_is_skipped_only_when_the_process_group_is_broken(tmp_path, caplog):
    from types import SimpleNamespace

    import torch.distributed as dist

    from lightning_hybrid import FaultTolerantCheckpoint

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        checkpoint = FaultTolerantCheckpoint(tmp_path / "ckpt", every_n_steps=2)
        checkpoint._training_started = True
        calls: list = []
        checkpoint._commit = lambda trainer: calls.append("commit")
        checkpoint._save = lambda trainer, step, async_save: calls.append(("save", step, async_save)) is None
        trainer = SimpleNamespace(global_step=5, global_rank=0, strategy=SimpleNamespace(checkpoint_group=None))
        # the text gloo's pair.cc raises for a peer that is gone (tests/dead_peer_worker.py gets it from torch)
        gone = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                            "closed by peer [127.0.0.1]:9099. This is typically caused by a remote worker crashing.")
        try:
            raise RuntimeError("pipeline step failed") from gone
        except RuntimeError as wrapped:
            with caplog.at_level("INFO", logger="lightning_hybrid.callbacks.fault_tolerant"):
                checkpoint.on_exception(trainer, None, wrapped)
        assert calls == [] and "the process group is broken ([/__w/" in caplog.text, (calls, caplog.text)
        checkpoint.on_exception(trainer, None, ValueError("loss is nan"))  # every rank alive: the save is tried
        assert calls == ["commit", ("save", 5, False)]
    finally:
        dist.destroy_process_group()


def test_heartbeat_thread_reports_a_peer_whose_beats_stop(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    found: list[str] = []
    beat = Heartbeat(1.0, store, rank=0, world_size=2, identity={"host": "h", "coords": {"pp": 0, "dp": 0, "tp": 0}},
                     on_hang=lambda message, hang: found.append(message), interval=0.1)
    peer = {"beat": 1, "progress": 1, "step": 2, "activity": "training step 3", "armed": True, "state": "running",
            "host": "h2", "coords": {"pp": 0, "dp": 1, "tp": 0}, "position": 5}
    store.set("heartbeat/1", json.dumps(peer))
    beat.start()
    beat.progress("training step 3", 2, arm=True, position=5)
    deadline = time.monotonic() + 10
    while not found and time.monotonic() < deadline:
        beat.progress("training step 3", 2, arm=True, position=5)  # this rank keeps making progress
        time.sleep(0.05)
    beat.stop()
    assert found and found[0].startswith("hang detected: rank 1 (h2, pp=0, dp=1, tp=0) stopped responding")


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_a_lost_node_shrinks_dp_and_training_finishes_on_the_survivors_with_the_same_losses(reference, tmp_path):
    # 2 agents x 2 processes with --nnodes 1:2, tp=2 so dp=2. After step 3, node B (agent and workers) is killed
    # for good; node A's agent re-forms the job alone: world 2, dp=1, tp unchanged, the dp-sharded checkpoint of
    # step 2 resharded on load, the global batch kept (the worker's per-rank batch is 8 // dp). The losses are those
    # of the unchanged reference run (tp=2 x pp=2, same global batches) to fp32 rounding.
    node_a, node_b = _launch(tmp_path, nodes=2, nnodes="1:2", max_restarts=1, TP=2, PP=1, HANG_TIMEOUT="none",
                             FAULTS="0:3:nodeB:node")
    assert node_a.returncode == 0, node_a.stdout[-6000:]
    assert node_b.returncode != 0  # killed with its workers
    assert not leftover_processes(tmp_path)
    losses = _losses(tmp_path)
    assert {(d["attempt"], d["world"]) for d in losses} == {(0, 4), (1, 2)}
    assert [d["step"] for d in losses if d["attempt"] == 1] == [3, 4, 5, 6, 7, 8]
    assert _final(tmp_path)["resumed_from"].endswith("step-000002")
    expected = {d["step"]: d["loss"] for d in _losses(reference)}
    for d in losses:
        assert abs(d["loss"] - expected[d["step"]]) <= 1e-5 * abs(expected[d["step"]]), d


def test_a_changed_global_batch_on_resume_is_reported_with_the_ways_to_keep_it():
    from lightning_hybrid.distributed.elastic import global_batch_error

    assert global_batch_error(8, 4, 2) is None and global_batch_error(None, 4, 1) is None
    assert global_batch_error(8, 4, 1) == (
        "global batch changed on resume: the checkpoint was trained with 8 samples per step, this run has "
        "batch_size=4 x dp=1 = 4; use batch_size=8 per rank to keep it or Trainer(accumulate_grad_batches=2) to make "
        "up the difference")
    assert global_batch_error(12, 8, 1).endswith("use batch_size=12 per rank to keep it")
    assert global_batch_error(9, 4, 2).endswith("use a dp that divides 9 to keep it")
