"""``prepare-data --format chat``: conversations -> packed rows with assistant-only labels and document boundaries.

Conversations are rendered with the tokenizer's chat template (:mod:`lightning_hybrid.data.chat`), then packed into
rows of ``seq_len`` tokens: first-fit decreasing within a window of ``pack_window`` conversations (the longest
first, each into the first row it fits), the rest of a row padded. The folder holds

- ``tokens.bin``: uint32, ``num_rows * seq_len`` token ids (row ``i`` is ``[i * L, (i + 1) * L)``);
- ``loss_mask.bin``: uint8 per token, 1 on assistant tokens (a reply and its end-of-turn token);
- ``boundaries.bin``: uint64 global offsets where a document starts (conversations and padding runs);
- ``index.json``, written last.

:class:`~lightning_hybrid.data.packed.PackedTokenDataset` reads a row as ``input_ids``, ``labels`` (the next token
when it is an assistant token of the same conversation, else ``-100``) and ``position_ids`` (0 at each document).
Tokenization runs in ``workers`` processes; results come back in input order, so the output is byte-identical
to one worker's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from lightning_hybrid.data.chat import ChatEncoder, check_conversation, load_chat_tokenizer
from lightning_hybrid.data.packed import BOUNDARIES_FILE, CHAT_FORMAT, LOSS_MASK_FILE
from lightning_hybrid.data.parallel_map import ordered_map
from lightning_hybrid.data.sources import expand_inputs, iter_records

__all__ = ["prepare_chat", "first_fit_decreasing", "LOSS_MASK_FILE", "BOUNDARIES_FILE", "CHAT_FORMAT"]

OVERLONG = ("drop", "truncate")

_encoder: Optional[ChatEncoder] = None


def _init_worker(tokenizer: str, chat_template: Optional[str]) -> None:
    global _encoder
    _encoder = ChatEncoder(load_chat_tokenizer(tokenizer, chat_template))


def _encode_batch(batch: list[tuple[str, list[dict[str, Any]]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    assert _encoder is not None
    return [_encoder.encode(messages, location) for location, messages in batch]


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= ``capacity``: items longest first (ties: input order), each
    into the first bin with room. Bins in order of opening; items in a bin in order of placement."""
    bins: list[list[int]] = []
    room: list[int] = []
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[item]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(item)
                room[b] -= n
                break
        else:
            bins.append([item])
            room.append(capacity - n)
    return bins


def _conversations(paths: list[Path], messages_key: str, strict: bool, stats: dict[str, int],
                   batch_size: int) -> Iterator[list[tuple[str, list[dict[str, Any]]]]]:
    batch: list[tuple[str, list[dict[str, Any]]]] = []
    for location, record in iter_records(paths, messages_key):
        messages, has_assistant = check_conversation(location, record, messages_key)
        if not has_assistant:
            if strict:
                raise ValueError(f"{location}: the conversation has no assistant turn (nothing to train on); drop "
                                 f"it or run without --strict to skip such conversations")
            stats["skipped_no_assistant"] += 1
            continue
        batch.append((location, messages))
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


class _RowWriter:
    """Appends packed rows to the three files."""

    def __init__(self, folder: Path, seq_len: int, pad_id: int) -> None:
        self.folder, self.seq_len, self.pad_id = folder, seq_len, pad_id
        self.tokens = (folder / "tokens.bin.partial").open("wb")
        self.mask = (folder / f"{LOSS_MASK_FILE}.partial").open("wb")
        self.bounds = (folder / f"{BOUNDARIES_FILE}.partial").open("wb")
        self.rows = 0
        self.used = 0

    def write(self, convs: list[tuple[np.ndarray, np.ndarray]], bins: list[list[int]]) -> None:
        L = self.seq_len
        for items in bins:
            tokens = np.full(L, self.pad_id, dtype=np.uint32)
            mask = np.zeros(L, dtype=np.uint8)
            starts, at = [], 0
            for i in items:
                ids, m = convs[i]
                tokens[at:at + len(ids)], mask[at:at + len(ids)] = ids, m
                starts.append(at)
                at += len(ids)
            if at < L:
                starts.append(at)  # the padding run is a document of its own, never in the loss
            self.used += at
            tokens.tofile(self.tokens)
            mask.tofile(self.mask)
            (np.asarray(starts, dtype=np.uint64) + np.uint64(self.rows * L)).tofile(self.bounds)
            self.rows += 1

    def close(self) -> None:
        for file in (self.tokens, self.mask, self.bounds):
            file.flush()
            os.fsync(file.fileno())
            file.close()

    def commit(self) -> None:
        for name in ("tokens.bin", LOSS_MASK_FILE, BOUNDARIES_FILE):
            os.replace(self.folder / f"{name}.partial", self.folder / name)


