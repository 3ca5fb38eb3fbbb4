"""End a launched test worker without the interpreter's finalization racing gloo's worker threads.

A gloo process group runs each collective on a C++ worker thread, which drops its finished ``Work`` (and the tensors
it holds) only after the waiting Python thread has been woken. When the worker's last act is a collective (every
worker here ends with a barrier), the interpreter may begin finalizing before that thread drops it; releasing a
tensor that Python created then takes the GIL, CPython ends the thread with ``pthread_exit`` and the forced unwind
through a ``noexcept`` destructor aborts the process: "terminate called without an active exception", SIGABRT,
after all the work was done (core dump: ``ProcessGroupGloo::runLoop`` > ``~AsyncBarrierWork`` >
``~AsyncAllgatherWork`` > ``TensorImpl::decref_pyobject`` > ``take_gil`` > ``pthread_exit``; torch's
``destroy_process_group`` does not join the default group's threads while Python still references the group). This is
pytorch/pytorch#190489 (open); about 1 launch in 50 on this 2-core machine under load.
"""

from __future__ import annotations

import os
import sys

__all__ = ["end_worker"]


def end_worker(code: int = 0) -> None:
    """Leave the process group and exit with ``code`` at once, skipping interpreter finalization (everything the
    worker writes is closed by then; stdout and stderr are flushed here)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
