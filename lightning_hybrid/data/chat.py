"""Chat conversations to token ids and an assistant-token mask, with the tokenizer's own chat template.

The template is the tokenizer's (``apply_chat_template``), or the Jinja file given with ``--chat-template``; never
one of ours. Which tokens are the assistant's:

- a template with ``{% generation %}`` blocks: ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
- otherwise the spans are found by rendering prefixes: the text of turns ``< i`` with the generation prompt ends
  where assistant turn ``i`` starts, the text of turns ``<= i`` where it ends (trailing whitespace after the
  end-of-turn token excluded). Each span's tokens (by character offsets of the tokenized full text) are marked.

Both give the ids of ``apply_chat_template(messages, tokenize=True)``; the mask covers each assistant reply and
its end-of-turn token.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import numpy as np

__all__ = ["ROLES", "check_conversation", "ChatEncoder", "load_chat_tokenizer"]

ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def check_conversation(location: str, record: Any, messages_key: str) -> tuple[list[dict[str, Any]], bool]:
    """The messages of ``record`` and whether one of them is an assistant turn.

    Raises:
        ValueError: (one line naming ``location``) no ``messages_key`` list, a message that is not an object with
            a known role and string content.
    """
    messages = record.get(messages_key) if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{location}: no {messages_key!r} list of messages; pass --messages-key with the field "
                         f"that holds them")
    for number, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ValueError(f"{location}: message {number} has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str) and not message.get("tool_calls"):
            raise ValueError(f"{location}: message {number} ({role}) has no string 'content'")
    return messages, any(m["role"] == "assistant" for m in messages)


def load_chat_tokenizer(path: str, chat_template: Optional[str] = None) -> Any:
    """The Hugging Face fast tokenizer of ``path`` with its chat template (or the Jinja file ``chat_template``).

    Raises:
        ValueError: the tokenizer is not a fast one, or has no chat template and none was given.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ValueError("prepare-data --format chat needs transformers (apply_chat_template); "
                         "pip install 'lightning-hybrid[data]'") from err

    from lightning_hybrid.data.sources import TOKENIZER_PATTERNS
    from lightning_hybrid.hub import resolve_hf_path

    hf = AutoTokenizer.from_pretrained(str(resolve_hf_path(path, allow_patterns=TOKENIZER_PATTERNS)))
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{path} has no fast tokenizer (tokenizer.json); prepare-data needs one")
    if chat_template is not None:
        file = Path(chat_template)
        if not file.is_file():
            raise FileNotFoundError(f"--chat-template {file} does not exist")
        hf.chat_template = file.read_text(encoding="utf-8")
    if not getattr(hf, "chat_template", None):
        raise ValueError(f"tokenizer {path} has no chat template; pass --chat-template FILE with a Jinja template")
    return hf


class ChatEncoder:
    """Conversation -> (token ids uint32, assistant mask uint8) with ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template
        self.generation_tags = isinstance(template, str) and bool(_GENERATION.search(template))

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, messages: list[dict[str, Any]], location: str = "") -> tuple[np.ndarray, np.ndarray]:
        """Token ids and assistant mask of one conversation.

        Raises:
            ValueError: the template renders a conversation's prefixes inconsistently (use ``{% generation %}``).
        """
        if self.generation_tags:
            out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
            return (np.asarray(out["input_ids"], dtype=np.uint32),
                    np.asarray(out["assistant_masks"], dtype=np.uint8))
        text = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self._render(messages[:i], generation_prompt=True)) if i else 0
            through = self._render(messages[:i + 1])
            if not text.startswith(through) or start > len(through):
                raise ValueError(f"{location}: the chat template does not render the turns before assistant turn "
                                 f"{i} as a prefix of the conversation; use a template with {{% generation %}}")
            end = len(through.rstrip())
            spans.append((start, end))
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.uint32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        for start, end in spans:  # a token overlapping the reply's characters is the reply's
            mask[(offsets[:, 0] < end) & (offsets[:, 1] > start)] = 1
        return ids, mask
