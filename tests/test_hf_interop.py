"""Hugging Face interop: import into plain and tp=2 x pp=2 models, sharded input, memory, errors, export.

Tiny random Qwen2 models are built with ``transformers`` and saved with ``save_pretrained`` (no download).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.hf_models import hf_logits, offline_hub_cache, write_checkpoint
from helpers.launch import TESTS, launch
from lightning_hybrid.checkpoint.export import export_hf, export_main, parse_size
from lightning_hybrid.hub import resolve_hf_path
from lightning_hybrid.models import Qwen2, Qwen2Config
from lightning_hybrid.models.qwen2 import hf

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
            initializer_range=0.1)
SEQ = 16


def save_tokenizer(folder: Path) -> None:
    """A word-level fast tokenizer with an EOS token (stands in for the model's tokenizer files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(["the cat sat on the mat"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)


def build_hf_model(tie: bool, seed: int = 0):
    """A random transformers Qwen2ForCausalLM; biases and norm scales are perturbed too, so a wrong mapping shows."""
    from transformers import Qwen2Config as HFConfig
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(HFConfig(**TINY, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """``single`` (one model.safetensors), ``sharded`` (the same weights in several shards + index, with tokenizer
    files), ``tied`` (tie_word_embeddings)."""
    root = tmp_path_factory.mktemp("hf")
    model = build_hf_model(tie=False)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    save_tokenizer(root / "sharded")
    build_hf_model(tie=True, seed=1).save_pretrained(root / "tied")
    return {name: root / name for name in ("single", "sharded", "tied")}


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (4, SEQ), generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------------------------------------- name table


def test_name_table_maps_every_transformers_tensor_both_ways(folders):
    from safetensors import safe_open

    with safe_open(str(folders["single"] / "model.safetensors"), "pt") as f:
        hf_names = set(f.keys())
    ours = {hf.hf_to_ours(n) for n in hf_names}
    config = Qwen2Config.from_hf(folders["single"])
    with torch.device("meta"):
        model_names = {n for n, _ in Qwen2(config).named_parameters()}
    assert ours == model_names
    assert {hf.ours_to_hf(n) for n in model_names} == hf_names
    assert all(hf.ours_to_hf(hf.hf_to_ours(n)) == n for n in hf_names)
    assert hf.hf_to_ours("model.layers.79.mlp.down_proj.weight") == "layers.79.mlp.down_proj.weight"
    assert hf.ours_to_hf("layers.12.self_attn.k_proj.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf.hf_to_ours("model.layers.0.mlp.experts.0.weight") is None
    with pytest.raises(KeyError, match="not a Qwen2 parameter name"):
        hf.ours_to_hf("layers.0.attn.qkv.weight")


# ---------------------------------------------------------------------------------------------- single process


@pytest.mark.parametrize("kind", ["single", "tied"])
def test_qwen2_from_hf_logits_match_transformers(folders, inputs, kind):
    model = Qwen2.from_hf(str(folders[kind]))
    assert model.config.tie_word_embeddings == (kind == "tied")
    if kind == "tied":
        assert model.lm_head.weight is model.embed_tokens.weight
    with torch.no_grad():
        ours = model(inputs)
    reference = hf_logits(folders[kind], inputs)
    assert reference.std() > 0.1  # logits large enough that 1e-5 means something
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_sharded_folder_with_index_loads_identically(folders):
    assert len(list(folders["sharded"].glob("model-*.safetensors"))) > 2
    assert (folders["sharded"] / "model.safetensors.index.json").is_file()
    single, sharded = Qwen2.from_hf(str(folders["single"])), Qwen2.from_hf(str(folders["sharded"]))
    a, b = dict(single.named_parameters()), dict(sharded.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    total = sum(p.numel() * 4 for p in sharded.parameters())
    assert hf.read_stats.bytes_read == total and hf.read_stats.tensors_read == len(b)


def test_config_from_hf_reads_both_rope_layouts_and_refuses_unsupported_features(folders, tmp_path):
    config = Qwen2Config.from_hf(folders["single"])
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps"):
        assert getattr(config, key) == TINY[key], key
    assert config.tie_word_embeddings is False and Qwen2Config.from_hf(folders["tied"]).tie_word_embeddings is True
    values = json.loads((folders["single"] / "config.json").read_text())

    def write(**changes) -> Path:
        folder = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**values, **changes}))
        return folder

    classic = {k: v for k, v in values.items() if k != "rope_parameters"}
    folder = tmp_path / "classic"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**classic, "rope_theta": 123.0, "rope_scaling": None}))
    assert Qwen2Config.from_hf(folder / "config.json").rope_theta == 123.0
    cases = {
        "use_sliding_window=true is not supported": dict(use_sliding_window=True),
        # yarn and llama3 are implemented (tests/test_model_families.py); dynamic NTK is not
        "rope scaling type 'dynamic' is not implemented": dict(rope_scaling={"type": "dynamic", "factor": 4.0}),
        "rope scaling type 'linear' is not implemented": dict(rope_parameters={"rope_type": "linear",
                                                                               "rope_theta": 1.0, "factor": 2.0}),
        "hidden_act='gelu' is not supported; only 'silu'": dict(hidden_act="gelu"),
        "model_type='gpt2' is not supported": dict(model_type="gpt2"),  # llama is a family of the core now
    }
    for message, changes in cases.items():
        with pytest.raises(ValueError, match=message) as err:
            Qwen2Config.from_hf(write(**changes))
        assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Qwen2Config.from_hf(tmp_path)


