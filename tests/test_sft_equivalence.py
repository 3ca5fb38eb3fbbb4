"""Packed chat rows with document masking train exactly like the conversations run one by one.

One process: a packed row of 3 conversations gives the loss and gradients of the 3 conversations run separately
without padding (< 1e-5); without document masking the same comparison is far off. One launch of 4 processes:
tp2 x pp2, cp2 x tp2 and cp2 x pp2 on packed rows train like one process (losses and final weights < 1e-5), and
tp2 x pp2 without document masking does not.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.compare import assert_trains_like, max_relative_error
from helpers.equivalence import SEED, LossRecorder, make_trainer_kwargs, tiny_config
from helpers.launch import TESTS, launch
from lightning_hybrid.data.packed import PackedTokenDataset
from lightning_hybrid.data.prepare_chat import prepare_chat
from lightning_hybrid.data.tiny_chat import build_tiny_chat_tokenizer
from lightning_hybrid.models.qwen2.model import Qwen2

VOCAB = 264


def conversations(count: int, seed: int = 3) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        a, b = (int(x) for x in torch.randint(0, 99, (2,), generator=g))
        convo = [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]
        if i % 3 == 0:
            convo = [{"role": "system", "content": "add"}] + convo
        out.append(convo)
    return out


def write_jsonl(path, convos) -> None:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convos))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tokenizer = build_tiny_chat_tokenizer(root / "tokenizer")
    write_jsonl(root / "chat.jsonl", conversations(60))
    prepare_chat(str(tokenizer), [root / "chat.jsonl"], root / "data", seq_len=96)
    return root


def _loss_and_grads(model: Qwen2, batches: list[dict]) -> tuple[float, list[torch.Tensor]]:
    """Token-mean loss over all batches together (the global-batch mean) and its gradients."""
    model.zero_grad()
    total, count = 0.0, 0
    for batch in batches:
        positions = batch.get("position_ids")
        logits = model(batch["input_ids"][None], positions[None] if positions is not None else None)
        loss_sum, n = model.loss_sum(logits, batch["labels"][None])
        total, count = total + loss_sum, count + n
    loss = total / count
    loss.backward()
    return float(loss), [p.grad.detach().clone() for p in model.parameters()]


def _packed_vs_separate(chat_folder, document_mask: bool) -> tuple[float, float, int]:
    """(relative loss error, worst relative gradient error, conversations in the row) of a packed row vs its
    conversations run one by one at their own length."""
    data = PackedTokenDataset(chat_folder / "data", document_mask=True)
    # The row holding the most documents (conversations, and a padding run if any).
    best = max(range(len(data)), key=lambda i: int((data[i]["position_ids"] == 0).sum()))
    row = PackedTokenDataset(chat_folder / "data", document_mask=document_mask)[best]
    masked = data[best]
    starts = (masked["position_ids"] == 0).nonzero().flatten().tolist() + [data.seq_len]
    separate = []
    for a, b in zip(starts[:-1], starts[1:]):
        if (masked["labels"][a:b] != -100).any():  # a conversation (the padding run has no label)
            separate.append({"input_ids": masked["input_ids"][a:b], "labels": masked["labels"][a:b]})
    torch.manual_seed(0)
    model = Qwen2(tiny_config(vocab_size=VOCAB))
    loss_sep, grads_sep = _loss_and_grads(model, separate)
    loss_packed, grads_packed = _loss_and_grads(model, [row])
    grad_err = max(float((a - b).norm() / b.norm()) for a, b in zip(grads_packed, grads_sep) if b.norm() > 0)
    return abs(loss_packed - loss_sep) / loss_sep, grad_err, len(separate)


def test_packed_row_equals_separate_conversations_on_one_process(chat_folder):
    loss_err, grad_err, n = _packed_vs_separate(chat_folder, document_mask=True)
    print(f"packed vs separate ({n} conversations): loss {loss_err:.2e}, gradients {grad_err:.2e}")
    assert n >= 3
    assert loss_err < 1e-5 and grad_err < 1e-5, (loss_err, grad_err)


def test_packed_row_without_document_mask_differs_from_separate(chat_folder):
    loss_err, grad_err, _ = _packed_vs_separate(chat_folder, document_mask=False)
    print(f"without document mask: loss {loss_err:.2e}, gradients {grad_err:.2e}")
    assert loss_err > 1e-4 and grad_err > 1e-2, (loss_err, grad_err)


def _reference(chat_folder) -> dict:
    """One process, Lightning's default strategy, the global batches the distributed sampler gives (dp=1)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_hybrid.models import CausalLM

    L.seed_everything(SEED)
    kwargs = make_trainer_kwargs()
    module = CausalLM(tiny_config(vocab_size=VOCAB), **kwargs["module"])
    data = PackedTokenDataset(chat_folder / "data", document_mask=True)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED)).tolist()
    losses, initial = LossRecorder(), {}

    class Initial(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            initial.update({k: v.detach().clone() for k, v in pl_module.model.named_parameters()})

    trainer = L.Trainer(devices=1, callbacks=[losses, Initial()], **{**kwargs["trainer"], "limit_val_batches": 0})
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4, sampler=order))
    return {"losses": losses.losses, "initial": initial,
            "final": {k: v.detach().clone() for k, v in module.model.named_parameters()}}


@pytest.fixture(scope="module")
def meshes(chat_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_meshes")
    configs = [{"name": "tp2_pp2", "tp": 2, "pp": 2, "microbatches": 2},
               {"name": "cp2_tp2", "cp": 2, "tp": 2},
               {"name": "cp2_pp2", "cp": 2, "pp": 2, "microbatches": 2},
               {"name": "tp2_pp2_no_mask", "tp": 2, "pp": 2, "microbatches": 2, "document_mask": False}]
    spec = out / "spec.json"
    spec.write_text(json.dumps({"data": str(chat_folder / "data"), "configs": configs}))
    launch(4, [str(TESTS / "sft_worker.py"), str(spec), str(out)], timeout=800)
    records = {c["name"]: torch.load(out / f"{c['name']}.pt", weights_only=False) for c in configs}
    return records, _reference(chat_folder)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", ["tp2_pp2", "cp2_tp2", "cp2_pp2"])
def test_packed_chat_trains_like_one_process(meshes, name):
    records, reference = meshes
    print(name, max_relative_error(records[name], reference))
    assert_trains_like(records[name], reference)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_packed_chat_without_document_mask_trains_differently(meshes):
    records, reference = meshes
    err = max_relative_error(records["tp2_pp2_no_mask"], reference)
    print("no document mask", err)
    assert err["loss"] > 1e-4, err
