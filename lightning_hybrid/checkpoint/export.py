"""``lightning-hybrid export-hf``: a sharded training checkpoint -> a Hugging Face folder of the model's own family
(``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM`` or ``Qwen3MoeForCausalLM``).

The checkpoint is read one tensor at a time with Distributed Checkpoint (which assembles the
tensor from whatever mesh wrote it), so the exporter holds at most one output shard and one tensor
in memory, never the whole model (a mixture of experts: a layer's two 3-D expert tensors, written one tensor per
expert as on the Hub). The result loads with ``AutoModelForCausalLM.from_pretrained``. A router bias of
auxiliary-loss-free balancing has no place in Qwen3-MoE's format: it is left out, with a warning (the exported
model routes without it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from lightning_hybrid.checkpoint.storage import ObjectPath, checkpoint_path, storage_reader
from lightning_hybrid.models.decoder.config import DecoderConfig
from lightning_hybrid.models.decoder.hf import TOKENIZER_FILES, expected_hf_tensors, hf_source
from lightning_hybrid.models.decoder.hf import hf_config_dict as family_config_dict

__all__ = ["export_hf", "export_main", "parse_size", "hf_config_dict", "EXPORT_DTYPES"]

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_MODEL_PREFIX = "model."


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``5GB`` (decimal, as Hugging Face counts), ``500MiB`` (binary) or a plain integer.

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not match or match.group(2) not in _UNITS:
            raise ValueError(f"max_shard_size={size!r} is not a size; use e.g. 5GB, 500MB, 2GiB or a byte count")
        value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


def hf_config_dict(config: DecoderConfig, dtype: torch.dtype, base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The ``config.json`` of ``config`` for its family's ``transformers`` class, with weights of ``dtype``; ``base``
    (the imported model's) keeps its other keys (token ids, ...). See
    :func:`lightning_hybrid.models.decoder.hf.hf_config_dict`."""
    return family_config_dict(config, _DTYPE_NAMES[dtype], base)


def _read_meta(checkpoint: Path) -> tuple[DecoderConfig, dict[str, Any]]:
    meta_path = checkpoint / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"no meta.json in {checkpoint}: not a lightning-hybrid checkpoint folder, or a save "
                                f"that did not finish; pass a committed step-N folder")
    meta = json.loads(meta_path.read_text())
    hparams = meta.get("hparams") or {}
    values = meta.get("model_config") or (hparams.get("model") if isinstance(hparams.get("model"), dict) else None)
    if not values:
        raise ValueError(f"{meta_path} has no model_config; the checkpoint was not written by lightning-hybrid")
    return DecoderConfig.from_dict(values), hparams


def _import_folder(init_from_hf: Optional[str]) -> Optional[Path]:
    """The folder the weights were imported from, if it is still on disk (or in the Hub cache); never downloads."""
    if not init_from_hf:
        return None
    if Path(init_from_hf).is_dir():
        return Path(init_from_hf)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=init_from_hf, local_files_only=True, allow_patterns=["*.json", "*.txt"]))
    except Exception:  # noqa: BLE001 - not cached, not a repo id, no hub: export without its extras
        return None


class _MetadataOnceReader(FileSystemReader):
    """A DCP reader that parses the checkpoint's ``.metadata`` once, not once per tensor loaded."""

    _cached: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached is None:
            self._cached = super().read_metadata(*args, **kwargs)
        return self._cached


def _reader(checkpoint: Any) -> Any:
    """The DCP reader of ``checkpoint``: local files, or DCP's fsspec reader for an object store (its options)."""
    if not isinstance(checkpoint, ObjectPath):
        return _MetadataOnceReader(str(checkpoint))
    reader = storage_reader(checkpoint)
    metadata = reader.read_metadata()  # parsed once: the export loads one tensor at a time
    reader.read_metadata = lambda *args, **kwargs: metadata
    return reader


