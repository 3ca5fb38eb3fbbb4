"""GPUHealthMonitor: the judge against the start record, the reader's injected sources and XID events, the poll's
report exchange, the SLURM exclusion functions; and 4 gloo processes (tp=2 x pp=2) training under the real callback
with injected records per rank: a link down stops every rank at the next poll with exit code 76, a checkpoint and the
host to exclude; corrected ECC errors only warn; an XID between polls is reported at the next one; warn mode logs a
finding once; without NVML the monitor is inactive and costs nothing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.gpu_records import HEALTHY_H100, gpu_of_rank, links_down, record
from helpers.launch import TESTS, torchrun
from lightning_hybrid.callbacks import EXIT_CODE_UNHEALTHY, GPUHealthMonitor
from lightning_hybrid.callbacks.gpu_health import write_exclude_hosts
from lightning_hybrid.callbacks.gpu_poll import REPORT_BYTES, device_figures, finding_line, node_metrics, pack, unpack
from lightning_hybrid.preflight.health import check_gpu_health, check_thresholds
from lightning_hybrid.preflight.nvml import NvmlReader, XidWatcher, read_nvml

REPO = TESTS.parent
EXCLUDE_SH = REPO / "recipes" / "slurm" / "exclude_hosts.sh"


def judge(now: dict, start: dict = HEALTHY_H100, **kwargs) -> list[tuple[str, str, str]]:
    return [(f["severity"], f["check"], f["detail"]) for f in check_gpu_health(now, baseline=start, **kwargs)]


# ----------------------------------------------------------------------------- the judge against the start


def test_an_unchanged_healthy_gpu_has_no_findings_against_its_start():
    assert judge(HEALTHY_H100) == []


def test_new_ecc_errors_are_counted_from_the_start_of_training():
    start = record(ecc={"volatile_corrected": 40, "volatile_uncorrected": 1})
    assert judge(start, start) == []  # errors from before the start are the preflight's business
    assert judge(record(ecc={"volatile_corrected": 45, "volatile_uncorrected": 1}), start) == [
        ("warning", "ecc_corrected", "5 new corrected ECC errors since the start of training (error at 100)")]
    assert judge(record(ecc={"volatile_corrected": 140, "volatile_uncorrected": 1}), start)[0][:2] == (
        "error", "ecc_corrected")
    assert judge(record(ecc={"volatile_corrected": 45, "volatile_uncorrected": 1}), start,
                 thresholds={"corrected_ecc": 5})[0][0] == "error"
    assert judge(record(ecc={"volatile_corrected": 40, "volatile_uncorrected": 3}), start) == [
        ("error", "ecc_uncorrected", "2 new uncorrected ECC errors since the start of training")]


def test_retired_pages_and_remapped_rows_count_from_the_start_and_pending_ones_are_errors():
    start = record(remapped_rows={"correctable": 2, "uncorrectable": 1, "pending": False, "failure": False})
    assert judge(start, start) == []
    assert judge(record(remapped_rows={"correctable": 3, "uncorrectable": 1, "pending": True, "failure": False}),
                 start) == [("warning", "remapped_rows", "1 rows remapped since the start of training"),
                            ("error", "remapped_rows", "row remapping pending: reset the GPU")]
    assert judge(record(retired_pages={"single_bit": 0, "double_bit": 1, "pending": True})) == [
        ("warning", "retired_pages", "1 pages retired since the start of training"),
        ("error", "retired_pages", "page retirement pending: reset the GPU")]


def test_links_pcie_throttling_and_temperature_are_judged_as_they_are_now():
    found = judge(record(nvlink=links_down(5), pcie={"gen": 4, "max_gen": 5, "width": 8, "max_width": 16},
                         throttle_reasons=0x4 | 0x40 | 0x20, temperature_c=88))
    assert [(s, c) for s, c, _ in found] == [("error", "nvlink"), ("error", "pcie_width"), ("warning", "pcie_gen"),
                                             ("warning", "throttle"), ("error", "throttle"),
                                             ("warning", "temperature")]
    assert found[0][2] == "NVLink: 17 of 18 links up (down: [5])"
    assert found[-1][2] == "temperature 88 C (>= 85 C)"
    assert judge(record(temperature_c=93))[0][:2] == ("error", "temperature")


def test_xids_are_judged_by_nvidias_list():
    assert judge(HEALTHY_H100, xids=[79, 31, 9999]) == [
        ("error", "xid", "XID 79 (GPU has fallen off the bus)"), ("warning", "xid", "XID 31 (GPU memory page fault)"),
        ("warning", "xid", "XID 9999 (see NVIDIA's XID list)")]
    assert judge(HEALTHY_H100, xids=[13] * 50 + [48]) == [("warning", "xid", "XID 13 (graphics engine exception) x 50"),
                                                         ("error", "xid", "XID 48 (double-bit ECC error)")]


def test_the_preflight_view_without_a_start_is_unchanged():
    assert check_gpu_health(record(ecc={"volatile_uncorrected": 3}), host="h", rank=1)[0]["message"] == \
        "host h GPU 3 (rank 1): 3 uncorrected ECC errors since boot"


@pytest.mark.parametrize("thresholds, message", [
    ({"ecc": 3}, "thresholds key 'ecc' is unknown; use corrected_ecc, temperature_warning_c, temperature_error_c"),
    ({"corrected_ecc": 0}, "thresholds['corrected_ecc']=0 must be a number > 0"),
    ({"temperature_warning_c": 95}, "thresholds: temperature_warning_c=95 is above temperature_error_c=92"),
])
def test_bad_thresholds_fail_in_one_line(thresholds, message):
    with pytest.raises(ValueError) as info:
        check_thresholds(thresholds)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(every_n_steps=0), "every_n_steps=0 must be an integer >= 1"),
    (dict(every_n_steps=2.5), "every_n_steps=2.5 must be an integer >= 1"),
    (dict(on_fault="rollback"), "on_fault='rollback' is not a policy; use 'stop' or 'warn'"),
    (dict(thresholds={"temperature_error_c": -1}), "thresholds['temperature_error_c']=-1 must be a number > 0"),
])
def test_bad_monitor_arguments_fail_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as info:
        GPUHealthMonitor(**kwargs)
    assert str(info.value) == message


# ----------------------------------------------------------------------------- the reader, XIDs and the poll


def test_the_reader_replays_an_injected_sequence_and_repeats_its_last_record():
    reader = NvmlReader(source=[record(temperature_c=50), record(temperature_c=60)])
    assert reader.open() is None
    assert [reader.read()["temperature_c"] for _ in range(3)] == [50, 60, 60]
    assert read_nvml(source=lambda: record(temperature_c=70))["temperature_c"] == 70
    assert NvmlReader(source=[]).open() == "the injected record source is empty"


class FakeEvents:
    """nvidia-ml-py's event API as the reader uses it: one XID 79 pending, then timeouts."""

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeXidCriticalError = 8

    def __init__(self):
        self.pending, self.registered, self.freed, self.shut_down = [79], None, False, False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shut_down = True
    def nvmlDeviceGetHandleByPciBusId(self, bus): return ("gpu", bus)
    def nvmlEventSetCreate(self): return "set"
    def nvmlDeviceRegisterEvents(self, handle, types, events): self.registered = (handle, types, events)
    def nvmlEventSetFree(self, events): self.freed = True

    def nvmlEventSetWait(self, events, ms):
        if self.pending:
            return type("Data", (), {"eventData": self.pending.pop(0)})()
        time.sleep(ms / 1000)
        raise self.NVMLError(self.NVML_ERROR_TIMEOUT)


