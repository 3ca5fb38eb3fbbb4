"""The planner's GPU time model held against published training runs of 1.7B-405B dense models.

Each row is one published measurement: the model's shape, the cluster, the layout, the sequence length, the batch
and the precision as the source states them, and what the source measured (TFLOP/s per GPU, MFU or tokens/s per
GPU). The planner (:func:`lightning_hybrid.planner.search.estimate`, the same closed-form model ``plan`` ranks
layouts with) predicts the step time of exactly that layout; the table prints predicted TFLOP/s per GPU, MFU and
tokens/s per GPU beside the published figure, with the relative error of the throughput (the same as the error
of MFU or TFLOP/s).

    python benchmarks/planner_published.py              # the table, the fitted constants' errors, leave-one-out
    python benchmarks/planner_published.py --fit        # also refit the constants on all rows and print them

Model FLOPs are the planner's ``6 N + 12 L hq T`` per token (N the matmul weights including the head; the causal
half of attention not subtracted): torchtitan's, Megatron's and the Llama 3 report's convention. MFU is against
the H100 SXM dense bf16 peak, 989.4 TFLOP/s, for every row: the Llama 3 report and Megatron-Core state their MFU
so, torchtitan computes its MFU footnote so.

What a source does not state is chosen and said in the row's ``assumed`` field; rows that need something the
planner does not model yet are listed as pending with the reason, not predicted.

``tests/test_planner_published.py`` runs the table (every row must compute; median absolute error at most 10%,
no row off by more than 20%); the leave-one-out errors are printed here, not asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Optional

from lightning_hybrid.hardware import GPU, GPUS
from lightning_hybrid.models.qwen2.config import Qwen2Config, flops_per_token
from lightning_hybrid.planner.search import Estimate, Layout, Problem, estimate
from lightning_hybrid.planner.step_time import Hardware, Runtime, TimeModel

H100_SXM_PEAK = GPUS["h100"].peak.bf16  # 989.4e12: what every row's MFU is relative to

# The H100s of Meta's Grand Teton hosts in torchtitan's benchmarks: "96GB HBM2e with 2.4 TB/sec peak memory
# bandwidth ... the default 500W power limit"; their footnote: "the actual peak TFLOPs number is between SXM and
# NVL, and we don't know its exact value". The planner uses the midpoint of the SXM (989.4) and NVL (835.5) dense
# bf16 peaks, 912.5 TFLOP/s; links as H100 SXM (NVLink 450 GB/s, 400 Gb/s RDMA per GPU, stated).
H100_GRAND_TETON_500W = dataclasses.replace(
    GPUS["h100"], name="h100 96gb hbm2e 500w", memory_gb=96, hbm_tbs=2.4,
    peak=dataclasses.replace(GPUS["h100"].peak, bf16=(GPUS["h100"].peak.bf16 + GPUS["h100 nvl"].peak.bf16) / 2))


def megatron_gpt(hidden: int, heads: int, layers: int) -> Qwen2Config:
    """A Megatron-Core README benchmark model: GPT with the stated width, heads and layers, vocabulary 131,072.

    The README states hidden size, attention heads and layers only; Megatron's GPT defaults give the rest:
    multi-head attention (kv heads = heads), a 4h GeLU MLP (two h x 4h matrices, 8 h^2 weights) and untied
    embeddings (the model-size column matches untied: 1.7B for h=2048, 24 layers). The planner's SwiGLU has three
    h x I matrices, so I = 8h/3 (rounded to a multiple of 8) gives the same weights and FLOPs per token.
    """
    inter = 8 * round(hidden / 3)
    return Qwen2Config(vocab_size=131072, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                       attention_bias=False, name=f"megatron-gpt-h{hidden}-l{layers}")


@dataclass(frozen=True)
class PublishedRun:
    """One published training measurement and the layout it ran.

    ``published_tflops`` (per GPU) or ``published_tokens_per_gpu`` is the measured figure; ``published_mfu`` is the
    MFU the source prints (for the record: the error is computed on throughput). ``pending`` names what the
    planner lacks for a row it cannot predict yet.
    """

    name: str
    source: str
    stated: str
    assumed: str
    model: str | Qwen2Config
    gpu: GPU
    gpus: int
    tp: int
    pp: int
    dp: int
    data_parallel: str
    micro_batch_size: int
    microbatches: int
    seq_len: int
    global_batch: int  # sequences per optimizer step
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    cp: int = 1  # context parallel: each sequence over cp ranks (dp counts replicas, not cp)
    precision: str = "bf16-mixed"
    runtime: Runtime = field(default_factory=Runtime)
    published_tflops: Optional[float] = None
    published_tokens_per_gpu: Optional[float] = None
    published_mfu: Optional[float] = None
    pending: str = ""
    float8_kernels: str = "torchao"  # whose float8 casts and GEMMs: "torchao" (ours) or "transformer-engine"

    @property
    def config(self) -> Qwen2Config:
        return Qwen2Config.resolve(self.model)

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.config, self.seq_len)

    @property
    def tokens_per_gpu(self) -> float:
        """The published throughput in tokens/s per GPU (from TFLOP/s with the planner's FLOPs per token)."""
        if self.published_tokens_per_gpu is not None:
            return self.published_tokens_per_gpu
        return self.published_tflops * 1e12 / self.flops_per_token

    @property
    def mfu(self) -> float:
        """The published throughput as MFU against the H100 SXM peak."""
        return self.tokens_per_gpu * self.flops_per_token / H100_SXM_PEAK


LLAMA3_PAPER = ("The Llama 3 Herd of Models (arXiv 2407.21783), table 4 'Scaling configurations and MFU for each "
                "stage of Llama 3 405B pre-training', sec. 3.3.1-3.3.2")
LLAMA3_ASSUMED = ("micro-batch 1 sequence (the table's 'batch size/DP' is then the micro-batch count); interleaved "
                  "1F1B is stated, V is not: the text (one fewer layer on the first and last stage, whose first/last "
                  "chunk then holds only the embedding/head) implies one layer per chunk, V=8 for 128 layer slots; "
                  "the planner needs a block per stage, so v=7 (bubble 15/(7x32) instead of 15/(8x32)); "
                  "FSDP 'not resharding after forward' = the planner's FSDP under a pipeline (one gather and one "
                  "reduce-scatter per step); bf16 weights for compute; fused kernels, TP not overlapped and sequence "
                  "parallel are not stated (assumed as in Megatron-style stacks: fused, not overlapped, SP on)")
LLAMA3_RUNTIME = Runtime(fused_elementwise=True, low_precision_params=True, loss_parallel=True, fused_projections=False)
LLAMA3_405B_STATED = ("H100 SXM 80GB HBM3 at 700 W, 8 per Grand Teton server over NVLink, 400 Gb/s RoCE per GPU; "
                      "BF16; seq 8,192; 16M tokens per batch; no activation checkpointing at 8K ('we could pre-train "
                      "Llama 3 on sequences of 8K tokens without activation checkpointing'); TP8 CP1 PP16; "
                      "interleaved schedule; FSDP (ZeRO-2-like: weights not resharded after forward)")

TORCHTITAN_2412 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, torch "
                   "1963fc8, 2024-12); train_configs/llama3_8b.toml at 9dec370: seq_len 8192, selective AC 'op'")
