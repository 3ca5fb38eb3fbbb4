"""Time to recovery inside one torchrun launch, split into its parts, for three faults of the tiny model on CPU.

    python benchmarks/recovery.py                  # all three faults, hang_timeout 10 s
    python benchmarks/recovery.py --fault killed   # one of: killed, hung, lost-node
    python benchmarks/recovery.py --torchft        # torchft replica groups against the whole-job restart, same run

Each fault runs the tests' worker (``tests/elastic_worker.py``: the tiny Qwen2, 8 steps, async checkpoints every
2 steps) under torchrun and reads the timestamps the worker and torchrun leave:

- **killed rank**: one torchrun, 4 processes, tp=2 x pp=2; rank 1 SIGKILLs itself after step 5 (the step-4
  checkpoint is committed).
- **hung rank**: the same, rank 1 SIGSTOPs itself after step 5; ``hang_timeout`` ends the job.
- **lost node**: 2 torchrun agents ("nodes") x 4 processes with ``--nnodes 1:2`` and the c10d rendezvous,
  tp=2 x pp=2 x dp=2; node B (agent and workers) is SIGKILLed after step 5; node A continues alone with dp=1.

Columns (seconds): *detection + old workers stopped* (fault -> torchrun's agent logs the failure, which it does
after it has stopped the other workers of the round), *rendezvous + spawn* (-> the first new worker process runs),
*startup* (-> every new worker has its process group: Python and torch imports, process-group init), *load*
(-> training starts: model build and checkpoint load), *redone* (-> the first optimizer step past the fault: the
steps since the checkpoint again) and *total* (fault -> that step). One run per fault, on a shared machine.

``--torchft``: 2 replica groups x 2 processes (tp=2, ``fault_tolerance="torchft"``, torchft's lighthouse on
localhost; the tests' ``tests/torchft_worker.py``); all of group 1 is SIGKILLed in the middle of step 4 and its
torchrun restarts it. Columns: *survivors' next step* (kill -> group 0's first committed step without it: the
lighthouse's 3 s heartbeat timeout, the discarded step, one step), *restarted* (kill -> the new workers run),
*rejoined* (kill -> the first step group 1 takes part in again, after healing from group 0), and the whole-job
restart's *total* for the killed rank, run in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "elastic_worker.py"
FAULT_STEP = 5
FAILED = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*\] failed \(exitcode", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(nproc: int, port: int, out: Path, nnodes: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--max-restarts", "1",
           "--monitor-interval", "0.2"]
    if nnodes:
        cmd += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", out.name, "--local-addr", "127.0.0.1",
                "--rdzv-conf", "join_timeout=60,last_call_timeout=2"]
    else:
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    return [*cmd, str(WORKER)]


def _wait_for_port(port: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def run_fault(fault: str, out: Path, hang_timeout: float, timeout: float) -> dict:
    """Run one fault; return the phase durations (seconds)."""
    out.mkdir(parents=True)
    faults = {"killed": f"0:{FAULT_STEP}:1:kill", "hung": f"0:{FAULT_STEP}:1:stop",
              "lost-node": f"0:{FAULT_STEP}:nodeB:node"}[fault]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}", "OUT": str(out),
           "CKPT": str(out / "ckpt"), "FAULTS": faults, "TP": "2", "PP": "2", "STEPS": "8", "EVERY": "2",
           "HANG_TIMEOUT": str(hang_timeout) if fault == "hung" else "none",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # as the launchers: a fresh store each round
    port = _free_port()
    nodes = 2 if fault == "lost-node" else 1
    procs = []
    for i in range(nodes):
        cmd = _agent(4, port, out, "1:2" if nodes == 2 else "")
        procs.append(subprocess.Popen(cmd, env={**env, "NODE_TAG": "AB"[i]}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
        if nodes == 2 and i == 0:
            _wait_for_port(port)
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if procs[0].returncode != 0:
        raise RuntimeError(f"{fault}: torchrun failed:\n{logs[0][-4000:]}")
    return phases(out, logs[0])


def _marks(out: Path, what: str, attempt: int) -> list[float]:
    return [float(p.read_text().split()[0]) for p in out.glob(f"{what}_{attempt}_rank*")]


def phases(out: Path, agent_log: str) -> dict:
    fault_at = float(next(out.glob("fault_0_*")).read_text().split()[0])
    match = FAILED.search(agent_log)
    if match is None:
        raise RuntimeError("torchrun's log has no 'failed (exitcode' line")
    year = datetime.fromtimestamp(fault_at).year
    detected = datetime.strptime(f"{year}{match.group(1)} {match.group(2)}", "%Y%m%d %H:%M:%S.%f").timestamp()
    spawned = min(_marks(out, "start", 1))
    ready = max(_marks(out, "setup", 1))
    loaded = max(_marks(out, "loaded", 1))
    losses = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    first_new = min(d["time"] for d in losses if d["attempt"] == 1 and d["step"] == FAULT_STEP + 1)
    resumed = json.loads((out / "losses.jsonl").read_text().splitlines()[-1])
    return {"detection": detected - fault_at, "rendezvous": spawned - detected, "startup": ready - spawned,
            "load": loaded - ready,
            "redone": first_new - loaded, "total": first_new - fault_at, "world_after": resumed["world"]}


def run_torchft(out: Path, timeout: float) -> dict:
    """The torchft kill-and-rejoin scenario; the phase times (seconds from the kill)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.torchft_groups import run_groups

    records = run_groups(out, 2, {"TP": 2, "STEPS": 12, "KILL_AT": 4, "STEP_SLEEP": 1}, min_replicas=1,
                         timeout=timeout, max_restarts=1)
    killed = records["killed_at"]
    live = [s for s in records["0_0"]["steps"] if s["time"] > killed]
    survivors = next(s for s in live if s["committed"])
    back = records["1_0"]["steps"][0]
    return {"survivors": survivors["time"] - killed, "restarted": records["restarted"] - killed,
            "rejoined": back["time"] - killed, "discarded": sum(not s["committed"] for s in live),
            "degraded": sum(s["participants"] == 1 for s in live)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchft", action="store_true",
                        help="torchft replica groups against the whole-job restart (killed rank), in the same run")
    parser.add_argument("--fault", choices=["killed", "hung", "lost-node"], action="append")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.torchft:
        with tempfile.TemporaryDirectory() as tmp:
            whole = run_fault("killed", Path(tmp) / "killed", args.hang_timeout, args.timeout)
            ft = run_torchft(Path(tmp) / "torchft", args.timeout)
        print("\nrecovery of the tiny model on 4 CPU processes (gloo): a killed rank, whole-job in-job restart against "
              "torchft replica groups (2 groups x tp=2, the whole group killed)\n")
        print("| recovery | fault -> training again s | fault -> the failed part back s | steps redone | "
              "steps discarded | degraded steps |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        print(f"| whole-job restart (tp=2 x pp=2, checkpoint of step 4) | {whole['total']:.1f} | {whole['total']:.1f} "
              f"| 1 | 0 | 0 |")
        print(f"| torchft replica groups | {ft['survivors']:.1f} | {ft['rejoined']:.1f} (restarted at "
              f"{ft['restarted']:.1f}) | 0 | {ft['discarded']} | {ft['degraded']} |")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fault in args.fault or ["killed", "hung", "lost-node"]:
            rows.append((fault, run_fault(fault, Path(tmp) / fault, args.hang_timeout, args.timeout)))
    print(f"\nrecovery of the tiny model, tp=2 x pp=2, CPU/gloo, fault after step {FAULT_STEP}, checkpoint at step 4 "
          f"(hang_timeout={args.hang_timeout:g} s)\n")
    print("| fault | detection + old workers stopped s | rendezvous + spawn s | startup s | model + checkpoint load s "
          "| steps redone s | total s | processes after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fault, p in rows:
        print(f"| {fault} | {p['detection']:.1f} | {p['rendezvous']:.1f} | {p['startup']:.1f} | {p['load']:.1f} "
              f"| {p['redone']:.1f} | {p['total']:.1f} | {p['world_after']} |")


if __name__ == "__main__":
    main()
