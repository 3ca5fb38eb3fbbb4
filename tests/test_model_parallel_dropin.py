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
from typing import Optional
from unittest.mock import Mock

import lightning as L
import pytest
import torch

from helpers.compare import TOL
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


def validated(devices: int = 4, nodes: int = 1, module: Optional[L.LightningModule] = None,
              **kwargs) -> HybridParallelStrategy:
    """The strategy after its setup-time checks (no process group), for ``devices`` per node on ``nodes``, with
    ``module`` (default: one that parallelizes itself)."""
    strategy = HybridParallelStrategy(**kwargs)
    strategy._lightning_module = module if module is not None else SelfParallelizing()
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
    # no size given: ModelParallelStrategy()'s mesh for a module that parallelizes itself
    (4, 2, {}, (4, 2)),
    (4, 1, {}, (4, 1)),
    (4, 2, {"dp": 8}, (1, 8)),                                    # pure data parallelism when asked for
    (4, 2, {"tp": 2}, (2, 4)),                                    # a size given: nothing is "auto"
])
def test_auto_resolves_at_setup_as_lightning_does(devices, nodes, kwargs, tp_dp):
    dims = validated(devices, nodes, **kwargs).dims
    assert (dims.tp, dims.dp) == tp_dp


def test_a_bare_strategy_says_once_which_mesh_it_chose_for_each_kind_of_module(caplog):
    from lightning_hybrid.models import CausalLM

    with caplog.at_level("INFO"):
        self_parallel = validated(4, 2)
    lines = [r.getMessage() for r in caplog.records if "without sizes" in r.getMessage()]
    assert lines == ["HybridParallelStrategy() without sizes, for a module that parallelizes itself: "
                     "ModelParallelStrategy's default mesh, tensor_parallel=4 (the devices of a node) x "
                     "data_parallel=2 (the nodes); give dp/tp (or data_parallel_size/tensor_parallel_size) for "
                     "another"], lines
    assert (self_parallel.dims.tp, self_parallel.dims.dp) == (4, 2)
    caplog.clear()
    with caplog.at_level("INFO"):
        declared = validated(4, 2, module=CausalLM("tiny"))  # the documented default stays: tp=1, dp = the world
    assert (declared.dims.tp, declared.dims.pp, declared.dims.dp) == (1, 1, 8)
    lines = [r.getMessage() for r in caplog.records if "without sizes" in r.getMessage()]
    assert lines == ["HybridParallelStrategy() without sizes, for a declared model: tp=1, pp=1, dp=8 (fsdp over "
                     "every rank); give tp/pp (or 'auto' to plan them) for another"], lines
    caplog.clear()
    with caplog.at_level("INFO"):
        validated(4, 2, tp=2)
    assert not [r for r in caplog.records if "without sizes" in r.getMessage()]


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
                                          ("bare", 1, 4), ("ours_tp2", 2, 2), ("tp4_and_auto", 1, 4)])
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
@pytest.mark.parametrize("compile", [False, True])
def test_tensor_parallel_under_a_bare_strategy_gets_lightnings_default_mesh(runs, compile):
    """Code written for ``ModelParallelStrategy()``, given ``HybridParallelStrategy()``: tp = the node's 4 devices,
    dp = 1 node (not dp=4 with whole weights on every rank); TP only, every rank sees the same data."""
    for record in runs["tensor_parallel_bare"]:
        facts = record[f"compile={compile}"]
        assert facts["meta_before_setup"] and facts["steps"] == 2
        assert facts["mesh"]["shape"] == [1, 4]
        assert facts["compiled"] == ("OptimizedModule" if compile else "FeedForward")
        start = facts["start"]
        assert start["all_dtensor"] and start["optimizer_holds_them"] and start["on_tp_mesh"]
        assert start["meshes"] == [[1, [4], ["tensor_parallel"]]] and start["devices"] == ["cpu"]
        assert start["distributed_sampler"] and start["len"] == 8 // start["batch_size"]   # no data sharding
        assert len(facts["batches"]) == 2
        assert all(same_across(step, FULL_WORLD) for step in facts["batches"])


@distributed
@pytest.mark.parametrize("name, dp, replicated", [("dp4", 4, 6), ("tp2", 2, 6)])
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


