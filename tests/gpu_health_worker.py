"""Training under GPUHealthMonitor with injected device records, for tests/test_gpu_health.py (4 processes, tp=2 pp=2).

argv: a JSON file with a list of configurations, and the output folder. Each configuration is one fit, in order, on
the same processes. Rank r plays host ``node-{r // 2}`` and drives GPU r (tests/helpers/gpu_records.py).

- ``monitor``: the GPUHealthMonitor's keyword arguments, or absent for a run without it; ``inject``: whether each
  rank reads injected records (otherwise the real reader: inactive on CPU);
- ``faults``: ``[rank, from_step, changes]``: from that optimizer step on, the rank's record has these changes
  (a top-level key replaced; ``"links_down": [5]`` takes NVLink 5 down; ``"corrected": n`` sets the corrected ECC
  count);
- ``xids``: ``[rank, step, xid]``: the injected XID source of that rank delivers the XID at the start of that step
  (between polls), through the monitor's background thread;
- ``checkpoint``: a FaultTolerantCheckpoint in ``<out>/<name>-ckpt`` saving only when stopped;
- ``exit``: the last configuration; a GPUFault ends the process with its exit code.

Each rank writes ``<name>-rank<r>.json``: its global step, the monitor's findings, metrics, poll seconds, inactive
reason, the seconds of each call of its per-step hook and of each training step, and the exit code and message of a
stop.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from pathlib import Path

import lightning as L

from helpers.equivalence import GLOBAL_BATCH, SEED, make_dataset, make_trainer_kwargs, tiny_config
from helpers.gpu_records import gpu_of_rank, links_down
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.callbacks import FaultTolerantCheckpoint, GPUFault, GPUHealthMonitor, gpu_health
from lightning_hybrid.models import CausalLM

RANK = int(os.environ["RANK"])
gpu_health._hostname = lambda: f"node-{RANK // 2}"  # two ranks per "host": the exclusion must name only one


class StepTimes(L.Callback):
    """Seconds from the end of one training batch to the end of the next (the step as the loop sees it)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
        self._last = now


class Clock(L.Callback):
    """The optimizer steps done so far (what an injected record depends on), and the XIDs to deliver."""

    def __init__(self, xids: list) -> None:
        self.trainer = None
        self.xids = [(step, xid) for rank, step, xid in xids if rank == RANK]
        self.queue: queue.Queue = queue.Queue()

    def on_train_start(self, trainer, pl_module) -> None:
        self.trainer = trainer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for step, xid in self.xids:
            if trainer.global_step == step:
                self.queue.put(xid)

    def step(self) -> int:
        return self.trainer.global_step if self.trainer is not None else 0

    def wait_xid(self, timeout: float):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None


def source(clock: Clock, faults: list):
    """This rank's record now: its healthy GPU with the faults that began at or before the current step."""

    def read() -> dict:
        changes: dict = {}
        for rank, from_step, change in faults:
            if rank == RANK and clock.step() >= from_step:
                changes.update(change)
        record = gpu_of_rank(RANK)
        if "links_down" in changes:
            record["nvlink"] = links_down(*changes.pop("links_down"))
        if "corrected" in changes:
            record["ecc"]["volatile_corrected"] = changes.pop("corrected")
        record.update(changes)
        return record

    return read


def timed(monitor: GPUHealthMonitor) -> list[float]:
    """Seconds of each call of the monitor's per-step hook (polls and the steps between them)."""
    seconds: list[float] = []
    hook = monitor.on_train_batch_end

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            hook(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    monitor.on_train_batch_end = wrapper
    return seconds


def run(config: dict, out: Path) -> int:
    L.seed_everything(SEED)
    world = int(os.environ["WORLD_SIZE"])
    clock, times = Clock(config.get("xids", [])), StepTimes()
    callbacks = [clock, times]
    monitor = None
    if "monitor" in config:
        kwargs = dict(config["monitor"])
        if config.get("inject", True):
            kwargs.update(source=source(clock, config.get("faults", [])), xid_source=clock.wait_xid)
        monitor = GPUHealthMonitor(**kwargs)
        hook_seconds = timed(monitor)
        callbacks.append(monitor)
    if config.get("checkpoint"):
        callbacks.append(FaultTolerantCheckpoint(out / f"{config['name']}-ckpt", every_n_steps=None,
                                                 async_save=False, save_on_signal=True))
    trainer_kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": config["steps"], "val_check_interval": None,
                      "limit_val_batches": 0}
    trainer = L.Trainer(strategy=HybridParallelStrategy(tp=2, pp=2), devices=world, callbacks=callbacks,
                        **trainer_kwargs)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    train, _ = make_dataset(GLOBAL_BATCH)
    exit_code, message = 0, None
    try:
        trainer.fit(module, train_dataloaders=train)
    except GPUFault as fault:  # a SystemExit: what would end the process if nothing caught it
        exit_code, message = fault.code, str(fault)
    record = {"global_step": trainer.global_step, "step_seconds": times.seconds, "exit_code": exit_code,
              "message": message}
    if monitor is not None:
        record.update(hook_seconds=hook_seconds, findings=monitor.findings, metrics=monitor.last_metrics,
                      poll_seconds=monitor.poll_seconds,
                      inactive_reason=monitor.inactive_reason, active=monitor.active)
    (out / f"{config['name']}-rank{RANK}.json").write_text(json.dumps(record))
    return exit_code


def main() -> None:
    configs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    code = 0
    for config in configs:
        print(f"=== configuration {config['name']}", flush=True)
        code = run(config, out)
        if code and not config.get("exit"):
            raise SystemExit(f"configuration {config['name']} stopped with code {code} but is not the last one")
    end_worker(code)  # see helpers.worker_exit; the stop configuration's exit code (76) is the process's


if __name__ == "__main__":
    main()
