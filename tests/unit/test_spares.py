"""A local root's spare pool (core/storage/local.py): large deleted files kept for later
writes to overwrite, never aliasing a file that is still named elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_elastic import Storage
from lightning_elastic.core.storage.local import SPARE_MIN_BYTES, LocalStorage

MIB = SPARE_MIN_BYTES


def blob(n: int, seed: int) -> bytes:
    return bytes((seed + i // 4096) % 251 for i in range(0, n, 4096)) * 4096


def make(tmp_path: Path, limit: int = 100 * MIB) -> LocalStorage:
    storage = Storage(str(tmp_path / "root"))
    assert isinstance(storage, LocalStorage)
    storage.keep_spares().limit = limit
    return storage


def spares(storage: LocalStorage) -> list[tuple[int, int]]:
    """(size, inode) of each spare."""
    pool = Path(storage.root) / ".spares"
    return (
        sorted((p.stat().st_size, p.stat().st_ino) for p in pool.iterdir()) if pool.exists() else []
    )


def retire_tree(storage: LocalStorage, rel: str) -> None:
    """Retire every file of ``rel`` (as retention does a deleted checkpoint's), then delete it."""
    for entry in storage.listdir(rel):
        storage.retire(f"{rel}/{entry.name}")
    storage.delete_tree(rel)


def inode(storage: LocalStorage, rel: str) -> int:
    return os.stat(storage.full(rel)).st_ino


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("new_size", [MIB, 3 * MIB, 5 * MIB])
def test_a_deleted_large_file_is_overwritten_by_the_next_large_write(
    tmp_path, exclusive: bool, new_size: int
) -> None:
    storage = make(tmp_path)
    storage.write_bytes("a/old.bin", blob(3 * MIB, 1))
    old = inode(storage, "a/old.bin")
    storage.retire("a/old.bin")
    assert not storage.exists("a/old.bin") and spares(storage) == [(3 * MIB, old)]
    data = blob(new_size, 2)
    chunks = [data[i : i + MIB // 2] for i in range(0, len(data), MIB // 2)]
    written = storage.write_stream(
        "b/new.bin", lambda: iter(chunks), checksum="xxh3_64", exclusive=exclusive, size=new_size
    )
    assert inode(storage, "b/new.bin") == old  # the spare's pages, not new ones
    assert storage.read_bytes("b/new.bin") == data  # cut or grown to exactly the new bytes
    assert written == storage.hash_file("b/new.bin", "xxh3_64")
    assert spares(storage) == []
    assert not [p for p in Path(storage.root).rglob("*") if ".tmp-" in p.name]


def test_the_smallest_spare_that_fits_is_taken_else_the_largest(tmp_path) -> None:
    storage = make(tmp_path)
    for name, size in (("two", 2 * MIB), ("four", 4 * MIB), ("six", 6 * MIB)):
        storage.write_bytes(f"c/{name}", blob(size, 3))
    ids = {n: inode(storage, f"c/{n}") for n in ("two", "four", "six")}
    retire_tree(storage, "c")
    storage.write_bytes("d/three", b"")  # no size: never takes a spare
    assert len(spares(storage)) == 3
    storage.write_stream("d/x", lambda: [blob(3 * MIB, 4)], size=3 * MIB)
    assert inode(storage, "d/x") == ids["four"]
    storage.write_stream("d/y", lambda: [blob(8 * MIB, 5)], size=8 * MIB)
    assert inode(storage, "d/y") == ids["six"]
    assert storage.read_bytes("d/y") == blob(8 * MIB, 5)


def test_the_pool_keeps_no_more_than_its_limit_nor_small_files_and_nothing_by_default(
    tmp_path,
) -> None:
    storage = make(tmp_path, limit=5 * MIB)
    for i in range(3):
        storage.write_bytes(f"e/{i}", blob(2 * MIB, i))
    storage.write_bytes("e/small", b"x" * (MIB - 1))
    retire_tree(storage, "e")
    assert [size for size, _ in spares(storage)] == [2 * MIB, 2 * MIB]  # the third: deleted
    assert not storage.exists("e")
    plain = Storage(str(tmp_path / "plain"))
    plain.write_bytes("f", blob(2 * MIB, 0))
    plain.retire("f")
    assert not (tmp_path / "plain" / ".spares").exists()
    unsized = make(tmp_path / "unsized", limit=0)  # a pool without a limit keeps nothing
    unsized.write_bytes("f", blob(2 * MIB, 0))
    unsized.retire("f")
    assert spares(unsized) == []


def test_a_file_with_another_link_is_never_kept_nor_overwritten(tmp_path) -> None:
    storage = make(tmp_path)
    storage.write_bytes("g/linked", blob(2 * MIB, 6))
    os.link(storage.full("g/linked"), tmp_path / "backup")
    storage.retire("g/linked")
    assert spares(storage) == []  # deleted: keeping it would change the backup's bytes
    storage.write_bytes("g/spare", blob(2 * MIB, 7))
    storage.retire("g/spare")
    (pooled,) = (Path(storage.root) / ".spares").iterdir()
    os.link(pooled, tmp_path / "grabbed")  # linked while in the pool
    storage.write_stream("g/new", lambda: [blob(2 * MIB, 8)], size=2 * MIB)
    assert (tmp_path / "backup").read_bytes() == blob(2 * MIB, 6)
    assert (tmp_path / "grabbed").read_bytes() == blob(2 * MIB, 7)
    assert storage.read_bytes("g/new") == blob(2 * MIB, 8)
    assert inode(storage, "g/new") != (tmp_path / "grabbed").stat().st_ino


def test_a_write_that_fails_over_a_spare_leaves_no_file_with_old_bytes(tmp_path) -> None:
    storage = make(tmp_path)
    storage.write_bytes("h/old", blob(4 * MIB, 9))
    storage.retire("h/old")

    def failing() -> object:
        yield blob(MIB, 10)
        raise OSError("disk gone")

    for exclusive in (False, True):
        with pytest.raises(Exception, match="disk gone"):
            storage.with_retry(storage.retry.__class__(max_attempts=1)).write_stream(
                "h/new", failing, exclusive=exclusive, size=4 * MIB
            )
        assert not storage.exists("h/new")
        assert not [p for p in Path(storage.root).rglob("*") if ".tmp-" in p.name]


def test_clear_deletes_every_spare_and_listings_never_show_the_pool(tmp_path) -> None:
    from lightning_elastic.core.format.catalog import Catalog

    storage = make(tmp_path)
    storage.write_bytes("step_000000001/x.distcp", blob(2 * MIB, 11))
    retire_tree(storage, "step_000000001")
    assert len(spares(storage)) == 1
    assert Catalog(storage).scan() == []
    (Path(storage.root) / ".spares" / "empty.spare").write_bytes(b"")  # planted: 0 bytes
    storage.spares.clear()  # type: ignore[union-attr]
    assert spares(storage) == []


def test_trim_deletes_the_largest_spares_until_the_pool_fits_its_limit(tmp_path) -> None:
    storage = make(tmp_path, limit=100 * MIB)
    for i, n in enumerate((2, 3, 5)):
        storage.write_bytes(f"e/{i}", blob(n * MIB, i))
    retire_tree(storage, "e")
    pool = storage.spares
    assert pool is not None and pool.held() == 10 * MIB
    pool.trim()  # under its limit: nothing goes
    assert [s for s, _ in spares(storage)] == [2 * MIB, 3 * MIB, 5 * MIB]
    pool.limit = 6 * MIB
    pool.trim()
    assert [s for s, _ in spares(storage)] == [2 * MIB, 3 * MIB]
    pool.trim(2 * MIB)
    assert [s for s, _ in spares(storage)] == [2 * MIB]
    pool.trim(0)
    assert spares(storage) == [] and pool.held() == 0
