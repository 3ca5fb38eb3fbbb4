"""Distributed building blocks, one module per parallelism; the strategy calls them, models never do."""
