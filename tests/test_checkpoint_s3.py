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
from helpers.launch import TESTS, free_port, launch, leftover_processes

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
    return launch(4, [str(TESTS / "ft_worker.py")], timeout=400, env=variables, check=check)


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


def _tensors(url: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer states), read with no process group."""
    import torch.distributed.checkpoint as dcp

    from lightning_hybrid.checkpoint.storage import checkpoint_path, storage_reader

    reader = storage_reader(checkpoint_path(url))
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if hasattr(m, "size")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.slow
def test_the_process_writer_gives_checkpoints_identical_to_the_thread_writer(baseline, tmp_path):
    _run(tmp_path, f"s3://{BUCKET}/process", ASYNC_WRITER="process", KEEP=2)
    assert _steps("process") == ["step-000008", "step-000006"]
    for step in ("step-000006", "step-000008"):
        ours, theirs = _tensors(f"s3://{BUCKET}/process/{step}"), _tensors(f"s3://{BUCKET}/base/{step}")
        assert len(ours) > 10 and set(ours) == set(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), step
    assert same_tensors(_final(tmp_path)["final"], _final(baseline)["final"])


@pytest.mark.slow
def test_sigkill_during_a_background_process_write_commits_nothing_and_leaves_no_writer(s3_endpoint, tmp_path):
    # Every training process SIGKILLed at the end of step 5, while each rank's writer daemon is busy with the step-4
    # upload (60 s of it): each daemon exits with its training process. DCP's own daemon went on with the upload
    # nobody would commit (a 72B checkpoint's takes minutes), writing into the storage of the restarted job.
    result = _run(tmp_path, f"s3://{BUCKET}/process_killed", check=False, ASYNC_WRITER="process", KILL_ALL_AT=5,
                  KEEP=2, SLOW_DAEMON_WRITE_AT=4)
    assert result.returncode != 0
    assert leftover_processes(tmp_path, wait=15) == []
    assert _steps("process_killed") == ["step-000002"], (result.stdout + result.stderr)[-6000:]
    assert "step-000004/meta.json" not in _objects("process_killed")


def _one_line_error(code: str, env: dict) -> str:
    """Run ``code`` in a fresh interpreter (its own fsspec instances and environment); the exception's one line."""
    result = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
                            capture_output=True, text=True, timeout=280)
    assert result.returncode != 0, result.stdout
    return result.stderr.strip().splitlines()[-1]


CONSTRUCT = "from lightning_hybrid import FaultTolerantCheckpoint; FaultTolerantCheckpoint({url!r}, every_n_steps=1)"


@pytest.mark.timeout(300)
def test_bad_checkpoint_urls_get_one_line_each(s3_endpoint):
    from lightning_hybrid import FaultTolerantCheckpoint

    with pytest.raises(ValueError, match=r"unknown URL scheme foo://; use a local folder or an fsspec URL") as err:
        FaultTolerantCheckpoint("foo://bucket/run", every_n_steps=1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"bucket 'no-such-bucket' does not exist at http://127.0.0.1:\d+") as err:
        FaultTolerantCheckpoint("s3://no-such-bucket/run", every_n_steps=1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"storage_options=\['key'\] given with the local path"):
        FaultTolerantCheckpoint("ckpt", every_n_steps=1, storage_options={"key": "x"})

    hidden = "import sys; sys.modules['s3fs'] = None; "  # as if s3fs were not installed
    line = _one_line_error(hidden + CONSTRUCT.format(url=f"s3://{BUCKET}/run"), dict(os.environ))
    assert line.endswith("pip install 'lightning-hybrid[s3]'") and "StorageError" in line, line

    no_keys = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    no_keys.update(AWS_ENDPOINT_URL=s3_endpoint["AWS_ENDPOINT_URL"], AWS_EC2_METADATA_DISABLED="true",
                   AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent")
    line = _one_line_error(CONSTRUCT.format(url=f"s3://{BUCKET}/run"), no_keys)
    assert "NoCredentialsError: Unable to locate credentials" in line and f"s3://{BUCKET}/run" in line, line


@pytest.mark.timeout(300)
def test_storage_options_reach_the_bucket_without_environment_credentials(s3_endpoint, monkeypatch):
    from lightning_hybrid import FaultTolerantCheckpoint
    from lightning_hybrid.checkpoint.manifest import update_latest

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint["AWS_ENDPOINT_URL"],
                                                                       "region_name": "us-east-1"}}
    callback = FaultTolerantCheckpoint(f"s3://{BUCKET}/options", every_n_steps=1, storage_options=options)
    update_latest(callback.dirpath, callback.dirpath / "step-000001")
    assert (callback.dirpath / "latest").read_text() == "step-000001\n"  # through the same options


@pytest.mark.slow
def test_export_hf_reads_a_checkpoint_in_the_bucket_like_a_local_copy(baseline, tmp_path):
    from safetensors.torch import load_file

    from lightning_hybrid.checkpoint.export import export_main

    local = tmp_path / "step-000008"
    _fs().get(f"{BUCKET}/base/step-000008", str(local), recursive=True)
    assert export_main([f"s3://{BUCKET}/base/step-000008", str(tmp_path / "from_s3"), "--dtype", "fp32"]) == 0
    assert export_main([str(local), str(tmp_path / "from_disk"), "--dtype", "fp32"]) == 0
    ours, theirs = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("from_s3", "from_disk"))
    assert len(ours) > 5 and same_tensors(ours, theirs)
