"""Launch a test worker on N local gloo processes with torchrun, with a hard timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], timeout: float = 240, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node nproc args...``; a hang fails after ``timeout`` seconds."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}",
                **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    # torchrun and its workers share a new session: on a timeout all of them are killed, so a hung test leaves
    # no workers behind to slow down (or hold ports for) the rest of the suite.
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {' '.join(args)} ran past {timeout} s (killed):\n{stdout[-4000:]}\n"
                             f"{stderr[-8000:]}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def run_workers(nproc: int, configs: list[dict], out: Path, timeout: float = 300) -> dict[str, dict]:
    """Run ``dist_worker.py`` over ``configs`` in one process group; return each configuration's record."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "configs.json"
    spec.write_text(json.dumps(configs))
    torchrun(nproc, [str(HERE / "dist_worker.py"), str(spec), str(out)], timeout=timeout)
    import torch

    return {c["name"]: torch.load(out / f"{c['name']}.pt", weights_only=False) for c in configs}
