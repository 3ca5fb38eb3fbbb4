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
