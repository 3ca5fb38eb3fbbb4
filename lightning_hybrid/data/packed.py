"""Packed token files (written by ``lightning-hybrid prepare-data``), memory-mapped at training time.

Chat folders (``prepare-data --format chat``, see :mod:`lightning_hybrid.data.prepare_chat`) hold whole rows of
packed conversations with an assistant-token mask and document boundaries; their sequences are the rows, with
``labels`` on assistant tokens only and ``position_ids`` restarting at 0 at each conversation.

Document masking (``document_mask=True``): a sequence also carries ``position_ids`` (the Hugging Face
``DataCollatorWithFlattening`` convention), so the model attends only within each document. In a text folder a
document ends with its EOS token; the position after an EOS is not trained to predict the next document's first
token (its label is ``-100``).

A data folder holds ``tokens.bin`` (every document's tokens followed by EOS, concatenated, uint32)
and ``index.json`` (``seq_len``, ``num_tokens``, ...). Sequence ``i`` is the window
``tokens[i * L : (i + 1) * L + 1]``: inputs are its first ``L`` tokens, labels the last ``L``, so
consecutive sequences share one boundary token and no token is wasted. Nothing is loaded into
memory; each worker process maps the file on first access.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from lightning_hybrid.data.byte_text import check_positive
from lightning_hybrid.data.mixture import MixtureDataset, check_sources
from lightning_hybrid.models.spec import IGNORE_INDEX

# The chat layout's names (also in prepare_chat, which imports the heavy tokenizer code; kept equal by a test).
CHAT_FORMAT = "lightning-hybrid packed chat"
LOSS_MASK_FILE = "loss_mask.bin"
BOUNDARIES_FILE = "boundaries.bin"

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


def is_chat(index: dict[str, Any]) -> bool:
    """Whether a folder's index is that of packed chat rows (``prepare-data --format chat``)."""
    return index.get("format") == CHAT_FORMAT


def _positions(starts: Tensor) -> Tensor:
    """Position of each token in its document, given where documents start (``starts[0]`` is True)."""
    index = torch.arange(starts.numel())
    last_start = torch.cummax(torch.where(starts, index, 0), 0).values
    return index - last_start