TORCHTITAN_ASYNC_TP = ("pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torchtitan "
                       "820504e, torch 38410cf9, 2025-06); torchtitan/models/llama3/train_configs/llama3_{8b,70b}.toml "
                       "at 820504e: seq_len 8192")
TORCHTITAN_HW = ("Grand Teton: 8 H100 per host over NVLink, 96 GB HBM2e 2.4 TB/s, 500 W power limit, 400 Gb/s "
                 "RDMA per GPU")
TORCHTITAN_ASSUMED = ("FSDP2 MixedPrecisionPolicy defaults (param_dtype bf16, reduce_dtype fp32: "
                      "config_manager.py mixed_precision_param/reduce), i.e. bf16 compute on gathered bf16 weights; "
                      "no gradient accumulation (the local batch is one micro-batch); TP with sequence parallel and "
                      "loss parallel (parallelize_llama.py); peak of the 500 W HBM2e H100 = midpoint of SXM and NVL")
TORCHTITAN_OP_SAC = "every_other_mm"  # torchtitan's op SAC: saves every mm output except every second one
# torchtitan's Llama (models/llama/model.py): wq, wk, wv and w1, w3 are separate nn.Linear (five GEMMs, not fused), and
# K/V are repeated to the query heads (repeat_kv) before SDPA, which under context parallelism is torch's ring
TORCHTITAN_MODEL = {"fused_projections": False, "ring_attention": "rotate"}

MEGATRON_README = ("NVIDIA/Megatron-LM README.md 'Performance Benchmarking', images/model_table.png and "
                   "weak_scaling.png (Megatron-Core r0.8.0): vocabulary 131,072, sequence 4,096, "
                   "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap, H100")
MEGATRON_ASSUMED = ("model: GPT defaults (MHA, 4h MLP = SwiGLU with I=8h/3, untied); H100 SXM 80GB 700 W, 400 Gb/s "
                    "per GPU (DGX H100; the README says 'H100 clusters'); micro-batch size not stated: the per-replica "
                    "batch as one micro-batch without a pipeline, 1 sequence with one (1F1B, no virtual stages: "
                    "none stated); no recompute; distributed optimizer = replication whose gradient reduce-scatter "
                    "and parameter all-gather overlap the last micro-batch; bf16 parameters; TE fused kernels")
MEGATRON_RUNTIME = Runtime(fused_elementwise=True, low_precision_params=True, tp_overlap=True, dp_overlap=True,
                           fused_projections=True, ring_attention="gather",
                           loss_parallel=True)


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
              tflops: float, mfu: float) -> PublishedRun:
    dp = gpus // (tp * pp)
    per_replica = batch // dp
    mbs, m, schedule = (per_replica, 1, "none") if pp == 1 else (1, per_replica, "1f1b")
    return PublishedRun(
        name=f"Megatron-Core {size} GPT, {gpus} H100, TP{tp} PP{pp} DP{dp}", source=MEGATRON_README,
        stated=(f"{size}: {heads} heads, hidden {hidden}, {layers} layers; TP {tp}, PP {pp}, DP {dp}, {gpus} GPUs; "
                f"batch {batch} sequences; {tflops} TFLOP/s per GPU, {mfu:.0%} MFU"),
        assumed=MEGATRON_ASSUMED, model=megatron_gpt(hidden, heads, layers), gpu=GPUS["h100"], gpus=gpus,
        tp=tp, pp=pp, dp=dp, data_parallel="replicate", micro_batch_size=mbs, microbatches=m, seq_len=4096,
        global_batch=batch, schedule=schedule, sequence_parallel=tp > 1, runtime=MEGATRON_RUNTIME,
        published_tflops=tflops, published_mfu=mfu)


