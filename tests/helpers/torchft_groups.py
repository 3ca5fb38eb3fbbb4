"""Launching a torchft job on this machine: ``lightning-hybrid lighthouse`` and one torchrun per replica group of
``tests/torchft_worker.py``, or, where no group is restarted (nothing of torchrun's agent is used), the groups' ranks
forked side by side from the tests' fork server (:meth:`helpers.fork_server.ForkServer.launch_groups`). Shared by
``tests/test_torchft.py`` and ``benchmarks/recovery.py --torchft``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_hybrid.launch.torchrun import free_port, kill_process_group, launcher_command

__all__ = ["Lighthouse", "run_groups"]

TESTS = Path(__file__).resolve().parents[1]
WORKER = TESTS / "torchft_worker.py"


def _env(extra: dict) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}",
            **{k: str(v) for k, v in extra.items()}}


class Lighthouse:
    """``lightning-hybrid lighthouse`` as a subprocess on a free port (heartbeat timeout 3 s)."""

    def __init__(self, min_replicas: int, join_timeout_ms: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_hybrid.launch.lighthouse", "--min-replicas", str(min_replicas),
             "--port", str(self.port), "--join-timeout-ms", str(join_timeout_ms), "--heartbeat-timeout-ms", "3000"],
            env=_env({}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        self.stop()
        raise AssertionError("the lighthouse did not start listening within 120 s")

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        kill_process_group(self.proc)
        self.proc.wait()


def _logs(out: Path) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-6000:]}" for log in sorted(out.glob("group*.log")))


def run_groups(out: Path, nproc: int, extra: dict, min_replicas: int, timeout: float, max_restarts: int = 0,
               groups: int = 2, join_timeout_ms: int = 10_000, fork: bool = False) -> dict:
    """Run ``groups`` replica groups of ``nproc`` processes each against a new lighthouse; return every rank's record
    (``{"<group>_<rank>": ...}``), plus ``killed_at`` / ``restarted`` (times) when the worker left them.

    ``fork``: the groups' ranks are forked from the fork server instead of started by a torchrun each (only without
    restarts: restarting a group is torchrun's agent's job)."""
    if fork and max_restarts:
        raise ValueError(f"max_restarts={max_restarts} needs torchrun's agent: fork=False")
    out.mkdir(parents=True, exist_ok=True)
    lighthouse = Lighthouse(min_replicas, join_timeout_ms)
    procs = []
    try:
        if fork:
            _fork_groups(out, nproc, extra, lighthouse.address, groups, timeout)
            return _records(out)
        for g in range(groups):
            env = _env({"OUT": out, "REPLICA_GROUP_ID": g, "NUM_REPLICA_GROUPS": groups,
                        "TORCHFT_LIGHTHOUSE": lighthouse.address, **extra})
            cmd = [*launcher_command(nproc), "--max-restarts", str(max_restarts), str(WORKER)]
            with open(out / f"group{g}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        for g, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"replica group {g} ran past {timeout} s:\n" + _logs(out)) from None
        failed = [g for g, p in enumerate(procs) if p.returncode != 0]
        assert not failed, f"replica groups {failed} failed:\n" + _logs(out)
    finally:
        for proc in procs:
            kill_process_group(proc)
        lighthouse.stop()
    return _records(out)


def _fork_groups(out: Path, nproc: int, extra: dict, lighthouse: str, groups: int, timeout: float) -> None:
    from helpers.fork_server import fork_server

    envs = [{"REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(groups)} for g in range(groups)]
    result = fork_server().launch_groups(nproc, [str(WORKER)], _env({"OUT": out, "TORCHFT_LIGHTHOUSE": lighthouse,
                                                                      **extra}),
                                         envs, [out / f"group{g}.log" for g in range(groups)], timeout=timeout)
    assert result.returncode == 0, f"replica groups failed:\n{result.stderr[-2000:]}\n" + _logs(out)


def _records(out: Path) -> dict:
    records = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*_*.pt")}
    for mark in ("killed_at", "restarted"):
        if (out / mark).exists():
            records[mark] = float((out / mark).read_text())
    return records
