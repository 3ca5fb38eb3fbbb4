"""``lightning-hybrid prepare-data``: tokenize text or JSONL into a packed uint32 token file.

Every document is tokenized with the model's fast tokenizer (no special tokens added) and followed
by the EOS token; the results are concatenated into ``tokens.bin``, read back memory-mapped by
:class:`~lightning_hybrid.data.packed.PackedTokenDataset`. Documents are streamed in batches, so
the corpus never has to fit in memory. ``index.json`` is written last: a folder without it, or whose
token file does not have the size it records, is an unfinished run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from lightning_hybrid.data.packed import INDEX_FILE, TOKENS_FILE
from lightning_hybrid.data.parallel_map import ordered_map
from lightning_hybrid.data.sources import (
    ARROW_SUFFIXES,
    PARQUET_SUFFIXES,
    TOKENIZER_PATTERNS,
    expand_inputs,
    iter_records,
)

__all__ = ["prepare_data", "prepare_main", "load_tokenizer", "Tokenizer", "iter_documents"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass
class Tokenizer:
    """A batch encoder and its EOS token id."""

    encode_batch: Callable[[list[str]], list[list[int]]]
    eos_token_id: int
    eos_token: str
    vocab_size: int
    source: str


def _eos_from_config(folder: Path) -> Optional[str]:
    file = folder / "tokenizer_config.json"
    if not file.is_file():
        return None
    token = json.loads(file.read_text()).get("eos_token")
    return token.get("content") if isinstance(token, dict) else token


def load_tokenizer(path_or_repo: str, eos_token: Optional[str] = None, backend: str = "auto") -> Tokenizer:
    """The fast tokenizer of a Hugging Face folder or repo id (only its tokenizer files are fetched).

    ``backend="transformers"`` uses ``AutoTokenizer.from_pretrained``; ``"tokenizers"`` reads ``tokenizer.json``
    with the ``tokenizers`` library and the EOS token from ``tokenizer_config.json``; ``"auto"`` prefers
    transformers when it is installed.

    Raises:
        ValueError: no fast tokenizer there, or it has no EOS token (pass ``eos_token``).
    """
    from lightning_hybrid.hub import resolve_hf_path

    folder = resolve_hf_path(path_or_repo, allow_patterns=TOKENIZER_PATTERNS)
    if backend == "auto":
        try:
            import transformers  # noqa: F401

            backend = "transformers"
        except ImportError:
            backend = "tokenizers"
    if backend == "transformers":
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder))
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{path_or_repo} has no fast tokenizer (tokenizer.json); prepare-data needs one")
        token = eos_token or hf.eos_token
        token_id = hf.convert_tokens_to_ids(token) if token is not None else None
        if token_id == hf.unk_token_id and token != hf.unk_token:
            token_id = None

        def encode(texts: list[str]) -> list[list[int]]:
            return hf(texts, add_special_tokens=False)["input_ids"]

        vocab_size = len(hf)
    elif backend == "tokenizers":
        from tokenizers import Tokenizer as RawTokenizer

        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"no tokenizer.json in {folder}; prepare-data needs a fast tokenizer")
        raw = RawTokenizer.from_file(str(file))
        token = eos_token or _eos_from_config(folder)
        token_id = raw.token_to_id(token) if token is not None else None

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]

        vocab_size = raw.get_vocab_size(with_added_tokens=True)
    else:
        raise ValueError(f"backend={backend!r} is not supported; use auto, transformers or tokenizers")
    if token is None or token_id is None:
        missing = "" if token is None else f" {token!r} in its vocabulary"
        raise ValueError(f"tokenizer {path_or_repo} has no EOS token{missing}; "
                         f"pass --eos-token with a token of its vocabulary")
    return Tokenizer(encode, int(token_id), str(token), int(vocab_size), str(path_or_repo))


def iter_documents(files: Iterable[Union[str, Path]], text_key: str = "text", text_mode: str = "file") -> Iterator[str]:
    """The documents of ``files`` in order: one per line of a ``.jsonl`` file (its ``text_key`` field); for
    other files the whole file (``text_mode="file"``) or each non-empty line (``"line"``).

    Raises:
        FileNotFoundError: an input does not exist.
        ValueError: a JSONL line is not an object with a string ``text_key``.
    """
    if text_mode not in ("file", "line"):
        raise ValueError(f"text_mode={text_mode!r} is not supported; use file or line")
    for name in files:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"input {path} does not exist")
        suffix = path.suffix.lower()
        if suffix in PARQUET_SUFFIXES or suffix in ARROW_SUFFIXES or suffix in _JSONL_SUFFIXES or path.is_dir():
            for location, record in iter_records([path], text_key):  # JSON lines, Parquet rows, datasets records
                text = record.get(text_key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{location}: no string field {text_key!r}; pass --text-key with the field "
                                     f"that holds the text")
                yield text
        elif text_mode == "line":
            with path.open(encoding="utf-8") as lines:
                for line in lines:
                    if line.strip():
                        yield line.rstrip("\n")
        else:
            yield path.read_text(encoding="utf-8")


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


_text_tokenizer: Optional[Tokenizer] = None


def _with_eos(ids: list[list[int]], eos_token_id: int) -> np.ndarray:
    """The documents' ids concatenated, each followed by EOS.

    Raises:
        ValueError: a token id does not fit uint32.
    """
    flat = np.empty(sum(len(doc) + 1 for doc in ids), dtype=np.int64)
    position = 0
    for doc in ids:
        flat[position:position + len(doc)] = doc
        flat[position + len(doc)] = eos_token_id
        position += len(doc) + 1
    if flat.size and (flat.min() < 0 or flat.max() >= 2**32):
        raise ValueError(f"token id {int(flat.max())} does not fit uint32")
    return flat


def _checked_inputs(inputs: Sequence[Union[str, Path]], workers: int) -> list[Path]:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer")
    return expand_inputs(inputs)


def _init_text_worker(tokenizer: Union[str, Tokenizer], eos_token: Optional[str]) -> None:
    global _text_tokenizer
    _text_tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer, eos_token)


def _encode_with_worker_tokenizer(batch: list[str]) -> tuple[int, list[list[int]]]:
    assert _text_tokenizer is not None
    return len(batch), _text_tokenizer.encode_batch(batch)


def _too_few_tokens(inputs: Sequence[Union[str, Path]], num_tokens: int, seq_len: int,
                    created: Optional[Path]) -> ValueError:
    """The error for inputs that give less than one sequence, naming them; removes ``created`` (the output folder
    this call made), so nothing is left behind."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    names = ", ".join(map(str, inputs[:3])) + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")
    return ValueError(f"the inputs ({names}) give {num_tokens} tokens, fewer than one sequence of seq_len={seq_len} "
                      f"needs ({seq_len + 1}); add text or lower --seq-len"
                      f"{'; nothing was written' if created is not None else ''}")


