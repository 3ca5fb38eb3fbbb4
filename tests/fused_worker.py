"""Fused projections and rotary tables made once, on 4 gloo processes, without a Trainer (issue #49).

Launched once by ``tests/test_fused_projections.py``. Every case builds the decoder on the meta device, runs the
strategy's own parallelize sequence on a mesh of the 4 ranks (float8 -> TP -> recompute/compile -> FSDP2), fills the
weights mesh-independently, and runs one forward and backward of a fixed batch; every rank also runs the one-process
model on the whole batch. A case records, per rank, the relative error (norm of the difference over the norm, whole
vectors) of the logits at this rank's tokens and of the full gradients against the one-process model, and of the
fused model against the unfused one on the same mesh. The last case loads the checkpoint the code before the fusion
wrote (``fixtures/pre_fusion_checkpoint``, tp=2) at tp2 x dp2 and compares. Rank 0 writes the records as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from helpers.worker_exit import end_worker
from lightning_hybrid.distributed.context_parallel import sequence_positions
from lightning_hybrid.distributed.mesh import build_mesh
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.distributed.parallelize import parallelize
from lightning_hybrid.init_weights import init_parameters
from lightning_hybrid.models.decoder.config import DecoderConfig
from lightning_hybrid.models.decoder.model import Decoder

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pre_fusion_checkpoint"
SEQ, BATCH, SEED = 16, 4, 99


def config(heads: int, kv_heads: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, name="fused-test")


def batch(cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, labels and packed-document positions (documents of 5, 7 and 4 tokens) of the whole batch."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]).expand(BATCH, SEQ).contiguous()
    return ids, labels, positions


def full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def build(cfg: DecoderConfig, fused: bool, dims: Optional[ParallelDims], mesh: Any, **options: Any) -> Decoder:
    """The decoder with ``fused`` projections, parallelized over ``mesh`` (``None``: one process), initialized."""
    with torch.device("meta"):
        model = Decoder(cfg, fused_projections=fused)
    if dims is None:
        model.to_empty(device="cpu")
    else:
        opts = ParallelOptions(tp=dims.tp, cp=dims.cp, loss_parallel=False, **options)
        parallelize(model, model.parallel_spec(), opts, dims, mesh, torch.device("cpu"), "32-true", lambda m: m)
    init_parameters(model, 0, model.parameter_init)
    return model


def step(model: Decoder, ids: torch.Tensor, labels: torch.Tensor, positions: Optional[torch.Tensor],
         scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits (this rank's tokens) and full gradients of ``scale * loss_sum`` (the global token mean's share)."""
    logits = model(ids, positions)
    loss, _ = model.loss_sum(logits, labels)
    (loss * scale).backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    return full(logits).detach(), grads


def grads_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return rel(torch.cat([a[k].flatten() for k in b]), torch.cat([b[k].flatten() for k in b]))


