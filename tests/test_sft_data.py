"""prepare-data for chat and pre-training input: chat template, assistant-only labels, packing, Parquet, datasets
folders, worker processes, weighted mixtures and their resume on another mesh, and the one-line input errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_hybrid.data.mixture import MixtureDataset, check_sources
from lightning_hybrid.data.packed import PackedTokenDataModule, PackedTokenDataset
from lightning_hybrid.data.prepare import prepare_main
from lightning_hybrid.data.prepare_chat import first_fit_decreasing, prepare_chat
from lightning_hybrid.data.sampler import ResumableDistributedSampler
from lightning_hybrid.data.tiny_chat import CHATML_GENERATION_TEMPLATE, build_tiny_chat_tokenizer

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6, of course."}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Let me look."},
     {"role": "tool", "content": "sunny, 21C"}, {"role": "assistant", "content": "Sunny and 21C."}],
    [{"role": "user", "content": "a longer question about nothing in particular"},
     {"role": "assistant", "content": "a longer answer about nothing in particular either"}],
]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {"prefix": str(build_tiny_chat_tokenizer(root / "plain")),
            "generation": str(build_tiny_chat_tokenizer(root / "generation", CHATML_GENERATION_TEMPLATE)),
            "none": str(build_tiny_chat_tokenizer(root / "none", chat_template=None))}


def expected_mask(tok, convo) -> list[int]:
    """Assistant mask built piece by piece (independent of the template code): the reply and its <|im_end|>."""
    mask: list[int] = []
    for message in convo:
        head = tok(f"<|im_start|>{message['role']}\n", add_special_tokens=False)["input_ids"]
        body = tok(message["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        tail = tok("\n", add_special_tokens=False)["input_ids"]
        mask += [0] * len(head) + [int(message["role"] == "assistant")] * len(body) + [0] * len(tail)
    return mask


def documents(data: PackedTokenDataset):
    """(input ids, labels) of every conversation of every row, cut at the position_ids restarts."""
    for i in range(len(data)):
        row = data[i]
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [data.seq_len]
        for a, b in zip(starts[:-1], starts[1:]):
            yield row["input_ids"][a:b].tolist(), row["labels"][a:b].tolist()


@pytest.mark.parametrize("template", ["prefix", "generation"])
def test_labels_are_exactly_the_assistant_tokens(tmp_path, tokenizers, template):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizers[template])
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    index = prepare_chat(tokenizers[template], [src], tmp_path / "out", seq_len=128)
    expected = {}
    for convo in CONVERSATIONS:
        ids = tok.apply_chat_template(convo, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        expected[tuple(ids)] = expected_mask(tok, convo)
    seen = 0
    for ids, labels in documents(PackedTokenDataset(tmp_path / "out", document_mask=True)):
        if tuple(ids) not in expected:
            assert all(label == -100 for label in labels)  # the padding run
            continue
        mask = expected[tuple(ids)]
        # Position t is trained to predict token t + 1 exactly when t + 1 is an assistant token.
        want = [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
        assert labels == want
        seen += 1
    assert seen == len(CONVERSATIONS)
    assert index["assistant_tokens"] == sum(sum(m) for m in expected.values())
    assert PackedTokenDataModule(str(tmp_path / "out")).document_mask  # on by default for chat folders


def test_first_fit_decreasing_and_packing_summary(tmp_path, tokenizers, capsys):
    assert first_fit_decreasing([3, 7, 5, 2, 4], 10) == [[1, 0], [2, 4], [3]]  # 7+3, 5+4, 2
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 5])
    assert prepare_main(["--format", "chat", "--tokenizer", tokenizers["prefix"], "--input", src, "--output",
                         str(tmp_path / "out"), "--seq-len", "128"]) == 0
    line = capsys.readouterr().out.strip()
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    print(line)
    assert "20 conversations" in line and "packing efficiency" in line and "assistant" in line
    assert index["packing_efficiency"] == index["conversation_tokens"] / (index["num_rows"] * 128) > 0.8


@pytest.mark.parametrize("overlong, kept", [("drop", 3), ("truncate", 4)])
def test_overlong_conversations_are_dropped_or_truncated_and_counted(tmp_path, tokenizers, overlong, kept):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    index = prepare_chat(tokenizers["prefix"], [src], tmp_path / "out", seq_len=100, overlong=overlong)
    assert index["conversations"] == kept
    assert index["dropped" if overlong == "drop" else "truncated"] == 1


def test_workers_give_byte_identical_output(tmp_path, tokenizers):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 30])
    texts = [f"document {i}: " + "lorem ipsum " * (i % 17) for i in range(300)]
    pq.write_table(pa.table({"body": texts}), tmp_path / "text.parquet")
    for workers in (1, 3):
        prepare_chat(tokenizers["prefix"], [src], tmp_path / f"chat{workers}", seq_len=128, workers=workers,
                     batch_size=8)
        assert prepare_main(["--tokenizer", tokenizers["prefix"], "--input", str(tmp_path / "text.parquet"),
                             "--text-key", "body", "--output", str(tmp_path / f"text{workers}"), "--seq-len", "64",
                             "--workers", str(workers), "--batch-size", "16"]) == 0
    for name in ("tokens.bin", "loss_mask.bin", "boundaries.bin"):
        assert (tmp_path / "chat1" / name).read_bytes() == (tmp_path / "chat3" / name).read_bytes(), name
    assert (tmp_path / "text1" / "tokens.bin").read_bytes() == (tmp_path / "text3" / "tokens.bin").read_bytes()
    assert json.loads((tmp_path / "text1" / "index.json").read_text())["documents"] == 300


def test_chat_from_parquet_and_a_datasets_folder_equals_jsonl(tmp_path, tokenizers):
    import datasets

    records = [{"messages": c} for c in CONVERSATIONS]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "chat.parquet"))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))
    outputs = []
    for name, src in (("jsonl", write_jsonl(tmp_path / "chat.jsonl", records)),
                      ("parquet", str(tmp_path / "chat.parquet")), ("hf", str(tmp_path / "hf"))):
        prepare_chat(tokenizers["prefix"], [src], tmp_path / f"out_{name}", seq_len=128)
        outputs.append((tmp_path / f"out_{name}" / "tokens.bin").read_bytes())
    assert outputs[0] == outputs[1] == outputs[2]


def test_text_document_mask_restarts_positions_after_eos(tmp_path, tokenizers):
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, [{"text": "abc"}, {"text": "defgh"}, {"text": "ij"}])
    assert prepare_main(["--tokenizer", tokenizers["prefix"], "--input", str(src), "--output", str(tmp_path / "o"),
                         "--seq-len", "12"]) == 0
    item = PackedTokenDataset(tmp_path / "o", document_mask=True)[0]
    assert item["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]
    assert (item["labels"] == -100).nonzero().flatten().tolist() == [3, 9]  # the EOS positions
    assert "position_ids" not in PackedTokenDataset(tmp_path / "o")[0]


def bad_input_error(capsys, tmp_path, tokenizer, records, *extra) -> str:
    src = write_jsonl(tmp_path / "bad.jsonl", records)
    code = prepare_main(["--format", "chat", "--tokenizer", tokenizer, "--input", src, "--output",
                         str(tmp_path / "out"), "--seq-len", "128", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_chat_input_gets_one_line_naming_file_and_line(tmp_path, tokenizers, capsys):
    good = {"messages": CONVERSATIONS[0]}
    err = bad_input_error(capsys, tmp_path, tokenizers["prefix"], [good, {"text": "no messages"}])
    assert "bad.jsonl:2" in err and "'messages'" in err
    err = bad_input_error(capsys, tmp_path, tokenizers["prefix"],
                          [good, good, {"messages": [{"role": "robot", "content": "x"}]}])
    assert "bad.jsonl:3" in err and "'robot'" in err and "assistant" in err
    no_assistant = {"messages": [{"role": "user", "content": "hello?"}]}
    err = bad_input_error(capsys, tmp_path, tokenizers["prefix"], [good, no_assistant], "--strict")
    assert "bad.jsonl:2" in err and "no assistant turn" in err
    err = bad_input_error(capsys, tmp_path, tokenizers["none"], [good])
    assert "no chat template" in err and "--chat-template" in err


def test_conversation_without_assistant_is_counted_and_skipped(tmp_path, tokenizers):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]},
                                             {"messages": [{"role": "user", "content": "hello?"}]}])
    index = prepare_chat(tokenizers["prefix"], [src], tmp_path / "out", seq_len=128)
    assert index["conversations"] == 1 and index["skipped_no_assistant"] == 1


def test_chat_template_file_replaces_a_missing_one(tmp_path, tokenizers):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_GENERATION_TEMPLATE)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    index = prepare_chat(tokenizers["none"], [src], tmp_path / "out", seq_len=128, chat_template=str(template))
    assert index["conversations"] == 4


def test_parquet_without_the_text_column_names_the_file(tmp_path, tokenizers, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "shard-0.parquet")
    code = prepare_main(["--tokenizer", tokenizers["prefix"], "--input", str(tmp_path / "shard-*.parquet"),
                         "--output", str(tmp_path / "out"), "--seq-len", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "shard-0.parquet" in err and "'text'" in err and "content" in err


@pytest.mark.parametrize("weight", [0, -0.5, "a lot"])
def test_a_weight_that_is_not_positive_is_refused(weight):
    with pytest.raises(ValueError, match=r"sources\[1\] \(b\): weight=.* must be a positive number"):
        check_sources([{"path": "a", "weight": 1.0}, {"path": "b", "weight": weight}])


class _Source(torch.utils.data.Dataset):
    def __init__(self, tag: int, size: int) -> None:
        self.tag, self.size = tag, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, int]:
        return self.tag, i


def test_mixture_proportions_follow_the_weights():
    mixture = MixtureDataset([_Source(0, 3000), _Source(1, 500)], [0.7, 0.3], num_samples=50_000, seed=5)
    sampler = ResumableDistributedSampler(mixture, num_replicas=1, rank=0, shuffle=True, seed=5)
    drawn = [mixture.source_of(i) for _, i in zip(range(10_000), iter(sampler))]
    share = drawn.count(0) / len(drawn)
    print(f"source 0 share over 10,000 samples: {share:.4f}")
    assert abs(share - 0.7) < 0.01
    # Deterministic from the seed; another seed gives another order.
    again = MixtureDataset([_Source(0, 3000), _Source(1, 500)], [0.7, 0.3], num_samples=50_000, seed=5)
    assert [again[i] for i in range(200)] == [mixture[i] for i in range(200)]
    other = MixtureDataset([_Source(0, 3000), _Source(1, 500)], [0.7, 0.3], num_samples=50_000, seed=6)
    assert [other[i] for i in range(200)] != [mixture[i] for i in range(200)]
    # The small source is repeated in fresh permutations, each pass a permutation of all of it.
    ones = [mixture[i][1] for i in range(50_000) if mixture.source_of(i) == 1]
    assert sorted(ones[:500]) == list(range(500)) and ones[:500] != ones[500:1000]


def _global_order(mixture, dp: int, steps: int, per_rank: int, resume_after: int = 0) -> list:
    """Samples of global batches (rank-major within a batch, as the dp ranks read them)."""
    ranks = []
    for rank in range(dp):
        sampler = ResumableDistributedSampler(mixture, num_replicas=dp, rank=rank, shuffle=True, seed=11)
        if resume_after:
            sampler.resume_from(0, resume_after)
        ranks.append(list(iter(sampler)))
    order = []
    for step in range(steps):
        batch = sorted(i for r in ranks for i in r[step * per_rank:(step + 1) * per_rank])
        order.append([mixture[i] for i in batch])
    return order


def test_mixture_resumed_on_another_mesh_continues_the_same_order():
    mixture = MixtureDataset([_Source(0, 40), _Source(1, 25), _Source(2, 9)], [0.5, 0.3, 0.2], num_samples=240,
                             seed=11)
    global_batch, k = 8, 5
    straight = _global_order(mixture, dp=2, steps=12, per_rank=global_batch // 2)
    resumed = _global_order(mixture, dp=4, steps=7, per_rank=global_batch // 4, resume_after=k * global_batch)
    assert resumed == straight[k:]


def test_data_module_mixes_prepared_folders(tmp_path, tokenizers):
    for name, text in (("a", "alpha "), ("b", "beta ")):
        src = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": text * 40}] * 20)
        assert prepare_main(["--tokenizer", tokenizers["prefix"], "--input", src, "--output",
                             str(tmp_path / name), "--seq-len", "16"]) == 0
    module = PackedTokenDataModule(sources=[{"path": str(tmp_path / "a"), "weight": 3},
                                            {"path": str(tmp_path / "b"), "weight": 1}], num_samples=400, seed=1)
    module.setup("fit")
    mixture = module.train_set
    assert sum(mixture.source_of(i) == 0 for i in range(400)) == 300  # exact counts: 3/4 of the samples
    for i in (0, 7, 399):
        source, j = mixture.locate(i)
        folder = tmp_path / ("a", "b")[source]
        assert torch.equal(mixture[i]["input_ids"], PackedTokenDataset(folder)[j]["input_ids"])
    assert not module.document_mask
    with pytest.raises(ValueError, match="weight=0 must be a positive number"):
        PackedTokenDataModule(sources=[{"path": str(tmp_path / "a"), "weight": 0}])
    with pytest.raises(ValueError, match="one of the two"):
        PackedTokenDataModule()
    assert np.isclose(sum(w for _, w in module.mixture), 1.0)
