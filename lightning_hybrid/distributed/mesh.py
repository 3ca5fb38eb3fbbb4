"""The DeviceMesh ``("pp", "dp", "cp", "tp")`` of a run's sizes (:class:`~.parallel_dims.ParallelDims`), its named
groups and their timeouts, and the gloo groups of checkpoint I/O.

The order of the dimensions, HSDP's split of dp and the flattened names ``"dp_cp"`` and ``"dp_shard_cp"`` are
described in :mod:`lightning_hybrid.distributed.parallel_dims`. A dimension ``cp`` of size 1 is left out of the mesh
(``mesh["cp"]`` then does not exist).
"""

from __future__ import annotations

import contextlib
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Optional

from lightning_hybrid.distributed.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["build_mesh", "lightning_mesh", "data_mesh", "new_gloo_group", "checkpoint_groups", "MESH_DIMS",
           "LIGHTNING_MESH_DIMS"]

# The dimensions every mesh answers to by name (cp only when cp > 1).
MESH_DIMS = ("pp", "dp", "tp")
# The mesh Lightning's ModelParallelStrategy gives a LightningModule.
LIGHTNING_MESH_DIMS = ("data_parallel", "tensor_parallel")


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


def _flatten_groups(mesh: "DeviceMesh", aliases: dict[str, tuple[str, ...]]) -> None:
    """Let ``mesh[alias]`` name the group of the dimensions ``aliases[alias]`` (consecutive, in mesh order) flattened.

    DeviceMesh has no public way to name a group of dimensions or to alias one; ``_flatten`` registers the group under
    a new name. ``tests/test_torch_private_apis.py`` fails when it moves.
    """
    for alias, dims in aliases.items():
        mesh[dims]._flatten(alias)


def _lightning_names(mesh: "DeviceMesh") -> None:
    """Let ``mesh["data_parallel"]`` and ``mesh["tensor_parallel"]`` name the dp and tp dimensions."""
    _flatten_groups(mesh, {"data_parallel": ("dp",), "tensor_parallel": ("tp",)})


def build_mesh(dims: ParallelDims, device_type: str, timeout: Optional[timedelta] = None) -> "DeviceMesh":
    """The DeviceMesh ``("pp", "dp", "tp")`` over the default process group, its groups timing out after ``timeout``;
    ``("pp", "dp", "cp", "tp")`` with cp > 1, and ``"dp"`` split into ``("dp_replicate", "dp_shard")`` under HSDP or
    into ``("edp", "ep")`` with ep > 1 (see :mod:`~.parallel_dims` for the order and the flattened names).

    Without cp and HSDP it also answers to Lightning's ``ModelParallelStrategy`` names: ``mesh["data_parallel"]``
    and ``mesh["tensor_parallel"]`` are the ``dp`` and ``tp`` dimensions, so a ``configure_model`` written for
    that strategy keeps working.
    """
    from torch.distributed.device_mesh import init_device_mesh

    hsdp, experts = dims.dp_replicate > 1, dims.ep > 1
    data = ("dp_replicate", "dp_shard") if hsdp else ("edp", "ep") if experts else ("dp",)
    names = ("pp",) + data + (("cp",) if dims.cp > 1 else ()) + ("tp",)
    sizes = {"pp": dims.pp, "dp": dims.dp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
             "cp": dims.cp, "tp": dims.tp, "edp": dims.edp, "ep": dims.ep}
    with _group_timeout(timeout):
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        cp = ("cp",) if dims.cp > 1 else ()
        aliases = {"dp": data, "dp_shard_cp": ("dp_shard",) + cp} if hsdp else {}
        if experts:
            aliases = {"dp": data, **({"edp_cp": ("edp",) + cp} if cp else {})}
        _flatten_groups(mesh, {**aliases, "dp_cp": data + cp})
        if not hsdp and not experts and dims.cp == 1:
            _lightning_names(mesh)
    return mesh


def data_mesh(mesh: "DeviceMesh", dims: ParallelDims) -> "DeviceMesh":
    """The mesh FSDP2 shards over: ``dp x cp`` flattened (1-D), or ``("dp_replicate", "dp_shard_cp")`` (2-D: replicate
    across groups, shard within) under HSDP."""
    if dims.dp_replicate > 1:
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh["dp_cp"] if dims.cp > 1 else mesh["dp"]


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
