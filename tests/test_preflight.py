"""Preflight: NVML health flagging on recorded values, and the bandwidth checks on 4 gloo processes."""

from __future__ import annotations

import json

import pytest

from helpers.gpu_records import HEALTHY_H100, record
from helpers.launch import launch
from lightning_hybrid.preflight.cli import _key_values
from lightning_hybrid.preflight.health import check_gpu_health, gpu_type_from_name, read_nvml
from lightning_hybrid.preflight.links import bus_bandwidth_factor


def test_a_healthy_gpu_has_no_findings():
    assert check_gpu_health(HEALTHY_H100, host="node07", rank=59) == []


def test_a_degraded_nvlink_is_an_error_naming_host_gpu_rank_and_links():
    links = [True] * 18
    links[4] = links[11] = False
    findings = check_gpu_health(record(nvlink=links), host="node07", rank=59)
    assert [(f["severity"], f["check"]) for f in findings] == [("error", "nvlink")]
    assert findings[0]["message"] == "host node07 GPU 3 (rank 59): NVLink: 16 of 18 links up (down: [4, 11])"


def test_missing_nvlinks_count_against_the_gpu_types_expected_number():
    findings = check_gpu_health(record(nvlink=[True] * 12), host="n", rank=0)
    assert "NVLink: 12 of 18 links up" in findings[0]["message"]
    assert check_gpu_health(record(nvlink=[True] * 12), expected_nvlinks=12) == []


def test_a_pcie_link_trained_down_to_x8_is_an_error():
    findings = check_gpu_health(record(pcie={"gen": 5, "max_gen": 5, "width": 8, "max_width": 16}), host="node02",
                                rank=12)
    assert [(f["severity"], f["check"]) for f in findings] == [("error", "pcie_width")]
    assert findings[0]["message"] == "host node02 GPU 3 (rank 12): PCIe link trained down to x8 (max x16)"


def test_a_lower_pcie_generation_is_only_a_warning_since_idle_gpus_downshift():
    findings = check_gpu_health(record(pcie={"gen": 1, "max_gen": 5, "width": 16, "max_width": 16}))
    assert [(f["severity"], f["check"]) for f in findings] == [("warning", "pcie_gen")]


@pytest.mark.parametrize("changes, severity, check", [
    ({"ecc": {"volatile_uncorrected": 3}}, "error", "ecc"),
    ({"ecc": {"aggregate_uncorrected": 1}}, "warning", "ecc"),
    ({"ecc": {"volatile_corrected": 5000}}, "warning", "ecc"),
    ({"retired_pages": {"single_bit": 0, "double_bit": 0, "pending": True}}, "error", "retired_pages"),
    ({"retired_pages": {"single_bit": 0, "double_bit": 2, "pending": False}}, "warning", "retired_pages"),
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": True, "failure": False}}, "error",
     "remapped_rows"),
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": True}}, "error",
     "remapped_rows"),
    ({"remapped_rows": {"correctable": 1, "uncorrectable": 4, "pending": False, "failure": False}}, "warning",
     "remapped_rows"),
    ({"throttle_reasons": 0x40, "clocks": {"sm": 1100, "sm_max": 1980}}, "error", "throttle"),
    ({"throttle_reasons": 0x8}, "error", "throttle"),
    ({"throttle_reasons": 0x20}, "warning", "throttle"),
])
def test_memory_errors_and_throttling_are_flagged(changes, severity, check):
    findings = check_gpu_health(record(**changes), host="h", rank=1)
    assert [(f["severity"], f["check"]) for f in findings] == [(severity, check)]


def test_throttling_message_names_the_reason_and_clocks():
    (finding,) = check_gpu_health(record(throttle_reasons=0x40 | 0x1, clocks={"sm": 1100, "sm_max": 1980}), host="h")
    assert finding["message"] == "host h GPU 3: clocks throttled: hw_thermal_slowdown (SM 1100 of 1980 MHz)"


def test_values_a_device_does_not_report_are_not_judged():
    sparse = {"index": 0, "name": "NVIDIA B300", "nvlink": None, "pcie": {"gen": None, "width": None},
              "ecc": None, "retired_pages": None, "remapped_rows": None, "throttle_reasons": None}
    assert check_gpu_health(sparse) == []


def test_gpu_types_are_recognized_from_device_names():
    assert gpu_type_from_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_type_from_name("NVIDIA H200") == "h200"
    assert gpu_type_from_name("NVIDIA B300 SXM6 AC") == "b300"
    assert gpu_type_from_name("NVIDIA A100-SXM4-80GB") is None


def test_read_nvml_never_raises_and_says_why_it_skipped():
    result = read_nvml(0)
    assert result["status"] in ("checked", "skipped")
    if result["status"] == "skipped":
        assert result["reason"]


def test_bus_bandwidth_factors_are_nccl_tests_definitions():
    assert bus_bandwidth_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_bandwidth_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_bandwidth_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_bandwidth_factor("p2p", 2) == 1.0


