"""Stage split, schedule validation and pipeline errors (single process, meta device)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.distributed.pipeline.schedules import stage_ids_for_rank, theoretical_bubble, validate_schedule
from lightning_hybrid.distributed.pipeline.split import build_stages, plan_stages
from lightning_hybrid.models import CausalLM, Qwen2, Qwen2Config


def _spec(name: str):
    return CausalLM(name).parallel_spec()


@pytest.mark.parametrize("pp", [2, 4])
def test_72b_split_is_balanced_by_cost(pp, capsys):
    spec = _spec("qwen2.5-72b")
    plans = plan_stages(spec, 80, pp)
    mean = sum(p.cost for p in plans) / pp
    print(f"qwen2.5-72b pp={pp}: "
          + ", ".join(f"stage {p.index}: {p.num_blocks} blocks cost {p.cost:.2f}" for p in plans))
    assert sum(p.num_blocks for p in plans) == 80
    assert plans[0].has_embedding and plans[-1].has_head
    assert all(p.cost <= mean + spec.block_cost for p in plans)
    # the ends carry the embedding and the head, so they never hold more blocks than a middle stage
    assert plans[-1].num_blocks <= min(p.num_blocks for p in plans[:-1])
    assert "stage 0" in capsys.readouterr().out


def test_head_heavy_model_gives_the_last_stage_fewer_blocks():
    # A large vocabulary relative to the width: the head costs several blocks.
    config = Qwen2Config(vocab_size=152064, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=2)
    spec = CausalLM(config).parallel_spec()
    assert spec.head_cost > 3
    plans = plan_stages(spec, 24, 4)
    assert plans[-1].num_blocks < plans[1].num_blocks
    assert plans[0].num_blocks <= plans[1].num_blocks


def test_72b_stages_are_built_on_the_meta_device_with_global_names():
    spec = _spec("qwen2.5-72b")
    with torch.device("meta"):
        model = Qwen2(Qwen2Config.from_preset("qwen2.5-72b"))
    plans = plan_stages(spec, 80, 2)
    container, stages = build_stages(model, spec, plans, [1])
    names = {n for n, _ in container.named_parameters()}
    assert "layers.57.mlp.up_proj.weight" in names and "lm_head.weight" in names
    assert "embed_tokens.weight" not in names and "layers.0.mlp.up_proj.weight" not in names
    assert all(p.is_meta for p in container.parameters())
    assert stages[0].layers["57"] is container.layers["57"]


def test_explicit_split_points_by_name_and_by_count():
    spec = _spec("tiny")
    assert [p.num_blocks for p in plan_stages(spec, 4, 2, ["layers.3"])] == [3, 1]
    assert [p.num_blocks for p in plan_stages(spec, 4, 3, [1, 2, 1])] == [1, 2, 1]


@pytest.mark.parametrize("points, message", [
    (["layers.9"], r"split point 'layers.9' does not exist; use layers.N with 1 <= N <= 3"),
    (["blocks.2"], r"split point 'blocks.2' does not exist"),
    (["layers.1", "layers.2"], r"names 2 stage starts; 2 stages need 1"),
    ([3, 2], r"must be 2 positive block counts summing to 4"),
])
def test_bad_split_points_are_refused(points, message):
    with pytest.raises(ValueError, match=message):
        plan_stages(_spec("tiny"), 4, 2, points)


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(ValueError, match=r"8 pipeline stages but the model has only 4 blocks"):
        plan_stages(_spec("tiny"), 4, 8)


def test_stage_layouts_of_looped_and_v_schedules():
    assert stage_ids_for_rank(1, 4, 1, "1f1b") == [1]
    assert stage_ids_for_rank(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_ids_for_rank(1, 4, 2, "zbv_zero_bubble") == [1, 6]


@pytest.mark.parametrize("args, message", [
    (("interleaved_1f1b", 2, 1, 4), r"pp_schedule='interleaved_1f1b' needs virtual_stages >= 2 \(got 1\)"),
    (("1f1b", 2, 2, 4), r"pp_schedule='1f1b' runs one stage per rank; use virtual_stages=1"),
    (("1f1b", 4, 1, 2), r"microbatches=2 is fewer than the 4 stages 1f1b needs; use >= 4"),
    (("interleaved_1f1b", 4, 2, 6), r"microbatches=6 must be a multiple of pp=4 for interleaved_1f1b"),
    (("dualpipev", 2, 2, 2), r"microbatches=2 is fewer than the 4 stages dualpipev needs; use >= 4"),
    (("zbv_zero_bubble", 2, 3, 8), r"places exactly two stages per rank in a V; use virtual_stages=2"),
])
def test_invalid_schedule_combinations_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)


def test_schedule_names_are_case_insensitive():
    strategy = HybridParallelStrategy(pp=2, pp_schedule="Interleaved_1F1B", virtual_stages=2)
    assert strategy.options.pp_schedule == "interleaved_1f1b"


def test_default_microbatches_are_at_least_twice_pp():
    assert HybridParallelStrategy(pp=4).options.num_microbatches == 8
    assert HybridParallelStrategy(pp=2, pp_schedule="zbv_zero_bubble", virtual_stages=2).options.num_microbatches >= 4


def test_theoretical_bubble():
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 11 / 2)
    assert theoretical_bubble("gpipe", 1, 8) == 0.0


class _PlainModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)


def test_pp_with_a_module_that_declares_no_parts_is_refused():
    trainer = L.Trainer(strategy=HybridParallelStrategy(pp=1, tp=1), accelerator="cpu", devices=1, logger=False)
    strategy = HybridParallelStrategy(pp=2)
    strategy._lightning_module = _PlainModule()
    strategy._parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 1
    with pytest.raises(ValueError, match=r"pp=2 needs a LightningModule that declares its model parts and loss"):
        strategy._validate()
    del trainer


def test_split_point_that_does_not_exist_fails_in_validation_before_processes_start():
    strategy = HybridParallelStrategy(pp=2, pp_split_points=["layers.7"])
    strategy._lightning_module = CausalLM("tiny")
    strategy._parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 1
    with pytest.raises(ValueError, match=r"split point 'layers.7' does not exist"):
        strategy._validate()


class _FakeStage:
    def forward_one_chunk(self, seconds):
        import time

        time.sleep(seconds)
        return seconds


def test_stage_timer_sums_compute_time_against_the_step_on_cpu():
    import time

    from lightning_hybrid.distributed.pipeline.timer import StageTimer

    timer, stage = StageTimer(torch.device("cpu")), _FakeStage()
    timer.wrap(stage)
    timer.start_step()
    assert stage.forward_one_chunk(0.02) == 0.02
    time.sleep(0.06)  # waiting for a neighbour stage: idle
    stage.forward_one_chunk(0.02)
    timer.end_step()
    assert timer.steps == 1
    assert 0.04 <= timer.busy < 0.06
    assert 0.5 < timer.idle_fraction < 0.7
    timer.reset()
    assert (timer.busy, timer.step_time, timer.steps, timer.idle_fraction) == (0.0, 0.0, 0, None)


def test_stage_timer_on_cuda_uses_events_and_never_synchronizes(monkeypatch):
    """A device-wide synchronize per micro-batch would serialise the pipeline's p2p with compute on a GPU."""
    from lightning_hybrid.distributed.pipeline.timer import StageTimer

    clock = iter(range(1000))
    recorded: list["Event"] = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at, self.done, self.waited = None, False, False

        def record(self):
            self.at = next(clock) * 10.0  # milliseconds
            recorded.append(self)

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

        def elapsed_time(self, end):
            return end.at - self.at

    def no_sync(*args, **kwargs):
        raise AssertionError("StageTimer called torch.cuda.synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    timer, stage = StageTimer(torch.device("cuda", 0)), _FakeStage()
    timer.wrap(stage)
    timer.start_step()                 # event at 0 ms
    stage.forward_one_chunk(0.0)       # 10 .. 20 ms
    recorded[0].done = recorded[1].done = recorded[2].done = True
    stage.forward_one_chunk(0.0)       # 30 .. 40 ms; the first pair is read back without waiting
    assert timer._busy == pytest.approx(0.010) and len(timer._pending) == 1
    timer.end_step()                   # 50 ms
    assert not any(e.waited for e in recorded)
    assert timer.busy == pytest.approx(0.020)           # reading waits for the events in flight
    assert timer.step_time == pytest.approx(0.050)
    assert timer.idle_fraction == pytest.approx(0.6)
