"""The ``lightning-hybrid`` command: LightningCLI's fit/validate/test/predict plus the project's tools."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Optional

__all__ = ["main", "TOOLS"]

# Subcommands that are not Lightning's: name -> ("module:function", one-line help).
TOOLS: dict[str, tuple[str, str]] = {
    "plan": ("lightning_hybrid.planner.cli:run_plan", "choose tp/pp/dp/micro-batching for a model and cluster"),
    "preflight": ("lightning_hybrid.preflight.cli:preflight_main",
                  "measure link bandwidth per mesh dimension (torchrun)"),
    "prepare-data": ("lightning_hybrid.data.prepare:prepare_main", "tokenize text/JSONL into a packed token file"),
    "export-hf": ("lightning_hybrid.checkpoint.export:export_main", "write a Hugging Face folder from a checkpoint"),
}
LIGHTNING_SUBCOMMANDS = {
    "fit": "train (and validate) a model",
    "validate": "run one validation epoch",
    "test": "run one test epoch",
    "predict": "run prediction",
}


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


def _lightning_cli(argv: Optional[list[str]]) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_hybrid.models import CausalLM

    LightningCLI(CausalLM, subclass_mode_data=True, args=argv,
                 save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``lightning-hybrid`` console script."""
    explicit = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command = argv[0]
    if command in TOOLS:
        return int(_tool(TOOLS[command][0])(argv[1:]) or 0)
    if command in LIGHTNING_SUBCOMMANDS:
        _lightning_cli(argv if explicit else None)  # None: LightningCLI reads sys.argv itself
        return 0
    print(f"lightning-hybrid: unknown subcommand {command!r}; use one of "
          f"{', '.join([*LIGHTNING_SUBCOMMANDS, *TOOLS])}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
