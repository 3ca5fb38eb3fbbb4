"""Launch a test worker on N local gloo processes with torchrun, with a hard timeout.

The command line and the kill of the whole process group on a timeout are the package's own
(:mod:`lightning_hybrid.launch.torchrun`, also behind the notebooks' ``launch_cli``); this adds what tests need:
``PYTHONPATH`` pointing at the tests folder (workers import ``helpers``, ``user_module``, ``mesh_probe``),
stdout and stderr captured apart, and an ``AssertionError`` with the output's tail on a failure or a hang.

:func:`launch` starts the same process group without paying each rank's imports: its ranks are forked from a process
that imported torch, Lightning and the package once (:mod:`helpers.fork_server`). Tests of the math, the state and the
errors inside a run use it; tests of what torchrun's agent does (restarts, exit codes, signals to a worker, the
rendezvous) use :func:`torchrun`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Optional

from lightning_hybrid.launch.torchrun import free_port, kill_process_group, launcher_command

__all__ = ["TESTS", "free_port", "kill_process_group", "worker_env", "torchrun", "launch", "run_workers",
           "leftover_processes"]

TESTS = Path(__file__).resolve().parents[1]  # the tests folder: worker scripts live here


def worker_env(extra: Optional[dict] = None) -> dict[str, str]:
    """This process's environment for a launched worker: one thread per process, the tests folder importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}",
            **(extra or {})}


def torchrun(nproc: int, args: list[str], timeout: float = 240, env: Optional[dict] = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node nproc args...``; a hang fails after ``timeout`` seconds."""
    cmd = [*launcher_command(nproc), *args]
    # torchrun and its workers share a new session: on a timeout all of them are killed, so a hung test leaves
    # no workers behind to slow down (or hold ports for) the rest of the suite.
    proc = subprocess.Popen(cmd, env=worker_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(proc)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {' '.join(args)} ran past {timeout} s (killed):\n{stdout[-4000:]}\n"
                             f"{stderr[-8000:]}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-8000:]}")
    return result


def launch(nproc: int, args: list[str], timeout: float = 240, env: Optional[dict] = None,
           check: bool = True, keep_going: bool = False) -> subprocess.CompletedProcess:
    """:func:`torchrun`'s process group (the same environment in each rank, the others stopped when one fails), its
    ranks forked from :func:`helpers.fork_server.fork_server`; a failure or a hang raises as :func:`torchrun` does.
    ``keep_going``: no rank is stopped for another's failure, and each rank's non-zero exit code is printed."""
    from helpers.fork_server import fork_server

    result = fork_server().launch(nproc, args, env=worker_env(env), timeout=timeout, keep_going=keep_going)
    if check and result.returncode != 0:
        raise AssertionError(f"{result.args[0]} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-8000:]}")
    return result


def run_workers(nproc: int, configs: list[dict], out: Path, timeout: float = 300) -> dict[str, dict]:
    """Run ``dist_worker.py`` over ``configs`` in one process group; return each configuration's record."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "configs.json"
    spec.write_text(json.dumps(configs))
    launch(nproc, [str(TESTS / "dist_worker.py"), str(spec), str(out)], timeout=timeout)
    import torch

    return {c["name"]: torch.load(out / f"{c['name']}.pt", weights_only=False) for c in configs}


def leftover_processes(out: Path, wait: float = 0.0) -> list[int]:
    """Processes still alive that were started for ``out`` (their environment holds ``OUT=<out>``, as every worker's
    and everything it spawned does), after waiting up to ``wait`` seconds for them to end."""
    import time

    mark = f"OUT={out}".encode()
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if mark in (entry / "environ").read_bytes().split(b"\0") and b"Z" not in _state(entry):
                        found.append(int(entry.name))
                except OSError:
                    continue
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def _state(proc: Path) -> bytes:
    """The state letter of ``/proc/PID/stat`` (``Z``: a zombie, dead and waiting to be reaped)."""
    stat = (proc / "stat").read_bytes()
    return stat[stat.rindex(b")") + 2:][:1]
