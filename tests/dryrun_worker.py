"""A 4-process run that measures each rank of the tiny recipe twice: dry (fake world) and real (gloo).

Launched by ``tests/test_dry_run.py`` with torchrun. For each layout it first plays its own rank on the fake process
group (before any real process group exists in this process), then all layouts run for real on gloo, one untraced
step and one traced step (the first real step also does the pipeline's shape exchange, which a dry run is given).
Each rank writes ``<name>-<rank>.json`` with both measurements.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from helpers.worker_exit import end_worker
from lightning_hybrid.dryrun.rank import run_rank
from lightning_hybrid.dryrun.recipe import load_job


def main() -> None:
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    jobs = {c["name"]: load_job(c["recipe"]).with_strategy(**c["strategy"]) for c in configs}
    dry = {name: dataclasses.asdict(run_rank(job, rank)) for name, job in jobs.items()}
    for name, job in jobs.items():
        real = dataclasses.asdict(run_rank(job, rank, fake=False, warmup_steps=1))
        (out / f"{name}-{rank}.json").write_text(json.dumps({"dry": dry[name], "real": real}))


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
