"""The tiny mixture-of-experts recipe trains on 4 CPU processes with ep=2 (as the tiny recipe is run in
``tests/test_recipes.py``: the command line on ranks forked from the tests' fork server), and TensorBoard gets each
sparse layer's load balance, load-balancing loss and dropped tokens beside the MFU of the active parameters."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from helpers.launch import launch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-moe-cpu.yaml"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tiny_moe_recipe_trains_with_ep2_and_logs_each_sparse_layer_beside_mfu(tmp_path):
    from lightning_hybrid.launch.torchrun import latest_version_dir, read_scalars

    result = launch(4, ["-m", "lightning_hybrid.cli", "fit", "--config", str(RECIPE),
                        "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
                        "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
                        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
                        "--data.init_args.max_bytes", "300000"], timeout=240)
    assert re.search(r"throughput: [\d,]+ tokens/s.*MFU", result.stdout), result.stdout[-3000:]
    scalars = read_scalars(latest_version_dir(tmp_path))
    losses = [value for _, value in scalars["train_loss"]]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    for layer in (0, 2, 3):  # tiny-moe's sparse layers (layer 1 is a dense MLP)
        balance = [v for _, v in scalars[f"moe/layer_{layer}/load_max_over_mean"]]
        assert len(balance) == 4 and all(1.0 <= v <= 4.0 for v in balance), balance  # 8 experts, top-2: at most 4
        assert all(0.0 < v < 8.0 for _, v in scalars[f"moe/layer_{layer}/aux_loss"])
        assert all(v == 0.0 for _, v in scalars[f"moe/layer_{layer}/dropped_tokens"])  # dropless
    assert "moe/layer_1/aux_loss" not in scalars
    assert all(0.0 < v < 1.0 for _, v in scalars["throughput/mfu"])
