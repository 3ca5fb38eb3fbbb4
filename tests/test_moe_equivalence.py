"""Experts are data, not a new math: a tiny Qwen3-MoE trains on ep x dp, ep x pp, ep x tp meshes like one process.

One 4-process launch (:mod:`moe_worker`) runs every configuration; the references train in this process with
Lightning's default strategy on the same global micro-batches (:mod:`helpers.moe_problem`): the whole global batch,
or its halves with gradient accumulation where the run has two micro-batches per step (a pipeline's, or Lightning's
accumulation under tp). fp32, 5 optimizer steps, the load-balancing loss on (coefficient 0.1), every configuration
within 1e-5 of its reference in every step's loss, load-balancing loss and the final weights.

What each equivalence needs, switched off once by hand (docs/moe.md has the figures): without the all-to-all's
backward on the return path, ep2 x dp2 ends 2.7e-2 from one process (losses 1.5e-4); without the load statistics'
sum over the data ranks, 9.6e-3 (load-balancing losses 1.3e-2); with the experts' FSDP2 gradients divided twice on a
one-rank shard group (a torch 2.13 quirk this code avoids), ep2 x pp2 and ep2 x tp2 end 1.1e-3 off.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from helpers.compare import TOL
from helpers.launch import TESTS, launch
from helpers.moe_problem import MODULE, SEED, STEPS, Recorder, loaders, moe_config, trainer_kwargs
from lightning_hybrid.models import CausalLM

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

AUX_FREE = {"router_bias_update_rate": 1e-3}
CONFIGS = [
    {"name": "ep2_dp2", "ep": 2},
    {"name": "ep2_pp2", "ep": 2, "pp": 2, "microbatches": 2},
    {"name": "ep2_tp2", "ep": 2, "tp": 2, "accumulate": 2},
    {"name": "ep2_tp2_sequence_parallel", "ep": 2, "tp": 2, "sequence_parallel": True, "accumulate": 2},
    {"name": "ep2_dp2_selective_recompute", "ep": 2, "activation_checkpointing": "selective"},
    {"name": "ep1_dp4", "ep": 1},
    {"name": "ep2_cp2", "ep": 2, "cp": 2},
    {"name": "ep2_dp2_bf16_mixed", "ep": 2, "trainer": {"precision": "bf16-mixed"}},
    {"name": "ep2_dp2_forced_router", "ep": 2, "force": True},
    {"name": "aux_free", "ep": 2, "model": AUX_FREE},
    {"name": "aux_free_resumed", "ep": 2, "model": AUX_FREE, "save_at": 2, "resume": True},
    {"name": "aux_free_loaded_on_ep1_dp4", "ep": 1, "model": AUX_FREE, "load_from": "aux_free_resumed"},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("moe")
    (out / "configs.json").write_text(json.dumps(CONFIGS))
    launch(4, [str(TESTS / "moe_worker.py"), str(out / "configs.json"), str(out)], timeout=600)
    records = {c["name"]: torch.load(out / f"{c['name']}.pt", weights_only=False) for c in CONFIGS}
    records["folder"] = out
    return records


class _Setup(L.Callback):
    """Record the initial weights; with ``force``, a routing bias that puts expert 0 into every token's top-k."""

    def __init__(self, force: bool) -> None:
        self.force, self.initial = force, {}

    def on_fit_start(self, trainer, pl_module) -> None:
        self.initial = {k: v.detach().clone() for k, v in pl_module.model.named_parameters()}
        for module in pl_module.model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None and self.force:
                bias[0] = 10.0


def reference(microbatches: int = 1, force: bool = False, model: dict | None = None, strategy=None,
              ckpt_path=None, max_steps: int = STEPS) -> dict:
    """One process: the same global micro-batches, gradients accumulated over ``microbatches`` of them."""
    L.seed_everything(SEED)
    overrides = {"router_bias_update_rate": 1e-12} if force else dict(model or {})
    module = CausalLM(moe_config(**overrides), **MODULE)
    recorder, setup = Recorder(), _Setup(force)
    extra = {"strategy": strategy} if strategy is not None else {}
    trainer = L.Trainer(devices=1, callbacks=[recorder, setup], **extra,
                        **{**trainer_kwargs(accumulate_grad_batches=microbatches), "max_steps": max_steps})
    train, val = loaders(microbatches=microbatches)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "aux": recorder.aux, "load": recorder.load, "initial": setup.initial,
            "final": {k: v.detach().clone() for k, v in module.model.named_parameters()},
            "biases": {k: v.detach().clone() for k, v in module.model.named_buffers()
                       if k.endswith("e_score_correction_bias")}}


@pytest.fixture(scope="module")
def whole_batch() -> dict:
    return reference()


@pytest.fixture(scope="module")
def two_microbatches() -> dict:
    return reference(microbatches=2)


def errors(record: dict, ref: dict) -> dict[str, float]:
    """Worst relative error of the step losses and load-balancing losses, and of the final weight vector."""
    def worst(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b), (a, b)
        return max(abs(x - y) / abs(y) for x, y in zip(a, b))

    diff = torch.cat([(record["final"][k] - v).flatten() for k, v in ref["final"].items()])
    full = torch.cat([v.flatten() for v in ref["final"].values()])
    return {"loss": worst(record["losses"], ref["losses"]), "aux": worst(record["aux"], ref["aux"]),
            "weights": float(diff.norm() / full.norm())}


