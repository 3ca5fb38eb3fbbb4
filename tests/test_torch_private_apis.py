"""The private torch and Lightning APIs the package relies on still exist and behave as its wrappers expect.

Each private API is used in exactly one named function of the package (the *wrapper*). When torch or Lightning
changes one of them, the test here fails with a message naming that wrapper: fix it there, nowhere else.

Wrappers (in ``lightning_hybrid.distributed``) and the private APIs they use:

- ``pipeline.runner.forward_only_order``: ``torch.distributed.pipelining.schedules._Action``, ``_ComputationType``,
  ``_add_send_recv``, ``_add_unshard_reshard``; a V schedule's ``pipeline_order_with_comms``,
  ``stage_index_to_group_rank`` and ``_num_stages``;
- ``pipeline.runner.forget_stage_shapes``: a schedule's ``_stage_forward_initialized`` and
  ``_stage_backward_initialized`` (one stage per rank) or ``_stages_forward_initialized`` and
  ``_stages_backward_initialized`` (several), which its step reads to infer the stages' shapes again;
- ``mesh._group_timeout``: ``torch.distributed.distributed_c10d.default_pg_timeout`` and
  ``default_pg_nccl_timeout``, read by ``new_group`` when DeviceMesh creates its groups;
- ``mesh._flatten_groups``: ``DeviceMesh._flatten`` (the dp x cp, HSDP and Lightning names of the mesh);
- ``clip_grad.use_global_norm_clipping``: Lightning's ``Precision.clip_gradients(optimizer, val, "norm")`` calling
  ``self.clip_grad_by_norm(optimizer, val)``;
- ``clip_grad._is_split``: ``torch.distributed.tensor.placement_types._StridedShard``;
- ``init_weights.local_region``: ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``;
- ``callbacks.rollback._restore_counters``: Lightning's ``_TrainingEpochLoop._batches_that_stepped`` and the fit
  loop's state-dict keys ``epoch_loop.automatic_optimization.optim_progress`` and ``epoch_loop.state_dict``;
- ``callbacks.rollback._rewind``: the fit loop's ``_data_fetcher`` (``iter()`` makes its iterator anew, ``fetched``
  counts the epoch's batches) and its state-dict key ``epoch_loop.batch_progress``;
- ``checkpoint.storage.storage_writer`` / ``storage_reader``: ``torch.distributed.checkpoint._fsspec_filesystem``'s
  ``FsspecWriter`` and ``FsspecReader`` (a path and fsspec's storage options as keywords);
- ``checkpoint.staging.tie_writer_to_parent``: ``torch.distributed.checkpoint._async_process_executor``'s
  ``_AsyncCheckpointProcess._checkpointing_subprocess`` (a static method of ``(pg_init_info, parent_conn)``, the
  target of the writer daemon that ``__init__`` spawns);
- ``lightning_hybrid.distributed.auto_layout._data``: Lightning's ``trainer.fit_loop._data_source.instance`` (the
  DataLoader given to ``fit``, before Lightning sets it up), read by the auto layout.

- ``expert_parallel._recomputing`` and ``models.decoder.moe._in_backward``: ``torch._C._current_graph_task_id``
  (-1 outside a backward pass);
- ``expert_parallel.AllToAllDispatch``: ``torch.distributed._functional_collectives.all_to_all_single_autograd``
  (differentiable, split sizes; the same op that ``activation_checkpoint._saved_ops`` keeps);
- ``expert_parallel.shard_experts``: FSDP2 dividing a one-rank group's gradients twice when the sum reduction is
  forced with a divide factor (the reason it is forced only on larger groups).

Wrappers in ``lightning_hybrid.dryrun`` (the dry run on the fake process group):

- ``fake.DryRunTensorMode``: ``torch._subclasses.fake_tensor.FakeTensorMode`` (``allow_non_fake_inputs``),
  ``FakeTensor`` and ``unset_fake_temporarily``;
- ``fake.fake_world``: ``torch.testing._internal.distributed.fake_pg.FakeStore`` and the ``"fake"`` backend;
- ``accounting.MemoryPeaks``: ``torch.distributed._tools.mem_tracker.MemTracker`` and its ``_update_snap`` (its
  four parameters), ``_update_peak_stats``, ``_curr_mem_snap``, ``_peak_mem``, ``_peak_mem_snap``,
  ``memory_tracking``, ``_in_opt``, ``_in_ac``, ``_ac_mod``, ``_mod_tracker``, ``_track_module_params_and_buffers``,
  the module's ``_TOTAL_KEY`` and the four module hooks it overrides;
- ``accounting._group_of``: ``torch._C._distributed_c10d.ProcessGroup.unbox`` and ``_resolve_process_group``;
- ``rank._static_stages``: ``torch.distributed.pipelining._utils._StageMeta`` and ``extract_tensor_metas``, and a
  ``PipelineStage``'s ``_user_meta``, ``_warmup_forward_vote`` and ``_warmup_backward_result``.

All single-process: the pipeline schedules are built over stand-in stages, the clipping runs without a process
group, and the DeviceMesh tests use a one-process gloo group on 127.0.0.1 (destroyed after each test).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from datetime import timedelta
from typing import Any, Iterator

import lightning
import pytest
import torch
import torch.distributed as dist

from lightning_hybrid.launch.torchrun import free_port

FORWARD_ONLY_ORDER = "lightning_hybrid.distributed.pipeline.runner.forward_only_order"
GROUP_TIMEOUT = "lightning_hybrid.distributed.mesh._group_timeout"
LIGHTNING_NAMES = "lightning_hybrid.distributed.mesh._flatten_groups"
GLOBAL_NORM_CLIPPING = "lightning_hybrid.distributed.clip_grad.use_global_norm_clipping"
IS_SPLIT = "lightning_hybrid.distributed.clip_grad._is_split"
LOCAL_REGION = "lightning_hybrid.init_weights.local_region"
RESTORE_COUNTERS = "lightning_hybrid.callbacks.rollback._restore_counters"
REWIND = "lightning_hybrid.callbacks.rollback._rewind"
FSSPEC_WRITER = "lightning_hybrid.checkpoint.storage.storage_writer"
FORGET_STAGE_SHAPES = "lightning_hybrid.distributed.pipeline.runner.forget_stage_shapes"
WRITER_DAEMON = "lightning_hybrid.checkpoint.staging.tie_writer_to_parent"
RECOMPUTING = "lightning_hybrid.distributed.expert_parallel._recomputing"
IN_BACKWARD = "lightning_hybrid.models.decoder.moe._in_backward"
ALL_TO_ALL = "lightning_hybrid.distributed.expert_parallel.AllToAllDispatch"
SHARD_EXPERTS = "lightning_hybrid.distributed.expert_parallel.shard_experts"


def broken(wrapper: str, what: str) -> str:
    return (f"{what} (torch {torch.__version__}, lightning {lightning.__version__}): a private API changed; "
            f"fix {wrapper}, the one place that uses it")


def private(module: str, name: str, wrapper: str) -> Any:
    """``module.name``, failing with the wrapper to fix when it is gone."""
    found = importlib.import_module(module)
    assert hasattr(found, name), broken(wrapper, f"{module}.{name} is gone")
    return getattr(found, name)


def takes(func: Any, parameters: list[str], wrapper: str) -> None:
    """``func`` still has the named parameters the wrapper passes."""
    signature = inspect.signature(func)
    missing = [name for name in parameters if name not in signature.parameters]
    assert not missing, broken(wrapper, f"{func.__qualname__}{signature} has no parameter {', '.join(missing)}")


@contextlib.contextmanager
def blame(wrapper: str) -> Iterator[None]:
    """An exception inside (other than a failed assertion) fails the test naming the wrapper to fix."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as err:  # noqa: BLE001 - any change of behaviour is reported the same way
        pytest.fail(broken(wrapper, f"{type(err).__name__}: {err}"))


