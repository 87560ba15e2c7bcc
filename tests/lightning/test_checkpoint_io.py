"""``ElasticCheckpointIO`` under ``ModelCheckpoint``: every path Lightning writes becomes one of
our committed checkpoints, with the options users set, loads and resumes as Lightning's own
files do, and is verified; one process (the 2-process runs are at the end, one launch).

Most checks fit twice with the same seed, with Lightning's ``TorchCheckpointIO`` and with ours,
and compare: the same paths, the same checkpoint contents, the same resumed training."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_elastic import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    CorruptCheckpointWarning,
    ElasticCheckpointIO,
    ElasticStrategy,
    IntegrityError,
    Storage,
    UnsupportedFormatError,
    consolidate,
)
from lightning_elastic.cli import main
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.lightning.checkpoint_io_rules import check_strategy
from lightning_elastic.testing.faults import Fault
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import checkpoint_io_workers
from tests.lightning.models import IdDataset, TinyModule, make_trainer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:The '\\w+_dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*the number of the training batches.*"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed from"),
]


class Monitored(TinyModule):
    """TinyModule logging ``score`` every step (lowest at step 6) and ``val_loss`` from a
    small validation set."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("score", abs(self.global_step - 6.0))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(8), batch_size=4)

    def on_train_epoch_end(self) -> None:
        """Nothing: TinyModule's epoch metrics fail on the empty epoch a resume from an
        end-of-epoch checkpoint runs (Lightning's, whichever plugin wrote it)."""