def assert_trains_like(record: dict, ref: dict) -> None:
    assert record["final"].keys() == ref["final"].keys()
    assert len(record["losses"]) == STEPS
    err = errors(record, ref)
    assert max(err.values()) < TOL, err
    for key, value in ref["initial"].items():  # the same model at any mesh
        assert torch.equal(record["initial"][key], value), key
    moved = torch.cat([(ref["final"][k] - v).flatten() for k, v in ref["initial"].items()])
    assert float(moved.norm()) > 1e-2  # the reference really trained


@pytest.mark.parametrize("name", ["ep2_dp2", "ep2_dp2_selective_recompute", "ep1_dp4", "ep2_cp2"])
def test_expert_parallel_training_equals_one_process_on_the_whole_batch(runs, whole_batch, name):
    assert_trains_like(runs[name], whole_batch)


@pytest.mark.parametrize("name", ["ep2_pp2", "ep2_tp2", "ep2_tp2_sequence_parallel"])
def test_expert_parallel_with_pp_or_tp_equals_one_process_on_the_same_micro_batches(runs, two_microbatches, name):
    assert_trains_like(runs[name], two_microbatches)


def test_bf16_mixed_with_expert_parallelism_trains_like_fp32_within_bf16_rounding(runs, whole_batch):
    record = runs["ep2_dp2_bf16_mixed"]
    assert max(abs(a - b) / b for a, b in zip(record["losses"], whole_batch["losses"])) < 2e-2
    assert errors(record, whole_batch)["weights"] < 2e-2


def test_the_micro_batches_matter_so_the_comparison_has_teeth(whole_batch, two_microbatches):
    """Balancing per micro-batch is not balancing per batch: the two references differ far beyond the tolerance."""
    assert errors(two_microbatches, whole_batch)["weights"] > 100 * TOL


def test_tokens_travel_through_the_all_to_all_only_with_ep(runs):
    from lightning_hybrid.distributed.activation_checkpoint import _saved_ops

    assert runs["ep2_dp2"]["all_to_all_bytes"] > 0 and runs["ep1_dp4"]["all_to_all_bytes"] == 0
    # selective recompute ("op") keeps the all-to-all's outputs: no token is sent twice
    assert torch.ops._c10d_functional.all_to_all_single.default in _saved_ops()


def test_dropless_a_router_that_sends_every_token_to_one_expert_computes_every_token(runs):
    forced = reference(force=True)
    record = runs["ep2_dp2_forced_router"]
    # expert 0 of every layer (on ep rank 0) gets every token: its load is num_experts / top_k = 4 times the mean
    assert record["load"] == [4.0] * STEPS and forced["load"] == [4.0] * STEPS
    assert record["dropped"] == 0.0  # routed (token, expert) pairs less those the experts computed, over all ranks
    assert_trains_like(record, forced)


def test_aux_loss_free_balancing_moves_the_routing_bias_by_the_global_load_like_one_process(runs):
    ref = reference(model=AUX_FREE)
    record = runs["aux_free"]
    assert_trains_like(record, ref)
    assert record["biases"].keys() == ref["biases"].keys() and len(ref["biases"]) == 3
    for name, bias in ref["biases"].items():
        assert bias.abs().max() > 0 and torch.allclose(record["biases"][name], bias, atol=1e-9), name


def test_a_checkpoint_resumes_bitwise_on_its_mesh_and_loads_on_ep1_dp4_and_on_one_process(runs):
    from lightning_hybrid import HybridParallelStrategy

    straight, resumed = runs["aux_free"], runs["aux_free_resumed"]
    assert resumed["losses"] == straight["losses"]
    for key, value in straight["final"].items():
        assert torch.equal(resumed["final"][key], value), key
    for key, value in straight["biases"].items():
        assert torch.equal(resumed["biases"][key], value), key
    on_ep1 = runs["aux_free_loaded_on_ep1_dp4"]  # steps 3 to 5 on another mesh, from the step-2 checkpoint
    assert on_ep1["losses"] == pytest.approx(straight["losses"][2:], rel=TOL)
    assert errors({**on_ep1, "losses": [1.0], "aux": [1.0]},
                  {**straight, "losses": [1.0], "aux": [1.0]})["weights"] < TOL
    # one process, no step left to train: the checkpoint's weights and routing biases as the ep2 x dp2 run held them
    alone = reference(model=AUX_FREE, strategy=HybridParallelStrategy(),
                      ckpt_path=runs["folder"] / "ckpt_aux_free_resumed", max_steps=2)
    saved = resumed["saved"]
    assert alone["final"].keys() == saved["weights"].keys()
    for key, value in saved["weights"].items():
        assert torch.equal(alone["final"][key], value), key
    for key, value in saved["biases"].items():
        assert torch.equal(alone["biases"][key], value) and value.abs().max() > 0, key