def mesh_case(heads: int, kv_heads: int, tp: int, cp: int = 1, documents: bool = False,
              **options: Any) -> dict[str, Any]:
    """Fused and unfused at (tp, cp, dp = the rest), each against the one-process model, and against each other."""
    cfg = config(heads, kv_heads)
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.resolve(tp=tp, pp=1, dp=None, world_size=world, cp=cp)
    mesh = build_mesh(dims, "cpu")
    coords = dims.coordinates(rank)
    ids, labels, positions = batch(cfg)
    total = BATCH * SEQ
    reference = build(cfg, False, None, None)
    ref_logits, ref_grads = step(reference, ids, labels, positions if documents else None, 1.0 / total)
    rows = slice(coords["dp"] * BATCH // dims.dp, (coords["dp"] + 1) * BATCH // dims.dp)
    tokens = sequence_positions(SEQ, cp, coords.get("cp", 0)) if cp > 1 else torch.arange(SEQ)
    local = [t[rows].index_select(1, tokens) for t in (ids, labels, positions)]
    out: dict[str, Any] = {}
    runs = {}
    for fused in (True, False):
        model = build(cfg, fused, dims, mesh, **options)
        runs[fused] = step(model, local[0], local[1], local[2] if documents else None, dims.data_ranks / total)
        name = "fused" if fused else "unfused"
        out[f"{name}_logits"] = rel(runs[fused][0], ref_logits[rows].index_select(1, tokens))
        out[f"{name}_grads"] = grads_error(runs[fused][1], ref_grads)
    out["fused_vs_unfused_logits"] = rel(runs[True][0], runs[False][0])
    out["fused_vs_unfused_grads"] = grads_error(runs[True][1], runs[False][1])
    return out


def rotary_case(tp: int, cp: int) -> dict[str, Any]:
    """Rotary tables made once against made per layer (the model's ``rotary`` set to ``None``), at tp x cp with
    sequence parallelism and packed documents: logits bitwise, and both against one process."""
    cfg = config(4, 2)
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.resolve(tp=tp, pp=1, dp=None, world_size=world, cp=cp)
    mesh = build_mesh(dims, "cpu")
    coords = dims.coordinates(rank)
    ids, _, positions = batch(cfg)
    tokens = sequence_positions(SEQ, cp, coords["cp"])
    reference = build(cfg, True, None, None)
    out: dict[str, Any] = {}
    for documents in (False, True):
        pos = positions if documents else None
        with torch.no_grad():
            ref = reference(ids, pos).index_select(1, tokens)
            model = build(cfg, True, dims, mesh, sequence_parallel=True)
            once = full(model(ids.index_select(1, tokens), None if pos is None else pos.index_select(1, tokens)))
            model.rotary = None
            per_layer = full(model(ids.index_select(1, tokens), None if pos is None else pos.index_select(1, tokens)))
        key = "documents" if documents else "plain"
        out[f"{key}_bitwise"] = bool(torch.equal(once, per_layer))
        out[f"{key}_vs_one_process"] = rel(once, ref)
    return out


def old_checkpoint_case() -> dict[str, Any]:
    """The pre-fusion checkpoint (tp=2) loaded at tp2 x dp2 with FSDP: every weight and AdamW state bitwise what DCP
    reads from its files, and the logits of the old code."""
    import torch.distributed.checkpoint as dcp

    from lightning_hybrid.checkpoint.dcp import load_shards

    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    cfg = DecoderConfig(**reference["config"])
    dims = ParallelDims.resolve(tp=2, pp=1, dp=None, world_size=dist.get_world_size())
    mesh = build_mesh(dims, "cpu")
    model = build(cfg, True, dims, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's state exists, to be overwritten by the checkpoint's
    load_shards(FIXTURE, model, [optimizer], None)
    names = {id(p): n for n, p in model.named_parameters()}
    loaded = {f"model.{n}": full(p.detach()) for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            loaded[f"optimizer_0.state.{names[id(p)]}.{key}"] = full(state[key])
    stored = {k: torch.empty_like(v) for k, v in loaded.items()}
    dcp.load(stored, checkpoint_id=str(FIXTURE), no_dist=True)  # the files as DCP reads them, no model code
    with torch.no_grad():
        logits = {key: full(model(reference["ids"], pos))
                  for key, pos in (("plain", None), ("documents", reference["positions"]))}
    shapes = {f"model.{n}": tuple(t.shape) for n, t in model.state_dict().items()}
    return {"names_and_shapes_equal": shapes == {k: tuple(v) for k, v in reference["shapes"].items()},
            "tensors": len(loaded), "bitwise": [k for k in loaded if not torch.equal(loaded[k], stored[k])],
            "adamw_moved": bool(any(v.abs().sum() > 0 for k, v in stored.items() if k.endswith("exp_avg"))),
            **{f"logits_{k}": rel(v, reference["logits"][k]) for k, v in logits.items()}}


CASES = {
    "tp2_dp2_gqa_fsdp": lambda: mesh_case(4, 2, tp=2),
    "tp2_dp2_gqa_sp_documents": lambda: mesh_case(4, 2, tp=2, documents=True, sequence_parallel=True),
    "tp4_kv_heads_equal_tp": lambda: mesh_case(8, 4, tp=4),
    "tp2_dp2_compile_sp": lambda: mesh_case(4, 2, tp=2, sequence_parallel=True, compile=True),
    "rotary_cp2_tp2_sp": lambda: rotary_case(tp=2, cp=2),
    "pre_fusion_checkpoint_tp2_dp2": old_checkpoint_case,
}


def main(out_path: str, names: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {name: CASES[name]() for name in names}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(CASES))
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
