"""Runs several training configurations inside one launched process group and saves what they did.

Launched by ``helpers.launch.run_workers`` with torchrun. For each configuration: a fresh seed, a
Trainer with ``HybridParallelStrategy``, a few optimizer steps on fixed random tokens; rank 0 saves the
per-step global losses, the validation loss, and the full (gathered) initial and final weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist

from helpers.equivalence import (
    GLOBAL_BATCH,
    SEED,
    LossRecorder,
    make_dataset,
    make_mixture_loader,
    make_trainer_kwargs,
    tiny_config,
)
from helpers.gather import first_prediction, full_weights, gather_merged, gather_objects
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.models import CausalLM


class WeightRecorder(L.Callback):
    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = full_weights(pl_module.model)


def evaluate_after_fit(trainer: L.Trainer, module: L.LightningModule, val) -> dict:
    """trainer.test and trainer.predict on the fitted model; predictions gathered from the rank that has them."""
    test_loss = float(trainer.test(module, dataloaders=val, verbose=False)[0]["test_loss"])
    inputs = torch.utils.data.DataLoader([x for x, _ in val.dataset], batch_size=val.batch_size)
    return {"test_loss": test_loss, "logits": first_prediction(trainer.predict(module, dataloaders=inputs))}


class SampleRecorder(L.Callback):
    """Rank 0: the samples of every global batch (their first tokens, sorted), gathered from the dp ranks."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dp_rank = trainer.strategy.distributed_sampler_kwargs["rank"]
        parts = gather_objects((dp_rank, [row[:6].tolist() for row in batch[0]]))
        self.batches.append(sorted(sample for _, samples in dict(parts).items() for sample in samples))


