"""Per-step fault tolerance with torchft replica groups (``HybridParallelStrategy(fault_tolerance="torchft")``).

The job is ``N`` replica groups, each its own torchrun launch with its own ``tp x pp x dp`` mesh (FSDP2 inside the
group). Every step, torchft's :class:`~torchft.Manager` forms a quorum of the live groups through a lighthouse;
gradients are averaged across the groups of the quorum with the manager's fault-tolerant all-reduce, and the
optimizer steps only where :meth:`~torchft.Manager.should_commit` says so. A group that dies drops out of the next
quorum and the others go on without stopping; a group that comes back (torchrun ``--max-restarts`` or the
scheduler) heals from a live peer -- weights, optimizer state, LR schedule, loop counters and data position -- and
rejoins.

What crosses the groups:

- *Gradients*: one flat all-reduce (average over the groups of the quorum) of each rank's local gradient shards,
  between the backward and gradient clipping. Group rank ``r`` of every group holds the same shard, so the
  reduction pairs equal shards.
- *The loss's token count*: inside a training step, :meth:`ReplicaGroups.average` averages what the strategy's
  ``reduce`` (and the pipeline's label count) summed within the group. The data sampler counts all ``N * dp`` data
  ranks, so the loss is the token mean over the samples of the groups actually in the step: a group that was down
  contributes neither tokens nor gradient (its share of those global batches is skipped, not redistributed).
- *Healing*: the peer's state goes over torchft's HTTP checkpoint transport, read back with ``weights_only=True``
  (tensors, numbers and strings only: a peer can never make this process run pickled code).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch import nn

    from lightning_hybrid.distributed.host import StrategyHost

__all__ = ["FAULT_TOLERANCE", "ENV_GROUP", "ENV_GROUPS", "ENV_LIGHTHOUSE", "ReplicaGroupEnv", "ReplicaGroups",
           "check_fault_tolerance", "require_torchft", "data_share", "join_replica_groups", "JoinedGroups"]

FAULT_TOLERANCE = ("torchft",)
ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE = "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
EXTRA = "pip install 'lightning-hybrid[ft]'"


@dataclass(frozen=True)
class ReplicaGroupEnv:
    """This process's replica group, as torchft's launchers describe it in the environment."""

    group_id: int
    num_groups: int
    lighthouse: str
    min_replica_groups: int


def require_torchft() -> None:
    """Raise ``ImportError`` in one line naming the extra when torchft is not installed."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ImportError(f"fault_tolerance='torchft' needs the torchft package: {EXTRA}") from None


def _env_int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; torchft's launchers set it to the replica "
                         f"group's number") from None


def check_fault_tolerance(fault_tolerance: Optional[str], min_replica_groups: int, timeout: float = 60.0,
                          environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[ReplicaGroupEnv], float]:
    """Validate the options and read the replica group from the environment (on construction, on every rank).

    Returns:
        (``None`` without fault tolerance, else this process's :class:`ReplicaGroupEnv`; the cross-group timeout).

    Raises:
        ValueError: an unknown ``fault_tolerance``, a missing or inconsistent environment variable,
            ``min_replica_groups`` outside ``1..NUM_REPLICA_GROUPS``, or a timeout that is not a positive number.
        ImportError: torchft is not installed (naming the extra).
    """
    if isinstance(min_replica_groups, bool) or not isinstance(min_replica_groups, int) or min_replica_groups < 1:
        raise ValueError(f"min_replica_groups={min_replica_groups!r} must be a positive integer")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"ft_timeout={timeout!r} must be a positive number of seconds")
    if fault_tolerance is None:
        return None, float(timeout)
    if fault_tolerance not in FAULT_TOLERANCE:
        raise ValueError(f"fault_tolerance={fault_tolerance!r} is not known; use None or 'torchft'")
    require_torchft()
    environ = os.environ if environ is None else environ
    missing = [name for name in (ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE) if not environ.get(name)]
    if missing:
        raise ValueError(f"fault_tolerance='torchft' needs {', '.join(missing)} in the environment (each replica "
                         f"group is its own launch: REPLICA_GROUP_ID=0..N-1, NUM_REPLICA_GROUPS=N, "
                         f"TORCHFT_LIGHTHOUSE=http://HOST:PORT of `lightning-hybrid lighthouse`)")
    group, groups = _env_int(environ, ENV_GROUP), _env_int(environ, ENV_GROUPS)
    if groups < 1 or not 0 <= group < groups:
        raise ValueError(f"{ENV_GROUP}={group} with {ENV_GROUPS}={groups}: the group id must be in 0..{groups - 1}")
    if min_replica_groups > groups:
        raise ValueError(f"min_replica_groups={min_replica_groups} is larger than {ENV_GROUPS}={groups}; "
                         f"use 1..{groups}")
    return ReplicaGroupEnv(group, groups, environ[ENV_LIGHTHOUSE], min_replica_groups), float(timeout)


