"""Predicted time of one ``DownstreamEval`` run of a recipe, from the planner's forward-pass time (predicted, not
measured: no GPU has run it).

    python benchmarks/eval_time.py recipes/qwen2.5-72b-pretrain.yaml                  # the recipe's commented block
    python benchmarks/eval_time.py RECIPE.yaml --batch-size 1024 --task piqa:1000:2:64 --task arc_easy:1000:4:64

A task is ``name:documents:requests per document:tokens per request`` (padded to a multiple of 32, as the scorer
pads; the defaults are the recipe block's four tasks at ``limit: 1000`` with typical Qwen2.5 token counts: hellaswag
~120 tokens per context + ending, ARC ~40-50 per question + answer, PIQA ~55; assumptions, not measurements).

The planner predicts a training step of the recipe's layout term by term (``lightning_hybrid.planner.search``). One
forward-only batch of an evaluation (``batch_size`` rows over the pipeline's micro-batches, every row of the task's
length) is that step's forward share at the evaluation's shape:

* compute / 3: a GEMM's forward is 2 of the 6 FLOPs per weight and token the planner counts, attention likewise, and
  the elementwise forward 1 of the 3 byte passes (``ELEMENTWISE_BACKWARD`` = 2);
* the forward's TP collectives: 2 of the 4 per block with sequence parallelism, 2 of 7 without;
* a third of the pipeline bubble ((pp - 1) forward micro-batch times), and half the exposed FSDP traffic (the
  gather, not the reduce-scatter); no recompute, no optimizer.

A run is each replica's share of the batches (the requests are dealt over dp) times that, summed over the tasks; the
harness's own work (building requests, metrics) is not in it.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hybrid.planner.recipe_plan import plan_recipe  # noqa: E402
from lightning_hybrid.planner.search import estimate  # noqa: E402

DEFAULT_TASKS = ["hellaswag:1000:4:128", "arc_easy:1000:4:64", "arc_challenge:1000:4:64", "piqa:1000:2:64"]


def forward_seconds(plan, rows: int, tokens: int) -> tuple[float, object]:
    """Predicted seconds of one forward-only batch of ``rows`` rows of ``tokens`` tokens per replica."""
    problem, layout = plan.problem, plan.recipe.layout
    m = layout.microbatches if layout.pp > 1 else 1
    per_microbatch = max(1, rows // m)
    shaped = replace(layout, micro_batch_size=per_microbatch, microbatches=m)
    e = estimate(replace(problem, seq_len=tokens, global_batch=per_microbatch * m * layout.dp), shaped)
    tp_forward = 0.5 if layout.sequence_parallel else 2 / 7
    t = e.time
    return (t["compute"] / 3 + t["tp_comm"] * tp_forward + t["pp_bubble"] / 3 + t["dp_comm"] / 2
            + t.get("cp_comm", 0.0) / 2), e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--batch-size", type=int, default=1024, help="DownstreamEval(batch_size=...) rows per forward")
    parser.add_argument("--task", action="append", help="name:documents:requests_per_document:tokens (repeatable)")
    parser.add_argument("--gpu", help="GPU type (default: the recipe header's --gpu)")
    args = parser.parse_args(argv)
    plan = plan_recipe(args.recipe, args.gpu)
    layout = plan.recipe.layout
    print(f"recipe layout: {layout.describe()} on {plan.problem.hw.gpus} x {plan.problem.hw.gpu.name}; training step "
          f"predicted {plan.recipe.time['step']:.2f} s")
    total = 0.0
    for spec in args.task or DEFAULT_TASKS:
        name, docs, per_doc, tokens = spec.split(":")
        requests = int(docs) * int(per_doc)
        batches = math.ceil(requests / args.batch_size / layout.dp)  # per replica
        seconds, e = forward_seconds(plan, args.batch_size, int(tokens))
        total += batches * seconds
        print(f"  {name}: {requests} requests of {tokens} tokens, {batches} batches of {args.batch_size} rows per "
              f"replica x {seconds:.2f} s predicted per forward batch = {batches * seconds:.1f} s")
    print(f"predicted time per DownstreamEval run: {total:.0f} s ({total / 60:.1f} min), the harness's own work "
          f"not included")
    return 0


if __name__ == "__main__":
    sys.exit(main())
