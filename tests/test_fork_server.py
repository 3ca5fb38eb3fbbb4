"""The tests' fork server's process groups side by side (``launch_groups``, torchft's replica groups): each group its
own environment, rendezvous port and log, all running at once, and a failed rank stopping every group."""

from __future__ import annotations

import os
import textwrap

import pytest

from helpers.fork_server import fork_server

pytestmark = pytest.mark.timeout(180)

# Each rank leaves a file and waits until every rank of both groups has left one (a group that only started after
# the other ended would wait forever); then prints what it was given. FAIL_GROUP's rank 0 exits 3 instead.
SCRIPT = textwrap.dedent("""
    import os, pathlib, sys, time
    out = pathlib.Path(os.environ["OUT"])
    group, rank = os.environ["GROUP"], os.environ["RANK"]
    if os.environ.get("FAIL_GROUP") == group and rank == "0":
        sys.exit(3)
    (out / f"here_{group}_{rank}").write_text("")
    while len(list(out.glob("here_*"))) < 4:
        time.sleep(0.02)
    print(f"group={group} rank={rank} world={os.environ['WORLD_SIZE']} port={os.environ['MASTER_PORT']} "
          f"shared={os.environ['SHARED']}")
""")


def _launch(tmp_path, extra: dict) -> tuple:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    logs = [tmp_path / "group0.log", tmp_path / "group1.log"]
    env = {**os.environ, "OUT": str(tmp_path), "SHARED": "yes", **extra}
    result = fork_server().launch_groups(2, [str(script)], env, [{"GROUP": "0"}, {"GROUP": "1"}], logs, timeout=120)
    return result, [log.read_text().split() for log in logs]


def test_groups_run_at_once_each_with_its_environment_port_and_log(tmp_path):
    result, (first, second) = _launch(tmp_path, {})
    assert result.returncode == 0, result.stderr
    assert sorted(w for w in first if w.startswith(("group", "rank"))) == ["group=0", "group=0", "rank=0", "rank=1"]
    assert sorted(w for w in second if w.startswith(("group", "rank"))) == ["group=1", "group=1", "rank=0", "rank=1"]
    assert {w for w in first + second if w.startswith(("world", "shared"))} == {"world=2", "shared=yes"}
    ports = [{w for w in log if w.startswith("port")} for log in (first, second)]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]  # one store per group, as one per torchrun


def test_a_failed_rank_stops_every_group(tmp_path):
    result, _ = _launch(tmp_path, {"FAIL_GROUP": "1"})
    assert result.returncode == 1
    assert "[fork launcher] group 1 rank 0 exited with 3: stopping the other ranks" in result.stderr
    assert not list(tmp_path.glob("here_1_0"))
