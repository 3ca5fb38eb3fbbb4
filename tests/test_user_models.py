"""Models the user brings: a decoder of their own (docs/custom-models.md) and a Hugging Face model held as it is
(docs/huggingface.md), trained by ``HybridParallelStrategy`` like one process.

The decoder below is the guide's, defined here with its own names (``tok_emb``, ``h``, ``ln_f``, ``out``, separate
``wq/wk/wv/wo``, ``ffn.w1/w2/w3``) and its own LightningModule; the guide holds this very code (a test below checks
it, and runs the guide's snippets). ``HeldLlama`` is a user's LightningModule around
``AutoModelForCausalLM.from_pretrained`` that computes the loss from the model's logits and holds no parallelism code.

One launch of 4 forked processes (``user_models_worker.py``) trains: the decoder on tp=2 x pp=2 (sequence parallel)
and on cp=2 x tp=2, ``HeldLlama`` on tp=2 x dp=2 (recompute per decoder layer); rank 0 then trains both on one
process with Lightning's default strategy. Every run: 5 optimizer steps, fp32.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.init_weights import init_parameters
from lightning_hybrid.models.attention import CausalAttention
from lightning_hybrid.models.causal_lm import builds_declared_models, declared_runner, global_token_loss
from lightning_hybrid.models.spec import IGNORE_INDEX, ParallelSpec

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "custom-models.md"
STEPS = 5


# ------------------------------------------------------------------------------------------------ the user's decoder

@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """RoPE on (batch, heads, seq, head_dim), pairs (2i, 2i+1), at ``positions`` (seq,) or (batch, seq)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float().unsqueeze(-1) * freqs
    if angles.dim() == 3:  # per-document positions (batch, seq, half): one table per row
        angles = angles.unsqueeze(1)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = cfg.dim // cfg.n_heads, cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.core = CausalAttention()  # the strategy swaps it for ring attention under cp

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        b, s, _ = x.shape
        # heads counted from the projections' outputs: a TP rank holds heads / tp of them
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        # global positions of the tokens this rank holds (cp), or each token's place in its document
        positions = self.core.positions(s, x.device) if position_ids is None else position_ids
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        out = self.core(q, k, v, position_ids=position_ids)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.eps), Attention(cfg)
        self.ffn_norm, self.ffn = RMSNorm(cfg.dim, cfg.eps), FeedForward(cfg)

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        # position_ids by keyword: the strategy's input layouts touch only the first positional input
        x = x + self.attn(self.attn_norm(x), position_ids=position_ids)
        return x + self.ffn(self.ffn_norm(x))


class TinyDecoder(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: Optional[nn.Embedding] = nn.Embedding(cfg.vocab, cfg.dim)
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})  # keyed by global index
        self.ln_f: Optional[RMSNorm] = RMSNorm(cfg.dim, cfg.eps)
        self.out: Optional[nn.Linear] = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        # A pipeline stage holds some blocks and maybe the ends: a part that is None is skipped, and a stage
        # without the embedding receives the previous stage's hidden states in place of input_ids.
        x = self.tok_emb(input_ids) if self.tok_emb is not None else input_ids
        for block in self.h.values():
            x = block(x, position_ids=position_ids)
        x = self.ln_f(x) if self.ln_f is not None else x
        return self.out(x) if self.out is not None else x

    @staticmethod
    def loss_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-entropy summed over the label tokens, and their number (the strategy divides by the global one)."""
        loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        return loss, (labels != IGNORE_INDEX).sum()

    def parameter_init(self, name: str) -> tuple[str, float]:
        """How the parameter ``name`` (global) starts: ``("normal", std)``, ``("ones", 0)`` or ``("zeros", 0)``."""
        if name.endswith("norm.weight") or name == "ln_f.weight":
            return "ones", 0.0
        if name.endswith(("wo.weight", "w2.weight")):  # residual outputs: scaled by depth
            return "normal", 0.02 / math.sqrt(2 * self.cfg.n_layers)
        return "normal", 0.02


def tiny_decoder_spec(cfg: TinyConfig) -> ParallelSpec:
    return ParallelSpec(
        embedding="tok_emb", blocks="h", norm="ln_f", head="out",
        block_plan={"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
                    "ffn.w1": "colwise", "ffn.w3": "colwise", "ffn.w2": "rowwise"},
        block_norms=("attn_norm", "ffn_norm"),        # sharded on the sequence under sequence parallel
        block_norm_consumers=("attn", "ffn"),         # their input gathered back to the whole sequence
        block_attention="attn", attention_core="core",
        tp_divisible={"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads},
    )


class TinyDecoderLM(L.LightningModule):
    def __init__(self, cfg: TinyConfig = TinyConfig(), lr: float = 1e-3, seed: int = 0) -> None:
        super().__init__()
        self.cfg, self.lr, self.seed = cfg, lr, seed
        self.model: Optional[TinyDecoder] = None

    # What the strategy asks before it builds the model.
    def parallel_spec(self) -> ParallelSpec:
        return tiny_decoder_spec(self.cfg)

    def num_blocks(self) -> int:
        return self.cfg.n_layers

    def init_seed(self) -> int:
        return self.seed

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):  # HybridParallelStrategy shards it before any weight is allocated
            model = TinyDecoder(self.cfg)
        if not builds_declared_models(self):  # any other strategy: allocate and initialize it here
            model.to_empty(device=self.device)
            init_parameters(model, self.seed, model.parameter_init)
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels = batch
        loss, mean, _ = global_token_loss(self, input_ids, labels, train=True)
        self.log("train_loss", mean)
        return loss

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        # Under a pipeline the schedule computes the gradients inside training_step; the strategy zeroes them.
        if declared_runner(self) is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0, eps=1e-6)


def train(strategy: Union[str, HybridParallelStrategy], devices: int, data: DataLoader, max_steps: int = 5,
          callbacks: Sequence[L.Callback] = (), seed: int = 1234) -> TinyDecoderLM:
    L.seed_everything(seed)  # also the seed of the shuffling DistributedSampler Lightning gives `data`
    module = TinyDecoderLM(seed=seed)
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks))
    trainer.fit(module, train_dataloaders=data)
    return module


# ------------------------------------------------------------------------------------------------ a held HF model

class HeldLlama(L.LightningModule):
    """A user's module around a transformers model, as written for one device: no parallelism code."""

    def __init__(self, path: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.path, self.lr = path, lr
        self.model: Optional[nn.Module] = None

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).train()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels = batch
        logits = self.model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0, eps=1e-6)


