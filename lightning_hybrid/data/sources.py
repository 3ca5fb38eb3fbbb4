"""Input records for ``prepare-data``: JSONL lines, Parquet rows and local Hugging Face ``datasets`` folders or files,
each with a location (``file:line`` or ``file:row N``) that error messages name.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

__all__ = ["expand_inputs", "iter_records", "JSONL_SUFFIXES", "PARQUET_SUFFIXES", "ARROW_SUFFIXES",
           "TOKENIZER_PATTERNS"]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
# The files of a tokenizer folder (fetched from the Hub without the weights).
TOKENIZER_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)


def expand_inputs(patterns: Sequence[Union[str, Path]]) -> list[Path]:
    """The files and dataset folders that ``patterns`` (paths or globs) name, globs sorted, in the given order.

    Raises:
        FileNotFoundError: a pattern matches nothing.
    """
    paths: list[Path] = []
    for pattern in patterns:
        text = str(pattern)
        matches = sorted(glob.glob(text)) if glob.has_magic(text) else ([text] if Path(text).exists() else [])
        if not matches:
            raise FileNotFoundError(f"input {text} does not exist")
        paths.extend(Path(m) for m in matches)
    return paths


def is_hf_dataset_folder(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def _parquet_rows(path: Path, column: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ValueError(f"{path}: reading Parquet needs pyarrow; pip install 'lightning-hybrid[data]'") from err

    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    if column not in names:
        raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(names)}); pass the key of the column "
                         f"that holds the data (--text-key / --messages-key)")
    row = 0
    for batch in file.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield f"{path}:row {row}", {column: value}
            row += 1


def _hf_rows(path: Path, column: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(f"{path}: reading a datasets folder needs datasets; pip install 'lightning-hybrid[data]'"
                         ) from err
    data = datasets.Dataset.from_file(str(path)) if path.is_file() else datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(data)}); "
                             f"pass the folder of one split")
        data = data["train"]
    if column not in data.column_names:
        raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(data.column_names)}); pass the key of "
                         f"the column that holds the data (--text-key / --messages-key)")
    for row, value in enumerate(data[column] if len(data) <= 100_000 else (r[column] for r in data)):
        yield f"{path}:row {row}", {column: value}


def iter_records(paths: Sequence[Path], key: str) -> Iterator[tuple[str, Any]]:
    """``(location, record)`` for every record of ``paths``: JSONL objects, Parquet rows, rows of a ``datasets``
    folder (``save_to_disk``) or ``.arrow`` file. Parquet and datasets records hold only the column ``key``.

    Raises:
        ValueError: an unreadable line, a file of another kind, or a Parquet/datasets input without column ``key``.
    """
    for path in paths:
        suffix = path.suffix.lower()
        if is_hf_dataset_folder(path) or suffix in ARROW_SUFFIXES:
            yield from _hf_rows(path, key)
        elif suffix in PARQUET_SUFFIXES:
            yield from _parquet_rows(path, key)
        elif suffix in JSONL_SUFFIXES:
            with path.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
                    yield f"{path}:{number}", record
        else:
            raise ValueError(f"{path}: not a .jsonl, .parquet, .arrow file or a datasets folder; chat data comes "
                             f"as records with a messages list")
