import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def reference_run():
    """The tiny model trained by one process with no parallel strategy (the ground truth)."""
    from helpers.equivalence import run_reference

    return run_reference()


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default in pyproject.toml): a worker per core, at most 4. The suite is CPU-bound apart from
    the recovery scenarios' waits, and a test launches up to 8 processes of ~0.5 GB: more workers than cores only
    slow every test down, and 4 bound the memory on a large machine."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_collection_modifyitems(config, items):
    """Every test that launches a process group (``distributed``) or runs a notebook is also ``slow``: ``pytest -m
    "not slow"`` is then the inner loop of unit tests, and a new launch test cannot slow it down unmarked."""
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("notebook"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that trains in this process (a one-device HybridParallelStrategy initializes a one-rank process group,
    which Lightning keeps after fit) must not hand that group to the next test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
