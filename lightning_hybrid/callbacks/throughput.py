"""Throughput, model FLOP/s, MFU and memory per device, per step and over a window.

Model FLOPs per trained token (:func:`flops_per_token`) follow the convention of PaLM (appendix B)
and Megatron-LM, so MFU compares with published numbers: ``6 * N`` for the matmul weights (2 FLOPs
per weight and token forward, 4 backward) plus ``12 * L * h * T`` for attention scores and values.
Recomputed activations are not counted (that would be hardware FLOPs, not model FLOPs).

Peak FLOP/s per device come from :data:`lightning_hybrid.hardware.GPUS` (dense, non-sparse datasheet
numbers), chosen from ``torch.cuda.get_device_name()``; other GPUs fall back to Lightning's table; on CPU
the peak is the best rate of a few fp32 matmuls measured once per process.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import deque
from typing import Any, Callable, Iterable, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_hybrid.callbacks.stragglers import StragglerDetector
from lightning_hybrid.device_speed import matmul_flops
from lightning_hybrid.hardware import gpu_from_device_name, normalize_dtype
from lightning_hybrid.models.qwen2.config import flops_per_token

__all__ = ["ThroughputMonitor", "flops_per_token", "peak_flops", "measure_cpu_peak_flops", "training_state_bytes"]

GIB = 1024 ** 3


def peak_flops(device_name: str, dtype: str) -> Optional[float]:
    """Dense peak FLOP/s of one GPU for a compute dtype, or ``None`` when the GPU or dtype is not listed.

    The figures are :data:`lightning_hybrid.hardware.GPUS`'s.

    Raises:
        ValueError: the dtype is not known.
    """
    gpu = gpu_from_device_name(device_name)
    return gpu.peak.get(dtype) if gpu is not None else None


@functools.lru_cache(maxsize=None)
def _cpu_peak(size: int, repeats: int, threads: int) -> float:
    return matmul_flops(size, repeats, best=True)  # cached per thread count: the threads set the speed


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of ``size x size`` matmuls with the current thread count; measured once, then cached."""
    return _cpu_peak(size, repeats, torch.get_num_threads())


def compute_dtype(trainer: "pl.Trainer", device: torch.device) -> str:
    """The compute dtype of the Trainer's precision; fp32 on a GPU counts as tf32 when TF32 matmuls are on."""
    try:
        dtype = normalize_dtype(str(trainer.precision))
    except ValueError:
        dtype = "fp32"
    if dtype == "fp32" and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    return dtype


def device_peak_flops(device: torch.device, dtype: str) -> tuple[Optional[float], str]:
    """(peak FLOP/s, where it came from) for a device: the table, Lightning's table, or a CPU measurement."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, dtype)
        if peak is not None:
            return peak, f"{name} {dtype} dense"
        torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                       "fp16": torch.float16, "fp8": torch.int8}[dtype]
        fallback = get_available_flops(device, torch_dtype)
        return (float(fallback), f"{name} {dtype} (Lightning's table)") if fallback else (None, f"{name} unknown")
    if device.type == "cpu":
        return measure_cpu_peak_flops(), f"CPU fp32 matmul measured with {torch.get_num_threads()} threads"
    return None, f"{device.type} unknown"


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def training_state_bytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer states (DTensors: the local shard).

    Tied parameters and shared state tensors are counted once. Works on the meta device.
    """
    params = grads = states = 0
    for param in module.parameters():  # deduplicated
        local = _local(param)
        params += local.numel() * local.element_size()
        if param.grad is not None:
            grad = _local(param.grad)
            grads += grad.numel() * grad.element_size()
    seen: set[int] = set()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    local = _local(value)
                    states += local.numel() * local.element_size()
    return {"params": params, "grads": grads, "optimizer": states}