def _torchtitan_fsdp(gpus: int, compile_: bool, tokens: float, table: str) -> PublishedRun:
    return PublishedRun(
        name=f"torchtitan Llama 3.1 8B, {gpus} H100, FSDP{gpus}{' + compile' if compile_ else ''}",
        source=f"{TORCHTITAN_2412}, {table}",
        stated=(f"{TORCHTITAN_HW}; 1D FSDP over {gpus} GPUs, local batch 2, global batch {2 * gpus}, selective "
                f"activation checkpointing, {'torch.compile, ' if compile_ else ''}bf16 (no Float8); "
                f"{tokens:,} TPS/GPU"),
        assumed=TORCHTITAN_ASSUMED, model="llama3-8b", gpu=H100_GRAND_TETON_500W, gpus=gpus, tp=1, pp=1, dp=gpus,
        data_parallel="fsdp", micro_batch_size=2, microbatches=1, seq_len=8192, global_batch=2 * gpus,
        recompute="selective",
        runtime=Runtime(fused_elementwise=compile_, low_precision_params=True, selective=TORCHTITAN_OP_SAC,
                        **TORCHTITAN_MODEL),
        published_tokens_per_gpu=tokens)


def _torchtitan_tp(size: str, gpus: int, local_batch: int, recompute: str, async_tp: bool,
                   tokens: float) -> PublishedRun:
    dp = gpus // 8
    ac = "full AC" if recompute == "full" else "per op SAC"
    return PublishedRun(
        name=f"torchtitan Llama 3 {size}, {gpus} H100, FSDP{dp} TP8{' async TP' if async_tp else ''}",
        source=TORCHTITAN_ASYNC_TP,
        stated=(f"{TORCHTITAN_HW}; Llama3 {size.lower()} on {gpus} H100s with FSDP={dp}, TP=8, torch.compile, {ac}, "
                f"local batch size {local_batch}; bfloat16 {'async' if async_tp else 'vanilla'} TP {tokens} "
                f"tokens/sec"),
        assumed=TORCHTITAN_ASSUMED, model=f"llama3-{size.lower()}", gpu=H100_GRAND_TETON_500W, gpus=gpus, tp=8,
        pp=1, dp=dp, data_parallel="fsdp", micro_batch_size=local_batch, microbatches=1, seq_len=8192,
        global_batch=local_batch * dp, recompute=recompute, sequence_parallel=True,
        runtime=Runtime(fused_elementwise=True, low_precision_params=True, tp_overlap=async_tp, loss_parallel=True,
                        selective=TORCHTITAN_OP_SAC, **TORCHTITAN_MODEL),
        published_tokens_per_gpu=tokens)


def _llama3_405b(gpus: int, dp: int, per_dp: int, tflops: float, mfu: float) -> PublishedRun:
    return PublishedRun(
        name=f"Llama 3 405B, {gpus:,} H100, TP8 PP16 DP{dp}", source=LLAMA3_PAPER,
        stated=(f"{LLAMA3_405B_STATED}; {gpus:,} GPUs, DP {dp}, batch size/DP {per_dp}; {tflops} TFLOPs/GPU, "
                f"{mfu:.0%} BF16 MFU"),
        assumed=LLAMA3_ASSUMED, model="llama3-405b", gpu=GPUS["h100"], gpus=gpus, tp=8, pp=16, dp=dp,
        data_parallel="fsdp", micro_batch_size=1, microbatches=per_dp, seq_len=8192, global_batch=dp * per_dp,
        schedule="interleaved_1f1b", virtual_stages=7, sequence_parallel=True, runtime=LLAMA3_RUNTIME,
        published_tflops=tflops, published_mfu=mfu)


