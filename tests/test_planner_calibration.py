"""The planner's parameter, gradient and optimizer bytes equal what ranks really allocate (4 gloo processes).

The worker shards small models with the strategy's own functions (stage split, TP plan, FSDP2) and
steps AdamW once; every rank's local bytes must equal ``rank_memory`` at its mesh coordinates, exactly.
The sizes are chosen so that chunks are uneven (vocabulary 250 over tp=4: 63, 63, 63, 61) and so that
an FSDP rank holds zero rows of a tensor (a 6-element bias over dp=4: 2, 2, 2, 0).
"""

from __future__ import annotations

import json

import pytest

from helpers.launch import TESTS, launch
from lightning_hybrid.models import Qwen2Config
from lightning_hybrid.planner.search import rank_memory

ODD = dict(vocab_size=250, hidden_size=48, intermediate_size=100, num_hidden_layers=5, num_attention_heads=8,
           num_key_value_heads=4, max_position_embeddings=64)
ZERO_ROWS = dict(vocab_size=97, hidden_size=12, intermediate_size=30, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64)
TINY = {k: v for k, v in Qwen2Config.from_preset("tiny").to_dict().items() if k != "name"}

LAYOUTS = [
    dict(name="tiny-tp2-dp2-fsdp", config=TINY, tp=2, pp=1, dp=2, data_parallel="fsdp"),
    dict(name="odd-tp2-dp2-fsdp", config=ODD, tp=2, pp=1, dp=2, data_parallel="fsdp"),
    dict(name="odd-tp2-dp2-replicate", config=ODD, tp=2, pp=1, dp=2, data_parallel="replicate"),
    dict(name="odd-tp4", config=ODD, tp=4, pp=1, dp=1, data_parallel="fsdp"),
    dict(name="zero-rows-dp4-fsdp", config=ZERO_ROWS, tp=1, pp=1, dp=4, data_parallel="fsdp"),
    dict(name="odd-pp2-dp2-fsdp", config=ODD, tp=1, pp=2, dp=2, data_parallel="fsdp"),
    dict(name="odd-tp2-pp2", config=ODD, tp=2, pp=2, dp=1, data_parallel="fsdp"),
    dict(name="odd-pp2-v2-dp2-fsdp", config=ODD, tp=1, pp=2, dp=2, data_parallel="fsdp", virtual_stages=2),
    dict(name="zero-rows-pp2-vshape-dp2-fsdp", config=ZERO_ROWS, tp=1, pp=2, dp=2, data_parallel="fsdp",
         virtual_stages=2, schedule="zbv_zero_bubble"),
]


@pytest.fixture(scope="module")
def allocations(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration")
    spec = out / "layouts.json"
    spec.write_text(json.dumps(LAYOUTS))
    launch(4, [str(TESTS / "planner_calibration_worker.py"), str(spec), str(out)], timeout=200)
    return [record for rank in range(4) for record in json.loads((out / f"rank{rank}.json").read_text())]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", ["param_numel", "param_tensors", "param_bytes", "grad_bytes", "optimizer_bytes"])
def test_rank_memory_equals_real_allocation_on_every_rank(allocations, key):
    layouts = {layout["name"]: layout for layout in LAYOUTS}
    assert len(allocations) == 4 * len(LAYOUTS)
    mismatches = []
    for record in allocations:
        layout = layouts[record["name"]]
        c = record["coords"]
        predicted = rank_memory(Qwen2Config(**layout["config"]), layout["tp"], layout["pp"], layout["dp"],
                                layout["data_parallel"], c["pp"], c["tp"], c["dp"], precision="32-true",
                                virtual_stages=layout.get("virtual_stages", 1),
                                stage_style="v" if layout.get("schedule") == "zbv_zero_bubble" else "loop")
        if predicted[key] != record[key]:
            mismatches.append(f"{record['name']} {c}: predicted {predicted[key]}, allocated {record[key]}")
    assert not mismatches, "\n".join(mismatches)
