"""The ``lightning-hybrid`` command: LightningCLI's fit/validate/test/predict plus the project's tools.

A user's mistake (a bad value, a missing file, a layout that cannot work) ends the command with one line on
stderr, printed once (by global rank 0, or the launcher process), naming the bad value and what would fit,
and a non-zero exit code; no traceback unless ``LIGHTNING_HYBRID_DEBUG=1``. Everything knowable from the
config (strategy sizes against the devices, the model preset and its blocks, schedules, micro-batches
against the batch size) is checked right after the config is parsed, before any worker process starts.
"""

from __future__ import annotations

import importlib
import os
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_hybrid.distributed.exit_report import DEBUG_ENV, EXIT_USER_ERROR, user_error_message
from lightning_hybrid.distributed.exit_report import is_global_rank_zero as _is_global_rank_zero

__all__ = ["main", "TOOLS", "EXIT_USER_ERROR", "user_error_message", "check_before_launch", "check_strategy_arguments",
           "hybrid_cli_class", "check_config_files"]

# Subcommands that are not Lightning's: name -> ("module:function", one-line help).
TOOLS: dict[str, tuple[str, str]] = {
    "plan": ("lightning_hybrid.planner.cli:run_plan", "choose tp/pp/dp/micro-batching for a model and cluster"),
    "preflight": ("lightning_hybrid.preflight.cli:preflight_main",
                  "measure link bandwidth per mesh dimension (torchrun)"),
    "prepare-data": ("lightning_hybrid.data.prepare:prepare_main", "tokenize text or chat data into packed tokens"),
    "export-hf": ("lightning_hybrid.checkpoint.export:export_main", "write a Hugging Face folder from a checkpoint"),
    "dry-run": ("lightning_hybrid.dryrun.cli:dry_run_main", "build every rank of a recipe and trace a step on one CPU"),
    "lighthouse": ("lightning_hybrid.launch.lighthouse:lighthouse_main",
                   "run torchft's lighthouse for replica groups (fault_tolerance='torchft')"),
    "eval": ("lightning_hybrid.eval.cli:eval_main",
             "score a recipe's model or a checkpoint on lm-evaluation-harness tasks, on the training mesh"),
}
LIGHTNING_SUBCOMMANDS = {
    "fit": "train (and validate) a model",
    "validate": "run one validation epoch",
    "test": "run one test epoch",
    "predict": "run prediction",
}
_PARSERS: list = []  # the LightningCLI parsers of this command, for the keys an unknown one is compared with


def _usage() -> str:
    lines = ["usage: lightning-hybrid SUBCOMMAND [options]", "", "subcommands:"]
    for name, text in LIGHTNING_SUBCOMMANDS.items():
        lines.append(f"  {name:<13} {text} (LightningCLI: --config FILE, --print_config, --trainer.strategy.tp 8)")
    for name, (_, text) in TOOLS.items():
        lines.append(f"  {name:<13} {text}")
    lines.append("")
    lines.append("`lightning-hybrid SUBCOMMAND --help` shows the options of one subcommand.")
    return "\n".join(lines)


def _tool(target: str) -> Callable[[list[str]], int]:
    module_name, func = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise SystemExit(f"lightning-hybrid: this subcommand is not available in this install ({err})") from err
    return getattr(module, func)


def check_files(model: Any, ckpt_path: Optional[str] = None) -> None:
    """The files the config names: ``--ckpt_path`` exists, and a local ``init_from_hf`` folder exists and holds
    readable safetensors files of this model (headers only). Before any worker process starts.

    Raises:
        FileNotFoundError: a missing file or folder, named.
        ValueError: a damaged safetensors file (named), or weights of another model.
    """
    if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry") and "://" not in str(ckpt_path) \
            and not Path(ckpt_path).expanduser().exists():
        raise FileNotFoundError(f"--ckpt_path {ckpt_path}: no such file or folder")
    init_from_hf = getattr(model, "hparams", {}).get("init_from_hf")
    config = getattr(model, "config", None)
    if init_from_hf and config is not None:
        from lightning_hybrid.models.decoder.hf import check_hf_folder

        check_hf_folder(init_from_hf, config)


def check_before_launch(trainer: Any, model: Any, datamodule: Any, ckpt_path: Optional[str] = None) -> None:
    """What the parsed config alone decides: the files it names (:func:`check_files`), the strategy's sizes against
    the devices and the model, the micro-batches against the per-rank batch size, the sequence length against cp,
    and that a checkpoint folder to resume from holds this model and no other run. Runs before any worker process
    starts.

    Raises:
        ValueError: naming the bad value and what would fit.
    """
    from lightning_hybrid.callbacks.fault_tolerant import FaultTolerantCheckpoint
    from lightning_hybrid.distributed.context_parallel import check_sequence_length
    from lightning_hybrid.distributed.option_checks import check_options
    from lightning_hybrid.distributed.pipeline.schedules import check_batch_splits
    from lightning_hybrid.planner.auto import auto_fields
    from lightning_hybrid.strategy import HybridParallelStrategy

    check_files(model, ckpt_path)
    strategy = trainer.strategy
    if not isinstance(strategy, HybridParallelStrategy):
        return
    from lightning_hybrid.models.spec import declared_spec

    spec = declared_spec(model)
    devices = trainer.num_devices
    options = strategy.options
    if not auto_fields(options):  # an "auto" layout is planned and checked at setup, once the world is known
        check_options(options, devices * trainer.num_nodes, devices if trainer.num_nodes > 1 else None, spec,
                      model.num_blocks() if spec is not None else None, str(trainer.precision), type(model).__name__)
    batch = getattr(getattr(datamodule, "hparams", None), "batch_size", None)
    if isinstance(options.pp, int) and options.pp > 1 and isinstance(batch, int) and options.microbatches != "auto":
        check_batch_splits(batch, options.num_microbatches)
    seq_len = getattr(getattr(datamodule, "hparams", None), "seq_len", None)
    if options.cp > 1 and isinstance(seq_len, int):
        check_sequence_length(seq_len, options.cp)
    from lightning_hybrid.checkpoint.lineage import model_config_of

    for callback in trainer.callbacks:
        if isinstance(callback, FaultTolerantCheckpoint):
            callback.check_lineage(ckpt_path, model_config_of(model))


