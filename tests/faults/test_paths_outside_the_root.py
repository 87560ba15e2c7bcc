"""Symbolic links and odd paths never make us read, write or delete outside the root."""

import os
from pathlib import Path

import pytest
import torch

from lightning_elastic import CheckpointEngine, KeepLastN, Storage
from lightning_elastic.cli import main as cli
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.policy.housekeeping import delete_checkpoint
from lightning_elastic.errors import StorageError


def save(engine: CheckpointEngine, step: int) -> str:
    handle = engine.save({"w": torch.full((4,), float(step))}, step=step, blocking=True)
    assert handle is not None
    return handle.name


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "./a", "a//b", "a\\..\\b"])
def test_paths_that_could_leave_the_root_are_refused(tmp_path, rel) -> None:
    storage = Storage(str(tmp_path / "root"))
    for op in (
        lambda: storage.write_bytes(rel, b"1"),
        lambda: storage.read_bytes(rel),
        lambda: storage.delete(rel),
        lambda: storage.child(rel),
    ):
        with pytest.raises(StorageError, match="plain relative path"):
            op()
    assert not (tmp_path / "x").exists()


def test_a_latest_symlink_in_the_root_never_costs_a_kept_checkpoint(tmp_path) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(str(root), retention=[KeepLastN(2)], async_save=False) as engine:
        names = [save(engine, step) for step in (1, 2)]
        os.symlink(root / names[1], root / "latest")  # what users' scripts do
        os.symlink(names[1], root / "latest-relative")
        for step in (3, 4, 5):
            save(engine, step)
        valid = [i for i in engine.list() if i.status == "valid"]
        assert [i.step for i in valid] == [4, 5]
        assert all(i.name not in ("latest", "latest-relative") for i in engine.list())
        for info in valid:  # nothing kept was emptied through a link
            assert (root / info.name / "manifest.json").exists()
            engine.load(None, checkpoint=info.name)
    assert cli(["verify", str(root)]) == 0


def test_deleting_a_checkpoint_with_a_link_inside_leaves_the_target_alone(tmp_path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"keep me")
    root = tmp_path / "ckpts"
    with CheckpointEngine(str(root), async_save=False) as engine:
        name = save(engine, 1)
        save(engine, 2)
    os.symlink(outside, root / name / "escape")
    os.symlink(outside / "data.bin", root / name / "file-escape")
    storage = Storage(str(root))
    delete_checkpoint(storage, Catalog(storage), name)
    assert not (root / name).exists()
    assert (outside / "data.bin").read_bytes() == b"keep me"


def test_prune_never_deletes_through_a_link_to_outside(tmp_path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"keep me")
    root = tmp_path / "ckpts"
    with CheckpointEngine(str(root), async_save=False) as engine:
        first = save(engine, 1)
        for step in (2, 3):
            save(engine, step)
    os.symlink(outside, root / first / "escape")
    os.symlink(outside, root / "step_999999999")  # a link posing as a checkpoint
    assert cli(["prune", str(root), "--keep-last", "1"]) == 0
    assert (outside / "data.bin").read_bytes() == b"keep me"
    assert os.path.islink(root / "step_999999999")


def test_a_checkpoint_directory_linked_outside_the_root_is_refused(tmp_path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    root = tmp_path / "ckpts"
    root.mkdir()
    os.symlink(outside, root / "step_000000007")
    storage = Storage(str(root))
    with pytest.raises(StorageError, match="symbolic link"):
        storage.child("step_000000007").write_bytes("f", b"1")
    with pytest.raises(StorageError, match="symbolic link"):
        storage.write_bytes("step_000000007/nested/f", b"1")
    assert list(outside.iterdir()) == []


def test_listing_reports_links_without_following_them(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "d").mkdir(parents=True)
    os.symlink(root / "d", root / "link")
    entries = {e.name: e for e in Storage(str(root)).listdir()}
    assert entries["link"].is_link and not entries["link"].is_dir
    assert entries["d"].is_dir and not entries["d"].is_link


def test_a_file_linked_outside_is_never_read_through_the_link(tmp_path: Path) -> None:
    """A manifest (or shard) replaced by a link to a file outside the root: unreadable, the
    checkpoint is skipped (not quarantined: no lasting mark) and resume falls back."""
    import warnings

    from lightning_elastic.errors import CorruptCheckpointWarning

    root = tmp_path / "ckpts"
    with CheckpointEngine(str(root), async_save=False) as engine:
        save(engine, 1)
        newest = save(engine, 2)
    outside = tmp_path / "elsewhere.json"
    (root / newest / "manifest.json").rename(outside)
    os.symlink(outside, root / newest / "manifest.json")
    with CheckpointEngine(str(root)) as engine, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert engine.load(None).info.step == 1
    assert any(
        issubclass(w.category, CorruptCheckpointWarning) and "symbolic link" in str(w.message)
        for w in seen
    )
    assert not (root / newest / "_quarantine.json").exists()
    with pytest.raises(StorageError, match="symbolic link"):
        Storage(str(root)).read_bytes(f"{newest}/manifest.json")
    assert cli(["verify", str(root / newest)]) == 1
