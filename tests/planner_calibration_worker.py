"""torchrun worker: shard small Qwen2 models exactly as the strategy does and record what each rank allocates.

For every layout in the JSON spec (argv[1]) it builds the mesh, splits the meta-device model into this
rank's pipeline stages (``plan_stages``, ``stage_ids_for_rank``, ``build_stages``), applies tensor
parallelism and FSDP2 per stage module (the strategy's ``_shard_stage`` order), materializes, runs one
forward/backward and one AdamW step, and writes the local bytes of parameters, gradients and optimizer
states with the rank's mesh coordinates to ``argv[2]/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from helpers.worker_exit import end_worker
from lightning_hybrid.distributed.data_parallel import apply_fsdp
from lightning_hybrid.distributed.mesh import build_mesh
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.pipeline.schedules import stage_ids_for_rank
from lightning_hybrid.distributed.pipeline.split import build_stages, plan_stages
from lightning_hybrid.distributed.tensor_parallel import apply_tensor_parallel
from lightning_hybrid.models import Qwen2, Qwen2Config


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def allocate(layout: dict) -> dict:
    config = Qwen2Config(**layout["config"])
    tp, pp, dp, v = layout["tp"], layout["pp"], layout["dp"], layout.get("virtual_stages", 1)
    schedule = layout.get("schedule", "1f1b" if v == 1 else "interleaved_1f1b")
    dims = ParallelDims.resolve(tp, pp, dp, dist.get_world_size())
    mesh = build_mesh(dims, "cpu")
    coords = dims.coordinates(dist.get_rank())
    with torch.device("meta"):
        model = Qwen2(config)
    spec = model.parallel_spec()
    plans = plan_stages(spec, config.num_hidden_layers, pp * v)
    container, modules = build_stages(model, spec, plans, stage_ids_for_rank(coords["pp"], pp, v, schedule))
    for module in modules:
        if tp > 1:
            apply_tensor_parallel(module, spec, mesh["tp"])
        if dp > 1 and layout["data_parallel"] == "fsdp":
            apply_fsdp(module, module.layers, mesh["dp"])
        module.to_empty(device="cpu")
        with torch.no_grad():
            for p in module.parameters():
                _local(p).normal_(0, 0.02)
    params = list({id(p): p for p in container.parameters()}.values())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for module in modules:
        x = (torch.randint(0, config.vocab_size, (2, 8)) if module.embed_tokens is not None
             else torch.randn(2, 8, config.hidden_size))
        module(x).float().pow(2).mean().backward()
    optimizer.step()
    states = [t for p in params for t in optimizer.state[p].values() if isinstance(t, torch.Tensor)]
    return {"name": layout["name"], "coords": coords, "param_numel": sum(_local(p).numel() for p in params),
            "param_tensors": len(params),
            "param_bytes": sum(_local(p).numel() * p.element_size() for p in params),
            "grad_bytes": sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer_bytes": sum(_local(t).numel() * t.element_size() for t in states)}


def main() -> None:
    dist.init_process_group("gloo")
    layouts = json.loads(Path(sys.argv[1]).read_text())
    records = [allocate(layout) for layout in layouts]
    Path(sys.argv[2], f"rank{dist.get_rank()}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