def test_xid_events_are_read_through_nvmls_event_api_in_a_background_thread(monkeypatch):
    fake = FakeEvents()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reader = NvmlReader(pci_bus_id="00000000:1B:00.0")
    assert reader.open() is None
    wait = reader.xid_waiter()
    assert fake.registered == (("gpu", "00000000:1B:00.0"), 8, "set")
    watcher = XidWatcher(wait, timeout=0.05).start()
    deadline = time.monotonic() + 10
    seen: list[int] = []
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)
        seen += watcher.drain()
    watcher.stop()
    reader.close()
    assert seen == [79] and watcher.drain() == [] and watcher.error is None
    assert fake.freed and fake.shut_down


def test_a_failing_xid_source_is_reported_not_silently_lost():
    def broken(timeout):
        raise RuntimeError("NVML gone")

    watcher = XidWatcher(broken, timeout=0.01).start()
    watcher._thread.join(5)
    assert watcher.error == "XID watcher stopped: NVML gone"


def test_a_report_packs_into_a_fixed_size_and_drops_warnings_first_when_too_long():
    report = {"rank": 3, "host": "node-1", "gpu": 3, "pci_bus_id": "00000000:48:00.0",
              "coords": {"pp": 1, "dp": 0, "tp": 1, "cp": 0},
              "findings": [["warning", "xid", "x" * 300]] * 20 + [["error", "nvlink", "NVLink: 17 of 18 links up"]],
              "figures": device_figures(gpu_of_rank(3, nvlink=links_down(5)), gpu_of_rank(3))}
    tensor = pack(report)
    assert tensor.numel() == REPORT_BYTES
    back = unpack(tensor)
    assert back["truncated"] and ["error", "nvlink", "NVLink: 17 of 18 links up"] in back["findings"]
    assert finding_line(back, back["findings"][-1], 8) == (
        "GPU health: error nvlink: rank 3, host node-1, GPU 3 (PCI 00000000:48:00.0), pp=1 dp=0 tp=1 cp=0: "
        "NVLink: 17 of 18 links up (step 8)")


