"""Bad expert-parallel input is refused in one line naming the value and what fits, before any collective: checked
with the options against the world and the model (every rank alike, no process group), and from the command line
(exit 2, no traceback)."""

from __future__ import annotations

import os

import pytest

from helpers.fork_server import fork_server
from helpers.launch import TESTS
from lightning_hybrid.distributed.option_checks import check_options
from lightning_hybrid.distributed.options import ParallelOptions
from lightning_hybrid.models.decoder.config import DecoderConfig, parallel_spec

MOE = parallel_spec(DecoderConfig.from_preset("tiny-moe"))  # 8 experts
DENSE = parallel_spec(DecoderConfig.from_preset("tiny"))


def _check(world: int, spec=MOE, **options) -> None:
    check_options(ParallelOptions(**options), world, None, spec, 4, "32-true", "CausalLM")


@pytest.mark.parametrize("world, spec, options, message", [
    (4, MOE, dict(ep=3), "ep=3 does not divide dp=4 (expert parallelism is carved from the data-parallel ranks); use "
                         "ep in 1, 2 or 4"),
    (4, MOE, dict(tp=2, ep=4), "ep=4 does not divide dp=2 (expert parallelism is carved from the data-parallel "
                               "ranks); use ep in 1 or 2"),
    (3, MOE, dict(ep=3), "ep=3 does not divide num_experts=8 (each ep rank holds num_experts / ep experts); use ep "
                         "in 1, 2, 4, 8"),
    (4, DENSE, dict(ep=2), "ep=2 needs a mixture-of-experts model (its ParallelSpec declares block_experts, e.g. "
                           "model='qwen3-30b-a3b' or 'tiny-moe'); CausalLM has none; use ep=1"),
    (4, None, dict(ep=2), "ep=2 needs a mixture-of-experts model"),
    (4, MOE, dict(ep=2, data_parallel="replicate"), "ep=2 with data_parallel='replicate' is not supported"),
    (4, MOE, dict(ep=2, compile=True), "compile=True with a mixture-of-experts model is not supported"),
])
def test_bad_expert_parallel_input_is_refused_in_one_line_before_any_collective(world, spec, options, message):
    import torch.distributed as dist

    with pytest.raises(ValueError) as err:
        _check(world, spec, **options)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not dist.is_initialized()  # nothing was started to find out


def test_ep_must_be_a_positive_integer():
    with pytest.raises(ValueError, match=r"^ep=0 must be a positive integer$"):
        ParallelOptions(ep=0)


def test_good_expert_parallel_layouts_pass():
    _check(4, ep=2)
    _check(4, ep=4)
    _check(8, tp=2, pp=2, ep=2)
    _check(4, ep=1)


CLI_CASES = [
    ("dense_model", ["fit", "--config", str(TESTS.parent / "recipes" / "tiny-cpu.yaml"),
                     "--trainer.strategy.init_args.ep", "2"], "ep=2 needs a mixture-of-experts model"),
    ("ep_does_not_divide_dp", ["fit", "--config", str(TESTS.parent / "recipes" / "tiny-moe-cpu.yaml"),
                               "--trainer.strategy.init_args.ep", "3"], "ep=3 does not divide dp=4"),
]


@pytest.mark.slow  # a CLI process forked per case
@pytest.mark.timeout(300)
@pytest.mark.parametrize("args, expected", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_the_command_line_refuses_bad_ep_with_exit_2_and_one_line(args, expected, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LIGHTNING_HYBRID_DEBUG", None)
    result = fork_server().run(args + ["--trainer.logger", "false"], cwd=tmp_path, env=env)
    output = (result.stdout + result.stderr).strip()
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    assert result.returncode == 2, output[-2000:]
    assert expected in last and "Traceback" not in output, output[-3000:]
