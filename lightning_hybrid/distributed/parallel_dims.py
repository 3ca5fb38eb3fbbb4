"""Parallel sizes: validation and the 3-D DeviceMesh ``("pp", "dp", "tp")``.

TP is the innermost (fastest varying) dimension, so with ``tp <= devices per node`` the ranks of a
TP group are consecutive global ranks on one node and TP traffic stays on NVLink. DP comes next
and PP outermost: the pipeline's point-to-point traffic is the lightest and may cross nodes.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "divisors", "format_choices", "build_mesh", "lightning_mesh", "new_gloo_group",
           "tied_embedding_error", "MESH_DIMS", "LIGHTNING_MESH_DIMS"]

MESH_DIMS = ("pp", "dp", "tp")
# The mesh Lightning's ModelParallelStrategy gives a LightningModule.
LIGHTNING_MESH_DIMS = ("data_parallel", "tensor_parallel")


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def format_choices(values: list[int]) -> str:
    """``"1, 2, 4 or 8"``: the values that would fit, for error messages."""
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the pipeline, data and tensor parallel dimensions of a run.

    Args:
        tp: tensor-parallel size (inside a node).
        pp: pipeline-parallel size (number of ranks in a pipeline).
        dp: data-parallel size; ``None`` infers ``world_size // (tp * pp)``.
        world_size: total number of processes.
        devices_per_node: processes per node, to keep a TP group inside a node; ``None`` skips the check.

    Raises:
        ValueError: a size is not a positive integer or the sizes do not multiply to the world size.
    """

    tp: int
    pp: int
    dp: int
    world_size: int

    @classmethod
    def resolve(cls, tp: int, pp: int, dp: Optional[int], world_size: int,
                devices_per_node: Optional[int] = None) -> "ParallelDims":
        for name, value in (("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
            raise ValueError(f"dp={dp!r} must be a positive integer or None (inferred from the world size)")
        if dp is None:
            if world_size % (tp * pp):
                fits = [d for d in divisors(world_size)]
                raise ValueError(
                    f"world size {world_size} is not divisible by tp*pp={tp}*{pp}={tp * pp}; "
                    f"tp*pp must be one of {format_choices(fits)}"
                )
            dp = world_size // (tp * pp)
        if tp * pp * dp != world_size:
            raise ValueError(
                f"tp*pp*dp={tp}*{pp}*{dp}={tp * pp * dp} does not equal the world size {world_size}; "
                f"set dp=None to infer it or change the number of devices"
            )
        if devices_per_node is not None and tp > devices_per_node and tp % devices_per_node:
            raise ValueError(
                f"tp={tp} spans nodes unevenly with {devices_per_node} devices per node; use a tp that divides "
                f"{devices_per_node} ({format_choices(divisors(devices_per_node))})"
            )
        return cls(tp=tp, pp=pp, dp=dp, world_size=world_size)

    def check_model(self, tp_divisible: dict[str, int], num_blocks: int, stages_per_rank: int = 1) -> None:
        """Check that the model divides over this mesh.

        Raises:
            ValueError: tp does not divide a head count, or there are fewer blocks than pipeline stages.
        """
        for field, value in tp_divisible.items():
            if value % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not divide {field}={value}; use tp in {format_choices(divisors(value))}"
                )
        stages = self.pp * stages_per_rank
        if stages > 1 and num_blocks < stages:
            raise ValueError(
                f"pp={self.pp} x virtual_stages={stages_per_rank} = {stages} pipeline stages but the model has only "
                f"{num_blocks} blocks; use at most {num_blocks} stages"
            )

    def coordinates(self, global_rank: int) -> dict[str, int]:
        """(pp, dp, tp) coordinates of a global rank in the mesh."""
        return {"pp": global_rank // (self.dp * self.tp), "dp": (global_rank // self.tp) % self.dp,
                "tp": global_rank % self.tp}


def tied_embedding_error(tied: bool, tp: int, stages: int) -> str:
    """Why a model that ties its embedding to its head cannot run with this tp and number of pipeline stages
    ('' when it can).

    A vocabulary-sharded (tp>1) embedding and head cannot share one weight, and with pp>1 the first and
    last stage would both hold it.
    """
    if not tied:
        return ""
    if tp > 1:
        return f"tie_word_embeddings=True is not supported with tp={tp}; untie the embeddings or use tp=1"
    if stages > 1:
        return (f"tie_word_embeddings=True is not supported with {stages} pipeline stages (the first and last "
                f"stage would share a weight); untie the embeddings or use pp=1")
    return ""


@contextlib.contextmanager
def _group_timeout(timeout: Optional[timedelta]) -> Iterator[None]:
    """Create process groups with ``timeout`` instead of c10d's default (30 min).

    DeviceMesh creates its groups with c10d's module-level default timeout, not the one the default group was
    created with, and takes no timeout argument; a hung peer must end the others after the strategy's timeout.
    This sets c10d's private defaults for the duration; ``tests/test_torch_private_apis.py`` fails when they move.
    """
    import torch.distributed.distributed_c10d as c10d

    if timeout is None:
        yield
        return
    saved = c10d.default_pg_timeout, c10d.default_pg_nccl_timeout
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    try:
        yield
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved


def new_gloo_group(timeout: Optional[timedelta]) -> Any:
    """A new gloo group over the whole world (checkpoint and control traffic, apart from training collectives)."""
    import torch.distributed as dist

    # The dry run's fake backend (lightning_hybrid.dryrun) has no gloo to open: its groups are fake ones too.
    return dist.new_group(backend=None if dist.get_backend() == "fake" else "gloo", timeout=timeout)


def checkpoint_groups(timeout: Optional[timedelta]) -> tuple[Any, Any]:
    """Two new gloo groups over the world: checkpoint collectives of the main thread, and of the background writer.

    Checkpoint collectives may run while a background write is in flight and must never queue behind (or ahead of)
    training collectives. The background writer (DCP's async save, in another thread) gets a group of its own: two
    threads issuing collectives on one group can match them across ranks in different orders and hang (the main
    thread meets on the first group at every step).
    """
    return new_gloo_group(timeout), new_gloo_group(timeout)


def _lightning_names(mesh: "DeviceMesh") -> None:
    """Let ``mesh["data_parallel"]`` and ``mesh["tensor_parallel"]`` name the dp and tp dimensions.

    DeviceMesh has no public way to alias a dimension; ``_flatten`` of a single dimension registers it under a
    new name. ``tests/test_torch_private_apis.py`` fails when it moves.
    """
    mesh["dp"]._flatten("data_parallel")
    mesh["tp"]._flatten("tensor_parallel")


def build_mesh(dims: ParallelDims, device_type: str, timeout: Optional[timedelta] = None) -> "DeviceMesh":
    """The DeviceMesh ``("pp", "dp", "tp")`` over the default process group, its groups timing out after ``timeout``.

    It also answers to Lightning's ``ModelParallelStrategy`` names: ``mesh["data_parallel"]`` and
    ``mesh["tensor_parallel"]`` are the ``dp`` and ``tp`` dimensions, so a ``configure_model`` written for
    that strategy keeps working.
    """
    from torch.distributed.device_mesh import init_device_mesh

    with _group_timeout(timeout):
        mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=MESH_DIMS)
        _lightning_names(mesh)
    return mesh


