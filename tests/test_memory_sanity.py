"""Memory sanity: each rank holds 1 / (tp * dp) of the parameters, gradients and Adam states (FSDP, pp=1).

Norm weights are not split by tensor parallelism (every TP rank needs the whole scale vector), so
they are divided by ``dp`` only: a rank holds ``sharded / (tp * dp) + norms / dp``. The count of each
rank must equal that within the size of one unsharded norm, which bounds what uneven FSDP chunks
could add. Run as a script (by torchrun), this file is the worker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import lightning as L
from lightning_hybrid.models import CausalLM, Qwen2, Qwen2Config

TP, DP = 2, 2


def full_counts(config: Qwen2Config) -> tuple[int, int]:
    """(all parameters, parameters that tensor parallelism leaves whole) of the unsharded model, on meta."""
    with torch.device("meta"):
        model = Qwen2(config)
    total = sum(p.numel() for p in model.parameters())
    replicated = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    return total, replicated


class LocalCounts(L.Callback):
    """After the first optimizer step: this rank's numel of parameters, gradients and Adam moments."""

    def __init__(self) -> None:
        self.record: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from torch.distributed.tensor import DTensor

        from lightning_hybrid.callbacks.throughput import training_state_bytes

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        params = list(pl_module.model.parameters())
        optimizer = trainer.optimizers[0]
        states = [optimizer.state[p] for p in params]
        self.record = {
            "params": sum(local(p).numel() for p in params),
            "grads": sum(local(p.grad).numel() for p in params if p.grad is not None),
            "exp_avg": sum(local(s["exp_avg"]).numel() for s in states),
            "exp_avg_sq": sum(local(s["exp_avg_sq"]).numel() for s in states),
            "step_bytes": sum(local(s["step"]).numel() * local(s["step"]).element_size() for s in states),
            "all_dtensor": all(isinstance(p, DTensor) for p in params),
            "bytes": training_state_bytes(pl_module, trainer.optimizers),
        }


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridParallelStrategy

    L.seed_everything(0)
    ids = torch.randint(0, 256, (8, 16))
    counts = LocalCounts()
    trainer = L.Trainer(accelerator="cpu", devices=TP * DP, strategy=HybridParallelStrategy(tp=TP, data_parallel="fsdp"),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[counts])
    trainer.fit(CausalLM("tiny"), train_dataloaders=DataLoader(TensorDataset(ids, ids), batch_size=2))
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, counts.record)
    if trainer.global_rank == 0:
        (out / "counts.json").write_text(json.dumps(records))


@pytest.fixture(scope="module")
def rank_counts(tmp_path_factory) -> list[dict]:
    from launch import torchrun

    out = tmp_path_factory.mktemp("memory")
    torchrun(TP * DP, [__file__, str(out)], timeout=170)
    return json.loads((out / "counts.json").read_text())


pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


@pytest.mark.parametrize("kind", ["params", "grads", "exp_avg", "exp_avg_sq"])
def test_each_rank_holds_its_tp_times_dp_share_with_fsdp_tp2_dp2(rank_counts, kind):
    config = Qwen2Config.from_preset("tiny")
    total, replicated = full_counts(config)
    expected = (total - replicated) / (TP * DP) + replicated / DP
    one_norm = config.hidden_size
    assert len(rank_counts) == TP * DP
    for rank, record in enumerate(rank_counts):
        assert abs(record[kind] - expected) <= one_norm, (kind, rank, record[kind], expected)
        # the plain statement, with the TP-replicated norms as the only excess
        assert abs(record[kind] - total / (TP * DP)) <= replicated * (1 / DP - 1 / (TP * DP)) + one_norm


def test_every_parameter_is_a_sharded_dtensor(rank_counts):
    assert all(record["all_dtensor"] for record in rank_counts)


def test_monitor_byte_counts_agree_with_the_local_shards(rank_counts):
    for record in rank_counts:  # fp32 everywhere; Adam keeps a scalar step per parameter next to its moments
        assert record["bytes"]["params"] == 4 * record["params"]
        assert record["bytes"]["grads"] == 4 * record["grads"]
        assert record["bytes"]["optimizer"] == 4 * (record["exp_avg"] + record["exp_avg_sq"]) + record["step_bytes"]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
