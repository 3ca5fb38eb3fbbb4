"""Memory sanity: each rank holds its pipeline stage's share of the parameters, gradients and Adam states,
divided by ``tp * dp`` (FSDP).

Two meshes: tp=2 x dp=2 (the stage is the whole model) and tp=2 x pp=2 x dp=2 (the stages partition the
model). Norm weights are not split by tensor parallelism (every TP rank needs the whole scale vector), so
they are divided by ``dp`` only: a rank holds ``stage_sharded / (tp * dp) + stage_norms / dp``. The count of
each rank must equal that within the size of one unsharded norm, which bounds what uneven FSDP chunks
could add. Run as a script (by torchrun), this file is the worker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from helpers.compare import local_tensor
from lightning_hybrid.models import CausalLM, Qwen2, Qwen2Config

MESHES = {"tp2_dp2": (2, 1, 2), "tp2_pp2_dp2": (2, 2, 2)}  # name: (tp, pp, dp)


def full_counts(config: Qwen2Config) -> dict[str, tuple[int, bool]]:
    """Every parameter of the unsharded model (built on meta): name -> (numel, left whole by tensor parallelism)."""
    with torch.device("meta"):
        model = Qwen2(config)
    return {name: (p.numel(), "norm" in name) for name, p in model.named_parameters()}


class LocalCounts(L.Callback):
    """At the first optimizer step: this rank's numel of parameters, gradients and Adam moments, and its names."""

    def __init__(self, monitor) -> None:
        self.record: dict = {}
        self.monitor = monitor

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # A pipeline's gradients are dropped right after the step, so they are counted before it.
        self.record["grads"] = sum(local_tensor(p.grad).numel() for p in pl_module.model.parameters()
                                   if p.grad is not None)
        self.record["grads_are_dtensors"] = all(isinstance(p.grad, DTensor) for p in pl_module.model.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_hybrid.callbacks.throughput import training_state_bytes
        from lightning_hybrid.init_weights import canonical_name

        local = local_tensor
        params = list(pl_module.model.parameters())
        optimizer = trainer.optimizers[0]
        states = [optimizer.state[p] for p in params]
        self.record.update({
            "names": sorted(canonical_name(n) for n, _ in pl_module.model.named_parameters()),
            "coordinates": trainer.strategy.dims.coordinates(trainer.global_rank),
            "params": sum(local(p).numel() for p in params),
            "exp_avg": sum(local(s["exp_avg"]).numel() for s in states),
            "exp_avg_sq": sum(local(s["exp_avg_sq"]).numel() for s in states),
            "step_bytes": sum(local(s["step"]).numel() * local(s["step"]).element_size() for s in states),
            "all_dtensor": all(isinstance(p, DTensor) for p in params),
            "bytes": training_state_bytes(pl_module, trainer.optimizers),
            "monitor": {k: v for k, v in self.monitor.last_metrics.items() if k.startswith("memory/")},
        })


def _worker(out: Path, tp: int, pp: int, dp: int) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridParallelStrategy

    L.seed_everything(0)
    ids = torch.randint(0, 256, (16, 16))
    from lightning_hybrid.callbacks import ThroughputMonitor

    monitor = ThroughputMonitor(peak_tflops=1.0, straggler_every_n_steps=0)
    counts = LocalCounts(monitor)
    strategy = HybridParallelStrategy(tp=tp, pp=pp, dp=dp, data_parallel="fsdp")
    trainer = L.Trainer(accelerator="cpu", devices=tp * pp * dp, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[monitor, counts])
    trainer.fit(CausalLM("tiny"), train_dataloaders=DataLoader(TensorDataset(ids, ids), batch_size=4))
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, counts.record)
    if trainer.global_rank == 0:
        (out / "counts.json").write_text(json.dumps(records))
    # Leave together: a rank whose gloo peers are already gone can abort at exit ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=sorted(MESHES))
def rank_counts(request, tmp_path_factory) -> tuple[tuple[int, int, int], list[dict]]:
    from helpers.launch import launch

    mesh = MESHES[request.param]
    out = tmp_path_factory.mktemp("memory")
    launch(mesh[0] * mesh[1] * mesh[2], [__file__, str(out), *map(str, mesh)], timeout=170)
    return mesh, json.loads((out / "counts.json").read_text())


pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


@pytest.mark.parametrize("kind", ["params", "grads", "exp_avg", "exp_avg_sq"])
def test_each_rank_holds_its_stage_share_divided_by_tp_times_dp(rank_counts, kind):
    (tp, pp, dp), records = rank_counts
    config = Qwen2Config.from_preset("tiny")
    full = full_counts(config)
    one_norm = config.hidden_size
    assert len(records) == tp * pp * dp
    for rank, record in enumerate(records):
        stage = [full[name] for name in record["names"]]
        expected = sum(n / dp if whole else n / (tp * dp) for n, whole in stage)
        assert abs(record[kind] - expected) <= one_norm, (kind, rank, record[kind], expected)
        if pp == 1:  # the plain statement, with the TP-replicated norms as the only excess
            total, norms = sum(n for n, _ in full.values()), sum(n for n, whole in full.values() if whole)
            assert abs(record[kind] - total / (tp * dp)) <= norms * (1 / dp - 1 / (tp * dp)) + one_norm


def test_the_stages_partition_the_model_and_every_tp_and_dp_peer_holds_the_same_stage(rank_counts):
    (tp, pp, dp), records = rank_counts
    full = full_counts(Qwen2Config.from_preset("tiny"))
    by_stage: dict[int, set] = {}
    for record in records:
        names = set(record["names"])
        assert by_stage.setdefault(record["coordinates"]["pp"], names) == names
    assert len(by_stage) == pp
    assert sum(len(names) for names in by_stage.values()) == len(full)  # disjoint ...
    assert set().union(*by_stage.values()) == set(full)                 # ... and complete


def test_every_parameter_and_gradient_is_a_sharded_dtensor(rank_counts):
    _, records = rank_counts
    assert all(record["all_dtensor"] and record["grads_are_dtensors"] for record in records)


def test_monitor_byte_counts_agree_with_the_local_shards(rank_counts):
    _, records = rank_counts
    for record in records:  # fp32 everywhere; Adam keeps a scalar step per parameter next to its moments
        assert record["bytes"]["params"] == 4 * record["params"]
        assert record["bytes"]["optimizer"] == 4 * (record["exp_avg"] + record["exp_avg_sq"]) + record["step_bytes"]
        # what the ThroughputMonitor logs; gradients as held at the optimizer step, also under a pipeline
        gib = 1024 ** 3
        assert record["monitor"]["memory/params_gib"] * gib == pytest.approx(4 * record["params"])
        assert record["monitor"]["memory/grads_gib"] * gib == pytest.approx(4 * record["grads"])
        assert record["grads"] == record["params"]
    # the fullest device, the same number on every rank
    peaks = [record["monitor"]["memory/peak_rss_gib"] for record in records]
    assert {record["monitor"]["memory/peak_max_gib"] for record in records} == {max(peaks)}


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), *map(int, sys.argv[2:5]))
