"""Step time of ``HybridParallelStrategy`` against a hand-written loop and Lightning's ``ModelParallelStrategy``.

The same Qwen2-shaped model, mesh, batch and optimizer are trained three ways, one after the other inside
one process group (``torchrun`` per process count):

* **hand-written**: no Lightning. The loop builds the model on the meta device, applies tensor parallelism
  with ``parallelize_module`` (the model's own TP plan), FSDP2 ``fully_shard`` per block, cuts pipeline
  stages by hand and runs ``torch.distributed.pipelining``'s ``Schedule1F1B``; a ``DataLoader`` with a
  ``DistributedSampler``, token-mean loss over the global batch, ``AdamW``.
* **HybridParallelStrategy**: ``CausalLM`` in a ``Trainer`` (logger, checkpointing and progress bar off).
* **ModelParallelStrategy**: Lightning's own strategy with a LightningModule that parallelizes itself in
  ``configure_model`` the same way (TP x DP meshes only: it has no pipeline).

The step time is the interval between the ends of consecutive optimizer steps on rank 0, so data loading
and all per-step framework work count; the median is taken over ``--steps`` steps after ``--warmup``,
over ``--rounds`` rounds that alternate the order of the three (the machine is noisy; ratios within one
run are what to read). Target: HybridParallelStrategy / hand-written <= 1.05.

    python benchmarks/overhead.py                      # 1, 2 and 4 CPU processes (gloo)
    python benchmarks/overhead.py --procs 2 --steps 20

It prints a Markdown table. This is a measurement script, not a test.
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

import torch

MESHES = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 1, 2), (1, 2, 1)], 4: [(2, 1, 2), (2, 2, 1)]}  # (tp, pp, dp)
SEQ_LEN, GLOBAL_BATCH, LR = 128, 8, 1e-4


def model_config():
    from lightning_hybrid.models import Qwen2Config

    values = dict(Qwen2Config.from_preset("tiny").to_dict())
    values.update(name="overhead", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)
    return Qwen2Config(**values)


def dataset(num_steps: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (num_steps * GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# ---------------------------------------------------------------- the hand-written loop


def hand_tensor_parallel(model, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    spec = model.parallel_spec()
    outer = {}
    if model.embed_tokens is not None:
        outer["embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if model.lm_head is not None:
        outer["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    if outer:
        parallelize_module(model, tp_mesh, outer)
    from lightning_hybrid.distributed.tensor_parallel import FusedColwiseParallel

    plan = {name: ColwiseParallel() if style == "colwise" else RowwiseParallel()
            for name, style in spec.block_plan.items()}
    # q/k/v and gate/up run as one GEMM of this rank's shards (the model's fused modules)
    plan.update({name: FusedColwiseParallel() for name in spec.fused_projections})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


def hand_fsdp(model, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def init_weights(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)


def hand_written(tp: int, pp: int, dp: int, steps: int) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lightning_hybrid.models import Qwen2

    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    with torch.device("meta"):
        model = Qwen2(model_config())
    if pp > 1:
        per_stage = len(model.layers) // pp
        for index in list(model.layers):
            if int(index) // per_stage != pp_rank:
                del model.layers[index]
        if pp_rank > 0:
            model.embed_tokens = None
        if pp_rank < pp - 1:
            model.norm, model.lm_head = None, None
    if tp > 1:
        hand_tensor_parallel(model, mesh["tp"])
    if dp > 1:
        hand_fsdp(model, mesh["dp"])
    model.to_empty(device="cpu")
    init_weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = dataset(steps)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // dp, sampler=sampler)
    denominator = [1.0]

    def loss_fn(logits, labels):
        loss, _ = Qwen2.loss_sum(logits, labels)
        return loss / denominator[0]

    schedule = None
    if pp > 1:
        stage = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=2 * pp, loss_fn=loss_fn, scale_grads=False)
    ends = []
    for inputs, labels in loader:
        count = torch.tensor(float(labels.numel()))
        if dp > 1:
            dist.all_reduce(count, group=mesh["dp"].get_group())
        denominator[0] = float(count)
        if schedule is None:
            loss_fn(model(inputs), labels).backward()
        elif pp_rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=labels)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])]


# ---------------------------------------------------------------- the two Lightning strategies


def _interval_callback(intervals: list[float]):
    import lightning as L

    class Intervals(L.Callback):
        def __init__(self):
            self.last = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self.last is not None:
                intervals.append(now - self.last)
            self.last = now

    return Intervals()


def _trainer(strategy, steps: int, intervals: list[float]):
    import lightning as L

    return L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                     callbacks=[_interval_callback(intervals)])


def hybrid(tp: int, pp: int, dp: int, steps: int) -> list[float]:
    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.models import CausalLM

    intervals: list[float] = []
    module = CausalLM(model_config(), lr=LR, weight_decay=0.1, lr_schedule="constant")
    strategy = HybridParallelStrategy(tp=tp, pp=pp, dp=dp, pp_schedule="1f1b")
    loader = torch.utils.data.DataLoader(dataset(steps), batch_size=GLOBAL_BATCH // dp, shuffle=True)
    _trainer(strategy, steps, intervals).fit(module, train_dataloaders=loader)
    return intervals


def model_parallel(tp: int, pp: int, dp: int, steps: int) -> list[float]:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_hybrid.models import Qwen2

    class SelfParallelizing(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None

        def configure_model(self):
            if self.model is not None:
                return
            with torch.device("meta"):
                model = Qwen2(model_config())
            if tp > 1:
                hand_tensor_parallel(model, self.device_mesh["tensor_parallel"])
            if dp > 1:
                hand_fsdp(model, self.device_mesh["data_parallel"])
            self.model = model

        def on_fit_start(self):
            init_weights(self.model)

        def training_step(self, batch, batch_idx):
            inputs, labels = batch
            loss, count = Qwen2.loss_sum(self.model(inputs), labels)
            return loss / count

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.1)

    intervals: list[float] = []
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    loader = torch.utils.data.DataLoader(dataset(steps), batch_size=GLOBAL_BATCH // dp, shuffle=True)
    _trainer(strategy, steps, intervals).fit(SelfParallelizing(), train_dataloaders=loader)
    return intervals


RUNNERS = {"hand": hand_written, "hybrid": hybrid, "model_parallel": model_parallel}


def worker(out: Path, steps: int, warmup: int, rounds: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = []
    for tp, pp, dp in MESHES[world]:
        names = [n for n in RUNNERS if not (n == "model_parallel" and pp > 1)]
        samples: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                dist.barrier()
                samples[name] += RUNNERS[name](tp, pp, dp, warmup + steps + 1)[warmup:]
        results.append({"procs": world, "tp": tp, "pp": pp, "dp": dp,
                        **{n: statistics.median(v) for n, v in samples.items()},
                        "samples": {n: len(v) for n, v in samples.items()}})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    lines = ["| procs | mesh (tp x pp x dp) | steps | hand-written ms | HybridParallelStrategy ms | ratio | "
             "ModelParallelStrategy ms | ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mp = (f"{r['model_parallel'] * 1e3:.1f} | {r['model_parallel'] / r['hand']:.3f}"
              if "model_parallel" in r else "n/a (no pipeline) | -")
        lines.append(f"| {r['procs']} | {r['tp']} x {r['pp']} x {r['dp']} | {r['samples']['hand']} | "
                     f"{r['hand'] * 1e3:.1f} | {r['hybrid'] * 1e3:.1f} | {r['hybrid'] / r['hand']:.3f} | {mp} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], choices=sorted(MESHES))
    parser.add_argument("--steps", type=int, default=12, help="measured steps per round and implementation (>= 10)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.rounds)
    rows = []
    for procs in args.procs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
                   "--master_addr", "127.0.0.1", "--master_port", str(29400 + procs), __file__,
                   "--worker", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--rounds", str(args.rounds)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows += json.loads(out.read_text())
    print(f"\nQwen2-shaped model {model_config().num_parameters() / 1e6:.1f}M parameters, sequence {SEQ_LEN}, "
          f"global batch {GLOBAL_BATCH}, AdamW, CPU gloo, torch {torch.__version__}; median step time\n")
    print(table(rows))


if __name__ == "__main__":
    main()
