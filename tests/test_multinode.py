"""Multi-node without a cluster: the tiny recipe as 2 "nodes" x 2 processes, joined by torchrun's c10d rendezvous.

Two torchrun agents start together on this machine, each with ``--nnodes 2 --nproc_per_node 2`` and its own
``--node_rank``, meeting at ``127.0.0.1:PORT`` exactly as two hosts of a cluster would (the same arguments as
``recipes/torchrun-multinode.sh``). A small callback (``tests/mesh_probe.py``) records on every rank the node it runs
on (torchrun's ``GROUP_RANK``) and the members of its TP, DP and PP groups; the test checks that every TP group lies
inside one node and that the data-parallel group is the one that crosses nodes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import free_port, kill_process_group, worker_env

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
NODES, PER_NODE = 2, 2


def agent_command(node_rank: int, port: int, run_id: str) -> list[str]:
    """torchrun for one "node": c10d rendezvous on 127.0.0.1, node 0 hosting the store, then the tiny recipe."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc_per_node", str(PER_NODE),
            "--node_rank", str(node_rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
            "--rdzv_id", run_id, "--rdzv_conf", f"is_host={1 if node_rank == 0 else 0}", "--max-restarts", "0",
            "-m", "lightning_hybrid.cli", "fit", "--config", str(TINY),
            "--trainer.num_nodes", str(NODES), "--trainer.devices", str(PER_NODE),
            "--trainer.callbacks+=mesh_probe.MeshProbe",
            "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--data.init_args.max_bytes", "400000"]


def run_two_nodes(tmp_path: Path, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Start both agents at once and wait for both; a hang fails after ``timeout`` s and leaves nothing running."""
    env = worker_env({"MESH_PROBE_DIR": str(tmp_path)})  # the tests folder on PYTHONPATH: mesh_probe.MeshProbe
    port, run_id = free_port(), f"multinode-{os.getpid()}"
    agents = [subprocess.Popen(agent_command(rank, port, run_id), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for rank in range(NODES)]
    results = []
    try:
        for rank, agent in enumerate(agents):
            out, _ = agent.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, ""))
    except subprocess.TimeoutExpired:
        for agent in agents:  # torchrun and its workers share the session started for them
            if agent.poll() is None:
                kill_process_group(agent)
        raise AssertionError(f"the two torchrun agents did not finish within {timeout} s")
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"node {rank} failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tiny_recipe_on_two_nodes_of_two_processes_keeps_every_tp_group_inside_a_node(tmp_path):
    results = run_two_nodes(tmp_path)
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in records) == list(range(NODES * PER_NODE))
    node_of = {r["rank"]: r["node"] for r in records}
    assert sorted(set(node_of.values())) == list(range(NODES))
    for r in records:
        assert r["local_world_size"] == PER_NODE
        assert r["lightning_node_rank"] == r["node"]  # Lightning reads the node from torchrun's GROUP_RANK
        # ranks of an agent are consecutive: node = rank // processes per node
        assert r["node"] == r["rank"] // PER_NODE and r["local_rank"] == r["rank"] % PER_NODE
        tp_nodes = {node_of[m] for m in r["groups"]["tp"]}
        assert len(r["groups"]["tp"]) == 2 and tp_nodes == {r["node"]}, (
            f"rank {r['rank']} on node {r['node']}: its TP group {r['groups']['tp']} spans nodes {tp_nodes}")
        dp_nodes = {node_of[m] for m in r["groups"]["dp"]}
        assert len(r["groups"]["dp"]) == 2 and dp_nodes == set(range(NODES))  # DP is the dimension across nodes
    tp_groups = {tuple(r["groups"]["tp"]) for r in records}
    assert tp_groups == {(0, 1), (2, 3)}
    # training ran on the 4 ranks: rank 0 (on node 0) prints the throughput summary at the end
    assert re.search(r"throughput: [\d,]+ tokens/s", results[0].stdout), results[0].stdout[-3000:]
