"""The planner's closed-form step-time model: cluster figures, software features, fitted constants, and its terms.

The GPU figures come from :mod:`lightning_hybrid.hardware`; :class:`Hardware` adds the cluster (GPU count,
GPUs per node) and link efficiency, :class:`Runtime` what the training software does that changes time
(fused kernels, overlapped collectives, the selective recompute policy), and :class:`TimeModel` the constants
fitted on published runs (``benchmarks/planner_published.py``; ``docs/planner.md`` lists each with its source).
:func:`lightning_hybrid.planner.cost.estimate` adds the terms up. Per micro-batch and pipeline rank:

* GEMMs: every matmul of a block (q, k, v, o, gate, up, down) and the head at its TP-local shape
  ``tokens x in x out``, forward and backward ``6 x tokens x in x out`` FLOPs, at ``peak x`` :func:`gemm_efficiency`
  of its smallest dimension: ``e_max x d / (d + knee)``; attention ``12 L hq T`` FLOPs (causal half not
  subtracted) at ``peak x ATTENTION_EFFICIENCY``.
* elementwise work (norms, rotary, SiLU, residual adds, casts): bytes moved per token and block
  (:func:`elementwise_bytes`, counted op by op for this implementation, or once per fused region with
  ``torch.compile``/fused kernels) at ``HBM bandwidth x HBM_EFFICIENCY``; backward moves
  ``ELEMENTWISE_BACKWARD`` times the forward's bytes.
* recompute: full recompute reruns every forward (GEMMs, attention, elementwise, the forward TP collectives up to
  the block's last saved tensor: torch's checkpoint stops there, before the MLP's output collective);
  this project's selective ("op") policy reruns the elementwise forward only; torchtitan's "every other
  matmul" policy also reruns k, o and up.
* TP: per block, two collectives of the activations forward and two backward with sequence parallel
  (reduce-scatter + all-gather pairs, an all-reduce's bus traffic each); without it two all-reduces forward and five
  backward, one per colwise projection, as torch's TP styles issue them here (``planner/collectives.py``); in the
  critical path (torch's TP runs them on the compute stream); with async TP / Megatron's overlap
  ``TimeModel.tp_overlap_exposed`` of them stays exposed.
* PP: a bubble of ``(pp - 1) / v`` micro-batch times of the slowest rank, plus the point-to-point transfers of
  warm-up and cool-down (steady-state transfers overlap with compute).
* DP: ``replicate`` all-reduces the gradients once per step after backward (exposed); FSDP without a pipeline
  gathers in forward and backward and reduce-scatters per micro-batch, prefetch hiding it behind compute up to
  the compute time; FSDP under a 1F1B or GPipe pipeline gathers the stage once and each block again once per
  micro-batch (torch reshards a block after each forward; the re-gathers hide behind compute like prefetch) and
  reduce-scatters once per step, exposed. With
  ``Runtime.dp_overlap`` (Megatron's overlapped gradient reduce and parameter gather) the per-step collectives
  hide behind the last micro-batch's compute.
* the optimizer step, bound by memory bandwidth.

Collective times use nccl-tests' bus bandwidth: ``t = latency + bytes * f / busbw`` with ``f = 2(n-1)/n``
for all-reduce and ``(n-1)/n`` for all-gather and reduce-scatter, and ``busbw = link bandwidth *
link_efficiency``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lightning_hybrid.hardware import GPU, NETWORK_LATENCY_S, NVLINK_LATENCY_S
from lightning_hybrid.models.qwen2.config import Qwen2Config

__all__ = ["Hardware", "Runtime", "TimeModel", "SELECTIVE_POLICIES", "collective_seconds", "gemm_efficiency",
           "block_gemms", "elementwise_bytes", "GEMM_PEAK_EFFICIENCY", "GEMM_KNEE", "TP_OVERLAP_EXPOSED",
           "ATTENTION_EFFICIENCY", "HBM_EFFICIENCY", "ELEMENTWISE_BACKWARD", "FLOAT8_GEMM_EFFICIENCY"]

# ----------------------------------------------------------------------------- constants
# Fitted on the published runs of benchmarks/planner_published.py (least squares on log MFU; the leave-one-out
# errors are printed there and listed in docs/planner.md). Each is a property of the GPU's matmul kernels or of
# the overlap machinery, not of one run.
GEMM_PEAK_EFFICIENCY = 0.641
"""Fraction of the dense peak a large bf16 GEMM sustains in training (fitted; cuBLAS reaches 0.7-0.8 of the H100
peak on 8192^3 at 700 W)."""
GEMM_KNEE = 616.0
"""A GEMM whose smallest dimension is ``d`` reaches ``d / (d + GEMM_KNEE)`` of :data:`GEMM_PEAK_EFFICIENCY` (fitted):
tile quantization and too few tiles to fill the SMs make skinny TP-local matmuls slower."""
TP_OVERLAP_EXPOSED = 0.075
"""Fraction of the TP collectives still exposed when they are overlapped with the GEMMs (torch async TP,
Megatron's --tp-comm-overlap; fitted: torchtitan measured async TP 1.09-1.10x faster than vanilla TP)."""
# Taken from sources, not fitted.
ATTENTION_EFFICIENCY = 0.6
"""Fraction of the peak attention reaches on the planner's count ``12 L hq T`` (the causal half not subtracted):
FlashAttention-2 runs forward + backward at up to 335 TFLOP/s on an H100 counting only the causal half it
computes (Dao 2023, sec. 4), i.e. 0.6-0.68 of the 989 TFLOP/s peak on the full count."""
HBM_EFFICIENCY = 0.8
"""Fraction of the HBM bandwidth elementwise kernels reach (STREAM-like copies reach 0.8-0.9 on H100)."""
ELEMENTWISE_BACKWARD = 2.0
"""Backward of an elementwise op moves about twice its forward's bytes: it reads the output gradient and the saved
inputs and writes the input gradients (unary: 3 tensors vs 2; binary: 5 vs 3), plus the residual gradient adds."""
FLOAT8_GEMM_EFFICIENCY = {"tensorwise": 0.447, "rowwise": 0.279, "mxfp8": 0.423}
"""Fraction of the dense fp8 peak a large float8 block GEMM sustains in training with torchao, dynamic casts and
scales included (fitted per recipe on torchtitan's H100 float8 rows without context parallelism in
``benchmarks/planner_published.py``: Llama 3 8B, 70B and 405B; mxfp8 on its published B200 speedup over bf16, 1.20x,
in torchtitan's mxfp8.md). The head and attention stay at the bf16 peak. Rowwise is low: torchtitan's rowwise rows ran
no faster than bf16 (pytorch/torchtitan#1207). Transformer Engine's fused casts reach more (0.65 tensorwise, fitted on
Megatron-Bridge's rows there); the planner predicts torchao, our runtime."""
AUTOCAST_WEIGHT_CAST_BYTES = 6
"""Autocast casts each fp32 matmul weight to bf16 once per forward (reads 4 bytes, writes 2)."""


@dataclass(frozen=True)
class SelectivePolicy:
    """What a selective recompute policy reruns in backward besides the elementwise forward.

    Args:
        matmuls: block matmuls whose forward runs again.
        tp_all_gathers: sequence-parallel all-gathers per block that run again (half an all-reduce's traffic each).
    """

    matmuls: tuple[str, ...] = ()
    tp_all_gathers: int = 0
    fused_matmuls: tuple[str, ...] = ()  # the same policy on fused q/k/v and gate/up projections

    def rerun(self, fused: bool) -> tuple[str, ...]:
        """The matmuls (names of :func:`block_gemms`) whose forward runs again in backward."""
        return self.fused_matmuls if fused else self.matmuls


SELECTIVE_POLICIES = {
    # this project's "op" policy (distributed/activation_checkpoint.py): matmul, attention and collective outputs
    # are kept, norms/rotary/SiLU/products/casts rerun.
    "op": SelectivePolicy(),
    # torchtitan's op SAC (torchtitan/parallelisms/parallelize_llama.py, _apply_ac_to_transformer_block): keeps
    # every mm output except every second one (k, o and up in execution order q k v o gate up down; o and down of
    # qkv o gate_up down with fused projections); the SP all-gathers in front of attention and the MLP are not in
    # its save list.
    "every_other_mm": SelectivePolicy(matmuls=("k", "o", "up"), tp_all_gathers=2, fused_matmuls=("o", "down")),
}


@dataclass(frozen=True)
class Runtime:
    """What the training software does that changes the step time (and, where said, the memory). Defaults: this
    project.

    Args:
        fused_elementwise: norms, rotary, SiLU and residual adds run as fused kernels (``torch.compile`` per block,
            Transformer Engine/Apex); else one kernel per op, as this project's eager model.
        low_precision_params: the forward runs on bf16 copies of the weights made once per gather or step (FSDP's
            ``param_dtype=bf16``, Megatron's bf16 parameters): bf16 residual stream and FSDP all-gathers, no
            per-op autocast casts. This project under ``bf16-mixed`` uses autocast on fp32 weights instead.
        tp_overlap: TP collectives overlap with the GEMMs (torch async TP, Megatron ``--tp-comm-overlap``).
        dp_overlap: the per-step gradient reduce-scatter and parameter all-gather overlap with the last
            micro-batch (Megatron ``--overlap-grad-reduce --overlap-param-gather``).
        loss_parallel: the cross-entropy runs on vocabulary shards (torchtitan, Megatron); this project gathers
            the logits and computes the loss on the full vocabulary on every TP rank.
        selective: the selective recompute policy, a key of :data:`SELECTIVE_POLICIES`.
        float8: ``None`` or the float8 recipe of the block linears (``"tensorwise"``, ``"rowwise"``, ``"mxfp8"``):
            their GEMMs run at the fp8 peak times :data:`FLOAT8_GEMM_EFFICIENCY`.
        fsdp_regather: under a pipeline FSDP re-gathers each block for every micro-batch (it reshards after each
            forward); ``False``: the stage is gathered once per step (``fsdp_reshard_after_forward`` off or
            ``"auto"`` under ``pp > 1``).
        fused_projections: q, k and v run as one GEMM per TP rank, and gate with up as another (this project's
            model, Megatron-LM, Megatron-Bridge, NeMo); ``False``: five separate GEMMs (torchtitan, Hugging Face).
            The FLOPs are the same; the fused GEMMs are wider, so skinny TP-local k and v projections no longer run
            at their own low efficiency, and autocast casts each projection input once instead of per projection.
        ring_attention: the context-parallel attention (``planner/context_parallel.py``): ``"blockwise"``, this
            project's (K/V all-gathered at their own heads, fp32 matmuls block by block under checkpointing);
            ``"gather"``, Llama 3's (the same all-gather, a fused attention kernel); ``"rotate"``, torch's
            ``context_parallel`` ring as torchtitan runs it (K/V repeated to the query heads, one step at a time).
        pipeline_keeps_outputs: memory, not time: the last pipeline stage keeps every micro-batch's logits until
            the step ends (torch's ``schedule.step()`` does, to return them, unless ``return_outputs=False``, which
            this project's ``PipelineRunner`` passes), not only those in flight.
    """

    fused_elementwise: bool = False
    low_precision_params: bool = False
    tp_overlap: bool = False
    dp_overlap: bool = False
    loss_parallel: bool = False
    selective: str = "op"
    float8: Optional[str] = None
    fsdp_regather: bool = True
    fused_projections: bool = True
    ring_attention: str = "blockwise"
    pipeline_keeps_outputs: bool = False


@dataclass(frozen=True)
class TimeModel:
    """The constants of the time model besides the large-GEMM efficiency (``Hardware.compute_efficiency``)."""

    gemm_knee: float = GEMM_KNEE
    tp_overlap_exposed: float = TP_OVERLAP_EXPOSED
    attention_efficiency: float = ATTENTION_EFFICIENCY
    hbm_efficiency: float = HBM_EFFICIENCY
    float8_efficiency: Optional[float] = None  # None: FLOAT8_GEMM_EFFICIENCY of the runtime's recipe


def gemm_efficiency(peak_efficiency: float, knee: float, m: int, k: int, n: int) -> float:
    """Fraction of peak an ``m x k`` by ``k x n`` GEMM (and its two backward GEMMs) reaches: ``e d / (d + knee)``
    with ``d`` the smallest dimension and ``e`` the large-GEMM efficiency."""
    d = min(m, k, n)
    return peak_efficiency * d / (d + knee)


def block_gemms(config: Qwen2Config, tp: int, fused: bool = False) -> dict[str, tuple[int, int]]:
    """(in, out) of each matmul of a block on one TP rank: colwise ones split ``out``, rowwise ones ``in``.

    ``fused``: q, k and v as one GEMM ``qkv`` of ``(heads + 2 kv_heads) x head_dim / tp`` outputs (each rank keeps
    whole heads and whole KV groups), gate and up as one ``gate_up`` of ``2 x intermediate / tp``.
    """
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    q, kv, inter = (-(-n // tp) for n in (q, kv, inter))  # torch.chunk: the first ranks hold ceil(n / tp)
    if fused:
        return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, inter), "up": (h, inter),
            "down": (inter, h)}


def elementwise_bytes(config: Qwen2Config, tp: int, sequence_parallel: bool, compute: int, residual: int,
                      runtime: Runtime) -> float:
    """Bytes the elementwise ops of one block move per token in forward, on one TP rank.

    Eager (this project's model, op by op, reads + writes): each RMSNorm in fp32 (square, mean, scale, weight:
    ``20 h`` bytes, plus the casts to and from fp32 when the residual stream is narrower: ``2 (r + 4) h`` and the
    weight multiply ``2 r h``); autocast's cast of the 5 linear inputs (``5 (r + a) h``); rotary on q and k
    (negate, concatenate, two products, a sum: ``10 a`` per element); GQA's repeat of k and v to the query heads
    (``2 a (q + kv)``); the attention output's transpose copy (``2 a q``); two residual adds (``6 r h``); SiLU and
    the product (``5 a I``); Qwen3's per-head q/k norms, an RMSNorm in fp32 on ``q + kv`` elements of the compute
    dtype; with fused projections autocast casts 2 linear inputs (qkv, gate_up), not 5. Fused kernels: each region
    reads its inputs and writes its outputs once: residual add + norm ``2 (r + a) h`` twice, rotary ``2 a (q + kv)``
    (with the q/k norms inside the same region) and the GQA repeat, SiLU-product ``3 a I``. ``h`` terms are divided
    by ``tp`` under sequence parallel.
    """
    a, r = compute, residual
    h = config.hidden_size / (tp if sequence_parallel and tp > 1 else 1)
    q = config.num_attention_heads * config.head_dim / tp
    kv = config.num_key_value_heads * config.head_dim / tp
    inter = config.intermediate_size / tp
    gqa = 2 * a * (q + kv) if config.num_attention_heads > config.num_key_value_heads else 0.0
    if runtime.fused_elementwise:
        return 4 * (r + a) * h + 2 * a * (q + kv) + gqa + 3 * a * inter
    norm = 20 * h + 2 * r * h + (2 * (r + 4) * h if r < 4 else 0.0)
    casts = (2 if runtime.fused_projections else 5) * (r + a) * h if r > a else 0.0
    head_norms = (20 + 2 * a + (2 * (a + 4) if a < 4 else 0.0)) * (q + kv) if config.qk_norm else 0.0
    return 2 * norm + casts + 10 * a * (q + kv) + gqa + 2 * a * q + 6 * r * h + 5 * a * inter + head_norms


@dataclass(frozen=True)
class Hardware:
    """The cluster the planner plans for: a GPU type with its figures overridden by flags.

    Args:
        gpu: the GPU figures.
        gpus: total GPUs.
        gpus_per_node: GPUs per node (TP stays inside a node).
        compute_efficiency: fraction of peak that large matmuls reach (:data:`GEMM_PEAK_EFFICIENCY`); smaller
            ones reach less (:func:`gemm_efficiency`).
        link_efficiency: fraction of link bandwidth that collectives reach (busbw / link).
        intra_latency_s, inter_latency_s: fixed cost of one collective inside a node / across nodes.
        reserved_gb: memory the framework takes before the model (CUDA context, NCCL buffers, workspaces).
        fragmentation: fraction of the remaining memory lost to allocator fragmentation.
        cores_per_node: CPU processes share this many cores (``None``: every rank has its own device, as GPUs).
        collective_factors: ``(kind, factor)`` pairs: a collective kind's measured bus bandwidth over the link
            figure (a preflight measures each kind; gloo's reduce-scatter is several times slower than its
            all-reduce). A kind not listed runs at the link figure.
        scheduling_wait_s: CPU processes with no spare core (processes >= cores): what one step of a blocking collective
            (a ring all-reduce has ``2 (n - 1)`` of them, an all-gather ``n - 1``) waits for its peer to be scheduled
            (:data:`lightning_hybrid.planner.calibrate.CPU_SCHEDULING_WAIT_S`); 0 on GPUs.
    """

    gpu: GPU
    gpus: int
    gpus_per_node: int
    compute_efficiency: float = GEMM_PEAK_EFFICIENCY
    link_efficiency: float = 0.8
    intra_latency_s: float = NVLINK_LATENCY_S
    inter_latency_s: float = NETWORK_LATENCY_S
    reserved_gb: float = 4.0
    fragmentation: float = 0.05
    cores_per_node: Optional[int] = None
    collective_factors: tuple[tuple[str, float], ...] = ()
    scheduling_wait_s: float = 0.0

    @property
    def usable_bytes(self) -> float:
        """Bytes a rank can fill with model, optimizer and activations."""
        return max(0.0, (self.gpu.memory_gb - self.reserved_gb) * (1 - self.fragmentation)) * 1e9

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s of one GPU: fp32 for ``32-true``, else the bf16 tensor-core peak."""
        peak = self.gpu.peak.fp32 if precision == "32-true" else self.gpu.peak.bf16
        if peak is None:
            raise ValueError(f"GPU {self.gpu.name} lists no peak for precision={precision!r}; pass --peak-tflops")
        return peak

    def bus_bandwidth(self, inter_node: bool) -> float:
        """Achievable bus bandwidth of a collective in bytes/s, inside a node or across nodes."""
        link = self.gpu.network_gbs if inter_node else self.gpu.nvlink_gbs
        return link * 1e9 * self.link_efficiency

    def latency(self, inter_node: bool) -> float:
        """Fixed cost in seconds of one collective inside a node or across nodes."""
        return self.inter_latency_s if inter_node else self.intra_latency_s

    def collective(self, kind: str, nbytes: float, ranks: int, inter_node: bool, blocking: bool = False) -> float:
        """Seconds of one collective of ``kind`` (see :func:`collective_seconds`) on this cluster's links;
        ``blocking``: every rank waits in it between compute bursts (TP, CP), so with no spare core each of its
        steps also waits for a peer to be scheduled (:attr:`scheduling_wait_s`)."""
        bandwidth = self.bus_bandwidth(inter_node) * dict(self.collective_factors).get(kind, 1.0)
        seconds = collective_seconds(kind, nbytes, ranks, bandwidth, self.latency(inter_node))
        if blocking and self.scheduling_wait_s and ranks > 1 and nbytes > 0:
            steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
            seconds += steps * self.scheduling_wait_s
        return seconds

    def with_overrides(self, memory_gb: Optional[float] = None, peak_tflops: Optional[float] = None,
                       nvlink_gbs: Optional[float] = None, network_gbits: Optional[float] = None) -> "Hardware":
        """A copy with the given GPU figures replaced (``None`` keeps the table value).

        ``peak_tflops`` replaces the dense bf16 peak (TFLOP/s), the one mixed and half precision plan with.
        """
        changes: dict[str, object] = {k: v for k, v in dict(memory_gb=memory_gb, nvlink_gbs=nvlink_gbs,
                                                            network_gbits=network_gbits).items() if v is not None}
        if peak_tflops is not None:
            changes["peak"] = replace(self.gpu.peak, bf16=peak_tflops * 1e12)
        return replace(self, gpu=replace(self.gpu, **changes)) if changes else self


def collective_seconds(kind: str, nbytes: float, ranks: int, bus_bandwidth: float, latency: float) -> float:
    """Time of one collective over ``ranks`` with nccl-tests' bus-bandwidth factors.

    ``nbytes`` is the buffer nccl-tests calls the size: the all-reduce buffer, the all-gather output or
    the reduce-scatter input. ``p2p`` moves ``nbytes`` one way.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
              "reduce_scatter": (ranks - 1) / ranks, "p2p": 1.0}[kind]
    return latency + nbytes * factor / bus_bandwidth
