"""A user's mistake on the command line ends with one line naming the bad value, printed once, no traceback.

Each case runs the ``lightning-hybrid`` command line in a fresh process forked from one that imported the package
once (:mod:`helpers.fork_server`: the imports are 5 of the 5-6 s a CLI process takes here); two cases run the command
as a separate interpreter, as a user does, imports included. The time each took is printed (``-s``) for the record,
never asserted: the machine is shared and noisy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.fork_server import fork_server
from helpers.launch import TESTS

ROOT = TESTS.parent
TINY = ROOT / "recipes" / "tiny-cpu.yaml"
FIT = ["fit", "--config", str(TINY), "--trainer.max_steps", "1", "--trainer.logger", "false"]

pytestmark = pytest.mark.timeout(600)


def _bad_yaml(tmp: Path) -> Path:
    path = tmp / "broken.yaml"
    path.write_text("trainer:\n  devices: 4\n  strategy: [tp: 2\nmodel:\n  model: tiny\n")
    return path


# (id, arguments, text the last line must contain)
CASES = [
    ("tp_negative", FIT + ["--trainer.strategy.init_args.tp", "-2"], "tp=-2 must be a positive integer"),
    ("unknown_schedule", FIT + ["--trainer.strategy.init_args.pp_schedule", "foo"],
     "pp_schedule='foo' is not supported; use one of gpipe, 1f1b"),
    ("unknown_data_parallel", FIT + ["--trainer.strategy.init_args.data_parallel", "foo"],
     "data_parallel='foo' is not supported; use one of fsdp, replicate"),
    ("microbatches_vs_batch", FIT + ["--trainer.strategy.init_args.tp", "1", "--trainer.strategy.init_args.pp", "2",
                                     "--trainer.strategy.init_args.microbatches", "3"],
     "the per-rank batch of 8 sequences does not split into microbatches=3"),
    ("negative_batch", FIT + ["--data.init_args.batch_size", "-4"], "batch_size=-4 must be a positive integer"),
    ("more_stages_than_blocks", FIT + ["--trainer.strategy.init_args.tp", "1", "--trainer.strategy.init_args.pp", "4",
                                       "--trainer.strategy.init_args.pp_schedule", "interleaved_1f1b",
                                       "--trainer.strategy.init_args.virtual_stages", "2"],
     "8 pipeline stages but the model has only 4 blocks; use at most 4 stages"),
    ("unknown_preset", FIT + ["--model.model", "tiny-xx"], "unknown model 'tiny-xx'; use a preset (tiny,"),
    ("devices_do_not_divide", FIT + ["--trainer.devices", "3"], "world size 3 is not divisible by tp*pp=2*1=2"),
    ("cp_sequence_length", FIT + ["--trainer.strategy.init_args.tp", "1", "--trainer.strategy.init_args.cp", "2",
                                  "--data.init_args.seq_len", "30"],
     "sequence length 30 is not divisible by 2*cp=4 (the load-balanced split of cp=2); pad or pack sequences to a "
     "multiple of 4 (e.g. 32)"),
    ("tp_does_not_divide_heads", FIT + ["--trainer.strategy.init_args.tp", "4", "--trainer.devices", "4"],
     "tp=4 does not divide num_key_value_heads=2; use tp in 1 or 2"),
    ("yaml_syntax", ["fit", "--config", "{bad_yaml}"],
     "broken.yaml: YAML syntax error at line 4, column 6: expected ',' or ']'"),
    ("missing_config", ["fit", "--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
    ("unknown_subcommand", ["train"], "unknown subcommand; use one of fit, validate, test, predict, plan"),
    ("plan_nothing_fits", ["plan", "--model", "qwen2.5-72b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "h100"],
     "nothing fits"),
    ("prepare_data_missing_input", ["prepare-data", "--tokenizer", "no/such/tokenizer", "--input", "no/such.jsonl",
                                    "--output", "{tmp}/out", "--seq-len", "16"], "no/such.jsonl"),
    # parse errors of the config or the command line: one line, the closest valid key (not jsonargparse's usage)
    ("parse_bad_value", FIT + ["--trainer.strategy.init_args.tp", "two"],
     "error: --trainer.strategy.init_args.tp: 'two' is not valid; expected int or 'auto'"),
    ("parse_unknown_strategy_key", FIT + ["--trainer.strategy.init_args.tensor_paralel", "2"],
     "--trainer.strategy.init_args.tensor_paralel: HybridParallelStrategy has no argument 'tensor_paralel'; "
     "did you mean `tensor_parallel_size`?"),
    ("parse_unknown_model_key", FIT + ["--model.learning_rte", "0.1"],
     "--model.learning_rte: unknown key; did you mean `model.lr`?"),
    ("parse_misspelled_section", ["fit", "--config", "{trainr_yaml}"], "unknown section `trainr`; expected one of "),
    # files named by the config, checked before any process starts
    ("missing_ckpt_path", FIT + ["--ckpt_path", "no/such/step-000002"],
     "--ckpt_path no/such/step-000002: no such file or folder"),
    ("missing_init_from_hf", FIT + ["--model.init_from_hf", "{tmp}/no-such-folder"],
     "no-such-folder: no such folder, and not a Hugging Face repo id"),
    ("corrupted_safetensors", FIT + ["--model.init_from_hf", "{corrupted_hf}"],
     "model.safetensors: not a readable safetensors file ("),
    # a Hugging Face config.json the decoder core cannot compute exactly: refused before any process starts
    ("family_model_type", FIT + ["--model.model", "{hf_model_type}"],
     "model_type='gpt_neox' is not supported; use one of qwen2, llama, qwen3, mistral"),
    ("family_activation", FIT + ["--model.model", "{hf_activation}"],
     "hidden_act='gelu' is not supported; only 'silu'"),
    ("family_rope_type", FIT + ["--model.model", "{hf_rope_type}"],
     "rope scaling type 'longrope' is not implemented; use default, llama3, yarn"),
    ("family_sliding_window", FIT + ["--model.model", "{hf_sliding_window}"],
     "sliding_window=4096 is not supported (sliding-window attention is not implemented); set it to null"),
    ("family_head_dim", FIT + ["--model.model", "{hf_head_dim}"],
     "head_dim=15 must be a positive even integer (RoPE turns pairs of dimensions)"),
    ("family_tp_does_not_divide_kv_heads", FIT + ["--model.model", "tiny-qwen3", "--trainer.strategy.init_args.tp", "4",
                                                  "--trainer.devices", "4"],
     "tp=4 does not divide num_key_value_heads=2; use tp in 1 or 2"),
    ("prepare_data_empty_input", ["prepare-data", "--tokenizer", "{tokenizer}", "--input", "{tmp}/empty.txt",
                                  "--output", "{tmp}/prepared", "--seq-len", "16", "--eos-token", "</s>"],
     "empty.txt) give 1 tokens, fewer than one sequence of seq_len=16 needs (17); add text or lower --seq-len; "
     "nothing was written"),
]


def _placeholders(tmp: Path) -> dict[str, str]:
    """Files some cases name: a config with a misspelled section, a damaged safetensors file, an empty input."""
    trainr = tmp / "trainr.yaml"
    trainr.write_text(TINY.read_text().replace("trainer:", "trainr:", 1))
    corrupted = tmp / "hf"
    corrupted.mkdir(exist_ok=True)
    (corrupted / "model.safetensors").write_bytes(b"\xff" * 64)
    (tmp / "empty.txt").write_text("")
    return {"{bad_yaml}": str(_bad_yaml(tmp)), "{tmp}": str(tmp), "{trainr_yaml}": str(trainr),
            "{corrupted_hf}": str(corrupted), "{tokenizer}": str(_byte_tokenizer(tmp)), **_family_configs(tmp)}


def _family_configs(tmp: Path) -> dict[str, str]:
    """Folders with a ``config.json`` of a tiny Llama-shaped model, each with one field the core does not compute."""
    import json

    llama = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 176,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
             "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    cases = {"model_type": {"model_type": "gpt_neox"}, "activation": {"hidden_act": "gelu"},
             "rope_type": {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
             "sliding_window": {"model_type": "mistral", "sliding_window": 4096}, "head_dim": {"head_dim": 15}}
    folders = {}
    for name, change in cases.items():
        folder = tmp / f"hf-{name}"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**llama, **change}))
        folders[f"{{hf_{name}}}"] = str(folder)
    return folders


def _byte_tokenizer(tmp: Path) -> Path:
    """A tiny word-level tokenizer folder (tokenizer.json with an EOS token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp / "tokenizer"
    folder.mkdir(exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "cat": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def cli():
    return fork_server()


@pytest.mark.slow  # one process importing torch and Lightning, a fork per case
@pytest.mark.parametrize("args,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_user_error_ends_with_one_line_naming_the_value(cli, args, expected, tmp_path):
    values = _placeholders(tmp_path)
    for key, value in values.items():
        args = [a.replace(key, value) for a in args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LIGHTNING_HYBRID_DEBUG", None)
    start = time.perf_counter()
    result = cli.run(args, cwd=tmp_path, env=env)
    seconds = time.perf_counter() - start
    output = (result.stdout + result.stderr).strip()
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    print(f"\n{' '.join(args[:1])} ... -> exit {result.returncode} in {seconds:.1f} s: {last}")
    assert result.returncode == 2, output[-2000:]  # usage and configuration errors: 2 in every subcommand
    assert expected in last, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert output.count(expected) == 1, output[-3000:]  # printed once
    assert "usage:" not in output, output[-3000:]  # the full usage only with --help
    assert not (tmp_path / "prepared").exists()  # an empty prepare-data input leaves nothing behind


@pytest.mark.slow  # a CLI process each (imports torch and Lightning)
def test_the_debug_switch_shows_the_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_HYBRID_DEBUG": "1"}
    result = subprocess.run([sys.executable, "-m", "lightning_hybrid.cli", *FIT, "--model.model", "tiny-xx"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" in result.stderr and "tiny-xx" in result.stderr


def test_only_global_rank_zero_prints_a_user_error(monkeypatch, capsys):
    from lightning_hybrid import cli

    for rank, printed in (("0", True), ("3", False)):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["fit", "--config", "no/such.yaml"]) == cli.EXIT_USER_ERROR
        assert ("no/such.yaml: no such file" in capsys.readouterr().err) is printed


@pytest.mark.slow  # a CLI process each (imports torch and Lightning)
def test_a_checkpoint_of_another_model_in_the_folder_is_refused_in_one_line_naming_the_ways_out(tmp_path):
    # A committed checkpoint written by a wider model (intermediate_size 352 vs the recipe's 176): the CLI reads its
    # manifest before any worker starts and refuses it in one line naming why and what to do (the workers refuse it
    # too, before the model is built, if training is started another way: tests/test_lineage.py).
    import json

    from lightning_hybrid.models import Qwen2Config

    folder = tmp_path / "ckpt" / "step-000002"
    folder.mkdir(parents=True)
    other = {**Qwen2Config.from_preset("tiny").to_dict(), "intermediate_size": 352}
    (folder / "meta.json").write_text(json.dumps({"step": 2, "epoch": 0, "files": {}, "model_config": other,
                                                  "mesh": {"tp": 2, "pp": 1, "dp": 2, "world_size": 4}}))
    extra = tmp_path / "checkpoints.yaml"
    extra.write_text("trainer:\n  callbacks:\n"
                     "    - class_path: lightning_hybrid.callbacks.ThroughputMonitor\n"
                     "    - class_path: lightning_hybrid.FaultTolerantCheckpoint\n"
                     f"      init_args:\n        dirpath: {tmp_path / 'ckpt'}\n        every_n_steps: 1\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LIGHTNING_HYBRID_DEBUG", None)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "lightning_hybrid.cli", *FIT, "--config", str(extra)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = (result.stdout + result.stderr).strip()
    last = result.stderr.strip().splitlines()[-1]
    print(f"\nanother model's checkpoint -> exit {result.returncode} in {time.perf_counter() - start:.1f} s: {last}")
    assert result.returncode != 0 and "Traceback" not in output, output[-3000:]
    # another model's checkpoint is another run's (auto-resume does not take it): refused as such, naming the run
    # (this one was written before run ids) and how the two models differ
    assert f"checkpoint folder {tmp_path / 'ckpt'} holds checkpoints of another run (run without run id: model " \
           f"tiny (intermediate_size 352, this run's 176), newest step 2, 1 checkpoint)" in last, output[-3000:]
    assert "Give this run another dirpath" in last and 'on_foreign="archive"' in last
    assert output.count("holds checkpoints of another run") == 1


def test_help_keeps_the_full_usage(capsys):
    from lightning_hybrid import cli

    with pytest.raises(SystemExit) as caught:
        cli.main(["fit", "--help"])
    out = capsys.readouterr().out
    assert caught.value.code == 0 and "usage:" in out and "--trainer.max_steps" in out and len(out.splitlines()) > 60


@pytest.mark.parametrize("message, keys, line", [
    ('Parser key "trainer.max_steps":\n  Expected a <class \'int\'>. Got value: abc', [],
     "--trainer.max_steps: 'abc' is not valid; expected int"),
    ("unrecognized arguments: --trainer.max_stepz 3", ["trainer.max_steps", "trainer.devices", "model.lr"],
     "--trainer.max_stepz: unknown key; did you mean `trainer.max_steps`?"),
    ("Subcommand 'fit' does not accept option 'modle.lr'", ["trainer.max_steps", "model.lr", "data"],
     "unknown section `modle`; expected one of data, model, trainer; did you mean `model`?"),
])
def test_parse_errors_become_one_line_with_the_closest_key(message, keys, line):
    from lightning_hybrid.cli_errors import parse_error_line

    assert parse_error_line(message, keys) == line