def test_node_metrics_are_per_host_maxima_with_the_fewest_links_up():
    def report(rank, host, **changes):
        return {"rank": rank, "host": host, "findings": [],
                "figures": device_figures(gpu_of_rank(rank, **changes), gpu_of_rank(rank))}

    metrics = node_metrics([report(0, "a", temperature_c=70), report(1, "a", throttle_reasons=0x40 | 0x4),
                            report(2, "b", nvlink=links_down(1, 2)),
                            report(3, "b", ecc={"volatile_corrected": 7, "volatile_uncorrected": 0})])
    assert metrics["gpu_health/a/temperature_c_max"] == 70 and metrics["gpu_health/a/throttle_flags"] == 0x40
    assert metrics["gpu_health/b/nvlink_up_min"] == 16 and metrics["gpu_health/a/nvlink_up_min"] == 18
    assert metrics["gpu_health/b/ecc_corrected_new_max"] == 7 and metrics["gpu_health/a/ecc_corrected_new_max"] == 0


def test_the_exclusion_file_keeps_hosts_across_runs_without_duplicates(tmp_path):
    path = tmp_path / "ckpt" / "exclude_hosts.txt"
    assert write_exclude_hosts(path, ["node-7"]) == ["node-7"]
    assert write_exclude_hosts(path, ["node-2", "node-7"]) == ["node-7", "node-2"]
    assert path.read_text().splitlines()[1:] == ["node-7", "node-2"]


# ----------------------------------------------------------------------------- the launchers' exclusion logic


def shell(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{EXCLUDE_SH}"; {script}'], capture_output=True,
                          text=True, timeout=30, env={**os.environ, **env})


def test_the_slurm_exclusion_list_reads_the_file_as_the_monitor_writes_it(tmp_path):
    fixture = tmp_path / "exclude_hosts.txt"
    write_exclude_hosts(fixture, ["gpu-node-007", "gpu-node-012"])
    fixture.write_text(fixture.read_text() + "  gpu-node-007  # again, by hand\n\nbad host;rm -rf /\ngpu-node-003\r\n")
    result = shell(f'exclude_hosts_list "{fixture}"')
    assert result.returncode == 0 and result.stdout == "gpu-node-007,gpu-node-012,gpu-node-003\n"
    assert result.stderr.endswith("line 6: bad host;rm -rf /\n"), result.stderr
    assert shell(f'echo "[$(exclude_hosts_list "{tmp_path}/none.txt")]"').stdout == "[]\n"
    hosts = "gpu-node-001\ngpu-node-012\ngpu-node-003"
    assert shell(f'hosts_in_list "{hosts}" gpu-node-007,gpu-node-012,gpu-node-003').stdout == \
        "gpu-node-012,gpu-node-003\n"
    assert shell(f'recipe_checkpoint_dir "{REPO}/recipes/qwen2.5-72b-pretrain.yaml"').stdout == \
        "checkpoints/qwen2.5-72b-pretrain\n"


