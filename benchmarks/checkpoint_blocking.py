"""How long an async checkpoint blocks training, as a share of a synchronous save of the same state, in one run.

    python benchmarks/checkpoint_blocking.py                  # ~200M-parameter Qwen2, 2.4 GB of state (weights + AdamW)
    python benchmarks/checkpoint_blocking.py --hidden 512 --layers 4 --saves 2     # a quick look

One process on a one-rank gloo group trains a Qwen2 model with AdamW and saves its state through the package's own
writer (:func:`lightning_hybrid.checkpoint.dcp.write_shards`, what ``FaultTolerantCheckpoint`` calls), in each mode:

- ``sync``: ``dcp.save``; blocked = the whole save.
- ``thread, staged in the call``: ``dcp.async_save`` with DCP's default staging (the copy to host memory inside
  the call; what the package did before) and a thread writer.
- ``thread``, ``process``: the copy runs in the background (``DefaultStager(use_async_staging=True)``) while the
  next step's forward and backward run; its optimizer step waits for the copy. Blocked = the call + that wait.
- ``+ plan caching``: ``DefaultSavePlanner(enable_plan_caching=True)``.

"next step" is the wall time of the training step right after the save (the background copy and write compete with
it for the CPU), against the median step without a save. Each mode saves ``--saves`` times; the first save of the
process writer includes starting its daemon and is reported apart. The ``if __name__ == "__main__":`` guard is
required: the process writer starts its daemon with ``spawn``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

MODES = [  # name, async_save, writer, background staging, plan caching
    ("sync", False, "thread", False, False),
    ("thread, staged in the call", True, "thread", False, False),
    ("thread", True, "thread", True, False),
    ("thread + plan caching", True, "thread", True, True),
    ("process", True, "process", True, False),
    ("process + plan caching", True, "process", True, True),
]


def _train_step(model, optimizer, tokens, pending=None) -> tuple[float, float]:
    """One step; returns its seconds and the part spent waiting for a background copy before the optimizer."""
    import torch.nn.functional as F

    start = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    waited = time.perf_counter()
    if pending is not None:
        pending.staged()  # what FaultTolerantCheckpoint.on_before_optimizer_step does
    waited = time.perf_counter() - waited
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return time.perf_counter() - start, waited


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_hybrid.checkpoint.dcp import model_optimizer_state, write_shards
    from lightning_hybrid.checkpoint.staging import AsyncOptions, close_stagers
    from lightning_hybrid.launch.torchrun import free_port
    from lightning_hybrid.models import Qwen2Config
    from lightning_hybrid.models.qwen2.model import Qwen2

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    background = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4)
    model = Qwen2(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (1, args.seq + 1))
    _train_step(model, optimizer, tokens)  # AdamW states exist from here on
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
    plain = [_train_step(model, optimizer, tokens)[0] for _ in range(args.steps)]
    root = Path(args.dir)
    rows = []
    for name, async_save, writer, staging, caching in MODES:
        options = AsyncOptions(writer=writer, background_staging=staging, plan_caching=caching) if async_save \
            else False
        blocked, next_steps, totals, calls, first = [], [], [], [], None
        for i in range(args.saves + (1 if writer == "process" else 0)):
            folder = root / f"{name.replace(' ', '_').replace(',', '')}_{i}"
            folder.mkdir(parents=True)
            state = model_optimizer_state(model, [optimizer])
            start = time.perf_counter()
            pending = write_shards(folder, state, background if async_save else None, 0, 0, options)
            call = time.perf_counter() - start
            step, waited = _train_step(model, optimizer, tokens, pending)
            pending.result()
            total = time.perf_counter() - start
            del state
            entry = (call + waited, step, total, call)  # blocked: the call and the wait before the optimizer step
            if writer == "process" and i == 0:
                first = entry  # starts the daemon
            else:
                blocked.append(entry[0])
                next_steps.append(step)
                totals.append(total)
                calls.append(call)
            shutil.rmtree(folder, ignore_errors=True)
        close_stagers()  # each mode's stager holds a host copy of the whole state: one at a time
        rows.append((name, statistics.median(blocked), statistics.median(next_steps), statistics.median(totals),
                     first, statistics.median(calls)))
        print(f"measured {name}: blocked {rows[-1][1]:.3f} s, next step {rows[-1][2]:.2f} s (plain "
              f"{statistics.median(plain):.2f} s), first save {first}", flush=True)
    sync_blocked = rows[0][1]
    base_step = statistics.median(plain)
    print(f"state: {state_bytes / 1e9:.2f} GB (weights + AdamW states, {state_bytes / 12e6:.0f}M parameters), "
          f"1 process, {args.saves} saves per mode (medians); step without a save {base_step:.2f} s; "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores")
    print("| mode | blocked (s): call + wait for the copy | ratio to sync | next step (s) | next step - plain step (s) "
          "| call + next-step slowdown, ratio to sync | save to written (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, blocked, step, total, first, call in rows:
        extra = step - base_step  # the next step includes the wait for the copy: counted once, here
        cost = call + max(0.0, extra)
        print(f"| {name} | {blocked:.3f} | {100 * blocked / sync_blocked:.1f}% | {step:.2f} | {extra:+.2f} | "
              f"{100 * cost / sync_blocked:.1f}% | {total:.2f} |")
    for name, *_, first, _ in rows:
        if first is not None:
            print(f"{name}: first save (starts the daemon process): blocked {first[0]:.2f} s, next step "
                  f"{first[1]:.2f} s, written after {first[2]:.2f} s")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="plain steps measured (no save)")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode")
    parser.add_argument("--dir", default="", help="where to write (a temporary folder by default)")
    args = parser.parse_args()
    if args.dir:
        run(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = tmp
        run(args)


if __name__ == "__main__":
    main()
