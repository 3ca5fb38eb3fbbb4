"""Start test processes by forking one that has already imported torch, Lightning and the package.

Every Python process the suite starts spends 6-7 s of CPU importing torch, Lightning (and, through torchmetrics, its
optional transformers and scipy) and this package before it does anything: ~28 CPU-s for a 4-process launch, about
half of what a small equivalence launch costs on a 2-core machine. :class:`ForkServer` is one process that imports
those modules once and then, per request, forks:

- ``run``: one child that becomes ``python -m lightning_hybrid.cli ARGS`` (the CLI tests);
- ``launch``: a process group, the way ``torchrun --nproc_per_node N`` starts one: a launcher child in a session of
  its own forks N ranks with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``,
  ``TORCHELASTIC_*`` with rank 0 hosting the store, as torchrun's ``--master-port`` rendezvous without an agent
  store does), each running the script (or ``-m module``) as ``__main__``. As torchrun's agent does, when one rank
  fails the others are stopped (SIGTERM, then SIGKILL after 10 s) and the launch exits 1; a timeout kills the
  session.
- ``launch_groups``: several such process groups at once, each with its own rendezvous port, environment and log, as
  several torchruns side by side (torchft's replica groups); a failed rank stops every group.

A forked child differs from a fresh interpreter only in what happened at import time, which is the same for every
child (the server runs nothing but imports). What torchrun's agent itself does (restarts, rendezvous rounds, its
exit codes and log lines, signals to a worker) is not here: the tests of those launch real torchrun
(:func:`helpers.launch.torchrun`).

Run as a script, this file is the server: one JSON request per stdin line, one JSON reply per stdout line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["ForkServer", "fork_server"]

# What the server imports before it forks: the modules every launched worker and CLI process imports anyway (not
# optional extras such as torchao or transformers, whose import registers things a run without them would not have).
# The package's root imports lazily (the planner loads no torch): its callbacks and CausalLM are named here.
PRELOAD = ("lightning_hybrid.cli", "lightning_hybrid.strategy", "lightning_hybrid.callbacks",
           "lightning_hybrid.models.causal_lm", "torch.distributed.checkpoint", "torch.distributed.pipelining",
           "torch.distributed.tensor.parallel", "torch.distributed.fsdp")
TESTS = Path(__file__).resolve().parents[1]  # on the server's path: launched scripts import helpers, user_module


class ForkServer:
    """A process with :data:`PRELOAD` imported that forks a child (``run``) or a process group (``launch``)."""

    def __init__(self, env: Optional[dict] = None) -> None:
        self.outputs = Path(tempfile.mkdtemp(prefix="fork_server_"))  # the children's stdout/stderr files
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}",
                                                **(env or {})})
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the fork server did not start: {ready!r}")

    def _request(self, request: dict, what: str) -> subprocess.CompletedProcess:
        out, err = self.outputs / "stdout", self.outputs / "stderr"
        request = {**request, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended (exit code {self.proc.wait()}) while running {what}")
        reply = json.loads(line)
        stdout, stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        if reply["timed_out"]:
            raise AssertionError(f"{what} ran past {request['timeout']} s (killed):\n{stdout[-4000:]}\n"
                                 f"{stderr[-8000:]}")
        return subprocess.CompletedProcess([what], reply["returncode"], stdout, stderr)

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
        """``python -m lightning_hybrid.cli *args`` in ``cwd`` with exactly ``env``, as a forked child."""
        request = {"nproc": 0, "args": ["-m", "lightning_hybrid.cli", *args], "cwd": str(cwd), "env": env,
                   "timeout": timeout}
        result = self._request(request, f"lightning-hybrid {' '.join(args)}")
        result.args = ["lightning-hybrid", *args]
        return result

    def launch(self, nproc: int, args: list[str], env: dict[str, str], timeout: float = 240,
               cwd: Optional[Path] = None, keep_going: bool = False) -> subprocess.CompletedProcess:
        """``torchrun --nproc_per_node nproc *args`` (a script path or ``-m module``, then its arguments) with
        ``env``, its ranks forked; stdout and stderr are all ranks' together, as torchrun's are. ``keep_going``: a
        failed rank does not stop the others; each rank's non-zero exit code is printed (tests of how each exits)."""
        request = {"nproc": nproc, "args": args, "cwd": str(cwd or os.getcwd()), "env": env, "timeout": timeout,
                   "keep_going": keep_going}
        return self._request(request, f"forked launch of {nproc} x {' '.join(args)}")

    def launch_groups(self, nproc: int, args: list[str], env: dict[str, str], groups: list[dict[str, str]],
                      logs: list[Path], timeout: float = 240,
                      cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        """One :meth:`launch` of ``nproc`` ranks per entry of ``groups`` (that group's variables over ``env``), all
        at once, each on its own rendezvous port; group ``g``'s ranks write stdout and stderr to ``logs[g]``."""
        if len(logs) != len(groups):
            raise ValueError(f"{len(logs)} logs for {len(groups)} groups")
        request = {"nproc": nproc, "args": args, "cwd": str(cwd or os.getcwd()), "env": env, "timeout": timeout,
                   "groups": [{"env": group, "log": str(log)} for group, log in zip(groups, logs)]}
        return self._request(request, f"forked launch of {len(groups)} groups of {nproc} x {' '.join(args)}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        shutil.rmtree(self.outputs, ignore_errors=True)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SERVER: Optional[ForkServer] = None


def fork_server() -> ForkServer:
    """This pytest process's server, started on first use and closed when the process exits."""
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        import atexit

        _SERVER = ForkServer()
        atexit.register(_SERVER.close)
    return _SERVER


# ---------------------------------------------------------------------------------------------- the server's side

def _redirect(stdout: str, stderr: str) -> None:
    """fd 0 from /dev/null, fds 1 and 2 to the request's files (one file opened once, appended to, when both are
    the same: a group's ranks share a log); Python's streams line-buffered on them."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if stdout == stderr:
        handle = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(handle, 1)
        os.dup2(handle, 2)
        os.close(handle)
    else:
        for fd, path in ((1, stdout), (2, stderr)):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _become(args: list[str], env: dict[str, str]) -> None:
    """In a forked child: run ``args`` (``-m module ...`` or ``script ...``) as ``__main__`` with exactly ``env``;
    exit with its code as the interpreter would (an uncaught exception goes to ``sys.excepthook``, which prints its
    traceback, and exits 1)."""
    import atexit
    import runpy

    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
            sys.path[0] = os.getcwd()  # as `python -m` does
            # preloaded as a module: run afresh as __main__ without runpy's "found in sys.modules" warning, which
            # `python -m` does not print (nothing has imported it before in a fresh interpreter)
            sys.modules.pop(args[1], None)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)  # as `python script.py` puts the script's folder first
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught exception: sys.excepthook)
        code = 1
        try:
            sys.excepthook(*sys.exc_info())  # a hook may end the process itself (os._exit) with its own code
        except SystemExit as exit_:  # or raise SystemExit, which the interpreter honours
            code = exit_.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch(request: dict) -> None:
    """In the launcher child (a session of its own): fork the ranks, wait for them as torchrun's agent does."""
    import signal
    import time

    from lightning_hybrid.launch.torchrun import free_port

    os.setsid()
    nproc = request["nproc"]
    groups = request.get("groups") or [{"env": {}, "log": None}]
    ranks = {}
    for g, group in enumerate(groups):
        port = free_port()  # each group its own store, as each torchrun its own --master-port
        for rank in range(nproc):
            env = {**request["env"], **group["env"], "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                   "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc),
                   "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                   "TORCHELASTIC_USE_AGENT_STORE": "False"}
            pid = os.fork()
            if pid == 0:
                if group["log"]:
                    _redirect(group["log"], group["log"])
                _become(request["args"], env)
            ranks[pid] = (f"group {g} " if len(groups) > 1 else "") + f"rank {rank}"
    failed = False
    while ranks:
        pid, status = os.wait()
        rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0 and request.get("keep_going"):
            print(f"[fork launcher] {rank} exited with {code}", file=sys.stderr, flush=True)
            failed = True
        elif code != 0 and not failed:
            failed = True
            print(f"[fork launcher] {rank} exited with {code}: stopping the other ranks", file=sys.stderr,
                  flush=True)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while ranks and time.monotonic() < deadline:
                done, status = os.waitpid(-1, os.WNOHANG)
                if done:
                    ranks.pop(done, None)
                else:
                    time.sleep(0.05)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    os._exit(1 if failed else 0)


def _serve() -> None:
    import importlib
    import signal
    import time

    for name in PRELOAD:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.chdir(request["cwd"])
            _redirect(request["stdout"], request["stderr"])
            if request["nproc"]:
                _launch(request)
            os.setsid()
            _become(request["args"], request["env"])
        deadline, timed_out = time.monotonic() + request["timeout"], False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                try:
                    os.killpg(pid, signal.SIGKILL)  # the child leads its session: its ranks go with it
                except ProcessLookupError:  # it had not called setsid yet
                    os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    _serve()
