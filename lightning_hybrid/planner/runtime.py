"""The planner's :class:`~lightning_hybrid.planner.step_time.Runtime` derived from the strategy's own options.

One function, :func:`runtime_from_options`, used by ``lightning-hybrid plan`` (with or without ``--config``), by
``"auto"`` layouts at setup and by the dry run's comparison, so that the planner predicts what the configured strategy
does. It reads plain option values (a dict of ``HybridParallelStrategy`` arguments, as in a recipe's
``trainer.strategy.init_args``), never the strategy or a mesh.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from lightning_hybrid.distributed.options import float8_precision_error, reshard_after_forward
from lightning_hybrid.planner.step_time import Runtime

__all__ = ["RUNTIME_OPTIONS", "runtime_from_options", "runtime_features"]

# Strategy arguments that change the step time, each with HybridParallelStrategy's default (the value it has when a
# recipe leaves it out; tests/test_plan_recipe.py holds them equal to the strategy's signature).
RUNTIME_OPTIONS: dict[str, Any] = {
    "compile": False,                     # torch.compile per block: fused elementwise kernels
    "loss_parallel": True,                # cross-entropy on vocabulary shards over the TP group
    "async_tp": False,                    # micro-pipelined TP: TP collectives overlap the matmuls
    "fsdp_reshard_after_forward": "auto",  # True / False / "auto" (under pp > 1: gathered once per step)
    "bf16_compute_weights": True,         # bf16-mixed: bf16 weight copies once per gather/step instead of autocast
    "float8": None,                       # float8 block linears (torchao): their GEMMs at the fp8 peak
}


def _reshards_under_pipeline(value: Any) -> bool:
    """Whether FSDP reshards each block after every forward under ``pp > 1``: the strategy's own decision
    (:func:`~lightning_hybrid.distributed.options.reshard_after_forward`; ``"auto"``: no, as torchtitan), for a
    recipe's value, which may also be the string ``"true"`` or ``"false"``."""
    if isinstance(value, str):
        if value.lower() not in ("auto", "true", "false"):
            raise ValueError(f"fsdp_reshard_after_forward={value!r}; use True, False or 'auto'")
        policy: Any = "auto" if value.lower() == "auto" else value.lower() == "true"
    else:
        policy = bool(value)
    return reshard_after_forward(policy, pp=2, schedule="1f1b")  # any pipeline of a non-zero-bubble schedule


def runtime_from_options(options: Optional[Mapping[str, Any]] = None, precision: str = "bf16-mixed",
                         fused_projections: bool = True) -> Runtime:
    """The :class:`Runtime` a strategy with ``options`` runs with.

    Args:
        options: ``HybridParallelStrategy`` arguments by name (others are ignored; missing ones take
            :data:`RUNTIME_OPTIONS`' defaults).
        precision: Lightning's precision: under ``bf16-true`` the weights are bf16 already (no autocast casts).
        fused_projections: the model runs q/k/v and gate/up as one GEMM each (a property of the model, not a
            strategy option: this project's decoder fuses them; ``plan --no-fused-projections`` plans without).

    Mapping: ``compile`` -> ``fused_elementwise``; ``async_tp`` -> ``tp_overlap``; ``loss_parallel`` -> itself;
    bf16 compute weights (or ``bf16-true``) -> ``low_precision_params``; ``fsdp_reshard_after_forward`` False or
    ``"auto"`` -> under a pipeline the stage is gathered once per step (``fsdp_regather=False``), and the step's
    gradient reduce-scatter overlaps the last micro-batch (the search applies this to FSDP layouts with ``pp > 1``
    only; ``dp_overlap``, a distributed optimizer for replicated weights, stays off: the strategy has none).

    Raises:
        ValueError: an unknown ``fsdp_reshard_after_forward``, or ``float8`` with a precision the strategy refuses it
            under (the strategy's own words: ``option_checks.float8_error``).
    """
    values = {**RUNTIME_OPTIONS, **{k: v for k, v in (options or {}).items() if k in RUNTIME_OPTIONS}}
    if float8_precision_error(values["float8"], precision):
        raise ValueError(float8_precision_error(values["float8"], precision))
    keep_gathered = not _reshards_under_pipeline(values["fsdp_reshard_after_forward"])
    low_precision = precision == "bf16-true" or (precision == "bf16-mixed" and bool(values["bf16_compute_weights"]))
    return Runtime(fused_elementwise=bool(values["compile"]), low_precision_params=low_precision,
                   tp_overlap=bool(values["async_tp"]),
                   loss_parallel=bool(values["loss_parallel"]), fsdp_regather=not keep_gathered,
                   float8=values["float8"], fused_projections=fused_projections)


def runtime_features(runtime: Runtime) -> dict[str, bool]:
    """Which runtime features are on, by the planner's names (``plan --explain`` and the JSON report list them)."""
    return {"fused_elementwise (compile)": runtime.fused_elementwise,
            "low_precision_params (bf16 compute weights)": runtime.low_precision_params,
            "tp_overlap (async_tp)": runtime.tp_overlap,
            "fsdp stage gathered once per step under pp (fsdp_reshard_after_forward)": not runtime.fsdp_regather,
            "loss_parallel": runtime.loss_parallel,
            f"float8 ({runtime.float8})": runtime.float8 is not None,
            "fused_projections (q/k/v and gate/up GEMMs)": runtime.fused_projections}
