"""How a worker of a multi-process run ends (lightning_hybrid/distributed/exit_report.py): a user error is one line
from global rank 0 and exit code 2 on every rank; a lost peer is one line per surviving rank (its rank, the step, what
it was doing, the peer's address) and exit code 1; anything else keeps Python's traceback. In one process, with the
hook called as the interpreter calls it; the real launches: tests/test_lineage.py (a refusal in the workers) and
tests/test_elastic_recovery.py (a SIGKILLed rank under torchrun)."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest

from lightning_hybrid.checkpoint.lineage import ForeignCheckpointsError
from lightning_hybrid.distributed import exit_report

GLOO_PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:9099. This is typically caused by a remote worker crashing. Check the logs of the "
                  "remote worker before reporting an error. GLHF!")


class Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Strategy:
    """Rank 3 of 4 after 5 steps (the hook holds it weakly, as it holds a real strategy)."""

    world_size, global_rank = 4, 3
    lightning_module = SimpleNamespace(trainer=SimpleNamespace(global_step=5))


@pytest.fixture
def hook(monkeypatch):
    """A fresh hook over a recording "previous" hook, for rank 3 of 4 after 5 steps; returns (hook, what the
    previous hook saw, stderr, the strategy)."""
    seen: list = []
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
    monkeypatch.setattr(sys, "__stderr__", stderr)
    monkeypatch.setattr(exit_report.os, "_exit", lambda code: (_ for _ in ()).throw(Exited(code)))
    monkeypatch.delenv(exit_report.DEBUG_ENV, raising=False)
    monkeypatch.setenv("RANK", "3")
    strategy = Strategy()
    exit_report.report_exits(strategy)
    installed = sys.excepthook
    assert isinstance(installed, exit_report._ExitReport)
    exit_report.report_exits(strategy)  # idempotent: one hook
    assert sys.excepthook is installed and installed.previous is not installed
    return installed, seen, stderr, strategy


def _raised(err: BaseException) -> BaseException:
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001 - with its traceback, as the hook gets it
        return caught


def optimizer_step() -> None:  # a frame of that name: what the rank was doing
    raise RuntimeError("pipeline step failed") from RuntimeError(GLOO_PEER_GONE)


def test_a_lost_peer_is_one_line_per_surviving_rank_and_exit_code_1(hook):
    report, seen, stderr, _ = hook
    try:
        optimizer_step()
    except RuntimeError as err:
        with pytest.raises(Exited) as exited:
            report(type(err), err, err.__traceback__)
    assert exited.value.code == exit_report.EXIT_PEER_LOST == 1 and seen == []
    assert stderr.getvalue() == ("rank 3: lost a peer in step 6 (the optimizer step): the connection to the peer at "
                                 "127.0.0.1:9099 closed; exiting with code 1 so that the launcher restarts the job "
                                 "(it resumes from the newest checkpoint)\n")


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_a_user_error_is_printed_once_by_global_rank_zero_and_every_rank_exits_with_2(hook, monkeypatch, rank,
                                                                                       printed):
    report, seen, stderr, _ = hook
    monkeypatch.setenv("RANK", rank)
    err = _raised(ForeignCheckpointsError("checkpoint folder ckpt holds checkpoints of another run (run abc)"))
    with pytest.raises(Exited) as exited:
        report(type(err), err, err.__traceback__)
    assert exited.value.code == exit_report.EXIT_USER_ERROR == 2 and seen == []
    expected = "lightning-hybrid: error: checkpoint folder ckpt holds checkpoints of another run (run abc)\n"
    assert stderr.getvalue() == (expected if printed else "")


def test_a_bug_a_single_process_and_the_debug_switch_keep_the_traceback(hook, monkeypatch):
    report, seen, stderr, strategy = hook
    bug = _raised(KeyError("typo"))  # a bug in user code
    foreign = _raised(ValueError("raised outside the package: a user's own ValueError is a bug too"))
    for err in (bug, foreign):
        report(type(err), err, err.__traceback__)
    assert seen == [bug, foreign]
    gone = _raised(RuntimeError(GLOO_PEER_GONE))
    strategy.world_size = 1  # one process: its one traceback buries nothing
    report(type(gone), gone, gone.__traceback__)
    strategy.world_size = 4
    monkeypatch.setenv(exit_report.DEBUG_ENV, "1")
    report(type(gone), gone, gone.__traceback__)
    assert seen == [bug, foreign, gone, gone] and stderr.getvalue() == ""


def test_what_the_rank_was_doing_comes_from_the_innermost_named_frame():
    def training_step():
        def backward():
            raise RuntimeError("x")
        backward()

    def begin_save():
        raise RuntimeError("x")

    found = []
    for call in (training_step, begin_save, lambda: 1 / 0):
        try:
            call()
        except (RuntimeError, ZeroDivisionError) as err:
            found.append(exit_report.doing(err.__traceback__))
    assert found == ["the backward pass", "saving a checkpoint", "training"]


def test_a_collective_error_without_an_address_keeps_its_first_line(hook):
    import torch.distributed as dist

    err = dist.DistBackendError("NCCL communicator was aborted on rank 5.\nmore details")
    line = exit_report.peer_lost_line(_raised(err), 2, 0)
    assert line.startswith("rank 2: lost a peer in step 1 (training): NCCL communicator was aborted on rank 5; ")


def test_the_hook_keeps_no_finished_run_alive(hook):
    import gc

    report, seen, stderr, _ = hook
    report.strategy = Strategy()  # the only reference is the hook's (weak): gone with the run
    gc.collect()
    assert report.strategy is None
    gone = _raised(RuntimeError(GLOO_PEER_GONE))
    report(type(gone), gone, gone.__traceback__)
    assert seen == [gone] and stderr.getvalue() == ""