def test_expected_bandwidth_flags_parse_and_reject_unknown_dimensions():
    assert _key_values(["tp=360,dp=40", "dp.all_gather=35"], "--expected-busbw") == {
        "tp": 360.0, "dp": 40.0, "dp.all_gather": 35.0}
    with pytest.raises(ValueError, match="the key must be one of pp, dp, tp"):
        _key_values(["ep=3"], "--expected-busbw")


# ----------------------------------------------------------------------------- 4 gloo processes

ARGS = ["-m", "lightning_hybrid.preflight", "--tp", "2", "--pp", "2", "--max-bytes", str(4 << 20), "--iters", "2"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_preflight_on_4_cpu_processes_measures_every_dimension_and_fails_an_impossible_expectation():
    ok = launch(4, ARGS + ["--json"], timeout=180)
    doc = json.loads(ok.stdout[ok.stdout.index("{"):])
    assert doc["ok"] and doc["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and doc["world_size"] == 4
    tests = {(link["dim"], link["test"]) for link in doc["links"]}
    assert tests == {(d, t) for d in ("tp", "pp") for t in ("all_reduce", "all_gather", "reduce_scatter")} | {
        ("pp", "p2p")}
    for link in doc["links"]:
        assert link["busbw_gbs"] > 0 and len(link["ranks"]) == 2 and link["link"] == "intra-node shared memory"
        assert [s["bytes"] for s in link["sizes"]] == [1 << 20, 2 << 20, 4 << 20]
    assert {tuple(link["ranks"]) for link in doc["links"] if link["dim"] == "tp"} == {(0, 1), (2, 3)}
    assert {tuple(link["ranks"]) for link in doc["links"] if link["dim"] == "pp"} == {(0, 2), (1, 3)}
    assert len(doc["matmul"]) == 4 and all(m["tflops"] > 0 for m in doc["matmul"])
    assert doc["health"]["status"] == "skipped" and "CPU" in doc["health"]["reason"]

    bad = launch(4, ARGS + ["--expected-busbw", "tp=1e6"], timeout=180, check=False)
    assert bad.returncode != 0
    failure = next(line for line in bad.stderr.splitlines() if "tp all_reduce: bus bandwidth" in line)
    assert "below 0.8 x expected 1e+06 GB/s on ranks [0, 1]" in failure or "on ranks [2, 3]" in failure
    assert "(hosts " in failure and "link intra-node shared memory" in failure
    assert "FAIL" in bad.stdout and "pp   p2p" in bad.stdout


class FakeNVML:
    """Enough of nvidia-ml-py's API to read one degraded H100: link 5 down, PCIe at x8, links 18+ absent."""

    class NVMLError(Exception):
        pass

    NVML_NVLINK_MAX_LINKS = 36
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 0, 1
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self):
        self.shut_down = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shut_down = True
    def nvmlDeviceGetHandleByPciBusId(self, bus): raise self.NVMLError("not found")
    def nvmlDeviceGetHandleByIndex(self, i): return ("gpu", i)
    def nvmlDeviceGetIndex(self, h): return h[1]
    def nvmlDeviceGetName(self, h): return b"NVIDIA H100 80GB HBM3"
    def nvmlDeviceGetUUID(self, h): return "GPU-1234"
    def nvmlDeviceGetPciInfo(self, h): return type("Pci", (), {"busId": b"00000000:1B:00.0"})()

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 18:
            raise self.NVMLError("not supported")
        return 0 if link == 5 else 1

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return 5
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return 5
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return 8
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return 16
    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter): return 0
    def nvmlDeviceGetRetiredPages(self, h, cause): return []
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h): raise self.NVMLError("not supported")  # Hopper remaps rows
    def nvmlDeviceGetRemappedRows(self, h): return (0, 0, 0, 0)
    def nvmlDeviceGetClockInfo(self, h, kind): return 1980
    def nvmlDeviceGetMaxClockInfo(self, h, kind): return 1980
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return 0
    def nvmlDeviceGetTemperature(self, h, kind): return 40


def test_read_nvml_builds_a_record_that_flags_the_degraded_device(monkeypatch):
    fake = FakeNVML()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    rec = read_nvml(index=2, pci_bus_id="00000000:1B:00.0")
    assert rec["status"] == "checked" and rec["index"] == 2 and rec["name"] == "NVIDIA H100 80GB HBM3"
    assert len(rec["nvlink"]) == 18 and rec["nvlink"][5] is False
    assert rec["retired_pages"]["pending"] is None and rec["remapped_rows"]["pending"] is False
    assert fake.shut_down
    findings = check_gpu_health(rec, host="node01", rank=2)
    assert [(f["severity"], f["check"]) for f in findings] == [("error", "nvlink"), ("error", "pcie_width")]
    assert findings[0]["message"] == "host node01 GPU 2 (rank 2): NVLink: 17 of 18 links up (down: [5])"
