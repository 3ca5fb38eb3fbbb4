"""What an operator reads when a worker of a multi-process run ends with an error: one line, not a traceback per rank.

Two failures are not bugs, and a traceback from every rank only buries the one line that matters:

- **A user's mistake found in the workers** (a bad size, a checkpoint folder of another run, a missing file: a
  ``ValueError``/``TypeError``/``FileNotFoundError`` raised by this package's own checks, or a checkpoint error),
  raised alike on every rank. Global rank 0 prints it once as one line; every rank exits with
  :data:`EXIT_USER_ERROR` (2), as the CLI does before launch.
- **A lost peer**: another rank died (SIGKILL, a crashed node) and this rank's collective failed (gloo's "Connection
  closed by peer", NCCL's and the store's ``DistError``). Each surviving rank prints one line (its rank, the step,
  what it was doing, the peer's address where the error names it) and exits with 1, so that torchrun restarts the
  job, which resumes from the newest checkpoint.

Anything else (a bug in user code or here) keeps Python's traceback. ``LIGHTNING_HYBRID_DEBUG=1`` keeps it always.

How: :func:`report_exits` (called by the strategy at setup, in every worker) installs a ``sys.excepthook`` that only
acts on an exception nothing caught (the user's script may catch ``fit``'s exceptions itself) in a process of a run
with several ranks; a single process keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional

__all__ = ["EXIT_USER_ERROR", "EXIT_PEER_LOST", "DEBUG_ENV", "is_global_rank_zero", "user_error_message",
           "peer_lost_line", "doing", "report_exits"]

EXIT_USER_ERROR = 2  # argparse's code for a bad command line; the CLI's too
EXIT_PEER_LOST = 1  # what torchrun restarts on, as it always did
DEBUG_ENV = "LIGHTNING_HYBRID_DEBUG"
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def is_global_rank_zero(environ: Optional[dict[str, str]] = None) -> bool:
    """True in global rank 0 or a launcher process: torchrun's ``RANK``, else Lightning's launcher's ``LOCAL_RANK``
    and ``NODE_RANK`` (readable before the process group exists, when every rank may still think it is rank 0)."""
    env = os.environ if environ is None else environ
    if "RANK" in env:
        return env["RANK"] == "0"
    return env.get("LOCAL_RANK", "0") == "0" and env.get("NODE_RANK", "0") == "0"


def _chain(err: Optional[BaseException]) -> list[BaseException]:
    seen: set[int] = set()
    chain: list[BaseException] = []
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _raised_in_package(err: BaseException) -> bool:
    tb, last = err.__traceback__, None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and str(Path(last).resolve()).startswith(_PACKAGE_DIR)


def user_error_message(err: BaseException) -> Optional[str]:
    """The one-line message of a user's mistake somewhere in ``err``'s chain, or ``None`` for anything else (a bug).

    A user's mistake is a ``ValueError``, ``TypeError``, ``FileNotFoundError`` or checkpoint error raised by this
    package's own checks (libraries wrap them: jsonargparse re-raises the constructor's error inside its own).
    """
    from lightning_hybrid.checkpoint.manifest import CheckpointError

    for item in _chain(err):
        if isinstance(item, CheckpointError) or (
                isinstance(item, (ValueError, TypeError, FileNotFoundError)) and _raised_in_package(item)):
            return " ".join(str(item).split())
    return None


# Where a surviving rank was when the collective failed: the innermost frame with one of these names decides.
_DOING = {
    "load": "loading a checkpoint", "load_shards": "loading a checkpoint", "_newest_valid": "checking checkpoints",
    "begin_save": "saving a checkpoint", "write_shards": "saving a checkpoint",
    "_agree": "the step's end (checkpoint callbacks)", "reduce_gradients": "the gradient all-reduce over dp",
    "average_gradients": "the gradient average over replica groups", "clip_gradients": "gradient clipping",
    "backward": "the backward pass", "_step_microbatches": "the pipeline schedule's forward and backward",
    "training_step": "the training step", "optimizer_step": "the optimizer step", "validation_step": "validation",
    "_run_sanity_check": "the sanity check", "setup": "setup", "setup_environment": "setup",
}


def doing(tb: Optional[TracebackType]) -> str:
    """What the failed call was part of, from the traceback's innermost frame that names it (a frame of this
    package's checkpoint code: saving a checkpoint; none: ``"training"``)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    for code in reversed(frames):
        if code.co_name in _DOING:
            return _DOING[code.co_name]
        if str(Path(code.co_filename).resolve()).startswith(os.path.join(_PACKAGE_DIR, "checkpoint")):
            return "saving a checkpoint"
    return "training"


