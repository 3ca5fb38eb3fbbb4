"""The walkthrough notebooks run top to bottom in a fresh ``python3`` kernel (nbclient), as committed.

Marked ``notebook`` so a quick run can leave them out (``-m "not notebook"``); ``.ci/run`` runs them. Each notebook
is executed from a copy in memory: the committed file and its outputs are not touched
(``python notebooks/regenerate.py`` rewrites them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
ALL = sorted(NOTEBOOKS.glob("*.ipynb"))
OWN = ("01_quickstart", "02_parallelism_explained", "03_planning_qwen2.5_72b", "04_fault_tolerance")


def test_the_walkthrough_notebooks_exist_with_their_sources_and_committed_outputs():
    nbformat = pytest.importorskip("nbformat")
    for name in OWN:
        assert (NOTEBOOKS / "src" / f"{name}.py").is_file(), f"notebooks/src/{name}.py is missing"
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.get("execution_count") for c in code), (
            f"{name}: not executed; run notebooks/regenerate.py")
        errors = [o for c in code for o in c.outputs if o.output_type == "error"]
        assert not errors, f"{name}: committed with an error output: {errors[0].get('ename')}"
        images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
        assert images, f"{name}: no plot in the committed outputs"


def test_the_committed_notebooks_match_their_sources():
    pytest.importorskip("nbformat")
    import nbformat

    spec = importlib.util.spec_from_file_location("regenerate", NOTEBOOKS / "regenerate.py")
    regenerate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regenerate)  # a script next to the notebooks, not on sys.path
    build = regenerate.build

    for name in OWN:
        built = [c.source for c in build(NOTEBOOKS / "src" / f"{name}.py").cells]
        committed = [c.source for c in nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells]
        assert built == committed, (
            f"{name}.ipynb is older than src/{name}.py; run python notebooks/regenerate.py {name[:2]}")


@pytest.mark.notebook
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=540, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the cell and the exception
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    if path.stem in OWN:
        assert images, f"{path.name} drew no plot"
