"""The notebook launcher finds a job's ranks among its child processes and kills exactly the one asked for."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from lightning_hybrid.launch.torchrun import LocalJob, torchrun_command, worker_pids

# A stand-in for torchrun: starts one worker per rank (RANK in its environment), one of them through an
# intermediate process as a wrapper script would, and waits.
LAUNCHER = """
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
workers = [subprocess.Popen(sleep, env={**os.environ, "RANK": "0"}),
           subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])", *sleep],
                            env={**os.environ, "RANK": "1"}),
           subprocess.Popen(sleep, env={**os.environ, "RANK": "2"})]
print("started", flush=True)
time.sleep(60)
"""


@pytest.fixture
def launcher():
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 20
    while len(worker_pids(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    yield proc
    import os

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.timeout(60)
def test_worker_pids_maps_every_rank_to_its_own_process(launcher):
    ranks = worker_pids(launcher.pid)
    assert sorted(ranks) == [0, 1, 2]
    assert len(set(ranks.values())) == 3 and launcher.pid not in ranks.values()


@pytest.mark.timeout(60)
def test_kill_rank_ends_that_rank_only_and_records_it(launcher):
    job = LocalJob(launcher, nproc=3)
    before = worker_pids(launcher.pid)
    assert job.kill_rank(2) == before[2]
    deadline = time.monotonic() + 10
    while 2 in worker_pids(launcher.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = worker_pids(launcher.pid)
    assert 2 not in after and after[0] == before[0] and after[1] == before[1]
    assert job.killed == [(2, int(signal.SIGKILL))]
    with pytest.raises(RuntimeError, match="no running process has rank 2"):
        job.kill_rank(2)
    with pytest.raises(ValueError, match=r"rank=3 is not a rank of this job; use 0 to 2"):
        job.kill_rank(3)


def test_torchrun_command_refuses_bad_process_counts_and_empty_arguments():
    with pytest.raises(ValueError, match=r"nproc=0 must be a positive integer"):
        torchrun_command(["fit"], 0)
    with pytest.raises(ValueError, match=r"args is empty"):
        torchrun_command([], 2)
    assert torchrun_command(["fit", "--config", "x.yaml"], 2, port=29999)[-6:] == [
        "29999", "-m", "lightning_hybrid.cli", "fit", "--config", "x.yaml"]