def _sbatch(tmp_path: Path, fit_status: int, hosts: list[str], nodes: str = "gpu-node-001\\ngpu-node-002"):
    calls, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {"scontrol": f'if [ "$1" = show ]; then printf "{nodes}\\n"; fi',
                       "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
                       "torchrun": f'case "$*" in *" fit "*) exit {fit_status};; esac; echo "{{}}"'}.items():
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "{calls}"\n{body}\n')
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    if hosts:
        write_exclude_hosts(run_dir / "checkpoints" / "qwen2.5-72b-pretrain" / "exclude_hosts.txt", hosts)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "16",
           "SLURM_JOB_NODELIST": "gpu-node-[001-016]", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_RESTART_COUNT": "1",
           "RUN_DIR": str(run_dir), "DRY_RUN": "0"}
    result = subprocess.run(["bash", str(REPO / "recipes" / "slurm" / "qwen2.5-72b.sbatch")], env=env,
                            capture_output=True, text=True, timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


def test_sbatch_excludes_the_faulty_hosts_and_requeues_after_exit_76(tmp_path):
    result, calls = _sbatch(tmp_path, fit_status=76, hosts=["gpu-node-002"])
    assert result.returncode == 76
    assert calls[-2:] == ["scontrol update JobId=4242 ExcNodeList=gpu-node-002", "scontrol requeue 4242"], calls
    assert "sbatch --exclude=gpu-node-002" in result.stdout


def test_sbatch_does_not_requeue_an_exit_76_with_no_host_to_exclude(tmp_path):
    result, calls = _sbatch(tmp_path, fit_status=76, hosts=[])
    assert result.returncode == 76 and not any("requeue" in c or "update" in c for c in calls), calls


def test_a_requeued_job_on_an_excluded_host_requeues_again_without_training(tmp_path):
    result, calls = _sbatch(tmp_path, fit_status=0, hosts=["gpu-node-002", "gpu-node-009"])
    assert result.returncode == 76 and not any(c.startswith("torchrun") for c in calls), calls
    assert "scontrol update JobId=4242 ExcNodeList=gpu-node-002,gpu-node-009" in calls
    assert "this allocation holds excluded hosts gpu-node-002" in result.stdout


def test_torchrun_script_refuses_to_start_on_an_excluded_host_and_says_where_to_act(tmp_path):
    import socket

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "lightning-hybrid"):
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "{tmp_path}/calls.log"\n')
        (bin_dir / name).chmod(0o755)
    write_exclude_hosts(tmp_path / "run" / "checkpoints" / "qwen2.5-72b-pretrain" / "exclude_hosts.txt",
                        [socket.gethostname()])
    result = subprocess.run(["bash", str(REPO / "recipes" / "torchrun-multinode.sh"),
                             str(REPO / "recipes" / "qwen2.5-72b-pretrain.yaml")], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                             "RUN_DIR": str(tmp_path / "run"), "DRY_RUN": "0"})
    assert result.returncode == 76 and not (tmp_path / "calls.log").exists()
    assert "is listed as faulty" in result.stderr and "kubectl cordon" in result.stderr


# ----------------------------------------------------------------------------- 4 gloo processes, tp=2 x pp=2

