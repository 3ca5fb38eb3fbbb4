"""``DownstreamEval``: lm-evaluation-harness tasks scored on the training model, every N steps and at the end of fit."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_hybrid.eval.tasks import (
    check_limit,
    evaluate_tasks,
    evaluation_mode,
    load_tokenizer,
    parse_tasks,
    require_harness,
    resolve_tasks,
    task_metrics,
)

__all__ = ["DownstreamEval"]


def _positive(name: str, value: Any, allow_none: bool = True, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}" + (" or None" if allow_none else ""))


class DownstreamEval(pl.Callback):
    """Scores the model on lm-evaluation-harness tasks while it trains, on the mesh it trains on.

    Every ``every_n_steps`` optimizer steps (and once at the end of fit, unless that step was just evaluated) every
    rank runs the harness on the same requests through :class:`~lightning_hybrid.eval.harness.ShardedLM`: forward
    passes through the same schedule as validation (pp, tp, cp), the batches spread over the dp replicas. It logs
    ``eval/{task}/{metric}`` and ``eval/time_s`` (the run's wall time) to every logger of the Trainer at the global
    step, keeps them in :attr:`history`, and reports the run's time to callbacks that take it (``ThroughputMonitor``
    counts it as evaluation, not training time).

    It leaves training as it was: no gradient, optimizer or data state is touched, the random states of Python, NumPy
    and torch are restored after the harness seeds them, and every submodule returns to the mode it had.

    Args:
        tasks: harness task names (a list or a comma-separated string): ``["hellaswag", "arc_easy"]``, groups, tags.
        every_n_steps: evaluate every this many optimizer steps.
        limit: documents per task (an integer), or a fraction of them; ``None``: all.
        num_fewshot: few-shot examples per prompt; ``None``: each task's default.
        include_path: a folder of the user's own task YAML files (local data: ``dataset_path: json``).
        tokenizer: the model's Hugging Face tokenizer (folder or repo id); ``None``: the module's ``init_from_hf``.
        batch_size: rows per forward pass; ``None``: the pipeline's micro-batches, or 8 without a pipeline.
        max_length: longest input in tokens; ``None``: the model's ``max_position_embeddings`` (set the trained
            sequence length: a model trained at 4,096 tokens says little about 32k-token prompts).
        max_gen_toks: tokens generated at most per request of a generation task (unless the task sets it).
        bootstrap_iters: the harness's bootstrap iterations for standard errors (0: none, which keeps a run short).
        at_fit_end: also evaluate when fit ends.

    Raises:
        ValueError: lm-evaluation-harness is not installed (naming the extra), an unknown task (with the closest
            names), a task that samples its generations, or a bad number; on construction, on every rank.
    """

    def __init__(self, tasks: Union[str, Sequence[str]], every_n_steps: int,
                 limit: Optional[Union[int, float]] = None, num_fewshot: Optional[int] = None,
                 include_path: Optional[str] = None, tokenizer: Optional[str] = None,
                 batch_size: Optional[int] = None, max_length: Optional[int] = None, max_gen_toks: int = 256,
                 bootstrap_iters: int = 0, at_fit_end: bool = True) -> None:
        require_harness("DownstreamEval")
        _positive("every_n_steps", every_n_steps, allow_none=False)
        _positive("num_fewshot", num_fewshot, minimum=0)
        _positive("bootstrap_iters", bootstrap_iters, allow_none=False, minimum=0)
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("max_gen_toks", max_gen_toks)):
            _positive(name, value)
        self.tasks = parse_tasks(tasks)
        self.every_n_steps, self.limit, self.num_fewshot = every_n_steps, check_limit(limit), num_fewshot
        self.include_path, self.tokenizer = include_path, tokenizer
        self.batch_size, self.max_length, self.max_gen_toks = batch_size, max_length, max_gen_toks
        self.bootstrap_iters, self.at_fit_end = bootstrap_iters, at_fit_end
        self.harness_tasks = resolve_tasks(self.tasks, include_path, num_fewshot)  # loaded once, reused by every run
        self.history: list[dict[str, Any]] = []  # per run: step, seconds, metrics, forward passes
        self._tokenizer: Any = None
        self._lm: Any = None
        self._seen_step = -1

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and self._tokenizer is None:  # every rank, before any collective of an evaluation
            source = self.tokenizer or getattr(pl_module, "hparams", {}).get("init_from_hf")
            self._tokenizer = load_tokenizer(source, "DownstreamEval", "DownstreamEval(tokenizer=...)",
                                             "CausalLM(init_from_hf=...)")

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._seen_step = trainer.global_step  # after a resume: evaluate from the next multiple on

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._seen_step:  # a gradient-accumulation micro-batch: no optimizer step since the last call
            return
        self._seen_step = step
        if step % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        evaluated = bool(self.history) and self.history[-1]["step"] == trainer.global_step
        if self.at_fit_end and not evaluated:
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, float]:
        """One run of the harness on the model as it is now (every rank must call it); returns the logged metrics."""
        if self._lm is None:
            from lightning_hybrid.eval.harness import ShardedLM

            self._lm = ShardedLM(pl_module, self._tokenizer or load_tokenizer(self.tokenizer, "DownstreamEval"),
                                 trainer.strategy, self.batch_size, self.max_length, self.max_gen_toks)
        start = _now(pl_module.device)
        passes = self._lm.scorer.forward_passes
        with evaluation_mode(pl_module):
            results, _ = evaluate_tasks(self._lm, self.harness_tasks, self.limit,
                                        bootstrap_iters=self.bootstrap_iters, record=False)
        end = _now(pl_module.device)
        metrics = {**task_metrics(results), "eval/time_s": end - start}
        step = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        for callback in trainer.callbacks:  # ThroughputMonitor: evaluation time is not training time
            record = getattr(callback, "record_evaluation", None)
            if callable(record) and callback is not self:
                record(start, end)
        self.history.append({"step": step, "seconds": end - start, "metrics": metrics,
                             "forward_passes": self._lm.scorer.forward_passes - passes})
        shown = ", ".join(f"{k[len('eval/'):]} {v:.4g}" for k, v in metrics.items() if k != "eval/time_s")
        rank_zero_info(f"DownstreamEval at step {step} ({end - start:.1f} s): {shown}")
        return metrics


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
