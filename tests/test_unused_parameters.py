"""A parameter that some data-parallel ranks did not use (``grad is None`` there) takes part in every reduction over
dp as zeros: the ranks reduce buffers of the same size, a parameter used anywhere gets the reduced gradient
everywhere, one used nowhere keeps ``grad=None`` (lightning_hybrid/distributed/data_parallel.py's
``reduce_gradients``, behind the replicas of self-parallelizing modules, ``replicate`` and torchft's cross-group
average). Two "ranks" in one process: each reduction adds the other rank's flat buffer, as a sum all-reduce would.
The multi-process check (dp=2 x tp=2, against one process) is in tests/test_model_parallel_dropin.py."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from lightning_hybrid.distributed.data_parallel import reduce_gradients

GRADS = {  # per rank: the parameters with a gradient (the others' grad is None)
    0: {"used_by_both": 1.0, "used_by_rank0": 3.0},
    1: {"used_by_both": 5.0},
}


def _model(rank: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ParameterDict({name: nn.Parameter(torch.zeros(3)) for name in
                              ("used_by_both", "used_by_rank0", "used_by_nobody")})
    model["frozen"] = nn.Parameter(torch.zeros(2), requires_grad=False)
    for name, value in GRADS[rank].items():
        model[name].grad = torch.full((3,), value)
    return model


def _flat(model: nn.Module, reduce_dtype: Optional[torch.dtype]) -> list[torch.Tensor]:
    """The flat buffers ``model`` sends (a reduction that only captures them changes no gradient)."""
    sent: list[torch.Tensor] = []
    reduce_gradients(model.parameters(), lambda flat: sent.append(flat.clone()), 1, reduce_dtype)
    return sent


@pytest.mark.parametrize("reduce_dtype", [None, torch.float64])
def test_the_ranks_send_buffers_of_one_size_and_agree_on_every_gradient(reduce_dtype):
    models = {rank: _model(rank) for rank in GRADS}
    sent = {rank: _flat(model, reduce_dtype) for rank, model in models.items()}
    assert [t.shape for t in sent[0]] == [t.shape for t in sent[1]] == [torch.Size([3 * 3 + 3])]
    for rank, model in models.items():
        other = iter(sent[1 - rank])
        reduce_gradients(model.parameters(), lambda flat: flat.add_(next(other)), 2, reduce_dtype)
    for model in models.values():
        assert torch.equal(model["used_by_both"].grad, torch.full((3,), 3.0))   # (1 + 5) / 2
        assert torch.equal(model["used_by_rank0"].grad, torch.full((3,), 1.5))  # (3 + 0) / 2: zeros on rank 1
        assert model["used_by_nobody"].grad is None and model["frozen"].grad is None
        assert model["used_by_rank0"].grad.dtype == torch.float32


def test_buckets_are_cut_by_the_parameters_not_by_which_gradients_exist():
    models = {rank: _model(rank) for rank in GRADS}
    sizes = {}
    for rank, model in models.items():
        sent: list[torch.Tensor] = []
        reduce_gradients(model.parameters(), lambda flat: sent.append(flat), bucket_bytes=0)
        sizes[rank] = [t.numel() for t in sent]
    assert sizes[0] == sizes[1] == [3 + 1, 3 + 1, 3 + 1]  # one parameter per bucket (each over 0 bytes), with its flag


def test_torchft_cross_group_average_counts_a_missing_gradient_as_zeros():
    from lightning_hybrid.distributed.fault_tolerance import ReplicaGroups

    models = {rank: _model(rank) for rank in GRADS}
    sent = {rank: _flat(model, None) for rank, model in models.items()}
    for group, model in models.items():
        other = iter(sent[1 - group])

        class Work:
            def wait(self) -> None:
                pass

        class Manager:  # torchft's Manager.allreduce: the average over the groups of the quorum, in place
            @staticmethod
            def allreduce(tensor: torch.Tensor) -> Work:
                tensor.add_(next(other)).div_(2)
                return Work()

        groups = ReplicaGroups.__new__(ReplicaGroups)
        groups.manager, groups.in_step = Manager(), True
        groups.average_gradients(list(model.parameters()))
    for model in models.values():
        assert torch.equal(model["used_by_rank0"].grad, torch.full((3,), 1.5))
        assert model["used_by_nobody"].grad is None
