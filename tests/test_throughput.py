"""ThroughputMonitor: the FLOPs formula, the peak table, straggler logic, and what a real run logs.

Run as a script (by ``helpers.launch.launch``, from ``test_stragglers_are_found_by_rank_host_and_coordinates_with_tp2``)
it is the worker of the two-process test.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_hybrid.callbacks import ThroughputMonitor, find_stragglers, flops_per_token, peak_flops
from lightning_hybrid.callbacks.stragglers import Straggler, StragglerDetector, own_step_times
from lightning_hybrid.callbacks.throughput import measure_cpu_peak_flops, training_state_bytes
from lightning_hybrid.models import CausalLM, Qwen2, Qwen2Config

TRAINER_KWARGS = dict(accelerator="cpu", enable_checkpointing=False, enable_model_summary=False,
                      enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0)


# ---------------------------------------------------------------------- FLOPs per token

def test_flops_per_token_matches_a_hand_count_for_tiny():
    # tiny: h=64, 4 query heads of 16 (hq=64), 2 kv heads (hkv=32), SwiGLU width 176, 4 layers, vocab 256
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 176  # q, k, v, o, gate/up/down = 46_080
    matmuls = 6 * 4 * per_layer                                     # 1_105_920
    head = 6 * 64 * 256                                             # 98_304
    attention = 12 * 4 * 64 * 32                                    # 98_304 at seq_len 32
    assert matmuls + head + attention == 1_302_528
    assert flops_per_token(Qwen2Config.from_preset("tiny"), 32) == 1_302_528
    assert flops_per_token(Qwen2Config.from_preset("tiny"), 32, include_head=False) == 1_302_528 - head


def test_flops_per_token_matches_6n_plus_attention_for_qwen25_72b():
    c = Qwen2Config.from_preset("qwen2.5-72b")
    n = c.num_parameters(include_embedding=False)  # blocks + final norm, with biases and norms
    expected = 6 * (n + c.hidden_size * c.vocab_size) + 12 * c.num_hidden_layers * c.hidden_size * 4096
    # the formula leaves out biases and norms: 26_624 of 0.89B weights per layer
    assert abs(flops_per_token(c, 4096) - expected) / expected < 1e-4
    assert flops_per_token(c, 4096) < expected


def test_flops_per_token_equals_torch_flop_counter_on_the_meta_device():
    from lightning.fabric.utilities.throughput import measure_flops

    config = Qwen2Config.from_preset("tiny")
    with torch.device("meta"):
        model = Qwen2(config)
        ids = torch.randint(0, config.vocab_size, (2, 32))
    counted = measure_flops(model, lambda: model(ids), lambda logits: logits.float().sum())
    assert counted / ids.numel() == flops_per_token(config, 32)


def test_flops_per_token_rejects_a_bad_sequence_length():
    with pytest.raises(ValueError, match=r"seq_len=0 must be a positive integer"):
        flops_per_token(Qwen2Config.from_preset("tiny"), 0)


# ---------------------------------------------------------------------- peak FLOP/s

@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "bf16", 835.5e12),
    ("NVIDIA H200", "bf16", 989.4e12),
    ("NVIDIA H200 NVL", "bf16", 835.5e12),
    ("NVIDIA B200", "bf16", 2.25e15),
    ("NVIDIA B300 SXM6 AC", "bf16-true", 2.25e15),
    ("NVIDIA B300 SXM6 AC", "fp8", 4.5e15),
    ("NVIDIA GB200", "bf16", 2.5e15),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12),
])
def test_peak_flops_is_the_dense_datasheet_number_for_the_device_name(name, dtype, peak):
    assert peak_flops(name, dtype) == peak


def test_peak_flops_is_none_for_an_unlisted_gpu_or_dtype_and_refuses_an_unknown_dtype():
    assert peak_flops("Tesla T4", "bf16") is None
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp8") is None  # Ampere has no fp8
    with pytest.raises(ValueError, match=r"dtype='int4' is not known; use one of fp32, tf32, bf16, fp16, fp8"):
        peak_flops("NVIDIA H100", "int4")


def test_cpu_peak_is_measured_once_and_cached():
    first = measure_cpu_peak_flops()
    assert first > 1e8
    assert measure_cpu_peak_flops() == first


def test_training_state_bytes_counts_tied_weights_once_on_the_meta_device():
    config = Qwen2Config(**{**Qwen2Config.from_preset("tiny").to_dict(), "tie_word_embeddings": True})
    with torch.device("meta"):
        model = Qwen2(config)
    assert training_state_bytes(model)["params"] == 4 * config.num_parameters()
    assert training_state_bytes(model)["grads"] == 0


# ---------------------------------------------------------------------- stragglers

def test_find_stragglers_reports_ranks_slower_than_the_median_by_more_than_the_threshold():
    assert find_stragglers([1.0, 1.0, 1.3, 1.0], 0.2) == [2]
    assert find_stragglers([1.0, 1.1, 1.0, 1.15], 0.2) == []
    assert find_stragglers([1.0, 2.0, 1.0, 1.0, 5.0], 0.5) == [1, 4]
    assert find_stragglers([0.1, 0.5], 0.2) == [1]  # two ranks: the faster one is the reference
    assert find_stragglers([], 0.2) == []


def test_find_stragglers_refuses_a_non_positive_threshold():
    with pytest.raises(ValueError, match=r"threshold=0 must be a positive fraction"):
        find_stragglers([1.0], 0)


def test_a_rank_that_arrives_late_is_the_straggler_not_the_ranks_that_wait_for_it():
    # Rank 2 loads its batch 0.3 s late every step; the others wait for it inside the step's collectives,
    # so their measured step times are the long ones and raw step times point at the wrong ranks.
    intervals = [0.5, 0.5, 0.5, 0.5]
    arrivals = [1.00, 1.01, 1.30, 1.00]
    raw_step_times = [0.5, 0.49, 0.2, 0.5]
    assert 2 not in find_stragglers(raw_step_times, 0.2)
    own = own_step_times(intervals, arrivals)
    assert own == pytest.approx([0.2, 0.21, 0.5, 0.2])
    assert find_stragglers(own, 0.2) == [2]


def test_own_step_times_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="need one interval and one arrival per rank; got 2 intervals and 1"):
        own_step_times([1.0, 1.0], [0.0])


def test_a_straggler_is_described_by_rank_host_and_mesh_coordinates():
    s = Straggler(rank=5, host="node03", coordinates={"pp": 1, "dp": 0, "tp": 1}, own_time=0.6, median_time=0.4)
    text = s.describe()
    assert text.startswith("rank 5 (host node03, pp=1 dp=0 tp=1) 0.600 s/step, 50% slower than the median 0.400 s")


def test_straggler_detection_is_off_without_a_process_group_and_refuses_bad_settings():
    assert not StragglerDetector(every_n_steps=1).enabled()
    with pytest.raises(ValueError, match=r"straggler_every_n_steps=-1 must be an integer >= 0"):
        StragglerDetector(every_n_steps=-1)
    with pytest.raises(ValueError, match=r"straggler_threshold=0.0 must be a positive fraction"):
        ThroughputMonitor(straggler_threshold=0.0)
    with pytest.raises(ValueError, match=r"window=1 must be an integer >= 2"):
        ThroughputMonitor(window=1)


# ---------------------------------------------------------------------- a real run

def test_throughput_metrics_reach_tensorboard_and_a_summary_line_is_printed(tmp_path, capsys):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_hybrid.data.byte_text import ByteTextDataModule

    L.seed_everything(0)
    monitor = ThroughputMonitor(window=4)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(max_steps=10, logger=logger, callbacks=[monitor], **TRAINER_KWARGS)
    trainer.fit(CausalLM("tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4, max_bytes=100_000))

    events = EventAccumulator(logger.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("throughput/tokens_per_sec", "throughput/tokens_per_sec_per_device", "throughput/tflops_per_device",
                "throughput/mfu", "throughput/step_time", "throughput/data_wait", "throughput/tokens_per_sec_avg",
                "throughput/mfu_avg", "throughput/tflops_per_device_avg", "memory/params_gib", "memory/grads_gib",
                "memory/optimizer_gib", "memory/peak_rss_gib", "memory/peak_max_gib"):
        assert tag in tags, (tag, sorted(tags))
        values = [e.value for e in events.Scalars(tag)]
        assert values and all(v > 0 for v in values), (tag, values)
    assert len(events.Scalars("throughput/tokens_per_sec")) == 10
    assert len(events.Scalars("throughput/mfu_avg")) == 10 - 4  # from the step that fills the window
    # global tokens per step: 4 sequences of 32, one data-parallel rank
    m = monitor.last_metrics
    seconds = m["throughput/step_time"] + m["throughput/data_wait"]
    assert m["throughput/tokens_per_sec"] * seconds == pytest.approx(128)
    assert m["memory/optimizer_gib"] > 2 * m["memory/params_gib"]  # Adam: two moments plus step counters
    assert {"tok/s", "mfu"} <= set(trainer.progress_bar_metrics)

    lines = [line for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("throughput: ") and "MFU" in lines[0] and "TFLOP/s/device" in lines[0]


def test_a_step_is_an_optimizer_step_under_gradient_accumulation():
    from torch.utils.data import DataLoader, TensorDataset

    ids = torch.randint(0, 256, (16, 16))
    loader = DataLoader(TensorDataset(ids, ids), batch_size=2)
    monitor = ThroughputMonitor(window=2, peak_tflops=1.0)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, logger=False, callbacks=[monitor], **TRAINER_KWARGS)
    trainer.fit(CausalLM("tiny"), train_dataloaders=loader)
    m = monitor.last_metrics
    # two micro-batches of 2 x 16 tokens per optimizer step
    assert m["throughput/tokens_per_sec"] * (m["throughput/step_time"] + m["throughput/data_wait"]) == pytest.approx(64)
    assert m["throughput/mfu"] == pytest.approx(m["throughput/tflops_per_device"] / 1.0)


def test_validation_alone_with_the_monitor_attached_logs_nothing_and_does_not_fail():
    from torch.utils.data import DataLoader, TensorDataset

    ids = torch.randint(0, 256, (4, 16))
    monitor = ThroughputMonitor()
    kwargs = {**TRAINER_KWARGS, "limit_val_batches": 1}
    trainer = L.Trainer(logger=False, callbacks=[monitor], **kwargs)
    trainer.validate(CausalLM("tiny"), DataLoader(TensorDataset(ids, ids)))
    assert monitor.last_metrics == {} and monitor.summary == ""


# ---------------------------------------------------------------------- two processes

class SlowDataOnRank(L.Callback):
    """Sleeps before the monitor's step start on one rank: a slow data loader."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