def tiny_llama(folder: Path, **overrides: Any) -> Path:
    """A random tiny ``LlamaForCausalLM`` (transformers' own classes, fp32) saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(**{**values, **overrides})).save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------------ the launch

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from helpers.launch import TESTS, launch

    out = tmp_path_factory.mktemp("user_models")
    launch(4, [str(TESTS / "user_models_worker.py"), str(out)], timeout=400)
    return torch.load(out / "records.pt", weights_only=False)


def distributed(test: Any) -> Any:
    return pytest.mark.timeout(420)(pytest.mark.distributed(test))


@distributed
def test_own_decoder_on_tp2_pp2_with_sequence_parallel_trains_like_one_process(runs):
    from helpers.compare import assert_trains_like

    assert_trains_like(runs["decoder_tp2_pp2"], runs["decoder_reference"], same_initial_weights=True, steps=STEPS)


@distributed
def test_own_decoder_on_cp2_tp2_trains_like_one_process(runs):
    from helpers.compare import assert_trains_like

    assert_trains_like(runs["decoder_cp2_tp2"], runs["decoder_reference"], same_initial_weights=True, steps=STEPS)


@distributed
def test_held_llama_on_tp2_dp2_with_recompute_trains_like_one_process(runs):
    from helpers.compare import assert_trains_like

    record = runs["llama_tp2_dp2"]
    assert_trains_like(record, runs["llama_reference"], same_initial_weights=True, steps=STEPS)
    # what the strategy applied on every rank: the model's own plan over tp, FSDP2 units over dp, recompute
    for rank in record["applied"]:  # 7 linears in each of 2 layers, the embedding and the head; 2 layers + the root
        assert rank == {"sharded_by_tp": 16, "fsdp_units": 3, "recomputed": 2}, record["applied"]
    assert record["log"] == ["LlamaForCausalLM (model) held as it is: its own tp plan over tp=2, fsdp over dp=2, "
                             "activation_checkpointing='full' per decoder layer"], record["log"]


# ------------------------------------------------------------------------------------------------ one process

def guide_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guide_holds_the_tested_decoder_and_its_snippets_run():
    code = "\n".join(guide_blocks())
    for obj in (TinyConfig, RMSNorm, rotate, Attention, FeedForward, Block, TinyDecoder, tiny_decoder_spec,
                TinyDecoderLM, train):
        assert inspect.getsource(obj) in code, f"docs/custom-models.md does not show the tested {obj.__name__}"
    guide = types.ModuleType("custom_models_guide")  # a module of its own, as the reader's script would be
    sys.modules[guide.__name__] = guide
    try:
        for block in guide_blocks():  # every snippet runs, in the guide's order, without this file's imports
            exec(compile(block, str(GUIDE), "exec", dont_inherit=True), guide.__dict__)
        assert isinstance(guide.TinyDecoderLM().parallel_spec(), ParallelSpec)
    finally:
        del sys.modules[guide.__name__]


def test_own_decoder_masks_documents_and_counts_global_positions_on_one_process():
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig())
    first, second = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 7))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    with torch.no_grad():
        logits = model(packed, position_ids=positions)
        alone = torch.cat([model(first), model(second)], dim=1)
    assert torch.allclose(logits, alone, atol=1e-5) and not torch.allclose(model(packed), alone, atol=1e-3)


def _guide_error(row: str) -> None:
    """Make the error of one row of the guide's error table happen."""
    from dataclasses import replace
    from types import SimpleNamespace

    from lightning_hybrid.distributed.declared import declared_model
    from lightning_hybrid.distributed.parallelize import require_meta
    from lightning_hybrid.distributed.tensor_parallel import apply_tensor_parallel

    no_blocks = type("TinyDecoderLM", (TinyDecoderLM,), {"num_blocks": None})

    class NoAttention(TinyDecoderLM):
        def parallel_spec(self) -> ParallelSpec:
            return replace(tiny_decoder_spec(self.cfg), block_attention=None, attention_core=None)

    module, model = TinyDecoderLM(), TinyDecoder(TinyConfig())
    if row.startswith("tp=4"):
        _checked(module, tp=4)
    elif "has no num_blocks" in row:
        _checked(no_blocks())
    elif "built real weights" in row:
        require_meta(model, "TinyDecoderLM")
    elif "has no loss_sum" in row or "has no parameter_init" in row:
        setattr(model, "loss_sum" if "loss_sum" in row else "parameter_init", None)
        module.model = model
        declared_model(module)
    elif row.startswith("cp=2"):
        _checked(NoAttention(), cp=2, tp=2)
    elif row.startswith("tie_word_embeddings"):
        model.out.weight = model.tok_emb.weight
        apply_tensor_parallel(model, tiny_decoder_spec(model.cfg), SimpleNamespace(size=lambda: 2))
    elif row.startswith("tp='auto'"):
        _checked(module, tp="auto")
    elif row.startswith("split point"):
        _checked(module, tp=2, pp=2, pp_split_points=["layers.2"])