def lightning_mesh(mesh: "DeviceMesh", dims: ParallelDims, device_type: str,
                   timeout: Optional[timedelta] = None) -> "DeviceMesh":
    """The 2-D mesh ``("data_parallel", "tensor_parallel")`` of shape ``(dp, tp)`` that Lightning's
    ``ModelParallelStrategy`` gives a LightningModule, for ``pp=1``.

    Code written for that strategy may read it by position (``dp, tp = self.device_mesh.shape``); the 3-D mesh
    ``("pp", "dp", "tp")`` of :func:`build_mesh` would give it ``pp`` first. The 2-D mesh is ``mesh`` sliced by the
    names :func:`build_mesh` registered, so it uses the very process groups of its ``dp`` and ``tp`` dimensions.
    Where DeviceMesh no longer allows that slice (torch announces its deprecation), it is a new mesh over the
    same ranks in the same order (the same groups, created again, timing out after ``timeout``).

    Raises:
        ValueError: ``dims.pp > 1`` (a pipeline has no 2-D mesh).
    """
    if dims.pp != 1:
        raise ValueError(f"the 2-D mesh {LIGHTNING_MESH_DIMS} exists only with pp=1, not pp={dims.pp}")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return mesh[LIGHTNING_MESH_DIMS]
    except (KeyError, RuntimeError):
        from torch.distributed.device_mesh import init_device_mesh

        with _group_timeout(timeout):
            return init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=LIGHTNING_MESH_DIMS)
