"""Checkpoints on an S3 endpoint (moto's standalone server, a real HTTP subprocess on 127.0.0.1) on tp=2 x pp=2.

Commit without rename: a ``step-N/`` prefix counts once its manifest object exists. The workers reach the bucket
with the environment's credentials and endpoint (``AWS_ENDPOINT_URL``), as a cluster job would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.compare import same_tensors
from helpers.launch import TESTS, free_port, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

BUCKET = "ckpt"


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """``python -m moto.server`` on a free port; yields the environment that points boto/s3fs at it."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start on port {port}")
            time.sleep(0.2)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fs = _fs()
    fs.mkdir(BUCKET)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _fs():
    import fsspec

    return fsspec.filesystem("s3", use_listings_cache=False, skip_instance_cache=True)


def _run(out: Path, url: str, check: bool = True, **env) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    variables = {"OUT": str(out), "CKPT": url, **{k: str(v) for k, v in env.items()}}
    return torchrun(4, [str(TESTS / "ft_worker.py")], timeout=400, env=variables, check=check)


def _final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=False)


def _losses(out: Path) -> set:
    return {(d["step"], d["loss"]) for d in map(json.loads, (out / "losses.jsonl").read_text().splitlines())}


def _steps(prefix: str) -> list[str]:
    from lightning_hybrid.checkpoint.manifest import committed_checkpoints

    return [c.path.name for c in committed_checkpoints(f"s3://{BUCKET}/{prefix}")]


def _objects(prefix: str) -> set[str]:
    root = f"{BUCKET}/{prefix}"
    return {p[len(root) + 1:] for p in _fs().find(root)}


@pytest.fixture(scope="module")
def baseline(s3_endpoint, tmp_path_factory) -> Path:
    """An uninterrupted tp=2 x pp=2 run, 8 steps, async saves every 2 steps into s3://ckpt/base, keep_last=2."""
    out = tmp_path_factory.mktemp("s3_baseline")
    started = time.perf_counter()
    _run(out, f"s3://{BUCKET}/base", KEEP=2)
    (out / "seconds").write_text(f"{time.perf_counter() - started:.1f}")
    return out


@pytest.mark.slow
def test_a_run_commits_manifests_last_and_retention_keeps_two(baseline):
    assert _steps("base") == ["step-000008", "step-000006"]
    objects = _objects("base")
    assert not any(o.startswith(("step-000002", "step-000004")) for o in objects), objects  # shards deleted too
    assert _fs().cat_file(f"{BUCKET}/base/latest").decode().strip() == "step-000008"
    from lightning_hybrid.checkpoint.verify import verify_checkpoint

    manifest = verify_checkpoint(f"s3://{BUCKET}/base/step-000008")
    assert manifest["step"] == 8 and manifest["mesh"]["tp"] == 2 and manifest["mesh"]["pp"] == 2
    assert {"__0_0.distcp", "__3_0.distcp", ".metadata", "trainer_state.pt", "rng/rank_2.pt"} <= set(manifest["files"])


@pytest.mark.slow
def test_sigkill_during_an_upload_is_ignored_and_the_rerun_resumes_bitwise(baseline, tmp_path):
    """Rank 1 dies right after the step-4 save started uploading: step-000004/ holds objects but no manifest; the
    next start ignores (and removes) it, resumes from step 2 and reaches the uninterrupted run's weights bitwise."""
    url = f"s3://{BUCKET}/killed"
    result = _run(tmp_path, url, check=False, KILL_AT=4, KILL_RANK=1, KEEP=2)
    assert result.returncode != 0
    assert _steps("killed") == ["step-000002"]
    assert "step-000004/meta.json" not in _objects("killed")
    _run(tmp_path, url, KEEP=2)
    assert _final(tmp_path)["resumed_from"].endswith("step-000002")
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])
    assert _losses(tmp_path) == _losses(baseline)
    assert _steps("killed") == ["step-000008", "step-000006"]


@pytest.mark.slow
def test_a_damaged_shard_object_is_set_aside_with_one_line_and_the_older_checkpoint_resumes(baseline, tmp_path):
    fs = _fs()
    fs.copy(f"{BUCKET}/base", f"{BUCKET}/damaged", recursive=True)
    shard = f"{BUCKET}/damaged/step-000008/__2_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC-32 finds it
    fs.pipe_file(shard, bytes(data))
    result = _run(tmp_path, f"s3://{BUCKET}/damaged", KEEP=2)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "skipping damaged checkpoint" in line]
    assert len(lines) == 1 and "__2_0.distcp" in lines[0] and "CRC-32" in lines[0], lines
    assert _final(tmp_path)["resumed_from"].endswith("step-000006")
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])
    assert "step-000008.damaged/meta.json" in _objects("damaged")  # kept for inspection, never tried again
    assert _steps("damaged") == ["step-000008", "step-000006"]  # step 8 saved anew


@pytest.mark.slow
def test_a_tp2_pp2_checkpoint_in_a_bucket_reshards_on_load_to_dp4(baseline, tmp_path):
    fs = _fs()
    fs.copy(f"{BUCKET}/base", f"{BUCKET}/reshard", recursive=True)
    _run(tmp_path, f"s3://{BUCKET}/reshard", TP=1, PP=1, KEEP=2)  # max_steps reached: load, then stop
    assert _final(tmp_path)["resumed_from"].endswith("step-000008")
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])
