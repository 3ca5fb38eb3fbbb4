"""``import launch`` for the tests that still use the old name; the launcher lives in :mod:`helpers.launch`.

``HERE`` is the tests folder (where the worker scripts are).
"""

from helpers.launch import TESTS, free_port, run_workers, torchrun

HERE = TESTS

__all__ = ["HERE", "free_port", "run_workers", "torchrun"]