RUNS: tuple[PublishedRun, ...] = (
    _llama3_405b(8192, 64, 32, 430, 0.43),
    _llama3_405b(16384, 128, 16, 400, 0.41),
    dataclasses.replace(
        _llama3_405b(16384, 8, 16, 380, 0.38), name="Llama 3 405B, 16,384 H100, TP8 CP16 PP16 DP8, seq 131,072",
        seq_len=131072, cp=16, recompute="full", runtime=dataclasses.replace(LLAMA3_RUNTIME, ring_attention="gather"),
        stated=(f"{LLAMA3_405B_STATED.split('; no activation')[0]}; TP8 CP16 PP16 DP8, seq 131,072, batch size/DP 16; "
                "380 TFLOPs/GPU, 38% BF16 MFU; context parallelism 'all-gather based': K and V all-gathered, then the "
                "attention of the local query chunk (sec. 3.3.2)"),
        assumed=(f"{LLAMA3_ASSUMED}; activation recompute at 128K tokens not stated: full (without it, or with the "
                 "selective policy, the layout needs 310 / 224 GB per GPU in the planner's memory model)")),
    _torchtitan_fsdp(8, False, 5762, "table 1 (FSDP)"),
    _torchtitan_fsdp(8, True, 6667, "table 1 (FSDP + torch.compile)"),
    _torchtitan_fsdp(128, False, 5605, "table 3 (FSDP)"),
    _torchtitan_fsdp(128, True, 6514, "table 3 (FSDP + torch.compile)"),
    _torchtitan_tp("70B", 256, 16, "full", False, 597.3),
    _torchtitan_tp("70B", 256, 16, "full", True, 652.4),
    _torchtitan_tp("8B", 64, 12, "selective", False, 4378),
    _torchtitan_tp("8B", 64, 12, "selective", True, 4809.4),
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 0.41),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 0.47),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 0.49),
    _megatron("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 0.46),
    _megatron("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 0.42),
)
"""Every row. Not used, with the reason: torchtitan's Float8 rows (the planner models bf16 matmuls) and its CP rows
(no context parallelism yet); Megatron-Core's 119B-462B rows (PP 4-16: the virtual pipeline size and micro-batch
size are not stated, and 1F1B without virtual stages would put their bubble at 19-22%, far from the 43-48% MFU
measured, so they ran interleaved with an unknown v)."""


TORCHTITAN_FLOAT8 = ("torchtitan's float8 is torchao's dynamic tensorwise recipe in 2024-12 (the only one then; FSDP2 "
                     "float8 all-gather and precomputed scales as its float8.md recommends), tensorwise or rowwise as "
                     "the 2025-06 table names it; the block linears are converted, the head is not (torchtitan's "
                     "filter_fqns default ['output'])")


def _float8(run: PublishedRun, recipe: str, tokens: float, table: str) -> PublishedRun:
    """``run``'s layout with float8 block linears (``recipe``), as another row of the same source states it."""
    return dataclasses.replace(
        run, name=f"{run.name} + float8 {recipe}", runtime=dataclasses.replace(run.runtime, float8=recipe),
        source=f"{run.source.split(', table')[0]}, {table}", assumed=f"{run.assumed}; {TORCHTITAN_FLOAT8}",
        stated=f"{run.stated.split('; bf16')[0].split('; bfloat16')[0]}; float8 {recipe}: {tokens} tokens/s per GPU",
        published_tokens_per_gpu=tokens, published_tflops=None, published_mfu=None)


TORCHTITAN_405B_ASSUMED = (
    f"{TORCHTITAN_ASSUMED}; micro-batch count not stated: torchtitan's default at 9dec370 is the pipeline degree "
    "(parallelisms/pipeline_llama.py: pipeline_parallel_microbatches or parallel_dims.pp), so 8 micro-batches of "
    "local batch / 8 sequences; interleaved 1F1B without split points = 2 stages per rank "
    "(pipelining_utils.generate_split_points), v=2; FSDP under the pipeline reshards after forward (torchtitan's "
    "default then)")


def _torchtitan_405b(schedule: str, cp: int, seq_len: int, local_batch: int, tokens: float, table: str) -> PublishedRun:
    """torchtitan's Llama 3.1 405B float8 rows (tables 5 and 6): 512 H100, TP8 PP8, FSDP 8 / cp, async TP, full AC."""
    dp = 8 // cp
    v = 2 if schedule == "interleaved_1f1b" else 1
    return PublishedRun(
        name=(f"torchtitan Llama 3.1 405B, 512 H100, FSDP{dp} TP8 PP8{f' CP{cp}' if cp > 1 else ''} "
              f"{'interleaved' if v > 1 else '1F1B'}, seq {seq_len} + float8 tensorwise"),
        source=f"{TORCHTITAN_2412}, {table}; train_configs/llama3_405b.toml at 9dec370 (float8 with FSDP float8 "
               "all-gather and precomputed scales)",
        stated=(f"{TORCHTITAN_HW}; Llama 3.1 405B, 512 GPUs, FSDP {dp}, TP 8, PP 8{f', CP {cp}' if cp > 1 else ''}, "
                f"torch.compile + Float8 + AsyncTP, {'interleaved 1F1B' if v > 1 else '1F1B'}, local batch "
                f"{local_batch}, seq {seq_len}, full activation checkpointing; {tokens} TPS/GPU"),
        assumed=f"{TORCHTITAN_405B_ASSUMED}; {TORCHTITAN_FLOAT8}", model="llama3-405b", gpu=H100_GRAND_TETON_500W,
        gpus=512, tp=8, pp=8, dp=dp, cp=cp, data_parallel="fsdp", micro_batch_size=local_batch // 8, microbatches=8,
        seq_len=seq_len, global_batch=local_batch * dp, schedule=schedule, virtual_stages=v, recompute="full",
        sequence_parallel=True,
        runtime=Runtime(fused_elementwise=True, low_precision_params=True, tp_overlap=True, loss_parallel=True,
                        float8="tensorwise", **TORCHTITAN_MODEL),
        published_tokens_per_gpu=tokens)


MEGATRON_BRIDGE = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, '25.11 NeMo Container', Pre-Training "
                   "Performance, System: {system}")
MEGATRON_BRIDGE_ASSUMED = (
    "FP8-CS = Transformer Engine's per-tensor current scaling, the planner's tensorwise (FP8-MX = MXFP8, 32-element "
    "blocks); Llama 3 shapes as the model names say; recompute not stated: none; FSDP 0 = Megatron's distributed "
    "optimizer (the planner's replication whose gradient reduce-scatter and parameter all-gather overlap), FSDP 1 = "
    "Megatron FSDP; micro-batches per step = GA (GBS / (MBS x DP)); TP with sequence parallel and overlapped TP "
    "communication, fused kernels and bf16 weights as in Megatron-Core's performance recipes; DGX H100 at 700 W, DGX "
    "B200 at 1,000 W, 400 Gb/s per GPU")


