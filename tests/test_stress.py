"""``tests/stress.py``, the flake detector: its arguments, the JUnit reading and the failure table (no real run)."""

from __future__ import annotations

import pytest
import stress


def test_arguments_default_to_the_distributed_tests_idle_and_under_load():
    args = stress.parse_args(["--runs", "20", "-k", "elastic"])
    assert (args.runs, args.expr, args.marker, args.conditions) == (20, "elastic", "distributed", ["idle", "load"])
    assert stress.parse_args(["--conditions", "load"]).conditions == ["load"] and args.reports is None
    assert stress.parse_args(["--reports", "out"]).reports == stress.Path("out")
    command = stress.pytest_command(args, stress.TESTS / "r.xml")
    assert command[-4:] == ["-m", "distributed", "-k", "elastic"] and f"--junitxml={stress.TESTS / 'r.xml'}" in command
    assert stress.pytest_command(stress.parse_args(["--marker", ""]), stress.TESTS / "r.xml").count("-m") == 1


@pytest.mark.parametrize("argv", [["--runs", "0"], ["--conditions", "busy"], ["--conditions", ""]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        stress.parse_args(argv)
    assert "stress.py: error:" in capsys.readouterr().err


def test_junit_reports_become_failure_counts_per_test_and_condition(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok"/>'
                      '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
                      '<testcase classname="tests.test_a" name="test_setup"><error message="y"/></testcase>'
                      '<testcase classname="tests.test_a" name="test_skip"><skipped/></testcase>'
                      '</testsuite></testsuites>')
    first = stress.outcomes(report)
    assert stress.failure_messages(report) == {"tests.test_a::test_bad": "x", "tests.test_a::test_setup": "y"}
    assert first == {"tests.test_a::test_ok": False, "tests.test_a::test_bad": True, "tests.test_a::test_setup": True}
    second = {"tests.test_a::test_ok": False, "tests.test_a::test_bad": False}  # test_setup missing: a crashed run
    counts = stress.tally({"idle": [first, second], "load": [second, second]})
    assert counts == {"tests.test_a::test_bad": {"idle": 1, "load": 0}, "tests.test_a::test_ok": {"idle": 0, "load": 0},
                      "tests.test_a::test_setup": {"idle": 2, "load": 2}}
    table = stress.format_table(counts, 2, ["idle", "load"]).splitlines()
    assert table[0].split() == ["test", "idle", "fails", "load", "fails"]
    assert table[1].split() == ["tests.test_a::test_bad", "1/2", "0/2"]
    assert table[2].split() == ["tests.test_a::test_ok", "0/2", "0/2"]
    assert table[-1] == "3 tests x 2 runs per condition; failures idle: 3, load: 2"