def check_strategy_arguments(strategy: Any) -> None:
    """Construct the configured strategy once when it is a :class:`~lightning_hybrid.HybridParallelStrategy`.

    Raises:
        ValueError: the strategy's own one-line error for a bad argument.
    """
    from lightning_hybrid.strategy import HybridParallelStrategy

    class_path = getattr(strategy, "class_path", None) if strategy is not None else None
    if not isinstance(class_path, str):
        return
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return  # jsonargparse reports an unknown class itself
    if isinstance(cls, type) and issubclass(cls, HybridParallelStrategy):
        init_args = getattr(strategy, "init_args", None)
        cls(**(dict(vars(init_args)) if init_args is not None else {}))


def hybrid_cli_class() -> type:
    """The LightningCLI class of ``lightning-hybrid fit/validate/test/predict`` (also built by ``eval``)."""
    from lightning.pytorch.cli import LightningCLI

    class HybridCLI(LightningCLI):
        """LightningCLI that checks the job before Lightning launches its processes (its ``before_<subcommand>``
        hooks run after the classes are built and before the Trainer starts anything)."""

        def init_parser(self, **kwargs: Any) -> Any:
            # A parse error raises (jsonargparse's ArgumentError) instead of printing the whole usage: main() turns it
            # into one line (cli_errors.py). `--help` still prints the full usage.
            parser = super().init_parser(**{**kwargs, "exit_on_error": False})
            _PARSERS.append(parser)
            return parser

        def before_instantiate_classes(self) -> None:
            # jsonargparse folds a constructor's error into its own multi-line message; build the strategy from its
            # parsed arguments first, so a bad value raises the strategy's own one-line error.
            config = self.config.get(self.subcommand) if self.subcommand else self.config
            check_strategy_arguments(config.get("trainer", {}).get("strategy"))

        def _check(self) -> None:
            config = self.config.get(self.subcommand) if self.subcommand else self.config
            check_before_launch(self.trainer, self.model, self.datamodule, config.get("ckpt_path"))

        before_fit = before_validate = before_test = before_predict = _check

    return HybridCLI


def check_config_files(argv: list[str]) -> None:
    """Parse each ``--config`` YAML file first, so a syntax error names the file and its line.

    Raises:
        ValueError: a file is missing or is not valid YAML.
    """
    import yaml

    for flag, value in zip(argv, argv[1:]):
        if flag not in ("--config", "-c"):
            continue
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--config {value}: no such file")
        try:
            yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"--config {value}: YAML syntax error{where}: {problem}") from None


def _lightning_cli(argv: list[str], explicit: bool) -> None:
    from lightning_hybrid.models import CausalLM

    check_config_files(argv[1:])
    _PARSERS.clear()
    hybrid_cli_class()(CausalLM, subclass_mode_data=True, args=argv if explicit else None,
                 save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)


def _fail(command: str, message: str) -> int:
    if _is_global_rank_zero():
        print(f"lightning-hybrid {command}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``lightning-hybrid`` console script."""
    explicit = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command = argv[0]
    if command not in TOOLS and command not in LIGHTNING_SUBCOMMANDS:
        return _fail(command, f"unknown subcommand; use one of {', '.join([*LIGHTNING_SUBCOMMANDS, *TOOLS])}")
    try:
        if command in TOOLS:
            return int(_tool(TOOLS[command][0])(argv[1:]) or 0)
        _lightning_cli(argv, explicit)  # not explicit: LightningCLI reads sys.argv itself
        return 0
    except ArgumentError as err:  # a config/command-line parse error of LightningCLI (jsonargparse)
        from lightning_hybrid.cli_errors import parse_error_line

        if os.environ.get(DEBUG_ENV) == "1":
            raise
        keys = [a.dest for p in _PARSERS for a in p._actions if isinstance(a.dest, str)]
        return _fail(command, parse_error_line(str(err), keys))
    except Exception as err:  # noqa: BLE001 - a user's mistake becomes one line; anything else is re-raised
        message = user_error_message(err)
        if message is None or os.environ.get(DEBUG_ENV) == "1":
            raise
        return _fail(command, message)


if __name__ == "__main__":
    sys.exit(main())
