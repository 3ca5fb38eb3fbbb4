"""The tiny SFT recipe runs the whole path on 4 CPU processes (tp=2 x pp=2): the repository's own chat tokenizer and
conversations, prepare-data --format chat, then fit with document masking."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from helpers.launch import launch
from lightning_hybrid.data.prepare import prepare_main
from lightning_hybrid.data.tiny_chat import main as tiny_chat_main

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-sft-cpu.yaml"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tiny_sft_recipe_trains_on_tp2_pp2_with_a_falling_loss(tmp_path):
    from lightning_hybrid.launch.torchrun import latest_version_dir, read_scalars

    # The header's three commands, with this test's folders.
    assert tiny_chat_main([str(tmp_path / "tiny-chat"), "--conversations", "600"]) == 0
    assert prepare_main(["--format", "chat", "--tokenizer", str(tmp_path / "tiny-chat" / "tokenizer"), "--input",
                         str(tmp_path / "tiny-chat" / "chat.jsonl"), "--output", str(tmp_path / "data"),
                         "--seq-len", "256"]) == 0
    result = launch(4, ["-m", "lightning_hybrid.cli", "fit", "--config", str(RECIPE),
                        "--data.init_args.path", str(tmp_path / "data"), "--data.init_args.val_fraction", "0.05",
                        "--trainer.max_steps", "8", "--trainer.val_check_interval", "8",
                        "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
                        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir",
                        str(tmp_path)], timeout=360)
    assert re.search(r"throughput: [\d,]+ tokens/s", result.stdout), result.stdout[-3000:]
    scalars = read_scalars(latest_version_dir(tmp_path))
    losses = [value for _, value in scalars["train_loss"]]
    print("tiny SFT losses:", [round(v, 3) for v in losses])
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses), losses
    assert min(losses[-3:]) < losses[0], f"the loss did not fall in 8 steps: {losses}"
    assert [v for _, v in scalars["val_loss"]]