def _megatron_bridge(model: str, system: str, gpu: str, gpus: int, recipe: str, gbs: int, mbs: int, fsdp: bool,
                     tp: int, pp: int, cp: int, vp: int, tokens: float, tflops: float) -> PublishedRun:
    dp = gpus // (tp * pp * cp)
    microbatches = gbs // (mbs * dp)
    label = {"tensorwise": "FP8-CS", "mxfp8": "FP8-MX"}[recipe]
    return PublishedRun(
        name=(f"Megatron-Bridge {model}, {gpus} {gpu.upper()}, TP{tp} PP{pp}{f' VP{vp}' if vp > 1 else ''}"
              f"{f' CP{cp}' if cp > 1 else ''} {'FSDP' if fsdp else 'DP'}{dp}, {label}"),
        source=MEGATRON_BRIDGE.format(system=system),
        stated=(f"{model}, {gpus} GPUs, {label}, GBS {gbs}, MBS {mbs}, seq 8192, FSDP {int(fsdp)}, TP {tp}, PP {pp}, "
                f"CP {cp}, VP {vp if pp > 1 else 'n/a'}, GA {microbatches}; {tokens} tokens/s/GPU, {tflops} model "
                "TFLOP/s/GPU"),
        assumed=MEGATRON_BRIDGE_ASSUMED,
        model=model.lower().replace("llama3.1_", "llama3-").replace("llama3_", "llama3-"),
        gpu=GPUS[gpu], gpus=gpus, tp=tp, pp=pp, dp=dp, cp=cp, data_parallel="fsdp" if fsdp else "replicate",
        micro_batch_size=mbs, microbatches=microbatches, seq_len=8192, global_batch=gbs,
        schedule="none" if pp == 1 else ("interleaved_1f1b" if vp > 1 else "1f1b"), virtual_stages=vp if pp > 1 else 1,
        sequence_parallel=tp > 1,
        runtime=dataclasses.replace(MEGATRON_RUNTIME, dp_overlap=not fsdp, float8=recipe),
        published_tokens_per_gpu=tokens, float8_kernels="transformer-engine")


TORCHTITAN_FLOAT8_RUNS: tuple[PublishedRun, ...] = (
    _float8(_torchtitan_fsdp(8, True, 6667, ""), "tensorwise", 8532, "table 1 (FSDP + torch.compile + Float8)"),
    _float8(_torchtitan_fsdp(128, True, 6514, ""), "tensorwise", 8380, "table 3 (FSDP + torch.compile + Float8)"),
    dataclasses.replace(_float8(_torchtitan_tp("70B", 256, 16, "full", False, 597.3), "tensorwise", 829,
                                "table 4 (2D + torch.compile + Float8)"), source=f"{TORCHTITAN_2412}, table 4"),
    dataclasses.replace(_float8(_torchtitan_tp("70B", 256, 16, "full", True, 652.4), "tensorwise", 876,
                                "table 4 (2D + AsyncTP + torch.compile + Float8)"),
                        source=f"{TORCHTITAN_2412}, table 4"),
    _float8(_torchtitan_tp("70B", 256, 16, "full", False, 597.3), "tensorwise", 809.8, "float8 tensorwise, vanilla TP"),
    _float8(_torchtitan_tp("70B", 256, 16, "full", True, 652.4), "tensorwise", 942.4, "float8 tensorwise, async TP"),
    _float8(_torchtitan_tp("8B", 64, 12, "selective", False, 4378), "tensorwise", 5078.1,
            "float8 tensorwise, vanilla TP"),
    _float8(_torchtitan_tp("8B", 64, 12, "selective", True, 4809.4), "tensorwise", 5570.1,
            "float8 tensorwise, async TP"),
    _float8(_torchtitan_tp("70B", 256, 16, "full", False, 597.3), "rowwise", 599.6, "float8 rowwise, vanilla TP"),
    _float8(_torchtitan_tp("70B", 256, 16, "full", True, 652.4), "rowwise", 624.8, "float8 rowwise, async TP"),
    _float8(_torchtitan_tp("8B", 64, 12, "selective", False, 4378), "rowwise", 3708.5, "float8 rowwise, vanilla TP"),
    _float8(_torchtitan_tp("8B", 64, 12, "selective", True, 4809.4), "rowwise", 3914.9, "float8 rowwise, async TP"),
    _torchtitan_405b("1f1b", 1, 8192, 32, 100, "table 5 (3D + torch.compile + Float8 + AsyncTP), 1F1B"),
    _torchtitan_405b("interleaved_1f1b", 1, 8192, 32, 128, "table 5, Interleaved 1F1B"),
    _torchtitan_405b("1f1b", 1, 32768, 8, 76, "table 6 (4D + torch.compile + Float8 + AsyncTP + 1F1B), CP 1"),
    _torchtitan_405b("1f1b", 2, 65536, 8, 47, "table 6, CP 2"),
    _torchtitan_405b("1f1b", 4, 131072, 8, 31, "table 6, CP 4"),
    _torchtitan_405b("1f1b", 8, 262144, 8, 16, "table 6, CP 8"),
)
MEGATRON_BRIDGE_FLOAT8_RUNS: tuple[PublishedRun, ...] = (
    _megatron_bridge("LLAMA3_8B", "DGX-H100", "h100", 8, "tensorwise", 128, 1, True, 1, 1, 1, 1, 14451, 744),
    _megatron_bridge("LLAMA3_70B", "DGX-H100", "h100", 64, "tensorwise", 128, 1, False, 4, 8, 1, 5, 1602, 719),
    _megatron_bridge("LLAMA3.1_405B", "DGX-H100", "h100", 1024, "tensorwise", 512, 1, False, 8, 8, 2, 8, 292, 737),
    _megatron_bridge("LLAMA3_8B", "DGX-B200", "b200", 8, "tensorwise", 128, 2, False, 1, 1, 1, 1, 30624, 1576),
    _megatron_bridge("LLAMA3_8B", "DGX-B200", "b200", 8, "mxfp8", 128, 2, False, 1, 1, 1, 1, 29521, 1519),
    _megatron_bridge("LLAMA3.1_405B", "DGX-B200", "b200", 128, "tensorwise", 64, 1, False, 4, 8, 2, 8, 661, 1667),
    _megatron_bridge("LLAMA3.1_405B", "DGX-B200", "b200", 128, "mxfp8", 64, 1, False, 4, 8, 2, 8, 624, 1576),
)
FLOAT8_RUNS: tuple[PublishedRun, ...] = TORCHTITAN_FLOAT8_RUNS + MEGATRON_BRIDGE_FLOAT8_RUNS
"""Every published float8 row, 25: torchtitan's (H100, torchao; Llama 3 8B/70B float8 beside bf16 rows above, and
Llama 3.1 405B's tables 5 and 6) fit ``FLOAT8_GEMM_EFFICIENCY`` per recipe; Megatron-Bridge's 25.11 FP8-CS and FP8-MX
rows on DGX H100 and DGX B200 fit :data:`TRANSFORMER_ENGINE_FLOAT8_EFFICIENCY`. Rows with cp > 1 are predicted, not
fitted on (:func:`fit_float8`). torchtitan notes its vanilla-TP rowwise rows as slow (pytorch/torchtitan#1207).
Not used: Megatron-Bridge's DGX-GB200 and DGX-GB300 rows (``hardware.py`` lists the NVL72 GPUs' peaks but not their
memory and links, which the planner's time model needs); its H100 Qwen3/GPT-OSS rows (mixture of experts)."""

