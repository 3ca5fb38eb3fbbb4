"""Loading a checkpoint never runs code: its .pt files are read with weights_only=True, and nothing else unpickles."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from lightning_hybrid.checkpoint.dcp import TRAINER_STATE, load_plain, load_rng, load_trainer_state, rng_state
from lightning_hybrid.checkpoint.manifest import CheckpointError

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hybrid"


class _Payload:
    """Unpickling this creates a marker file: what an attacker with write access to the checkpoint folder plants."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_trainer_state_with_a_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"epoch": 0, "global_step": 4, "loops": _Payload(marker)}, tmp_path / TRAINER_STATE)
    with pytest.raises(CheckpointError) as caught:
        load_trainer_state(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "refusing to load" in message and TRAINER_STATE in message
    assert "it names getattr" in message  # names what the pickle asked for (Path.touch, reached via getattr)
    assert not marker.exists()


def test_an_rng_file_with_a_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "rng").mkdir()
    torch.save({"python": _Payload(marker)}, tmp_path / "rng" / "rank_0.pt")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_rng(tmp_path, 0, print)
    assert not marker.exists()


def test_random_states_round_trip_through_the_plain_format(tmp_path):
    import random

    import numpy as np

    torch.save(rng_state(), tmp_path / "rng.pt")
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    (tmp_path / "rng").mkdir()
    os.replace(tmp_path / "rng.pt", tmp_path / "rng" / "rank_0.pt")
    assert load_rng(tmp_path, 0, print)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


def test_lightnings_own_trainer_state_loads_with_weights_only(tmp_path):
    state = {"epoch": 1, "global_step": 8, "pytorch-lightning_version": "2.6.6",
             "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
             "lr_schedulers": [{"base_lrs": [0.003], "last_epoch": 8, "lr_lambdas": [None]}],
             "hyper_parameters": {"lr": 0.003, "betas": (0.9, 0.95)}, "hybrid": {"data_position": None}}
    torch.save(state, tmp_path / TRAINER_STATE)
    assert load_plain(tmp_path / TRAINER_STATE) == state


def test_the_package_never_unpickles_without_weights_only():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in ("pickle.load", "pickle.loads", "pickle.Unpickler"):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
            if name == "torch.load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} torch.load without "
                                     f"weights_only=True")
    assert not offenders, "\n".join(offenders)
