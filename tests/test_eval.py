"""Downstream evaluation through lm-evaluation-harness on the sharded model (``lightning_hybrid.eval``).

Tasks, data and tokenizer are local files written here (:mod:`helpers.eval_tasks`; the harness's own task YAML with
``dataset_path: json``), and nothing is downloaded (the launch runs with the Hub and datasets offline).

One 4-process launch (``eval_worker.py``, module-scoped) trains the tiny model at tp=2 x pp=2 with and without
``DownstreamEval``, saves a checkpoint, exports it with ``export-hf``, and runs ``lightning-hybrid eval`` on the
checkpoint at tp=2 x pp=2 and dp=4 and on the export (``--model.init_from_hf``) at cp=2 x tp=2. Here, on one process:
the export is scored by the harness's own Hugging Face model (``hf``, transformers) and by ``ShardedLM`` on one
process; every scorer must agree per request. The in-loop check on
one process, the bad inputs and the import rule run without a launch.
"""

from __future__ import annotations

import ast
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.eval_tasks import MAX_GEN_TOKS, MAX_LENGTH, TASKS, write_recipe, write_tasks, write_tokenizer
from helpers.launch import TESTS, launch

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
AGREE = 1e-4  # per-request log-likelihood against the harness's hf model (fp32; observed ~2e-6)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    write_tasks(root / "tasks")
    write_tokenizer(root / "tokenizer")
    write_recipe(root / "recipe.yaml")
    return root


@pytest.fixture(scope="module")
def offline(folder):
    """The Hub and datasets offline, the datasets cache in the test's folder (for this module's own harness runs)."""
    saved = {key: os.environ.get(key) for key in (*OFFLINE, "HF_DATASETS_CACHE")}
    os.environ.update({**OFFLINE, "HF_DATASETS_CACHE": str(folder / "datasets_cache")})
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def launched(folder) -> dict:
    env = {**OFFLINE, "HF_DATASETS_CACHE": str(folder / "datasets_cache")}
    launch(4, [str(TESTS / "eval_worker.py"), str(folder)], env=env, timeout=480)
    return torch.load(folder / "record.pt", weights_only=False)


def _parse(task: str, response):
    if task == "tiny_gen":
        return response
    if isinstance(response, (list, tuple)):  # loglikelihood: (log-likelihood, greedy); the JSONL holds strings
        return float(response[0]), str(response[1]) == "True"
    return float(response)


def answers(samples: dict) -> dict[str, list]:
    """Per task, per document (by id), per request: the harness's answer."""
    return {task: [[_parse(task, resp[0]) for resp in row["resps"]] for row in sorted(rows, key=lambda r: r["doc_id"])]
            for task, rows in samples.items()}


def cli_output(folder: Path, mesh: str) -> tuple[dict, dict]:
    """(results, answers) that ``lightning-hybrid eval`` wrote for one mesh (the harness's file names)."""
    out = folder / f"cli_{mesh}"
    (results_file,) = out.glob("results_*.json")
    samples = {}
    for task in TASKS:
        (file,) = out.glob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in file.read_text().splitlines()]
    return json.loads(results_file.read_text()), answers(samples)


def _harness(lm, folder: Path) -> tuple[dict, dict]:
    from lightning_hybrid.eval.tasks import evaluate_tasks, resolve_tasks

    results, samples = evaluate_tasks(lm, resolve_tasks(TASKS, str(folder / "tasks")), log_samples=True,
                                      bootstrap_iters=0)
    return results, answers(samples)


@pytest.fixture(scope="module")
def exported(launched, folder) -> Path:
    """The checkpoint exported by ``export-hf --dtype fp32`` (the worker ran it on rank 0)."""
    assert (folder / "hf" / "model.safetensors.index.json").is_file()
    return folder / "hf"


