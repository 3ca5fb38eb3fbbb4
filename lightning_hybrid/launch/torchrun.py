"""Run ``lightning-hybrid`` on several local processes from a Jupyter notebook and read back its metrics.

Lightning's own launchers do not work inside Jupyter: the subprocess launcher re-runs the script
(a notebook has none) and a forked launcher cannot ship DTensor state back. :func:`launch_cli` runs
``torchrun ... -m lightning_hybrid.cli SUBCOMMAND ...`` as a child process instead, streams its
output into the cell while it runs, and returns the TensorBoard scalars the run logged. Nothing here
imports ``torch.distributed``; the notebook's kernel stays a single plain process.

    from lightning_hybrid.launch.torchrun import launch_cli
    run = launch_cli(["fit", "--config", "recipes/tiny-cpu.yaml", "--trainer.max_steps", "20"], nproc=4,
                     log_dir="runs/quickstart")
    steps, losses = zip(*run["scalars"]["train_loss"])

To see fault tolerance at work, ``on_line`` watches the output and can kill one rank of the running job
(``job.kill_rank(3)``), as a failing GPU or node would; ``check=False`` returns the failed run instead of
raising.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = ["launch_cli", "read_scalars", "latest_version_dir", "free_port", "torchrun_command", "launcher_command",
           "kill_process_group", "worker_pids", "LocalJob"]

# Options whose value is a path: made absolute, because the child process runs in ``log_dir``.
_PATH_OPTIONS = ("--config", "-c")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for the rendezvous of a local run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_command(nproc: int, port: Optional[int] = None) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node N --master_addr 127.0.0.1 --master_port PORT``.

    The script (or ``-m module``) to launch and its arguments follow. The tests' launcher
    (``tests/helpers/launch.py``) starts its worker scripts with it too.

    Args:
        nproc: processes on this machine.
        port: rendezvous port on 127.0.0.1; ``None`` picks a free one.

    Raises:
        ValueError: ``nproc`` is not a positive integer.
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be a positive integer (processes to start)")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port or free_port())]


def torchrun_command(args: list[str], nproc: int, port: Optional[int] = None) -> list[str]:
    """The command line ``python -m torch.distributed.run --nproc_per_node N ... -m lightning_hybrid.cli ARGS``.

    Args:
        args: the ``lightning-hybrid`` arguments, starting with the subcommand (``fit``, ``validate``, ...).
        nproc: processes on this machine.
        port: rendezvous port on 127.0.0.1; ``None`` picks a free one.

    Raises:
        ValueError: ``nproc`` is not a positive integer or ``args`` is empty.
    """
    launcher = launcher_command(nproc, port)
    if not args:
        raise ValueError("args is empty; start it with a subcommand, e.g. ['fit', '--config', 'recipes/tiny-cpu.yaml']")
    return [*launcher, "-m", "lightning_hybrid.cli", *args]


def _absolute_paths(args: list[str]) -> list[str]:
    out, expect_path = [], False
    for arg in args:
        if expect_path:
            out.append(str(Path(arg).resolve()))
            expect_path = False
            continue
        name, eq, value = arg.partition("=")
        if eq and name in _PATH_OPTIONS:
            out.append(f"{name}={Path(value).resolve()}")
        else:
            out.append(arg)
            expect_path = arg in _PATH_OPTIONS
    return out


def latest_version_dir(log_dir: Union[str, Path]) -> Optional[Path]:
    """The newest folder under ``log_dir`` that holds TensorBoard event files (``None`` when there is none)."""
    events = sorted(Path(log_dir).rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    return events[-1].parent if events else None


def read_scalars(run_dir: Union[str, Path]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files in ``run_dir``: tag -> [(step, value), ...] by step.

    Raises:
        FileNotFoundError: ``run_dir`` holds no event file.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event file in {run_dir}; did the run log anything "
                                f"(trainer.logger, trainer.log_every_n_steps)?")
    scalars: dict[str, dict[int, float]] = {}
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                scalars.setdefault(tag, {})[int(event.step)] = float(event.value)
    return {tag: sorted(values.items()) for tag, values in scalars.items()}


def _children(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (psutil when installed, else Linux's /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
    proc = Path("/proc")
    if not proc.is_dir():
        raise RuntimeError("finding the worker processes needs psutil on this system (pip install psutil)")
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                # /proc/PID/stat: "pid (command) state ppid ..."; the command may hold spaces and parentheses.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def _environment(pid: int) -> dict[str, str]:
    try:
        import psutil
    except ImportError:
        psutil = None
    try:
        if psutil is not None:
            return dict(psutil.Process(pid).environ())
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except Exception:  # noqa: BLE001 - the process ended meanwhile or is not ours (psutil errors are no OSError)
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """Global rank -> process id of the training processes a torchrun (``launcher_pid``) started on this machine.

    Workers are recognised by the ``RANK`` variable torchrun sets in their environment.

    Raises:
        RuntimeError: the processes cannot be listed on this system (no /proc and no psutil).
    """
    ranks = {}
    for pid in _children(launcher_pid):
        rank = _environment(pid).get("RANK")
        if rank is not None and rank.isdigit() and int(rank) not in ranks:
            ranks[int(rank)] = pid
    return ranks


class LocalJob:
    """A running ``launch_cli`` job, handed to its ``on_line`` callback."""

    def __init__(self, proc: subprocess.Popen, nproc: int) -> None:
        self.proc = proc
        self.nproc = nproc
        self.killed: list[tuple[int, int]] = []  # (rank, signal) sent by kill_rank

    def kill_rank(self, rank: int, signum: int = signal.SIGKILL) -> int:
        """Send ``signum`` (SIGKILL by default: no handler runs, as when a GPU or node dies) to one rank.

        Returns:
            The process id that got the signal.

        Raises:
            ValueError: ``rank`` is not a rank of this job.
            RuntimeError: no process with that rank is running (not started yet, or already ended).
        """
        if not isinstance(rank, int) or not 0 <= rank < self.nproc:
            raise ValueError(f"rank={rank!r} is not a rank of this job; use 0 to {self.nproc - 1}")
        pid = worker_pids(self.proc.pid).get(rank)
        if pid is None:
            raise RuntimeError(f"no running process has rank {rank} (the job has not started it or it ended)")
        os.kill(pid, signum)
        self.killed.append((rank, int(signum)))
        return pid


def kill_process_group(proc: subprocess.Popen) -> None:
    """Kill torchrun and the workers it started.

    ``proc`` must have been started with ``start_new_session=True`` (as here and in the tests' launcher): torchrun
    and its workers then share a process group of their own, and none of them is left behind.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pump(proc: subprocess.Popen, pending: queue.Queue) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        pending.put(raw.rstrip("\n"))
    pending.put(None)


def _follow(job: LocalJob, deadline: float, echo: Optional[Callable[[str], None]], keep: Callable[[str], bool],
            on_line: Optional[Callable[[str, LocalJob], None]]) -> tuple[list[str], bool]:
    """Pass the job's output lines on as they arrive until it ends; ``(all lines, whether it ran past deadline)``.

    A reader thread feeds a queue; this thread echoes (so output lands in the calling cell) and watches the clock
    (``time.perf_counter()`` against ``deadline``). On a timeout, or any exception (an interrupted cell), the job's
    whole process group is killed: no worker is left behind.
    """
    proc = job.proc
    pending: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc, pending), daemon=True)
    reader.start()
    lines: list[str] = []
    timed_out = False
    try:
        while True:
            if time.perf_counter() > deadline:
                timed_out = True
                kill_process_group(proc)
                break
            try:
                line = pending.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:  # end of output
                break
            lines.append(line)
            if echo is not None and keep(line):
                echo(line)
            if on_line is not None:
                on_line(line, job)
    except BaseException:  # an interrupted cell must not leave workers behind
        kill_process_group(proc)
        raise
    proc.wait()
    reader.join(timeout=5)
    return lines, timed_out


