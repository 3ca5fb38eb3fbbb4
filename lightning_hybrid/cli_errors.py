"""One line for a config or command-line parse error of ``lightning-hybrid fit/validate/test/predict``.

jsonargparse reports a bad value or an unknown key as a nested, multi-line message (60-75 lines with the usage).
:func:`parse_error_line` reduces it to one line: the key (as a command-line option), the bad value and what is
expected, or for an unknown key the closest valid one ("did you mean `tensor_parallel_size`?").
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from typing import Iterable, Optional

__all__ = ["parse_error_line", "closest"]

# Names users bring from other tools, mapped to ours (offered when nothing closer is found).
ALIASES = {"learning_rate": "lr", "lr_scheduler_type": "lr_schedule", "warmup": "warmup_steps",
           "tensor_parallel": "tensor_parallel_size", "pipeline_parallel": "pp", "data_parallel_size": "dp"}

_NOT_SECTIONS = {"help", "print_config", "print_shtab", "subcommand", "config", "verbose"}
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"given class_path '([^']+)'")
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (\S+)")
_NOT_ACCEPT_OPTION = re.compile(r"does not accept option '([^']+)'")
_KEY_NOT_EXPECTED = re.compile(r"Key '([^']+)' is not expected")
_EXPECTED = re.compile(r"Expected a (?:<class '([^']+)'>|typing\.Literal\[([^\]]+)\]|(\S+?))(?:\.|$| )")
_GIVEN = re.compile(r"(?:Given value|Got value): (.+)$")


def closest(name: str, valid: Iterable[str]) -> Optional[str]:
    """The valid key closest to ``name`` (difflib, then :data:`ALIASES`), or ``None``."""
    valid = sorted(set(valid))
    found = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if found:
        return found[0]
    alias = difflib.get_close_matches(name, list(ALIASES), n=1, cutoff=0.75)
    return ALIASES[alias[0]] if alias and ALIASES[alias[0]] in valid else None


def _init_args(class_path: str) -> list[str]:
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, ValueError, TypeError):
        return []


def _suggest(name: str, valid: Iterable[str], prefix: str = "") -> str:
    match = closest(name, valid)
    return f"; did you mean `{prefix}{match}`?" if match else ""


def _expected(lines: list[str]) -> tuple[list[str], Optional[str]]:
    """What the innermost key expects (``int``, ``'auto'``) and the value given."""
    expected, given = [], None
    for line in lines:
        text = line.strip().lstrip("- ")
        for m in _EXPECTED.finditer(text):
            kind = m.group(1) or m.group(2) or m.group(3)
            if kind and kind not in expected:
                expected.append(kind)
        g = _GIVEN.search(text)
        if g and given is None and "NestedArg" not in g.group(1):
            given = g.group(1).strip()
    return expected, given


def parse_error_line(message: str, option_keys: Iterable[str] = ()) -> str:
    """One line for jsonargparse's ``message``; ``option_keys`` are the parser's known keys (``trainer.max_steps``),
    used to suggest the closest one for an unknown key."""
    keys = list(option_keys)
    text = message.strip()
    path = _PARSER_KEY.findall(text)
    class_path = _CLASS_PATH.search(text)
    outer = path[0] if path else ""
    if (m := _NOT_ACCEPTED.search(text)) and class_path:
        name, cls = m.group(1), class_path.group(1)
        return (f"--{outer}.init_args.{name}: {cls.rpartition('.')[2]} has no argument {name!r}"
                f"{_suggest(name, _init_args(cls))}")
    if m := (_UNRECOGNIZED.search(text) or _NOT_ACCEPT_OPTION.search(text) or _KEY_NOT_EXPECTED.search(text)):
        key = m.group(1).lstrip("-")
        parent, _, name = key.rpartition(".")
        siblings = [k[len(parent) + 1:] for k in keys if parent and k.startswith(parent + ".")]
        siblings = [k for k in siblings if "." not in k]
        sections = sorted({k.split(".")[0] for k in keys} - _NOT_SECTIONS)
        head = key.split(".")[0]
        if head not in sections and head not in _NOT_SECTIONS:  # a misspelled section (`trainr:`)
            return f"unknown section `{head}`; expected one of {', '.join(sections)}{_suggest(head, sections)}"
        return f"--{key}: unknown key{_suggest(name, siblings, parent + '.')}"
    if path:
        inner = path[-1]
        key = f"{outer}.init_args.{inner}" if class_path and inner != outer else outer
        start = text.rfind(f'Parser key "{inner}"')
        expected, given = _expected(text[start:].splitlines()[1:])
        what = " or ".join(expected) if expected else "another value"
        return f"--{key}: {given!r} is not valid; expected {what}" if given else f"--{key}: expected {what}"
    return " ".join(text.split())