@pytest.fixture(scope="module")
def hf_scored(exported, folder, offline) -> tuple[dict, dict]:
    """The harness's own Hugging Face model (transformers) on the exported checkpoint."""
    from lm_eval.models.huggingface import HFLM

    # A one-device Trainer.fit earlier in this pytest process leaves Lightning's launcher variables behind
    # (LOCAL_RANK=0, WORLD_SIZE=1, no RANK); accelerate, under HFLM, reads LOCAL_RANK as a torchrun worker's and calls
    # init_process_group("env://"), which then fails for want of RANK. The harness's model runs as a plain process.
    launcher = {key: os.environ.pop(key) for key in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK") if key in os.environ}
    try:
        lm = HFLM(pretrained=str(exported), tokenizer=str(folder / "tokenizer"), device="cpu", dtype="float32",
                  batch_size=8, max_length=MAX_LENGTH)
        return _harness(lm, folder)
    finally:
        os.environ.update(launcher)


@pytest.fixture(scope="module")
def one_process_scored(exported, folder, offline) -> tuple[dict, dict]:
    """ShardedLM on one process, the model loaded from the exported folder (``init_from_hf``)."""
    from lightning_hybrid.eval.harness import ShardedLM
    from lightning_hybrid.eval.tasks import load_tokenizer
    from lightning_hybrid.models import CausalLM, Qwen2Config

    module = CausalLM(Qwen2Config.from_hf(exported), init_from_hf=str(exported))
    module.configure_model()
    lm = ShardedLM(module, load_tokenizer(str(folder / "tokenizer"), "test"), max_length=MAX_LENGTH,
                   max_gen_toks=MAX_GEN_TOKS)
    return _harness(lm, folder)


def assert_same_answers(ours: dict, theirs: dict, tolerance: float, name: str) -> float:
    """Every request's answer: log-likelihoods within ``tolerance``, greedy flags and generated texts equal."""
    worst = 0.0
    assert ours.keys() == theirs.keys() == set(TASKS), (name, ours.keys(), theirs.keys())
    for task in TASKS:
        assert len(ours[task]) == len(theirs[task]) > 0, (name, task)
        for doc, (a, b) in enumerate(zip(ours[task], theirs[task])):
            for x, y in zip(a, b, strict=True):
                if task == "tiny_gen":
                    assert x == y, (name, task, doc, x, y)
                    continue
                value_x, value_y = (x[0], y[0]) if isinstance(x, tuple) else (x, y)
                worst = max(worst, abs(value_x - value_y))
                assert abs(value_x - value_y) < tolerance, (name, task, doc, x, y)
                if isinstance(x, tuple):
                    assert x[1] == y[1], (name, task, doc, "greedy", x, y)
    return worst


def _metric(results: dict, task: str, metric: str) -> float:
    return float(results["results"][task][f"{metric},none"])


# ---------------------------------------------------------------------------------------------------- 4 processes


@pytest.mark.distributed
def test_in_loop_evaluation_at_tp2_pp2_changes_nothing(launched):
    plain, evaluated = launched["plain"], launched["evaluated"]
    assert [h["step"] for h in evaluated["history"]] == [2, 4]  # every 2 steps; the end of fit was step 4
    assert all(0.0 <= h["metrics"]["eval/tiny_mc/acc"] <= 1.0 and h["forward_passes"] > 0
               for h in evaluated["history"])
    losses = max(abs(a - b) / abs(b) for a, b in zip(evaluated["losses"], plain["losses"]))
    assert len(evaluated["losses"]) == len(plain["losses"]) == 4 and losses < 1e-6, (evaluated["losses"],
                                                                                     plain["losses"])
    diff = torch.cat([(evaluated["final"][k] - v).flatten() for k, v in plain["final"].items()])
    assert float(diff.norm() / torch.cat([v.flatten() for v in plain["final"].values()]).norm()) < 1e-6
    assert evaluated["val_loss"] == plain["val_loss"]  # validation right after an evaluation (other batch shapes)
    assert all(evaluated["training"]) and len(evaluated["training"]) == 4  # back in training mode at every step
    assert torch.equal(evaluated["rng"]["torch"], plain["rng"]["torch"])  # the harness seeds; the states come back
    assert evaluated["rng"]["python"] == plain["rng"]["python"] and evaluated["rng"]["numpy"] == plain["rng"]["numpy"]
    steps = sorted(plain["step_seconds"][1:])
    print(f"\nin-loop evaluation at tp=2 x pp=2 (4 processes, tiny_mc: 48 requests, 16 rows per pass): "
          f"{[round(h['seconds'], 2) for h in evaluated['history']]} s per run, "
          f"{evaluated['history'][0]['forward_passes']} forward passes; a training step {steps[len(steps) // 2]:.2f} s "
          f"(median of steps 2-4); worker phases {({k: round(v, 1) for k, v in launched['seconds'].items()})}")


@pytest.mark.distributed
def test_scores_agree_with_the_harness_hf_model_at_tp2_pp2_and_on_one_process(launched, folder, hf_scored,
                                                                               one_process_scored):
    hf_results, hf = hf_scored
    rows = []
    for name, (results, ours) in (("tp=2 x pp=2 (lightning-hybrid eval)", cli_output(folder, "tp2pp2")),
                                  ("one process (ShardedLM)", one_process_scored)):
        worst = assert_same_answers(ours, hf, AGREE, name)
        for metric in ("acc", "acc_norm"):
            assert _metric(results, "tiny_mc", metric) == _metric(hf_results, "tiny_mc", metric), (name, metric)
        assert _metric(results, "tiny_gen", "exact_match") == _metric(hf_results, "tiny_gen", "exact_match")
        assert abs(_metric(results, "tiny_ppl", "word_perplexity") / _metric(hf_results, "tiny_ppl", "word_perplexity")
                   - 1) < 1e-5
        rows.append(f"{name}: max |log-likelihood - hf| {worst:.2e}, acc {_metric(results, 'tiny_mc', 'acc'):.4f} "
                    f"(hf {_metric(hf_results, 'tiny_mc', 'acc'):.4f}), word perplexity "
                    f"{_metric(results, 'tiny_ppl', 'word_perplexity'):.4f} "
                    f"(hf {_metric(hf_results, 'tiny_ppl', 'word_perplexity'):.4f}), generations equal")
    print("\n" + "\n".join(rows))


@pytest.mark.distributed
def test_eval_of_a_tp2_pp2_checkpoint_at_dp4_and_of_its_export_at_cp2_tp2_gives_the_same_results(launched, folder):
    # dp=4 loads the checkpoint onto FSDP shards; cp=2 x tp=2 initializes the model from the exported folder
    # (--model.init_from_hf, no --checkpoint) and scores every sequence split head-tail over the cp ranks
    reference, expected = cli_output(folder, "tp2pp2")  # the mesh that wrote the checkpoint
    for mesh in ("dp4", "cp2tp2"):
        results, got = cli_output(folder, mesh)
        assert_same_answers(got, expected, 1e-5, mesh)
        for task in TASKS:
            for key, value in reference["results"][task].items():
                if isinstance(value, float):
                    assert abs(results["results"][task][key] - value) <= 1e-6 * max(1.0, abs(value)), (mesh, key)


# ---------------------------------------------------------------------------------------------------- one process


def _fit_one_process(folder: Path, with_eval: bool) -> dict:
    import lightning as L

    from helpers.equivalence import SEED, LossRecorder, make_dataset, make_trainer_kwargs, tiny_config
    from lightning_hybrid.callbacks import ThroughputMonitor
    from lightning_hybrid.eval import DownstreamEval
    from lightning_hybrid.models import CausalLM

    L.seed_everything(SEED)
    kwargs = make_trainer_kwargs()
    module = CausalLM(tiny_config(), **kwargs["module"])
    losses, monitor = LossRecorder(), ThroughputMonitor(peak_tflops=1.0, straggler_every_n_steps=0)
    callbacks: list = [losses, monitor]
    if with_eval:
        evaluation = DownstreamEval(["tiny_mc", "tiny_gen"], every_n_steps=2, include_path=str(folder / "tasks"),
                                    tokenizer=str(folder / "tokenizer"), max_length=MAX_LENGTH)
        callbacks.insert(0, evaluation)
    modes = []

    class Modes(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            modes.append(all(m.training for m in pl_module.modules()))

    trainer = L.Trainer(devices=1, callbacks=[*callbacks, Modes()], **kwargs["trainer"])
    train, val = make_dataset(reference=True)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    return {"losses": losses.losses, "final": {k: v.detach().clone() for k, v in module.model.named_parameters()},
            "modes": modes, "rng": (torch.get_rng_state(), random.random(), float(np.random.rand())),
            "history": evaluation.history if with_eval else None, "monitor": monitor.last_metrics}


def test_in_loop_evaluation_on_one_process_changes_nothing_bitwise(folder, offline):
    plain = _fit_one_process(folder, with_eval=False)
    evaluated = _fit_one_process(folder, with_eval=True)
    assert evaluated["losses"] == plain["losses"] and len(plain["losses"]) == 4
    assert plain["final"].keys() == evaluated["final"].keys()
    assert all(torch.equal(evaluated["final"][k], v) for k, v in plain["final"].items())
    assert evaluated["modes"] == [True] * 4
    assert torch.equal(evaluated["rng"][0], plain["rng"][0]) and evaluated["rng"][1:] == plain["rng"][1:]
    history = evaluated["history"]
    assert [h["step"] for h in history] == [2, 4] and "eval/tiny_gen/exact_match" in history[-1]["metrics"]
    # The run at step 4 fell inside that step's window of the throughput monitor: evaluation time, not step time.
    monitor = evaluated["monitor"]
    assert monitor["throughput/eval_time"] == pytest.approx(history[-1]["seconds"], rel=1e-9)
    assert plain["monitor"]["throughput/eval_time"] == 0.0
    print(f"\nin-loop evaluation on one process (tiny_mc + tiny_gen: 48 + 5 requests): "
          f"{[round(h['seconds'], 3) for h in history]} s per run, {history[-1]['forward_passes']} forward passes; "
          f"a training step {plain['monitor']['throughput/step_time']:.3f} s")


# ---------------------------------------------------------------------------------------------------- bad input


def _eval_cli(args: list[str], capsys) -> tuple[int, str]:
    from lightning_hybrid import cli

    code = cli.main(["eval", *args])
    err = capsys.readouterr().err.strip()
    return code, err


def test_an_unknown_task_is_one_line_with_the_closest_names(folder, capsys, offline):
    code, err = _eval_cli(["--config", str(folder / "recipe.yaml"), "--tasks", "helaswag"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "unknown task 'helaswag'" in err and "did you mean hellaswag" in err, err


def test_the_missing_extra_is_named(folder, capsys, monkeypatch):
    from lightning_hybrid.eval import DownstreamEval

    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if lm-eval were not installed
    with pytest.raises(ValueError, match=r"lm-evaluation-harness \(lm-eval\).*pip install 'lightning-hybrid\[eval\]'"):
        DownstreamEval(["tiny_mc"], every_n_steps=2)
    code, err = _eval_cli(["--tasks", "tiny_mc"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "pip install 'lightning-hybrid[eval]'" in err, err


def test_a_checkpoint_that_is_not_there_is_one_line(folder, capsys, tmp_path):
    code, err = _eval_cli(["--config", str(folder / "recipe.yaml"), "--tasks", "tiny_mc", "--checkpoint",
                           str(tmp_path / "no" / "step-000004")], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "step-000004: no such checkpoint folder" in err, err
    (tmp_path / "empty").mkdir()
    code, err = _eval_cli(["--tasks", "tiny_mc", "--checkpoint", str(tmp_path / "empty")], capsys)
    assert code == 2 and "not a committed checkpoint" in err, err


def test_a_sampling_task_is_refused_in_one_line_naming_it(folder, capsys, offline):
    from lightning_hybrid.eval import DownstreamEval

    with pytest.raises(ValueError, match="task 'tiny_sample' samples its generations.*decodes greedily only"):
        DownstreamEval(["tiny_mc", "tiny_sample"], every_n_steps=2, include_path=str(folder / "tasks"))
    code, err = _eval_cli(["--tasks", "tiny_sample", "--include_path", str(folder / "tasks")], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "task 'tiny_sample' samples" in err, err


def test_no_tokenizer_and_bad_numbers_are_one_line(folder, capsys, offline):
    from lightning_hybrid.eval import DownstreamEval

    code, err = _eval_cli(["--config", str(folder / "recipe.yaml"), "--tasks", "tiny_mc", "--include_path",
                           str(folder / "tasks")], capsys)
    assert code == 2 and "the model has no tokenizer: pass the model's Hugging Face tokenizer (a folder or repo id) " \
        "as --tokenizer PATH, or load the model with --model.init_from_hf DIR" in err, err
    code, err = _eval_cli(["--tasks", "tiny_mc", "--limit", "-3"], capsys)
    assert code == 2 and "limit=-3.0 must be a number of documents" in err, err
    code, err = _eval_cli(["--config", str(folder / "recipe.yaml")], capsys)
    assert code == 2 and "--tasks is required" in err, err
    with pytest.raises(ValueError, match="every_n_steps=0 must be an integer >= 1"):
        DownstreamEval(["tiny_mc"], every_n_steps=0, include_path=str(folder / "tasks"))


# ---------------------------------------------------------------------------------------------------- the extra


def test_only_the_harness_adapter_imports_lm_eval_and_nothing_imports_it_at_module_level():
    """``import lightning_hybrid`` (and ``lightning_hybrid.eval``) works without the extra: lm-evaluation-harness is
    imported at module level only by ``lightning_hybrid/eval/harness.py``, which every other module imports inside
    a function."""
    root = TESTS.parent / "lightning_hybrid"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.split(".")[0] == "lm_eval" or n == "lightning_hybrid.eval.harness"]
            if bad and path.name != "harness.py":
                offenders.append(f"{path.relative_to(root)}: {bad}")
    assert not offenders, offenders
    assert "from lm_eval" in (root / "eval" / "harness.py").read_text()


def test_the_72b_recipe_carries_a_commented_downstream_eval_block_with_its_predicted_time():
    import inspect

    import yaml

    from lightning_hybrid.eval import DownstreamEval

    text = (TESTS.parent / "recipes" / "qwen2.5-72b-pretrain.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if "# - class_path: lightning_hybrid.eval.DownstreamEval" in line)
    block = [text[start]]
    for line in text[start + 1:]:
        if not line.startswith("    #   "):
            break
        block.append(line)
    (entry,) = yaml.safe_load("\n".join(line.replace("    # ", "", 1) for line in block))
    arguments = entry["init_args"]
    assert set(arguments) <= set(inspect.signature(DownstreamEval).parameters), arguments
    assert arguments["tasks"] and arguments["every_n_steps"] >= 1 and arguments["limit"] >= 1
    comment = " ".join(text[start - 8:start])
    assert "predicted from the planner's forward-pass time" in comment and "benchmarks/eval_time.py" in comment
