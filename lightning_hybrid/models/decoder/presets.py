"""Published model sizes, by preset name: the fields of each model's ``config.json`` on the Hugging Face Hub.

Sources and parameter totals are in ``docs/models.md`` (tests/test_model_families.py checks the counts against the
published totals). Plain data: no torch, read by the planner.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_QWEN25_COMMON = dict(rope_theta=1000000.0)
# Llama 3 (Meta's params.json / Hugging Face config.json of Meta-Llama-3-8B, -70B and Llama-3.1-405B; "The Llama 3
# Herd of Models", table 3): no q/k/v biases, 128,256-token vocabulary, untied head, rope_theta 500,000, 8 key-value
# heads, at the 8,192-token pre-training context (plain RoPE). The planner's published-run benchmarks use them.
_LLAMA3_COMMON = dict(model_type="llama", vocab_size=128256, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)
# Llama 3.1 / 3.2 (meta-llama/Llama-3.1-8B, -70B, -405B, Llama-3.2-1B, -3B config.json): the Llama 3 shapes at a
# 131,072-token context through the "llama3" rope scaling of the 8,192-token original (factor 8; 32 for 3.2).
_LLAMA31_COMMON = dict(_LLAMA3_COMMON, max_position_embeddings=131072)
_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)
# Qwen3 dense (Qwen/Qwen3-0.6B ... Qwen3-32B config.json): q/k norms, no biases, head_dim 128 at every size,
# 151,936-token vocabulary, rope_theta 1e6, 40,960-token context, tied embeddings up to 4B.
_QWEN3_COMMON = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)

# Qwen3-MoE (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json): the Qwen3 attention (q/k norms, head_dim 128,
# 4 key-value heads) and in every layer (decoder_sparse_step 1, no mlp_only_layers) 128 SwiGLU experts of which a
# token uses 8, routing weights renormalized; published 30.5B total / 3.3B active and 235B / 22B.
_QWEN3_MOE_COMMON = dict(model_type="qwen3_moe", vocab_size=151936, head_dim=128, num_key_value_heads=4,
                         max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                         router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=())

PRESETS: dict[str, dict[str, Any]] = {
    # A debug size: 4 blocks, width 64, GQA 4:2, a byte-level vocabulary. Trains in seconds on a CPU.
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, **_QWEN25_COMMON),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, **_QWEN25_COMMON),
    "qwen2.5-14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, **_QWEN25_COMMON),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, **_QWEN25_COMMON),
    "qwen2.5-72b": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, **_QWEN25_COMMON),
    # Llama 3 / 3.1 sizes at the 8,192-token context; published totals 8.03B, 70.6B and 405.9B parameters.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      **_LLAMA3_COMMON),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       **_LLAMA3_COMMON),
    "llama3-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                        **_LLAMA3_COMMON),
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        rope_scaling=_LLAMA31_ROPE, **_LLAMA31_COMMON),
    "llama3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         rope_scaling=_LLAMA31_ROPE, **_LLAMA31_COMMON),
    "llama3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                          num_attention_heads=128, rope_scaling=_LLAMA31_ROPE, **_LLAMA31_COMMON),
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        head_dim=64, rope_scaling=_LLAMA32_ROPE, **dict(_LLAMA31_COMMON, tie_word_embeddings=True)),
    "llama3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        head_dim=128, rope_scaling=_LLAMA32_ROPE, **dict(_LLAMA31_COMMON, tie_word_embeddings=True)),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False, **_QWEN3_COMMON),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      tie_word_embeddings=False, **_QWEN3_COMMON),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      tie_word_embeddings=False, **_QWEN3_COMMON),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, **_QWEN3_MOE_COMMON),
    "qwen3-235b-a22b": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64, **_QWEN3_MOE_COMMON),
    # Mistral-7B-v0.3 (mistralai/Mistral-7B-v0.3 config.json): Llama-shaped, 32,768-token vocabulary, rope_theta 1e6,
    # sliding_window null (full attention).
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
    # Debug sizes of the other families, the shape of "tiny": each family's traits on a CPU in seconds. tiny-llama's
    # llama3 scaling has a 64-token original context, so it changes the frequencies a 16-token sequence uses.
    "tiny-llama": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_scaling=dict(_LLAMA31_ROPE, original_max_position_embeddings=64)),
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny-mistral": dict(model_type="mistral", vocab_size=256, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False),
    # A debug mixture of experts, the shape of tiny-qwen3: 8 experts of width 32, 2 per token, every layer sparse
    # except layer 1 (a dense MLP, so both kinds of block are exercised); the auxiliary loss at 0.01.
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=176,
                     moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     router_aux_loss_coef=0.01, mlp_only_layers=(1,)),
}