@distributed
def test_a_branch_one_dp_rank_skips_trains_like_one_process_over_the_global_batch(runs):
    """A self-parallelizing module whose adapter only some samples use, on dp=2 x tp=2 for 4 steps: in step 1 only dp
    rank 0's batch uses it, in step 2 only rank 1's, in step 3 neither, in step 4 both. The rank without a gradient
    takes part in the replicas' all-reduce with zeros (it used to reduce a shorter buffer: gloo aborted with
    "Received data size doesn't match expected size"); a step no rank used it leaves it untouched, as one process
    over the global batch does (AdamW skips a parameter without gradient; weight decay would move a zero one)."""
    from dropin_worker import (
        BRANCH_DP,
        BRANCH_PER_RANK,
        BRANCH_STEPS,
        BranchFeedForward,
        branch_loss,
        branch_optimizer,
        branch_samples,
    )

    records = runs["unused_branch"]
    for record in records:
        assert record["steps"] == BRANCH_STEPS and (record["dp"], record["tp"]) == (2, 2)
        assert record["replicated"] == 8  # gate, up, down (TP shards over tp only) and the adapter: weight and bias
        assert record["difference_to_rank0"] == 0.0  # the replicas are bitwise equal
    reference = BranchFeedForward()
    reference.load_state_dict({k: torch.tensor(v) for k, v in records[0]["start"].items()})
    optimizer = branch_optimizer(reference.parameters())
    samples, global_batch = branch_samples(), BRANCH_DP * BRANCH_PER_RANK
    adapter_moved = []
    for step in range(BRANCH_STEPS):
        before = reference.adapter.weight.detach().clone()
        branch_loss(reference, samples[step * global_batch:(step + 1) * global_batch]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        adapter_moved.append(not torch.equal(before, reference.adapter.weight))
    assert adapter_moved == [True, True, False, True]  # the reference itself: the adapter rests in step 3
    final = {k: torch.tensor(v) for k, v in records[0]["final"].items()}
    expected = {name: param.detach() for name, param in reference.named_parameters()}
    assert final.keys() == expected.keys()
    for names in (list(expected), ["adapter.weight", "adapter.bias"]):  # the whole model, and the adapter alone
        diff = torch.cat([(final[k] - expected[k]).flatten() for k in names])
        assert float(diff.norm() / torch.cat([expected[k].flatten() for k in names]).norm()) < TOL, names


# ------------------------------------------------------------------------------------------------ more of Lightning's
# unit scenarios, in process: what a self-parallelizing module meets in setup, saving and loading

def _set_up(module: L.LightningModule, **kwargs) -> HybridParallelStrategy:
    """``setup`` of the strategy for ``module`` on one CPU, without a Trainer or a process group (sizes unresolved:
    nothing is replicated)."""
    strategy = HybridParallelStrategy(**kwargs)
    strategy.model = strategy._lightning_module = module
    strategy._accelerator = Mock()
    strategy._parallel_devices = [torch.device("cpu")]
    strategy.setup(Mock())
    return strategy


def test_a_module_wrapped_in_the_legacy_fsdp_is_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    module = SelfParallelizing()
    module.modules = Mock(return_value=[Mock(spec=FullyShardedDataParallel)])
    with pytest.raises(TypeError, match="only supports the new FSDP2 APIs"):
        _set_up(module)


def test_meta_device_weights_are_materialized_by_reset_parameters_and_a_module_without_it_is_named():
    class Ones(torch.nn.Module):  # no reset_parameters(): left uninitialized, and named in a warning
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4))

    class Module(SelfParallelizing):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(Ones(), Ones())
            self.register_buffer("scale", torch.rand(2))

        def reset_parameters(self) -> None:
            self.scale.fill_(1.0)

    with torch.device("meta"):
        module = Module()
    assert module.layer.weight.is_meta and module.block[0].weight.is_meta and module.scale.is_meta
    with pytest.warns(UserWarning, match=r"`reset_parameters\(\)` method for re-initialization: Ones"):
        _set_up(module)
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def test_a_full_checkpoint_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path, monkeypatch):
    strategy = HybridParallelStrategy(save_distributed_checkpoint=False)
    monkeypatch.setattr(HybridParallelStrategy, "broadcast", lambda self, obj, src=0: obj)
    strategy._lightning_module = SelfParallelizing()
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        strategy.save_checkpoint({"state_dict": {}}, filepath=folder)
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_module_built_in_the_init_context_trains_in_the_precision_asked_for(tmp_path):
    class Module(SelfParallelizing):
        def training_step(self, batch, batch_idx):
            self.seen = (self.layer.weight.dtype, self.layer.weight.device.type)
            return self.layer(batch).float().sum()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(strategy=HybridParallelStrategy(), accelerator="cpu", devices=1, precision="bf16-true",
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with trainer.init_module(empty_init=True):
        module = Module()
    assert module.layer.weight.is_meta and module.layer.weight.dtype == torch.bfloat16
    trainer.fit(module)
    assert module.seen == (torch.bfloat16, "cpu") and trainer.global_step == 1
