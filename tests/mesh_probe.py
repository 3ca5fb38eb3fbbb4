"""A callback that records where each rank sits: its node, its local rank and the members of its TP, DP and PP groups.

Used by ``tests/test_multinode.py`` through the CLI (``--trainer.callbacks+=mesh_probe.MeshProbe``): each rank
prints one ``MESH_PROBE {...}`` line and, when ``MESH_PROBE_DIR`` is set, writes ``rank-N.json`` there.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import lightning.pytorch as pl


class MeshProbe(pl.Callback):
    """Record this rank's node (torchrun's ``GROUP_RANK``) and the global ranks of its mesh groups at fit start."""

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        import torch.distributed as dist

        mesh = trainer.strategy.device_mesh
        record = {
            "rank": dist.get_rank(),
            "node": int(os.environ["GROUP_RANK"]),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
            "lightning_node_rank": trainer.node_rank,
            "host": socket.gethostname(),
            "coordinates": trainer.strategy.dims.coordinates(dist.get_rank()),
            "groups": {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in ("tp", "dp", "pp")},
        }
        print("MESH_PROBE " + json.dumps(record), flush=True)
        out = os.environ.get("MESH_PROBE_DIR")
        if out:
            Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