def _worker(out: Path) -> None:
    from lightning_hybrid import HybridParallelStrategy
    from lightning_hybrid.data.byte_text import ByteTextDataModule

    L.seed_everything(0)
    monitor = ThroughputMonitor(window=2, straggler_every_n_steps=3, straggler_threshold=0.2)
    trainer = L.Trainer(devices=2, strategy=HybridParallelStrategy(tp=2), max_steps=6, logger=False,
                        callbacks=[SlowDataOnRank(1, 0.3), monitor], **TRAINER_KWARGS)
    trainer.fit(CausalLM("tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4, max_bytes=100_000))
    if trainer.global_rank == 0:
        record = {"history": [(step, [vars(s) for s in found]) for step, found in monitor.stragglers.history],
                  "metrics": monitor.last_metrics}
        (out / "record.json").write_text(json.dumps(record))


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_stragglers_are_found_by_rank_host_and_coordinates_with_tp2(tmp_path):
    import socket

    from helpers.launch import launch

    result = launch(2, [__file__, str(tmp_path)], timeout=170)
    record = json.loads((tmp_path / "record.json").read_text())
    assert [step for step, _ in record["history"]] == [3, 6]
    for step, found in record["history"]:
        assert [s["rank"] for s in found] == [1], (step, found)
        assert found[0]["host"] == socket.gethostname()
        assert found[0]["coordinates"] == {"pp": 0, "dp": 0, "tp": 1}
        assert found[0]["own_time"] > 1.2 * found[0]["median_time"]
    assert "stragglers at step 3: rank 1 (host" in result.stderr
    # tensor-parallel peers see the same 4 x 32 tokens: the global batch is 128 tokens, not 256
    m = record["metrics"]
    seconds = m["throughput/step_time"] + m["throughput/data_wait"]
    assert m["throughput/tokens_per_sec"] * seconds == pytest.approx(128)
    assert m["throughput/tokens_per_sec_per_device"] == pytest.approx(m["throughput/tokens_per_sec"] / 2)
    assert len([line for line in result.stdout.splitlines() if line.startswith("throughput: ")]) == 1


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