def test_the_huggingface_guide_shows_the_tested_held_module_and_its_snippet_runs():
    page = (GUIDE.parent / "huggingface.md").read_text().split("## A transformers model held as it is")[1]
    block = re.search(r"```python\n(.*?)```", page, flags=re.S).group(1)
    assert inspect.getsource(HeldLlama) in block
    guide = types.ModuleType("held_model_guide")
    sys.modules[guide.__name__] = guide
    try:
        exec(compile(block, "docs/huggingface.md", "exec", dont_inherit=True), guide.__dict__)
        assert guide.trainer.strategy.options.tp == 2 and guide.HeldLlama("folder").model is None
    finally:
        del sys.modules[guide.__name__]


def test_every_error_the_guide_lists_is_the_one_line_the_strategy_raises():
    rows = re.findall(r"^\| `([^`]+)` \|", GUIDE.read_text().split("## Errors you may meet")[1], flags=re.M)
    assert len(rows) == 9, rows
    for row in rows:
        with pytest.raises((ValueError, TypeError)) as caught:
            _guide_error(row)
        assert str(caught.value).startswith(row) and "\n" not in str(caught.value), (row, str(caught.value))


# ------------------------------------------------------------------------------------------------ held models: errors

def _checked(module: L.LightningModule, devices: int = 4, **kwargs: Any) -> HybridParallelStrategy:
    """The strategy after its setup-time checks (no process group) for ``module`` on ``devices`` processes."""
    strategy = HybridParallelStrategy(**kwargs)
    strategy._lightning_module = module
    strategy._parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = 1
    strategy._validate()
    return strategy


def _holding(folder: Path) -> HeldLlama:
    module = HeldLlama(str(folder))
    module.configure_model()  # made in __init__ or before fit: checked before any process group exists
    return module


def test_a_held_model_whose_heads_tp_does_not_divide_is_refused_naming_the_field_and_what_fits(tmp_path):
    module = _holding(tiny_llama(tmp_path / "llama", num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM \(model\): tp=2 does not divide "
                                         r"LlamaConfig.num_key_value_heads=1; use tp in 1$"):
        _checked(module, tp=2, dp=2)
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM \(model\): tp=4 does not divide "
                                         r"LlamaConfig.num_key_value_heads=2; use tp in 1 or 2$"):
        _checked(_holding(tiny_llama(tmp_path / "llama2")), tp=4)


def test_held_models_refuse_what_they_cannot_run_in_one_line(tmp_path):
    module = _holding(tiny_llama(tmp_path / "llama"))
    with pytest.raises(ValueError, match=r"^pp=2 needs a LightningModule that declares its model parts and loss .* "
                                         r"\(a Hugging Face model held as it is trains with tp and dp only\)$"):
        _checked(module, pp=2, tp=2)
    with pytest.raises(ValueError, match=r"^sequence_parallel=True needs a declared model .* use sequence_parallel="):
        _checked(module, tp=2, dp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"^cp=2 needs a model that declares its attention"):
        _checked(module, cp=2, tp=2)
    module.model.tp_plan = {**module.model.tp_plan, "model.layers.*.mlp.gate_proj": "packed_colwise"}
    with pytest.raises(ValueError, match=r"^the tp plan of LlamaForCausalLM \(model\) uses 'packed_colwise' "
                                         r"\(model.layers.\*.mlp.gate_proj: packed_colwise\), which "
                                         r"HybridParallelStrategy does not train; supported: colwise, rowwise"):
        _checked(module, tp=2, dp=2)
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = HeldLlama(str(tmp_path / "llama"))
    with torch.device("meta"):  # from_config on meta: no weights to shard
        meta.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "llama"))
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM \(model\) is on the meta device; .*models.CausalLM"):
        _checked(meta, tp=2, dp=2)