def launch_cli(args: list[str], nproc: int, log_dir: Union[str, Path], timeout: float = 600,
               env: Optional[dict[str, str]] = None, echo: Optional[Callable[[str], None]] = print,
               keep: Callable[[str], bool] = lambda line: True,
               on_line: Optional[Callable[[str, LocalJob], None]] = None, check: bool = True) -> dict:
    """Run ``lightning-hybrid ARGS`` on ``nproc`` local processes with torchrun and return what it logged.

    The child runs in ``log_dir`` (created if needed), so a recipe's ``logger.save_dir: .`` writes there;
    ``--config`` paths are made absolute first. Output lines are passed to ``echo`` as they arrive (in
    Jupyter, ``print`` shows them live in the cell) when ``keep(line)`` is true.

    Args:
        args: ``lightning-hybrid`` arguments, starting with the subcommand (``fit``, ...).
        nproc: processes to start (``tp * pp * dp``).
        log_dir: working folder of the run; TensorBoard logs land below it.
        timeout: seconds before the run is killed.
        env: extra environment variables (``OMP_NUM_THREADS=1`` is set unless given).
        echo: receives each kept output line; ``None`` keeps quiet.
        keep: filter of the echoed lines (all lines are still returned in ``output``).
        on_line: called with every output line and the running :class:`LocalJob` (which can kill a rank).
        check: raise when the run exits non-zero; ``False`` returns it (a run killed on purpose).

    Returns:
        ``{"returncode", "seconds", "log_dir" (the TensorBoard version folder or None), "scalars"
        (tag -> [(step, value)]), "output" (all lines), "killed" ([(rank, signal)] sent through the job)}``.

    Raises:
        RuntimeError: the run ran past ``timeout``, or failed (non-zero exit) with ``check=True``; the message
            ends with its last lines.
    """
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(_absolute_paths(list(args)), nproc)
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=log_dir, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    job = LocalJob(proc, nproc)
    lines, timed_out = _follow(job, start + timeout, echo, keep, on_line)
    seconds = time.perf_counter() - start
    if timed_out or (check and proc.returncode != 0):
        why = f"ran past timeout={timeout:g} s" if timed_out else f"exited with code {proc.returncode}"
        raise RuntimeError(f"lightning-hybrid {' '.join(args[:1])} on {nproc} processes {why}; last lines:\n"
                           + "\n".join(lines[-40:]))
    run_dir = latest_version_dir(log_dir)
    scalars = read_scalars(run_dir) if run_dir is not None else {}
    return {"returncode": proc.returncode, "seconds": seconds, "log_dir": run_dir, "scalars": scalars,
            "output": lines, "killed": job.killed}