class SaveAt(L.Callback):
    """Save a checkpoint at the end of optimizer step ``step``, where a fault-tolerant callback would."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True  # as if the job died here: the LR schedule still spans all steps


def _module(kind: str, hf: Optional[str] = None) -> L.LightningModule:
    if kind == "model_parallel_user":
        from user_module import UserTPModule

        return UserTPModule()
    if hf is not None:  # a Hugging Face folder: its family and its weights
        return CausalLM(hf, init_from_hf=hf, **make_trainer_kwargs()["module"])
    return CausalLM(tiny_config(), **make_trainer_kwargs()["module"])


def _fit(config: dict, kind: str, trainer_extra: dict, callbacks: list, ckpt_path=None, max_steps=None,
         mixture: bool = False, hf: Optional[str] = None):
    world = int(os.environ["WORLD_SIZE"])
    module = _module(kind, hf)
    kwargs = {**make_trainer_kwargs()["trainer"], **trainer_extra}
    if max_steps is not None:
        kwargs["max_steps"] = max_steps
    trainer = L.Trainer(strategy=HybridParallelStrategy(**config), devices=world, callbacks=callbacks, **kwargs)
    from lightning_hybrid.distributed.options import AUTO_FIELDS

    # The planner picks dp: a datamodule keeps the global batch; the resume is announced before fit so the manifest's
    # layout is kept.
    if any(config.get(k) == "auto" for k in AUTO_FIELDS):
        from helpers.auto_data import GlobalBatchData

        trainer.ckpt_path = ckpt_path
        data = GlobalBatchData()
        trainer.fit(module, datamodule=data)
        return trainer, module, data.val_dataloader()
    dp = config.get("dp") or world // (config.get("tp", 1) * config.get("pp", 1) * config.get("cp", 1))
    train, val = make_dataset(GLOBAL_BATCH // dp)
    if mixture:
        train = make_mixture_loader(GLOBAL_BATCH // dp)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    return trainer, module, val


def run(config: dict, out: Path) -> None:
    kind = config.pop("module", "causal_lm")
    name = config.pop("name")
    trainer_extra = config.pop("trainer", {})
    evaluate = config.pop("evaluate", False)
    save_at = config.pop("save_at", None)          # train to this step, save, resume (maybe on another mesh)
    resume_config = config.pop("resume_config", None)
    load_from = config.pop("load_from", None)      # resume from an existing checkpoint
    stop_after_save = config.pop("stop_after_save", False)
    mixture = config.pop("mixture", False)         # train on a weighted mixture; record each step's samples
    hf = config.pop("hf", None)                    # a Hugging Face folder to build the model from and load
    export_to = config.pop("save_end", None)       # save a checkpoint there at the end (for export-hf)
    import lightning_hybrid.distributed.activation_checkpoint as recompute_and_compile
    # the compile-under-TP workaround switched off (tests/test_compile_tp.py shows the wrong gradients then)
    recompute_and_compile.TP_COMPILE_WORKAROUND = config.pop("tp_compile_workaround", True)
    L.seed_everything(SEED)
    losses, weights, samples = LossRecorder(), WeightRecorder(), SampleRecorder()
    recorders = [losses, samples] if mixture else [losses]
    if save_at is not None:
        ckpt = out / f"ckpt_{name}"
        trainer, module, val = _fit(dict(config), kind, trainer_extra, [*recorders, weights, SaveAt(save_at, ckpt)],
                                    mixture=mixture)
        if not stop_after_save:
            L.seed_everything(SEED + 1)  # the resumed run must not depend on the seed it starts with
            config = dict(resume_config or config)
            trainer, module, val = _fit(dict(config), kind, trainer_extra, recorders, ckpt_path=ckpt, mixture=mixture)
    else:
        trainer, module, val = _fit(dict(config), kind, trainer_extra, [*recorders, weights], ckpt_path=load_from,
                                    mixture=mixture, hf=hf)
    if export_to is not None:
        trainer.save_checkpoint(out / export_to)
    final = full_weights(module.model)
    record = {"losses": losses.losses, "samples": samples.batches,
              "val_loss": (float(trainer.callback_metrics["val_loss"]) if "val_loss" in trainer.callback_metrics
                           else None),
              "initial": weights.initial, "final": final,
              "optimizer": optimizer_state(module),
              "switches": applied_switches(module.model, getattr(trainer.strategy, "pipeline", None)),
              "bubble": getattr(trainer.strategy, "bubble_report", None),
              "runtime": runtime_switches(trainer.strategy),
              "auto": gather_objects(trainer.strategy.auto_plan.summary() if trainer.strategy.auto_plan else None)}
    if trainer.strategy.auto_plan is not None:
        record["auto_table"] = trainer.strategy.auto_plan.table()
    if evaluate:
        record.update(evaluate_after_fit(trainer, module, val))
    if trainer.global_rank == 0:
        torch.save(record, out / f"{name}.pt")
    dist.barrier()


def applied_switches(model: torch.nn.Module, pipeline=None) -> dict:
    """What the strategy applied, over all ranks: recomputed and compiled modules, FSDP2 dtypes, weight dtypes,
    for every FSDP2 unit (by global name) whether it reshards its weights after forward, and the units still
    gathered at the end (after the last evaluation). A pipeline's stage modules (the FSDP2 roots there) are
    named ``stage<i>``."""
    from lightning_hybrid.distributed.activation_checkpoint import compiled, recomputed
    from lightning_hybrid.init_weights import canonical_name

    local = {"recomputed": {}, "compiled": [], "mp_policy": [], "param_dtypes": [], "reshard_after_forward": {},
             "gathered": []}
    stage_roots = [(f"stage{s.stage_index}", s.submod) for s in pipeline.stages] if pipeline is not None else []
    for name, sub in list(model.named_modules()) + stage_roots:
        if recomputed(sub):
            local["recomputed"][canonical_name(name)] = recomputed(sub)
        if compiled(sub):
            local["compiled"].append(canonical_name(name))
        state = getattr(sub, "_get_fsdp_state", None)
        if callable(state):
            groups = getattr(state(), "_fsdp_param_groups", None) or [state()._fsdp_param_group]
            groups = [g for g in groups if g is not None]
            if groups:
                local["reshard_after_forward"][canonical_name(name)] = groups[0].post_forward_mesh_info is not None
                if not groups[0].is_sharded:
                    local["gathered"].append(canonical_name(name))
        if callable(state) and name.count(".") == 0:
            policy = state()._mp_policy
            local["mp_policy"].append((str(policy.param_dtype), str(policy.reduce_dtype)))
    local["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    gathered = gather_objects(local)
    merged = {"recomputed": {}, "compiled": set(), "mp_policy": set(), "param_dtypes": set(),
              "reshard_after_forward": {}, "gathered": set()}
    for part in gathered:
        merged["recomputed"].update(part["recomputed"])
        merged["reshard_after_forward"].update(part["reshard_after_forward"])
        for key in ("compiled", "mp_policy", "param_dtypes", "gathered"):
            merged[key].update(part[key])
    return merged


def runtime_switches(strategy) -> dict:
    """The runtime features a run used: bf16 weight copies made (per rank), autocast left on, loss parallel."""
    import contextlib

    casts = getattr(strategy, "weight_casts", None)
    return {"weight_casts": gather_objects(casts.casts if casts is not None else None),
            "autocast": strategy.precision_plugin.forward_context is not contextlib.nullcontext,
            "loss_parallel": bool(getattr(strategy, "_loss_parallel", False))}


def optimizer_state(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """Full AdamW states by global parameter name (gathered like the weights)."""
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.init_weights import canonical_name

    optimizer = module.trainer.optimizers[0] if module.trainer.optimizers else None
    local = {}
    if optimizer is not None:
        names = {id(p): canonical_name(n) for n, p in module.model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        full = value.full_tensor() if isinstance(value, DTensor) else value
                        local[f"{names[id(p)]}.{key}"] = full.detach().cpu().clone()
    return gather_merged(local)


def main() -> None:
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for config in configs:
        run(dict(config), out)
    dist.destroy_process_group()  # after run()'s final barrier: no rank exits while its gloo peers still talk


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
