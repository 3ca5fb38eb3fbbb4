"""Hugging Face checkpoints of the decoder core's families: the name table, lazy sharded loading, ``config.json`` out.

A rank never reads a whole model: for each of its parameters (a plain tensor, a TP or FSDP2 shard,
or one pipeline stage's part) it computes the region of the global tensor it holds and reads just
that slice from the safetensors file through safetensors' memory-mapped slice API. Only
safetensors files are read, so loading never unpickles anything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_hybrid.hub import resolve_hf_path
from lightning_hybrid.models.decoder.config import BLOCK_TENSORS, DecoderConfig, block_tensor_shapes
from lightning_hybrid.models.decoder.hf_config import ATTENTION_BIAS_FIELD, MLP_BIAS_FIELD, QWEN_WINDOW
from lightning_hybrid.models.decoder.hf_experts import (
    is_fused_layout,
    per_expert_source,
    per_expert_tensors,
    read_experts_region,
)
from lightning_hybrid.models.decoder.moe_config import is_expert_tensor

__all__ = [
    "HF_NAME_TABLE", "hf_to_ours", "ours_to_hf", "load_hf_weights", "check_hf_folder", "expected_hf_tensors",
    "SafetensorsFolder", "read_stats", "ARCHITECTURE_FIELDS", "TOKENIZER_FILES", "hf_config_dict", "hf_source",
]

# The one mapping between Hugging Face tensor names and ours, read in both directions. ``{i}`` is the
# global block index. The q/k/v bias and q/k norm names map too; a config without ``attention_bias`` (or ``qk_norm``)
# expects none of them (:func:`expected_hf_tensors` follows :func:`block_tensor_shapes`).
HF_NAME_TABLE: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "embed_tokens.weight"),
    *((f"model.layers.{{i}}.{suffix}", f"layers.{{i}}.{suffix}") for suffix in BLOCK_TENSORS),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)

# Tensors some exporters add that carry no learned weights (the rotary table is recomputed).
_IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# Fields of config.json that decide shapes or math; all must agree with the model asked for.
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "rope_theta",
                       "rms_norm_eps", "attention_bias", "model_type", "head_dim", "rope_scaling", "num_experts",
                       "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                       "decoder_sparse_step")

# Files of a Hugging Face folder that belong to the tokenizer (copied on export).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")



def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_FORWARD = [(_compile(hf), ours) for hf, ours in HF_NAME_TABLE]
_BACKWARD = [(_compile(ours), hf) for hf, ours in HF_NAME_TABLE]


def _translate(name: str, table: list[tuple[re.Pattern[str], str]]) -> Optional[str]:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.replace("{i}", match.group("i")) if "i" in match.groupdict() else target
    return None


def hf_to_ours(name: str) -> Optional[str]:
    """Our parameter name for a Hugging Face tensor name, or ``None`` when the table has no such tensor."""
    return _translate(name, _FORWARD)


def ours_to_hf(name: str) -> str:
    """The Hugging Face tensor name of our parameter ``name``.

    Raises:
        KeyError: ``name`` is not a parameter of the decoder core.
    """
    hf = _translate(name, _BACKWARD)
    if hf is None:
        raise KeyError(f"{name!r} is not a Qwen2 parameter name, nor one of Llama, Qwen3, Mistral or Qwen3-MoE; the "
                       f"mapping knows {len(HF_NAME_TABLE)} patterns "
                       f"(embed_tokens.weight, layers.N.<...>, norm.weight, lm_head.weight)")
    return hf


def expected_hf_tensors(config: DecoderConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a checkpoint of ``config`` holds (no ``lm_head`` when tied); a
    mixture of experts' experts one tensor per expert (the Hub's layout) or, with ``fused_experts``, two 3-D
    tensors per layer (:mod:`.hf_experts`)."""
    h, vocab = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, h)}
    experts: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_hidden_layers):
        for name, (shape, _) in block_tensor_shapes(config, i).items():
            if is_expert_tensor(name) and not fused_experts:
                continue
            shapes[f"layers.{i}.{name}"] = shape
        if config.mlp_kind(i) == "experts" and not fused_experts:
            experts.update(per_expert_tensors(i, config.num_experts, h, config.moe_intermediate_size))
    shapes["norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return {**{ours_to_hf(name): shape for name, shape in shapes.items()}, **experts}


def hf_source(name: str, config: DecoderConfig) -> tuple[str, tuple[Any, ...]]:
    """(our tensor, the index of it) that the Hugging Face tensor ``name`` of a checkpoint of ``config`` holds: the
    whole tensor (``()``) but for a per-expert tensor of a mixture of experts (a slice of our 3-D experts).

    Raises:
        KeyError: ``name`` is no tensor of the decoder core.
    """
    if config.has_experts:
        source = per_expert_source(name, config.moe_intermediate_size)
        if source is not None:
            return source
    ours = hf_to_ours(name)
    if ours is None:
        raise KeyError(f"{name!r} is no tensor of a {config.model_type} checkpoint")
    return ours, ()


@dataclass
class ReadStats:
    """What the last :func:`load_hf_weights` call in this process read from disk."""

    bytes_read: int = 0
    tensors_read: int = 0

    def reset(self) -> None:
        self.bytes_read = 0
        self.tensors_read = 0


read_stats = ReadStats()


class SafetensorsFolder:
    """The tensors of a Hugging Face folder: one ``model.safetensors`` or the shards its index lists.

    Files are opened lazily (memory-mapped) and headers read without touching tensor data. Use as a
    context manager so the files are closed.

    Raises:
        FileNotFoundError: the folder has no safetensors file (``.bin``/``.pt`` files are refused: they are pickles).
        ValueError: the index names a shard that does not exist.
    """

    def __init__(self, folder: Union[str, Path]) -> None:
        self.folder = Path(folder)
        self._stack: Optional[ExitStack] = None
        self._handles: dict[str, Any] = {}
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            missing = sorted({f for f in weight_map.values() if not (self.folder / f).is_file()})
            if missing:
                raise ValueError(f"{index} lists {len(missing)} shard(s) that are not there: {', '.join(missing[:3])}; "
                                 f"the download is incomplete")
            self.weight_map = dict(weight_map)
            self._files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in self.folder.glob(pattern))
                hint = (f" (found {', '.join(pickles[:3])}: pickled weights are never loaded; convert them to "
                        f"safetensors)" if pickles else "")
                raise FileNotFoundError(f"no *.safetensors files in {self.folder}{hint}")
            self._files = files
            self.weight_map = {}
            for file in files:
                for name in self._handle(file).keys():
                    self.weight_map[name] = file

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            if self._stack is None:
                self._stack = ExitStack()
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(self.folder / file), framework="pt"))
            except Exception as err:  # noqa: BLE001 - safetensors' own error type; one line naming the file instead
                raise ValueError(f"{self.folder / file}: not a readable safetensors file ({type(err).__name__}: "
                                 f"{' '.join(str(err).split())}); download it again") from None
        return self._handles[file]

    def check_files(self) -> None:
        """Open every file's header (no tensor data), so a damaged or truncated file fails here, on every rank
        alike, before any collective.

        Raises:
            ValueError: one line naming the file and the error.
        """
        for file in self._files:
            self._handle(file)

    def __enter__(self) -> "SafetensorsFolder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self._handles = None, {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of tensor ``name``; only those bytes are read."""
        part = self._handle(self.weight_map[name]).get_slice(name)
        tensor = part[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        read_stats.bytes_read += tensor.numel() * tensor.element_size()
        read_stats.tensors_read += 1
        return tensor


def _check_config(folder: Path, config: DecoderConfig) -> None:
    if not (folder / "config.json").is_file():
        return  # weights only; the shape checks below still catch a different model
    found = DecoderConfig.from_hf(folder)
    diffs = [f"{k}={getattr(found, k)!r} (asked for {getattr(config, k)!r})" for k in ARCHITECTURE_FIELDS
             if getattr(found, k) != getattr(config, k)]
    if diffs:
        raise ValueError(f"{folder} holds another model than {config.name!r}: {', '.join(diffs)}; pass "
                         f"model={str(folder)!r} (its config.json) or the preset that matches these weights")


def _check_tensors(files: SafetensorsFolder, config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor present, nothing extra, every shape right; the same verdict on every rank (headers only)."""
    present = set(files.names())
    expected = expected_hf_tensors(config, fused_experts=is_fused_layout(present))
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"tensor {missing[0]} is missing from {files.folder}{more}; the folder does not hold a "
                         f"complete {config.name!r} checkpoint")
    allowed = set(expected)
    if config.tie_word_embeddings:
        allowed.add("lm_head.weight")  # some exporters write the tied head anyway; it equals the embedding
    extra = sorted(n for n in present - allowed if not _IGNORED_HF.match(n))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"unexpected tensor {extra[0]} in {files.folder}{more}: not part of a {config.model_type} "
                         f"model with "
                         f"{config.num_hidden_layers} layers and tie_word_embeddings={config.tie_word_embeddings}")
    for name, shape in expected.items():
        found = files.shape(name)
        if found != shape:
            raise ValueError(f"tensor {name} in {files.folder} has shape {list(found)} but the model expects "
                             f"{list(shape)}; the weights are from another model size")
    return expected


def _parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from lightning_hybrid.init_weights import canonical_name

    for raw, param in model.named_parameters():
        yield canonical_name(raw), param


def check_hf_folder(path_or_repo: Union[str, Path], config: DecoderConfig) -> None:
    """What :func:`load_hf_weights` checks before reading a weight (the folder, ``config.json``, every file's header,
    every tensor's name and shape), for the command line before any process starts. A Hub repo id that is not a
    local folder is left to the training processes (it may still have to be downloaded).

    Raises:
        FileNotFoundError: no such local folder, or no safetensors files in it.
        ValueError: a damaged file (named), another model, a missing, extra or misshapen tensor.
    """
    from lightning_hybrid.hub import is_repo_id

    path = Path(path_or_repo).expanduser()
    if not path.exists() and is_repo_id(str(path_or_repo)):
        return
    folder = resolve_hf_path(path_or_repo)
    _check_config(folder, config)
    with SafetensorsFolder(folder) as files:
        files.check_files()
        _check_tensors(files, config)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path_or_repo: Union[str, Path], config: DecoderConfig) -> None:
    """Fill the materialized parameters of ``model`` from a Hugging Face checkpoint of its family, slice by slice.

    ``model`` may be a plain :class:`~lightning_hybrid.models.decoder.Decoder`, one whose parameters are TP or FSDP2
    DTensor shards, or a pipeline stage container holding some blocks; parameter names must be the
    global ones. Each rank reads only the regions of its shards. No collective is used, and all checks
    read headers only, so a bad folder fails the same way on every rank.

    Args:
        model: the materialized module to fill.
        path_or_repo: a local folder or a Hub repo id (see :func:`resolve_hf_path`).
        config: the configuration the model was built with; ``config.json`` must agree with it.

    Raises:
        FileNotFoundError: no such folder or repo, or no safetensors files in it.
        ValueError: ``config.json`` describes another model, a tensor is missing, extra or of the wrong
            shape, or ``model`` has a parameter that is not a weight of the checkpoint.
    """
    from lightning_hybrid.init_weights import local_region

    read_stats.reset()
    folder = resolve_hf_path(path_or_repo)
    _check_config(folder, config)
    with SafetensorsFolder(folder) as files:
        files.check_files()
        expected = _check_tensors(files, config)
        per_expert = not is_fused_layout(expected)
        for name, param in _parameters(model):
            local, shape, offset = local_region(param)
            if per_expert and is_expert_tensor(name):  # assembled from the experts' own tensors
                if local.numel():
                    local.copy_(read_experts_region(files, name, offset, tuple(local.shape),
                                                    config.moe_intermediate_size))
                continue
            hf = ours_to_hf(name)
            if hf not in expected:  # e.g. lm_head of a model built untied from a tied config
                raise ValueError(f"parameter {name} of the model has no tensor {hf} in a checkpoint of {config.name!r}")
            if shape != expected[hf]:
                raise ValueError(f"parameter {name} has shape {list(shape)} but tensor {hf} in {folder} has "
                                 f"{list(expected[hf])}")
            if local.numel() == 0:
                continue
            local.copy_(files.read(hf, offset, tuple(local.shape)))


def hf_config_dict(config: DecoderConfig, dtype_name: str, base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The ``config.json`` of ``config`` for its family's ``transformers`` class (``Qwen2ForCausalLM``,
    ``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Qwen3MoeForCausalLM``); ``base`` (the
    imported model's ``config.json``) keeps its other keys (token ids, ...).

    Args:
        config: the model's configuration.
        dtype_name: the weights' dtype as transformers names it (``bfloat16``, ``float16``, ``float32``).
        base: the ``config.json`` the weights were imported from, if any.
    """
    values: dict[str, Any] = dict(base or {})
    for key in ("rope_scaling", "rope_parameters", "name", "layer_types", "use_sliding_window", "sliding_window",
                "max_window_layers", "attention_bias", "mlp_bias", "head_dim"):
        values.pop(key, None)
    family = config.family
    values.update({
        "architectures": [family.architecture],
        "model_type": config.model_type,
        "hidden_act": "silu",
        "attention_dropout": values.get("attention_dropout", 0.0),
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    })
    if config.model_type in QWEN_WINDOW:
        values.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers)
    if config.model_type == "mistral":
        values["sliding_window"] = None  # transformers' MistralConfig defaults to a 4,096-token window
    if config.model_type in ATTENTION_BIAS_FIELD:
        values["attention_bias"] = False
    if config.model_type in MLP_BIAS_FIELD:
        values["mlp_bias"] = False
    fields = config.to_dict()
    for key in ("name", "model_type", "rope_scaling", "router_bias_update_rate"):
        fields.pop(key, None)
    values.pop("num_local_experts", None)  # written as num_experts, which transformers 4 and 5 both read
    if config.model_type != "qwen2" or config.head_dim * config.num_attention_heads != config.hidden_size:
        fields["head_dim"] = config.head_dim
    values.update(fields)
    scaling = config.rope_scaling.to_dict() if config.rope_scaling is not None else None
    values["rope_scaling"] = scaling  # the classic layout (transformers 4.x) ...
    values["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta}  # ... 5.x
    values.setdefault("bos_token_id", None)
    values.setdefault("eos_token_id", None)
    return dict(sorted(values.items()))
