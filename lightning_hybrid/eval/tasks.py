"""Tasks of lm-evaluation-harness: their names checked, the harness run on every rank, its metrics read.

Task names are the harness's (``hellaswag``, ``arc_easy``, ``mmlu``, a group or tag, a glob), or tasks of a folder
given as ``include_path``: YAML files in the harness's own format, for example a local multiple-choice task with
``dataset_path: json`` and ``dataset_kwargs: {data_files: {test: /data/my_task.jsonl}}``, which reads local files
and downloads nothing (see docs/evaluation.md).

Nothing here imports lm-evaluation-harness at module level: :func:`require_harness` names the extra to install.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch

__all__ = ["EVAL_EXTRA", "HarnessTasks", "require_harness", "parse_tasks", "resolve_tasks", "evaluate_tasks",
           "task_metrics",
           "preserved_rng", "evaluation_mode", "check_limit", "load_tokenizer"]

EVAL_EXTRA = "pip install 'lightning-hybrid[eval]'"


def require_harness(what: str) -> None:
    """Raise unless lm-evaluation-harness and transformers (the tokenizer) can be imported.

    Raises:
        ValueError: one line naming the missing package and the extra that installs it.
    """
    for module, package in (("lm_eval", "lm-evaluation-harness (lm-eval)"), ("transformers", "transformers")):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(f"{what} needs {package}, which is not installed; {EVAL_EXTRA}") from err


def parse_tasks(tasks: Union[str, Sequence[str]]) -> list[str]:
    """Task names from a comma-separated string or a list (whose items may hold commas too).

    Raises:
        ValueError: no task named.
    """
    items = [tasks] if isinstance(tasks, str) else list(tasks or [])
    names = [name.strip() for item in items for name in str(item).split(",") if name.strip()]
    if not names:
        raise ValueError(f"tasks={tasks!r} names no task; give lm-evaluation-harness task names, e.g. "
                         f"hellaswag,arc_easy")
    return names


def check_limit(limit: Optional[Union[int, float]]) -> Optional[Union[int, float]]:
    """The harness's ``limit``: documents per task (an integer >= 1) or a fraction of them (0 < limit < 1).

    Raises:
        ValueError: another value.
    """
    if limit is None:
        return None
    if isinstance(limit, float) and limit.is_integer() and limit >= 1:
        limit = int(limit)
    if isinstance(limit, bool) or not ((isinstance(limit, int) and limit >= 1)
                                       or (isinstance(limit, float) and 0.0 < limit < 1.0)):
        raise ValueError(f"limit={limit!r} must be a number of documents per task (>= 1) or a fraction in (0, 1)")
    return limit


def _unknown_task(name: str, known: Sequence[str], include_path: Optional[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    where = f" nor in --include_path {include_path}" if include_path else ""
    return (f"unknown task {name!r}: not a task, group or tag of lm-evaluation-harness{where}{hint} "
            f"(`lm-eval ls tasks` lists them; a folder of task YAML files goes in include_path)")


@dataclass
class HarnessTasks:
    """Tasks the harness knows, checked on every rank before any collective.

    Attributes:
        names: the task, group or tag names asked for.
        manager: the harness's ``TaskManager`` that indexes them.
        loaded: the tasks loaded once (``TaskManager.load``: datasets read, ``num_fewshot`` set as the harness's
            ``simple_evaluate`` sets it), for runs that reuse them (:func:`evaluate_tasks` with ``record=False``).
        num_fewshot: few-shot examples per prompt; ``None``: each task's default.
    """

    names: list[str]
    manager: Any
    loaded: dict[str, Any]
    num_fewshot: Optional[int] = None


def resolve_tasks(tasks: Sequence[str], include_path: Optional[str] = None,
                  num_fewshot: Optional[int] = None) -> HarnessTasks:
    """The harness's index of every one of ``tasks`` and the tasks loaded once; on every rank before any collective.

    With ``include_path`` whose tasks are all the ones asked for, only that folder is indexed (the harness's own
    thousands of task files take seconds to index); otherwise the harness's tasks and the folder's.

    Raises:
        ValueError: a name the harness does not know (with the closest names), or one of the tasks samples its
            generations (decoding is greedy here; one line naming the task).
        FileNotFoundError: ``include_path`` is not a folder.
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"include_path {include_path}: no such folder of task YAML files")

    def known(manager: Any, name: str) -> bool:
        return name.endswith(".yaml") and Path(name).is_file() or bool(manager.match_tasks([name]))

    with preserved_rng(), _quiet_harness(_global_rank() != 0):  # loading tasks draws from Python's random state: a
        manager = None  # callback built between seed_everything and the model must not change the model's weights
        if include_path is not None:
            local = TaskManager(include_path=include_path, include_defaults=False)
            manager = local if all(known(local, name) for name in tasks) else None
        manager = manager or TaskManager(include_path=include_path)
        for name in tasks:
            if not known(manager, name):
                raise ValueError(_unknown_task(name, manager.all_tasks, include_path))
        loaded = manager.load(list(tasks))
    for name, task in loaded["tasks"].items():
        default = task.get_config("num_fewshot")  # as simple_evaluate: a task's explicit 0 is kept
        if num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        _check_generation(name, task)
    return HarnessTasks(list(tasks), manager, loaded, num_fewshot)


