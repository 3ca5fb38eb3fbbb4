"""Float8 training through torchao: which linears are converted, the float8 TP styles, FSDP2's float8 all-gather.

``float8="tensorwise"`` and ``"rowwise"`` swap the declared block linears (the keys of the model's TP plan: q/k/v/o,
gate/up/down for Qwen2) for torchao's ``Float8Linear``; ``"mxfp8"`` swaps their weights for torchao's MXFP8 training
tensor (``MXFP8TrainingOpConfig``: real kernels on compute capability 10.x, torchao's emulated path on CPU). The
embedding and the head stay in the compute dtype (the head's logits feed the loss, the least robust place for
float8). The parameters keep their names, shapes and master dtype, so checkpoints of a float8 run load into a bf16
run and back, and ``export-hf`` is unchanged.

Fused projections (q/k/v, gate/up: the model's ``fused_projections``) stay one GEMM: :class:`Float8FusedLinear` casts
the concatenation of the parts' weights once and runs one float8 (or MXFP8) GEMM through torchao's own autograd
functions. MXFP8 (blocks of 32 along the inner dimension; each part's rows a multiple of 32) and rowwise's forward
(a scale per output row) scale exactly as the parts would; tensorwise takes one scale for the fused weight (the amax
of all its parts, as Transformer Engine's fused QKV), and rowwise's input-gradient GEMM scales each column over all
the fused rows. The float8 GEMM keeps the concatenated weight for its backward (one copy of the parts' weights per
layer until then). Tensorwise with FSDP2's float8 all-gather gathers each part in float8 with its own scale, which
one GEMM cannot take: there the parts run one by one (logged once), as they do when only some parts can be
converted.

Order (:func:`~lightning_hybrid.distributed.parallelize.parallelize`): conversion on the meta device, then TP (with
torchao's float8 styles under ``"tensorwise"``: the TP all-gathers move float8), then recompute/compile, then FSDP2
(under ``"tensorwise"`` weights are all-gathered in float8; :func:`precompute_float8_scales` computes their scales
after each optimizer step, one all-reduce of the amaxes over the shard group). Scales are computed on the full
tensors whatever the mesh: torchao's amax of a sharded DTensor is reduced over the shards.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_hybrid.models.fused import FusedLinear
from lightning_hybrid.models.spec import ParallelSpec, held_block_plan, holds

__all__ = ["FLOAT8_EMULATE_ENV", "float8_device_error", "check_float8_device", "convert_float8", "float8_skipped",
           "float8_tp_plan", "precompute_float8_scales", "uses_fsdp_float8_all_gather", "Float8FusedLinear"]

log = logging.getLogger(__name__)

# torch._scaled_mm (cuBLAS/CUTLASS) takes float8 matrices whose inner and output dimensions are multiples of 16;
# MXFP8 scales blocks of 32 elements along the inner dimension.
_DIVISOR = {"tensorwise": 16, "rowwise": 16, "mxfp8": 32}
_LOGGED: set[tuple[str, ...]] = set()
FLOAT8_EMULATE_ENV = "LIGHTNING_HYBRID_FLOAT8_EMULATE"
"""Set to ``1``: tensorwise/rowwise matmuls run torchao's emulated GEMM (the same float8 casts and scales, the product
of the dequantized operands in bf16) instead of ``torch._scaled_mm``. For long CPU tests only: torch's CPU
``_scaled_mm`` is a reference kernel (0.25 s for a 128x64x176 product, 4,000x a bf16 matmul) whose results the
emulation matches to bf16 rounding (tests/test_float8.py checks it)."""


def float8_device_error(float8: Optional[str], device: torch.device) -> Optional[str]:
    """Why this device cannot run ``float8`` (one line), or ``None``; needs no collective.

    Float8 matmuls need compute capability 8.9 (Ada, Hopper); MXFP8 needs 10.x (Blackwell). On CPU torch's
    ``_scaled_mm`` runs tensorwise and rowwise float8, and torchao emulates MXFP8.
    """
    if float8 is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    need = (10, 0) if float8 == "mxfp8" else (8, 9)
    if capability < need:
        return (f"float8={float8!r} needs a GPU of compute capability {need[0]}.{need[1]} or newer; {name} has "
                f"{capability[0]}.{capability[1]} (use float8='rowwise' on Hopper/Ada, or float8=None)")
    return None


def check_float8_device(float8: Optional[str], device: torch.device) -> None:
    """Raise ``ValueError`` with :func:`float8_device_error`'s line when this device cannot run ``float8``."""
    problem = float8_device_error(float8, device)
    if problem:
        raise ValueError(problem)


