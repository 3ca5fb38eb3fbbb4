"""What TrainingHealth costs per step with every check on, and how long an in-process rollback takes.

    python benchmarks/health.py                         # 4 CPU processes, tp=2 x dp=2 (replicate), ~30M parameters
    python benchmarks/health.py --hidden 512 --layers 4 --steps 16

Runs, in one launch and alternating (so that a busy machine slows all alike): training without the callback;
with ``TrainingHealth(recheck=True)`` (NaN/Inf and spike checks, the flags' all-reduce, the grad norm, the batch and
RNG kept for a re-run); and with ``consistency_every_n_steps=1`` on top (the replicas' checksums all-gathered every
step: the worst case). Per step: the median wall time between step ends (the first steps left out), the ratio to
no callback, the callback's own hook time (including the time its collectives wait for slower ranks, which the
step would otherwise spend waiting in the next collective), and the consistency check alone per call, with its
share at ``consistency_every_n_steps=100``. Then the tiny model (tp=2 x pp=2) with FaultTolerantCheckpoint every 2 steps
and a loss spike injected at step 5: the time of the in-process rollback (reload, counters, manifests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "checks", "consistency")


def _timed_callback(health, seconds: list) -> None:
    for name in ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"):
        hook = getattr(health, name)

        def wrapper(*args, _hook=hook, **kwargs):
            start = time.perf_counter()
            _hook(*args, **kwargs)
            seconds.append(time.perf_counter() - start)

        setattr(health, name, wrapper)


def _fit(args: argparse.Namespace, mode: str) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.callbacks import TrainingHealth
    from lightning_hybrid.models import CausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=8000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         name="health-bench")
    tokens = torch.randint(0, 8000, (4 * args.steps * 4, 129), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    ends: list[float] = []

    class StepEnds(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())

    callbacks: list = [StepEnds()]
    hook_seconds: list[float] = []
    health = None
    if mode != "none":
        health = TrainingHealth(recheck=True, consistency_every_n_steps=1 if mode == "consistency" else None)
        _timed_callback(health, hook_seconds)
        consistency: list[float] = []
        check = health.check_consistency

        def timed_check(*a, **k):
            start = time.perf_counter()
            found = check(*a, **k)
            consistency.append(time.perf_counter() - start)
            return found

        health.check_consistency = timed_check
        callbacks.append(health)
    L.seed_everything(0)
    trainer = L.Trainer(strategy=HybridParallelStrategy(tp=2, data_parallel="replicate"), accelerator="cpu",
                        devices=args.processes, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(CausalLM(config, lr=1e-4), train_dataloaders=data)
    skip = args.warmup
    steps = [b - a for a, b in zip(ends[skip:], ends[skip + 1:])]
    result = {"steps": steps, "parameters": config.num_parameters()}
    if health is not None:
        per_step = len(hook_seconds) / max(1, len(ends))
        hooks = hook_seconds[int(skip * per_step):]
        result.update(hook_per_step=sum(hooks) / max(1, len(ends) - skip), consistency=consistency[skip:],
                      events=len(health.events))
    return result


def _rollback(args: argparse.Namespace) -> list[float]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import FaultTolerantCheckpoint, HybridParallelStrategy
    from lightning_hybrid.callbacks import TrainingHealth
    from lightning_hybrid.models import CausalLM, Qwen2Config

    class Spike(L.Callback):
        def __init__(self) -> None:
            self.active = self.fired = False

        def on_train_start(self, trainer, pl_module):
            for name, module in pl_module.model.named_modules():
                if name.endswith("lm_head"):
                    module.register_forward_hook(lambda _m, _i, out: out * 100.0 if self.active else out)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.active = trainer.global_step == 5 and not self.fired
            self.fired = self.fired or self.active

    health = TrainingHealth(window=3)
    L.seed_everything(0)
    tokens = torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(strategy=HybridParallelStrategy(tp=2, pp=2), accelerator="cpu", devices=4, max_steps=8,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[
                            Spike(), FaultTolerantCheckpoint(Path(args.dir) / "rollback", every_n_steps=2,
                                                             async_save=False), health])
    trainer.fit(CausalLM(Qwen2Config.from_preset("tiny"), lr=1e-2), train_dataloaders=data)
    return health.rollback_seconds


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    results: dict = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            results[mode].append(_fit(args, mode))
    results["rollback"] = _rollback(args)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes), __file__,
               "--worker", "--dir", tmp, "--out", str(out), *(f"--{k}={getattr(args, k)}" for k in (
                   "processes", "hidden", "layers", "steps", "warmup", "repeats"))]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"benchmark workers failed:\n{done.stderr[-4000:]}")
        r = json.loads(out.read_text())
    base = statistics.median(s for run in r["none"] for s in run["steps"])
    print(f"model: {r['none'][0]['parameters'] / 1e6:.1f}M parameters, {args.processes} processes, tp=2 x dp=2 "
          f"(replicate), {args.steps} steps x {args.repeats} runs per mode, first {args.warmup} steps left out")
    print("| mode | median step (s) | ratio vs no callback | callback hooks per step (s) | hooks / step |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| no callback | {base:.4f} | 1.000 | - | - |")
    names = {"checks": "TrainingHealth(recheck=True): NaN/Inf, spike, grad norm (one all-reduce)",
             "consistency": "the same + consistency_every_n_steps=1"}
    for mode, name in names.items():
        steps = statistics.median(s for run in r[mode] for s in run["steps"])
        hook = statistics.median(run["hook_per_step"] for run in r[mode])
        print(f"| {name} | {steps:.4f} | {steps / base:.3f} | {hook:.4f} | {100 * hook / base:.2f}% |")
    check = statistics.median(c for run in r["consistency"] for c in run["consistency"])
    print(f"consistency check alone (checksums + one all-gather): {1000 * check:.2f} ms per call, "
          f"{100 * check / base:.2f}% of a step; at consistency_every_n_steps=100: {check / base / 100:.4%} per step")
    rollback = r["rollback"]
    print(f"in-process rollback of the tiny model (tp=2 x pp=2, 4 processes): "
          f"{', '.join(f'{s:.3f}' for s in rollback) or 'none happened'} s")


if __name__ == "__main__":
    main()
