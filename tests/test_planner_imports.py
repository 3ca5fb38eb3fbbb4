"""The planner is arithmetic: importing any planner module, or running ``lightning-hybrid plan``, loads neither torch
nor Lightning (each checked in a fresh interpreter, whose ``sys.modules`` is read at the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics")
PLANNER_MODULES = ["lightning_hybrid.planner"] + sorted(  # __main__ runs the command: the CLI test below covers it
    f"lightning_hybrid.planner.{p.stem}" for p in (ROOT / "lightning_hybrid" / "planner").glob("*.py")
    if p.stem not in ("__init__", "__main__"))
REPORT = ("import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {frameworks})), "
          "file=sys.stderr)")


def _fresh(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = f"{code}\n{REPORT.format(frameworks=FRAMEWORKS)}"
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _loaded(process: subprocess.Popen) -> tuple[list[str], str]:
    """(the framework modules the interpreter had loaded at its end, its stdout)."""
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return json.loads(err.strip().splitlines()[-1]), out


def test_every_planner_module_imports_neither_torch_nor_lightning():
    # one fresh interpreter per module, all at once (a module that loads torch is named, whichever it is)
    started = {module: _fresh(f"import importlib; importlib.import_module({module!r})") for module in PLANNER_MODULES}
    loaded = {module: _loaded(process)[0] for module, process in started.items()}
    assert len(loaded) >= 10 and "lightning_hybrid.planner.search" in loaded
    heavy = {module: found for module, found in loaded.items() if found}
    assert not heavy, f"planner modules that load a framework: {heavy}"


def test_lightning_hybrid_plan_runs_without_torch_or_lightning():
    command = ["plan", "--model", "qwen2.5-72b", "--gpus", "128", "--gpu", "b300"]
    loaded, out = _loaded(_fresh(f"from lightning_hybrid.cli import main\nassert main({command!r}) == 0"))
    assert out.startswith("plan: qwen2.5-72b (72.71B parameters), 128 x b300") and "layouts fit" in out
    assert loaded == [], f"lightning-hybrid plan loaded {loaded}"
