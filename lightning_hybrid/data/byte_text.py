"""A data set that needs no download: the Python standard library's own source, as bytes.

Bytes are token ids 0..255 (the ``tiny`` preset's vocabulary), packed into fixed-length
sequences with labels shifted by one. The files are read in sorted order and split by position
(the last ``val_fraction`` is validation), so train/val are the same on every rank and every run.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = ["stdlib_text", "PackedSequences", "ByteTextDataModule"]


def stdlib_text(max_bytes: int, root: Optional[str] = None) -> bytes:
    """Up to ``max_bytes`` of ``.py`` source from ``root`` (default: this Python's standard library), sorted by path.

    Raises:
        ValueError: no source files were found.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(base.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise ValueError(f"no .py files under {base}; pass another root")
    return b"".join(chunks)[:max_bytes]


class PackedSequences(Dataset):
    """Token ids cut into sequences of ``seq_len`` inputs and the ``seq_len`` next tokens as labels."""

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"{tokens.numel()} tokens cannot make one sequence of seq_len={seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        start = index * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


def check_positive(**values: Any) -> None:
    """Raise one ``ValueError`` naming the first of ``values`` that is not a positive integer (``None`` passes)."""
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")


class ByteTextDataModule(pl.LightningDataModule):
    """Byte-level language modelling on the standard library's source code.

    Args:
        seq_len: tokens per sequence.
        batch_size: sequences per data-parallel rank and step (global batch = batch_size * dp).
        max_bytes: how much source text to use.
        val_fraction: fraction of the sequences, taken from the end, held out for validation.
        root: folder of ``.py`` files to read instead of the standard library.
        num_workers: DataLoader workers.
    """

    def __init__(self, seq_len: int = 128, batch_size: int = 8, max_bytes: int = 4_000_000,
                 val_fraction: float = 0.05, root: Optional[str] = None, num_workers: int = 0) -> None:
        super().__init__()
        check_positive(seq_len=seq_len, batch_size=batch_size, max_bytes=max_bytes)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1")
        self.save_hyperparameters()
        self.train_set: Optional[PackedSequences] = None
        self.val_set: Optional[PackedSequences] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        tokens = torch.frombuffer(bytearray(stdlib_text(hp.max_bytes, hp.root)), dtype=torch.uint8)
        n_seq = (tokens.numel() - 1) // hp.seq_len
        n_val = max(1, int(n_seq * hp.val_fraction))
        split = (n_seq - n_val) * hp.seq_len
        self.train_set = PackedSequences(tokens[:split + 1], hp.seq_len)
        self.val_set = PackedSequences(tokens[split:], hp.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
