"""``dist_worker.py`` for float8 configurations: the tiny model with an MLP width whose TP shards fit float8 (192/2 =
96, a multiple of 16), a record of which linears were converted, and a ``per_shard_scales`` switch that makes
torchao compute each amax on this rank's shard only (the negative control of the equivalence test).

Launched by ``tests/test_float8.py`` with ``LIGHTNING_HYBRID_FLOAT8_EMULATE=1`` (torchao's emulated GEMM: the same
float8 casts and scales, without CPU ``_scaled_mm``'s reference kernel, which would take minutes per step).
"""

from __future__ import annotations

import json
import sys
from typing import Optional
from contextlib import contextmanager
from pathlib import Path

import dist_worker
import torch.distributed as dist

from helpers.equivalence import make_trainer_kwargs, tiny_config
from helpers.gather import full_weights
from helpers.worker_exit import end_worker
from lightning_hybrid.models import CausalLM

FLOAT8_TINY = {"intermediate_size": 192}


FLOAT8_LR = 1e-3  # bf16 rounding (4e-3) grows fast under lr 1e-2; this keeps 10 steps comparable at 1e-3


def float8_module(kind: str, hf: Optional[str] = None) -> CausalLM:
    """dist_worker's ``_module`` for every configuration (``hf`` unused: no float8 case loads a Hugging Face model)."""
    assert hf is None, hf
    return CausalLM(tiny_config(**FLOAT8_TINY), **{**make_trainer_kwargs()["module"], "lr": FLOAT8_LR})


@contextmanager
def per_shard_scales(enabled: bool):
    """With ``enabled``: every amax is the max over this rank's shard (a sharded DTensor's amax is left unreduced),
    i.e. float8 scales per shard instead of per full tensor."""
    if not enabled:
        yield
        return
    import torchao.float8.float8_utils as utils
    from torch.distributed.tensor import DTensor, Replicate

    original = utils.tensor_to_amax

    def local_amax(x, reduce_amax=False, device_mesh=None, scaling_granularity=utils.ScalingGranularity.TENSORWISE,
                   axiswise_dim=None):
        if not isinstance(x, DTensor):
            return original(x, reduce_amax, device_mesh, scaling_granularity, axiswise_dim)
        amax = original(x.to_local(), False, None, scaling_granularity, axiswise_dim)
        tensorwise = scaling_granularity is utils.ScalingGranularity.TENSORWISE
        reduced = None if tensorwise else axiswise_dim % x.ndim
        placements = [Replicate() if p.is_shard() and (tensorwise or p.dim % x.ndim == reduced) else p
                      for p in x.placements]
        return DTensor.from_local(amax, x.device_mesh, placements, run_check=False)

    utils.tensor_to_amax = local_amax
    try:
        yield
    finally:
        utils.tensor_to_amax = original


def layer_scales_error(out: Path, name: str) -> None:
    """One tensorwise float8 linear, colwise-sharded over all ranks, against the same layer on one rank: with scales
    on the full weight both quantize the same float8 weight (the outputs agree to bf16 rounding); with per-shard
    scales they do not. Rank 0 saves ``{"error": max |difference| / max |output|}``."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if not dist.is_initialized():  # when it runs before any training configuration
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    world = dist.get_world_size()
    single = torch.nn.Sequential(torch.nn.Linear(64, 16 * world, bias=False)).to(torch.bfloat16)
    with torch.no_grad():  # rows of very different size, so each shard's amax differs from the full weight's
        single[0].weight.mul_(torch.logspace(0, 2, 16 * world, dtype=torch.bfloat16)[:, None])
    sharded = copy.deepcopy(single)
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(single, config=config)
    convert_to_float8_training(sharded, config=config)
    parallelize_module(sharded[0], init_device_mesh("cpu", (world,)), ColwiseParallel())
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    expected, local = single(x).float(), sharded(x).float()
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous())
    error = float((torch.cat(pieces, dim=-1) - expected).abs().max() / expected.abs().max())
    if dist.get_rank() == 0:
        torch.save({"error": error}, out / f"{name}.pt")
    dist.barrier()


class WeightsAtTrainStart(dist_worker.WeightRecorder):
    """The weights training starts from: after a checkpoint is loaded (``on_fit_start`` comes before the restore)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pass

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = full_weights(pl_module.model)


def main() -> None:
    dist_worker.WeightRecorder = WeightsAtTrainStart  # "initial": the weights a resumed run loaded
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist_worker._module = float8_module  # every configuration trains the float8-friendly tiny model
    for config in configs:
        with per_shard_scales(config.pop("per_shard_scales", False)):
            if config.pop("layer_check", False):
                layer_scales_error(out, config["name"])
            else:
                dist_worker.run(dict(config), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
