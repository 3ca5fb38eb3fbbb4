"""Preflight: bandwidth of every mesh dimension, matmul speed and GPU health, checked before training."""
