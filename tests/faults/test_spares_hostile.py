"""Hostile conditions for a local root's spare pool (core/storage/local.py, SparePool): links
planted where the pool lives, writes killed while they overwrite a spare, and writers still
busy with a file that a delete hands to the pool."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_elastic import Storage
from lightning_elastic.core.storage.local import SPARE_MIN_BYTES, LocalStorage

MIB = SPARE_MIN_BYTES


def blob(n: int, seed: int) -> bytes:
    return bytes((seed + i // 4096) % 251 for i in range(0, n, 4096)) * 4096


def make(root: Path, limit: int = 100 * MIB) -> LocalStorage:
    storage = Storage(str(root))
    assert isinstance(storage, LocalStorage)
    storage.keep_spares().limit = limit
    return storage


def spare(storage: LocalStorage, size: int, seed: int = 0) -> None:
    """Put one spare of ``size`` bytes into the pool (a deleted large file)."""
    storage.write_bytes(f"old_{seed}/f", blob(size, seed))
    storage.delete(f"old_{seed}/f")
    assert len(os.listdir(os.path.join(storage.root, ".spares"))) >= 1


# ------------------------------------------------------------------ links planted


def test_a_spares_folder_linked_out_of_the_root_is_never_used_and_nothing_there_is_touched(
    tmp_path,
) -> None:
    """``.spares`` replaced by a link to another folder (a user's, another job's): no file of
    the root moves out through it, no file there is taken into the root and overwritten, and
    clearing the pool deletes nothing there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.spare").write_bytes(blob(2 * MIB, 1))
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / ".spares")
    storage = make(root)
    storage.write_bytes("step_1/a.distcp", blob(2 * MIB, 2))
    storage.delete("step_1/a.distcp")
    assert not storage.exists("step_1/a.distcp")
    storage.write_stream("step_2/b.distcp", lambda: [blob(2 * MIB, 3)], size=2 * MIB)
    assert storage.read_bytes("step_2/b.distcp") == blob(2 * MIB, 3)
    assert storage.spares is not None
    storage.spares.clear()
    assert sorted(os.listdir(outside)) == ["precious.spare"]
    assert (outside / "precious.spare").read_bytes() == blob(2 * MIB, 1)
