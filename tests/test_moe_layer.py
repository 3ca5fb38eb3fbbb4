"""The mixture-of-experts layer on one device: grouped GEMM against the loop, the injected load-balancing gradient,
auxiliary-loss-free balancing, the step statistics, mesh-independent initialization of 3-D experts and reading a
shard's region of per-expert Hugging Face tensors."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_hybrid.init_weights import fill_normal_region, init_parameters
from lightning_hybrid.models.decoder.config import DecoderConfig
from lightning_hybrid.models.decoder.hf_experts import read_experts_region
from lightning_hybrid.models.decoder.model import Decoder, parameter_init
from lightning_hybrid.models.decoder.moe import MoE, expert_mlp, moe_layers, step_metrics


def _model(**overrides) -> Decoder:
    config = DecoderConfig(**{**DecoderConfig.from_preset("tiny-moe").to_dict(), **overrides})
    model = Decoder(config)
    init_parameters(model, 0, functools.partial(parameter_init, config))
    return model


def test_grouped_gemm_computes_what_the_loop_computes_forward_and_backward():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(13, 16, generator=g)
    gate_up, down = torch.randn(4, 64, 16, generator=g), torch.randn(4, 16, 32, generator=g)
    counts, upstream = [5, 0, 6, 2], torch.randn(13, 16, generator=g)
    results = []
    for grouped in (True, False):
        x, a, b = (t.clone().requires_grad_() for t in (tokens, gate_up, down))
        out = expert_mlp(x, counts, a, b, grouped=grouped)
        out.backward(upstream)
        results.append((out.detach(), x.grad, a.grad, b.grad))
    for grouped, loop in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


def test_the_injected_balancing_gradient_is_the_gradient_of_coef_over_layers_times_the_loss():
    model = _model().train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    layers = moe_layers(model)
    logits = model(ids)
    logits.sum().backward()  # the injected gradients ride along
    injected = {i: m.gate.weight.grad.clone() for i, m in layers.items()}
    model.zero_grad()
    for layer in layers.values():  # the same objective spelled out: coef / 3 sparse layers x the sum of the losses
        layer.aux_loss_coef = 0.0
    explicit = []

    def keep(module, args, output):
        probs = module.gate(args[0].reshape(-1, 64))
        index = torch.topk(probs, 2, dim=-1).indices
        fraction = torch.bincount(index.reshape(-1), minlength=8).float() / probs.shape[0]
        explicit.append(8 * (fraction * probs.mean(0)).sum())

    hooks = [m.register_forward_hook(keep) for m in layers.values()]
    logits = model(ids)
    (logits.sum() + 0.01 / 3 * torch.stack(explicit).sum()).backward()
    for hook in hooks:
        hook.remove()
    for i, m in layers.items():  # fp32 rounding of two summation orders
        assert float((m.gate.weight.grad - injected[i]).norm() / injected[i].norm()) < 1e-5, i
    # and the balancing term is a real part of the router's gradient
    model.zero_grad()
    model(ids).sum().backward()
    assert all(float((m.gate.weight.grad - injected[i]).norm() / injected[i].norm()) > 1e-4 for i, m in layers.items())


def test_aux_loss_free_balancing_moves_the_bias_of_overloaded_experts_down_after_a_step():
    model = _model(router_bias_update_rate=0.05).train()
    layer = moe_layers(model)[0]
    model(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))).sum().backward()
    load = layer.stats.load.clone()
    layer.end_step()
    bias = layer.gate.e_score_correction_bias
    assert torch.equal(bias, 0.05 * torch.sign(load.mean() - load).float())
    assert layer.stats.load is None  # the next step starts afresh
    # the bias changes the choice only: the weights stay the softmax probabilities of the chosen experts
    bias.copy_(torch.tensor([10.0] + [0.0] * 7))
    x = torch.randn(5, 64)
    model.eval()
    assert (layer.gate(x) > 0).all()


def test_step_metrics_give_load_balance_loss_and_dropped_tokens_per_sparse_layer():
    model = _model().train()
    model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))).sum().backward()
    table = step_metrics(moe_layers(model), 4, torch.device("cpu"))
    assert table[:, 3].tolist() == [1.0, 0.0, 1.0, 1.0]  # layer 1 is dense
    assert (table[[0, 2, 3], 0] >= 1.0).all() and (table[[0, 2, 3], 1] > 0).all()
    assert (table[:, 2] == 0).all()  # every routed (token, expert) pair was computed
    layer = moe_layers(model)[0]
    assert layer.stats.load.sum() == 2 * 16 * 2  # tokens x top-k


def test_three_dimensional_experts_are_initialized_alike_whatever_slice_a_rank_holds():
    full = torch.empty(4, 6, 5)
    fill_normal_region(full, (4, 6, 5), (0, 0, 0), 0.02, 7, "layers.0.mlp.experts.gate_up_proj")
    part = torch.empty(2, 3, 5)  # experts 1-2, rows 3-5: an ep rank's experts, FSDP's rows of them
    fill_normal_region(part, (4, 6, 5), (1, 3, 0), 0.02, 7, "layers.0.mlp.experts.gate_up_proj")
    assert torch.equal(part, full[1:3, 3:6])


def test_a_shards_region_is_assembled_from_per_expert_gate_and_up_tensors():
    g = torch.Generator().manual_seed(4)
    fused = torch.randn(3, 8, 5, generator=g)  # inter 4: rows 0-3 gate, 4-7 up
    tensors = {}
    for e in range(3):
        prefix = f"model.layers.2.mlp.experts.{e}"
        tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"] = fused[e, :4], fused[e, 4:]

    class Files:
        def read(self, name, offset, shape):
            return tensors[name][tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    region = read_experts_region(Files(), "layers.2.mlp.experts.gate_up_proj", (1, 2, 1), (2, 5, 3), inter=4)
    assert torch.equal(region, fused[1:3, 2:7, 1:4])  # across the gate/up boundary


def test_export_warns_that_qwen3_moe_has_no_routing_bias(tmp_path):
    from helpers.hf_models import write_checkpoint
    from lightning_hybrid.checkpoint.export import export_hf

    model = _model(router_bias_update_rate=1e-3)
    write_checkpoint(model, tmp_path / "ckpt", None)
    with pytest.warns(UserWarning, match="routing biases of auxiliary-loss-free balancing"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", dtype="fp32")
    assert isinstance(model.layers["0"].mlp, MoE)
