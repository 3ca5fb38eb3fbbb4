"""HybridParallelStrategy in place of Lightning's ModelParallelStrategy, for code written for the latter.

What Lightning 2.6's own ``test_model_parallel.py`` and ``test_model_parallel_integration.py`` check of its strategy,
checked here of ours (our own tests, on CPU/gloo): the 2-D mesh a self-parallelizing module receives (by name and by
position), Lightning's size keywords and their ``"auto"``, timeouts, state dicts, full and sharded checkpoints,
compile, TP alone and TP with FSDP2; and a module whose batches hold no tensor. The differences that are intended
(our class name in messages, sizes refused earlier and as ``ValueError``) are asserted as such.

The multi-process checks share one launch of 4 processes (``dropin_worker.py`` runs every scenario and records
what each rank saw; the tests below assert on the records).
"""

from __future__ import annotations

import json
import math
from unittest.mock import Mock

import lightning as L
import pytest
import torch

from helpers.launch import TESTS, launch
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.data.sampler import batch_size_of
from lightning_hybrid.distributed.mesh import lightning_mesh
from lightning_hybrid.distributed.parallel_dims import ParallelDims

WORLD = 4
TIMEOUT_S = 97.0  # dropin_worker.TIMEOUT
FULL_WORLD = list(range(WORLD))


class SelfParallelizing(L.LightningModule):
    """A module written for ModelParallelStrategy (declares nothing; parallelizes itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def configure_model(self) -> None:
        pass


def validated(devices: int = 4, nodes: int = 1, **kwargs) -> HybridParallelStrategy:
    """The strategy after its setup-time checks (no process group), for ``devices`` per node on ``nodes``."""
    strategy = HybridParallelStrategy(**kwargs)
    strategy._lightning_module = SelfParallelizing()
    strategy._parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = nodes
    strategy._validate()
    return strategy


# ------------------------------------------------------------------------------------------------ sizes, in-process

def test_lightning_size_keywords_are_aliases_of_dp_and_tp():
    options = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=4).options
    assert (options.dp, options.tp) == (2, 4)
    assert validated(devices=8, data_parallel_size=2, tensor_parallel_size=4).dims == ParallelDims(4, 1, 2, 8)
    # the same value under both names is no conflict
    assert HybridParallelStrategy(tp=4, tensor_parallel_size=4, dp=2, data_parallel_size=2).options.tp == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 2, "tensor_parallel_size": 4}, r"^tp=2 and tensor_parallel_size=4 disagree; give one of them"),
    ({"dp": 2, "data_parallel_size": 4}, r"^dp=2 and data_parallel_size=4 disagree; give one of them"),
    ({"tensor_parallel_size": "all"}, r"^tensor_parallel_size='all' must be a positive integer or 'auto'$"),
    ({"data_parallel_size": 0}, r"^data_parallel_size=0 must be a positive integer or 'auto'$"),
    ({"data_parallel_size": True}, r"^data_parallel_size=True must be a positive integer or 'auto'$"),
])
def test_a_size_given_twice_differently_or_invalid_is_refused_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message) as caught:
        HybridParallelStrategy(**kwargs)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("devices, nodes, kwargs, tp_dp", [
    # Lightning's "auto": tp = devices per node, dp = nodes
    (4, 1, {"data_parallel_size": "auto", "tensor_parallel_size": "auto"}, (4, 1)),
    (4, 2, {"data_parallel_size": "auto", "tensor_parallel_size": "auto"}, (4, 2)),
    (4, 2, {"tensor_parallel_size": "auto"}, (4, 2)),             # dp inferred
    (4, 2, {"tp": 4, "tensor_parallel_size": "auto"}, (4, 2)),    # agrees with "auto"
    # the bare defaults differ from ModelParallelStrategy(): tp=1, dp = the world
    (4, 2, {}, (1, 8)),
])
def test_auto_resolves_at_setup_as_lightning_does(devices, nodes, kwargs, tp_dp):
    dims = validated(devices, nodes, **kwargs).dims
    assert (dims.tp, dims.dp) == tp_dp


def test_auto_that_disagrees_with_a_given_size_is_refused_at_setup():
    with pytest.raises(ValueError, match=r"^tp=2 and tensor_parallel_size='auto' \(= 4 here\) disagree"):
        validated(4, 2, tp=2, tensor_parallel_size="auto")
    with pytest.raises(ValueError, match=r"^dp=4 and data_parallel_size='auto' \(= 2 here\) disagree"):
        validated(4, 2, dp=4, data_parallel_size="auto")


@pytest.mark.parametrize("nodes, devices, dp, tp", [(1, 4, 1, 1), (1, 4, 2, 3), (1, 4, 4, 2), (2, 4, 1, 4),
                                                    (2, 4, 2, 1)])
def test_sizes_that_do_not_fill_the_world_are_refused_before_any_collective(nodes, devices, dp, tp):
    # Lightning raises a RuntimeError in setup_environment after init_process_group; ours is a ValueError before it
    with pytest.raises(ValueError, match=r"tp\*pp|world size"):
        validated(devices, nodes, data_parallel_size=dp, tensor_parallel_size=tp)


def test_the_mesh_is_not_available_before_setup():
    with pytest.raises(RuntimeError, match="Accessing the device mesh before processes have initialized"):
        _ = HybridParallelStrategy().device_mesh


def test_storage_options_are_refused_naming_the_strategy(tmp_path):
    with pytest.raises(TypeError, match=r"HybridParallelStrategy.save_checkpoint\(..., storage_options=...\)"):
        HybridParallelStrategy().save_checkpoint({}, tmp_path, storage_options=Mock())


def test_a_module_without_configure_model_is_refused():
    strategy = HybridParallelStrategy()
    module = L.LightningModule()
    strategy.model = strategy._lightning_module = module
    strategy._accelerator = Mock()
    strategy._parallel_devices = [torch.device("cpu")]
    with pytest.raises(TypeError, match="you are required to override the `configure_model"):
        strategy.setup(Mock())


def test_the_2d_mesh_exists_only_without_a_pipeline():
    with pytest.raises(ValueError, match=r"exists only with pp=1, not pp=2"):
        lightning_mesh(Mock(), ParallelDims(1, 2, 2, 4), "cpu")


def test_batch_size_comes_from_the_tensors_else_from_the_dataloader():
    loader = torch.utils.data.DataLoader(["a", "b", "c"], batch_size=3)
    assert batch_size_of(torch.zeros(5, 2), loader) == 5
    assert batch_size_of({"text": ["a", "b"], "ids": torch.zeros(2, 7)}, loader) == 2
    assert batch_size_of(["a b", "c d", "e f"], loader) == 3     # no tensor: Lightning's extract_batch_size raises
    assert batch_size_of(["a b"], None) is None                  # neither tells: no data position, no crash
    assert batch_size_of(["a b"], {"a": loader}) is None         # several loaders: no single batch size


# ------------------------------------------------------------------------------------------------ 4 processes

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropin")
    launch(WORLD, [str(TESTS / "dropin_worker.py"), str(out)], timeout=300)
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


def distributed(test):
    """A test of the 4-process run: marked ``distributed``, with a timeout that covers the run's launch."""
    return pytest.mark.timeout(600)(pytest.mark.distributed(test))


