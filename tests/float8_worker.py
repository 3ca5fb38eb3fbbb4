"""``dist_worker.py`` for float8 configurations: the tiny model with an MLP width whose TP shards fit float8 (192/2 =
96, a multiple of 16), a record of which linears were converted, and a ``per_shard_scales`` switch that makes
torchao compute each amax on this rank's shard only (the negative control of the equivalence test).

Launched by ``tests/test_float8.py`` with ``LIGHTNING_HYBRID_FLOAT8_EMULATE=1`` (torchao's emulated GEMM: the same
float8 casts and scales, without CPU ``_scaled_mm``'s reference kernel, which would take minutes per step).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import dist_worker
import torch.distributed as dist

from helpers.equivalence import make_trainer_kwargs, tiny_config
from helpers.worker_exit import end_worker
from lightning_hybrid.models import CausalLM

FLOAT8_TINY = {"intermediate_size": 192}


FLOAT8_LR = 1e-3  # bf16 rounding (4e-3) grows fast under lr 1e-2; this keeps 10 steps comparable at 1e-3


def float8_module(kind: str) -> CausalLM:
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


def main() -> None:
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist_worker._module = float8_module  # every configuration trains the float8-friendly tiny model
    for config in configs:
        with per_shard_scales(config.pop("per_shard_scales", False)):
            dist_worker.run(dict(config), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker()