def _weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading what a peer sends with ``weights_only=True``."""
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def _round_store(group_rank: int) -> tuple[Any, str, int]:
    """A key-value store new to this launch round, hosted by the group's rank 0 (address broadcast to the group).

    torchft's manager publishes its address under fixed keys; torchrun's own store outlives a restart of the workers,
    so a restarted group would read the dead round's address there and fail to connect.
    """
    import socket

    import torch.distributed as dist
    from torch.distributed import TCPStore

    store = None
    where: list[Any] = [None]
    if group_rank == 0:
        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        where = [(socket.gethostname(), store.port)]
    dist.broadcast_object_list(where, src=0)
    host, port = where[0]
    return store, host, port


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class ReplicaGroups:
    """One rank's member of the torchft quorum: quorum per step, gradient averaging, commit, and healing.

    Args:
        env: the replica group (from :func:`check_fault_tolerance`).
        group_rank: this process's rank inside its replica group; ``group_world_size`` the group's size.
        backend: the process-group backend (``"gloo"`` or ``"nccl"``) for the cross-group all-reduce.
        timeout: how long a quorum may wait for its members.
        state: returns this rank's state for a healing peer (tensors, numbers and strings only).
        load: applies a peer's state on this rank.
    """

    def __init__(self, env: ReplicaGroupEnv, group_rank: int, group_world_size: int, backend: str,
                 timeout: timedelta, state: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any]], None], collective_timeout: float = 60.0) -> None:
        """``collective_timeout``: seconds for a cross-group all-reduce, the commit and the healing transfer."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.env = env
        short = timedelta(seconds=collective_timeout)
        self._store, store_addr, store_port = _round_store(group_rank)
        pg = ProcessGroupNCCL(timeout=short) if backend == "nccl" else ProcessGroupGloo(timeout=short)
        self._load = load
        self.healed_at: Optional[int] = None  # the peer's committed step count when this rank healed
        self.manager = Manager(
            pg=pg, load_state_dict=self._apply, state_dict=state, min_replica_size=env.min_replica_groups,
            use_async_quorum=False,  # heal before the step, so the rejoining group takes part in it
            timeout=short, quorum_timeout=timeout, connect_timeout=short, rank=group_rank,
            world_size=group_world_size, lighthouse_addr=env.lighthouse, store_addr=store_addr, store_port=store_port,
            replica_id=f"replica_group_{env.group_id}", checkpoint_transport=_weights_only_transport(short))
        self.in_step = False  # a quorum is open (from the step's start to its commit)
        self.collecting = False  # inside the training step: the loss's sums are averaged over the groups
        self.history: list[dict[str, Any]] = []  # per step: participants and whether it was committed

    def _apply(self, state: dict[str, Any]) -> None:
        self.healed_at = self.manager.current_step()
        self._load(state)

    def start_step(self) -> None:
        """Join this step's quorum (once per step; a rank that is behind heals here, before the step)."""
        if not self.in_step:
            self.manager.start_quorum()
            self.in_step = True

    def begin_batch(self) -> None:
        """A training batch starts: join its quorum (once) and average the group's reduced sums until the backward."""
        self.start_step()
        self.collecting = True

    def average_in_step(self, value: Any) -> Any:
        """What the strategy reduced over this group, averaged over the groups of the quorum inside a training step
        (outside one -- validation, sanity checks, data setup -- unchanged: no quorum is open for every group there).
        """
        if not self.collecting or not isinstance(value, Tensor):
            return value
        return self.average(value.clone())

    def committing(self, closure: Callable[[], Any], module: Any, guard: Any) -> Callable[[], Any]:
        """Lightning's closure (forward and backward), then the gradients averaged over the groups and torchft's
        verdict: a discarded step is skipped through the strategy's step ``guard`` (weights and optimizer stay)."""
        guard.active = True

        def committed() -> Any:
            result = closure()
            self.collecting = False
            self.average_gradients(list(module.model.parameters()))
            if not self.commit(module.trainer.global_step + 1):
                guard.skip_next()
            return result

        return committed

    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def average(self, tensor: Tensor) -> Tensor:
        """``tensor`` averaged over the replica groups of this step's quorum (in place; no-op outside a step)."""
        if self.in_step:
            self.manager.allreduce(tensor).wait()
        return tensor

    def average_gradients(self, params: "list[nn.Parameter]") -> None:
        """Average the local gradient shards over the groups of the quorum, one flat all-reduce per dtype; a
        parameter without a gradient in this group takes part as zeros (:func:`~.data_parallel.reduce_gradients`)."""
        from lightning_hybrid.distributed.data_parallel import reduce_gradients

        reduce_gradients(params, self.average, bucket_bytes=None)

    def commit(self, step: int) -> bool:
        """torchft's verdict for this step (``False``: discard it, same on every rank of this group)."""
        participants = self.participants()
        committed = self.manager.should_commit()
        self.in_step = False
        self.history.append({"step": step, "participants": participants, "committed": bool(committed),
                             "healed_at": self.healed_at})
        self.healed_at = None
        return committed

    def shutdown(self) -> list[dict[str, Any]]:
        """Stop torchft's manager (its server and transport); returns the per-step history."""
        self.manager.shutdown(wait=False)
        return self.history


