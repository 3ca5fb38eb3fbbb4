"""Activation recompute on one process: it really re-runs the chosen modules, saves less, and changes no number."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_hybrid.distributed.activation_checkpoint import (
    apply_activation_checkpointing,
    compile_blocks,
    recomputed,
)
from lightning_hybrid.models import Qwen2, Qwen2Config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2(Qwen2Config.from_preset("tiny"))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)


def _step(model, batch, count=()):
    """Gradients, forward calls per counted module during backward, and bytes autograd saved outside recompute."""
    calls = {name: 0 for name in count}
    phase = {"backward": False}
    hooks = []
    for name in count:
        def hook(module, args, name=name):
            calls[name] += phase["backward"]
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, n = model.loss_sum(model(batch[0]), batch[1])
    phase["backward"] = True
    (loss / n).backward()
    for h in hooks:
        h.remove()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, calls, sum(saved)


# the fused q/k/v and gate/up projections: the modules that run the attention's and the MLP's input GEMMs
COUNTED = ("layers.0.self_attn.qkv", "layers.0.mlp.gate_up", "layers.1.self_attn.qkv", "layers.1.mlp.gate_up")


@pytest.mark.parametrize("mode, selective, rerun", [
    ("full", "op", dict(zip(COUNTED, (1, 1, 1, 1)))),
    ("selective", "attention", dict(zip(COUNTED, (1, 0, 1, 0)))),
    ("selective", 2, dict(zip(COUNTED, (1, 1, 0, 0)))),
])
def test_recompute_reruns_exactly_the_chosen_modules_and_gradients_are_bitwise_equal(model, batch, mode, selective,
                                                                                      rerun):
    reference, calls, _ = _step(model, batch, COUNTED)
    assert set(calls.values()) == {0}  # without recompute nothing runs forward during backward
    recomputing = copy.deepcopy(model)
    apply_activation_checkpointing(recomputing.layers, mode, selective, "self_attn")
    grads, calls, _ = _step(recomputing, batch, COUNTED)
    assert calls == rerun
    for name, grad in reference.items():
        assert torch.equal(grads[name], grad), name


def _ops_in_backward(model, batch) -> dict[str, int]:
    """How often each aten op runs during backward (recomputed forward ops included)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    model.zero_grad(set_to_none=True)
    loss, n = model.loss_sum(model(batch[0]), batch[1])
    with Count() as counter:
        (loss / n).backward()
    return counter.ops


def test_op_level_selective_recompute_reruns_norms_but_no_matmul(model, batch):
    reference, _, saved_none = _step(model, batch)
    ops, saved = {"none": _ops_in_backward(model, batch)}, {}
    for mode in ("selective", "full"):
        m = copy.deepcopy(model)
        apply_activation_checkpointing(m.layers, mode, "op")
        grads, _, saved[mode] = _step(m, batch)
        for name, grad in reference.items():
            assert torch.equal(grads[name], grad), (mode, name)
        ops[mode] = _ops_in_backward(m, batch)
    mm = {mode: ops[mode]["mm"] + ops[mode]["addmm"] for mode in ops}
    # op-level: no matmul runs again (their outputs were kept), the RMSNorm's rsqrt does; full re-runs both.
    assert mm["selective"] == mm["none"] < mm["full"], mm
    assert ops["none"]["rsqrt"] == 0 and ops["selective"]["rsqrt"] == ops["full"]["rsqrt"] == 8, ops
    assert ops["full"]["_scaled_dot_product_flash_attention_for_cpu"] == 4
    assert ops["selective"]["_scaled_dot_product_flash_attention_for_cpu"] == 0
    # Autograd keeps far less outside the recomputed regions.
    assert saved["full"] < saved_none / 4 and saved["selective"] < saved_none / 4, (saved, saved_none)


def test_recompute_keeps_parameter_names_and_survives_deepcopy(model, batch):
    m = copy.deepcopy(model)
    names = apply_activation_checkpointing(m.layers, "full")
    assert names == ["0", "1", "2", "3"]
    assert list(m.state_dict()) == list(model.state_dict())
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in model.named_parameters()]
    twin = copy.deepcopy(m)
    assert twin.layers["0"].forward.__self__ is twin.layers["0"]  # rebound to the copy, not the original
    assert recomputed(twin.layers["0"]) == "full" and recomputed(model.layers["0"]) is None


def test_compile_by_parts_names_the_compiled_modules_and_keeps_the_math(model, batch):
    reference, _, _ = _step(model, batch)
    m = copy.deepcopy(model)
    assert compile_blocks(m.layers, parts=("self_attn", "mlp"), backend="aot_eager")[:2] == ["0.self_attn", "0.mlp"]
    grads, _, _ = _step(m, batch)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6)


def test_attention_recompute_needs_the_attention_submodule(model):
    with pytest.raises(ValueError, match=r"selective_ac='attention' needs the model's ParallelSpec.block_attention"):
        apply_activation_checkpointing(copy.deepcopy(model).layers, "selective", "attention", None)


def test_each_rank_gets_cache_keys_of_its_own_beside_the_users_tag(monkeypatch):
    import torch.compiler.config as compiler_config

    from lightning_hybrid.distributed.activation_checkpoint import rank_compile_cache_key

    monkeypatch.setattr(compiler_config, "cache_key_tag", "")
    assert rank_compile_cache_key(3, 4, "0123abcd") == "lh-rank3of4-0123abcd" == compiler_config.cache_key_tag
    # a user's own tag stays; a second call (another compile_blocks in the process) replaces only the rank's part
    monkeypatch.setattr(compiler_config, "cache_key_tag", "experiment-7")
    assert rank_compile_cache_key(1, 4) == "experiment-7|lh-rank1of4"
    assert rank_compile_cache_key(2, 8, "ff") == "experiment-7|lh-rank2of8-ff"
