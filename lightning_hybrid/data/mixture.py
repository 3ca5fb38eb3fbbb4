"""Weighted mixtures of prepared data folders: one dataset whose sample ``i`` comes from a source chosen by weight.

The mapping is fixed by the seed: source ``s`` gets ``round(num_samples * w_s)`` of the ``num_samples`` slots
(largest remainders, so the counts are exact), the slots are shuffled with the seed, and the ``k``-th slot of a
source reads that source's sequence ``perm_c[k mod n_s]``, where ``perm_c`` is a seeded permutation of the source
redrawn for each pass ``c = k div n_s`` over it (a small source is repeated, a large one subsampled). Because the
mixture is an ordinary map-style dataset, the resumable sampler's position (global, valid on any mesh) covers it:
a resume on another number of data-parallel ranks continues the same sample order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

__all__ = ["MixtureDataset", "check_sources"]


def check_sources(sources: Any) -> list[tuple[str, float]]:
    """``[(path, weight), ...]`` from ``sources`` (a list of ``{"path": ..., "weight": ...}``), weights normalized.

    Raises:
        ValueError: (one line) not a non-empty list of such mappings, or a weight that is not a positive number.
    """
    if not isinstance(sources, (list, tuple)) or not sources:
        raise ValueError(f"sources={sources!r} must be a non-empty list of {{path, weight}} mappings")
    out = []
    for i, source in enumerate(sources):
        if not isinstance(source, dict) or not isinstance(source.get("path"), str):
            raise ValueError(f"sources[{i}]={source!r} must be a mapping with a 'path' string and a 'weight'")
        weight = source.get("weight", 1.0)
        if (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight)
                or weight <= 0):
            raise ValueError(f"sources[{i}] ({source['path']}): weight={weight!r} must be a positive number")
        out.append((source["path"], float(weight)))
    total = sum(w for _, w in out)
    return [(p, w / total) for p, w in out]


def _exact_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Integer counts summing to ``total``, proportional to ``weights`` (largest remainders; ties: lower index)."""
    raw = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(raw).astype(np.int64)
    remainder = raw - counts
    for s in sorted(range(len(weights)), key=lambda s: (-remainder[s], s))[:total - int(counts.sum())]:
        counts[s] += 1
    return counts


class MixtureDataset(Dataset):
    """``num_samples`` samples drawn from ``datasets`` by ``weights``, deterministically from ``seed``.

    Args:
        datasets: the sources (map-style datasets).
        weights: normalized weights, one per source.
        num_samples: length of the mixture (one epoch); ``None``: the sources' total length.
        seed: fixes which slot reads which source and sequence.
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], num_samples: Any = None,
                 seed: int = 0) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        sizes = [len(d) for d in self.datasets]  # type: ignore[arg-type]
        self.num_samples = int(num_samples) if num_samples is not None else sum(sizes)
        if self.num_samples < 1:
            raise ValueError(f"num_samples={num_samples!r} must be a positive integer")
        self.seed = seed
        counts = _exact_counts(weights, self.num_samples)
        rng = np.random.default_rng([seed, 0])
        self.source = rng.permutation(np.repeat(np.arange(len(sizes), dtype=np.int32), counts))
        # k: how many earlier slots read the same source.
        self.rank = np.empty(self.num_samples, dtype=np.int64)
        for s in range(len(sizes)):
            where = np.flatnonzero(self.source == s)
            self.rank[where] = np.arange(where.size)
        self.sizes = sizes
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def source_of(self, i: int) -> int:
        """Which source sample ``i`` comes from."""
        return int(self.source[i])

    def locate(self, i: int) -> tuple[int, int]:
        """``(source, index in that source)`` of sample ``i``."""
        s, k = int(self.source[i]), int(self.rank[i])
        cycle, offset = divmod(k, self.sizes[s])
        perm = self._perms.get((s, cycle))
        if perm is None:
            perm = np.random.default_rng([self.seed, 1, s, cycle]).permutation(self.sizes[s])
            self._perms[(s, cycle)] = perm
        return s, int(perm[offset])

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for a mixture of {self.num_samples}")
        s, j = self.locate(i)
        return self.datasets[s][j]
