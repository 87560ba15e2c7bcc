"""A local root's spare pool (core/storage/local.py, SparePool) under hostile conditions: links
planted where the pool lives, writes killed while they overwrite a spare, and writers still
busy with a file that a delete hands to the pool; the trim after each save (``SparePool.trim``,
``TierSet._size_spares``) when a spare cannot be deleted."""

from __future__ import annotations

import errno
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_elastic import Storage
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.storage.local import SPARE_MIN_BYTES, LocalStorage
from lightning_elastic.core.tiers.inventory import adoptable, scan_node

MIB = SPARE_MIN_BYTES
SHARD = "0123456789abcdef-rank00001.distcp"


def blob(n: int, seed: int) -> bytes:
    return bytes((seed + i // 4096) % 251 for i in range(0, n, 4096)) * 4096


def make(root: Path, limit: int = 100 * MIB) -> LocalStorage:
    storage = Storage(str(root))
    assert isinstance(storage, LocalStorage)
    storage.keep_spares().limit = limit
    return storage


def spare(storage: LocalStorage, size: int, seed: int = 0) -> None:
    """Put one spare of ``size`` bytes into the pool (a retired large file)."""
    storage.write_bytes(f"old_{seed}/f", blob(size, seed))
    storage.retire(f"old_{seed}/f")
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
    storage.retire("step_1/a.distcp")
    assert not storage.exists("step_1/a.distcp")
    storage.write_stream("step_2/b.distcp", lambda: [blob(2 * MIB, 3)], size=2 * MIB)
    assert storage.read_bytes("step_2/b.distcp") == blob(2 * MIB, 3)
    assert storage.spares is not None
    storage.spares.clear()
    assert sorted(os.listdir(outside)) == ["precious.spare"]
    assert (outside / "precious.spare").read_bytes() == blob(2 * MIB, 1)


# ------------------------------------------------------------------ killed writes


def test_a_write_killed_while_it_overwrites_a_spare_leaves_no_copy_that_counts_as_held(
    tmp_path,
) -> None:
    """A process killed in the middle of a non-exclusive write (a shard, a recovery download)
    that took a spare of the same size: recovery counts a file as held by its path and size
    (inventory.adoptable, scan_node), so the file at the final name must not have the full
    size unless all of it was written."""
    storage = make(tmp_path / "root")
    spare(storage, 4 * MIB)
    rel = f"step_000000002/{SHARD}"
    with warnings.catch_warnings():  # 3.12+ warns about fork() beside threads: none run here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child writes one chunk of four and dies without any cleanup
        try:

            def chunks() -> object:
                yield blob(MIB, 2)
                os._exit(0)

            storage.write_stream(rel, chunks, size=4 * MIB)  # type: ignore[arg-type]
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    scan = scan_node(storage)
    assert adoptable(scan, "step_000000002", {rel: 4 * MIB}) == {}, scan.uncommitted
    assert not (storage.exists(rel) and storage.size(rel) == 4 * MIB)


# ------------------------------------------------------------------ writers still busy


def test_a_file_still_being_written_when_garbage_collection_deletes_it_never_becomes_a_spare(
    tmp_path,
) -> None:
    """A requeued job's old copy still writes its shard into a save of the same run when the
    new job's garbage collection removes that save (this run's crashed save: no grace). The
    old writer keeps writing into the file it opened: handed to the pool, that inode would be
    the new job's next shard, and the old writer's bytes would land in a committed file."""
    from lightning_elastic.core.format.catalog import Catalog
    from lightning_elastic.core.format.manifest import STAGING_FILE, StagingRecord
    from lightning_elastic.core.policy.housekeeping import collect_garbage

    storage = make(tmp_path / "root")
    stale_id = "0123456789abcdef"
    record = StagingRecord("run", stale_id, 1, 0.0).to_json().encode()
    storage.write_bytes(f"step_000000001/{STAGING_FILE}", record)
    first, resume = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def stale_chunks() -> object:
        yield blob(MIB, 1)
        first.set()
        assert resume.wait(30)
        for seed in (2, 3, 4):
            yield blob(MIB, seed)

    def stale_writer() -> None:
        try:
            storage.write_stream(
                f"step_000000001/{stale_id}-rank00000.distcp",
                stale_chunks,  # type: ignore[arg-type]
                size=4 * MIB,
            )
        except BaseException as exc:  # its file is gone when it finishes: that is fine
            errors.append(exc)

    thread = threading.Thread(target=stale_writer)
    thread.start()
    try:
        assert first.wait(30)
        collect_garbage(storage, Catalog(storage), run_id="run", grace_s=3600.0)
        assert not storage.exists("step_000000001")
        new = blob(4 * MIB, 9)
        rel = "step_000000002/fedcba9876543210-rank00000.distcp"
        written = storage.write_stream(rel, lambda: [new], checksum="xxh3_64", size=4 * MIB)
    finally:
        resume.set()
        thread.join(30)
    assert storage.hash_file(rel, "xxh3_64") == written
    assert storage.read_bytes(rel) == new


def test_a_write_over_a_spare_to_a_name_a_folder_holds_fails_and_leaves_no_temporary_file(
    tmp_path,
) -> None:
    """The spare is written under a temporary name and renamed at the end: a rename that is
    refused (a folder planted at the file's name) must not leave the written spare behind."""
    storage = make(tmp_path / "root")
    spare(storage, 2 * MIB)
    os.makedirs(storage.full("step_3/x.distcp"))
    with pytest.raises(Exception):  # noqa: B017 - whatever the OS says about the folder
        storage.with_retry(storage.retry.__class__(max_attempts=1)).write_stream(
            "step_3/x.distcp", lambda: [blob(2 * MIB, 5)], size=2 * MIB
        )
    assert [e.name for e in storage.listdir("step_3")] == ["x.distcp"]
    assert storage.listdir("step_3/x.distcp") == []


# ------------------------------------------------------------------ behaviour pinned


def test_junk_planted_in_the_pool_is_never_taken_followed_or_cleared(tmp_path) -> None:
    """A folder, a FIFO and a link named like spares: a write never takes them (it gets a new
    file), nothing is written through the link, and clearing the pool leaves them."""
    storage = make(tmp_path / "root")
    pool = Path(storage.root) / ".spares"
    pool.mkdir(parents=True)
    (pool / "dir.spare").mkdir()
    os.mkfifo(pool / "fifo.spare")
    target = tmp_path / "target"
    target.write_bytes(blob(2 * MIB, 1))
    os.symlink(target, pool / "link.spare")
    storage.write_stream("step_1/x.distcp", lambda: [blob(2 * MIB, 2)], size=2 * MIB)
    assert storage.read_bytes("step_1/x.distcp") == blob(2 * MIB, 2)
    assert target.read_bytes() == blob(2 * MIB, 1)
    assert storage.spares is not None
    storage.spares.clear()
    assert sorted(os.listdir(pool)) == ["dir.spare", "fifo.spare", "link.spare"]


def test_two_writers_racing_for_one_spare_each_get_their_own_file(tmp_path) -> None:
    """Two writers of one root (a node's ranks) state a size at once with one spare in the
    pool: at most one overwrites it, the other writes a new file, both hold their bytes."""
    storage = make(tmp_path / "root")
    spare(storage, 2 * MIB)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            start.wait(10)
            storage.write_stream(
                f"step_2/{i}.distcp", lambda: [blob(2 * MIB, 10 + i)], size=2 * MIB
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    inodes = {os.stat(storage.full(f"step_2/{i}.distcp")).st_ino for i in range(2)}
    assert len(inodes) == 2
    for i in range(2):
        assert storage.read_bytes(f"step_2/{i}.distcp") == blob(2 * MIB, 10 + i)


def test_a_size_hint_and_retire_change_nothing_on_a_storage_that_is_not_local() -> None:
    storage = Storage("memory://spares-hostile")
    data = blob(2 * MIB, 3)
    written = storage.write_stream("a/b", lambda: [data], checksum="xxh3_64", size=2 * MIB)
    assert storage.read_bytes("a/b") == data and written == storage.hash_file("a/b", "xxh3_64")
    storage.write_stream("a/c", lambda: [data[:10]], size=2 * MIB)  # the hint is only a hint
    assert storage.read_bytes("a/c") == data[:10]
    storage.retire("a/b")
    storage.delete_tree("a")
    assert not storage.exists("a/b") and not storage.exists("a/c")


# ----------------------------------------------------------------------- the trim after each save


def plant(pool: Path, name: str, size: int) -> Path:
    pool.mkdir(parents=True, exist_ok=True)
    path = pool / f"{name}.spare"
    path.write_bytes(b"\xee" * size)
    return path


def undeletable_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a ``*.spare`` file fails with EPERM (a file made immutable, a pool folder of
    another owner): everything else deletes as usual."""
    real = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path).endswith(".spare"):
            raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def test_a_spare_trim_cannot_delete_stays_counted_and_the_others_go(tmp_path) -> None:
    """The largest spare turns into a folder between trim's listing and its delete (another
    process took it and planted one): trim does not raise, counts what it could not delete,
    and deletes the next largest until the pool fits."""
    storage = Storage(str(tmp_path / "root"))
    assert isinstance(storage, LocalStorage)
    pool = storage.keep_spares()
    folder = Path(pool.directory)
    big = plant(folder, "big", 5 * MIB)
    plant(folder, "mid", 3 * MIB)
    plant(folder, "small", 2 * MIB)
    listed = pool._spares

    def racing() -> list[tuple[int, str]]:
        out = listed()
        big.unlink()
        big.mkdir()  # a folder where the listing saw the largest spare
        return out

    pool._spares = racing  # type: ignore[method-assign]
    pool.trim(8 * MIB)
    assert sorted(p.name for p in folder.iterdir()) == ["big.spare", "small.spare"]
    assert big.is_dir()


def test_a_spare_that_cannot_be_deleted_fails_no_save_and_retention_goes_on(
    tmp_path, monkeypatch
) -> None:
    """A killed run left spares larger than a save writes, and they cannot be deleted: the
    trim after each save used to raise out of the save's background part on the node's lead,
    so every save failed after its commit, local retention never ran again (the node-local
    tier in /dev/shm grew with every save) and nothing was persisted; close raised too."""
    local = tmp_path / "local"
    for i in range(3):
        plant(local / ".spares", f"killed{i}", 8 * MIB)
    undeletable_spares(monkeypatch)
    eng = CheckpointEngine(
        tmp_path / "persistent",
        local_root=local,
        async_save=False,
        persist_every_n_saves=2,
    )
    with eng:
        for step in range(1, 6):
            state = {"w": torch.arange(1 << 19, dtype=torch.float32) + step, "step": step}
            eng.save(state, step=step).result()
        eng.wait()
    kept = sorted(n for n in os.listdir(local) if n.startswith("step_"))
    assert kept == ["step_000000004", "step_000000005"]
    persisted = sorted(n for n in os.listdir(tmp_path / "persistent") if n.startswith("step_"))
    # step 4 persists unless step 2 still uploads then (the next save persists instead)
    assert persisted in (
        ["step_000000002", "step_000000004"],
        ["step_000000002", "step_000000005"],
    ), persisted
