"""``python -m lightning_hybrid.planner``: the same as ``lightning-hybrid plan``."""

import sys

from lightning_hybrid.planner.cli import run_plan

sys.exit(run_plan())
