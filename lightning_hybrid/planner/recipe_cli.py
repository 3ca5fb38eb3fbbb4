"""``lightning-hybrid plan --config RECIPE``'s command line: which flags were given, which replace a recipe value,
which cannot apply, and the report (:mod:`~lightning_hybrid.planner.recipe_plan` plans).

No flag is dropped silently: a flag beside ``--config`` replaces the recipe's value (the report's ``values`` line and
the JSON's ``sources`` say which values came from where), applies to the GPU's figures, or is refused in one line
(exit 2) when the recipe fixes what it would change.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, Callable

from lightning_hybrid.planner.calibrate import calibrate_hardware, load_preflight
from lightning_hybrid.planner.interval import checkpoint_plan
from lightning_hybrid.planner.recipe_plan import Overrides, format_recipe_plan, plan_recipe
from lightning_hybrid.planner.report import explain_time
from lightning_hybrid.planner.step_time import Hardware

__all__ = ["given_flags", "hardware_flags", "run_recipe_plan", "check_positive", "HARDWARE_FLAGS", "EXPLAIN_BEST"]

# flags that change the GPU's figures: no recipe sets them, so beside --config they apply as they do without it
HARDWARE_FLAGS = ("gpu_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "compute_efficiency",
                  "link_efficiency", "calibrate")
# flags that replace a recipe value (Overrides' fields)
RECIPE_FLAGS = ("model", "gpu", "seq_len", "global_batch", "precision", "optimizer", "float8", "fused_projections")
# flags whose value the recipe fixes, or that change a report --config does not print
CANNOT_APPLY = {
    "gpus": "the recipe's trainer.devices x trainer.num_nodes set the GPUs",
    "gpus_per_node": "the recipe's trainer.devices sets the GPUs per node",
    "top": "--config prints the recipe's layout beside the fastest one, not the ranked table",
}
EXPLAIN_BEST = "best"  # `--explain` without a value: the chosen (fastest fitting) layout
POSITIVE = ("gpus", "gpus_per_node", "seq_len", "global_batch", "gpu_memory_gb", "peak_tflops", "intra_node_gbps",
            "inter_node_gbps", "mtbf_hours", "save_seconds", "compute_efficiency", "link_efficiency", "top")


def given_flags(build_parser: Callable[[], argparse.ArgumentParser], argv: Any) -> dict[str, Any]:
    """The flags given on the command line ``argv`` (``None``: ``sys.argv[1:]``), by destination, with their
    values: the parser of ``build_parser`` run again with every default suppressed (abbreviations included)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # an action not given then leaves no attribute
    return vars(parser.parse_args(argv))


def check_positive(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the first numeric flag that is given and not positive."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be positive")


def hardware_flags(args: argparse.Namespace, hw: Hardware) -> Hardware:
    """``hw`` with the GPU-figure, efficiency and ``--calibrate`` flags applied."""
    hw = replace(hw, compute_efficiency=args.compute_efficiency, link_efficiency=args.link_efficiency)
    hw = hw.with_overrides(args.gpu_memory_gb, args.peak_tflops, args.intra_node_gbps, args.inter_node_gbps)
    if getattr(args, "calibrate", None):
        hw = calibrate_hardware(hw, load_preflight(args.calibrate))
    return hw


def _refuse(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """Raise ``ValueError`` (one line) for the first flag that cannot apply beside ``--config``."""
    for name, why in CANNOT_APPLY.items():
        if name in given:
            raise ValueError(f"--{name.replace('_', '-')} {given[name]} cannot apply with --config: {why}; edit the "
                             f"recipe, or plan without --config")
    meshes = [value for value in args.explain if value != EXPLAIN_BEST]
    if meshes:
        raise ValueError(f"--explain {meshes[0]} cannot apply with --config: it explains the recipe's layout and the "
                         f"fastest one; use --explain without a value, or plan without --config")


def overrides_of(given: dict[str, Any]) -> Overrides:
    """The recipe values the given flags replace, and the hardware flags given."""
    values = {name: given[name] for name in RECIPE_FLAGS if name in given}
    hardware = tuple((f"--{name.replace('_', '-')}", given[name]) for name in HARDWARE_FLAGS if name in given)
    return Overrides(**values, hardware=hardware)


def run_recipe_plan(args: argparse.Namespace, given: dict[str, Any]) -> int:
    """``plan --config``: the recipe's own layout beside the fastest, with the given flags in place of the recipe's
    values; 0 when the recipe's layout fits, 1 when not, 2 on a bad recipe or a flag that cannot apply."""
    try:
        check_positive(args)
        _refuse(args, given)
        plan = plan_recipe(args.config, overrides=overrides_of(given), hardware=lambda hw: hardware_flags(args, hw))
    except ValueError as err:
        print(f"lightning-hybrid plan: error: {err}", file=sys.stderr)
        return 2
    e = plan.recipe
    checkpoint = checkpoint_plan(e.checkpoint_bytes, plan.problem.hw.gpus, e.time["step"], args.save_seconds,
                                 args.mtbf_hours, restart_seconds=args.restart_seconds)
    if args.json:
        print(json.dumps(dict(plan.to_dict(), checkpoint=checkpoint), indent=1))
        return 0 if e.fits else 1
    print("\n".join(format_recipe_plan(plan)))
    print(f"  checkpoint interval of the recipe's layout (Young/Daly): save {checkpoint['save_seconds']:.0f} s, "
          f"job MTBF {checkpoint['mtbf_hours']:.1f} h -> every {checkpoint['interval_seconds'] / 60:.0f} min")
    if args.explain:
        for estimate in (plan.recipe, plan.fastest):
            if estimate is not None:
                print("\n" + "\n".join(explain_time(estimate)))
    return 0 if e.fits else 1
