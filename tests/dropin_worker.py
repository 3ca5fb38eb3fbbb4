"""LightningModules written for Lightning's ``ModelParallelStrategy``, trained with ``HybridParallelStrategy``.

Launched on 4 gloo processes by ``tests/test_model_parallel_dropin.py``. Each scenario below trains (or only sets
up) a module that parallelizes itself in ``configure_model`` the way code written for Lightning's strategy does,
records what it saw on every rank (plain JSON values), and rank 0 writes ``<scenario>.json``: a list with one
record per rank. The tests assert on the records; nothing is asserted here, so one wrong behaviour fails one test.

    python dropin_worker.py OUT_DIR [SCENARIO ...]
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from helpers.gather import gather_objects
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy

WORLD = 4
SAMPLES = 8
BATCH = 2
TIMEOUT = timedelta(seconds=97)  # not c10d's default (30 min), nor Lightning's
LIGHTNING_DIMS = ("data_parallel", "tensor_parallel")


# ------------------------------------------------------------------------------------------------ the user's code

class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 64)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def tensor_parallel(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tensor_parallel"],
                       {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})


def fsdp2_over_tp(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    tensor_parallel(model, mesh)
    for layer in (model.gate, model.up, model.down):
        fully_shard(layer, mesh=mesh["data_parallel"])


def vectors() -> list[torch.Tensor]:
    """The same 8 vectors on every rank (the sampler decides which rank sees which)."""
    return list(torch.randn(SAMPLES, 32, generator=torch.Generator().manual_seed(0)))


class UserModule(L.LightningModule):
    """Parallelizes itself in ``configure_model`` with ``parallelize(model, self.device_mesh)``."""

    def __init__(self, parallelize: Optional[Callable[[nn.Module, Any], None]] = None, compile: bool = False) -> None:
        super().__init__()
        self.model = FeedForward()
        self.parallelize, self.use_compile = parallelize, compile
        self.facts: dict[str, Any] = {"batches": []}

    def configure_model(self) -> None:
        self.facts["mesh"] = describe_mesh(self.device_mesh, self.trainer.strategy)
        if self.parallelize is not None:
            self.parallelize(self.model, self.device_mesh)
        if self.use_compile:
            self.model = torch.compile(self.model, backend="aot_eager")

    def on_train_start(self) -> None:
        # after a checkpoint was restored: what the training starts from
        self.facts["start"] = {**parameter_facts(self), **sampler_facts(self.trainer)}
        self.start_weights, self.start_optimizer = full_state(self.model), optimizer_full_state(self)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # every rank's batch, to see which ranks share data (TP peers must, DP peers must not)
        self.facts["batches"].append(self.all_gather(batch).flatten(1).sum(1).tolist())
        return self.model(batch).sum()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(vectors(), batch_size=BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


class StringModule(UserModule):
    """A batch without tensors: a list of strings, tokenized (32 bytes) inside ``training_step``."""

    def __init__(self) -> None:
        super().__init__(fsdp2_over_tp)
        self.losses: list[float] = []

    def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
        tokens = torch.tensor([list(text.encode()[:32].ljust(32)) for text in batch], dtype=torch.float32) / 255
        loss = self.model(tokens).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader([f"sample {i}: a few words" for i in range(SAMPLES)], batch_size=BATCH)


# ------------------------------------------------------------------------------------------------ observations

def ranks_of(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def timeout_of(group: Any) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def describe_mesh(mesh: Any, strategy: HybridParallelStrategy) -> dict[str, Any]:
    """What a module sees of ``self.device_mesh``, read by name and by position, next to the strategy's 3-D mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    facts: dict[str, Any] = {"is_device_mesh": isinstance(mesh, DeviceMesh), "names": list(mesh.mesh_dim_names)}
    if facts["names"] != list(LIGHTNING_DIMS):
        return facts
    dp, tp = mesh.shape  # by position, as code written for ModelParallelStrategy reads it
    internal = strategy.device_mesh
    facts.update({
        "device_type": mesh.device_type, "ndim": mesh.ndim, "shape": [dp, tp], "size": [mesh.size(0), mesh.size(1)],
        "grid": mesh.mesh.tolist(), "local_rank": [mesh.get_local_rank(0), mesh.get_local_rank(1)],
        "groups": {name: ranks_of(mesh.get_group(name)) for name in LIGHTNING_DIMS},
        "sliced": {name: mesh[name].mesh.tolist() for name in LIGHTNING_DIMS},
        "internal_names": list(internal.mesh_dim_names),
        "internal_groups": {dim: ranks_of(internal.get_group(dim)) for dim in ("dp", "tp")},
        "same_groups": all(mesh.get_group(name) is internal[name].get_group() for name in LIGHTNING_DIMS),
        "timeouts": {name: timeout_of(mesh.get_group(name)) for name in LIGHTNING_DIMS},
    })
    return facts


