"""The storage suite: the same behaviour on local disk, memory:// and S3 (moto server)."""

import errno

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from lightning_elastic import RetryPolicy, Storage
from lightning_elastic.errors import (
    CheckpointExistsError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
    TransientStorageError,
)
from lightning_elastic.testing.faults import Fault, FaultyFileSystem


@pytest.fixture
def storage(any_root) -> Storage:
    root, options = any_root
    return Storage(root, storage_options=options)


def test_write_read_roundtrip_with_checksum(storage: Storage) -> None:
    chunks = [b"abc", bytearray(b"defg"), memoryview(b"hij")]
    written = storage.write_stream("d/file.bin", lambda: iter(chunks), checksum="xxh3_64")
    assert written.size == 10
    assert storage.read_bytes("d/file.bin") == b"abcdefghij"
    assert storage.read_bytes("d/file.bin", 3, 4) == b"defg"
    assert storage.hash_file("d/file.bin", "xxh3_64") == written
    out = bytearray(4)
    storage.read_into("d/file.bin", 6, memoryview(out))
    assert bytes(out) == b"ghij"


def test_short_read_is_an_error(storage: Storage) -> None:
    storage.write_bytes("f", b"12345")
    with pytest.raises(StorageError, match="ended after"):
        storage.read_bytes("f", 2, 10)
    with pytest.raises(StorageError, match="ended after"):
        storage.read_into("f", 0, memoryview(bytearray(9)))


def test_read_ranges_fills_every_range_of_one_file(storage: Storage) -> None:
    storage.write_bytes("f", bytes(range(256)) * 64)
    outs = [bytearray(3), bytearray(0), bytearray(5000), bytearray(1)]
    offsets = [0, 10, 100, 16383]
    storage.read_ranges("f", [(o, memoryview(b)) for o, b in zip(offsets, outs, strict=True)])
    data = bytes(range(256)) * 64
    for offset, out in zip(offsets, outs, strict=True):
        assert bytes(out) == data[offset : offset + len(out)]
    with pytest.raises(StorageError, match="ended after 1 of 2 bytes from offset 16383"):
        storage.read_ranges("f", [(0, memoryview(bytearray(2))), (16383, memoryview(bytearray(2)))])
    with pytest.raises(StorageNotFoundError):
        storage.read_ranges("missing", [(0, memoryview(bytearray(1)))])


def test_listing_exists_size_delete(storage: Storage) -> None:
    assert storage.listdir() == []
    storage.write_bytes("a/one", b"1")
    storage.write_bytes("a/two", b"22")
    storage.write_bytes("b/c/three", b"333")
    top = storage.listdir()
    assert [(e.name, e.is_dir) for e in top] == [("a", True), ("b", True)]
    assert [(e.name, e.size) for e in storage.listdir("a")] == [("one", 1), ("two", 2)]
    assert storage.exists("a/two") and storage.size("a/two") == 2
    assert not storage.exists("a/nope")
    storage.delete("a/one")
    storage.delete("a/one")  # idempotent
    assert [e.name for e in storage.listdir("a")] == ["two"]
    storage.delete_tree("b")
    assert [e.name for e in storage.listdir()] == ["a"]
    assert storage.listdir("missing") == []