MXFP8_B200 = ("pytorch/torchtitan torchtitan/components/quantization/mxfp8.md 'Dense Models' (torchao "
              "0.13.0+gite4e681be, torch 2.9.0.dev20250815): 8 power-limited B200, batch 1, seq 8192, torch.compile, "
              "FSDP2, per-op SAC: bf16 8307.5 tokens/s, mxfp8_cublas 9969.0 (+20.0%), float8 tensorwise 10417.0 "
              "(+25.4%)")
MXFP8_SPEEDUP = 9969.0 / 8307.5
"""MXFP8's published speedup over bf16 on B200: the power limit is not stated, so ``mxfp8`` is fitted on the ratio of
predicted step times (model assumed Llama 3.1 8B, torchtitan's default), not on absolute throughput."""


def mxfp8_row() -> PublishedRun:
    base = _torchtitan_fsdp(8, True, 8307.5, "")
    return dataclasses.replace(base, name="torchtitan Llama 3.1 8B, 8 B200, FSDP8 + compile", gpu=GPUS["b200"],
                               micro_batch_size=1, global_batch=8, source=MXFP8_B200, published_tokens_per_gpu=8307.5)


TRANSFORMER_ENGINE_FLOAT8_EFFICIENCY = {"tensorwise": 0.629, "mxfp8": 0.597}
"""Transformer Engine's float8 GEMM efficiency per recipe (fraction of the fp8 peak, casts included), fitted on
Megatron-Bridge's rows (``fit_float8(recipe, kernels="transformer-engine")``). Used only to predict those rows: TE
fuses the amax and the cast into the neighbouring kernels, torchao's dynamic casts are separate (compiled) kernels, so
one constant for both leaves Megatron-Bridge's rows 15-23% slow and torchtitan's fast. The planner predicts our
runtime, torchao, with ``FLOAT8_GEMM_EFFICIENCY``."""


def float8_efficiency(run: PublishedRun, efficiency: Optional[dict] = None) -> Optional[float]:
    """The float8 GEMM efficiency ``run`` is predicted with: ``efficiency`` (by recipe) for torchao rows if given, else
    the planner's; Transformer Engine's for Megatron-Bridge's rows."""
    if run.float8_kernels == "transformer-engine":
        return TRANSFORMER_ENGINE_FLOAT8_EFFICIENCY[run.runtime.float8]
    return (efficiency or {}).get(run.runtime.float8)


def float8_table(runs: tuple[PublishedRun, ...] = FLOAT8_RUNS, efficiency: Optional[dict] = None) -> list[dict]:
    """:func:`table` of the float8 rows, each recipe at ``efficiency[recipe]`` (default: the planner's constants;
    Megatron-Bridge's rows at Transformer Engine's)."""
    rows = []
    for run in runs:
        model = TimeModel(float8_efficiency=float8_efficiency(run, efficiency))
        e = predict(run, time_model=model)
        tokens = e.tokens_per_second / run.gpus
        rows.append({"name": run.name, "pending": "",
                     "published_tflops": run.tokens_per_gpu * run.flops_per_token / 1e12, "published_mfu": run.mfu,
                     "published_tokens_per_gpu": run.tokens_per_gpu, "predicted_tokens_per_gpu": tokens,
                     "predicted_tflops": tokens * run.flops_per_token / 1e12,
                     "predicted_mfu": tokens * run.flops_per_token / H100_SXM_PEAK, "error": error(run, e)})
    return rows


