"""Flake detector: re-run the distributed tests N times, without and under added CPU load, and count failures.

    python tests/stress.py --runs 20                        # every test marked ``distributed``
    python tests/stress.py --runs 5 -k context_parallel     # a subset (pytest's -k expression)
    python tests/stress.py --runs 3 --marker ""             # the whole suite
    python tests/stress.py --runs 20 -k elastic --reports stress-reports   # keep the JUnit reports

Each run is one ``pytest`` command (so module-scoped launches run again; its xdist workers as configured in
pyproject.toml, ``-n auto``) that writes a JUnit XML report; the table
lists every test with its failure count per condition, then the totals; each failure's message is printed as the
run ends (the reports keep the tracebacks: ``--reports DIR``). Under load, one
busy process per core spins for the whole run, as other jobs on a shared CI machine would. Exit code 1 when any
test failed in any run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional, Sequence

TESTS = Path(__file__).resolve().parent
CONDITIONS = {"idle": False, "load": True}  # condition name -> busy processes added


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stress.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per condition (default 3)")
    parser.add_argument("-k", dest="expr", default=None, help="pytest -k expression selecting the tests")
    parser.add_argument("--marker", default="distributed",
                        help="pytest -m expression (default 'distributed'; '' for every test)")
    parser.add_argument("--conditions", default="idle,load",
                        help="comma-separated: idle (nothing added), load (a busy process per core)")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy processes under load")
    parser.add_argument("--reports", type=Path, default=None,
                        help="keep each run's JUnit XML report in this folder (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs} must be at least 1")
    conditions = [c for c in args.conditions.split(",") if c]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions:
        parser.error(f"--conditions {args.conditions!r}: use idle, load or idle,load")
    args.conditions = conditions
    return args


def pytest_command(args: argparse.Namespace, report: Path) -> list[str]:
    """The pytest command of one run, writing its JUnit report to ``report``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(TESTS)]
    if args.marker:
        cmd += ["-m", args.marker]
    if args.expr:
        cmd += ["-k", args.expr]
    return cmd


def outcomes(report: Path) -> dict[str, bool]:
    """Test id -> failed (a failure or an error, in setup, call or teardown) from one JUnit XML report."""
    result: dict[str, bool] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure") is not None or case.find("error") is not None
        result[name] = result.get(name, False) or failed
    return result


def failure_messages(report: Path) -> dict[str, str]:
    """Test id -> the first line of its failure or error message, for the tests that failed in one report."""
    messages: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            text = problem.get("message") or problem.text or ""
            messages[f"{case.get('classname', '')}::{case.get('name', '')}"] = (text.strip().splitlines() or [""])[0]
    return messages


def tally(runs: dict[str, list[dict[str, bool]]]) -> dict[str, dict[str, int]]:
    """Failures per test and condition from each condition's runs (a test absent from a run counts as failed there,
    e.g. when a crash ended the run before it)."""
    tests = sorted({name for per_run in runs.values() for outcome in per_run for name in outcome})
    return {name: {cond: sum(outcome.get(name, True) for outcome in per_run) for cond, per_run in runs.items()}
            for name in tests}


def format_table(counts: dict[str, dict[str, int]], runs: int, conditions: Sequence[str]) -> str:
    """The failure table: every test's failures per condition (of ``runs``), then the totals."""
    width = max([len(name) for name in counts] + [len("test")])
    lines = [f"{'test':<{width}}  " + "  ".join(f"{cond + ' fails':>12}" for cond in conditions)]
    for name, per_condition in sorted(counts.items()):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{f'{per_condition[c]}/{runs}':>12}" for c in conditions))
    totals = ", ".join(f"{cond}: {sum(c[cond] for c in counts.values())}" for cond in conditions)
    lines.append(f"{len(counts)} tests x {runs} runs per condition; failures {totals}")
    return "\n".join(lines)


def _spin() -> None:
    while True:
        pass


def run_condition(args: argparse.Namespace, loaded: bool, folder: Path, name: str) -> list[dict[str, bool]]:
    """``args.runs`` pytest runs, with ``args.busy`` spinning processes for their duration when ``loaded``."""
    busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy if loaded else 0)]
    for proc in busy:
        proc.start()
    results = []
    try:
        for i in range(args.runs):
            report = folder / f"{name}-{i}.xml"
            proc = subprocess.run(pytest_command(args, report), capture_output=True, text=True)
            results.append(outcomes(report) if report.exists() else {})
            summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"[{name} {i + 1}/{args.runs}] {summary}", flush=True)
            for test, message in (failure_messages(report) if report.exists() else {}).items():
                print(f"    FAILED {test}: {message[:300]}", flush=True)
    finally:
        for proc in busy:
            proc.terminate()
            proc.join()
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
        folder = args.reports or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        runs = {cond: run_condition(args, CONDITIONS[cond], folder, cond) for cond in args.conditions}
    counts = tally(runs)
    print(format_table(counts, args.runs, args.conditions))
    return 1 if any(any(c.values()) for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