def test_delete_tree_leaves_what_is_written_into_it_meanwhile(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another save may claim a freed checkpoint name while its old files are being deleted:
    what it writes after the listing stays, and so does the directory, without an error."""
    storage.write_bytes("a/old", b"1")
    listdir = storage.listdir

    def then_a_claim(rel: str = "") -> list:
        entries = listdir(rel)
        if rel == "a":
            storage.write_bytes("a/claim", b"2")
        return entries

    monkeypatch.setattr(storage, "listdir", then_a_claim)
    storage.delete_tree("a")
    monkeypatch.undo()
    assert [e.name for e in storage.listdir("a")] == ["claim"]
    storage.remove_dir("a")  # not empty: left as it is
    assert storage.read_bytes("a/claim") == b"2"
    storage.delete("a/claim")
    storage.remove_dir("a")
    storage.remove_dir("a")  # missing: nothing to do
    assert storage.listdir() == []


def test_exclusive_create_refuses_existing(storage: Storage) -> None:
    storage.write_bytes("m.json", b"first", exclusive=True)
    with pytest.raises(CheckpointExistsError):
        storage.write_bytes("m.json", b"second", exclusive=True)
    assert storage.read_bytes("m.json") == b"first"
    # a non-exclusive write is an overwrite
    storage.write_bytes("m.json", b"third")
    assert storage.read_bytes("m.json") == b"third"


def test_replace_bytes_swaps_the_whole_file_and_leaves_no_temporary_name(
    storage: Storage,
) -> None:
    storage.write_bytes("d/m.json", b"old", exclusive=True)
    written = storage.replace_bytes("d/m.json", b"the new one")
    assert written.size == 11
    assert storage.read_bytes("d/m.json") == b"the new one"
    storage.replace_bytes("d/fresh.json", b"1")  # nothing to replace: a plain write
    assert sorted(e.name for e in storage.listdir("d")) == ["fresh.json", "m.json"]


def test_missing_file_is_typed_and_names_path(storage: Storage) -> None:
    with pytest.raises(StorageNotFoundError) as info:
        storage.read_bytes("nope/file")
    assert info.value.op == "read"
    assert "nope/file" in str(info.value)


def test_child_storage_is_rooted_below(storage: Storage) -> None:
    child = storage.child("x/y")
    child.write_bytes("f", b"1")
    assert storage.read_bytes("x/y/f") == b"1"
    assert child.display("f").endswith("x/y/f")


def test_refuses_to_delete_root(storage: Storage) -> None:
    with pytest.raises(StorageError, match="root"):
        storage.delete_tree("")


def _faulty(tmp_path, faults, attempts=0, deadline=5.0, sleeps=None):
    policy = RetryPolicy(
        deadline_s=deadline,
        max_attempts=attempts,
        initial_backoff_s=0.01,
        max_backoff_s=0.02,
        sleep=(sleeps.append if sleeps is not None else (lambda s: None)),
    )
    fs = FaultyFileSystem(LocalFileSystem(), faults)
    return Storage(str(tmp_path), fs=fs, retry=policy), fs


@pytest.mark.parametrize("error", ["EIO", "ECONNRESET", "EAGAIN", "timeout"])
def test_transient_errors_are_retried(tmp_path, error) -> None:
    sleeps: list[float] = []
    storage, fs = _faulty(tmp_path, [Fault("write", "*f.bin", error, times=2)], sleeps=sleeps)
    written = storage.write_stream("f.bin", lambda: [b"x" * 100], checksum="crc32")
    assert written.size == 100 and storage.read_bytes("f.bin") == b"x" * 100
    assert len(fs.fired) == 2 and len(sleeps) == 2
    assert sleeps[1] >= sleeps[0] * 0.5  # backoff grows (with jitter)


def test_transient_error_gives_up_at_deadline(tmp_path) -> None:
    storage, _ = _faulty(tmp_path, [Fault("read", "*", "EIO", times=0)], attempts=4)
    storage.write_bytes("f", b"1")
    with pytest.raises(TransientStorageError, match="gave up after 4 attempts") as info:
        storage.read_bytes("f")
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize(
    ("error", "typed"),
    [
        ("ENOSPC", StorageFullError),
        ("EACCES", StoragePermissionError),
        ("EROFS", StoragePermissionError),
    ],
)
def test_permanent_errors_fail_at_once(tmp_path, error, typed) -> None:
    storage, fs = _faulty(tmp_path, [Fault("write", "*", error, times=0)])
    with pytest.raises(typed) as info:
        storage.write_bytes("d/f", b"data")
    assert len(fs.fired) == 1  # no retry
    assert info.value.op == "write" and "d/f" in info.value.path
    assert info.value.__cause__.errno == getattr(errno, error)
    assert not (tmp_path / "d" / "f").exists()  # the partial file is removed


def test_failed_exclusive_write_leaves_nothing(tmp_path) -> None:
    storage, _ = _faulty(tmp_path, [Fault("write", "*", "ENOSPC")])
    with pytest.raises(StorageFullError):
        storage.write_bytes("m.json", b"x", exclusive=True)
    assert not storage.exists("m.json")


def test_memory_filesystem_instance_can_be_injected() -> None:
    fs = MemoryFileSystem()
    storage = Storage("memory://injected/root", fs=fs)
    storage.write_bytes("a", b"1")
    assert fs.cat_file("/injected/root/a") == b"1"


def test_bad_url_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="nosuchproto"):
        Storage("nosuchproto://x/y")


def test_storage_survives_pickling(storage: Storage) -> None:
    import pickle

    storage.write_bytes("p", b"1")
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.read_bytes("p") == b"1"


def test_file_url_uses_the_local_fast_path(tmp_path) -> None:
    storage = Storage(f"file://{tmp_path}/root")
    assert storage.is_local
    storage.write_bytes("m.json", b"{}", exclusive=True)
    assert (tmp_path / "root" / "m.json").read_bytes() == b"{}"
    with pytest.raises(CheckpointExistsError):
        storage.write_bytes("m.json", b"{}", exclusive=True)


def test_a_local_directory_removed_while_listed_lists_empty(tmp_path, monkeypatch) -> None:
    """Another run's retention removes a checkpoint directory between the check that it is
    one and its listing: empty, as a missing directory is, not a StorageNotFoundError (which
    failed a save's commit while it scanned the root)."""
    import os
    import shutil

    storage = Storage(str(tmp_path))
    storage.write_bytes("step/f", b"1")
    scandir = os.scandir

    def removed_first(path):
        if str(path).endswith("/step"):
            shutil.rmtree(path)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", removed_first)
    assert storage.listdir("step") == []


def test_direct_writes_whole_pages_and_buffers_the_tail(tmp_path) -> None:
    import torch

    from lightning_elastic.core.save.stage import PAGE, HostArena
    from lightning_elastic.core.storage.local import _LocalFile

    arena = HostArena()
    image = arena.reserve(3 * PAGE + 100)
    assert image.data_ptr() % PAGE == 0
    image.copy_(torch.arange(image.numel(), dtype=torch.int64).to(torch.uint8))
    view = memoryview(image.numpy())
    out = _LocalFile(str(tmp_path / "f"), direct=True)
    direct_supported = out.direct_fd is not None
    out.write(view[: 2 * PAGE])  # whole pages: O_DIRECT when the filesystem allows it
    out.write(view[2 * PAGE :])  # one page and a tail: buffered
    out.sync()
    out.close()
    assert (tmp_path / "f").read_bytes() == bytes(view)
    if not direct_supported:
        pytest.skip("this filesystem refuses O_DIRECT (content checked through the fallback)")


def test_direct_hint_with_unaligned_chunks_still_writes_correctly(tmp_path) -> None:
    storage = Storage(str(tmp_path))
    data = bytearray(range(256)) * 40  # not page-aligned memory
    written = storage.write_stream(
        "x",
        lambda: [memoryview(data)[:4096], memoryview(data)[4096:]],
        checksum="xxh3_64",
        direct=True,
    )
    assert storage.read_bytes("x") == bytes(data) and written.size == len(data)


def test_children_share_the_filesystem_instance(storage: Storage) -> None:
    child = storage.child("a").child("b")
    assert child.fs is storage.fs
    child.write_bytes("f", b"1")
    assert storage.read_bytes("a/b/f") == b"1"


def test_read_ranges_does_not_follow_a_planted_link(tmp_path) -> None:
    """A shard file replaced by a link to a file outside the root is refused, as by read_into."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret bytes")
    root = tmp_path / "root"
    root.mkdir()
    (root / "shard.distcp").symlink_to(outside)
    storage = Storage(str(root))
    out = bytearray(6)
    with pytest.raises(StorageError):
        storage.read_ranges("shard.distcp", [(0, memoryview(out))])
    assert bytes(out) == bytes(6)
