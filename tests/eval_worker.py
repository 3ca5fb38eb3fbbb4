"""The one 4-process launch of ``tests/test_eval.py``: downstream evaluation on the sharded model.

``eval_worker.py FOLDER`` (``FOLDER`` holds ``tasks/``, ``tokenizer/`` and ``recipe.yaml`` from
:mod:`helpers.eval_tasks`); on tp=2 x pp=2 (1F1B, loss parallel):

1. trains the tiny model 4 steps without, then with ``DownstreamEval`` every 2 steps (losses, final weights, random
   states, the modules' training flags at every step, the evaluation runs, step times);
2. saves a checkpoint of the trained model and exports it (``export-hf --dtype fp32``, rank 0) to ``FOLDER/hf``;
3. runs ``lightning-hybrid eval`` on that checkpoint at tp=2 x pp=2 (sequence parallel) and at dp=4 (FSDP), and
   without a checkpoint on the model the config initializes from the export (``--model.init_from_hf``) at
   cp=2 x tp=2, each writing the harness's results and per-sample files under ``FOLDER/cli_<mesh>``.

Rank 0 writes ``FOLDER/record.pt``.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from helpers.equivalence import GLOBAL_BATCH, SEED, LossRecorder, make_dataset, make_trainer_kwargs, tiny_config
from helpers.eval_tasks import MAX_LENGTH, TASKS
from helpers.gather import full_weights
from helpers.worker_exit import end_worker
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.eval import DownstreamEval
from lightning_hybrid.models import CausalLM

# the checkpoint's own mesh also with sequence parallelism (each row's tokens split over tp around the norms)
MESHES = {"tp2pp2": {"tp": 2, "pp": 2, "sequence_parallel": "true"}, "dp4": {"tp": 1, "pp": 1},
          "cp2tp2": {"tp": 2, "pp": 1, "cp": 2}}


class StepProbe(L.Callback):
    """Every step: whether every submodule trains, and the step's wall time (batch start to batch end)."""

    def __init__(self) -> None:
        self.training: list[bool] = []
        self.step_seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.training.append(all(m.training for m in pl_module.modules()))
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)


def fit(folder: Path, with_eval: bool) -> tuple[L.Trainer, CausalLM, dict]:
    L.seed_everything(SEED)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    losses, probe = LossRecorder(), StepProbe()
    callbacks: list = [losses, probe]
    if with_eval:
        evaluation = DownstreamEval(tasks=["tiny_mc"], every_n_steps=2, include_path=str(folder / "tasks"),
                                    tokenizer=str(folder / "tokenizer"), max_length=MAX_LENGTH, batch_size=16)
        callbacks.insert(0, evaluation)  # its time falls inside the probe's step (reported apart below)
    trainer = L.Trainer(strategy=HybridParallelStrategy(tp=2, pp=2), devices=4, callbacks=callbacks,
                        **make_trainer_kwargs()["trainer"])
    train, val = make_dataset(GLOBAL_BATCH)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    record = {"losses": losses.losses, "final": full_weights(module.model), "training": probe.training,
              "step_seconds": probe.step_seconds, "val_loss": float(trainer.callback_metrics["val_loss"]),
              "rng": {"torch": torch.get_rng_state(), "python": random.random(), "numpy": float(np.random.rand())}}
    if with_eval:
        record["history"] = evaluation.history
    return trainer, module, record


def cli_eval(folder: Path, mesh: str) -> float:
    from lightning_hybrid.cli import main

    source = (["--model.init_from_hf", str(folder / "hf")] if mesh == "cp2tp2"
              else ["--checkpoint", str(folder / "ckpt")])
    args = ["eval", "--config", str(folder / "recipe.yaml"), *source, "--tasks", ",".join(TASKS),
            "--include_path", str(folder / "tasks"),
            "--tokenizer", str(folder / "tokenizer"),
            "--max_length", str(MAX_LENGTH), "--bootstrap_iters", "0", "--log_samples",
            "--output_path", str(folder / f"cli_{mesh}" / "results.json")]
    for key, value in MESHES[mesh].items():
        args += [f"--trainer.strategy.init_args.{key}", str(value)]
    start = time.perf_counter()
    code = main(args)
    assert code == 0, f"lightning-hybrid eval on {mesh} exited with {code}"
    return time.perf_counter() - start


def main() -> None:
    folder = Path(sys.argv[1])
    _, _, plain = fit(folder, with_eval=False)
    trainer, module, evaluated = fit(folder, with_eval=True)
    seconds = {}
    trainer.save_checkpoint(folder / "ckpt")
    dist.barrier()
    if dist.get_rank() == 0:
        from lightning_hybrid.checkpoint.export import export_hf

        export_hf(folder / "ckpt", folder / "hf", dtype="fp32")
    dist.barrier()
    for mesh in MESHES:
        seconds[f"cli_{mesh}"] = cli_eval(folder, mesh)
    if dist.get_rank() == 0:
        torch.save({"plain": plain, "evaluated": evaluated, "seconds": seconds},
                   folder / "record.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