def fit_float8(recipe: str, runs: tuple[PublishedRun, ...] = FLOAT8_RUNS, kernels: str = "torchao") -> float:
    """The float8 GEMM efficiency of ``recipe`` with ``kernels`` that minimizes the squared log errors of its rows
    without context parallelism (golden section); torchao's ``mxfp8``: the one whose predicted speedup over bf16 on
    B200 is the published one.

    Rows with cp > 1 are predicted, not fitted on: at 64k-256k tokens attention is 40-73% of their FLOPs and their
    error is the planner's ring-attention model's (torchtitan's CP rows come out 25-56% fast, growing with cp), which
    a float8 constant would only smear over the other rows."""
    if recipe == "mxfp8" and kernels == "torchao":
        base = mxfp8_row()
        bf16 = predict(base).time["step"]
        mx = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, float8="mxfp8"))

        def loss(eff: float) -> float:
            return math.log(bf16 / predict(mx, time_model=TimeModel(float8_efficiency=eff)).time["step"]
                            / MXFP8_SPEEDUP) ** 2
    else:
        chosen = tuple(r for r in runs if r.runtime.float8 == recipe and r.float8_kernels == kernels and r.cp == 1)

        def loss(eff: float) -> float:
            return sum(math.log1p(error(r, predict(r, time_model=TimeModel(float8_efficiency=eff)))) ** 2
                       for r in chosen)
    lo, hi = 0.05, 1.0
    golden = (math.sqrt(5) - 1) / 2
    while hi - lo > 1e-4:
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
    return (lo + hi) / 2


def predict(run: PublishedRun, hw_efficiency: Optional[float] = None,
            time_model: Optional[TimeModel] = None) -> Estimate:
    """The planner's estimate for the run's exact layout (constants overridable for fitting)."""
    hw = Hardware(run.gpu, run.gpus, 8)
    if hw_efficiency is not None:
        hw = dataclasses.replace(hw, compute_efficiency=hw_efficiency)
    problem = Problem(run.config, hw, run.seq_len, run.global_batch, run.precision, runtime=run.runtime,
                      time_model=time_model or TimeModel())
    layout = Layout(run.tp, run.pp, run.dp, run.data_parallel, run.micro_batch_size, run.microbatches, run.schedule,
                    run.virtual_stages, run.recompute, run.sequence_parallel, cp=run.cp)
    return estimate(problem, layout)


def error(run: PublishedRun, e: Estimate) -> float:
    """Relative error of the predicted throughput (= of MFU, of TFLOP/s): predicted / published - 1."""
    return e.tokens_per_second / run.gpus / run.tokens_per_gpu - 1


def table(runs: tuple[PublishedRun, ...] = RUNS, **constants) -> list[dict]:
    """One dict per row: published and predicted TFLOP/s, MFU, tokens/s per GPU and the error (None if pending)."""
    rows = []
    for run in runs:
        row = {"name": run.name, "pending": run.pending, "published_tflops": run.tokens_per_gpu
               * run.flops_per_token / 1e12 if not run.pending else run.published_tflops,
               "published_mfu": run.mfu if not run.pending else run.published_mfu,
               "published_tokens_per_gpu": run.tokens_per_gpu if not run.pending else None}
        if not run.pending:
            e = predict(run, **constants)
            tokens = e.tokens_per_second / run.gpus
            row.update(predicted_tokens_per_gpu=tokens, predicted_tflops=tokens * run.flops_per_token / 1e12,
                       predicted_mfu=tokens * run.flops_per_token / H100_SXM_PEAK, error=error(run, e),
                       time=e.time, fits=e.fits)
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """Median and largest absolute relative error over the rows that compute."""
    errors = [abs(r["error"]) for r in rows if r.get("error") is not None]
    return {"rows": len(errors), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}


# ----------------------------------------------------------------------------- fitting


FITTED = ("compute_efficiency", "gemm_knee", "tp_overlap_exposed")


def _loss(params: tuple[float, ...], runs: tuple[PublishedRun, ...]) -> float:
    eff, knee, exposed = params
    if not (0.3 < eff < 1.0 and 1 <= knee <= 4096 and 0.0 <= exposed <= 1.0):
        return math.inf
    model = TimeModel(gemm_knee=knee, tp_overlap_exposed=exposed)
    return sum(math.log1p(error(run, predict(run, eff, model))) ** 2 for run in runs)


def fit(runs: tuple[PublishedRun, ...], start: tuple[float, ...]) -> tuple[float, ...]:
    """Least squares on log(predicted/published) over ``runs`` by a deterministic pattern search (Hooke-Jeeves)."""
    x, best = list(start), _loss(tuple(start), runs)
    steps = [0.05, 64.0, 0.2]
    while max(s / abs(v or 1) for s, v in zip(steps, x)) > 1e-3:
        improved = False
        for i in range(len(x)):
            for sign in (1, -1):
                trial = list(x)
                trial[i] += sign * steps[i]
                value = _loss(tuple(trial), runs)
                if value < best:
                    x, best, improved = trial, value, True
                    break
        if not improved:
            steps = [s / 2 for s in steps]
    return tuple(x)


def leave_one_out(runs: tuple[PublishedRun, ...], start: tuple[float, ...]) -> list[tuple[str, float]]:
    """Each row's error with the constants fitted on the other rows."""
    out = []
    for i, run in enumerate(runs):
        eff, knee, exposed = fit(runs[:i] + runs[i + 1:], start)
        out.append((run.name, error(run, predict(run, eff, TimeModel(gemm_knee=knee, tp_overlap_exposed=exposed)))))
    return out


# ----------------------------------------------------------------------------- report


