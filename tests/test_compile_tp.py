"""``compile=True`` with tensor parallelism, sequence parallelism and recompute trains like one process.

On torch 2.13 this combination trained with wrong gradients until ``compile_blocks`` kept the TP hooks outside
the compiled graphs and turned inductor's donated buffers off for them (docs/performance.md). One torchrun launch on
4 processes trains both meshes; the reproduction in docs/ shows the error with the workaround switched off.
Inductor compiles on CPU (a C++ compiler is needed).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from helpers.compare import max_relative_error
from helpers.launch import run_workers, torchrun

REPRO = Path(__file__).resolve().parents[1] / "docs" / "compile-tp-repro.py"

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="inductor on CPU needs a C++ compiler")]

COMPILE_TOL = 1e-4  # fp32; inductor fuses and reorders the elementwise math

MESHES = {
    "tp2_dp2_sp_selective": {"tp": 2, "data_parallel": "fsdp", "sequence_parallel": True,
                             "activation_checkpointing": "selective"},
    "tp2_pp2_sp_full": {"tp": 2, "pp": 2, "sequence_parallel": True, "activation_checkpointing": "full"},
}


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    configs = [{"name": name, "compile": True, **mesh} for name, mesh in MESHES.items()]
    return run_workers(4, configs, tmp_path_factory.mktemp("compile_tp"), timeout=1400)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_compile_with_tp_sp_and_recompute_trains_like_one_process(compiled_runs, reference_run, name):
    record = compiled_runs[name]
    assert record["switches"]["compiled"] == {f"layers.{i}.{part}" for i in range(4) for part in ("self_attn", "mlp")}
    assert record["switches"]["recomputed"] == {f"layers.{i}": "op" if "selective" in name else "full"
                                                for i in range(4)}
    err = max_relative_error(record, reference_run)
    assert err["loss"] < COMPILE_TOL and err["weights"] < COMPILE_TOL, err


def test_the_reproduction_in_docs_is_exact_with_the_workaround(tmp_path):
    """``--workaround off`` is not tested: exact with fresh caches, wrong with warm ones (docs/performance.md)."""
    # Compiled afresh (no inductor/AOTAutograd cache shared with the suite's other compiled runs): the reproduction
    # is about what inductor generates for these graphs, not about an artifact another run left in the cache.
    fresh = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result = torchrun(2, [str(REPRO), "--workaround", "on"], timeout=1200, check=False, env=fresh)
    errors = [float(e) for e in re.findall(r"max relative gradient error (\S+)", result.stdout)]
    assert len(errors) == 2, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.returncode == 0 and max(errors) < 1e-5, result.stdout