def local_state(model: "nn.Module", optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's shards of the weights and optimizer state, keyed by parameter name (same layout on a peer)."""
    names = {param: name for name, param in model.named_parameters()}
    state: dict[str, Any] = {"model": {name: _local(p).detach() for p, name in names.items()}, "optimizers": [],
                             "param_groups": []}
    for optimizer in optimizers:
        # The hyper-parameters too: an LR schedule writes the learning rate into the groups at its step, and a
        # loaded scheduler does not rewrite them until its next step.
        state["param_groups"].append([{k: v for k, v in group.items() if k != "params"}
                                      for group in optimizer.param_groups])
        entries = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                entries[names[param]] = {k: _local(v).detach() if isinstance(v, Tensor) else v
                                         for k, v in optimizer.state.get(param, {}).items()}
        state["optimizers"].append(entries)
    return state


def load_local_state(model: "nn.Module", optimizers: list[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Copy a peer's :func:`local_state` into this rank's weights and optimizer state.

    Raises:
        ValueError: the peer's parameters differ from this rank's (another model or layout).
    """
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    if set(params) != set(state["model"]):
        raise ValueError("the healing peer holds other parameters than this rank (another model or layout)")
    with torch.no_grad():
        for name, param in params.items():
            _local(param).copy_(state["model"][name])
        for optimizer, groups in zip(optimizers, state["param_groups"]):
            for group, values in zip(optimizer.param_groups, groups):
                group.update(values)
        for optimizer, entries in zip(optimizers, state["optimizers"]):
            for name, values in entries.items():
                param = params[name]
                target = optimizer.state[param]
                for key, value in values.items():
                    if isinstance(value, Tensor) and isinstance(param, DTensor) and value.dim() > 0:
                        value = DTensor.from_local(value.clone(), param.device_mesh, param.placements,
                                                   shape=param.shape, stride=param.stride())
                    elif isinstance(value, Tensor):
                        value = value.clone()
                    target[key] = value


def trainer_state_for_peer(trainer: Any, data_position: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Lightning's state a healing peer needs, as a checkpoint would hold it (loops, callbacks, LR schedules, the
    data position); read between steps, so the loops' counters are those of the last finished batch."""
    import lightning.pytorch as pl
    from lightning.pytorch.trainer import call

    return {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "loops": {"fit_loop": trainer.fit_loop.state_dict()},
            "callbacks": call._call_callbacks_state_dict(trainer),
            "optimizer_states": [{} for _ in trainer.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "hybrid": {"data_position": data_position}}


def heal_trainer_state(trainer: Any, state: dict[str, Any], before_fit: bool) -> Optional[dict[str, Any]]:
    """Apply a peer's :func:`trainer_state_for_peer`.

    Before the fit loop runs (a group that restarted), Lightning restores it like a checkpoint (loops, callbacks and
    schedules) and the data position is returned for the sampler. During training (a group whose step was discarded
    while a peer's was committed) only the LR schedules change: loops and data already move in step.
    """
    if before_fit:
        trainer._checkpoint_connector._loaded_checkpoint = state
        return (state.get("hybrid") or {}).get("data_position")
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
        config.scheduler.load_state_dict(scheduler_state)
    return None


def data_share(env: Optional[ReplicaGroupEnv], dp: int, dp_rank: int) -> dict[str, int]:
    """The sampler's ``num_replicas`` and ``rank``: with replica groups, every group reads its own share of each global
    batch (group ``g``'s data ranks follow those of groups ``0..g-1``)."""
    if env is None:
        return {"num_replicas": dp, "rank": dp_rank}
    return {"num_replicas": env.num_groups * dp, "rank": env.group_id * dp + dp_rank}


@dataclass
class JoinedGroups:
    """What joining decided: the groups, whether this group healed from a live peer (a restarted one: its
    checkpoint callback then does not auto-resume from disk) and the data position the peer gave the sampler."""

    groups: ReplicaGroups
    healed_from_peer: bool = False
    resume_position: Optional[dict[str, int]] = None


def join_replica_groups(member: "StrategyHost", trainer: Any, backend: str, timeout: Optional[timedelta],
                        pipeline: Optional[Any] = None) -> JoinedGroups:
    """Start torchft's manager for ``member``'s rank and join the first quorum; a group that is behind a live peer
    (a restarted one) heals here, before the fit loop: weights and optimizer at once, Lightning's loops, callbacks
    and LR schedules restored like a checkpoint, the data position returned for the sampler.

    Args:
        member: the strategy (read only).
        backend, timeout: the process group's backend and timeout, for the groups' own.
        pipeline: the strategy's pipeline runner, if any: its label count and loss sums are then averaged over the
            groups of each step, like the strategy's ``reduce``.
    """
    joining = [True]

    def state() -> dict[str, Any]:
        return {**local_state(member.lightning_module.model, list(member.optimizers)),
                "trainer": trainer_state_for_peer(trainer, member.checkpoint_context().data_position)}

    def load(peer: dict[str, Any]) -> None:
        load_local_state(member.lightning_module.model, list(member.optimizers), peer)
        position = heal_trainer_state(trainer, peer["trainer"], before_fit=joining[0])
        if joining[0]:
            joined.healed_from_peer, joined.resume_position = True, position

    assert member.replica_group_env is not None, "join_replica_groups is only asked with fault_tolerance='torchft'"
    groups = ReplicaGroups(member.replica_group_env, member.global_rank, member.world_size, backend, timeout, state,
                           load, collective_timeout=member.ft_timeout)
    joined = JoinedGroups(groups)
    if pipeline is not None:
        pipeline.cross_group = groups.average_in_step
    groups.start_step()  # the first step's quorum
    joining[0] = False
    return joined