def float8_skipped(module: nn.Module, spec: ParallelSpec, recipe: str, tp: int) -> dict[str, str]:
    """Block linears of ``module`` that ``recipe`` cannot take: name -> why (a dimension of the tensor-parallel shard
    that is not a multiple of 16, or 32 for MXFP8; under MXFP8 a bias outside a fused projection that runs fused:
    torchao's MXFP8 linear leaves ``F.linear``'s bias out, while :class:`Float8FusedLinear` adds it). A block
    holds only some of ``block_plan``'s linears where a mixture of experts replaces its MLP (its experts stay bf16)."""
    divisor = _DIVISOR[recipe]
    skipped = {}
    for index, block in (getattr(module, spec.blocks, None) or {}).items():
        shape = {}
        for name, style in held_block_plan(spec, block).items():
            linear = block.get_submodule(name)
            # The sharded dimension is divided over tp: colwise splits the output, rowwise the input.
            out_f = linear.out_features // (tp if style == "colwise" else 1)
            in_f = linear.in_features // (tp if style == "rowwise" else 1)
            if out_f % divisor or in_f % divisor or (linear.out_features % tp) or (linear.in_features % tp):
                shape[name] = f"{in_f}x{out_f} per rank is not a multiple of {divisor}"
        # a fused group runs fused under float8 only when all its parts are converted
        fused = {part for group, parts in spec.fused_projections.items()
                 if holds(block, group) and not shape.keys() & set(parts) for part in parts}
        for name in held_block_plan(spec, block):
            if name not in shape and recipe == "mxfp8" and block.get_submodule(name).bias is not None \
                    and name not in fused:
                shape[name] = "a bias (torchao's MXFP8 linear would drop it)"
        skipped.update({f"{spec.blocks}.{index}.{name}": why for name, why in shape.items()})
    return skipped


def convert_float8(module: nn.Module, spec: ParallelSpec, recipe: str, tp: int, fsdp: bool) -> list[str]:
    """Convert ``module``'s block linears (the keys of ``spec.block_plan``) in place for float8 training.

    Runs before TP and FSDP2, on the meta device. Linears of a shape ``recipe`` cannot take are skipped and
    logged once. Returns the names of the converted linears.

    Args:
        tp: the tensor-parallel size (each rank's shard must still fit the float8 kernels).
        fsdp: FSDP2 shards the weights; under ``"tensorwise"`` they are then all-gathered in float8.
    """
    skipped = float8_skipped(module, spec, recipe, tp)
    blocks = getattr(module, spec.blocks, None) or {}
    targets = [f"{spec.blocks}.{i}.{name}" for i, block in blocks.items() for name in held_block_plan(spec, block)]
    chosen = [name for name in targets if name not in skipped]
    if skipped and tuple(skipped) not in _LOGGED:
        _LOGGED.add(tuple(skipped))
        log.warning("float8=%r: %d linear(s) stay in bf16: %s", recipe, len(skipped),
                    "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    _convert(module, recipe, fsdp, set(chosen))
    _fuse_float8(module, spec, recipe, fsdp)
    return chosen


def _convert(module: nn.Module, recipe: str, fsdp: bool, wanted: set[str]) -> None:
    """torchao's conversion of the linears named in ``wanted`` (MXFP8 weights, or ``Float8Linear`` modules)."""
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        # torchao's kernels need compute capability 10.x; elsewhere its emulated (dequantizing) path.
        name = "MXFP8_RCEIL" if torch.cuda.is_available() else "MXFP8_EMULATED_RCEIL"
        config = MXFP8TrainingOpConfig.from_recipe(getattr(MXFP8TrainingRecipe, name))
        quantize_(module, config, filter_fn=lambda mod, fqn: fqn in wanted and isinstance(mod, nn.Linear),
                  device=None)
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fsdp:
        config = replace(config, enable_fsdp_float8_all_gather=True)
    if os.environ.get(FLOAT8_EMULATE_ENV) == "1":
        config = replace(config, emulate=True)
    convert_to_float8_training(module, config=config, module_filter_fn=lambda mod, fqn: fqn in wanted)


def uses_fsdp_float8_all_gather(model: nn.Module) -> bool:
    """Whether any linear of ``model`` all-gathers its weight in float8 (tensorwise with FSDP2)."""
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules())


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of all FSDP2-sharded tensorwise weights at once (one all-reduce of
    their amaxes over the shard group), instead of one reduction per weight in the next forward. Nothing without
    FSDP2's float8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    if not uses_fsdp_float8_all_gather(model):
        return
    precompute_float8_dynamic_scale_for_fsdp(model)


