"""``lightning-hybrid eval``: lm-evaluation-harness tasks on a recipe's model or a checkpoint, on the training mesh.

::

    lightning-hybrid eval --config RECIPE.yaml [--checkpoint CKPT] --tasks hellaswag,arc_easy [--tokenizer PATH]
        [--limit N] [--num_fewshot K] [--include_path DIR] [--output_path FILE] [--log_samples]
        [--trainer.devices 4 --trainer.strategy.tp 2 --trainer.strategy.pp 2 --model.init_from_hf DIR ...]

The recipe builds the Trainer and the model as ``fit`` does, with every ``--trainer.*`` and ``--model.*`` override, so
the mesh is chosen as for training; its data, callbacks and logger are left out (evaluation reads no training data and
writes no training logs). The model is sharded on that mesh and initialized as the config says (``--model.init_from_hf``
included); ``--checkpoint`` (a committed checkpoint folder, local or ``s3://``) is then loaded onto it, whatever mesh
wrote it. Every rank runs the harness through :class:`~lightning_hybrid.eval.harness.ShardedLM`; rank 0 prints the
harness's table and, with ``--output_path``, writes the harness's own results JSON (and with ``--log_samples`` its
per-sample JSONL files) through the harness's ``EvaluationTracker``, which names them as ``lm-eval`` does: for
``--output_path out/results.json``, ``out/results_<date>.json`` and ``out/samples_<task>_<date>.jsonl``.

A user's mistake (an unknown task, the extra missing, a checkpoint that is not there, no tokenizer, a task that
samples) ends the command with one line and exit code 2 before any worker process starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch

from lightning_hybrid.eval.tasks import (
    check_limit,
    evaluate_tasks,
    load_tokenizer,
    parse_tasks,
    require_harness,
    resolve_tasks,
)

__all__ = ["eval_main", "EvaluationRun"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-hybrid eval", allow_abbrev=False, exit_on_error=False,
        description="Score a recipe's model, or a checkpoint, on lm-evaluation-harness tasks, on the training mesh.",
        epilog="Every other option goes to the recipe as in `lightning-hybrid fit`: --config FILE, --trainer.* and "
               "--model.* (e.g. --trainer.devices 4 --trainer.strategy.tp 2 --trainer.strategy.pp 2).")
    parser.add_argument("--checkpoint", help="a committed checkpoint folder (step-N), local or s3://; written on any "
                        "mesh. Without it: the model as the config initializes it (--model.init_from_hf included)")
    parser.add_argument("--tasks", help="harness task names, comma-separated: hellaswag,arc_easy (groups, tags, globs)")
    parser.add_argument("--tokenizer", help="the model's Hugging Face tokenizer (folder or repo id); default: the "
                        "--model.init_from_hf folder")
    parser.add_argument("--limit", type=float, help="documents per task (or a fraction of them, below 1)")
    parser.add_argument("--num_fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    parser.add_argument("--include_path", help="a folder of your own task YAML files (local data: dataset_path: json)")
    parser.add_argument("--output_path", help="where the harness writes its results JSON (a .json file or a folder)")
    parser.add_argument("--log_samples", action="store_true", help="also write the per-sample records (JSONL)")
    parser.add_argument("--batch_size", type=int, help="rows per forward pass (default: the pipeline's micro-batches, "
                        "else 8)")
    parser.add_argument("--max_length", type=int, help="longest input in tokens (default: the model's "
                        "max_position_embeddings; set the trained sequence length)")
    parser.add_argument("--max_gen_toks", type=int, default=256, help="tokens generated at most per request")
    parser.add_argument("--bootstrap_iters", type=int, default=100000,
                        help="the harness's bootstrap iterations for standard errors (0: none)")
    return parser


def _check_checkpoint(path: Optional[str]) -> None:
    """A local ``--checkpoint`` must be a committed checkpoint folder (an object-store URL is checked when loaded).

    Raises:
        FileNotFoundError: nothing there.
        ValueError: a folder without the checkpoint's manifest.
    """
    if path is None or "://" in path:
        return
    from lightning_hybrid.checkpoint.manifest import MANIFEST

    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"--checkpoint {path}: no such checkpoint folder")
    if not (folder / MANIFEST).is_file():
        raise ValueError(f"--checkpoint {path}: not a committed checkpoint (no {MANIFEST}); pass a step-N folder "
                         f"written by FaultTolerantCheckpoint or trainer.save_checkpoint")


class _NoBatches(torch.utils.data.IterableDataset):
    """A predict loop with nothing to predict: Lightning builds and shards the model on the mesh, then calls the
    callbacks' ``on_predict_start``, where the evaluation runs."""

    def __iter__(self) -> Any:
        return iter(())