def _max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` over all ranks (one scalar all-reduce); ``value`` itself without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (0 where the platform does not report it)."""
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _count_tokens(batch: Any) -> tuple[int, int]:
    """(tokens, sequence length) of a batch's ``input_ids``: a dict key, the first tuple item, or a tensor."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(ids, Tensor):
        raise ValueError(f"cannot count tokens of a {type(batch).__name__} batch; "
                         f"pass batch_tokens= to ThroughputMonitor")
    return ids.numel(), ids.shape[-1] if ids.dim() else 1


def parallel_dims(strategy: Any) -> Optional[Any]:
    """The strategy's resolved ``ParallelDims`` (``tp``, ``pp``, ``dp``), ``None`` for other strategies."""
    try:
        return strategy.dims
    except (AttributeError, RuntimeError):  # not a hybrid strategy, or sizes not resolved yet
        return None


def data_parallel_size(strategy: Any) -> int:
    """Ranks that see different data: ``dims.dp`` of a hybrid strategy, else the sampler's replicas, else the world."""
    dims = parallel_dims(strategy)
    if dims is not None:
        return int(dims.dp)
    try:
        return int(strategy.distributed_sampler_kwargs["num_replicas"])
    except (AttributeError, KeyError, TypeError):
        return int(getattr(strategy, "world_size", 1))


def context_parallel_size(strategy: Any) -> int:
    """Ranks that share each sequence (``dims.cp`` of a hybrid strategy, else 1): a batch seen by a callback holds
    ``1 / cp`` of every sequence's tokens."""
    dims = parallel_dims(strategy)
    return int(getattr(dims, "cp", 1)) if dims is not None else 1


class ThroughputMonitor(pl.Callback):
    """Logs tokens/s, model TFLOP/s and MFU per device, step time, data wait and memory; finds stragglers.

    A step is an optimizer step (micro-batches of gradient accumulation are summed). Per step it
    logs ``throughput/{tokens_per_sec, tokens_per_sec_per_device, tflops_per_device, mfu, step_time,
    data_wait}``, the same with ``_avg`` over the last ``window`` steps (through Lightning's
    :class:`~lightning.fabric.utilities.throughput.Throughput`, once the window is full) and
    ``memory/{peak_allocated_gib (CUDA), peak_rss_gib, params_gib, grads_gib, optimizer_gib}`` (rank 0's
    device; local shards; gradients counted at the optimizer step, since a pipeline drops them right after
    it) and ``memory/peak_max_gib`` (the peak of the fullest device, one scalar all-reduce), to every
    logger of the Trainer from rank 0; ``tok/s`` and ``mfu`` go to the progress bar. Tokens per step
    are the global batch: ``input_ids.numel()`` times the data-parallel size (tensor and pipeline peers
    see the same tokens; under context parallelism a rank holds 1/cp of each sequence, so its count is
    multiplied by cp and the FLOPs per token are those of the whole sequence length). Step time runs from the
    train-batch-start hook to the batch-end hook (CUDA synchronized); data wait from the previous batch end to
    the next batch start, with validation left out. Downstream evaluation inside training
    (:class:`~lightning_hybrid.eval.DownstreamEval` reports its runs to :meth:`record_evaluation`) is left out of
    both and logged as ``throughput/eval_time``. At the end of training rank 0 prints one summary line with tokens/s.

    Straggler detection adds the only collectives: one ``all_gather_object`` of host names when
    training starts and one small ``all_gather`` every ``straggler_every_n_steps`` steps, on every rank
    at the same steps (see :mod:`lightning_hybrid.callbacks.stragglers`).

    Args:
        window: steps of the rolling averages.
        log_every_n_steps: log every this many optimizer steps.
        peak_tflops: peak TFLOP/s of one device for MFU; ``None`` looks it up (or measures on CPU).
        dtype: compute dtype for the peak lookup (``"bf16"``, ``"fp8"``, ...); ``None`` reads the Trainer's precision.
        straggler_every_n_steps: gather step timings every this many steps; 0 disables.
        straggler_threshold: a rank this fraction slower than the median is reported.
        model_flops_per_token: ``seq_len -> FLOPs per token``; ``None``: the module's own ``flops_per_token(seq_len)``
            when it has one, else the count of its Qwen2-shaped ``config``.
        batch_tokens: ``batch -> (tokens, seq_len)`` on this rank, for batches without ``input_ids``.
        synchronize: synchronize CUDA at the step boundaries so step times include the GPU work.

    Raises:
        ValueError: a window under 2, a non-positive period or peak, an unknown dtype or a bad straggler setting.
    """

    def __init__(self, window: int = 20, log_every_n_steps: int = 1, peak_tflops: Optional[float] = None,
                 dtype: Optional[str] = None, straggler_every_n_steps: int = 50, straggler_threshold: float = 0.2,
                 model_flops_per_token: Optional[Callable[[int], float]] = None,
                 batch_tokens: Optional[Callable[[Any], tuple[int, int]]] = None, synchronize: bool = True) -> None:
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window={window!r} must be an integer >= 2 (steps of the rolling average)")
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be a positive integer")
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"peak_tflops={peak_tflops!r} must be positive (TFLOP/s of one device) or None")
        self.window, self.log_every_n_steps = window, log_every_n_steps
        self.peak_tflops = peak_tflops
        self.dtype = normalize_dtype(dtype) if dtype is not None else None
        self.model_flops_per_token = model_flops_per_token
        self.batch_tokens = batch_tokens or _count_tokens
        self.synchronize = synchronize
        self.stragglers = StragglerDetector(straggler_every_n_steps, straggler_threshold)
        self.last_metrics: dict[str, float] = {}
        self.summary = ""
        self._sync = False
        self._grad_bytes: Optional[int] = None
        self._evaluations: list[tuple[float, float]] = []  # (start, end) of evaluations not yet accounted

    # ------------------------------------------------------------------ setup

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        device = pl_module.device
        self._sync = self.synchronize and device.type == "cuda"
        self._world = max(1, int(trainer.world_size))
        self._dp = data_parallel_size(trainer.strategy)
        self._cp = context_parallel_size(trainer.strategy)
        if self.peak_tflops is not None:
            self._peak, self._peak_source = self.peak_tflops * 1e12, "peak_tflops="
        else:
            self._peak, self._peak_source = device_peak_flops(device, self.dtype or compute_dtype(trainer, device))
        self._flops_fn = self.model_flops_per_token
        config = getattr(pl_module, "config", None)
        # the module's own count (CausalLM's, a user's decoder's): a method its class defines
        if self._flops_fn is None and callable(getattr(type(pl_module), "flops_per_token", None)):
            self._flops_fn = pl_module.flops_per_token
        elif self._flops_fn is None and config is not None and hasattr(config, "intermediate_size"):
            self._flops_fn = functools.partial(flops_per_token, config)
        if self._flops_fn is None:
            rank_zero_info("ThroughputMonitor: the module has no flops_per_token() nor a Qwen2-shaped `config`; "
                           "logging tokens/s without FLOP/s and MFU (pass model_flops_per_token= to add them)")
        self._throughput = Throughput(available_flops=self._peak, world_size=1, window_size=self.window + 1)
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.window)  # (step time, data wait)
        self._clock = 0.0  # training wall time: steps and data waits, no validation
        self._steps = self._samples = self._tokens = 0
        self._first: Optional[tuple[float, int, float]] = None  # clock, tokens, device flops after step 1
        self._device_flops = 0.0
        self._pending: Optional[dict[str, float]] = None
        self._batch_start = self._last_end = time.perf_counter()
        if self._sync:
            torch.cuda.reset_peak_memory_stats(device)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.stragglers.start(parallel_dims(trainer.strategy))
        self._last_global_step = trainer.global_step  # after a checkpoint restore, unlike on_fit_start
        self._pending = None
        self._last_end = time.perf_counter()

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def record_evaluation(self, start: float, end: float) -> None:
        """``[start, end]`` (``time.perf_counter()``) was spent evaluating inside training: evaluation time, not
        training time (left out of the step time or data wait it falls in)."""
        self._evaluations.append((start, end))

    def _evaluation_time(self, begin: float, end: float) -> float:
        """Seconds of the recorded evaluations inside ``[begin, end]``; those ending before ``end`` are done with."""
        inside = sum(max(0.0, min(stop, end) - max(start, begin)) for start, stop in self._evaluations)
        self._evaluations = [(start, stop) for start, stop in self._evaluations if stop > end]
        return inside

    # ------------------------------------------------------------------ timing

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._last_end = self._now()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._last_end = self._now()  # validation inside fit is not data wait

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        now = self._now()
        tokens, seq_len = self.batch_tokens(batch)
        # under context parallelism this rank's batch holds 1/cp of each sequence: count whole sequences
        tokens, seq_len = tokens * self._cp, seq_len * self._cp
        if self._pending is None:
            self._pending = {"start": now, "step_time": 0.0, "data_wait": 0.0, "eval_time": 0.0, "tokens": 0,
                             "samples": 0, "flops": 0.0}
        p = self._pending
        evaluating = self._evaluation_time(self._last_end, now)
        p["data_wait"] += now - self._last_end - evaluating
        p["eval_time"] += evaluating
        p["tokens"] += tokens * self._dp
        p["samples"] += max(1, tokens // max(seq_len, 1)) * self._dp
        if self._flops_fn is not None:
            p["flops"] += self._flops_fn(seq_len) * tokens * self._dp / self._world
        self._batch_start = now

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        # Gradients are counted where they all exist: a pipeline drops them right after the optimizer step.
        # Only for a step that will be logged (the global step counts up after this hook).
        if (trainer.global_step + 1) % self.log_every_n_steps == 0:
            self._grad_bytes = training_state_bytes(pl_module)["grads"]

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = self._now()
        self._last_end = now
        if self._pending is None:
            return
        evaluating = self._evaluation_time(self._batch_start, now)
        self._pending["step_time"] += now - self._batch_start - evaluating
        self._pending["eval_time"] += evaluating
        if trainer.global_step == self._last_global_step:
            return  # a gradient-accumulation micro-batch: the optimizer step is not done yet
        self._last_global_step = trainer.global_step
        step, self._pending = self._pending, None
        self._finish_step(trainer, pl_module, step)

    def _finish_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", p: dict[str, float]) -> None:
        interval = p["step_time"] + p["data_wait"]
        self._clock += interval
        self._steps += 1
        self._samples += int(p["samples"])
        self._tokens += int(p["tokens"])
        self._device_flops += p["flops"]
        self._recent.append((p["step_time"], p["data_wait"]))
        self._throughput.update(time=self._clock, batches=self._steps, samples=self._samples, lengths=self._tokens,
                                flops=p["flops"] if self._flops_fn is not None else None)
        if self._steps == 1:
            self._first = (self._clock, self._tokens, self._device_flops)
        step = trainer.global_step
        self.stragglers.record(p["start"], interval, p["step_time"], p["data_wait"])
        if self.stragglers.due(step):
            self._report_stragglers(trainer, step, self.stragglers.gather(step, pl_module.device))
        if step % self.log_every_n_steps == 0:
            self._log(trainer, pl_module, p, interval)

    # ------------------------------------------------------------------ metrics

    def _rates(self, tokens: float, device_flops: float, seconds: float) -> dict[str, float]:
        rates = {"tokens_per_sec": tokens / seconds, "tokens_per_sec_per_device": tokens / seconds / self._world}
        if self._flops_fn is not None:
            rates["tflops_per_device"] = device_flops / seconds / 1e12
            if self._peak:
                rates["mfu"] = device_flops / seconds / self._peak
        return rates

    def _log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", p: dict[str, float],
             interval: float) -> None:
        metrics = {f"throughput/{k}": v for k, v in self._rates(p["tokens"], p["flops"], interval).items()}
        metrics["throughput/step_time"] = p["step_time"]
        metrics["throughput/data_wait"] = p["data_wait"]
        metrics["throughput/eval_time"] = p.get("eval_time", 0.0)
        window = self._throughput.compute()
        if "device/items_per_sec" in window:
            tokens_per_sec = window["device/items_per_sec"]  # world_size=1 in Throughput: these are global tokens
            metrics["throughput/tokens_per_sec_avg"] = tokens_per_sec
            metrics["throughput/tokens_per_sec_per_device_avg"] = tokens_per_sec / self._world
            metrics["throughput/step_time_avg"] = sum(s for s, _ in self._recent) / len(self._recent)
            metrics["throughput/data_wait_avg"] = sum(w for _, w in self._recent) / len(self._recent)
        if "device/flops_per_sec" in window:
            metrics["throughput/tflops_per_device_avg"] = window["device/flops_per_sec"] / 1e12
        if "device/mfu" in window:
            metrics["throughput/mfu_avg"] = window["device/mfu"]
        metrics.update(self._memory(trainer, pl_module))
        self.last_metrics = metrics
        bar_tokens = metrics.get("throughput/tokens_per_sec_avg", metrics["throughput/tokens_per_sec"])
        pl_module.log("tok/s", bar_tokens, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        mfu = metrics.get("throughput/mfu_avg", metrics.get("throughput/mfu"))
        if mfu is not None:
            pl_module.log("mfu", mfu, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _memory(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, float]:
        state = training_state_bytes(pl_module, trainer.optimizers)
        if self._grad_bytes is not None:
            state["grads"] = self._grad_bytes  # at the optimizer step
        memory = {f"memory/{k}_gib": v / GIB for k, v in state.items()}
        memory["memory/peak_rss_gib"] = peak_rss_bytes() / GIB
        if pl_module.device.type == "cuda":
            memory["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / GIB
        # The fullest device decides whether a layout fits (under a pipeline it need not be rank 0's).
        peak = memory.get("memory/peak_allocated_gib", memory["memory/peak_rss_gib"])
        memory["memory/peak_max_gib"] = _max_over_ranks(peak, pl_module.device)
        return memory

    def _report_stragglers(self, trainer: "pl.Trainer", step: int, found: list) -> None:
        if found:
            rank_zero_warn(f"stragglers at step {step}: " + "; ".join(s.describe() for s in found))
        if trainer.is_global_zero:
            worst = max((s.slowdown for s in found), default=0.0)
            for logger in trainer.loggers:
                logger.log_metrics({"stragglers/count": float(len(found)), "stragglers/max_slowdown": worst},
                                   step=step)

    def summary_metrics(self) -> dict[str, float]:
        """Rates over the last window, or over all steps after the first (warm-up) when fewer were run."""
        if self._steps == 0:
            return {}
        window = self._throughput.compute()
        if "device/items_per_sec" in window:
            tokens, flops, seconds = window["device/items_per_sec"], window.get("device/flops_per_sec", 0.0), 1.0
        elif self._steps > 1 and self._first is not None:
            clock, first_tokens, first_flops = self._first
            tokens, flops, seconds = self._tokens - first_tokens, self._device_flops - first_flops, self._clock - clock
        else:
            tokens, flops, seconds = self._tokens, self._device_flops, self._clock
        result = self._rates(tokens, flops, seconds)
        result["step_time"] = sum(s for s, _ in self._recent) / len(self._recent)
        result["data_wait"] = sum(w for _, w in self._recent) / len(self._recent)
        return result

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        m = self.summary_metrics()
        if not m:
            return
        parts = [f"throughput: {m['tokens_per_sec']:,.0f} tokens/s (global)",
                 f"{m['tokens_per_sec_per_device']:,.0f} tokens/s/device"]
        if "tflops_per_device" in m:
            parts.append(f"{m['tflops_per_device']:.3g} TFLOP/s/device")
        if "mfu" in m:
            parts.append(f"MFU {m['mfu']:.1%} of {self._peak / 1e12:.3g} TFLOP/s ({self._peak_source})")
        parts.append(f"step {m['step_time']:.3g} s, data wait {m['data_wait']:.3g} s")
        memory = self._memory(trainer, pl_module)
        parts.append(f"peak memory {memory['memory/peak_max_gib']:.2f} GiB/device (fullest rank)")
        self.summary = ", ".join(parts)
        if trainer.is_global_zero:
            print(self.summary, flush=True)
