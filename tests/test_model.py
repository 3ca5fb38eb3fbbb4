"""The Qwen2 model against independent references: rotary rotation, GQA head sharing, causal mask, sizes."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hybrid.models import CausalLM, Qwen2, Qwen2Config
from lightning_hybrid.models.qwen2.model import Attention, apply_rotary, rotary_tables

PUBLISHED = {  # computed from the shapes of the published safetensors files (shared/qwen2.5-presets.md)
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512, "qwen2.5-14b": 14_770_033_664, "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_matches_published_total(name):
    config = Qwen2Config.from_preset(name)
    with torch.device("meta"):
        model = Qwen2(config)  # counted from the real module's tensors, without allocating them
    assert abs(model.num_parameters() - PUBLISHED[name]) / PUBLISHED[name] < 0.005
    assert model.num_parameters() == PUBLISHED[name] == config.num_parameters()


def test_72b_preset_has_published_sizes():
    c = Qwen2Config.from_preset("qwen2.5-72b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (8192, 80, 64, 8, 29568, 152064)


def test_unknown_preset_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"unknown model preset 'qwen2.5-70b'; use one of tiny, qwen2.5-0.5b"):
        Qwen2Config.from_preset("qwen2.5-70b")
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        CausalLM("gpt5")


def test_rotary_turns_each_pair_by_position_times_frequency():
    head_dim, theta, seq = 8, 10000.0, 5
    x = torch.randn(1, 1, seq, head_dim, dtype=torch.float64)
    cos, sin = rotary_tables(seq, head_dim, theta, torch.device("cpu"), torch.float64)
    out = apply_rotary(x, cos, sin)
    half = head_dim // 2
    for pos in range(seq):
        for i in range(half):
            angle = pos * theta ** (-2 * i / head_dim)
            z = complex(x[0, 0, pos, i], x[0, 0, pos, i + half]) * complex(math.cos(angle), math.sin(angle))
            assert out[0, 0, pos, i].item() == pytest.approx(z.real, abs=1e-6)
            assert out[0, 0, pos, i + half].item() == pytest.approx(z.imag, abs=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    head_dim, theta = 16, 1e6
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, head_dim, dtype=torch.float64, generator=generator)
    cos, sin = rotary_tables(12, head_dim, theta, torch.device("cpu"), torch.float64)

    def score(m, n):
        return float(apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n]))

    # absolute tolerance (the angles are fp32): a score near zero has no useful relative error
    assert score(7, 3) == pytest.approx(score(5, 1), rel=0, abs=1e-5)
    assert score(11, 2) == pytest.approx(score(9, 0), rel=0, abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=0, abs=1e-3)  # and it does depend on the distance


def _manual_attention(attn: Attention, x: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Textbook attention with explicit head loop, causal mask and kv-head lookup h // (heads / kv_heads)."""
    b, s, _ = x.shape
    d = attn.head_dim
    q = attn.q_proj(x).view(b, s, heads, d)
    k = attn.k_proj(x).view(b, s, kv_heads, d)
    v = attn.v_proj(x).view(b, s, kv_heads, d)
    cos, sin = rotary_tables(s, d, attn.rope_theta, x.device, x.dtype)
    outs = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        qh = apply_rotary(q[:, :, h].unsqueeze(1), cos, sin).squeeze(1)
        kh = apply_rotary(k[:, :, g].unsqueeze(1), cos, sin).squeeze(1)
        scores = qh @ kh.transpose(1, 2) / math.sqrt(d)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(scores.softmax(-1) @ v[:, :, g])
    return attn.o_proj(torch.cat(outs, dim=-1))


def test_attention_shares_each_kv_head_among_its_query_group():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    attn = Attention(config).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _manual_attention(attn, x, 4, 2), rtol=1e-10, atol=1e-10)


def test_future_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = CausalLM("tiny")
    model.configure_model()
    ids = torch.randint(0, 256, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_forward_gives_logits_of_batch_seq_vocab():
    model = CausalLM("tiny")
    model.configure_model()
    assert model(torch.zeros(3, 10, dtype=torch.long)).shape == (3, 10, 256)


def test_only_qkv_projections_carry_a_bias():
    with torch.device("meta"):
        model = Qwen2(Qwen2Config.from_preset("tiny"))
    biases = {n.split("layers.0.")[1] for n, _ in model.named_parameters() if n.endswith("bias") and "layers.0." in n}
    assert biases == {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}


def test_tied_embeddings_share_one_tensor():
    config = Qwen2Config(**{**Qwen2Config.from_preset("tiny").to_dict(), "tie_word_embeddings": True})
    model = CausalLM(config)
    model.configure_model()
    assert model.model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.num_parameters() == config.num_parameters()


def test_loss_is_mean_over_label_tokens_ignoring_minus_100():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 2], [-100, -100, 4]])
    total, count = Qwen2.loss_sum(logits, labels)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert count == 3
    torch.testing.assert_close(total / count, expected)


def test_initialization_is_the_same_for_a_shard_and_the_full_tensor():
    from lightning_hybrid.init_weights import fill_normal_region

    full = torch.empty(300, 7000)  # several row blocks of the generator
    fill_normal_region(full, (300, 7000), (0, 0), 0.02, seed=3, name="w")
    part = torch.empty(100, 2000)
    fill_normal_region(part, (300, 7000), (150, 3000), 0.02, seed=3, name="w")
    assert torch.equal(part, full[150:250, 3000:5000])
    assert 0.019 < float(full.std()) < 0.021