def _plan_shards(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def _hf_order(name: str) -> tuple[int, int, str]:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return (0 if "embed_tokens" in name else 2 if name.startswith("model.") else 3, 0, name)


def export_hf(checkpoint_dir: Union[str, Path], out_dir: Union[str, Path], dtype: str = "bf16",
              max_shard_size: Union[int, str] = "5GB", overwrite: bool = False) -> Path:
    """Write a Hugging Face folder of the checkpoint's family (its ``model_config``'s ``model_type``) from a
    lightning-hybrid checkpoint, streaming tensor by tensor.

    Writes ``model-0000N-of-0000M.safetensors`` shards of at most ``max_shard_size`` (a larger tensor gets a
    shard of its own), ``model.safetensors.index.json``, ``config.json``, ``generation_config.json`` and, when
    the folder the weights were imported from is still available, its tokenizer files.

    Args:
        checkpoint_dir: a committed checkpoint folder (DCP files and ``meta.json``), local or an fsspec URL
            (``s3://bucket/prefix/step-000400``; credentials and endpoint from the environment).
        out_dir: where to write; created, and it must be empty unless ``overwrite``.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        max_shard_size: ``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes.
        overwrite: replace the files of an earlier export in ``out_dir``.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: a bad dtype or size, ``out_dir`` not empty, or the checkpoint lacks a tensor of the model
            (or has one of another shape).
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}")
    out_dtype = EXPORT_DTYPES[dtype]
    limit = parse_size(max_shard_size)
    checkpoint, out = checkpoint_path(checkpoint_dir), Path(out_dir)
    config, hparams = _read_meta(checkpoint)
    _prepare_out_dir(out, overwrite)
    reader = _reader(checkpoint)
    stored, expected = _check_stored_tensors(reader, checkpoint, config)
    _write_weights(reader, stored, expected, out, out_dtype, limit, config)
    _write_configs(out, config, out_dtype, _import_folder(hparams.get("init_from_hf")))
    return out


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    """Create ``out``; an earlier export's weights are removed only with ``overwrite``."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"{out} is not empty; choose a new folder or pass --overwrite")
        for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
            old.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _check_stored_tensors(reader: "_MetadataOnceReader", checkpoint: Path,
                          config: DecoderConfig) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(our name -> DCP metadata of the stored model tensors, HF name -> shape the model needs).

    Raises:
        ValueError: a tensor of the model is missing or has another shape.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {key[len(_MODEL_PREFIX):]: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
              if key.startswith(_MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    expected = expected_hf_tensors(config)
    for name in sorted(expected, key=_hf_order):
        ours, index = hf_source(name, config)
        if ours not in stored:
            raise ValueError(f"checkpoint {checkpoint} has no tensor {_MODEL_PREFIX}{ours}; it is not a complete "
                             f"{config.name!r} checkpoint")
        size = tuple(torch.empty(stored[ours].size, device="meta")[index].shape)
        if size != expected[name]:
            raise ValueError(f"tensor {_MODEL_PREFIX}{ours} in {checkpoint} has shape {list(stored[ours].size)} but "
                             f"model_config in meta.json expects {list(expected[name])}")
    if any(key.endswith("e_score_correction_bias") for key in stored):
        warnings.warn(f"{checkpoint} holds the routing biases of auxiliary-loss-free balancing "
                      f"(router_bias_update_rate); Qwen3-MoE has no such tensor, and the exported model routes "
                      f"without them")
    return stored, expected


def _same_layer(a: str, b: str) -> bool:
    """Whether our tensors ``a`` and ``b`` are experts of one layer (kept loaded together while it is written)."""
    return ".experts." in a and a.split(".mlp.")[0] == b.split(".mlp.")[0]


def _write_weights(reader: "_MetadataOnceReader", stored: dict[str, Any], expected: dict[str, tuple[int, ...]],
                   out: Path, out_dtype: torch.dtype, limit: int, config: DecoderConfig) -> None:
    """Stream the tensors into safetensors shards of at most ``limit`` bytes, one tensor in memory at a time,
    and write the shard index."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    names = sorted(expected, key=_hf_order)
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    sizes = {name: itemsize * int(torch.Size(expected[name]).numel()) for name in names}
    shards = _plan_shards(names, sizes, limit)
    weight_map: dict[str, str] = {}
    loaded: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        for number, shard in enumerate(shards, start=1):
            file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for name in shard:
                ours, index = hf_source(name, config)
                if ours not in loaded:  # one stored tensor at a time (a layer's experts: its two 3-D tensors)
                    loaded = {key: value for key, value in loaded.items() if _same_layer(key, ours)}
                    meta = stored[ours]
                    loaded[ours] = torch.empty(meta.size, dtype=meta.properties.dtype)
                    dcp.load({_MODEL_PREFIX + ours: loaded[ours]}, storage_reader=reader, no_dist=True)
                tensors[name] = loaded[ours][index].to(out_dtype).contiguous()
                weight_map[name] = file
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_configs(out: Path, config: DecoderConfig, out_dtype: torch.dtype, source: Optional[Path]) -> None:
    """``config.json`` and ``generation_config.json``, and the tokenizer files of the folder imported from."""
    base = None
    if source is not None and (source / "config.json").is_file():
        base = json.loads((source / "config.json").read_text())
    hf_config = hf_config_dict(config, out_dtype, base)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
    else:
        generation = {"_from_model_config": True, "bos_token_id": hf_config["bos_token_id"],
                      "eos_token_id": hf_config["eos_token_id"]}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)


def export_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-hybrid export-hf CHECKPOINT_DIR OUT_DIR [--dtype bf16] [--max-shard-size 5GB]``."""
    parser = argparse.ArgumentParser(prog="lightning-hybrid export-hf",
                                     description="Write a Hugging Face folder (safetensors, config.json of "
                                     "the model's family) from a checkpoint.")
    parser.add_argument("checkpoint_dir", help="a committed checkpoint folder (step-N, with meta.json), local or an "
                        "fsspec URL (s3://bucket/run/step-N; credentials and endpoint from the environment)")
    parser.add_argument("out_dir", help="output folder (created; must be empty unless --overwrite)")
    parser.add_argument("--dtype", choices=list(EXPORT_DTYPES), default="bf16", help="dtype of the written weights")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (5GB, 500MB, 2GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT_DIR")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        out = export_hf(args.checkpoint_dir, args.out_dir, args.dtype, args.max_shard_size, args.overwrite)
    except (FileNotFoundError, ValueError) as err:
        print(f"lightning-hybrid export-hf: error: {err}", file=sys.stderr)
        return 2  # a user's mistake: the exit code of every lightning-hybrid subcommand for one
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = len(set(index["weight_map"].values()))
    print(f"wrote {len(index['weight_map'])} tensors ({index['metadata']['total_size'] / 1e9:.2f} GB, {args.dtype}) "
          f"in {shards} shard(s) to {out}")
    return 0