def _check_generation(name: str, task: Any) -> None:
    from lightning_hybrid.eval.harness import sampling_error

    if task.get_config("output_type") == "generate_until":
        error = sampling_error(name, task.get_config("generation_kwargs") or {})
        if error:
            raise ValueError(error)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and this CUDA device's) random states as they were before, whatever the
    block seeds (the harness seeds all three)."""
    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@contextlib.contextmanager
def evaluation_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode inside, every submodule back in the mode it had afterwards."""
    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for sub, training in modes:
            sub.training = training


@contextlib.contextmanager
def _quiet_harness(quiet: bool) -> Iterator[None]:
    """The harness's log lines and progress bars on one rank only (every rank runs it on the same requests)."""
    if not quiet:
        yield
        return
    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, os.environ.get("TQDM_DISABLE")
    logger.setLevel(logging.WARNING)
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = bars


def _broadcast(value: Any, rank: int) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def evaluate_tasks(lm: Any, tasks: HarnessTasks, limit: Optional[Union[int, float]] = None,
                   log_samples: bool = False, bootstrap_iters: int = 100000, tracker: Any = None,
                   record: bool = True) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """Run the harness on every rank (each gets the same requests; the model gathers its answers), the global random
    states restored afterwards.

    ``record=True``: the harness's ``simple_evaluate``, whose results carry the configuration, versions and
    environment of the run (what ``lightning-hybrid eval`` writes). ``record=False``: its ``evaluate`` on the tasks
    loaded once, seeded as ``simple_evaluate`` seeds (the same prompts and metrics, without reloading the datasets and
    collecting the environment at every run of the training loop).

    Returns:
        ``(results, samples)``: the harness's results dict without its samples, the same on every rank, and on rank 0
        the per-sample records when ``log_samples`` (else ``None``).
    """
    from lm_eval import evaluator
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    rank = _global_rank()
    with preserved_rng(), _quiet_harness(rank != 0):
        if record:
            results = evaluator.simple_evaluate(
                model=lm, tasks=list(tasks.names), num_fewshot=tasks.num_fewshot, limit=limit,
                task_manager=tasks.manager, log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                evaluation_tracker=tracker)
        else:
            import numpy as np

            random.seed(DEFAULT_RANDOM_SEED)
            np.random.seed(DEFAULT_OTHER_SEED)
            torch.manual_seed(DEFAULT_OTHER_SEED)
            for task in tasks.loaded["tasks"].values():
                task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
            results = evaluator.evaluate(lm=lm, task_dict=tasks.loaded, limit=limit, bootstrap_iters=bootstrap_iters,
                                         log_samples=log_samples)
    samples = results.pop("samples", None) if results is not None else None
    if record:  # simple_evaluate returns results where LOCAL_RANK is 0 only
        results = _broadcast(results, rank)
    return results, (samples if rank == 0 else None)


def _global_rank() -> int:
    """This process's global rank: the process group's, or before one exists the launcher's ``RANK``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def task_metrics(results: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """Every numeric metric of every task and group: ``{prefix}{task}/{metric}`` (the harness's filter name appended
    when it is not ``none``), without the standard errors."""
    metrics: dict[str, float] = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            if key in ("alias", "name", "sample_len") or "_stderr" in key or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            metric, _, selection = key.partition(",")
            name = metric if selection in ("", "none") else f"{metric}_{selection}"
            metrics[f"{prefix}{task}/{name}"] = float(value)
    return metrics


def load_tokenizer(source: Optional[str], what: str, option: str = "tokenizer=...",
                   init_option: str = "init_from_hf=...") -> Any:
    """The Hugging Face tokenizer of a folder or Hub repo id (``transformers.AutoTokenizer``).

    Raises:
        ValueError: no source given (naming the two options that give one), or the folder holds no tokenizer.
    """
    if not source:
        raise ValueError(f"{what} has no tokenizer: pass the model's Hugging Face tokenizer (a folder or repo id) as "
                         f"{option}, or load the model with {init_option} (its folder's tokenizer is used)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"tokenizer {source}: no Hugging Face tokenizer there ({' '.join(str(err).split())[:200]})"
                         ) from err
