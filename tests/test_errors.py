"""Bad input gets a one-line ValueError naming the value and what would fit, before any collective."""

from __future__ import annotations

import lightning as L
import pytest

from helpers.equivalence import make_dataset
from helpers.launch import launch
from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.models import CausalLM


def test_sizes_that_do_not_multiply_to_the_world_size_are_refused():
    with pytest.raises(ValueError, match=r"tp\*pp\*dp=2\*1\*3=6 does not equal the world size 4"):
        ParallelDims.resolve(tp=2, pp=1, dp=3, world_size=4)
    with pytest.raises(ValueError,
                       match=r"world size 6 is not divisible by tp\*pp=4\*1=4; tp\*pp must be one of 1, 2, 3 or 6"):
        ParallelDims.resolve(tp=4, pp=1, dp=None, world_size=6)
    assert ParallelDims.resolve(tp=8, pp=2, dp=None, world_size=128).dp == 8


def test_tp_that_does_not_divide_the_heads_is_refused_with_the_divisors():
    dims = ParallelDims.resolve(tp=3, pp=1, dp=None, world_size=3)
    with pytest.raises(ValueError,
                       match=r"tp=3 does not divide num_attention_heads=64; use tp in 1, 2, 4, 8, 16, 32 or 64"):
        dims.check_model({"num_attention_heads": 64, "num_key_value_heads": 8}, 80)
    dims = ParallelDims.resolve(tp=16, pp=1, dp=None, world_size=16)
    with pytest.raises(ValueError, match=r"tp=16 does not divide num_key_value_heads=8; use tp in 1, 2, 4 or 8"):
        dims.check_model({"num_attention_heads": 64, "num_key_value_heads": 8}, 80)


def test_more_pipeline_stages_than_blocks_are_refused():
    dims = ParallelDims.resolve(tp=1, pp=4, dp=None, world_size=4)
    with pytest.raises(ValueError,
                       match=r"pp=4 x virtual_stages=2 = 8 pipeline stages but the model has only 4 blocks"):
        dims.check_model({}, 4, stages_per_rank=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"data_parallel": "zero2"}, r"data_parallel='zero2' is not supported; use one of fsdp, replicate"),
    ({"pp_schedule": "pipedream"}, r"pp_schedule='pipedream' is not supported; use one of gpipe, 1f1b"),
    ({"activation_checkpointing": "some"},
     r"activation_checkpointing='some' is not supported; use one of none, selective, full"),
    ({"tp": 0}, r"tp=0 must be a positive integer"),
    ({"dp": -1}, r"dp=-1 must be a positive integer or None"),
    ({"virtual_stages": 0}, r"virtual_stages=0 must be a positive integer"),
])
def test_unknown_option_values_are_refused_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


def test_strategy_is_registered_as_hybrid():
    trainer = L.Trainer(strategy="hybrid", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)