_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")


def peer_lost_line(err: BaseException, rank: int, step: int) -> Optional[str]:
    """One line for a rank whose collective failed because a peer is gone, or ``None`` when ``err`` says no such
    thing (see :func:`~.elastic.peer_failure`)."""
    from lightning_hybrid.distributed.elastic import peer_failure

    cause = peer_failure(err)
    if cause is None:
        return None
    address = _ADDRESS.search(cause)
    what = (f"the connection to the peer at {address.group(1)}:{address.group(2)} closed" if address
            else re.sub(r"^\[[^\]]*\]\s*", "", cause).split(". This is")[0].rstrip("."))
    where = doing(err.__traceback__)
    return (f"rank {rank}: lost a peer in step {step + 1} ({where}): {what}; exiting with code {EXIT_PEER_LOST} so "
            f"that the launcher restarts the job (it resumes from the newest checkpoint)")


class _ExitReport:
    """The installed hook: the strategy of the latest run in this process (its rank, world and step) and the hook
    that was there before (for everything not reported here)."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous
        self._strategy: Callable[[], Any] = lambda: None  # a weak reference: the hook keeps no finished run alive

    @property
    def strategy(self) -> Any:
        return self._strategy()

    @strategy.setter
    def strategy(self, strategy: Any) -> None:
        self._strategy = weakref.ref(strategy)

    def __call__(self, kind: type, err: BaseException, tb: Optional[TracebackType]) -> None:
        line, code, printed = self.describe(err)
        if line is None:
            return self.previous(kind, err, tb)
        if printed:  # to the process's own stderr: torch's rank-prefixing hook (set at init_process_group, calling
            # this one) has swapped sys.stderr for a buffer it prints only after this returns, which it never does
            stream = sys.__stderr__ or sys.stderr
            print(line, file=stream, flush=True)
        # Out at once, past the interpreter's finalization: with a peer gone, tearing down the broken process group can
        # hang (NCCL) or abort in gloo's worker threads (pytorch/pytorch#190489), which would print and exit otherwise.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def describe(self, err: BaseException) -> tuple[Optional[str], int, bool]:
        """(the line or ``None``, the exit code, whether this rank prints it)."""
        strategy = self.strategy
        if strategy is None or os.environ.get(DEBUG_ENV) == "1" or int(getattr(strategy, "world_size", 1)) < 2:
            return None, 1, False
        try:
            step = int(strategy.lightning_module.trainer.global_step)
        except (AttributeError, RuntimeError):  # no module, or not attached to a Trainer (yet)
            step = 0
        rank = int(os.environ.get("RANK", getattr(strategy, "global_rank", 0)))
        line = peer_lost_line(err, rank, step)
        if line is not None:
            return line, EXIT_PEER_LOST, True
        message = user_error_message(err)
        if message is not None:
            return f"lightning-hybrid: error: {message}", EXIT_USER_ERROR, is_global_rank_zero()
        return None, 1, False


def report_exits(strategy: Any) -> None:
    """In this worker, end an uncaught user error or lost peer of ``strategy``'s run with one line and an exit code
    instead of a traceback (see the module docstring). Idempotent: a later run in the process takes over the hook."""
    hook = sys.excepthook
    if not isinstance(hook, _ExitReport):
        hook = _ExitReport(sys.excepthook)
        sys.excepthook = hook
    hook.strategy = strategy
