"""Parallel sizes: the tp, pp, dp and cp of a run, checked against the world and the model; pure arithmetic.

The DeviceMesh over these sizes is built by :mod:`lightning_hybrid.distributed.mesh`; this module imports no torch,
so the planner shares its arithmetic (:func:`divisors`, :func:`tied_embedding_error`).

TP is the innermost (fastest varying) dimension, so with ``tp <= devices per node`` the ranks of a
TP group are consecutive global ranks on one node and TP traffic stays on NVLink. Context parallelism (cp)
comes next, inside the node where ``cp * tp`` fits (its K/V exchange is the second heaviest traffic), then DP
and PP outermost: the pipeline's point-to-point traffic is the lightest and may cross nodes. The global rank of
coordinates (pp, dp, cp, tp) is ``((pp * dp_size + dp) * cp_size + cp) * tp_size + tp``.

HSDP (``data_parallel="hsdp"``) splits dp into ``("dp_replicate", "dp_shard")``, shard innermost:
``dp = dp_replicate_index * dp_shard + dp_shard_index``, so a shard group is ``dp_shard * cp * tp`` consecutive
ranks. The mesh then has the dimensions ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` and answers to
``"dp"`` (the two flattened) as well. Every mesh also answers to ``"dp_cp"`` (dp x cp flattened: the ranks that
see different tokens and average their gradients) and, with HSDP, ``"dp_shard_cp"`` (what FSDP shards over).
A dimension ``cp`` of size 1 is left out of the mesh (``mesh["cp"]`` then does not exist).

Expert parallelism (``ep > 1``) is carved from dp: dp splits into ``("edp", "ep")``, ep innermost, so the ranks of
an ep group are consecutive data-parallel ranks (inside a node where ``ep * cp * tp`` fits) and ``dp = edp_index * ep
+ ep_index``. The mesh then has the dimensions ``("pp", "edp", "ep", "cp", "tp")`` and answers to ``"dp"`` (edp and
ep flattened) and ``"dp_cp"`` as before, and to ``"edp_cp"`` (edp x cp: the ranks over which FSDP2 shards the experts
that one ep rank holds; ``"edp"`` without cp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ParallelSizeError", "ParallelDims", "divisors", "format_choices", "tied_embedding_error"]


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def format_choices(values: list[int]) -> str:
    """``"1, 2, 4 or 8"``: the values that would fit, for error messages."""
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


class ParallelSizeError(ValueError, RuntimeError):
    """The parallel sizes do not fit the world size. A ``ValueError`` (a bad argument) that is also the
    ``RuntimeError`` Lightning's ``ModelParallelStrategy`` raises for it, so code catching either keeps working."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the pipeline, data, context and tensor parallel dimensions of a run.

    Args:
        tp: tensor-parallel size (inside a node).
        pp: pipeline-parallel size (number of ranks in a pipeline).
        dp: data-parallel size; ``None`` infers ``world_size // (tp * pp * cp)``.
        world_size: total number of processes.
        devices_per_node: processes per node, to keep a TP group inside a node; ``None`` skips the check.
        cp: context-parallel size (ranks sharing each sequence).
        dp_replicate: HSDP replica groups (``dp // dp_shard``); 1 without HSDP.

    Raises:
        ValueError: a size is not a positive integer or the sizes do not multiply to the world size.
    """

    tp: int
    pp: int
    dp: int
    world_size: int
    cp: int = 1
    dp_replicate: int = 1
    ep: int = 1

    @property
    def dp_shard(self) -> int:
        """Ranks of a data-parallel shard group (HSDP); ``dp`` without HSDP."""
        return self.dp // self.dp_replicate

    @property
    def data_ranks(self) -> int:
        """Ranks that see different tokens of one model replica position and average gradients: ``dp * cp``."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Data-parallel ranks holding the same experts (``dp // ep``): FSDP2 shards them over these (and cp)."""
        return self.dp // self.ep

    @classmethod
    def resolve(cls, tp: int, pp: int, dp: Optional[int], world_size: int,
                devices_per_node: Optional[int] = None, cp: int = 1,
                dp_shard: Optional[int] = None, ep: int = 1) -> "ParallelDims":
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
            raise ValueError(f"dp={dp!r} must be a positive integer or None (inferred from the world size)")
        model_ranks = tp * pp * cp
        names, values = ("cp*tp*pp", f"{cp}*{tp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
        if dp is None:
            if world_size % model_ranks:
                fits = [d for d in divisors(world_size)]
                raise ParallelSizeError(
                    f"world size {world_size} is not divisible by {names}={values}={model_ranks}; "
                    f"{names} must be one of {format_choices(fits)}"
                )
            dp = world_size // model_ranks
        if model_ranks * dp != world_size:
            raise ParallelSizeError(
                f"{names}*dp={values}*{dp}={model_ranks * dp} does not equal the world size {world_size} "
                f"(the sizes multiplied should equal the world size); "
                f"set dp=None to infer it or change the number of devices"
            )
        replicate = _replicas(dp, dp_shard)
        if devices_per_node is not None and tp > devices_per_node and tp % devices_per_node:
            raise ParallelSizeError(
                f"tp={tp} spans nodes unevenly with {devices_per_node} devices per node; use a tp that divides "
                f"{devices_per_node} ({format_choices(divisors(devices_per_node))})"
            )
        if dp % ep:
            raise ParallelSizeError(f"ep={ep} does not divide dp={dp} (expert parallelism is carved from the "
                                    f"data-parallel ranks); use ep in {format_choices(divisors(dp))}")
        return cls(tp=tp, pp=pp, dp=dp, world_size=world_size, cp=cp, dp_replicate=replicate, ep=ep)

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
        """(pp, dp, tp) coordinates of a global rank in the mesh; also ``cp`` when cp > 1, ``dp_replicate``
        and ``dp_shard`` under HSDP, and ``ep`` and ``edp`` when ep > 1."""
        tp, cp, dp = self.tp, self.cp, self.dp
        coords = {"pp": global_rank // (dp * cp * tp), "dp": (global_rank // (cp * tp)) % dp, "tp": global_rank % tp}
        if cp > 1:
            coords["cp"] = (global_rank // tp) % cp
        if self.dp_replicate > 1:
            coords["dp_replicate"], coords["dp_shard"] = divmod(coords["dp"], self.dp_shard)
        if self.ep > 1:
            coords["edp"], coords["ep"] = divmod(coords["dp"], self.ep)
        return coords


def _replicas(dp: int, dp_shard: Optional[int]) -> int:
    """HSDP's replica count ``dp // dp_shard`` (1 without HSDP: ``dp_shard=None``).

    Raises:
        ValueError: ``dp_shard`` is not a positive divisor of ``dp``.
    """
    if dp_shard is None:
        return 1
    if not isinstance(dp_shard, int) or isinstance(dp_shard, bool) or dp_shard < 1 or dp % dp_shard:
        raise ValueError(f"dp_shard={dp_shard!r} does not divide dp={dp}; use one of {format_choices(divisors(dp))}")
    return dp // dp_shard


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