def test_trainer_with_too_few_devices_fails_before_initializing_processes():
    trainer = L.Trainer(strategy=HybridParallelStrategy(tp=2), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    train, _ = make_dataset(8)
    with pytest.raises(ValueError, match=r"world size 1 is not divisible by tp\*pp=2\*1=2"):
        trainer.fit(CausalLM("tiny"), train_dataloaders=train)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_indivisible_kv_heads_fail_on_every_rank_without_hanging(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import lightning as L\n"
        "from lightning_hybrid import HybridParallelStrategy\n"
        "from lightning_hybrid.models import CausalLM, Qwen2Config\n"
        "from helpers.equivalence import make_dataset\n"
        "config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,\n"
        "                     num_attention_heads=4, num_key_value_heads=1)\n"
        "trainer = L.Trainer(strategy=HybridParallelStrategy(tp=2), accelerator='cpu', devices=2, max_steps=1,\n"
        "                    logger=False, enable_checkpointing=False)\n"
        "try:\n"
        "    trainer.fit(CausalLM(config), train_dataloaders=make_dataset(8)[0])\n"
        "except ValueError as err:\n"
        "    import os, pathlib, time\n"
        "    print(f'rank {os.environ[\"RANK\"]}: {err}', flush=True)\n"
        "    # the launcher stops every other rank the moment one exits, as torchrun does: wait (bounded) until\n"
        "    # each rank reached the error on its own, so that a rank still starting up is not killed first\n"
        f"    marks = pathlib.Path({str(tmp_path / 'marks')!r}); marks.mkdir(exist_ok=True)\n"
        "    (marks / os.environ['RANK']).touch()\n"
        "    deadline = time.monotonic() + 60\n"
        "    while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    raise SystemExit(3)\n"
    )
    result = launch(2, [str(script)], timeout=150, check=False)
    assert result.returncode != 0
    for rank in (0, 1):
        message = f"rank {rank}: tp=2 does not divide num_key_value_heads=1; use tp in 1"
        assert message in result.stdout, result.stdout[-3000:]


def _validated(module, **kwargs):
    import torch

    strategy = HybridParallelStrategy(**kwargs)
    strategy._lightning_module = module
    strategy._parallel_devices = [torch.device("cpu")]
    strategy.num_nodes = 1
    strategy._validate()
    return strategy


@pytest.mark.parametrize("kwargs, message", [
    ({"selective_ac": "mlp"}, r"selective_ac='mlp' is not a mode; use one of \('op', 'attention'\) or a block stride"),
    ({"selective_ac": 0}, r"selective_ac=0: a block stride must be >= 1"),
    ({"reduce_dtype": "fp16"}, r"reduce_dtype='fp16'"),
    ({"activation_checkpointing": "some"}, r"activation_checkpointing='some'"),
])
def test_bad_recompute_and_precision_switches_are_refused_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


def test_a_precision_the_declared_path_does_not_implement_is_refused_before_any_collective():
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = HybridParallelStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu")
    strategy._lightning_module = CausalLM("tiny")
    strategy._parallel_devices = [__import__("torch").device("cpu")]
    strategy.num_nodes = 1
    with pytest.raises(ValueError, match=r"precision='16-mixed' is not supported for a declared model; use one of"):
        strategy._validate()


def test_recompute_and_compile_switches_are_accepted_for_a_declared_model_and_refused_without_one():
    from user_module import UserTPModule

    strategy = _validated(CausalLM("tiny"), activation_checkpointing="selective", selective_ac="2", compile=True)
    assert strategy.options.selective_ac == 2 and strategy.options.compile
    with pytest.raises(ValueError, match=r"^compile=True needs a LightningModule that declares its blocks"):
        _validated(UserTPModule(), compile=True)
    # recompute: the strategy also recomputes the decoder layers of a Hugging Face model the module holds, which may
    # be made in configure_model; a module that holds none is refused once configure_model has run
    from lightning_hybrid.distributed.hf_transformers import check_held_models

    strategy = _validated(UserTPModule(), activation_checkpointing="full")
    with pytest.raises(ValueError, match=r"^activation_checkpointing='full' needs a LightningModule that declares its "
                                         r"blocks \(parallel_spec\(\)\) or holds a Hugging Face transformers model; "
                                         r"UserTPModule parallelizes itself"):
        check_held_models(UserTPModule(), strategy.options, strategy.dims, final=True)


@pytest.mark.parametrize("kwargs", [{"sequence_parallel": True}, {"activation_checkpointing": "full"},
                                    {"sequence_parallel": True, "activation_checkpointing": "selective"},
                                    {"sequence_parallel": True, "activation_checkpointing": "full"}])
def test_compile_with_tp_and_sequence_parallel_or_recompute_is_accepted(kwargs):
    import torch

    strategy = HybridParallelStrategy(tp=2, compile=True, **kwargs)
    strategy._lightning_module = CausalLM("tiny")
    strategy._parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 1
    strategy._validate()  # trained against one process in tests/test_compile_tp.py


def test_compile_with_tp_and_op_level_recompute_without_sequence_parallel_is_refused_before_any_collective():
    import torch

    strategy = HybridParallelStrategy(tp=2, compile=True, activation_checkpointing="selective")
    strategy._lightning_module = CausalLM("tiny")
    strategy._parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 1
    with pytest.raises(ValueError, match=r"compile=True with tp=2, activation_checkpointing='selective' "
                                         r"\(selective_ac='op'\) and sequence_parallel=False trains with wrong"):
        strategy._validate()


@pytest.mark.timeout(120)
def test_hang_lines_of_ranks_writing_at_once_stay_whole_one_a_line():
    """Each rank's hang report is one os.write of the whole line: 4 processes writing 300 lines each into one pipe at
    the same time give 1,200 intact lines, none joined with another."""
    import multiprocessing
    import os
    import re
    import threading

    from lightning_hybrid.distributed.heartbeat import write_line

    read_end, write_end = os.pipe()
    chunks: list[bytes] = []

    def drain() -> None:
        while data := os.read(read_end, 1 << 16):
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()

    def ranks(rank: int) -> None:
        for i in range(300):
            write_line(f"[rank{rank}]: rank {rank} made no progress for 20 s (report {i}) " + "x" * 200, fd=write_end)

    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=ranks, args=(rank,)) for rank in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    os.close(write_end)
    reader.join(60)
    os.close(read_end)
    lines = b"".join(chunks).decode().splitlines()
    pattern = re.compile(r"^\[rank(\d)\]: rank \1 made no progress for 20 s \(report \d+\) x{200}$")
    assert len(lines) == 1200 and all(pattern.match(line) for line in lines)
