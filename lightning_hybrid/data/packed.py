"""Packed token files (written by ``lightning-hybrid prepare-data``), memory-mapped at training time.

A data folder holds ``tokens.bin`` (every document's tokens followed by EOS, concatenated, uint32)
and ``index.json`` (``seq_len``, ``num_tokens``, ...). Sequence ``i`` is the window
``tokens[i * L : (i + 1) * L + 1]``: inputs are its first ``L`` tokens, labels the last ``L``, so
consecutive sequences share one boundary token and no token is wasted. Nothing is loaded into
memory; each worker process maps the file on first access.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_hybrid.data.byte_text import check_positive

__all__ = ["PackedTokenDataset", "PackedTokenDataModule", "read_index", "TOKENS_FILE", "INDEX_FILE"]

TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.json"


def read_index(path: Union[str, Path]) -> dict[str, Any]:
    """The ``index.json`` of a data folder written by ``prepare-data``.

    Raises:
        FileNotFoundError: the folder lacks ``index.json`` or ``tokens.bin``.
        ValueError: the token file's size disagrees with the index.
    """
    folder = Path(path)
    index_path, tokens_path = folder / INDEX_FILE, folder / TOKENS_FILE
    if not index_path.is_file() or not tokens_path.is_file():
        raise FileNotFoundError(f"{folder} is not a packed token folder (needs {INDEX_FILE} and {TOKENS_FILE}); "
                                f"write one with `lightning-hybrid prepare-data`")
    index = json.loads(index_path.read_text())
    itemsize = np.dtype(index.get("dtype", "uint32")).itemsize
    size = tokens_path.stat().st_size
    if size != index["num_tokens"] * itemsize:
        raise ValueError(f"{tokens_path} has {size} bytes but {index_path} says {index['num_tokens']} tokens of "
                         f"{itemsize} bytes; the folder is incomplete, run prepare-data again")
    return index


class PackedTokenDataset(Dataset):
    """Fixed-length training sequences cut from a packed token file.

    Args:
        path: the data folder (``tokens.bin`` + ``index.json``).
        seq_len: tokens per sequence; ``None`` uses the index's ``seq_len``.
        start: first sequence of this view (to split train/validation by position).
        stop: one past the last sequence; ``None`` is the end.

    Raises:
        ValueError: the range is empty or outside the file.
    """

    def __init__(self, path: Union[str, Path], seq_len: Optional[int] = None, start: int = 0,
                 stop: Optional[int] = None) -> None:
        self.path = Path(path)
        self.index = read_index(self.path)
        self.seq_len = int(seq_len or self.index["seq_len"])
        total = max(0, (int(self.index["num_tokens"]) - 1) // self.seq_len)
        stop = total if stop is None else stop
        if not 0 <= start < stop <= total:
            raise ValueError(f"sequences [{start}, {stop}) are not inside the {total} sequences of "
                             f"seq_len={self.seq_len} in {self.path}")
        self.start, self.stop = start, stop
        self._tokens: Optional[np.memmap] = None

    @property
    def tokens(self) -> np.memmap:
        """The whole token file, memory-mapped read-only (opened lazily, once per process)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path / TOKENS_FILE, dtype=np.dtype(self.index.get("dtype", "uint32")),
                                     mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker started with spawn gets the path, not a copy of the mapped array.
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        begin = (self.start + i) * self.seq_len
        window = torch.from_numpy(self.tokens[begin:begin + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class PackedTokenDataModule(pl.LightningDataModule):
    """Language-model batches from a ``prepare-data`` folder: the last ``val_fraction`` of it is validation.

    Args:
        path: the data folder.
        batch_size: sequences per data-parallel rank and step (global batch = batch_size * dp).
        seq_len: tokens per sequence; ``None`` uses the one the data was prepared with.
        val_fraction: fraction of the sequences, taken from the end, held out (at least one sequence).
        num_workers: DataLoader workers.
        shuffle: shuffle the training sequences (under a distributed strategy Lightning's sampler does it,
            seeded, so every dp rank agrees on the order).
        global_batch_size: sequences per step over all dp ranks, kept whatever dp the strategy has (``tp="auto"``
            may choose it); each rank then reads ``global_batch_size / dp`` and ``batch_size`` is not used.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1), or too few sequences for the split.
    """

    def __init__(self, path: str, batch_size: int = 8, seq_len: Optional[int] = None, val_fraction: float = 0.01,
                 num_workers: int = 0, shuffle: bool = True, global_batch_size: Optional[int] = None) -> None:
        super().__init__()
        check_positive(batch_size=batch_size, seq_len=seq_len, global_batch_size=global_batch_size)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        self.save_hyperparameters()
        self.train_set: Optional[PackedTokenDataset] = None
        self.val_set: Optional[PackedTokenDataset] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        full = PackedTokenDataset(hp.path, hp.seq_len)
        n_val = max(1, int(len(full) * hp.val_fraction)) if hp.val_fraction > 0 else 0
        if len(full) - n_val < 1:
            raise ValueError(f"{hp.path} has {len(full)} sequences of seq_len={full.seq_len}: too few to hold out "
                             f"val_fraction={hp.val_fraction}; prepare more data or lower val_fraction")
        self.train_set = PackedTokenDataset(hp.path, full.seq_len, 0, len(full) - n_val)
        self.val_set = PackedTokenDataset(hp.path, full.seq_len, len(full) - n_val) if n_val else None

    def rank_batch_size(self) -> int:
        """Sequences per dp rank and step: ``batch_size``, or ``global_batch_size / dp``.

        Raises:
            ValueError: dp does not divide ``global_batch_size``.
        """
        hp = self.hparams
        if hp.global_batch_size is None:
            return hp.batch_size
        dims = getattr(self.trainer.strategy, "dims", None) if self.trainer is not None else None
        dp = dims.dp if dims is not None else (self.trainer.world_size if self.trainer is not None else 1)
        if hp.global_batch_size % dp:
            raise ValueError(f"global_batch_size={hp.global_batch_size} does not split over dp={dp}; use a multiple "
                             f"of {dp}")
        return hp.global_batch_size // dp

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.rank_batch_size(), shuffle=self.hparams.shuffle,
                          drop_last=True, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> Any:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.rank_batch_size(), shuffle=False, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> Any:
        return self.val_dataloader()