def wrapper_function(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return private(module, name, dotted)


# ---------------------------------------------------------------------------------- forward-only pipeline order

SCHEDULES = "torch.distributed.pipelining.schedules"


def test_pipeline_action_types_and_lowering_passes_exist_with_the_parameters_used():
    action = private(SCHEDULES, "_Action", FORWARD_ONLY_ORDER)
    kinds = private(SCHEDULES, "_ComputationType", FORWARD_ONLY_ORDER)
    takes(action, ["stage_index", "computation_type", "microbatch_index"], FORWARD_ONLY_ORDER)
    for member in ("FORWARD", "SEND_F", "RECV_F"):
        assert hasattr(kinds, member), broken(FORWARD_ONLY_ORDER, f"_ComputationType has no {member}")
    takes(private(SCHEDULES, "_add_unshard_reshard", FORWARD_ONLY_ORDER), ["compute_actions"], FORWARD_ONLY_ORDER)
    takes(private(SCHEDULES, "_add_send_recv", FORWARD_ONLY_ORDER), ["compute_actions", "stage_to_rank", "num_stages"],
          FORWARD_ONLY_ORDER)


def _v_schedule(name: str, pp: int, pp_rank: int, microbatches: int) -> Any:
    """A real torch V schedule over stand-in stages (building one needs no process group)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    stages = [types.SimpleNamespace(stage_index=i, num_stages=2 * pp, group_size=pp, group_rank=pp_rank,
                                    is_first=i == 0, is_last=i == 2 * pp - 1, submod=torch.nn.Linear(2, 2))
              for i in (pp_rank, 2 * pp - 1 - pp_rank)]
    try:
        return get_schedule_class(name)(stages, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"building a {name} schedule over stand-in stages failed ({type(err).__name__}: {err}); the "
                    f"schedule constructor changed: update _v_schedule in this test, then check {FORWARD_ONLY_ORDER}")


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_forward_only_order_lowers_to_forwards_with_sends_and_receives_and_restores_the_schedule(name):
    from torch.distributed.pipelining.schedules import _ComputationType

    forward_only_order = wrapper_function(FORWARD_ONLY_ORDER)
    pp, microbatches = 2, 4
    schedule = _v_schedule(name, pp, 0, microbatches)
    for attribute in ("pipeline_order_with_comms", "stage_index_to_group_rank", "_num_stages"):
        assert hasattr(schedule, attribute), broken(FORWARD_ONLY_ORDER, f"a {name} schedule has no {attribute}")
    training_order = schedule.pipeline_order_with_comms
    stage_to_rank = dict(schedule.stage_index_to_group_rank)
    assert schedule._num_stages == 2 * pp and sorted(stage_to_rank) == list(range(2 * pp)), broken(
        FORWARD_ONLY_ORDER, f"{name}: _num_stages={schedule._num_stages}, stage_index_to_group_rank={stage_to_rank}")
    with blame(FORWARD_ONLY_ORDER), forward_only_order(schedule, microbatches):
        order = schedule.pipeline_order_with_comms
    assert schedule.pipeline_order_with_comms is training_order, "the training order was not restored"
    for rank in range(pp):
        stages = sorted(s for s, r in stage_to_rank.items() if r == rank)
        actions = [a for a in order[rank] if a is not None]

        def of(kind: Any) -> list[tuple[int, int]]:
            return [(a.stage_index, a.microbatch_index) for a in actions if a.computation_type == kind]

        # every forward of this rank's stages, lowest stage first, no backward of any kind
        assert of(_ComputationType.FORWARD) == [(s, mb) for s in stages for mb in range(microbatches)], broken(
            FORWARD_ONLY_ORDER, f"rank {rank}'s lowered forward-only order is {[str(a) for a in actions]}")
        kinds = {a.computation_type for a in actions}
        assert kinds <= {_ComputationType.FORWARD, _ComputationType.SEND_F, _ComputationType.RECV_F,
                         _ComputationType.UNSHARD, _ComputationType.RESHARD}, broken(
            FORWARD_ONLY_ORDER, f"rank {rank}'s lowered forward-only order holds {sorted(map(str, kinds))}")
        # activations travel between ranks: sent where the next stage is elsewhere, received from the previous one
        sends = {(s, mb) for s in stages if s + 1 < 2 * pp and stage_to_rank[s + 1] != rank
                 for mb in range(microbatches)}
        receives = {(s, mb) for s in stages if s > 0 and stage_to_rank[s - 1] != rank
                    for mb in range(microbatches)}
        assert set(of(_ComputationType.SEND_F)) == sends and set(of(_ComputationType.RECV_F)) == receives, broken(
            FORWARD_ONLY_ORDER, f"rank {rank}'s sends/receives are {[str(a) for a in actions]}")


def test_forward_only_order_restores_the_training_order_after_an_error():
    forward_only_order = wrapper_function(FORWARD_ONLY_ORDER)
    schedule = _v_schedule("ZBVZeroBubble", 2, 1, 4)
    training_order = schedule.pipeline_order_with_comms
    with pytest.raises(RuntimeError, match="evaluation failed"):  # the lowering itself is checked above
        with forward_only_order(schedule, 4):
            raise RuntimeError("evaluation failed")
    assert schedule.pipeline_order_with_comms is training_order


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                  "ZBVZeroBubble", "DualPipeV"])
def test_forget_stage_shapes_clears_the_flags_a_schedule_step_reads(name):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    forget_stage_shapes = wrapper_function(FORGET_STAGE_SHAPES)
    cls = get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    ids = [0] if single else [0, 3]
    stages = [types.SimpleNamespace(stage_index=i, num_stages=len(ids) * 2, group_size=2, group_rank=0,
                                    is_first=i == 0, is_last=False, submod=torch.nn.Linear(2, 2)) for i in ids]
    with blame(FORGET_STAGE_SHAPES):
        schedule = cls(stages[0] if single else stages, n_microbatches=4, loss_fn=lambda out, target: out.sum())
    prefix = "_stage_" if single else "_stages_"
    flags = [f"{prefix}forward_initialized", f"{prefix}backward_initialized"]
    for flag in flags:
        assert getattr(schedule, flag, None) is False, broken(FORGET_STAGE_SHAPES, f"a new {name} has no {flag}=False")
        setattr(schedule, flag, True)  # as after a training step
    forget_stage_shapes(schedule)
    assert [getattr(schedule, flag) for flag in flags] == [False, False]
    # the forward-only pass hands return_outputs=False through eval() to step()
    assert "return_outputs" in inspect.signature(cls.step).parameters, broken(FORGET_STAGE_SHAPES, "step() changed")
    source = inspect.getsource(type(schedule)._initialize_pp_stages)
    assert "needs_fwd = not fwd_initialized" in source, broken(FORGET_STAGE_SHAPES, "_initialize_pp_stages changed")


# ---------------------------------------------------------------------------------- clipping through Lightning

def _precision(name: str) -> Any:
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    return {"32-true": lambda: Precision(), "bf16-true": lambda: HalfPrecision("bf16-true"),
            "bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu")}[name]()


def test_lightning_precision_clips_by_norm_through_clip_grad_by_norm():
    from lightning.pytorch.plugins.precision import Precision

    takes(Precision.clip_gradients, ["optimizer", "clip_val", "gradient_clip_algorithm"], GLOBAL_NORM_CLIPPING)
    takes(Precision.clip_grad_by_norm, ["optimizer", "clip_val"], GLOBAL_NORM_CLIPPING)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_lightning_routes_norm_clipping_to_the_global_norm(precision, monkeypatch):
    import lightning_hybrid.distributed.clip_grad as clip_grad

    assert not dist.is_initialized(), "this test runs without a process group (global_grad_norm needs none)"
    use_global_norm_clipping = wrapper_function(GLOBAL_NORM_CLIPPING)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model(torch.randn(16, 8)).pow(2).sum().backward()
    norm_before = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    assert norm_before > 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    calls = []
    ours = clip_grad.clip_grad_norm_global

    def spy(parameters, max_norm, ranks_per_stage, group=None):
        parameters = list(parameters)
        calls.append((len(parameters), max_norm, ranks_per_stage))
        return ours(parameters, max_norm, ranks_per_stage, group)

    def per_rank_clip(*args, **kwargs):
        raise AssertionError(broken(GLOBAL_NORM_CLIPPING, "Lightning clipped with torch's per-rank clip_grad_norm_"))

    monkeypatch.setattr(clip_grad, "clip_grad_norm_global", spy)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", per_rank_clip)
    plugin = _precision(precision)
    use_global_norm_clipping(plugin, ranks_per_stage=1)
    with blame(GLOBAL_NORM_CLIPPING):
        plugin.clip_gradients(optimizer, clip_val=0.5, gradient_clip_algorithm="norm")
    assert calls == [(2, 0.5, 1)], broken(
        GLOBAL_NORM_CLIPPING, f"{type(plugin).__name__}.clip_gradients(..., 'norm') did not call clip_grad_by_norm "
                              f"(calls of ours: {calls})")
    norm_after = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    assert norm_after == pytest.approx(0.5, rel=1e-4), (norm_before, norm_after)


def test_strided_shard_counts_as_a_split_placement():
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    strided = private("torch.distributed.tensor.placement_types", "_StridedShard", IS_SPLIT)
    takes(strided, ["dim", "split_factor"], IS_SPLIT)
    is_split = wrapper_function(IS_SPLIT)
    with blame(IS_SPLIT):
        assert is_split(strided(0, split_factor=2)) and is_split(Shard(1)), broken(IS_SPLIT, "a shard is not split")
        assert not is_split(Replicate()) and not is_split(Partial()), broken(IS_SPLIT, "a replica counts as split")


# ---------------------------------------------------------------------------------- one-process gloo group

C10D = "torch.distributed.distributed_c10d"


@pytest.fixture
def gloo_world() -> Iterator[None]:
    assert not dist.is_initialized(), "a process group is already initialized in this process"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _timeout_of(group: Any) -> timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except AttributeError as err:
        pytest.fail(f"this test reads a group's timeout through ProcessGroup._get_backend(cpu).options._timeout, "
                    f"which changed ({err}): update _timeout_of here, then check {GROUP_TIMEOUT}")


def test_c10d_default_timeouts_exist():
    assert isinstance(private(C10D, "default_pg_timeout", GROUP_TIMEOUT), timedelta), broken(
        GROUP_TIMEOUT, "c10d.default_pg_timeout is no timedelta")
    nccl = private(C10D, "default_pg_nccl_timeout", GROUP_TIMEOUT)  # None when torch is built without NCCL
    assert nccl is None or isinstance(nccl, timedelta), broken(GROUP_TIMEOUT, f"default_pg_nccl_timeout={nccl!r}")


def test_groups_created_inside_group_timeout_get_its_timeout(gloo_world):
    import torch.distributed.distributed_c10d as c10d

    group_timeout = wrapper_function(GROUP_TIMEOUT)
    saved = c10d.default_pg_timeout, c10d.default_pg_nccl_timeout
    with blame(GROUP_TIMEOUT):
        with group_timeout(timedelta(seconds=77)):
            inside = dist.new_group(ranks=[0], backend="gloo")  # as DeviceMesh creates them: no timeout argument
        outside = dist.new_group(ranks=[0], backend="gloo")
    assert (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout) == saved, "the c10d defaults were not restored"
    assert _timeout_of(inside) == timedelta(seconds=77), broken(
        GROUP_TIMEOUT, f"a group created inside got timeout {_timeout_of(inside)}: new_group no longer reads "
                       f"c10d.default_pg_timeout")
    assert _timeout_of(outside) == saved[0]


def test_device_mesh_answers_to_lightning_dimension_names(gloo_world):
    from lightning_hybrid.distributed.mesh import build_mesh
    from lightning_hybrid.distributed.parallel_dims import ParallelDims

    flatten = getattr(private("torch.distributed.device_mesh", "DeviceMesh", LIGHTNING_NAMES), "_flatten", None)
    assert flatten is not None, broken(LIGHTNING_NAMES, "DeviceMesh._flatten is gone")
    takes(flatten, ["mesh_dim_name"], LIGHTNING_NAMES)
    wrapper_function(LIGHTNING_NAMES)
    with blame(LIGHTNING_NAMES):
        mesh = build_mesh(ParallelDims.resolve(1, 1, None, 1), "cpu", timeout=timedelta(seconds=60))
        aliases = {"data_parallel": mesh["data_parallel"], "tensor_parallel": mesh["tensor_parallel"]}
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    for alias, dim in (("data_parallel", "dp"), ("tensor_parallel", "tp")):
        assert aliases[alias].mesh_dim_names == (alias,), broken(LIGHTNING_NAMES,
                                                                 f"mesh[{alias!r}] is {aliases[alias]}")
        assert aliases[alias].size() == mesh[dim].size() and aliases[alias].get_group() is not None


def test_local_region_reads_the_shard_shape_and_offset(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    compute = private("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", LOCAL_REGION)
    takes(compute, ["global_shape", "mesh", "placements"], LOCAL_REGION)
    local_region = wrapper_function(LOCAL_REGION)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    full = torch.arange(12.0).reshape(4, 3)
    with blame(LOCAL_REGION):
        shape, offset = compute(full.shape, mesh, [Shard(0)])
        local, global_shape, global_offset = local_region(distribute_tensor(full, mesh, [Shard(0)]))
    assert (tuple(shape), tuple(offset)) == ((4, 3), (0, 0)), broken(
        LOCAL_REGION, f"compute_local_shape_and_global_offset returned {shape}, {offset} (not local shape, offset)")
    assert torch.equal(local, full) and global_shape == (4, 3) and global_offset == (0, 0)


# ---------------------------------------------------------------------------------- rollback of the loop counters


def test_a_rollback_restores_the_optimizer_step_counter_and_the_logging_step_of_a_checkpoint():
    from types import SimpleNamespace

    import lightning as L

    restore = wrapper_function(RESTORE_COUNTERS)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    epoch_loop = trainer.fit_loop.epoch_loop
    assert hasattr(epoch_loop, "_batches_that_stepped"), broken(RESTORE_COUNTERS, "_batches_that_stepped is gone")
    step = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    step.ready = step.completed = 2
    epoch_loop._batches_that_stepped = 1
    saved = trainer.fit_loop.state_dict()
    assert {"epoch_loop.automatic_optimization.optim_progress", "epoch_loop.state_dict"} <= set(saved), broken(
        RESTORE_COUNTERS, f"the fit loop's state-dict keys changed: {sorted(saved)}")
    step.ready = step.completed = 7
    epoch_loop._batches_that_stepped = 6
    with blame(RESTORE_COUNTERS):
        restore(SimpleNamespace(fit_loop=trainer.fit_loop, lr_scheduler_configs=[]), {"loops": {"fit_loop": saved}})
    stepped = epoch_loop._batches_that_stepped
    assert trainer.global_step == 2 and stepped == 1, broken(
        RESTORE_COUNTERS, f"restored global_step {trainer.global_step}, _batches_that_stepped {stepped}; expected 2, 1")


def test_the_fit_loop_keeps_a_data_fetcher_that_iter_restarts_and_counts_fetched_batches():
    import lightning as L
    from lightning.pytorch.loops.fetchers import _DataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    wrapper_function(REWIND)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert hasattr(trainer.fit_loop, "_data_fetcher"), broken(REWIND, "FitLoop._data_fetcher is gone")
    assert "epoch_loop.batch_progress" in trainer.fit_loop.state_dict(), broken(REWIND, "no epoch_loop.batch_progress")
    fetcher = _DataFetcher()
    fetcher.setup(CombinedLoader([10, 20, 30]))
    with blame(REWIND):
        iter(fetcher)
        next(fetcher)
        iter(fetcher)  # anew: from the first batch again, nothing counted
        fetcher.fetched += 1
        assert next(fetcher)[0] == 10 and fetcher.fetched == 2 and not fetcher.done
        next(fetcher)
    assert fetcher.done, broken(REWIND, "the fetcher does not end the epoch at fetched == length")


AUTO_DATA = "lightning_hybrid.distributed.auto_layout._data"


def test_fit_loop_data_source_holds_the_dataloader_given_to_fit():
    from lightning_hybrid.distributed.auto_layout import _data

    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 8)), batch_size=2)
    module = lightning.LightningModule()
    trainer._data_connector.attach_data(module, train_dataloaders=loader)
    assert _data(trainer) == (None, loader), f"{AUTO_DATA}: Lightning moved fit_loop._data_source.instance"


DRY_MODE = "lightning_hybrid.dryrun.fake.DryRunTensorMode"
FAKE_WORLD = "lightning_hybrid.dryrun.fake.fake_world"
MEMORY_PEAKS = "lightning_hybrid.dryrun.accounting.MemoryPeaks"
GROUP_OF = "lightning_hybrid.dryrun.accounting._group_of"
STATIC_STAGES = "lightning_hybrid.dryrun.rank._static_stages"


def test_dry_run_tensor_mode_keeps_real_index_math_and_fakes_the_rest():
    for name in ("FakeTensorMode", "FakeTensor", "unset_fake_temporarily"):
        private("torch._subclasses.fake_tensor", name, DRY_MODE)
    mode_class = wrapper_function(DRY_MODE)
    index = torch.arange(8).reshape(2, 4)
    with blame(DRY_MODE), mode_class():
        big = torch.empty(1 << 30, dtype=torch.float32)  # 4 GiB: only a fake tensor can hold it here
        ranks = (index == 5).nonzero().tolist()  # DeviceMesh's coordinate lookup, on a real tensor
        flag = torch.ones(1, dtype=torch.int32)
        assert int(flag.item()) == 1
    from torch._subclasses.fake_tensor import FakeTensor

    assert isinstance(big, FakeTensor) and ranks == [[1, 1]]


def test_fake_world_builds_a_large_mesh_and_returns_collectives_at_once():
    private("torch.testing._internal.distributed.fake_pg", "FakeStore", FAKE_WORLD)
    fake_world = wrapper_function(FAKE_WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    with blame(FAKE_WORLD), fake_world(93, 128):
        mesh = init_device_mesh("cpu", (2, 8, 8), mesh_dim_names=("pp", "dp", "tp"))
        x = torch.ones(4)
        dist.all_reduce(x, group=mesh["dp"].get_group())
        assert list(mesh.get_coordinate()) == [1, 3, 5] and torch.equal(x, torch.ones(4))
    assert not dist.is_initialized()


def test_memory_peaks_uses_mem_tracker_internals():
    tracker_class = private("torch.distributed._tools.mem_tracker", "MemTracker", MEMORY_PEAKS)
    assert private("torch.distributed._tools.mem_tracker", "_TOTAL_KEY", MEMORY_PEAKS) == "Total"
    for name in ("_update_snap", "_update_peak_stats", "_track_module_params_and_buffers", "_pre_fw_hook",
                 "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook"):
        assert hasattr(tracker_class, name), broken(MEMORY_PEAKS, f"MemTracker.{name} is gone")
    takes(tracker_class._update_snap, ["u_type", "winfo", "old_mem_consumed", "old_reftype"], MEMORY_PEAKS)
    peaks = wrapper_function(MEMORY_PEAKS)()
    for name in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap", "memory_tracking", "_in_opt", "_in_ac", "_ac_mod",
                 "_mod_tracker"):
        assert hasattr(peaks, name), broken(MEMORY_PEAKS, f"MemTracker().{name} is gone")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model(torch.ones(2, 8))  # a module called twice in one step (pipeline micro-batches) must be accepted
    with blame(MEMORY_PEAKS), peaks:
        for _ in range(2):
            model(torch.ones(4, 8)).sum().backward()
    assert peaks.kind_peaks["Activation"] >= 4 * 8 * 4 and peaks.peak_breakdown()["Total"] > 0
    # one step under torch's own MemTracker (which takes one call per module) and under MemoryPeaks: the same peak
    # and the same breakdown at it
    reference, peaks = tracker_class(), wrapper_function(MEMORY_PEAKS)()
    for tracker in (reference, peaks):
        model.zero_grad(set_to_none=True)
        with tracker:
            model(torch.ones(4, 8)).sum().backward()
    mine = peaks.peak_breakdown()
    theirs = {getattr(k, "value", k): v for k, v in reference.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    assert mine == theirs, broken(MEMORY_PEAKS, f"peak breakdown {mine} != MemTracker's {theirs}")
    assert peaks.kind_peaks["Total"] == theirs["Total"], broken(MEMORY_PEAKS, str(dict(peaks.kind_peaks)))


def test_group_of_resolves_process_groups_of_collectives(gloo_world):
    from torch._C import _distributed_c10d as c10d

    for name in ("ProcessGroup", "_resolve_process_group"):
        assert hasattr(c10d, name), broken(GROUP_OF, f"torch._C._distributed_c10d.{name} is gone")
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hybrid.dryrun.accounting import CollectiveCounter, mesh_dimension_groups

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    counter = CollectiveCounter(mesh_dimension_groups(mesh, 1))
    with blame(GROUP_OF), counter:
        dist.all_reduce(torch.ones(3), group=mesh["dp"].get_group())
    assert counter.table() == {"world": {"all_reduce": [1, 12]}}, broken(GROUP_OF, str(counter.table()))


def test_static_stages_use_pipelining_metadata():
    from torch.distributed.pipelining import stage as stage_module

    meta_class = private("torch.distributed.pipelining._utils", "_StageMeta", STATIC_STAGES)
    extract = private("torch.distributed.pipelining._utils", "extract_tensor_metas", STATIC_STAGES)
    takes(meta_class, ["inputs", "outputs", "input_grads", "output_grads"], STATIC_STAGES)
    for name in ("_warmup_forward_vote", "_warmup_backward_result"):
        assert hasattr(stage_module.PipelineStage, name), broken(STATIC_STAGES, f"PipelineStage.{name} is gone")
    with blame(STATIC_STAGES):
        metas = extract((torch.empty(2, 3, device="meta").requires_grad_(True),))
    assert metas[0].shape == (2, 3) and metas[0].requires_grad


# ---------------------------------------------------------------------------------- fsspec checkpoint storage


def test_dcp_fsspec_writer_and_reader_take_a_path_and_storage_options(tmp_path):
    writer = private("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter", FSSPEC_WRITER)
    reader = private("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader", FSSPEC_WRITER)
    takes(writer.__init__, ["path", "kwargs"], FSSPEC_WRITER)
    takes(reader.__init__, ["path", "kwargs"], FSSPEC_WRITER)
    with blame(FSSPEC_WRITER):
        import torch.distributed.checkpoint as dcp

        url = f"file://{tmp_path}/ckpt"
        dcp.save({"w": torch.arange(4.0)}, storage_writer=writer(url, auto_mkdir=True), no_dist=True)
        loaded = {"w": torch.zeros(4)}
        dcp.load(loaded, storage_reader=reader(url, auto_mkdir=True), no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(4.0))


# ---------------------------------------------------------------------------------- the process writer's daemon


def test_the_process_writer_daemon_is_spawned_with_a_static_target_of_two_arguments():
    from lightning_hybrid.checkpoint import staging

    process = private("torch.distributed.checkpoint._async_process_executor", "_AsyncCheckpointProcess",
                      WRITER_DAEMON)
    target = inspect.getattr_static(process, "_checkpointing_subprocess")
    assert isinstance(target, staticmethod), broken(WRITER_DAEMON, "_checkpointing_subprocess is no static method")
    original = staging._TORCH_WRITER_DAEMON.get("target", target.__func__)  # this process may have tied it already
    takes(original, ["pg_init_info", "parent_conn"], WRITER_DAEMON)
    spawned = inspect.getsource(process.__init__)
    assert "target=self._checkpointing_subprocess" in spawned, broken(WRITER_DAEMON, "the daemon's target changed")


# ---------------------------------------------------------------------------------- mixture of experts

def test_the_graph_task_id_tells_a_recompute_inside_backward_from_a_forward():
    private("torch._C", "_current_graph_task_id", RECOMPUTING)
    inside = []
    for dotted in (RECOMPUTING, IN_BACKWARD):
        check = wrapper_function(dotted)
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda grad, check=check: inside.append(check()) or grad)
        with blame(dotted):
            assert check() is False, broken(dotted, "a plain forward counts as inside a backward")
            y.sum().backward()
    assert inside == [True, True], broken(RECOMPUTING, f"inside a backward pass: {inside}")


def test_the_differentiable_all_to_all_takes_split_sizes_and_sends_gradients_back(gloo_world):
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    wrapper_function(ALL_TO_ALL)
    takes(all_to_all_single_autograd, ["output_split_sizes", "input_split_sizes", "group"], ALL_TO_ALL)
    x = torch.arange(3.0, requires_grad=True)
    with blame(ALL_TO_ALL):
        out = all_to_all_single_autograd(x, [3], [3], dist.group.WORLD)
        (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(out.detach(), torch.arange(3.0)) and torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.ops._c10d_functional.all_to_all_single.default is not None


def test_fsdp_divides_a_one_rank_groups_gradients_twice_when_the_sum_is_forced(gloo_world):
    """What ``shard_experts`` works around: with ``set_force_sum_reduction_for_comms`` and a divide factor, FSDP2
    divides a one-rank group's gradients by the factor twice; without the forced sum, once. When this test fails
    torch fixed it: ``shard_experts`` may then force the sum on every group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    wrapper_function(SHARD_EXPERTS)
    grads = {}
    for forced in (True, False):
        module = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.ones_(module.weight)
        with blame(SHARD_EXPERTS):
            unit = fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
            unit.set_gradient_divide_factor(2.0)
            unit.set_force_sum_reduction_for_comms(forced)
            module(torch.ones(1, 2)).sum().backward()
        grads[forced] = module.weight.grad.to_local().flatten().tolist()
    assert grads[False] == [0.5, 0.5], grads
    assert grads[True] == [0.25, 0.25], broken(SHARD_EXPERTS, f"the forced sum now divides once: {grads}")
