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


@pytest.mark.parametrize("auto_resume", [False, True])
def test_a_new_run_in_a_folder_of_another_run_refuses_in_one_line_before_training(shared, auto_resume):
    # Another model's checkpoints are another run's: auto-resume does not take them for its own (it used to, and then
    # failed to load them, "another model (tiny vs tiny)").
    folder, run_id = shared
    before = _snapshot(folder)
    with pytest.raises(ForeignCheckpointsError) as caught:
        _fit(folder, 12, auto_resume=auto_resume, hidden_size=128)
    message = str(caught.value)
    assert "\n" not in message
    assert f"checkpoint folder {folder} holds checkpoints of another run (run {run_id}: model tiny-64 " \
           f"(hidden_size 64, this run's 128, intermediate_size 128, this run's 256), newest step 12, " \
           f"3 checkpoints)" in message
    assert "Give this run another dirpath" in message and 'on_foreign="archive"' in message
    assert _snapshot(folder) == before and not list(folder.glob("step-*.tmp"))  # nothing trained, nothing written


def test_the_refusal_is_known_before_launch_from_the_manifests(shared):
    folder, run_id = shared
    with pytest.raises(ForeignCheckpointsError, match=f"run {run_id}: model tiny-64"):
        FaultTolerantCheckpoint(folder, every_n_steps=2, auto_resume=False).check_lineage()
    FaultTolerantCheckpoint(folder, every_n_steps=2).check_lineage()  # auto-resume continues run A: fine
    check_folder(folder, folder / "step-000010", auto_resume=False)  # resuming A from its own checkpoint: fine
    FaultTolerantCheckpoint(folder, every_n_steps=2, auto_resume=False, on_foreign="archive").check_lineage()
    # under auto-resume, a model of another shape is another run: refused naming the run and how the models differ
    wide = tiny_config(hidden_size=128, intermediate_size=256, name="tiny-64").to_dict()  # the same name, even
    with pytest.raises(ForeignCheckpointsError, match=rf"run {run_id}: model tiny-64 \(hidden_size 64, this run's "
                                                      rf"128, intermediate_size 128, this run's 256\), newest step 12"):
        FaultTolerantCheckpoint(folder, every_n_steps=2).check_lineage(model_config=wide)
    FaultTolerantCheckpoint(folder, every_n_steps=2, on_foreign="archive").check_lineage(model_config=wide)
    with pytest.raises(ValueError, match=rf"^checkpoint {folder / 'step-000010'} \(run {run_id}\) is of another "
                                         rf"model: hidden_size: checkpoint 64 vs model 128, intermediate_size: "):
        check_folder(folder, folder / "step-000010", auto_resume=True, current=wide, refuse=False)
    with pytest.raises(ValueError, match=r"on_foreign='delete'; use one of 'refuse', 'archive'"):
        FaultTolerantCheckpoint(folder, every_n_steps=2, on_foreign="delete")


def test_archive_moves_the_other_run_aside_and_each_lineage_resumes_on_its_own(shared):
    folder, run_a_id = shared
    before = _snapshot(folder)
    # run B: a wider model into the same folder, under auto-resume (the default), which does not take A's
    # checkpoints for B's: a new run; A's are archived; it saves steps 2..10, retention keeps 3 of its own
    b, _ = _fit(folder, 10, hidden_size=128, on_foreign="archive")
    assert b.resumed_from is None
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


@pytest.mark.distributed
@pytest.mark.parametrize("on_foreign", ["refuse", "archive"])
def test_workers_started_from_python_refuse_once_in_one_line_or_archive_under_auto_resume(shared, tmp_path,
                                                                                         on_foreign):
    """Two ranks of a script that calls ``trainer.fit`` (no CLI to refuse before launch), auto-resume on, in run A's
    folder with another model (intermediate_size 176, A's 128). ``refuse``: in the workers, before the model is
    built: global rank 0 prints the refusal once, as one line, every rank exits with 2, no traceback (it used to be
    a load error in every worker, "tiny vs tiny", 5 tracebacks). ``archive``: A's checkpoints are moved aside and
    the run starts fresh."""
    import json
    import re

    from helpers.launch import TESTS, launch

    folder, run_id = shared
    before = _snapshot(folder)
    result = launch(2, [str(TESTS / "lineage_worker.py")], timeout=300, check=False, keep_going=True,
                    env={"CKPT": str(folder), "ON_FOREIGN": on_foreign, "OUT": str(tmp_path)})
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-4000:]
    if on_foreign == "refuse":
        codes = sorted(re.findall(r"\[fork launcher\] rank (\d) exited with (-?\d+)", output))
        assert codes == [("0", "2"), ("1", "2")], output[-4000:]
        errors = [line for line in output.splitlines() if "holds checkpoints of another run" in line]
        assert errors == [f"lightning-hybrid: error: checkpoint folder {folder} holds checkpoints of another run "
                          f"(run {run_id}: model tiny-64 (intermediate_size 128, this run's 176), newest step 12, "
                          f"3 checkpoints); this new run would mix its history into theirs. Give this run another "
                          f"dirpath, or pass FaultTolerantCheckpoint(..., on_foreign=\"archive\") to move the other "
                          f"run's checkpoints into {folder}/archived-<run_id>/ (nothing is deleted)"], errors
        assert _snapshot(folder) == before and not list(folder.glob("step-*.tmp"))
        return
    assert result.returncode == 0, output[-4000:]
    done = json.loads((tmp_path / "done.json").read_text())
    assert done["resumed_from"] == "None" and done["run_id"] != run_id  # a fresh run, not a resume of A
    assert _snapshot(folder / f"archived-{run_id}") == before
    assert _steps(folder) == [1, 2] and _run_ids(folder) == {done["run_id"]}