def sampler_facts(trainer: L.Trainer) -> dict[str, Any]:
    loader = trainer.train_dataloader
    return {"len": len(loader), "batch_size": loader.batch_size,
            "distributed_sampler": isinstance(loader.sampler, DistributedSampler)}


def parameter_facts(module: UserModule) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    params = list(module.model.parameters())
    optimized = module.trainer.optimizers[0].param_groups[0]["params"]
    meshes = [p.device_mesh for p in params if isinstance(p, DTensor)]
    return {
        "all_dtensor": len(meshes) == len(params),
        "optimizer_holds_them": len(optimized) == len(params) and all(a is b for a, b in zip(optimized, params)),
        "meshes": sorted({(m.ndim, tuple(m.shape), tuple(m.mesh_dim_names)) for m in meshes}),
        "on_tp_mesh": all(m == module.device_mesh["tensor_parallel"] for m in meshes),
        "devices": sorted({p.device.type for p in params}),
    }


def optimizer_full_state(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The optimizer's tensors by parameter name (gathered from their shards)."""
    from torch.distributed.tensor import DTensor

    optimizer = module.trainer.optimizers[0]
    names = {id(p): name for name, p in module.named_parameters()}
    return {f"{names[id(p)]}.{key}": (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for p, state in optimizer.state.items() for key, v in state.items() if isinstance(v, torch.Tensor)}


def flat_optimizer(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An optimizer state dict's tensors as ``{"<param>.<key>": tensor}``."""
    return {f"{param}.{key}": value for param, values in state.get("state", {}).items()
            for key, value in values.items() if isinstance(value, torch.Tensor)}


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Optional[float]:
    """Largest absolute difference over the common keys; ``None`` when the keys differ."""
    if sorted(a) != sorted(b):
        return None
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)


def trainer_for(strategy: HybridParallelStrategy, out: Path, **kwargs: Any) -> L.Trainer:
    settings = dict(accelerator="cpu", devices=WORLD, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    return L.Trainer(strategy=strategy, **{**settings, **kwargs})


# ------------------------------------------------------------------------------------------------ scenarios

def mesh_and_timeouts(out: Path) -> dict[str, Any]:
    """Lightning's 2-D mesh with dp=2 x tp=2; the timeout of every group. Runs first: it creates the default group."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hybrid.distributed.mesh import lightning_mesh

    module = UserModule()
    strategy = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, timeout=TIMEOUT)
    trainer_for(strategy, out, max_steps=1).fit(module)
    facts = module.facts["mesh"]
    internal = strategy.device_mesh
    facts["timeouts"].update({"world": timeout_of(dist.group.WORLD),
                              "checkpoint": timeout_of(strategy.checkpoint_group),
                              **{dim: timeout_of(internal.get_group(dim)) for dim in ("pp", "dp", "tp")}})
    # where DeviceMesh cannot slice by Lightning's names (a mesh built without them): a new mesh on the same ranks
    fallback = lightning_mesh(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp")),
                              strategy.dims, "cpu", TIMEOUT)
    facts["fallback"] = {"names": list(fallback.mesh_dim_names), "shape": list(fallback.shape),
                         "groups": {name: ranks_of(fallback.get_group(name)) for name in LIGHTNING_DIMS},
                         "timeouts": {name: timeout_of(fallback.get_group(name)) for name in LIGHTNING_DIMS}}
    return facts


SIZES = {
    "lightning_1x4": {"data_parallel_size": 1, "tensor_parallel_size": 4},
    "lightning_4x1": {"data_parallel_size": 4, "tensor_parallel_size": 1},
    "lightning_auto": {"data_parallel_size": "auto", "tensor_parallel_size": "auto"},
    "bare": {},
    "ours_tp2": {"tp": 2},
    "tp4_and_auto": {"tp": 4, "tensor_parallel_size": "auto"},
}


def mesh_sizes(out: Path) -> dict[str, Any]:
    """The mesh a module receives for each way of giving the sizes."""
    facts = {}
    for name, kwargs in SIZES.items():
        module = UserModule()
        trainer_for(HybridParallelStrategy(**kwargs), out, max_steps=1).fit(module)
        facts[name] = module.facts["mesh"]
    return facts


def tensor_parallel_bare(out: Path) -> dict[str, Any]:
    """A bare strategy, as code written for ``ModelParallelStrategy()`` gives none: tp = the node's 4 devices, dp = 1
    node; TP only, every rank sees the same data; compiled and not."""
    facts = {}
    for compile in (False, True):
        trainer = trainer_for(HybridParallelStrategy(), out, max_steps=2)
        with trainer.init_module(empty_init=True):
            module = UserModule(tensor_parallel, compile=compile)
        meta = all(p.is_meta for p in module.parameters())
        trainer.fit(module)
        facts[f"compile={compile}"] = {**module.facts, "meta_before_setup": meta, "steps": trainer.global_step,
                                       "compiled": type(module.model).__name__}
    return facts


def fsdp2_tensor_parallel(out: Path, compile: bool = False) -> dict[str, Any]:
    """FSDP2 over data_parallel=2 on TP over tensor_parallel=2: 2-D DTensors; data split over dp only; it trains."""
    trainer = trainer_for(HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), out, max_steps=2)
    with trainer.init_module(empty_init=True):
        module = UserModule(fsdp2_over_tp, compile=compile)
    trainer.fit(module)
    return {**module.facts, "steps": trainer.global_step, "compiled": type(module.model).__name__,
            "update": max_difference(module.start_weights, full_state(module.model))}


def load_into_plain(path: Path, model_state: dict, optimizer_state: dict) -> dict[str, Any]:
    """Rank 0: the single-file checkpoint into a plain module (not parallelized, not compiled) and a plain AdamW."""
    try:
        checkpoint = torch.load(path, weights_only=True)
        plain = UserModule()
        plain.load_state_dict(checkpoint["state_dict"])  # strict: every key, no extra one
        optimizer = torch.optim.AdamW(plain.model.parameters(), lr=1e-2)
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails naming it
        return {"error": repr(err)}
    return {"model": max_difference(dict(plain.state_dict()), model_state),
            "optimizer": max_difference(flat_optimizer(optimizer.state_dict()), flat_optimizer(optimizer_state)),
            "optimizer_entries": len(flat_optimizer(optimizer.state_dict()))}


def full_checkpoint(out: Path, compile: bool = False) -> dict[str, Any]:
    """save_distributed_checkpoint=False: full state dicts on rank 0 only, one file that a plain module loads, and
    that a distributed module resumes from bitwise.

    A compiled module's names carry no ``_orig_mod`` (torch's state-dict API drops it): its file loads into a plain
    module too. Resuming a compiled module from a full file fails inside Lightning's own loader (it expects the
    ``_orig_mod`` names), with ModelParallelStrategy alike, so that is not tried.
    """
    kwargs = {"data_parallel_size": 2, "tensor_parallel_size": 2, "save_distributed_checkpoint": False}
    module = UserModule(fsdp2_over_tp, compile=compile)
    trainer = trainer_for(HybridParallelStrategy(**kwargs), out, max_epochs=1)
    trainer.fit(module)
    strategy = trainer.strategy
    model_state = strategy.lightning_module_state_dict()
    optimizer_state = strategy.optimizer_state(trainer.optimizers[0])
    path = Path(strategy.broadcast(str(out / f"full-compile={compile}.ckpt")))
    trainer.save_checkpoint(path)
    facts = {"expected_keys": list(UserModule().state_dict()), "model_keys": list(model_state),
             "steps": trainer.global_step, "optimizer_entries": len(flat_optimizer(optimizer_state)),
             "compiled": type(module.model).__name__, "file": path.is_file()}
    if dist.get_rank() == 0:
        facts["plain"] = load_into_plain(path, model_state, optimizer_state)
    if compile:
        return facts
    resumed = UserModule(fsdp2_over_tp, compile=compile)
    trainer = trainer_for(HybridParallelStrategy(**kwargs), out, max_epochs=1)
    trainer.fit(resumed, ckpt_path=path)
    restored = trainer.strategy.optimizer_state(trainer.optimizers[0])
    facts["restored"] = {"steps": trainer.global_step,
                         "model": max_difference(model_state, trainer.strategy.lightning_module_state_dict()),
                         "optimizer": max_difference(flat_optimizer(optimizer_state), flat_optimizer(restored))}
    return facts


def sharded_checkpoint(out: Path) -> dict[str, Any]:
    """save_distributed_checkpoint=True: sharded state dicts on every rank; Lightning's ModelCheckpoint writes a
    folder of shards plus meta.pt; resuming starts from exactly the saved weights and optimizer states."""
    import os

    from torch.distributed.tensor import DTensor

    kwargs = {"data_parallel_size": 2, "tensor_parallel_size": 2, "save_distributed_checkpoint": True}
    module = UserModule(fsdp2_over_tp)
    expected_keys = list(module.state_dict())
    trainer = trainer_for(HybridParallelStrategy(**kwargs), out / "sharded", max_epochs=1, enable_checkpointing=True)
    trainer.fit(module)
    model_state = trainer.strategy.lightning_module_state_dict()
    weights, optimizer = full_state(module.model), optimizer_full_state(module)
    path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    meta = torch.load(path / "meta.pt", weights_only=True)
    facts = {"expected_keys": expected_keys, "model_keys": list(model_state),
             "all_dtensor": all(isinstance(v, DTensor) for v in model_state.values()),
             "files": sorted(os.listdir(path)),
             "meta": {"lightning_version": "pytorch-lightning_version" in meta, "callbacks": len(meta["callbacks"]),
                      "state_dict": "state_dict" in meta, "optimizer_states": "optimizer_states" in meta}}
    resumed = UserModule(fsdp2_over_tp)
    trainer = trainer_for(HybridParallelStrategy(**kwargs), out / "sharded", max_epochs=2, enable_checkpointing=True)
    trainer.fit(resumed, ckpt_path=path)
    facts["restored"] = {"weights": max_difference(weights, resumed.start_weights),
                         "optimizer": max_difference(optimizer, resumed.start_optimizer),
                         "optimizer_entries": len(resumed.start_optimizer), "steps": trainer.global_step,
                         "update": max_difference(resumed.start_weights, full_state(resumed.model))}
    return facts


def string_batch(out: Path) -> dict[str, Any]:
    """Batches of strings: trains; the data position counts in the DataLoader's batch size."""
    from lightning_hybrid.data.sampler import data_position

    module = StringModule()
    strategy = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    trainer = trainer_for(strategy, out, max_epochs=1)
    trainer.fit(module)
    return {"steps": trainer.global_step, "losses": module.losses, "per_rank_batch_size": strategy.per_rank_batch_size,
            "position": data_position(trainer, strategy.per_rank_batch_size, strategy.dims.dp, strategy.train_sampler),
            "update": max_difference(module.start_weights, full_state(module.model))}


def tp_only_replicas(out: Path) -> dict[str, Any]:
    """A module that applies only TP, under dp > 1 (tp=1, dp=4; and tp=2, dp=2): the strategy replicates its
    parameters over dp; after 4 steps every dp replica holds the same weights, and they moved."""
    facts = {}
    for name, strategy in (("dp4", HybridParallelStrategy(dp=4)), ("tp2", HybridParallelStrategy(tp=2))):
        trainer = trainer_for(strategy, out, max_steps=4)
        module = UserModule(tensor_parallel)
        L.seed_everything(int(dist.get_rank()), verbose=False)  # different initial weights per rank: broadcast fixes
        trainer.fit(module)
        weights = full_state(module.model)
        first = gather_objects({k: v.tolist() for k, v in weights.items()})[0]
        facts[name] = {"steps": trainer.global_step, "dp": strategy.dims.dp,
                       "replicated": len(strategy._replicas.params) if strategy._replicas else 0,
                       "difference_to_rank0": max_difference(weights, {k: torch.tensor(v) for k, v in first.items()}),
                       "update": max_difference(module.start_weights, weights),
                       "batches": module.facts["batches"]}
    return facts


class BranchFeedForward(FeedForward):
    """The feed-forward plus an adapter that only samples flagged in their last feature go through: a branch (an
    adapter, an expert no token is routed to) whose parameters get no gradient on a rank whose batch skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features, flag = x[:, :32], x[:, 32:]
        out = super().forward(features)
        if bool(flag.any()):  # per sample: a flagged sample's output does not depend on the others of its batch
            out = out + flag * self.adapter(features)
        return out


BRANCH_STEPS, BRANCH_DP, BRANCH_PER_RANK = 4, 2, 2
# Global sample i is read in step i // 4 by dp rank (i % 4) // 2. Flagged: step 0 only rank 0's sample 0, step 1
# only rank 1's sample 7, step 2 none (no rank uses the adapter), step 3 both ranks.
BRANCH_FLAGGED = (0, 7, 12, 14, 15)


def branch_samples() -> torch.Tensor:
    """The 16 samples (32 features and the flag) in global order: global batch k is rows 4k to 4k + 3."""
    samples = torch.randn(BRANCH_STEPS * BRANCH_DP * BRANCH_PER_RANK, 33, generator=torch.Generator().manual_seed(3))
    samples[:, 32] = 0.0
    samples[list(BRANCH_FLAGGED), 32] = 1.0
    return samples


def branch_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def branch_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # decay: a zero gradient would still move weights


class BranchModule(UserModule):
    """TP on the feed-forward (``tensor_parallel=2``), the adapter left alone: the strategy replicates both over dp."""

    def __init__(self) -> None:
        super().__init__(tensor_parallel)
        self.model = BranchFeedForward()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return branch_loss(self.model, batch)

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.strategy.distributed_sampler_kwargs["rank"]
        order = [step * BRANCH_DP * BRANCH_PER_RANK + rank * BRANCH_PER_RANK + i
                 for step in range(BRANCH_STEPS) for i in range(BRANCH_PER_RANK)]
        return DataLoader(list(branch_samples()), batch_size=BRANCH_PER_RANK, sampler=order)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return branch_optimizer(self.model.parameters())


def unused_branch(out: Path) -> dict[str, Any]:
    """dp=2 x tp=2, 4 steps, the adapter used on one dp rank only, on neither, on both: trains, every rank holds the
    same weights after it, and the weights it started from are recorded for the one-process reference."""
    strategy = HybridParallelStrategy(dp=BRANCH_DP, tp=2)
    trainer = trainer_for(strategy, out, max_steps=BRANCH_STEPS, use_distributed_sampler=False)
    module = BranchModule()
    L.seed_everything(int(os.environ["RANK"]), verbose=False)  # different initial weights per rank: broadcast fixes
    trainer.fit(module)
    weights = full_state(module.model)
    first = gather_objects({k: v.tolist() for k, v in weights.items()})[0]
    return {"steps": trainer.global_step, "dp": strategy.dims.dp, "tp": strategy.dims.tp,
            "replicated": len(strategy._replicas.params) if strategy._replicas else 0,
            "difference_to_rank0": max_difference(weights, {k: torch.tensor(v) for k, v in first.items()}),
            "start": {k: v.tolist() for k, v in module.start_weights.items()},
            "final": {k: v.tolist() for k, v in weights.items()}}


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "mesh_and_timeouts": mesh_and_timeouts,  # first: its strategy creates the default process group
    "mesh_sizes": mesh_sizes,
    "tensor_parallel_bare": tensor_parallel_bare,
    "fsdp2_tensor_parallel": fsdp2_tensor_parallel,
    "full_checkpoint": full_checkpoint,
    "compiled_full_checkpoint": lambda out: full_checkpoint(out, compile=True),
    "sharded_checkpoint": sharded_checkpoint,
    "string_batch": string_batch,
    "tp_only_replicas": tp_only_replicas,
    "unused_branch": unused_branch,
}


def main() -> None:
    out = Path(sys.argv[1])
    for name in sys.argv[2:] or list(SCENARIOS):
        L.seed_everything(0, verbose=False)
        per_rank = gather_objects(SCENARIOS[name](out))
        if dist.get_rank() == 0:
            (out / f"{name}.json").write_text(json.dumps(per_rank))
    dist.barrier()
    dist.destroy_process_group()  # after the barrier: no rank leaves while its gloo peers still talk


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