def test_repo_id_resolves_from_the_offline_cache(folders, tmp_path, monkeypatch, inputs):
    snapshot = offline_hub_cache(folders["single"], tmp_path, monkeypatch, "org/tiny-qwen2")
    assert resolve_hf_path("org/tiny-qwen2") == snapshot
    with torch.no_grad():
        torch.testing.assert_close(Qwen2.from_hf("org/tiny-qwen2")(inputs), hf_logits(folders["single"], inputs),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(FileNotFoundError, match=r"'org/absent' is not in the local cache .* HF_HUB_OFFLINE=1"):
        resolve_hf_path("org/absent")
    with pytest.raises(FileNotFoundError, match="no such folder, and not a Hugging Face repo id"):
        resolve_hf_path(str(tmp_path / "nowhere" / "at" / "all"))


# ---------------------------------------------------------------------------------------------- errors


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of a single-file folder whose tensors went through ``edit(dict) -> dict``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = edit(load_file(str(dst / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load_error(folder: Path, config: Qwen2Config, exc=ValueError) -> str:
    with torch.device("meta"):
        model = Qwen2(config)
    model.to_empty(device="cpu")
    with pytest.raises(exc) as err:
        hf.load_hf_weights(model, folder, config)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_load_errors_are_one_line_and_name_the_cause(folders, tmp_path):
    config = Qwen2Config.from_hf(folders["single"])
    src = folders["single"]

    empty = tmp_path / "pickles"
    empty.mkdir()
    shutil.copy(src / "config.json", empty)
    torch.save({"x": torch.ones(1)}, empty / "pytorch_model.bin")
    message = _load_error(empty, config, FileNotFoundError)
    assert "no *.safetensors files in" in message and "pickled weights are never loaded" in message

    message = _load_error(src, Qwen2Config.from_preset("qwen2.5-7b"))
    assert "holds another model than 'qwen2.5-7b'" in message
    assert "hidden_size=64 (asked for 3584)" in message and "num_hidden_layers=4 (asked for 28)" in message

    missing = _rewrite(src, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if "layers.2.mlp.up" not in k})
    assert "tensor model.layers.2.mlp.up_proj.weight is missing from" in _load_error(missing, config)

    extra = _rewrite(src, tmp_path / "extra", lambda t: {**t, "model.layers.4.mlp.up_proj.weight": torch.zeros(2)})
    assert "unexpected tensor model.layers.4.mlp.up_proj.weight in" in _load_error(extra, config)

    shapes = _rewrite(src, tmp_path / "shape",
                      lambda t: {**t, "model.layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)})
    message = _load_error(shapes, config)
    assert "tensor model.layers.1.self_attn.k_proj.weight" in message
    assert "has shape [64, 64] but the model expects [32, 64]" in message

    broken = tmp_path / "broken-index"
    shutil.copytree(folders["sharded"], broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    assert "shard(s) that are not there" in _load_error(broken, config)


# ---------------------------------------------------------------------------------------------- export (in process)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_of_a_checkpoint_writes_a_folder_transformers_loads(folders, inputs, tmp_path, dtype):
    from safetensors import safe_open

    model = Qwen2.from_hf(str(folders["sharded"]))
    ckpt = tmp_path / "ckpt"
    write_checkpoint(model, ckpt, folders["sharded"])
    out = tmp_path / "export"
    assert export_main([str(ckpt), str(out), "--dtype", dtype, "--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    itemsize = {"fp32": 4, "bf16": 2}[dtype]
    assert index["metadata"]["total_size"] == sum(p.numel() for p in model.parameters()) * itemsize
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            assert all(f.get_slice(k).get_dtype() == {"fp32": "F32", "bf16": "BF16"}[dtype] for k in f.keys())
        nbytes = sum(torch.Size(s).numel() * itemsize for s in sizes)
        assert nbytes <= parse_size("100KB") or len(sizes) == 1
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["torch_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    assert (out / "generation_config.json").is_file()
    assert (out / "tokenizer.json").read_bytes() == (folders["sharded"] / "tokenizer.json").read_bytes()
    with torch.no_grad():
        ours = model(inputs)
    exported = hf_logits(out, inputs)
    tol = 1e-5 if dtype == "fp32" else 5e-2
    torch.testing.assert_close(exported, ours, rtol=tol, atol=tol)


def test_export_of_a_tied_model_omits_the_head_and_transformers_ties_it(folders, inputs, tmp_path):
    model = Qwen2.from_hf(str(folders["tied"]))
    write_checkpoint(model, tmp_path / "ckpt", folders["tied"])
    out = export_hf(tmp_path / "ckpt", tmp_path / "export", dtype="fp32")
    assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(out, inputs), model(inputs), rtol=1e-5, atol=1e-5)


def test_export_errors_are_one_line(folders, tmp_path, capsys):
    assert export_main([str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no meta.json in" in err
    model = Qwen2.from_hf(str(folders["single"]))
    ckpt = tmp_path / "ckpt"
    write_checkpoint(model, ckpt, folders["single"])
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(
        json.dumps({**meta, "model_config": {**meta["model_config"], "num_hidden_layers": 5}}))
    with pytest.raises(ValueError, match=r"checkpoint .* has no tensor model\.layers\.4\.\S+; it is not a complete"):
        export_hf(ckpt, tmp_path / "out")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="dtype='int8' is not supported; use one of bf16, fp16, fp32"):
        export_hf(ckpt, tmp_path / "out", dtype="int8")
    with pytest.raises(ValueError, match="max_shard_size='5 parsecs' is not a size"):
        export_hf(ckpt, tmp_path / "out", max_shard_size="5 parsecs")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="is not empty; choose a new folder or pass --overwrite"):
        export_hf(ckpt, tmp_path / "full")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1234) == 1234


# ---------------------------------------------------------------------------------------------- tp=2 x pp=2


@pytest.fixture(scope="module")
def parallel_run(folders, inputs, tmp_path_factory):
    """One 4-process run: import the sharded folder into tp=2 x pp=2 and into tp=2 x dp=2 (FSDP2), predict,
    train the first 2 steps, predict, save."""
    out = tmp_path_factory.mktemp("parallel")
    torch.save(inputs, out / "inputs.pt")
    result = launch(4, [str(TESTS / "hf_worker.py"), str(folders["sharded"]), str(out / "inputs.pt"), str(out)],
                      timeout=280, check=False)
    record_path = out / "record.pt"
    if not record_path.is_file():
        raise AssertionError(f"the tp=2 x pp=2 worker failed before its record ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return {"result": result, "out": out, "record": torch.load(record_path, weights_only=False)}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_logits_of_a_tp2_pp2_import_match_transformers(parallel_run, folders, inputs):
    logits = parallel_run["record"]["before"]
    torch.testing.assert_close(logits, hf_logits(folders["single"], inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_logits_of_a_tp2_fsdp2_import_match_transformers_and_each_rank_reads_its_shard(parallel_run, folders, inputs):
    torch.testing.assert_close(parallel_run["record"]["fsdp_logits"], hf_logits(folders["single"], inputs),
                               rtol=1e-5, atol=1e-5)
    params = dict(Qwen2.from_hf(str(folders["single"])).named_parameters())
    total = sum(p.numel() * 4 for p in params.values())
    norms = sum(p.numel() * 4 for name, p in params.items() if "norm" in name)
    reads = parallel_run["record"]["fsdp_reads"]
    assert all(r["bytes_read"] == r["held_bytes"] for r in reads), reads
    # tp x dp shards tile every matrix exactly once; the norms, whole on each TP peer, are read by both peers.
    assert sum(r["bytes_read"] for r in reads) == total + norms


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_each_rank_of_a_tp2_pp2_import_reads_only_its_share(parallel_run, folders):
    total = sum(p.numel() * 4 for p in Qwen2.from_hf(str(folders["single"])).parameters())
    largest = max(p.numel() * 4 for p in Qwen2.from_hf(str(folders["single"])).parameters())
    reads = parallel_run["record"]["reads"]
    assert len(reads) == 4
    for rank in reads:
        assert rank["bytes_read"] == rank["held_bytes"], rank  # exactly the slices its shards hold
        assert rank["bytes_read"] <= total / 4 + largest, (rank, total)
    # Together the ranks read the model once, plus the norms every TP peer keeps whole.
    assert total <= sum(r["bytes_read"] for r in reads) <= total * 1.05


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_round_trip_import_train_save_export_loads_in_transformers_with_the_trained_logits(parallel_run, folders,
                                                                                         inputs, tmp_path):
    result, out, record = parallel_run["result"], parallel_run["out"], parallel_run["record"]
    assert result.returncode == 0, (f"training or trainer.save_checkpoint failed in the tp=2 x pp=2 worker:\n"
                                    f"{result.stderr[-6000:]}")
    assert (record["after"] - record["before"]).abs().max() > 1e-3  # the two steps changed the model
    exported = tmp_path / "export"
    assert export_main([str(out / "ckpt"), str(exported), "--dtype", "fp32"]) == 0
    torch.testing.assert_close(hf_logits(exported, inputs), record["after"], rtol=1e-5, atol=1e-5)
    # The exporter finds the import folder (and copies its tokenizer) through meta.json's hparams.init_from_hf.
    meta = json.loads((out / "ckpt" / "meta.json").read_text())
    assert (meta.get("hparams") or {}).get("init_from_hf") == str(folders["sharded"]), (
        f"the checkpoint's meta.json records no hparams.init_from_hf (keys: {sorted(meta)}); the checkpoint writer "
        f"must record the LightningModule's hparams so export-hf can copy the tokenizer")
    assert (exported / "tokenizer.json").read_bytes() == (folders["sharded"] / "tokenizer.json").read_bytes()
