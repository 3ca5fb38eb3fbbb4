"""Per-step fault tolerance with torchft replica groups: torchft's real lighthouse on localhost, each replica group
its own torchrun launch of gloo processes, real SIGKILLs."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.launch import TESTS, free_port, kill_process_group, worker_env
from lightning_hybrid.launch.torchrun import launcher_command

pytest.importorskip("torchft")

STEPS = 8


class Lighthouse:
    """``lightning-hybrid lighthouse`` as a subprocess on a free port."""

    def __init__(self, min_replicas: int, join_timeout_ms: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_hybrid.launch.lighthouse", "--min-replicas", str(min_replicas),
             "--port", str(self.port), "--join-timeout-ms", str(join_timeout_ms), "--heartbeat-timeout-ms", "3000"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        self.stop()
        raise AssertionError("the lighthouse did not start listening within 60 s")

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        kill_process_group(self.proc)
        self.proc.communicate()


def _launch_group(nproc: int, group: int, groups: int, lighthouse: str, out: Path, extra: dict,
                  max_restarts: int = 0) -> subprocess.Popen:
    env = worker_env({"OUT": str(out), "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(groups),
                      "TORCHFT_LIGHTHOUSE": lighthouse, **{k: str(v) for k, v in extra.items()}})
    cmd = [*launcher_command(nproc), "--max-restarts", str(max_restarts), str(TESTS / "torchft_worker.py")]
    log = open(out / f"group{group}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(procs: list[subprocess.Popen], out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for i, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_process_group(p)
            raise AssertionError(f"replica group {i} ran past {timeout} s:\n" + _logs(out))
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"replica groups {failed} failed:\n" + _logs(out)


def _logs(out: Path) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-5000:]}" for log in sorted(out.glob("group*.log")))


def _run_groups(tmp: Path, nproc: int, extra: dict, min_replicas: int, join_timeout_ms: int, timeout: float,
                max_restarts: int = 0) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    lighthouse = Lighthouse(min_replicas, join_timeout_ms)
    try:
        procs = [_launch_group(nproc, g, 2, lighthouse.address, tmp, extra, max_restarts) for g in range(2)]
        _wait(procs, tmp, timeout)
    finally:
        lighthouse.stop()
    return {p.stem: torch.load(p, weights_only=False) for p in tmp.glob("*_*.pt")}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def no_fault(tmp_path_factory) -> dict:
    """2 replica groups x 2 processes (tp=2) under torchft, and one launch of 4 processes, HSDP 2 replicas x 2."""
    tmp = tmp_path_factory.mktemp("torchft_no_fault")
    groups = _run_groups(tmp / "ft", 2, {"TP": 2, "STEPS": STEPS, "MIN_GROUPS": 2}, min_replicas=2,
                         join_timeout_ms=60_000, timeout=300)
    ref_dir = tmp / "ref"
    ref_dir.mkdir()
    env = worker_env({"OUT": str(ref_dir), "REFERENCE": "1", "TP": "2", "STEPS": str(STEPS), "DP_SHARD": "1"})
    subprocess.run([*launcher_command(4), str(TESTS / "torchft_worker.py")], env=env, check=True, timeout=300,
                   capture_output=True)
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


# ---------------------------------------------------------------- bad input (one process, no launch)

from lightning_hybrid.distributed.fault_tolerance import check_fault_tolerance  # noqa: E402

GOOD_ENV = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510"}


def test_the_replica_group_comes_from_torchfts_environment():
    env = check_fault_tolerance("torchft", 2, GOOD_ENV)
    assert (env.group_id, env.num_groups, env.lighthouse, env.min_replica_groups) == (1, 2, GOOD_ENV[
        "TORCHFT_LIGHTHOUSE"], 2)
    assert check_fault_tolerance(None, 1, {}) is None


def test_torchft_without_its_environment_names_the_missing_variables():
    with pytest.raises(ValueError, match=r"needs NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE in the environment"):
        check_fault_tolerance("torchft", 1, {"REPLICA_GROUP_ID": "0"})


@pytest.mark.parametrize("env, match", [
    ({**GOOD_ENV, "REPLICA_GROUP_ID": "2"}, r"REPLICA_GROUP_ID=2 with NUM_REPLICA_GROUPS=2: .* in 0\.\.1"),
    ({**GOOD_ENV, "REPLICA_GROUP_ID": "one"}, r"REPLICA_GROUP_ID='one' is not an integer"),
])
def test_an_inconsistent_replica_group_environment_is_one_line(env, match):
    with pytest.raises(ValueError, match=match) as err:
        check_fault_tolerance("torchft", 1, env)
    assert "\n" not in str(err.value)


def test_more_min_replica_groups_than_groups_is_refused():
    with pytest.raises(ValueError, match=r"min_replica_groups=3 is larger than NUM_REPLICA_GROUPS=2; use 1\.\.2"):
        check_fault_tolerance("torchft", 3, GOOD_ENV)


def test_an_unknown_fault_tolerance_is_refused():
    with pytest.raises(ValueError, match=r"fault_tolerance='torchelastic' is not known; use None or 'torchft'"):
        check_fault_tolerance("torchelastic", 1, GOOD_ENV)


def test_torchft_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning-hybrid\[ft\]'"):
        check_fault_tolerance("torchft", 1, GOOD_ENV)


def test_the_strategy_refuses_torchft_without_environment_on_construction(monkeypatch):
    from lightning_hybrid import HybridParallelStrategy

    for name in GOOD_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE"):
        HybridParallelStrategy(tp=2, fault_tolerance="torchft")


def test_the_cli_reports_a_bad_lighthouse_request_in_one_line():
    result = subprocess.run([sys.executable, "-m", "lightning_hybrid.cli", "lighthouse", "--min-replicas", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "--min-replicas 0 must be a positive integer (replica groups a quorum needs)")
    assert "Traceback" not in result.stderr