def prepare_data(tokenizer: Union[str, Tokenizer], inputs: Sequence[Union[str, Path]], output: Union[str, Path],
                 seq_len: int, text_key: str = "text", text_mode: str = "file", eos_token: Optional[str] = None,
                 batch_size: int = 256, overwrite: bool = False, workers: int = 1) -> dict[str, Any]:
    """Tokenize ``inputs`` (text, JSONL, Parquet with a ``text_key`` column, or ``datasets`` folders; globs are
    expanded) with ``workers`` processes into ``output/tokens.bin`` (uint32, EOS after every document) and
    ``output/index.json``; the bytes do not depend on ``workers``.

    Returns:
        The index: ``seq_len``, ``num_tokens``, ``num_sequences`` (``(num_tokens - 1) // seq_len``), ``dtype``,
        ``documents``, ``tokenizer``, ``eos_token_id``, ``eos_token``, ``vocab_size``, ``inputs``.

    Raises:
        ValueError: ``seq_len`` not positive, ``output`` already holds data (unless ``overwrite``), the inputs give
            fewer than ``seq_len + 1`` tokens, or a token id does not fit uint32.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    inputs = _checked_inputs(inputs, workers)  # checked before the tokenizer, which may be a download
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer, eos_token)
    out = Path(output)
    if (out / INDEX_FILE).exists() and not overwrite:
        raise ValueError(f"{out} already holds prepared data; choose a new folder or pass --overwrite")
    created = not out.exists()  # removed again when nothing is written
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_FILE).unlink(missing_ok=True)
    partial = out / (TOKENS_FILE + ".partial")
    num_tokens = documents = 0
    try:
        with partial.open("wb") as sink:
            batches = _batches(iter_documents(inputs, text_key, text_mode), batch_size)
            # Workers load the tokenizer themselves; batches come back in order, so any number of workers writes
            # the same bytes.
            for count, ids in ordered_map(_encode_with_worker_tokenizer, batches, workers, _init_text_worker,
                                          (tok.source if workers > 1 else tok, eos_token)):
                flat = _with_eos(ids, tok.eos_token_id)
                flat.astype(np.uint32).tofile(sink)
                num_tokens += int(flat.size)
                documents += count
            sink.flush()
            os.fsync(sink.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)  # an interrupted run leaves no half-written token file
        raise
    if num_tokens < seq_len + 1:
        partial.unlink()
        raise _too_few_tokens(inputs, num_tokens, seq_len, out if created else None)
    os.replace(partial, out / TOKENS_FILE)
    index = {
        "format": "lightning-hybrid packed tokens", "version": 1, "seq_len": seq_len, "num_tokens": num_tokens,
        "num_sequences": (num_tokens - 1) // seq_len, "dtype": "uint32", "documents": documents,
        "tokenizer": tok.source, "eos_token_id": tok.eos_token_id, "eos_token": tok.eos_token,
        "vocab_size": tok.vocab_size, "inputs": [str(p) for p in inputs], "text_key": text_key,
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return index


def prepare_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-hybrid prepare-data --tokenizer PATH_OR_REPO --input FILES... --output DIR --seq-len N``."""
    parser = argparse.ArgumentParser(prog="lightning-hybrid prepare-data",
                                     description="Tokenize text, JSONL, Parquet or chat conversations into packed "
                                                 "token files.")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face folder or repo id with tokenizer.json")
    parser.add_argument("--input", required=True, nargs="+",
                        help="files or globs: text, .jsonl (one record a line), .parquet, .arrow or a datasets folder")
    parser.add_argument("--output", required=True, help="output folder (tokens.bin, index.json, ...)")
    parser.add_argument("--seq-len", required=True, type=int, help="training sequence length")
    parser.add_argument("--format", choices=["text", "chat"], default="text",
                        help="text: documents + EOS in one stream; chat: conversations with the tokenizer's chat "
                             "template, assistant-only labels, packed rows with document boundaries")
    parser.add_argument("--text-key", default="text", help="JSONL field / Parquet column holding the text")
    parser.add_argument("--messages-key", default="messages", help="field / column holding a conversation's messages")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the tokenizer's own")
    parser.add_argument("--overlong", choices=["drop", "truncate"], default="drop",
                        help="a conversation longer than --seq-len is dropped or truncated (counted either way)")
    parser.add_argument("--strict", action="store_true",
                        help="refuse a conversation without assistant turn instead of skipping it")
    parser.add_argument("--pack-window", type=int, default=1000,
                        help="conversations packed together (first-fit decreasing within each window)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (the output does not depend on it)")
    parser.add_argument("--text-mode", choices=["file", "line"], default="file",
                        help="a plain text file is one document (file) or one per non-empty line (line)")
    parser.add_argument("--eos-token", default=None, help="EOS token, if the tokenizer does not define one")
    parser.add_argument("--batch-size", type=int, default=256, help="documents tokenized per batch")
    parser.add_argument("--overwrite", action="store_true", help="replace data already in --output")
    args = parser.parse_args(list(argv) if argv is not None else None)
    start = time.perf_counter()
    try:
        if args.format == "chat":
            from lightning_hybrid.data.prepare_chat import chat_summary, prepare_chat

            index = prepare_chat(args.tokenizer, args.input, args.output, args.seq_len, args.messages_key,
                                 args.chat_template, args.overlong, args.strict, args.workers, args.pack_window,
                                 max(1, args.batch_size // 4), args.overwrite)
            summary = chat_summary(index)
            tokens = index["conversation_tokens"]
        else:
            index = prepare_data(args.tokenizer, args.input, args.output, args.seq_len, args.text_key,
                                 args.text_mode, args.eos_token, args.batch_size, args.overwrite, args.workers)
            summary = (f"{index['num_tokens']} tokens from {index['documents']} documents "
                       f"({index['num_sequences']} sequences of {index['seq_len']})")
            tokens = index["num_tokens"]
    except (FileNotFoundError, ValueError) as err:
        print(f"lightning-hybrid prepare-data: error: {err}", file=sys.stderr)
        return 2  # a user's mistake: the exit code of every lightning-hybrid subcommand for one
    seconds = time.perf_counter() - start
    print(f"wrote {summary} to {args.output} in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s, "
          f"{args.workers} worker{'s' if args.workers > 1 else ''})")
    return 0