def dp2_tp2_groups(rank: int) -> dict[str, list[int]]:
    """Lightning's mesh (dp=2, tp=2) over ranks [[0, 1], [2, 3]]: tp groups are rows, dp groups columns."""
    return {"data_parallel": [rank % 2, rank % 2 + 2], "tensor_parallel": [rank // 2 * 2, rank // 2 * 2 + 1]}


@distributed
def test_a_self_parallelizing_module_gets_lightnings_2d_mesh(runs):
    for rank, mesh in enumerate(runs["mesh_and_timeouts"]):
        assert mesh["is_device_mesh"] and mesh["device_type"] == "cpu"
        assert mesh["names"] == ["data_parallel", "tensor_parallel"] and mesh["ndim"] == 2
        assert mesh["grid"] == [[0, 1], [2, 3]]
        assert mesh["groups"] == dp2_tp2_groups(rank) == mesh["sliced"]
        assert mesh["local_rank"] == [rank // 2, rank % 2]
        # the 3-D mesh stays the strategy's, and the 2-D one is a view of it: the same groups
        assert mesh["internal_names"] == ["pp", "dp", "tp"]
        groups = mesh["groups"]
        assert mesh["internal_groups"] == {"dp": groups["data_parallel"], "tp": groups["tensor_parallel"]}
        assert mesh["same_groups"] is True


@distributed
@pytest.mark.parametrize("name, dp, tp", [("lightning_1x4", 1, 4), ("lightning_4x1", 4, 1), ("lightning_auto", 1, 4),
                                          ("bare", 4, 1), ("ours_tp2", 2, 2), ("tp4_and_auto", 1, 4)])
def test_positional_mesh_access_reads_dp_then_tp(runs, name, dp, tp):
    for rank, record in enumerate(runs["mesh_sizes"]):
        mesh = record[name]
        assert mesh["names"] == ["data_parallel", "tensor_parallel"]
        assert mesh["shape"] == [dp, tp] and mesh["size"] == [dp, tp], mesh   # dp, tp = self.device_mesh.shape
        assert mesh["local_rank"] == [rank // tp, rank % tp]
        assert mesh["groups"]["tensor_parallel"] == list(range(rank // tp * tp, rank // tp * tp + tp))
        assert mesh["groups"]["data_parallel"] == list(range(rank % tp, WORLD, tp))


@distributed
def test_every_group_times_out_after_the_strategys_timeout(runs):
    for mesh in runs["mesh_and_timeouts"]:
        timeouts = mesh["timeouts"]
        assert set(timeouts) == {"world", "pp", "dp", "tp", "data_parallel", "tensor_parallel", "checkpoint"}
        assert all(value == TIMEOUT_S for value in timeouts.values()), timeouts


@distributed
def test_without_the_named_slice_the_2d_mesh_is_built_on_the_same_ranks(runs):
    for rank, mesh in enumerate(runs["mesh_and_timeouts"]):
        fallback = mesh["fallback"]
        assert fallback["names"] == ["data_parallel", "tensor_parallel"] and fallback["shape"] == [2, 2]
        assert fallback["groups"] == dp2_tp2_groups(rank)
        assert fallback["timeouts"] == {"data_parallel": TIMEOUT_S, "tensor_parallel": TIMEOUT_S}


def same_across(batches: list[list[float]], ranks: list[int]) -> bool:
    return all(batches[r] == batches[ranks[0]] for r in ranks)


@distributed
def test_tensor_parallel_with_lightnings_default_sizes(runs):
    """ModelParallelStrategy()'s sizes, asked for by name: tp = the node's 4 devices, dp = 1 node."""
    for record in runs["tensor_parallel_auto"]:
        assert record["meta_before_setup"] and record["steps"] == 2
        assert record["mesh"]["shape"] == [1, 4]
        start = record["start"]
        assert start["all_dtensor"] and start["optimizer_holds_them"] and start["on_tp_mesh"]
        assert start["meshes"] == [[1, [4], ["tensor_parallel"]]] and start["devices"] == ["cpu"]
        assert start["distributed_sampler"] and start["len"] == 8 // start["batch_size"]   # no data sharding
        assert len(record["batches"]) == 2
        assert all(same_across(step, FULL_WORLD) for step in record["batches"])


@distributed
@pytest.mark.parametrize("name, dp, replicated", [("bare", 4, 6), ("tp2", 2, 6)])
def test_a_module_that_applies_only_tp_trains_equal_replicas_over_dp(runs, name, dp, replicated):
    """Nothing of the module synchronizes its dp replicas; the strategy replicates its parameters (broadcast, then
    gradients averaged over dp): after 4 steps on different data, every rank holds rank 0's weights."""
    for record in runs["tp_only_replicas"]:
        facts = record[name]
        assert facts["steps"] == 4 and facts["dp"] == dp and facts["replicated"] == replicated
        assert facts["difference_to_rank0"] == 0.0 and facts["update"] > 1e-3
        assert not all(same_across(step, FULL_WORLD) for step in facts["batches"])  # the replicas saw other data


def test_the_declared_model_protocol_is_a_class_method_returning_a_parallel_spec():
    from lightning_hybrid.models import CausalLM
    from lightning_hybrid.models.spec import ParallelSpec, declared_spec

    assert declared_spec(Mock()) is None and declared_spec(SelfParallelizing()) is None
    assert isinstance(declared_spec(CausalLM("tiny")), ParallelSpec)

    class Wrong(SelfParallelizing):
        def parallel_spec(self):
            return {"blocks": "layers"}

    with pytest.raises(TypeError, match=r"^Wrong.parallel_spec\(\) returned dict, not a ParallelSpec"):
        declared_spec(Wrong())


def test_a_size_mismatch_is_both_a_value_error_and_lightnings_runtime_error():
    for expected in (ValueError, RuntimeError):
        with pytest.raises(expected, match=r"multiplied should equal the world size"):
            validated(4, 1, data_parallel_size=2, tensor_parallel_size=3)


@distributed
def test_fsdp2_over_tensor_parallel(runs):
    for record in runs["fsdp2_tensor_parallel"]:
        assert record["steps"] == 2 and record["mesh"]["shape"] == [2, 2]
        start = record["start"]
        assert start["all_dtensor"] and start["optimizer_holds_them"] and start["devices"] == ["cpu"]
        assert start["meshes"] == [[2, [2, 2], ["data_parallel", "tensor_parallel"]]]
        assert start["distributed_sampler"] and start["len"] == 8 // start["batch_size"] // 2  # sharded over dp only
        for step in record["batches"]:
            assert same_across(step, [0, 1]) and same_across(step, [2, 3])   # TP peers: the same batch
            assert step[0] != step[2]                                         # DP peers: different batches
        assert record["update"] > 0


PARAMETER_STATES = 6 * 3   # gate/up/down weight and bias; AdamW's step, exp_avg, exp_avg_sq


@distributed
def test_full_state_dicts_only_on_rank_0_and_sharded_ones_on_every_rank(runs):
    for rank, record in enumerate(runs["full_checkpoint"]):
        if rank == 0:
            assert record["model_keys"] == record["expected_keys"]
            assert record["optimizer_entries"] == PARAMETER_STATES
        else:
            assert record["model_keys"] == [] and record["optimizer_entries"] == 0
    for record in runs["sharded_checkpoint"]:
        assert record["model_keys"] == record["expected_keys"] and record["all_dtensor"]


@distributed
@pytest.mark.parametrize("name", ["full_checkpoint", "compiled_full_checkpoint"])
def test_a_full_checkpoint_is_one_file_a_plain_module_loads_bitwise(runs, name):
    record = runs[name][0]
    assert record["file"] and record["steps"] == 2
    assert record["plain"].get("error") is None, record["plain"]
    assert record["plain"]["model"] == 0.0 and record["plain"]["optimizer"] == 0.0
    assert record["plain"]["optimizer_entries"] == PARAMETER_STATES


@distributed
def test_a_distributed_module_resumes_from_a_full_checkpoint_bitwise(runs):
    for record in runs["full_checkpoint"]:
        assert record["restored"] == {"steps": 2, "model": 0.0, "optimizer": 0.0}


@distributed
def test_a_compiled_module_trains_and_saves_under_its_plain_names(runs):
    for rank, record in enumerate(runs["compiled_full_checkpoint"]):
        assert record["compiled"] == "OptimizedModule" and record["steps"] == 2
        if rank == 0:  # no "_orig_mod" in the file: a plain module loads it (test above)
            assert record["model_keys"] == record["expected_keys"] == [
                f"model.{layer}.{kind}" for layer in ("gate", "up", "down") for kind in ("weight", "bias")]
            assert record["optimizer_entries"] == PARAMETER_STATES


@distributed
def test_a_sharded_checkpoint_is_a_folder_of_shards_and_resumes_exactly(runs):
    for record in runs["sharded_checkpoint"]:
        assert record["files"] == sorted(["meta.pt", ".metadata", *(f"__{r}_0.distcp" for r in range(WORLD))])
        assert record["meta"] == {"lightning_version": True, "callbacks": 1, "state_dict": False,
                                  "optimizer_states": False}
        restored = record["restored"]
        assert restored["weights"] == 0.0 and restored["optimizer"] == 0.0
        assert restored["optimizer_entries"] == PARAMETER_STATES
        assert restored["steps"] == 4 and restored["update"] > 0


@distributed
def test_a_module_whose_batches_are_strings_trains(runs):
    for record in runs["string_batch"]:
        assert record["steps"] == 2 and len(record["losses"]) == 2
        assert all(math.isfinite(loss) for loss in record["losses"]) and record["update"] > 0
        # the data position counts in the DataLoader's batch size: 2 steps x 2 per rank x dp 2
        assert record["per_rank_batch_size"] == 2
        assert record["position"]["samples_in_epoch"] == 8 and record["position"]["global_batch"] == 4
