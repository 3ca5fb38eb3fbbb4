"""A tiny chat tokenizer and conversations made here, for the CPU SFT recipe and the tests (no download).

``python -m lightning_hybrid.data.tiny_chat OUT`` writes ``OUT/tokenizer`` (a byte-level ``tokenizers`` BPE
without merges, wrapped as a ``PreTrainedTokenizerFast`` with a ChatML Jinja template like Qwen2.5's) and
``OUT/chat.jsonl`` (synthetic arithmetic conversations with a system, user and assistant turn).

The vocabulary is the ``tiny`` preset's 256 ids: 253 byte tokens (the control bytes 0x00-0x02 are left out, they
do not occur in text) and ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` as ids 253-255.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Optional, Sequence, Union

__all__ = ["CHATML_TEMPLATE", "CHATML_GENERATION_TEMPLATE", "build_tiny_chat_tokenizer", "write_tiny_conversations",
           "TINY_CHAT_VOCAB"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The same rendering with the assistant replies (and their end-of-turn token) in {% generation %} blocks.
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_VOCAB = 256
_LEFT_OUT_BYTES = (0, 1, 2)  # ByteLevel writes bytes 0, 1, 2 as U+0100, U+0101, U+0102


def build_tiny_chat_tokenizer(folder: Union[str, Path], chat_template: Optional[str] = CHATML_TEMPLATE) -> Path:
    """Write a byte-level fast tokenizer with a ChatML template to ``folder`` (``save_pretrained``); returns it.

    ``chat_template=None`` writes one without a template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    left_out = {chr(256 + b) for b in _LEFT_OUT_BYTES}
    alphabet = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - left_out)
    vocab = {char: i for i, char in enumerate(alphabet)}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    if chat_template is not None:
        hf.chat_template = chat_template
    out = Path(folder)
    hf.save_pretrained(str(out))
    return out


def write_tiny_conversations(file: Union[str, Path], count: int = 2000, seed: int = 0) -> Path:
    """``count`` synthetic conversations (system, user asks a sum, assistant answers; some two rounds) as JSONL."""
    rng = random.Random(seed)
    path = Path(file)
    with path.open("w", encoding="utf-8") as out:
        for _ in range(count):
            messages = [{"role": "system", "content": "You add numbers."}]
            for _ in range(rng.choice((1, 1, 2))):
                a, b = rng.randrange(1000), rng.randrange(1000)
                messages.append({"role": "user", "content": f"What is {a} + {b}?"})
                messages.append({"role": "assistant", "content": f"{a} + {b} = {a + b}."})
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_hybrid.data.tiny_chat",
                                     description="Write a tiny chat tokenizer (OUT/tokenizer) and conversations "
                                                 "(OUT/chat.jsonl).")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--conversations", type=int, default=2000, help="how many conversations")
    args = parser.parse_args(list(argv) if argv is not None else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_chat_tokenizer(out / "tokenizer")
    write_tiny_conversations(out / "chat.jsonl", args.conversations)
    print(f"wrote {out / 'tokenizer'} (vocabulary {TINY_CHAT_VOCAB}) and {args.conversations} conversations to "
          f"{out / 'chat.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