def float8_tp_plan(plan: dict, block: nn.Module, recipe: Optional[str], tp_mesh: Any = None) -> dict:
    """``plan`` (one block's TP plan) with torchao's float8 styles where torchao has them (``"tensorwise"``), so the
    TP collectives of the block inputs move float8. Layers left in bf16 keep torch's styles.

    Gloo cannot move float8 tensors ("Invalid scalar type"). With sequence parallelism the float8 styles gather and
    reduce-scatter float8 activations and gradients, so on a gloo ``tp_mesh`` torch's styles are kept then (the
    block linears still run float8, with the same full-tensor scales); without it the float8 styles move no float8.
    """
    if recipe != "tensorwise":
        return plan
    import torch.distributed as dist
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    sequence_parallel = any(isinstance(style, PrepareModuleInput) or (
        isinstance(style, RowwiseParallel) and isinstance(style.output_layouts[0], Shard)) for style in plan.values())
    if sequence_parallel and tp_mesh is not None and dist.get_backend(tp_mesh.get_group()) == "gloo":
        return plan
    out: dict = {}
    for name, style in plan.items():
        sub = block.get_submodule(name)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(sub, Float8Linear):
            cls = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            out[name] = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                            use_local_output=style.use_local_output)
        elif isinstance(style, PrepareModuleInput) and _all_float8(sub):
            # The sequence-parallel all-gather of a norm's output, cast once to float8 for all its consumers.
            out[name] = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                                 desired_input_layouts=style.desired_input_layouts,
                                                 use_local_output=style.use_local_output)
        else:
            out[name] = style
    return out


def _all_float8(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(isinstance(m, Float8Linear) for m in linears)




def _float8_part(linear: nn.Module) -> Optional[Any]:
    """What runs ``linear``'s float8 GEMM: its ``Float8Linear`` (tensorwise, rowwise), its MXFP8 weight's config, or
    ``None`` (left in bf16)."""
    from torchao.float8.float8_linear import Float8Linear

    if isinstance(linear, Float8Linear):
        return linear
    config = getattr(linear.weight, "config", None)
    return config if config is not None and type(linear.weight).__name__.startswith("MXFP8") else None


def _fuse_float8(module: nn.Module, spec: ParallelSpec, recipe: str, fsdp: bool) -> None:
    """Swap each fused module whose parts were all converted for a :class:`Float8FusedLinear`; one whose parts were
    converted only in part, or gathered in float8 by FSDP2 (tensorwise), is removed: its parts run one by one."""
    unfused = []
    for index, block in (getattr(module, spec.blocks, None) or {}).items():
        for name, parts in spec.fused_projections.items():
            if not holds(block, name):
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = block.get_submodule(owner_name) if owner_name else block
            kinds = [_float8_part(block.get_submodule(part)) for part in parts]
            if all(kind is None for kind in kinds):
                continue  # a bf16 fused GEMM, as without float8
            if any(kind is None for kind in kinds) or (recipe == "tensorwise" and fsdp):
                setattr(owner, attr, None)
                unfused.append(f"{spec.blocks}.{index}.{name}")
                continue
            setattr(owner, attr, Float8FusedLinear(getattr(owner, attr).parts, recipe, kinds[0]))
    if unfused and tuple(unfused) not in _LOGGED:
        _LOGGED.add(tuple(unfused))
        log.warning("float8=%r: %d fused projection(s) run as separate GEMMs (parts in bf16, or FSDP2's float8 "
                    "all-gather: a scale per part): %s", recipe, len(unfused), ", ".join(unfused))


class Float8FusedLinear(FusedLinear):
    """A :class:`~lightning_hybrid.models.fused.FusedLinear` whose one GEMM runs in float8 through torchao: the
    concatenated weight cast once (tensorwise, rowwise: ``matmul_with_hp_or_float8_args`` with the parts' config;
    MXFP8: ``_to_mxfp8_then_scaled_mm``), the biases added in the output dtype.

    Args:
        parts: the fused linears' names (as the module it replaces).
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"mxfp8"``.
        source: the first part's ``Float8Linear`` (its config and GEMM configs), or its MXFP8 weight's config.
    """

    def __init__(self, parts: tuple[str, ...], recipe: str, source: Any) -> None:
        super().__init__(parts)
        self.recipe = recipe
        if recipe == "mxfp8":
            self.mx_config = source
        else:
            self.config, self.linear_mm_config = source.config, source.linear_mm_config

    def forward(self, x: Tensor, weights: Sequence[Tensor], biases: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
        sizes = [w.shape[0] for w in weights]
        if self.recipe == "mxfp8":
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
            from torchao.prototype.moe_training.utils import unwrap_weight

            weight = torch.cat([unwrap_weight(w) for w in weights])
            c = self.mx_config
            out = _to_mxfp8_then_scaled_mm(x, weight, kernel_preference=c.kernel_preference,
                                           scale_calculation_mode=c.scale_calculation_mode,
                                           wgrad_with_hp=c.wgrad_with_hp)
        else:
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

            if torch.is_autocast_enabled():  # as Float8Linear does: the output in autocast's (CUDA) dtype
                x = x.to(torch.get_autocast_gpu_dtype())
            out = matmul_with_hp_or_float8_args.apply(x, torch.cat(list(weights)).t(), self.linear_mm_config,
                                                      self.config)
        if biases is not None:
            out = out + torch.cat(list(biases)).to(out.dtype)
        return list(out.split(sizes, dim=-1))

    def extra_repr(self) -> str:
        return f"parts={self.parts}, recipe={self.recipe}"
