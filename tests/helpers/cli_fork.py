"""Run ``lightning-hybrid`` command lines the way a user does, without paying the imports for each one.

A CLI process spends about 5 s of its 5-6 s importing torch, Lightning and their optional dependencies before it
prints a one-line user error. :class:`CliForkServer` starts one Python process that imports
:mod:`lightning_hybrid.cli` once and then, for each command line, forks a child: a fresh process with the modules
already loaded, its own working directory, environment, ``sys.argv`` and stdout/stderr files, which runs the module's
``__main__`` entry (``sys.exit(main())``; an uncaught exception prints its traceback and exits 1, as ``python -m``
does). What a case sees differs from ``python -m lightning_hybrid.cli`` only in what happens at import time, which
the tests that need it check in real subprocesses.

    with CliForkServer() as cli:
        result = cli.run(["fit", "--config", "x.yaml"], cwd=tmp_path, env={...})   # a CompletedProcess

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

__all__ = ["CliForkServer"]


class CliForkServer:
    """A process with :mod:`lightning_hybrid.cli` imported that forks one child per command line."""

    def __init__(self, env: Optional[dict] = None) -> None:
        self.outputs = Path(tempfile.mkdtemp(prefix="cli_fork_"))  # the children's stdout/stderr files
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the CLI fork server did not start: {ready!r}")

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
        """``python -m lightning_hybrid.cli *args`` in ``cwd`` with exactly ``env``, as a forked child."""
        out, err = self.outputs / "stdout", self.outputs / "stderr"
        request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        stdout, stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        if reply["timed_out"]:
            raise AssertionError(f"lightning-hybrid {' '.join(args)} ran past {timeout} s (killed):\n{stderr[-4000:]}")
        return subprocess.CompletedProcess(["lightning-hybrid", *args], reply["returncode"], stdout, stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        shutil.rmtree(self.outputs, ignore_errors=True)

    def __enter__(self) -> CliForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(request: dict) -> None:
    """In the forked child: become the CLI process the request describes, run it, exit with its code."""
    import traceback

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [sys.modules["lightning_hybrid.cli"].__file__, *request["args"]]
    code = 0
    try:
        code = sys.modules["lightning_hybrid.cli"].main()
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught exception)
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve() -> None:
    import signal
    import time

    import lightning_hybrid.cli  # noqa: F401  (the imports every child inherits)

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        deadline, timed_out = time.monotonic() + request["timeout"], False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    _serve()
