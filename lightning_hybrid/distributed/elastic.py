"""The default process group of a torchrun restart round, on keys no earlier round wrote.

Why this exists (the restarted-round failure): under torchrun with the agent's store
(``TORCHELASTIC_USE_AGENT_STORE=True``: the static rendezvous of ``--master-addr/--master-port``, and the c10d
rendezvous unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), the TCPStore the workers meet on is created once by the
agent and kept for every round (``StaticTCPRendezvous.next_rendezvous`` creates it only ``if not self._store``;
the c10d rendezvous keeps its ``_shared_tcp_store_server``). torch's ``env://`` handler connects to it without a
per-round prefix (its comment assumes "a new TCPStore for every retry"), and ``init_process_group`` uses the fixed
prefix ``default_pg``. Every key of round 0 therefore survives into round 1 under the same name: the gloo
rendezvous of the default group (and of every later group, DeviceMesh's and the checkpoint groups alike) finds the
dead round's ``rank_N`` addresses already set, connects to closed ports and fails with ``connectFullMesh ...
Connection refused``. Here the default group is initialized on a store prefixed by the run id and the restart count,
which every worker of one round shares and no other round has; all later groups derive their keys from it.

With a per-round store (``TORCHELASTIC_USE_AGENT_STORE=False``: worker rank 0 hosts a fresh store on a new port each
round) nothing is done: there are no stale keys.

The restart count names a round only when every agent counts the same rounds: one agent (any rendezvous), or the
static rendezvous (its membership never changes). With the c10d rendezvous and several nodes, an agent whose workers
were still healthy restarts them for a membership change (a node failed or joins) without counting a restart, so two
nodes can start one round with different counts, and their workers would not meet (seen in the 2 x 2 tests: 45 s
lost until a second restart). There the launchers set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per
round); without it, :func:`init_round_process_group` warns.
"""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta
from typing import Any, Optional

__all__ = ["round_store_prefix", "init_round_process_group", "SHARED_STORE_WARNING", "global_batch_error",
           "report_global_batch", "peer_failure"]

log = logging.getLogger(__name__)

SHARED_STORE_WARNING = (
    "several torchrun agents share one store across restarts: with --rdzv-backend c10d, export "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (a fresh store each round, as the recipes' launchers do), "
    "or a restart after a membership change can hang until the rendezvous times out; the static rendezvous is fine")


def round_store_prefix(environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """The store prefix of this torchrun round (``None`` when not launched by torchrun with the agent's store)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    return f"lightning_hybrid/{run_id}/restart-{int(env.get('TORCHELASTIC_RESTART_COUNT', '0'))}/"


def init_round_process_group(backend: str, timeout: Optional[timedelta], device: Any) -> bool:
    """Initialize the default process group on this round's keys of torchrun's store; ``False`` when not needed.

    Does nothing (returns ``False``) when the group exists or the workers were not started by torchrun with the
    agent's store; Lightning then initializes the group as usual. Rank and world size are torchrun's
    (``RANK``, ``WORLD_SIZE``), as Lightning's ``TorchElasticEnvironment`` reads them.
    """
    import torch.distributed as dist

    prefix = round_store_prefix()
    if prefix is None or dist.is_initialized():
        return False
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and os.environ.get("RANK") == "0":
        warnings.warn(SHARED_STORE_WARNING, stacklevel=2)
    world = int(os.environ["WORLD_SIZE"])
    wait = timeout if timeout is not None else timedelta(minutes=30)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=wait)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=int(os.environ["RANK"]),
                            world_size=world, timeout=timeout, device_id=device if device.type != "cpu" else None)
    return True


def global_batch_error(saved: Optional[int], per_rank: Optional[int], dp: int) -> Optional[str]:
    """Why a resumed run's samples per step differ from the checkpoint's (``None`` when they agree or are unknown).

    After a node is lost, dp is smaller; a DataLoader whose per-rank ``batch_size`` stayed the same then trains with a
    smaller global batch (another learning-rate-to-batch ratio, another data order from here on).
    """
    if saved is None or per_rank is None or per_rank * dp == saved:
        return None
    fits = f"batch_size={saved // dp} per rank" if saved % dp == 0 else f"a dp that divides {saved}"
    accumulate = saved // (per_rank * dp) if saved % (per_rank * dp) == 0 else None
    other = f" or Trainer(accumulate_grad_batches={accumulate}) to make up the difference" if accumulate else ""
    return (f"global batch changed on resume: the checkpoint was trained with {saved} samples per step, this run has "
            f"batch_size={per_rank} x dp={dp} = {per_rank * dp}; use {fits} to keep it{other}")


def report_global_batch(saved: Optional[int], per_rank: Optional[int], dp: int, dp_rank: int) -> None:
    """Log :func:`global_batch_error` as an error once (dp rank 0); training goes on with the batch it was given."""
    message = global_batch_error(saved, per_rank, dp)
    if message is not None and dp_rank == 0:
        log.error(message)


# What gloo's TCP transport raises (a plain RuntimeError, from gloo/transport/tcp/pair.cc) when the process at the
# other end of a pair is gone: read or write on the closed socket.
_GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_failure(exception: Optional[BaseException]) -> Optional[str]:
    """The first line of the error in ``exception``'s chain (``__cause__``, ``__context__``) that says the process
    group is broken, or ``None``: a ``torch.distributed.DistError`` (NCCL's errors are ``DistBackendError``, store and
    network ones ``DistStoreError``/``DistNetworkError``) or gloo's error for a peer process that is gone.

    After such an error no collective of the group can complete, so nothing that needs all ranks (a checkpoint save)
    is worth trying: it would wait out a timeout while torchrun is already restarting the job.
    """
    import torch.distributed as dist

    seen: set[int] = set()
    while exception is not None and id(exception) not in seen:
        seen.add(id(exception))
        text = str(exception).strip()
        gloo = "gloo" in text and any(mark in text for mark in _GLOO_PEER_GONE)  # not a data loader's own socket
        if isinstance(exception, dist.DistError) or gloo:
            return text.splitlines()[0] if text else type(exception).__name__
        exception = exception.__cause__ or exception.__context__
    return None
