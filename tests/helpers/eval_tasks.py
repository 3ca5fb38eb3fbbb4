"""Local lm-evaluation-harness tasks, a word-level tokenizer and a recipe for the evaluation tests: nothing downloaded.

Three tasks in the harness's own YAML format, reading JSON lines from local files (``dataset_path: json`` with
``data_files``): ``tiny_mc`` (multiple choice: ``loglikelihood``), ``tiny_ppl`` (documents longer than
:data:`MAX_LENGTH` tokens: ``loglikelihood_rolling`` over several windows) and ``tiny_gen`` (``generate_until``, greedy,
stopping at "."); ``tiny_sample`` samples its generations (for the refusal). The tokenizer has exactly the tiny
preset's 256 tokens, so every id the model can produce decodes to a word.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["write_tokenizer", "write_tasks", "write_recipe", "TASKS", "MAX_LENGTH", "MAX_GEN_TOKS"]

TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]
MAX_LENGTH = 12  # tokens: the rolling documents (about 30 tokens) take three windows; MC prompts fit whole
MAX_GEN_TOKS = 4
_WORDS = ("the a cat dog bird sat ran flew on under over mat log tree red blue green sky grass sea is was what "
          "color of and who where sun moon big small").split()


def write_tokenizer(folder: Path) -> Path:
    """A word-level fast tokenizer of 256 tokens (``<unk>``, ``<eos>``, the words, fillers) saved for AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<eos>", ".", "?", *_WORDS]
    vocab += [f"w{i}" for i in range(256 - len(vocab))]
    raw = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocab)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _task(folder: Path, name: str, data: Path, body: str) -> None:
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{body}")


def write_tasks(folder: Path) -> Path:
    """The task YAML files and their data in ``folder`` (the ``include_path``)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    colors, things = ["red", "blue", "green"], ["sky", "grass", "sea", "mat", "log", "tree"]
    mc = [{"question": f"what color is the {rng.choice(things)} ?",
           "choices": [*rng.sample(colors, 2), "the cat sat", "dog"], "answer": i % 4} for i in range(12)]
    docs = [{"text": " ".join(rng.choice(_WORDS) for _ in range(30)) + " ."} for _ in range(3)]
    prompts = [{"prompt": f"the {rng.choice(['cat', 'dog', 'bird'])} {rng.choice(['sat', 'ran'])} on the",
                "answer": rng.choice(["mat", "log"])} for _ in range(5)]
    _task(folder, "tiny_mc", _jsonl(folder / "mc.jsonl", mc),
          'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
          'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    _task(folder, "tiny_ppl", _jsonl(folder / "ppl.jsonl", docs),
          'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
          '  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n')
    generation = ('output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
                  'metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n'
                  f'generation_kwargs:\n  until: ["."]\n  max_gen_toks: {MAX_GEN_TOKS}\n')
    _task(folder, "tiny_gen", _jsonl(folder / "gen.jsonl", prompts), generation + "  do_sample: false\n")
    _task(folder, "tiny_sample", folder / "gen.jsonl", generation + "  do_sample: true\n  temperature: 1.0\n")
    return folder


def write_recipe(path: Path) -> Path:
    """A tiny-model recipe on 4 CPU processes at tp=2 x pp=2 (what ``lightning-hybrid eval`` reads)."""
    path.write_text("seed_everything: 1234\ntrainer:\n  accelerator: cpu\n  devices: 4\n  strategy:\n"
                    "    class_path: lightning_hybrid.HybridParallelStrategy\n"
                    "    init_args:\n      tp: 2\n      pp: 2\n"
                    "  precision: 32-true\n  enable_progress_bar: false\n  enable_model_summary: false\n"
                    "  logger: false\nmodel:\n  model: tiny\n")
    return path
