"""Runtime features seen from outside: the dry run's collectives and one-line errors for bad requests.

The dry run plays ranks of the tiny recipe on the fake process group with the strategy's own code (each rank in a
fresh process, as ``lightning-hybrid dry-run`` does); the error tests need no process group.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

from lightning_hybrid import HybridParallelStrategy
from lightning_hybrid.models import CausalLM

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"


def _trace(ranks: list[int], **strategy) -> dict:
    from lightning_hybrid.dryrun.cli import trace_ranks
    from lightning_hybrid.dryrun.recipe import load_job

    job = load_job(str(TINY)).with_strategy(**strategy)
    return {r.rank: r for r in trace_ranks(job, ranks)}


@pytest.fixture(scope="module")
def pp2_dp2_traces() -> dict:
    # tiny recipe (4 blocks) at pp=2 x dp=2, 4 micro-batches: one rank per pipeline stage (ranks 0 and 2; the dp
    # peers of a stage run the same operations on their own groups, the dry run's roles), each reshard policy
    return {policy: _trace([0, 2], tp=1, pp=2, microbatches=4, fsdp_reshard_after_forward=policy)
            for policy in ("auto", True)}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dry_run_auto_gathers_each_fsdp_unit_once_per_step_under_pp2_dp2(pp2_dp2_traces) -> None:
    units = 2 + 1  # two blocks per stage and the stage's root unit (embedding, or final norm and head)
    for rank, result in pp2_dp2_traces["auto"].items():
        assert result.collectives["dp"]["all_gather"][0] == units, (rank, result.collectives["dp"])
        assert result.collectives["dp"]["reduce_scatter"][0] == units, (rank, result.collectives["dp"])
    # resharding after every forward gathers each block m + 1 = 5 times per step
    for rank, result in pp2_dp2_traces[True].items():
        assert result.collectives["dp"]["all_gather"][0] == 2 * 5 + 1, (rank, result.collectives["dp"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dry_run_auto_keeps_the_stage_gathered_and_holds_more_at_the_peak(pp2_dp2_traces) -> None:
    # the unsharded stage stays for the whole step: the peak holds it (more bytes), never less
    for rank in (0, 2):
        assert pp2_dp2_traces["auto"][rank].total_peak >= pp2_dp2_traces[True][rank].total_peak, rank


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dry_run_with_loss_parallel_has_no_logits_all_gather() -> None:
    on, off = _trace([0], tp=2, loss_parallel=True)[0], _trace([0], tp=2, loss_parallel=False)[0]
    tokens, vocab = 8 * 128, 256  # the tiny recipe: 8 sequences of 128 tokens per dp rank, byte vocabulary
    assert off.collectives["tp"]["all_gather"] == [1, tokens * vocab * 4]  # the fp32 logits, gathered
    assert "all_gather" not in on.collectives["tp"], on.collectives["tp"]
    # instead: 3 all-reduces of one fp32 per token (maximum, sum of exponentials, target logit)
    calls, size = on.collectives["tp"]["all_reduce"]
    off_calls, off_size = off.collectives["tp"]["all_reduce"]
    assert (calls - off_calls, size - off_size) == (3, 3 * tokens * 4)
    assert on.total_peak < off.total_peak  # no rank holds the full-vocabulary logits


# ---------------------------------------------------------------- one-line errors


def _fit_error(strategy: HybridParallelStrategy) -> str:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError) as info:
        trainer.fit(CausalLM("tiny"))
    return str(info.value)


def test_async_tp_on_cpu_names_cuda_and_nccl_before_any_collective() -> None:
    message = _fit_error(HybridParallelStrategy(tp=2, async_tp=True, compile=True, sequence_parallel=True))
    assert "\n" not in message
    assert "async_tp=True" in message and "CUDA device (this run is on cpu)" in message
    assert "NCCL backend (this run uses gloo)" in message


@pytest.mark.parametrize("options, missing", [
    ({"compile": False, "sequence_parallel": True}, "compile=True"),
    ({"compile": True, "sequence_parallel": False}, "sequence_parallel=True"),
    ({"compile": False, "sequence_parallel": False}, "compile=True, sequence_parallel=True"),
])
def test_async_tp_without_compile_or_sequence_parallel_names_what_is_missing(options, missing) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(tp=2, async_tp=True, **options)
    message = str(info.value)
    assert "\n" not in message and f"needs {missing}" in message, message


@pytest.mark.parametrize("value", ["sometimes", 1, None])
def test_unknown_fsdp_reshard_after_forward_is_a_one_line_error(value) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(fsdp_reshard_after_forward=value)
    message = str(info.value)
    assert "\n" not in message
    assert f"fsdp_reshard_after_forward={value!r}" in message and "'auto', True or False" in message


def test_resharding_under_a_zero_bubble_schedule_is_refused() -> None:
    strategy = HybridParallelStrategy(pp=2, pp_schedule="zbv_zero_bubble", virtual_stages=2, microbatches=4,
                                      fsdp_reshard_after_forward=True)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False)
    strategy._lightning_module = CausalLM("tiny")
    strategy._lightning_module.trainer = trainer
    with pytest.raises(ValueError, match="zero-bubble schedule needs the gathered weights"):
        strategy._validate()


@pytest.mark.parametrize("value, expected", [("AUTO", "auto"), (True, True), (False, False)])
def test_reshard_policy_accepts_auto_true_false(value, expected) -> None:
    assert HybridParallelStrategy(fsdp_reshard_after_forward=value).options.fsdp_reshard_after_forward == expected


def test_runtime_arguments_are_settable_from_yaml_and_the_cli() -> None:
    # LightningCLI reads HybridParallelStrategy.__init__ through jsonargparse: the new arguments parse from flags
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(HybridParallelStrategy, "strategy")
    defaults = parser.parse_args([])
    assert defaults.strategy.loss_parallel is True and defaults.strategy.bf16_compute_weights is True
    assert defaults.strategy.fsdp_reshard_after_forward == "auto" and defaults.strategy.async_tp is False
    args = parser.parse_args(["--strategy.loss_parallel", "false", "--strategy.bf16_compute_weights", "false",
                              "--strategy.fsdp_reshard_after_forward", "false", "--strategy.async_tp", "false"])
    strategy = HybridParallelStrategy(**vars(args.strategy))
    assert not strategy.options.loss_parallel and not strategy.options.bf16_compute_weights
    assert strategy.options.fsdp_reshard_after_forward is False
