"""``python -m lightning_hybrid.preflight`` (under torchrun): the same as ``lightning-hybrid preflight``."""

import sys

from lightning_hybrid.preflight.cli import preflight_main

sys.exit(preflight_main())