def _pack(encoded: Iterator[list[tuple[np.ndarray, np.ndarray]]], writer: _RowWriter, seq_len: int, overlong: str,
          pack_window: int, stats: dict[str, int]) -> None:
    """Pack encoded conversations window by window (first-fit decreasing), counting what is dropped or cut."""
    window: list[tuple[np.ndarray, np.ndarray]] = []
    for batch in encoded:
        for ids, mask in batch:
            if len(ids) > seq_len:
                if overlong == "drop":
                    stats["dropped"] += 1
                    continue
                ids, mask = ids[:seq_len], mask[:seq_len]
                stats["truncated"] += 1
            stats["conversations"] += 1
            stats["assistant_tokens"] += int(mask.sum())
            window.append((ids, mask))
            if len(window) == pack_window:
                writer.write(window, first_fit_decreasing([len(c[0]) for c in window], seq_len))
                window = []
    if window:
        writer.write(window, first_fit_decreasing([len(c[0]) for c in window], seq_len))


def prepare_chat(tokenizer: str, inputs: Sequence[Union[str, Path]], output: Union[str, Path], seq_len: int,
                 messages_key: str = "messages", chat_template: Optional[str] = None, overlong: str = "drop",
                 strict: bool = False, workers: int = 1, pack_window: int = 1000, batch_size: int = 64,
                 overwrite: bool = False) -> dict[str, Any]:
    """Render, tokenize and pack the conversations of ``inputs`` into ``output``; returns the index (also the
    summary: ``conversations``, ``num_tokens``, ``assistant_tokens``, ``packing_efficiency``, ``dropped``,
    ``truncated``, ``skipped_no_assistant``).

    Raises:
        ValueError: a bad record (one line naming file and line/row), a tokenizer without chat template, bad sizes,
            ``output`` already holds data (unless ``overwrite``), or no conversation is left.
        FileNotFoundError: an input does not exist.
    """
    for name, value in (("seq_len", seq_len), ("workers", workers), ("pack_window", pack_window)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong={overlong!r} is not supported; use drop or truncate")
    paths = expand_inputs(inputs)
    hf = load_chat_tokenizer(tokenizer, chat_template)  # fails early: no template, no fast tokenizer
    pad_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    if pad_id is None:
        raise ValueError(f"tokenizer {tokenizer} has neither a pad nor an EOS token to pad rows with")
    out = Path(output)
    if (out / "index.json").exists() and not overwrite:
        raise ValueError(f"{out} already holds prepared data; pass --overwrite or another --output")
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.json").unlink(missing_ok=True)  # the index goes last: until then the folder is unfinished
    stats = {"skipped_no_assistant": 0, "dropped": 0, "truncated": 0, "conversations": 0, "assistant_tokens": 0}
    writer = _RowWriter(out, seq_len, int(pad_id))
    try:
        batches = _conversations(paths, messages_key, strict, stats, batch_size)
        encoded = ordered_map(_encode_batch, batches, workers, _init_worker, (tokenizer, chat_template))
        _pack(encoded, writer, seq_len, overlong, pack_window, stats)
        writer.close()
    except BaseException:
        writer.close()
        for name in ("tokens.bin", LOSS_MASK_FILE, BOUNDARIES_FILE):
            (out / f"{name}.partial").unlink(missing_ok=True)
        raise
    if writer.rows == 0:
        raise ValueError(f"no conversation left to pack from {', '.join(map(str, paths))} (skipped "
                         f"{stats['skipped_no_assistant']} without assistant turn, dropped {stats['dropped']} longer "
                         f"than seq_len={seq_len}); check the inputs or raise --seq-len / use --overlong truncate")
    writer.commit()
    index = {
        "format": CHAT_FORMAT, "version": 1, "seq_len": seq_len, "num_rows": writer.rows,
        "num_tokens": writer.rows * seq_len, "dtype": "uint32", "conversation_tokens": writer.used,
        "assistant_fraction": stats["assistant_tokens"] / max(1, writer.used),
        "packing_efficiency": writer.used / (writer.rows * seq_len),
        **stats, "pad_token_id": int(pad_id), "eos_token_id": hf.eos_token_id, "tokenizer": str(tokenizer),
        "vocab_size": len(hf), "chat_template": chat_template, "messages_key": messages_key,
        "inputs": [str(p) for p in paths], "pack_window": pack_window,
    }
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def chat_summary(index: dict[str, Any]) -> str:
    """The one summary line of a chat preparation."""
    return (f"{index['conversations']} conversations, {index['conversation_tokens']} tokens "
            f"({index['assistant_fraction']:.1%} assistant) in {index['num_rows']} rows of {index['seq_len']}: "
            f"packing efficiency {index['packing_efficiency']:.1%}; dropped {index['dropped']}, truncated "
            f"{index['truncated']}, skipped without assistant turn {index['skipped_no_assistant']}")