class EvaluationRun(pl.Callback):
    """Loads the checkpoint onto the set-up model and runs the harness, in ``on_predict_start`` (every rank).

    Attributes:
        results: the harness's results dict (the same on every rank), once run.
    """

    def __init__(self, args: argparse.Namespace, tasks: Any, tokenizer: Any) -> None:
        self.args, self.tasks, self.tokenizer = args, tasks, tokenizer
        self.results: Optional[dict[str, Any]] = None

    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from lightning_hybrid.eval.harness import ShardedLM

        args, strategy = self.args, trainer.strategy
        if args.checkpoint:
            if not callable(getattr(strategy, "checkpoint_context", None)):
                raise ValueError(f"--checkpoint needs the recipe's strategy to be HybridParallelStrategy (its sharded "
                                 f"checkpoints); this one is {type(strategy).__name__}")
            strategy.load_checkpoint(args.checkpoint)  # onto this mesh, whatever mesh wrote it
        lm = ShardedLM(pl_module, self.tokenizer, strategy, args.batch_size, args.max_length, args.max_gen_toks)
        tracker = None
        if args.output_path:
            from lm_eval.loggers import EvaluationTracker

            tracker = EvaluationTracker(output_path=args.output_path)
        self.results, samples = evaluate_tasks(lm, self.tasks, check_limit(args.limit), args.log_samples,
                                               args.bootstrap_iters, tracker)
        if trainer.is_global_zero:
            _report(self.results, samples, tracker)


def _report(results: dict[str, Any], samples: Optional[dict[str, Any]], tracker: Any) -> None:
    """The harness's tables on stdout, and its files through its tracker (rank 0)."""
    from lm_eval.utils import make_table

    print(make_table(results), flush=True)
    if results.get("groups"):
        print(make_table(results, "groups"), flush=True)
    if tracker is None:
        return
    tracker.save_results_aggregated(results=dict(results), samples=samples)
    for task in (samples or {}):
        tracker.save_results_samples(task_name=task, samples=samples[task])
    folder = Path(tracker.output_path)
    folder = folder.parent if folder.suffix == ".json" else folder
    written = sorted(str(path) for path in folder.rglob(f"*{tracker.date_id}*"))  # the harness's own names
    print(f"lightning-hybrid eval: wrote {', '.join(written)}", flush=True)


def _eval_cli_class() -> type:
    from lightning_hybrid.cli import hybrid_cli_class

    class EvalCLI(hybrid_cli_class()):  # type: ignore[misc]
        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()
            # No training data, callbacks (checkpointing, monitors, a DownstreamEval of the recipe) or logger: a data
            # folder or checkpoint directory of the training job need not exist where the evaluation runs.
            self.config["data"] = None
            self.config["trainer.callbacks"] = None
            self.config["trainer.logger"] = False

    return EvalCLI


def eval_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-hybrid eval``: see the module docstring.

    Raises:
        ValueError, FileNotFoundError: a user's mistake (the command prints it as one line, exit code 2).
    """
    from lightning_hybrid.cli import check_before_launch, check_config_files
    from lightning_hybrid.models import CausalLM

    args, rest = _parser().parse_known_args(list(argv or []))
    if not args.tasks:
        raise ValueError("--tasks is required: lm-evaluation-harness task names, comma-separated (hellaswag,arc_easy)")
    require_harness("lightning-hybrid eval")
    tasks = parse_tasks(args.tasks)
    check_limit(args.limit)
    _check_checkpoint(args.checkpoint)
    harness_tasks = resolve_tasks(tasks, args.include_path, args.num_fewshot)
    check_config_files(rest)
    cli = _eval_cli_class()(CausalLM, subclass_mode_data=True, run=False, args=rest, save_config_callback=None,
                            auto_configure_optimizers=False)
    trainer, model = cli.trainer, cli.model
    check_before_launch(trainer, model, None, None)
    tokenizer = load_tokenizer(args.tokenizer or model.hparams.get("init_from_hf"), "the model", "--tokenizer PATH",
                               "--model.init_from_hf DIR")
    trainer.callbacks.append(EvaluationRun(args, harness_tasks, tokenizer))
    trainer.predict(model, dataloaders=torch.utils.data.DataLoader(_NoBatches()), return_predictions=False)
    return 0
