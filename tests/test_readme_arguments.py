"""The README's (and README.ko.md's) table of strategy arguments says what the constructor takes: every argument of
``HybridParallelStrategy.__init__`` has a row, in the constructor's order, no row names an argument that does not
exist, and every default in the table is the constructor's default. New arguments fail here until documented."""

from __future__ import annotations

import ast
import inspect
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_hybrid import HybridParallelStrategy

ROOT = Path(__file__).resolve().parents[1]
READMES = {"README.md": "| argument | default | meaning |", "README.ko.md": "| 인자 | 기본값 | 의미 |"}
HEADER = READMES["README.md"]


def table_rows(text: str, header: str = HEADER) -> list[tuple[str, str]]:
    """``(argument, default)`` of each row of the Markdown table that starts with ``header``."""
    lines = text.splitlines()
    start = lines.index(header) + 2  # after the header and the |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[1].strip("`")))
    return rows


def parse_default(cell: str) -> Any:
    """A default as the table writes it: a Python literal (``None``, ``1``, ``"fsdp"``) or ``timedelta(...)``."""
    if re.fullmatch(r"timedelta\((\w+=[\d.]+(, )?)+\)", cell):
        return eval(cell, {"__builtins__": {}, "timedelta": timedelta})  # noqa: S307 - the pattern allows only this
    return ast.literal_eval(cell)


def same_default(documented: Any, actual: Any) -> bool:
    """Equal and of one type (``600`` for ``600.0`` is fine; ``0`` for ``False`` or ``1`` for ``True`` is not)."""
    kinds = {type(documented), type(actual)}
    return documented == actual and (len(kinds) == 1 or kinds <= {int, float})


def constructor_defaults(cls: type) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@pytest.mark.parametrize("readme", list(READMES))
def test_every_constructor_argument_has_a_row_with_its_default_in_order(readme):
    rows = table_rows((ROOT / readme).read_text(), READMES[readme])
    documented = [name for name, _ in rows]
    code = constructor_defaults(HybridParallelStrategy)
    assert len(documented) == len(set(documented)), f"arguments documented twice: {documented}"
    missing, unknown = [n for n in code if n not in documented], [n for n in documented if n not in code]
    assert not missing and not unknown, f"README misses {missing}; documents arguments that do not exist: {unknown}"
    assert documented == list(code), "README's rows are not in the constructor's order"
    wrong = {name: (cell, code[name]) for name, cell in rows if not same_default(parse_default(cell), code[name])}
    assert not wrong, f"README defaults differ from the constructor's (README, code): {wrong}"


def test_the_check_names_what_is_missing_and_what_is_wrong():
    text = f"{HEADER}\n| --- | --- | --- |\n| `tp` | `2` | x |\n| `bogus` | `None` | y |\n"
    rows = table_rows(text)
    assert rows == [("tp", "2"), ("bogus", "None")]
    assert parse_default("timedelta(minutes=30)") == timedelta(seconds=1800)
    assert parse_default('"auto"') == "auto" and parse_default("600") == 600.0
    with pytest.raises((ValueError, SyntaxError)):
        parse_default("__import__('os')")

    class Strategy:
        def __init__(self, tp: int = 1, pp: int = 1) -> None:
            pass

    code = constructor_defaults(Strategy)
    assert [n for n in code if n not in dict(rows)] == ["pp"] and not same_default(parse_default("2"), code["tp"])
    assert not same_default(0, False) and not same_default(1, True) and same_default(600, 600.0)