class PackedTokenDataset(Dataset):
    """Fixed-length training sequences cut from a packed token file.

    Args:
        path: the data folder (``tokens.bin`` + ``index.json``).
        seq_len: tokens per sequence; ``None`` uses the index's ``seq_len``.
        start: first sequence of this view (to split train/validation by position).
        stop: one past the last sequence; ``None`` is the end.
        document_mask: add ``position_ids`` restarting at 0 at each document (chat rows: each conversation; text:
            after each EOS, whose label becomes ``-100``).

    Raises:
        ValueError: the range is empty or outside the file.
    """

    def __init__(self, path: Union[str, Path], seq_len: Optional[int] = None, start: int = 0,
                 stop: Optional[int] = None, document_mask: bool = False) -> None:
        self.path = Path(path)
        self.index = read_index(self.path)
        self.chat = is_chat(self.index)
        self.document_mask = document_mask
        if self.chat and seq_len is not None and seq_len != self.index["seq_len"]:
            raise ValueError(f"{self.path} holds chat rows packed to seq_len={self.index['seq_len']}, not {seq_len}; "
                             f"leave seq_len unset or prepare the data again with --seq-len {seq_len}")
        self.seq_len = int(seq_len or self.index["seq_len"])
        total = (int(self.index["num_rows"]) if self.chat
                 else max(0, (int(self.index["num_tokens"]) - 1) // self.seq_len))
        stop = total if stop is None else stop
        if not 0 <= start < stop <= total:
            raise ValueError(f"sequences [{start}, {stop}) are not inside the {total} sequences of "
                             f"seq_len={self.seq_len} in {self.path}")
        self.start, self.stop = start, stop
        self._tokens: Optional[np.memmap] = None
        self._mask: Optional[np.memmap] = None
        self._bounds: Optional[np.memmap] = None

    @property
    def tokens(self) -> np.memmap:
        """The whole token file, memory-mapped read-only (opened lazily, once per process)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path / TOKENS_FILE, dtype=np.dtype(self.index.get("dtype", "uint32")),
                                     mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker started with spawn gets the path, not a copy of the mapped array.
        return {**self.__dict__, "_tokens": None, "_mask": None, "_bounds": None}

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        if self.chat:
            return self._chat_row(self.start + i)
        begin = (self.start + i) * self.seq_len
        window = torch.from_numpy(self.tokens[begin:begin + self.seq_len + 1].astype(np.int64))
        if not self.document_mask:
            return {"input_ids": window[:-1], "labels": window[1:]}
        inputs, eos = window[:-1], int(self.index["eos_token_id"])
        starts = torch.zeros(self.seq_len, dtype=torch.bool)
        starts[0] = True
        starts[1:] = inputs[:-1] == eos  # a document starts after each EOS
        labels = window[1:].masked_fill(inputs == eos, IGNORE_INDEX)
        return {"input_ids": inputs, "labels": labels, "position_ids": _positions(starts)}

    def _chat_row(self, row: int) -> dict[str, Tensor]:
        L = self.seq_len
        if self._mask is None or self._bounds is None:
            self._mask = np.memmap(self.path / LOSS_MASK_FILE, dtype=np.uint8, mode="r")
            self._bounds = np.memmap(self.path / BOUNDARIES_FILE, dtype=np.uint64, mode="r")
        tokens = torch.from_numpy(self.tokens[row * L:(row + 1) * L].astype(np.int64))
        mask = torch.from_numpy(self._mask[row * L:(row + 1) * L].astype(np.bool_))
        first, last = np.searchsorted(self._bounds, [row * L, (row + 1) * L])
        starts = torch.zeros(L, dtype=torch.bool)
        starts[torch.from_numpy((self._bounds[first:last] - np.uint64(row * L)).astype(np.int64))] = True
        doc = torch.cumsum(starts.long(), 0)
        # Target of position t: token t + 1, when it is an assistant token of the same conversation.
        valid = mask[1:] & (doc[1:] == doc[:-1])
        labels = torch.full((L,), IGNORE_INDEX, dtype=torch.long)
        labels[:-1] = torch.where(valid, tokens[1:], IGNORE_INDEX)
        item = {"input_ids": tokens, "labels": labels}
        if self.document_mask:
            item["position_ids"] = _positions(starts)
        return item


class PackedTokenDataModule(pl.LightningDataModule):
    """Language-model batches from a ``prepare-data`` folder, or a weighted mixture of folders: the last
    ``val_fraction`` of each folder is validation.

    Args:
        path: the data folder (or ``sources``).
        batch_size: sequences per data-parallel rank and step (global batch = batch_size * dp).
        seq_len: tokens per sequence; ``None`` uses the one the data was prepared with.
        val_fraction: fraction of the sequences, taken from the end, held out (at least one sequence).
        num_workers: DataLoader workers.
        shuffle: shuffle the training sequences (under a distributed strategy Lightning's sampler does it,
            seeded, so every dp rank agrees on the order).
        global_batch_size: sequences per step over all dp ranks, kept whatever dp the strategy has (``tp="auto"``
            may choose it); each rank then reads ``global_batch_size / dp`` and ``batch_size`` is not used.
        sources: a weighted mixture instead of ``path``: ``[{"path": ..., "weight": 0.7}, ...]`` (see
            :class:`~lightning_hybrid.data.mixture.MixtureDataset`); deterministic from ``seed``, and resumable on
            any mesh like a single folder.
        document_mask: batches carry ``position_ids`` restarting at 0 at each document, so attention stays inside
            documents; ``None``: on for chat folders (``prepare-data --format chat``), off for text.
        num_samples: training samples per epoch of a mixture (default: the sources' total).
        seed: seed of the mixture (default: the global seed, ``PL_GLOBAL_SEED``).

    Raises:
        ValueError: ``val_fraction`` outside [0, 1), too few sequences for the split, both or neither of ``path``
            and ``sources``, a weight that is not positive.
        FileNotFoundError: a folder that is not prepared data.
    """

    def __init__(self, path: Optional[str] = None, batch_size: int = 8, seq_len: Optional[int] = None,
                 val_fraction: float = 0.01, num_workers: int = 0, shuffle: bool = True,
                 global_batch_size: Optional[int] = None, sources: Optional[list[dict[str, Any]]] = None,
                 document_mask: Optional[bool] = None, num_samples: Optional[int] = None,
                 seed: Optional[int] = None) -> None:
        super().__init__()
        check_positive(batch_size=batch_size, seq_len=seq_len, global_batch_size=global_batch_size,
                       num_samples=num_samples)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        if (path is None) == (sources is None):
            raise ValueError("give the data folder as path=... or a weighted mixture as sources=[{path, weight}, "
                             "...], one of the two")
        self.mixture = check_sources(sources) if sources is not None else [(str(path), 1.0)]
        indexes = [read_index(p) for p, _ in self.mixture]  # a missing folder fails here, on every rank
        if document_mask is None:  # on for chat rows, off for pre-training text
            document_mask = all(is_chat(index) for index in indexes)
        self.document_mask = bool(document_mask)
        self.save_hyperparameters()
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def _split(self, path: str) -> tuple[PackedTokenDataset, Optional[PackedTokenDataset]]:
        hp = self.hparams
        full = PackedTokenDataset(path, hp.seq_len, document_mask=self.document_mask)
        n_val = max(1, int(len(full) * hp.val_fraction)) if hp.val_fraction > 0 else 0
        if len(full) - n_val < 1:
            raise ValueError(f"{path} has {len(full)} sequences of seq_len={full.seq_len}: too few to hold out "
                             f"val_fraction={hp.val_fraction}; prepare more data or lower val_fraction")
        train = PackedTokenDataset(path, full.seq_len, 0, len(full) - n_val, document_mask=self.document_mask)
        val = (PackedTokenDataset(path, full.seq_len, len(full) - n_val, document_mask=self.document_mask)
               if n_val else None)
        return train, val

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        splits = [self._split(path) for path, _ in self.mixture]
        lengths = {train.seq_len for train, _ in splits}
        if len(lengths) > 1:
            raise ValueError(f"the sources have different sequence lengths {sorted(lengths)}; pass seq_len or "
                             f"prepare them with one --seq-len")
        if hp.sources is None:
            self.train_set, self.val_set = splits[0]
            return
        seed = hp.seed if hp.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.train_set = MixtureDataset([t for t, _ in splits], [w for _, w in self.mixture], hp.num_samples, seed)
        vals = [v for _, v in splits if v is not None]
        self.val_set = ConcatDataset(vals) if vals else None

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
