"""Launching ``lightning-hybrid`` on local processes with torchrun (shared by the notebooks and the tests)."""
