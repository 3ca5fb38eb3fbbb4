"""A checkpoint folder belongs to one run lineage (lightning_hybrid/checkpoint/lineage.py): a second run never deletes,
skips over or mixes with another run's checkpoints; it refuses in one line or archives them, and each lineage can
resume afterwards. One process per run (the lineage logic is rank 0's, broadcast to the others)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest

from helpers.equivalence import GLOBAL_BATCH, SEED, make_dataset, make_trainer_kwargs, tiny_config
from lightning_hybrid import FaultTolerantCheckpoint, HybridParallelStrategy
from lightning_hybrid.checkpoint.lineage import ForeignCheckpointsError, Lineage, check_folder
from lightning_hybrid.checkpoint.manifest import committed_checkpoints, purge_old, read_manifest
from lightning_hybrid.models import CausalLM

pytestmark = pytest.mark.timeout(600)


def _fit(dirpath: Path, steps: int, ckpt_path=None, **callback_kwargs) -> tuple[FaultTolerantCheckpoint, L.Trainer]:
    """Train the tiny model (``hidden_size`` given: a wider one) for ``steps`` steps, a checkpoint every 2 steps."""
    hidden = callback_kwargs.pop("hidden_size", 64)
    L.seed_everything(SEED)
    callback = FaultTolerantCheckpoint(dirpath, every_n_steps=2, async_save=False, keep_last=3, **callback_kwargs)
    kwargs = {**make_trainer_kwargs()["trainer"], "max_steps": steps, "val_check_interval": None,
              "limit_val_batches": 0}
    trainer = L.Trainer(strategy=HybridParallelStrategy(), devices=1, callbacks=[callback], **kwargs)
    module = CausalLM(tiny_config(hidden_size=hidden, intermediate_size=2 * hidden, name=f"tiny-{hidden}"),
                      **make_trainer_kwargs()["module"])
    train, _ = make_dataset(GLOBAL_BATCH)
    trainer.fit(module, train_dataloaders=train, ckpt_path=ckpt_path)
    return callback, trainer


def _steps(folder: Path) -> list[int]:
    return sorted(c.step for c in committed_checkpoints(folder))


def _run_ids(folder: Path) -> set:
    return {read_manifest(c.path)["run_id"] for c in committed_checkpoints(folder)}


def _snapshot(folder: Path) -> dict[str, str]:
    return {c.path.name: (c.path / "meta.json").read_text() for c in committed_checkpoints(folder)}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> tuple[Path, str]:
    """Run A: the tiny model trained to step 12 in its folder (keeps steps 8, 10, 12)."""
    folder = tmp_path_factory.mktemp("lineage") / "ckpt"
    callback, _ = _fit(folder, 12)
    return folder, callback.lineage.run_id


@pytest.fixture
def shared(run_a, tmp_path) -> tuple[Path, str]:
    folder = tmp_path / "ckpt"
    shutil.copytree(run_a[0], folder)
    return folder, run_a[1]


def test_every_manifest_names_the_run_and_a_resume_keeps_it(shared):
    folder, run_id = shared
    assert _steps(folder) == [8, 10, 12] and _run_ids(folder) == {run_id} and len(run_id) == 12
    callback, trainer = _fit(folder, 16)  # auto-resume: the same lineage goes on
    assert callback.resumed_from == folder / "step-000012" and callback.lineage.run_id == run_id
    assert _steps(folder) == [12, 14, 16] and _run_ids(folder) == {run_id}


def test_a_new_run_in_a_folder_of_another_run_refuses_in_one_line_before_training(shared):
    folder, run_id = shared
    before = _snapshot(folder)
    with pytest.raises(ForeignCheckpointsError) as caught:
        _fit(folder, 12, auto_resume=False, hidden_size=128)
    message = str(caught.value)
    assert "\n" not in message
    assert f"checkpoint folder {folder} holds checkpoints of another run (run {run_id}: model tiny-64 " \
           f"(hidden_size=64, num_hidden_layers=4), newest step 12, 3 checkpoints)" in message
    assert "Give this run another dirpath" in message and 'on_foreign="archive"' in message
    assert _snapshot(folder) == before and not list(folder.glob("step-*.tmp"))  # nothing trained, nothing written


def test_the_refusal_is_known_before_launch_from_the_manifests(shared):
    folder, run_id = shared
    with pytest.raises(ForeignCheckpointsError, match=f"run {run_id}: model tiny-64"):
        FaultTolerantCheckpoint(folder, every_n_steps=2, auto_resume=False).check_lineage()
    FaultTolerantCheckpoint(folder, every_n_steps=2).check_lineage()  # auto-resume continues run A: fine
    check_folder(folder, folder / "step-000010", auto_resume=False)  # resuming A from its own checkpoint: fine
    FaultTolerantCheckpoint(folder, every_n_steps=2, auto_resume=False, on_foreign="archive").check_lineage()
    with pytest.raises(ValueError, match=r"on_foreign='delete'; use one of 'refuse', 'archive'"):
        FaultTolerantCheckpoint(folder, every_n_steps=2, on_foreign="delete")


def test_archive_moves_the_other_run_aside_and_each_lineage_resumes_on_its_own(shared):
    folder, run_a_id = shared
    before = _snapshot(folder)
    # run B: a wider model, a new run, into the same folder; it saves steps 2..10, retention keeps 3 of its own
    b, _ = _fit(folder, 10, auto_resume=False, hidden_size=128, on_foreign="archive")
    archive = folder / f"archived-{run_a_id}"
    assert _snapshot(archive) == before  # run A's checkpoints all moved, none deleted or changed
    assert _steps(folder) == [6, 8, 10] and _run_ids(folder) == {b.lineage.run_id} != {run_a_id}
    assert (folder / "latest").read_text().strip() == "step-000010"
    assert not list(folder.glob("step-*.replaced*"))  # steps 8 and 10 were written, not skipped

    # B resumes in the folder: its own newest, never A's
    b2, _ = _fit(folder, 12, hidden_size=128)
    assert b2.resumed_from == folder / "step-000010" and b2.lineage.run_id == b.lineage.run_id
    assert _steps(folder) == [8, 10, 12] and _snapshot(archive) == before

    # A resumes from its archive folder and goes on there with its run id
    a2, _ = _fit(archive, 14)
    assert a2.resumed_from == archive / "step-000012" and a2.lineage.run_id == run_a_id
    assert _steps(archive) == [10, 12, 14] and _run_ids(archive) == {run_a_id}


def test_a_save_never_skips_a_step_whose_folder_exists_it_sets_that_one_aside(shared):
    folder, run_id = shared
    old_ten = (folder / "step-000010" / "meta.json").read_text()
    # resume A from its step 8: steps 10 and 12 of the older branch exist and must not be skipped
    callback, _ = _fit(folder, 12, ckpt_path=str(folder / "step-000008"))
    assert callback.lineage.run_id == run_id
    assert (folder / "step-000010.replaced" / "meta.json").read_text() == old_ten
    assert (folder / "step-000012.replaced").is_dir()
    assert (folder / "step-000010" / "meta.json").read_text() != old_ten  # written anew by the resumed branch


def test_retention_deletes_only_the_lineage_own_checkpoints(tmp_path):
    for step, run in [(2, "a"), (4, "b"), (6, "a"), (8, "b"), (10, "a"), (12, "b")]:
        path = tmp_path / f"step-{step:06d}"
        path.mkdir()
        (path / "meta.json").write_text(json.dumps({"run_id": run, "step": step}))
    mine = Lineage("b")
    removed = purge_old(tmp_path, 1, owns=lambda p: mine.owns(json.loads((p / "meta.json").read_text())["run_id"]))
    assert sorted(p.name for p in removed) == ["step-000004", "step-000008"]
    assert _steps(tmp_path) == [2, 6, 10, 12]


def test_resuming_an_unlabelled_checkpoint_adopts_the_unlabelled_ones(tmp_path):
    for step in (2, 4):
        (tmp_path / f"step-{step:06d}").mkdir()
        (tmp_path / f"step-{step:06d}" / "meta.json").write_text(json.dumps({"step": step}))
    lineage = Lineage.resuming(tmp_path / "step-000004")
    assert lineage.owns(None) and lineage.owns(lineage.run_id) and not Lineage.resuming(None).owns(None)
    check_folder(tmp_path, None, auto_resume=True)
    with pytest.raises(ForeignCheckpointsError, match="run without run id"):
        check_folder(tmp_path, None, auto_resume=False)
