"""`lightning-hybrid prepare-data` and the packed token data set, with a tokenizer built here (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_hybrid.cli import main as cli_main
from lightning_hybrid.data import PackedTokenDataModule, PackedTokenDataset
from lightning_hybrid.data.prepare import iter_documents, load_tokenizer, prepare_data

SENTENCES = ["the cat sat on the mat", "a dog ran far away", "hello world", "the dog sat", "cat and dog"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level fast tokenizer with an EOS token, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture()
def corpus(tmp_path) -> list[Path]:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": s, "id": i}) for i, s in enumerate(SENTENCES[:3])) + "\n\n")
    text = tmp_path / "more.txt"
    text.write_text(" ".join(SENTENCES[3:]))
    return [jsonl, text]


def test_prepare_data_cli_packs_documents_with_eos_between_them_and_writes_the_index(tokenizer_dir, corpus, tmp_path):
    out = tmp_path / "data"
    rc = cli_main(["prepare-data", "--tokenizer", str(tokenizer_dir), "--input", *map(str, corpus),
                   "--output", str(out), "--seq-len", "4"])
    assert rc == 0
    index = json.loads((out / "index.json").read_text())
    tok = load_tokenizer(str(tokenizer_dir))
    docs = [tok.encode_batch([d])[0] for d in [*SENTENCES[:3], " ".join(SENTENCES[3:])]]
    expected = [t for d in docs for t in (*d, tok.eos_token_id)]
    tokens = np.memmap(out / "tokens.bin", dtype=np.uint32, mode="r")
    assert tokens.tolist() == expected
    assert np.flatnonzero(tokens == tok.eos_token_id).tolist() == list(np.cumsum([len(d) + 1 for d in docs]) - 1)
    assert index["eos_token_id"] == tok.eos_token_id == 1 and index["eos_token"] == "<eos>"
    assert index["num_tokens"] == len(expected) and index["documents"] == 4
    assert index["seq_len"] == 4 and index["num_sequences"] == (len(expected) - 1) // 4
    assert index["dtype"] == "uint32" and index["tokenizer"] == str(tokenizer_dir)
    assert min(expected) >= 0 and max(expected) < index["vocab_size"]


def test_packed_dataset_items_are_shifted_windows_and_the_data_module_splits_by_position(tokenizer_dir, corpus,
                                                                                         tmp_path):
    out = tmp_path / "data"
    prepare_data(str(tokenizer_dir), corpus, out, seq_len=3)
    tokens = torch.from_numpy(np.fromfile(out / "tokens.bin", dtype=np.uint32).astype(np.int64))
    data = PackedTokenDataset(out)
    assert len(data) == (tokens.numel() - 1) // 3
    for i in range(len(data)):
        item = data[i]
        assert torch.equal(item["input_ids"], tokens[3 * i:3 * i + 3])
        assert torch.equal(item["labels"], tokens[3 * i + 1:3 * i + 4])
    with pytest.raises(IndexError):
        data[len(data)]
    module = PackedTokenDataModule(str(out), batch_size=2, val_fraction=0.25)
    module.setup("fit")
    n_val = max(1, int(len(data) * 0.25))
    assert len(module.train_set) == len(data) - n_val and len(module.val_set) == n_val
    assert torch.equal(module.val_set[0]["input_ids"], data[len(data) - n_val]["input_ids"])
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 3) and batch["input_ids"].dtype == torch.int64


def test_the_tokenizers_backend_gives_the_same_tokens_as_transformers(tokenizer_dir):
    a = load_tokenizer(str(tokenizer_dir), backend="transformers")
    b = load_tokenizer(str(tokenizer_dir), backend="tokenizers")
    assert a.encode_batch(SENTENCES) == b.encode_batch(SENTENCES)
    assert (a.eos_token_id, a.eos_token) == (b.eos_token_id, b.eos_token)


def test_text_mode_line_makes_each_line_a_document(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("one\n\ntwo three\n")
    assert list(iter_documents([path], text_mode="line")) == ["one", "two three"]
    assert list(iter_documents([path])) == ["one\n\ntwo three\n"]


def test_bad_inputs_give_one_line_errors(tokenizer_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "the cat"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no string field 'text'; pass --text-key"):
        prepare_data(str(tokenizer_dir), [bad], tmp_path / "out", seq_len=4)
    short = tmp_path / "short.txt"
    short.write_text("cat")
    with pytest.raises(ValueError, match=r"give 2 tokens, fewer than one sequence of seq_len=4"):
        prepare_data(str(tokenizer_dir), [short], tmp_path / "out", seq_len=4)
    with pytest.raises(ValueError, match=r"has no EOS token '<nope>' in its vocabulary; pass --eos-token"):
        load_tokenizer(str(tokenizer_dir), eos_token="<nope>", backend="tokenizers")
    assert cli_main(["prepare-data", "--tokenizer", str(tokenizer_dir), "--input", str(tmp_path / "missing.txt"),
                     "--output", str(tmp_path / "out"), "--seq-len", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing.txt does not exist" in err
    with pytest.raises(FileNotFoundError, match="not a packed token folder"):
        PackedTokenDataset(tmp_path)
    assert not list((tmp_path / "out").glob("tokens.bin*"))  # a failed run leaves no token file behind


def test_recipes_that_use_packed_tokens_pass_only_arguments_the_data_module_takes():
    import inspect

    import yaml

    accepted = set(inspect.signature(PackedTokenDataModule).parameters)
    recipes = Path(__file__).parents[1] / "recipes"
    used = 0
    for recipe in sorted(recipes.glob("*.yaml")):
        data = (yaml.safe_load(recipe.read_text()) or {}).get("data") or {}
        if str(data.get("class_path", "")).endswith("PackedTokenDataModule"):
            used += 1
            assert set(data.get("init_args", {})) <= accepted, (recipe.name, set(data["init_args"]) - accepted)
    assert used >= 1


def test_a_causal_lm_trains_on_prepared_data(tokenizer_dir, corpus, tmp_path):
    import lightning as L

    from lightning_hybrid.models import CausalLM

    prepare_data(str(tokenizer_dir), corpus, tmp_path / "data", seq_len=4)
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(CausalLM("tiny"), datamodule=PackedTokenDataModule(str(tmp_path / "data"), batch_size=2,
                                                                   val_fraction=0.4))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["val_loss"])