# The inactive monitor's own cost (no NVML on CPU): its hook's time per step, asserted below. No run without the
# monitor beside it: step times of two runs on a shared 2-core machine differ by more than the hook could cost.
TIMING = [{"name": "inactive", "steps": 10, "monitor": {"every_n_steps": 1}, "inject": False}]
SCENARIOS = [
    # corrected ECC errors on rank 1 (5 from step 3, 12 from step 6), under the threshold of 100: warn, never stop
    {"name": "ecc", "steps": 8, "monitor": {"every_n_steps": 1, "on_fault": "stop"},
     "faults": [[1, 3, {"corrected": 5}], [1, 6, {"corrected": 12}]]},
    # warn mode: rank 2's NVLink 5 down from step 3 (polls at 4, 6, 8); XID 79 on rank 1 during step 5
    {"name": "warn", "steps": 8, "monitor": {"every_n_steps": 2, "on_fault": "warn"},
     "faults": [[2, 3, {"links_down": [5]}]], "xids": [[1, 5, 79]]},
    # stop: rank 3's NVLink 5 down from step 6; polls at 4 and 8; the run stops at 8 (last: it ends the processes)
    {"name": "stop", "steps": 12, "monitor": {"every_n_steps": 4, "on_fault": "stop"}, "checkpoint": True,
     "faults": [[3, 6, {"links_down": [5]}]], "exit": True},
]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-health")
    configs = TIMING + SCENARIOS
    (out / "configs.json").write_text(json.dumps(configs))
    result = torchrun(4, [str(TESTS / "gpu_health_worker.py"), str(out / "configs.json"), str(out)], timeout=540,
                      check=False)
    records = {c["name"]: [json.loads((out / f"{c['name']}-rank{r}.json").read_text()) for r in range(4)]
               for c in configs if (out / f"{c['name']}-rank0.json").exists()}
    assert set(records) == {c["name"] for c in configs}, result.stderr[-4000:]
    return {"result": result, "records": records, "out": out, "log": result.stdout + result.stderr}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_link_down_on_rank_3_stops_every_rank_at_the_next_poll_with_exit_code_76(launch):
    stop = launch["records"]["stop"]
    assert [r["global_step"] for r in stop] == [8] * 4  # down during step 6; the poll at step 8 stops all ranks
    assert [r["exit_code"] for r in stop] == [EXIT_CODE_UNHEALTHY] * 4
    assert launch["result"].returncode != 0 and f"exitcode  : {EXIT_CODE_UNHEALTHY}" in launch["result"].stderr
    line = ("GPU health: error nvlink: rank 3, host node-1, GPU 3 (PCI 00000000:48:00.0), pp=1 dp=0 tp=1 cp=0: "
            "NVLink: 17 of 18 links up (down: [5]) (step 8)")
    assert all([f["line"] for f in r["findings"]] == [line] for r in stop)
    assert stop[0]["message"].splitlines()[:2] == ["GPU health stopped the run at step 8 (on_fault='stop'):",
                                                   f"  {line}"]
    assert launch["log"].count(line) >= 1


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_stop_commits_a_checkpoint_of_that_step_and_names_only_the_faulty_host(launch):
    from lightning_hybrid.checkpoint.manifest import committed_checkpoints, read_manifest

    folder = launch["out"] / "stop-ckpt"
    committed = committed_checkpoints(folder)
    assert [c.path.name for c in committed] == ["step-000008"]
    assert read_manifest(committed[0].path)["step"] == 8
    assert (folder / "exclude_hosts.txt").read_text().splitlines()[1:] == ["node-1"]
    message = launch["records"]["stop"][0]["message"]
    assert f"checkpoint of step 8 committed: {folder / 'step-000008'}" in message
    assert f"hosts to exclude (node-1) written to {folder / 'exclude_hosts.txt'}" in message


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_new_corrected_ecc_under_the_threshold_warns_once_with_a_metric_and_does_not_stop(launch):
    ecc = launch["records"]["ecc"]
    assert [r["global_step"] for r in ecc] == [8] * 4 and [r["exit_code"] for r in ecc] == [0] * 4
    assert [(f["step"], f["severity"], f["check"], f["rank"], f["host"]) for f in ecc[0]["findings"]] == [
        (3, "warning", "ecc_corrected", 1, "node-0")]
    assert ecc[0]["metrics"]["gpu_health/node-0/ecc_corrected_new_max"] == 12
    assert ecc[0]["metrics"]["gpu_health/node-1/ecc_corrected_new_max"] == 0
    assert launch["log"].count("warning ecc_corrected: rank 1, host node-0") == 1


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_warn_mode_finishes_logs_a_finding_once_and_reports_an_xid_between_polls_at_the_next_poll(launch):
    warn = launch["records"]["warn"]
    assert [r["global_step"] for r in warn] == [8] * 4 and [r["exit_code"] for r in warn] == [0] * 4
    found = [(f["step"], f["severity"], f["check"], f["rank"]) for f in warn[0]["findings"]]
    assert found == [(4, "error", "nvlink", 2), (6, "error", "xid", 1)]  # the link seen at 4, 6, 8: logged once
    assert "XID 79 (GPU has fallen off the bus) (step 6)" in warn[0]["findings"][1]["line"]
    assert launch["log"].count("error nvlink: rank 2, host node-1") == 1
    assert warn[0]["metrics"]["gpu_health/node-1/nvlink_up_min"] == 17


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_nvml_the_monitor_says_why_in_one_line_and_costs_nothing(launch):
    inactive = launch["records"]["inactive"]
    assert all(not r["active"] and r["inactive_reason"] == "the training device is cpu, not a CUDA GPU"
               for r in inactive)
    assert launch["log"].count("GPU health monitor inactive: the training device is cpu, not a CUDA GPU") == 1
    hook = [s for r in inactive for s in r["hook_seconds"]]
    median = statistics.median(hook)
    assert len(hook) == 4 * 10 and median < 2e-5, (len(hook), median)  # one attribute test per step
    step = statistics.median([s for r in inactive for s in r["step_seconds"][2:]])
    print(f"inactive hook: median {median * 1e6:.2f} us a step, {median / step:.1e} of the median step")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_poll_costs_one_small_all_gather(launch):
    polls = [s for r in launch["records"]["ecc"] for s in r["poll_seconds"]]
    assert len(polls) == 4 * 8
    median = statistics.median(polls)
    print(f"poll: median {median * 1e3:.2f} ms, max {max(polls) * 1e3:.2f} ms on 4 CPU processes; "
          f"per step at every_n_steps=100: {median / 100 * 1e6:.1f} us")
    assert median < 0.5