def fit(
    root: Path,
    *,
    ours: bool,
    max_steps: int = 12,
    ckpt_path: Any = None,
    callbacks: list[Any] | None = None,
    **checkpoint: Any,
) -> tuple[pl.Trainer, Monitored, ModelCheckpoint]:
    """A fit of 16-sample epochs (4 steps each) with a ModelCheckpoint in ``root/ckpts``."""
    pl.seed_everything(7, verbose=False)
    model = Monitored(n=16, hidden=16)
    callback = ModelCheckpoint(dirpath=root / "ckpts", **checkpoint)
    trainer = make_trainer(
        str(root),
        max_steps=max_steps,
        strategy="auto",
        devices=1,
        callbacks=[callback, *(callbacks or [])],
        plugins=[ElasticCheckpointIO()] if ours else None,
        check_val_every_n_epoch=1,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model, callback


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def assert_same(ours: Any, theirs: Any, roots: tuple[str, str], where: str = "") -> None:
    """Equal, tensors exactly, paths once ``roots`` (ours, theirs) are made one."""
    if isinstance(theirs, str):
        assert isinstance(ours, str) and ours.replace(*roots) == theirs, where
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        mapped = {k.replace(*roots) if isinstance(k, str) else k: v for k, v in ours.items()}
        assert mapped.keys() == theirs.keys(), where
        for key, value in theirs.items():
            assert_same(mapped[key], value, roots, f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, roots, f"{where}[{i}]")
    elif isinstance(theirs, float) and math.isnan(theirs):
        assert isinstance(ours, float) and math.isnan(ours), where
    else:
        assert ours == theirs and type(ours) is type(theirs), where


def assert_committed(directory: Path, names: list[str]) -> None:
    catalog = Catalog(Storage(directory))
    assert [i.name for i in catalog.valid()] and all(
        str(catalog.info(n).status) == "valid" for n in names
    )


# ---------------------------------------------------------------- what ModelCheckpoint writes

OPTIONS = {
    "monitor-top-k-template": dict(
        monitor="score", save_top_k=2, every_n_train_steps=3, filename="{epoch}-{step}-{score:.0f}"
    ),
    "every-n-epochs-all": dict(every_n_epochs=1, save_top_k=-1),
    "save-last-copy": dict(monitor="score", save_top_k=1, every_n_train_steps=4, save_last=True),
    "weights-only": dict(every_n_train_steps=6, save_top_k=-1, save_weights_only=True),
}


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_model_checkpoint_writes_the_paths_lightning_writes_as_committed_checkpoints(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    _, _, theirs = fit(tmp_path / "theirs", ours=False, **options)
    _, _, ours = fit(tmp_path / "ours", ours=True, **options)
    directory = tmp_path / "ours" / "ckpts"
    names = listing(directory)
    assert names == listing(tmp_path / "theirs" / "ckpts") and names
    assert all((directory / n / MANIFEST_FILE).is_file() for n in names)  # committed dirs
    assert_committed(directory, names)
    roots = (str(tmp_path / "ours"), str(tmp_path / "theirs"))
    assert ours.best_model_path.replace(*roots) == theirs.best_model_path
    for name in names:  # the same content, once our directory is read back
        saved = torch.load(tmp_path / "theirs" / "ckpts" / name, weights_only=False)
        assert_same(consolidate(directory / name), saved, roots, name)


def test_train_time_interval_saves_committed_checkpoints(tmp_path: Path) -> None:
    """Time-triggered saves land whenever the clock says: each one is committed, the newest
    holds the last step that saved."""
    _, _, callback = fit(
        tmp_path,
        ours=True,
        max_steps=10,
        save_top_k=-1,
        train_time_interval=timedelta(seconds=0.05),
        callbacks=[Sleepy()],
    )
    names = listing(tmp_path / "ckpts")
    assert len(names) >= 3
    assert_committed(tmp_path / "ckpts", names)
    newest = Catalog(Storage(tmp_path / "ckpts")).valid()[0]
    assert newest.manifest is not None and newest.step == int(
        consolidate(callback.last_model_path or callback.best_model_path)["global_step"]
    )


class Sleepy(pl.Callback):
    """60 ms per training step, so a time interval passes between steps."""

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(0.06)


def test_early_stopping_stops_and_resumes_as_with_lightnings_files(tmp_path: Path) -> None:
    # val_loss must improve by more than it can: stops after patience + 1 epochs
    stopper = dict(monitor="val_loss", patience=1, min_delta=100.0, check_on_train_epoch_end=False)
    options = dict(monitor="val_loss", save_top_k=1, save_last=True)
    runs = {}
    for who in ("theirs", "ours"):
        trainer, _, _ = fit(
            tmp_path / who,
            ours=who == "ours",
            max_steps=100,
            callbacks=[EarlyStopping(**stopper)],
            **options,
        )
        runs[who] = trainer.current_epoch
    assert runs["ours"] == runs["theirs"] < 10  # stopped early, at the same epoch
    last = tmp_path / "ours" / "ckpts" / "last.ckpt"
    state = consolidate(last)["callbacks"]
    stopping = next(v for k, v in state.items() if k.startswith("EarlyStopping"))
    assert stopping["wait_count"] == 1
    # restored, the callback goes on counting (a fresh one would see an improvement first)
    early = EarlyStopping(**stopper)
    fit(tmp_path / "ours", ours=True, max_steps=100, ckpt_path=str(last), callbacks=[early])
    assert early.wait_count == 2


# ---------------------------------------------------------------- resume and load


def test_a_resume_through_the_plugin_trains_as_a_resume_from_lightnings_file(tmp_path) -> None:
    weights = {}
    for who in ("theirs", "ours"):
        fit(tmp_path / who, ours=who == "ours", max_steps=6, every_n_train_steps=3, save_top_k=-1)
        middle = tmp_path / who / "ckpts" / "epoch=0-step=3.ckpt"
        trainer, model, _ = fit(
            tmp_path / who / "again",
            ours=who == "ours",
            max_steps=10,
            ckpt_path=str(middle),
            every_n_train_steps=3,
            save_top_k=-1,
        )
        assert trainer.global_step == 10 and trainer.ckpt_path == str(middle)
        weights[who] = model.state_dict()
    assert_same(weights["ours"], weights["theirs"], ("", ""))


def test_load_from_checkpoint_and_evaluation_read_a_plugin_checkpoint(tmp_path) -> None:
    trainer, model, callback = fit(tmp_path, ours=True, monitor="score", every_n_train_steps=3)
    best = Monitored.load_from_checkpoint(callback.best_model_path)
    assert callback.best_model_path.endswith("epoch=1-step=6.ckpt")
    expected = consolidate(callback.best_model_path)["state_dict"]
    assert all(torch.equal(v, expected[k]) for k, v in best.state_dict().items())
    trainer.validate(model, ckpt_path="best")
    assert trainer.ckpt_path == callback.best_model_path
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_a_checkpoint_saved_then_loaded_in_one_process_waits_for_its_commit(tmp_path) -> None:
    plugin = ElasticCheckpointIO(storage_options={"faults": [stall("*.distcp", 0.5)]})
    path = f"faulty://{tmp_path}/a.ckpt"
    plugin.save_checkpoint({"w": torch.arange(4.0), "global_step": 3}, path)
    assert plugin.pending(path)
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.arange(4.0))
    plugin.teardown()


def corrupt(directory: Path) -> str:
    """Flip one byte of the checkpoint's shard; returns the file's name."""
    (shard,) = directory.glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard.name


def test_a_corrupt_checkpoint_raises_an_integrity_error_naming_the_file(tmp_path) -> None:
    _, _, callback = fit(tmp_path, ours=True, every_n_train_steps=6, save_top_k=-1)
    path = Path(callback.best_model_path)
    shard = corrupt(path)
    with pytest.raises(IntegrityError, match=shard) as info:
        Monitored.load_from_checkpoint(path)
    assert info.value.file == shard
    with pytest.raises(IntegrityError, match=shard):
        fit(tmp_path / "again", ours=True, ckpt_path=str(path))
    (path / MANIFEST_FILE).unlink()  # as a save that never committed leaves it
    with pytest.raises(CheckpointNotFoundError, match="incomplete"):
        ElasticCheckpointIO().load_checkpoint(path)


def test_ckpt_path_last_takes_the_newest_checkpoint_that_verifies_and_says_so(
    tmp_path, caplog
) -> None:
    fit(tmp_path, ours=True, every_n_train_steps=3, save_top_k=-1, save_last=True)
    directory = tmp_path / "ckpts"
    corrupt(directory / "last.ckpt")
    with (
        pytest.warns(CorruptCheckpointWarning, match="last.ckpt"),
        caplog.at_level(logging.INFO, logger="lightning_elastic"),
    ):
        trainer, _, _ = fit(tmp_path, ours=True, max_steps=14, ckpt_path="last")
    newest = str(directory / "epoch=2-step=12.ckpt")
    assert trainer.ckpt_path == newest and trainer.global_step == 14
    assert f"restoring {newest}, the newest checkpoint of {directory} that verifies" in caplog.text
    for name in listing(directory):  # all corrupt now (last.ckpt is already)
        if name != "last.ckpt":
            corrupt(directory / name)
    with (
        pytest.warns(CorruptCheckpointWarning),
        pytest.raises(CheckpointNotFoundError, match=r"no checkpoint of .* verifies"),
    ):
        fit(tmp_path, ours=True, ckpt_path="last")


def test_ckpt_path_last_warns_of_an_unreadable_manifest_and_refuses_a_newer_format(
    tmp_path,
) -> None:
    # a manifest that does not parse was skipped without a word (only a checkpoint whose files
    # failed verification was warned about); one of a newer format was skipped too, and the
    # resume silently went back to an older checkpoint
    fit(tmp_path, ours=True, every_n_train_steps=4, save_top_k=-1)
    manifest = tmp_path / "ckpts" / "epoch=2-step=12.ckpt" / MANIFEST_FILE
    data = manifest.read_text()
    manifest.write_text("{garbage")
    with pytest.warns(CorruptCheckpointWarning, match=r"epoch=2-step=12\.ckpt.*not valid JSON"):
        trainer, _, _ = fit(tmp_path, ours=True, max_steps=14, ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "ckpts" / "epoch=1-step=8.ckpt")
    newer = json.loads(data)
    newer["format_version"] = 99
    manifest.write_text(json.dumps(newer))
    with pytest.raises(UnsupportedFormatError, match="epoch=2-step=12"):
        fit(tmp_path, ours=True, max_steps=14, ckpt_path="last")


def test_ckpt_path_last_without_checkpoints_starts_fresh_and_says_why_when_none_committed(
    tmp_path,
) -> None:
    with pytest.warns(UserWarning, match="there is no last checkpoint"):
        trainer, _, _ = fit(tmp_path, ours=True, max_steps=2, ckpt_path="last")
    assert trainer.ckpt_path is None  # Lightning's own answer for a first run
    crashed = tmp_path / "b" / "ckpts" / "last.ckpt"
    crashed.mkdir(parents=True)  # a save that never committed
    (crashed / "_staging.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError, match=r"last\.ckpt: no manifest"):
        fit(tmp_path / "b", ours=True, ckpt_path="last")


def test_save_last_link_links_the_newest_checkpoint_and_resumes_from_it(tmp_path) -> None:
    options = dict(monitor="step", mode="max", every_n_train_steps=3, save_top_k=2)
    fit(tmp_path, ours=True, save_last="link", **options)
    directory = tmp_path / "ckpts"
    link = directory / "last.ckpt"
    assert link.is_symlink() and os.readlink(link) == "epoch=2-step=12.ckpt"
    assert listing(directory) == ["epoch=2-step=12.ckpt", "epoch=2-step=9.ckpt", "last.ckpt"]
    trainer, _, _ = fit(tmp_path / "a", ours=True, max_steps=13, ckpt_path=str(link))
    assert trainer.global_step == 13
    trainer, _, _ = fit(
        tmp_path, ours=True, max_steps=13, ckpt_path="last", save_last="link", **options
    )
    assert trainer.ckpt_path == str(directory / "epoch=2-step=12.ckpt")


# ---------------------------------------------------------------- removals and teardown


def stall(pattern: str, seconds: float) -> Fault:
    return Fault("open", pattern, "stall", seconds=seconds, times=0)


def test_a_removal_waits_for_the_commit_of_the_save_that_replaces_it(tmp_path) -> None:
    root = f"faulty://{tmp_path}"
    plugin = ElasticCheckpointIO(storage_options={"faults": [stall("*/b.ckpt/*.distcp", 0.5)]})
    plugin.save_checkpoint({"w": torch.zeros(2), "global_step": 1}, f"{root}/a.ckpt")
    plugin.wait()
    plugin.save_checkpoint({"w": torch.ones(2), "global_step": 2}, f"{root}/b.ckpt")
    plugin.remove_checkpoint(f"{root}/a.ckpt")  # as top-k rotation does right after a save
    assert (tmp_path / "a.ckpt" / MANIFEST_FILE).exists()  # b is not committed yet
    assert plugin.wait() is not None and plugin.last_result.name == "b.ckpt"
    assert listing(tmp_path) == ["b.ckpt"]


def test_a_removal_waiting_for_a_save_that_fails_keeps_the_old_checkpoint(tmp_path) -> None:
    root = f"faulty://{tmp_path}"
    fault = Fault("write", "*/b.ckpt/*.distcp", "EACCES", times=0)
    plugin = ElasticCheckpointIO(storage_options={"faults": [fault]})
    plugin.save_checkpoint({"w": torch.zeros(2)}, f"{root}/a.ckpt")
    plugin.save_checkpoint({"w": torch.ones(2)}, f"{root}/b.ckpt")
    plugin.remove_checkpoint(f"{root}/a.ckpt")
    with pytest.raises(CheckpointSaveError):
        plugin.teardown()
    assert listing(tmp_path) == ["a.ckpt"] and (tmp_path / "a.ckpt" / MANIFEST_FILE).exists()


def test_teardown_waits_for_the_save_in_flight(tmp_path) -> None:
    plugin = ElasticCheckpointIO(storage_options={"faults": [stall("*.distcp", 0.3)]})
    plugin.save_checkpoint({"w": torch.ones(2)}, f"faulty://{tmp_path}/a.ckpt")
    assert not (tmp_path / "a.ckpt" / MANIFEST_FILE).exists()
    plugin.teardown()
    assert (tmp_path / "a.ckpt" / MANIFEST_FILE).exists()
    plugin.save_checkpoint({"w": torch.ones(2)}, f"faulty://{tmp_path}/b.ckpt")  # usable again
    plugin.teardown()


class Crashes(Monitored):
    """Raises its own error at step 5, after ModelCheckpoint's save at step 4."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 5:
            raise RuntimeError("the user's own error")
        return super().training_step(batch, batch_idx)


def test_a_save_failing_while_training_crashes_does_not_hide_the_crash(tmp_path, caplog) -> None:
    # Lightning tears down inside its `except` block: a save error raised there would replace
    # the user's exception (and skip the KeyboardInterrupt handling after the teardown)
    fault = Fault("write", "*.distcp", "EACCES", times=0)
    plugin = ElasticCheckpointIO(storage_options={"faults": [fault]})
    callback = ModelCheckpoint(dirpath=f"faulty://{tmp_path}/ckpts", every_n_train_steps=4)
    trainer = make_trainer(
        str(tmp_path),
        max_steps=12,
        strategy="auto",
        devices=1,
        callbacks=[callback],
        plugins=[plugin],
    )
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="the user's own"):
        trainer.fit(Crashes(n=16, hidden=16))
    assert "epoch=0-step=4.ckpt was not committed" in caplog.text  # said, not lost
    with pytest.raises(CheckpointSaveError):  # outside an exception, teardown still raises
        plugin.save_checkpoint({"w": torch.ones(2)}, f"faulty://{tmp_path}/ckpts/b.ckpt")
        plugin.teardown()
    try:  # a fit run inside a script's own `except` block (a retry): its save failure raises
        raise KeyError("an earlier failure the script handles")
    except KeyError:
        plugin.save_checkpoint({"w": torch.ones(2)}, f"faulty://{tmp_path}/ckpts/c.ckpt")
        with pytest.raises(CheckpointSaveError):
            plugin.teardown()


def test_a_key_that_would_load_back_as_a_string_is_refused_when_saved(tmp_path) -> None:
    # fabric.save(path, {"counts": {(0, 1): 5}}) loaded back {"counts": {"(0, 1)": 5}}
    plugin = ElasticCheckpointIO()
    with pytest.raises(ConfigError, match=r"cannot save the key \(0, 1\) \(tuple\) of counts"):
        plugin.save_checkpoint({"counts": {(0, 1): 5}, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    plugin.save_checkpoint({"counts": {"0,1": 5, 7: 1}}, tmp_path / "a.ckpt")  # still usable
    assert plugin.load_checkpoint(tmp_path / "a.ckpt")["counts"] == {"0,1": 5, 7: 1}
    plugin.teardown()


def test_consolidate_reads_the_checkpoint_a_save_last_link_names(tmp_path) -> None:
    # save_last="link": `lightning-elastic consolidate ckpts/last.ckpt model.ckpt` said "no
    # checkpoint at ckpts/last.ckpt" (listings below a root never follow links)
    plugin = ElasticCheckpointIO()
    plugin.save_checkpoint({"w": torch.ones(2), "global_step": 3}, tmp_path / "a.ckpt")
    plugin.teardown()
    (tmp_path / "last.ckpt").symlink_to("a.ckpt")
    assert consolidate(tmp_path / "last.ckpt", tmp_path / "model.ckpt")["global_step"] == 3
    assert torch.load(tmp_path / "model.ckpt")["global_step"] == 3
    link = str(tmp_path / "last.ckpt")
    verbs = (["consolidate", link, str(tmp_path / "m.ckpt")], ["verify", link], ["inspect", link])
    for argv in verbs:
        assert main(argv) == 0, argv


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.eye(3).to_sparse(),
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
    ],
    ids=["sparse-coo", "sparse-csr", "quantized"],
)
def test_a_tensor_the_staging_copy_cannot_hold_is_refused_naming_its_key(tmp_path, make) -> None:
    tensor = make()
    # torch.save takes them; the staging copy into the dense host buffer raised a bare
    # RuntimeError ("copy_() between dense and sparse Tensors is not implemented")
    plugin = ElasticCheckpointIO()
    with pytest.raises(ConfigError, match=r"buffers\.table"):
        plugin.save_checkpoint({"buffers": {"table": tensor}, "w": torch.ones(2)}, tmp_path / "a")
    plugin.save_checkpoint({"buffers": {"table": torch.ones(3)}}, tmp_path / "a")  # usable
    assert torch.equal(plugin.load_checkpoint(tmp_path / "a")["buffers"]["table"], torch.ones(3))
    plugin.teardown()
    # a lazy snapshot copies it at once, where the copy is refused by name (deferred, it
    # failed in the writer thread with torch's RuntimeError)
    from lightning_elastic import CheckpointEngine

    with CheckpointEngine(tmp_path / "engine", snapshot="lazy") as engine:
        with pytest.raises(ConfigError, match=r"buffers\.table"):
            engine.save({"buffers": {"table": tensor}, "w": torch.ones(2)}, step=1)
        engine.save({"w": torch.ones(2)}, step=2).result()


def test_links_and_files_of_other_runs_are_removed_as_lightning_removes_them(tmp_path) -> None:
    plugin = ElasticCheckpointIO()
    plugin.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    plugin.wait()
    (tmp_path / "last.ckpt").symlink_to("a.ckpt")
    (tmp_path / "old.ckpt").write_bytes(b"a torch.save file")
    plugin.remove_checkpoint(tmp_path / "last.ckpt")  # the link only, never its target
    plugin.remove_checkpoint(tmp_path / "old.ckpt")
    assert listing(tmp_path) == ["a.ckpt"] and (tmp_path / "a.ckpt" / MANIFEST_FILE).exists()
    with pytest.raises(Exception, match="is a file"):
        (tmp_path / "b.ckpt").write_bytes(b"x")
        plugin.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b.ckpt")
    plugin.teardown()


def test_hostile_folders_that_are_not_checkpoints_are_neither_emptied_nor_loaded(tmp_path) -> None:
    plugin = ElasticCheckpointIO()
    folder = tmp_path / "epoch=0-step=3.ckpt"  # a user's folder under ModelCheckpoint's name
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match=r"notes\.txt"):
        plugin.save_checkpoint({"w": torch.ones(2)}, folder)
    assert listing(folder) == ["notes.txt"]
    with pytest.raises(CheckpointNotFoundError, match="is a directory but not a checkpoint"):
        plugin.load_checkpoint(folder)
    plugin.teardown()


def test_a_load_through_a_link_waits_for_the_save_it_points_to(tmp_path, monkeypatch) -> None:
    from lightning_elastic.core.save import pipeline

    write = pipeline._write_and_report

    def slow_write(*args: Any) -> Any:  # a local path (a link resolves), written slowly
        time.sleep(0.5)
        return write(*args)

    monkeypatch.setattr(pipeline, "_write_and_report", slow_write)
    plugin = ElasticCheckpointIO()
    plugin.save_checkpoint({"w": torch.arange(3.0)}, tmp_path / "a.ckpt")
    assert plugin.pending(str(tmp_path / "a.ckpt"))
    (tmp_path / "last.ckpt").symlink_to("a.ckpt")  # as save_last="link" makes it
    assert torch.equal(plugin.load_checkpoint(tmp_path / "last.ckpt")["w"], torch.arange(3.0))
    plugin.teardown()


def test_the_plugin_pickles_without_its_engines_as_ddp_spawn_sends_it(tmp_path) -> None:
    import pickle

    plugin = ElasticCheckpointIO(verify="size")
    plugin.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.verify == "size" and copy.last_result is None
    copy.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "b.ckpt")
    copy.teardown()
    plugin.teardown()
    assert torch.equal(copy.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.zeros(2))


def test_the_manifest_records_the_monitored_value_and_the_lightning_path(tmp_path) -> None:
    _, _, callback = fit(tmp_path, ours=True, monitor="score", every_n_train_steps=3)
    manifest = json.loads((Path(callback.best_model_path) / MANIFEST_FILE).read_text())
    assert manifest["metrics"] == {"score": 1.0} and manifest["step"] == 6
    assert manifest["metadata"]["path"] == callback.best_model_path


# ---------------------------------------------------------------- options and strategies


def test_options_are_checked_when_the_plugin_is_made() -> None:
    for bad in (
        dict(verify="most"),
        dict(async_save="yes"),
        dict(checkpoint_timeout=-1),
        dict(checksum="md5sum"),
        dict(storage_options=["x"]),
    ):
        with pytest.raises(ConfigError):
            ElasticCheckpointIO(**bad)


def test_strategies_that_do_not_save_and_load_through_the_plugin_are_refused() -> None:
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    plugin = ElasticCheckpointIO()
    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        with pytest.raises(ConfigError, match="loads do not go through checkpoint_io"):
            check_strategy(strategy, plugin)
    with pytest.raises(ConfigError, match="DeepSpeed writes"):
        check_strategy(DeepSpeedStrategy.__new__(DeepSpeedStrategy), plugin)
    with pytest.raises(ConfigError, match="saves asynchronously itself"):
        check_strategy(SingleDeviceStrategy(), AsyncCheckpointIO(plugin))
    for fine in (SingleDeviceStrategy(), DDPStrategy(), DDPStrategy(start_method="spawn")):
        check_strategy(fine, plugin)
    check_strategy(ElasticStrategy(), plugin)
    check_strategy(FSDPStrategy(), None)  # only ours is checked
    # where a user meets it: building the Trainer, or Fabric (whose FSDP takes no plugin)
    with pytest.raises(ConfigError, match="ModelParallelStrategy"):
        pl.Trainer(strategy=ModelParallelStrategy(), plugins=[plugin], logger=False)
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    with pytest.raises(ConfigError, match="takes no CheckpointIO plugin"):
        check_strategy(FabricFSDP(), plugin)
    with pytest.raises(ConfigError, match="ModelParallelStrategy"):
        parallel = FabricModelParallel(lambda module, mesh: module)
        Fabric(accelerator="cpu", devices=1, strategy=parallel, plugins=[plugin])


# ---------------------------------------------------------------- two processes (one launch)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ddp")
    results = run_distributed(checkpoint_io_workers.fit_test_resume, 2, str(root), timeout=240)
    return root, results


@pytest.mark.slow
def test_under_ddp_rank_0_commits_what_model_checkpoint_writes_and_every_rank_loads_it(
    ddp_run,
) -> None:
    root, (rank0, rank1) = ddp_run
    directory = root / "ckpts"
    names = listing(directory)
    # top 2 by score (|step - 6|, ties keep the older), and last.ckpt: step 14's by now
    assert names == rank0["names"] == ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert_committed(directory, names)
    assert rank0["best"] == rank1["best"] == str(directory / "epoch=1-step=6.ckpt")
    # test(ckpt_path="best") loaded the same weights on both ranks, then fit(ckpt_path="last")
    # resumed both from last.ckpt (the newest that verifies), saved, and tore down committed
    assert rank0["tested"] and rank1["tested"]
    assert rank0["resumed"] == rank1["resumed"] == str(directory / "last.ckpt")
    assert rank0["step"] == rank1["step"] == 14
    assert consolidate(directory / "last.ckpt")["global_step"] == 14