def format_table(rows: list[dict]) -> str:
    head = (f"{'run':<52} | {'TFLOP/s/GPU':>17} | {'MFU':>13} | {'tokens/s/GPU':>17} | {'error':>6}\n"
            f"{'':<52} | {'publ.':>8} {'pred.':>8} | {'publ.':>6} {'pred.':>6} | {'publ.':>8} {'pred.':>8} |")
    lines = [head, "-" * len(head.splitlines()[0])]
    for r in rows:
        if r["pending"]:
            lines.append(f"{r['name'][:52]:<52} | {r['published_tflops']:>8.1f} {'-':>8} | "
                         f"{r['published_mfu']:>6.1%} {'-':>6} | {'-':>8} {'-':>8} | pending")
            continue
        lines.append(f"{r['name'][:52]:<52} | {r['published_tflops']:>8.1f} {r['predicted_tflops']:>8.1f} | "
                     f"{r['published_mfu']:>6.1%} {r['predicted_mfu']:>6.1%} | {r['published_tokens_per_gpu']:>8.1f} "
                     f"{r['predicted_tokens_per_gpu']:>8.1f} | {r['error']:>+6.1%}")
    return "\n".join(lines)


def float8_leave_one_out() -> list[tuple[str, float]]:
    """Each float8 row's error with its recipe's efficiency fitted on the recipe's other rows (rows with cp > 1 and
    torchao's mxfp8, fitted on a published speedup, are not fitted on: their error is the table's); ``nan`` for a row
    that is its recipe's only fitted one."""
    out = []
    for i, run in enumerate(FLOAT8_RUNS):
        others = FLOAT8_RUNS[:i] + FLOAT8_RUNS[i + 1:]
        fitted_on = run.cp == 1 and not (run.runtime.float8 == "mxfp8" and run.float8_kernels == "torchao")
        peers = [r for r in others if r.cp == 1 and r.runtime.float8 == run.runtime.float8
                 and r.float8_kernels == run.float8_kernels]
        if fitted_on and not peers:
            out.append((run.name, math.nan))
            continue
        efficiency = fit_float8(run.runtime.float8, others, run.float8_kernels) if fitted_on else float8_efficiency(run)
        out.append((run.name, error(run, predict(run, time_model=TimeModel(float8_efficiency=efficiency)))))
    return out


def _print_float8(refit: bool, loo: bool) -> list[dict]:
    """The float8 table (and the refitted efficiencies, the leave-one-out errors); returns its rows."""
    f8 = float8_table()
    print("\nfloat8 rows (block GEMMs at the fp8 peak x FLOAT8_GEMM_EFFICIENCY; MFU against the bf16 peak):")
    print(format_table(f8))
    s8 = summary(f8)
    print(f"{s8['rows']} float8 rows: median |error| {s8['median_abs_error']:.1%}, largest {s8['max_abs_error']:.1%}")
    if refit:
        torchao = ", ".join(f"{r}={fit_float8(r):.3f}" for r in ("tensorwise", "rowwise", "mxfp8"))
        te = ", ".join(f"{r}={fit_float8(r, kernels='transformer-engine'):.3f}"
                       for r in TRANSFORMER_ENGINE_FLOAT8_EFFICIENCY)
        print(f"float8 efficiency fitted per recipe: {torchao}; Transformer Engine: {te}")
    if loo:
        print("\nfloat8 leave-one-out (the row's recipe efficiency fitted on its other rows, this row predicted):")
        errors = float8_leave_one_out()
        for name, err in errors:
            print(f"  {name[:80]:<80} {err:>+7.1%}")
        values = [abs(e) for _, e in errors if not math.isnan(e)]
        print(f"  median |error| {statistics.median(values):.1%}, largest {max(values):.1%} (nan: the recipe's only "
              "fitted row)")
    return f8


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the constants on all rows and print them")
    parser.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits")
    parser.add_argument("--sources", action="store_true", help="print each row's source, stated and assumed settings")
    args = parser.parse_args(argv)
    rows = table()
    print(format_table(rows))
    s = summary(rows)
    print(f"\n{s['rows']} rows: median |error| {s['median_abs_error']:.1%}, largest {s['max_abs_error']:.1%} "
          f"(thresholds 10% and 20%)")
    for r in rows:
        if r["pending"]:
            print(f"pending: {r['name']}: {r['pending']}")
    computed = tuple(run for run in RUNS if not run.pending)
    defaults = (Hardware(GPUS["h100"], 8, 8).compute_efficiency, TimeModel().gemm_knee,
                TimeModel().tp_overlap_exposed)
    if args.fit:
        fitted = fit(computed, defaults)
        print("\nfitted on all rows: " + ", ".join(f"{n}={v:.4g}" for n, v in zip(FITTED, fitted)))
    if not args.no_loo:
        print("\nleave-one-out (constants fitted on the other rows, this row predicted):")
        loo = leave_one_out(computed, defaults)
        for name, err in loo:
            print(f"  {name[:60]:<60} {err:>+7.1%}")
        errors = [abs(e) for _, e in loo]
        print(f"  median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%}")
    f8 = _print_float8(args.fit, not args.no_loo)
    every = summary([r for r in rows if r.get("error") is not None] + f8)
    print(f"\nall {every['rows']} rows (bf16, float8, context parallel): median |error| "
          f"{every['median_abs_error']:.1%}, largest {every['max_abs_error']:.1%}")
    if args.sources:
        for run in RUNS + FLOAT8_RUNS:
            print(f"\n{run.name}\n  source: {run.source}\n  stated: {run.stated}\n  assumed: {run.assumed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
