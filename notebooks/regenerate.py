"""Build the walkthrough notebooks from their Python sources and execute them in place, outputs (plots) included.

Each notebook is written as a plain Python file in ``notebooks/src/`` ("percent" format: a line ``# %%`` starts
a code cell, ``# %% [markdown]`` a markdown cell whose lines are ``# ``-commented). This script turns every source
into ``notebooks/<name>.ipynb`` with nbformat and runs it top to bottom with nbclient (kernel ``python3``, working
directory ``notebooks/``), so the committed notebooks show their outputs on a code host.

    python notebooks/regenerate.py                 # all notebooks
    python notebooks/regenerate.py 02 03           # those whose name starts with 02 or 03
    python notebooks/regenerate.py --no-execute    # cells only, no outputs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
CELL_MARK = "# %%"


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``[(kind, source), ...]`` from a percent-format file; ``kind`` is ``"markdown"`` or ``"code"``.

    Raises:
        ValueError: text before the first cell marker, or a markdown line that is not a comment.
    """
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(CELL_MARK):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
            continue
        if not cells:
            if line.strip():
                raise ValueError(f"text before the first '{CELL_MARK}' marker: {line!r}")
            continue
        kind, lines = cells[-1]
        if kind == "markdown":
            if line.strip() and not line.startswith("#"):
                raise ValueError(f"a markdown cell line must start with '#': {line!r}")
            line = line[2:] if line.startswith("# ") else line.lstrip("#")
        lines.append(line)
    out = []
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if lines:
            out.append((kind, "\n".join(lines)))
    return out


def build(source: Path) -> nbformat.NotebookNode:
    """The notebook (without outputs) of one source file."""
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, text in parse_cells(source.read_text()):
        nb.cells.append(new_markdown_cell(text) if kind == "markdown" else new_code_cell(text))
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Run every cell in a fresh ``python3`` kernel with ``notebooks/`` as the working directory.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised; the message names the cell and the error.
    """
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(HERE)}})
    client.execute()
    return nb


def _with_sources_of(committed: nbformat.NotebookNode, built: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``committed`` with every cell's source replaced by ``built``'s (same cells, same kinds), outputs kept.

    Raises:
        ValueError: the cells do not line up (a cell was added, removed or changed kind: execute instead).
    """
    kinds = [c.cell_type for c in committed.cells], [c.cell_type for c in built.cells]
    if kinds[0] != kinds[1]:
        raise ValueError("the source's cells do not line up with the committed notebook's; regenerate with execution")
    for old, new in zip(committed.cells, built.cells):
        old.source = new.source
    return committed


def main(argv: Optional[list[str]] = None) -> int:
    """Regenerate the notebooks named on the command line (all by default); 0 on success."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="name prefixes, e.g. 01 02 (default: all)")
    parser.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (600)")
    parser.add_argument("--sources-only", action="store_true",
                        help="only update the cell sources of the committed notebook, keeping its outputs (for edits "
                             "that change no output, such as a renamed import path; the cells must line up)")
    args = parser.parse_args(argv)
    sources = sorted(SOURCES.glob("*.py"))
    if args.names:
        sources = [s for s in sources if any(s.stem.startswith(n) for n in args.names)]
    if not sources:
        print(f"no notebook source in {SOURCES} matches {args.names}", file=sys.stderr)
        return 2
    for source in sources:
        start = time.perf_counter()
        nb = build(source)
        target = HERE / f"{source.stem}.ipynb"
        if args.sources_only:
            nb = _with_sources_of(nbformat.read(target, as_version=4), nb)
        elif not args.no_execute:
            execute(nb, args.timeout)
        nbformat.write(nb, target)
        print(f"{target.relative_to(HERE.parent)}: {len(nb.cells)} cells"
              + ("" if args.no_execute or args.sources_only else f", executed in {time.perf_counter() - start:.0f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
