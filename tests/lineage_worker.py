"""Training through the Python API (a script calling ``trainer.fit``, not the CLI) with a FaultTolerantCheckpoint whose
folder holds another model's checkpoints; launched on 2 ranks by tests/test_lineage.py. Environment: CKPT (the
folder), ON_FOREIGN (``refuse`` or ``archive``), OUT (rank 0 writes ``done.json`` there after training). Auto-resume
is on (the default)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L

from helpers.equivalence import GLOBAL_BATCH, SEED, make_dataset, make_trainer_kwargs, tiny_config
from helpers.worker_exit import end_worker
from lightning_hybrid import FaultTolerantCheckpoint, HybridParallelStrategy
from lightning_hybrid.models import CausalLM


def main() -> None:
    L.seed_everything(SEED)
    checkpoint = FaultTolerantCheckpoint(os.environ["CKPT"], every_n_steps=1, async_save=False,
                                         on_foreign=os.environ["ON_FOREIGN"])
    kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": 2, "val_check_interval": None, "limit_val_batches": 0}
    trainer = L.Trainer(strategy=HybridParallelStrategy(), devices=2, callbacks=[checkpoint], **kwargs)
    module = CausalLM(tiny_config(), **make_trainer_kwargs()["module"])
    train, _ = make_dataset(GLOBAL_BATCH // 2)
    trainer.fit(module, train_dataloaders=train)
    if trainer.is_global_zero:
        (Path(os.environ["OUT"]) / "done.json").write_text(json.dumps(
            {"resumed_from": str(checkpoint.resumed_from), "run_id": checkpoint.lineage.run_id}))
    trainer.strategy.barrier()


if __name__ == "__main__":
    main()
    end_worker()  # see helpers.worker_exit: a gloo thread must not outlive the interpreter
