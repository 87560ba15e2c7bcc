"""verify="full" checks the shard files' checksums while the load reads them (one pass over
the bytes): the reader's hashing in file order, and the engine's fallback when a corrupt
file is found only then."""

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_elastic import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CorruptCheckpointWarning,
    IntegrityError,
    Storage,
)
from lightning_elastic.core.format.dcp_json import read_checkpoint_metadata
from lightning_elastic.core.format.manifest import QUARANTINE_FILE, FileRecord
from lightning_elastic.core.load import reader as reader_module
from lightning_elastic.core.load import select as select_module
from lightning_elastic.core.load.reader import ShardReader
from lightning_elastic.core.storage.checksum import new_hasher
from tests.unit.test_engine import assert_same, make_state, shard_files, template

DATA = bytes(range(256)) * 40  # 10,240 bytes


def record(path: Path, data: bytes, size: int | None = None) -> FileRecord:
    hasher = new_hasher("xxh3_64")
    hasher.update(data)
    return FileRecord(path.name, len(data) if size is None else size, hasher.hexdigest(), 0)


def reader_over(tmp_path: Path, data: bytes = DATA, **kwargs) -> tuple[ShardReader, Path]:
    path = tmp_path / "f.distcp"
    path.write_bytes(kwargs.pop("on_disk", data))
    rec = record(path, data, kwargs.pop("size", None))
    return ShardReader(Storage(tmp_path), Metadata({}), verify=[rec]), path


def out(n: int) -> memoryview:
    return memoryview(bytearray(n))


@pytest.mark.parametrize("scratch", [7, 1000, 1 << 20])
def test_ranges_in_any_order_and_overlapping_are_hashed_once_in_file_order(
    tmp_path, monkeypatch, scratch
) -> None:
    monkeypatch.setattr(reader_module, "SCRATCH_BYTES", scratch)
    reader, _ = reader_over(tmp_path)
    wanted = [(5000, out(100)), (10, out(50)), (40, out(30)), (9000, out(1240))]
    reader.read_ranges("f.distcp", wanted)
    late = [(20, out(10)), (9500, out(100))]  # a second read, behind what was hashed
    reader.read_ranges("f.distcp", late)
    for offset, view in wanted + late:
        assert bytes(view) == DATA[offset : offset + view.nbytes]
    assert reader.finish_verification() == []
    # the reader counts the gaps it read for the hash only (the ranges asked for are counted
    # by the load's batch): every byte but the union of the ranges (10..70 overlaps)
    assert reader.bytes_read == len(DATA) - 100 - 60 - 1240


def test_a_corrupt_byte_no_range_needed_is_found(tmp_path) -> None:
    bad = bytearray(DATA)
    bad[7000] ^= 1  # outside every range read below: found through the scratch buffer
    reader, _ = reader_over(tmp_path, on_disk=bytes(bad))
    view = out(100)
    reader.read_ranges("f.distcp", [(0, view)])
    assert bytes(view) == DATA[:100]
    [problem] = reader.finish_verification()
    assert problem.file == "f.distcp" and "checksum" in problem.reason


def test_nothing_read_the_whole_file_is_hashed(tmp_path) -> None:
    reader, _ = reader_over(tmp_path)
    assert reader.finish_verification() == []
    assert reader.bytes_read == len(DATA)


def test_a_short_or_missing_file_is_a_problem_not_an_error(tmp_path) -> None:
    reader, path = reader_over(tmp_path, on_disk=DATA[:-10])
    [problem] = reader.finish_verification()
    assert problem.reason == f"size is {len(DATA) - 10} bytes, the manifest says {len(DATA)}"
    reader, path = reader_over(tmp_path)
    path.unlink()
    [problem] = reader.finish_verification()
    assert problem.reason == "file is missing"


# ------------------------------------------------------------------ the engine


def full_checks(monkeypatch) -> list[str]:
    """Record every file selection checks with a full checksum pass of its own."""
    checked: list[str] = []
    original = select_module.verify_files

    def verify_files(storage, manifest, mode, files=None, *, routes=None):
        if mode == "full":
            checked.extend(r.path for r in (manifest.files if files is None else files))
        return original(storage, manifest, mode, files, routes=routes)

    monkeypatch.setattr(select_module, "verify_files", verify_files)
    return checked


def test_a_full_verification_reads_the_shard_bytes_once(tmp_path, monkeypatch) -> None:
    eng = CheckpointEngine(tmp_path)
    eng.save(make_state(1), step=1).result()
    checked = full_checks(monkeypatch)
    loaded = template()
    result = eng.load(loaded)  # verify="full", the default
    assert checked and not [f for f in checked if f.endswith(".distcp")], checked
    assert_same(make_state(1), loaded)
    shard_bytes = sum(p.stat().st_size for p in shard_files(tmp_path / "step_000000001"))
    assert result.bytes_read == shard_bytes  # every byte once: loaded and hashed together
    # trusted loads unpickle before anything is verified: they keep the separate pass
    eng.load(template(), trusted=True)
    assert [f for f in checked if f.endswith(".distcp")], "trusted: verified before unpickled"
    eng.close()


def corrupt_object_bytes(ckpt: Path, fqn_part: str) -> None:
    """Flip a byte in the middle of the pickled object whose FQN contains ``fqn_part``."""
    metadata, _ = read_checkpoint_metadata(Storage(ckpt))
    [(_, where)] = [(i, loc) for i, loc in metadata.storage_data.items() if fqn_part in i.fqn]
    path = ckpt / where.file
    data = bytearray(path.read_bytes())
    data[where.offset + where.length // 2] ^= 0x55
    path.write_bytes(bytes(data))


def test_corrupt_object_bytes_fall_back_instead_of_failing_the_load(tmp_path) -> None:
    """Bytes that fail to unpickle are found corrupt by the verification that completes
    after the failed read: the checkpoint is quarantined, the one before is loaded."""
    eng = CheckpointEngine(tmp_path)
    eng.save(make_state(1), step=1).result()
    eng.save(make_state(2), step=2).result()
    newest = tmp_path / "step_000000002"
    corrupt_object_bytes(newest, "text")
    loaded = template()
    with pytest.warns(CorruptCheckpointWarning, match="step_000000002"):
        result = eng.load(loaded)
    assert result.info.name == "step_000000001"
    assert_same(make_state(1), loaded)
    assert (newest / QUARANTINE_FILE).exists()
    eng.close()


def corrupt_newest_shard(root: Path, name: str) -> None:
    shard = shard_files(root / name)[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 1
    shard.write_bytes(bytes(data))


def test_every_checkpoint_corrupt(tmp_path) -> None:
    """In place, the state was partly overwritten by the corrupt checkpoint: an
    IntegrityError that says so; into a new state, simply nothing to resume."""
    eng = CheckpointEngine(tmp_path)
    eng.save(make_state(1), step=1).result()
    corrupt_newest_shard(tmp_path, "step_000000001")
    with pytest.warns(CorruptCheckpointWarning), pytest.raises(IntegrityError, match="partly"):
        eng.load(template())
    eng.close()
    eng = CheckpointEngine(tmp_path)  # quarantined now: skipped without reading it
    with pytest.raises(CheckpointNotFoundError):
        eng.load(None)
    eng.close()


def test_into_a_new_state_a_corrupt_only_checkpoint_is_nothing_to_resume(tmp_path) -> None:
    eng = CheckpointEngine(tmp_path)
    eng.save(make_state(1), step=1).result()
    corrupt_newest_shard(tmp_path, "step_000000001")
    with pytest.warns(CorruptCheckpointWarning), pytest.raises(CheckpointNotFoundError):
        eng.load(None)
    eng.close()


def test_targets_the_older_checkpoint_does_not_rewrite_are_reported(tmp_path) -> None:
    """The corrupt newest held "b", the older one does not: "b"'s target keeps corrupt bytes,
    so the load must not report success."""
    eng = CheckpointEngine(tmp_path)
    eng.save({"a": torch.ones(4)}, step=1).result()
    eng.save({"b": torch.full((4,), 7.0), "a": torch.full((4,), 2.0)}, step=2).result()
    corrupt_newest_shard(tmp_path, "step_000000002")
    mine = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with (
        pytest.warns(CorruptCheckpointWarning),
        pytest.raises(IntegrityError) as info,
    ):
        eng.load(None, targets=lambda path, shape, dtype: mine[path[0]])
    assert "does not hold b" in str(info.value) and "partly" in str(info.value)
    eng.close()


def test_a_failing_fallback_after_a_corrupt_in_place_load_says_so(tmp_path) -> None:
    eng = CheckpointEngine(tmp_path)
    eng.save({"w": torch.ones(4)}, step=1).result()
    eng.save({"w": torch.full((8,), 2.0)}, step=2).result()
    corrupt_newest_shard(tmp_path, "step_000000002")
    with pytest.warns(CorruptCheckpointWarning), pytest.raises(IntegrityError) as info:
        eng.load({"w": torch.zeros(8)})
    message = str(info.value)
    assert "step_000000001" in message and "instead failed" in message and "partly" in message
    eng.close()


def test_a_named_corrupt_checkpoint_loaded_in_place_says_the_state_is_partly_its(
    tmp_path,
) -> None:
    eng = CheckpointEngine(tmp_path)
    eng.save(make_state(1), step=1).result()
    corrupt_newest_shard(tmp_path, "step_000000001")
    with pytest.raises(IntegrityError, match=r"checksum.*partly"):
        eng.load(template(), checkpoint="step_000000001")
    with pytest.raises(IntegrityError, match="checksum") as info:  # into a new state: no note
        eng.load(None, checkpoint="step_000000001")
    assert "partly" not in str(info.value)
    eng.close()


def test_a_read_error_is_not_a_corrupt_checkpoint(tmp_path, monkeypatch) -> None:
    """An I/O error while reading a shard (retries spent) fails the load with that error; it
    never quarantines a checkpoint whose bytes were not shown to be wrong."""
    from lightning_elastic.errors import CheckpointLoadError, StorageError

    eng = CheckpointEngine(tmp_path)
    eng.save(make_state(1), step=1).result()
    local = type(Storage(tmp_path))

    def failing(self, rel, ranges):
        raise StorageError("read", rel, "EIO (injected)")

    monkeypatch.setattr(local, "read_ranges", failing)
    with pytest.raises((StorageError, CheckpointLoadError), match="EIO"):
        eng.load(template())
    assert not (tmp_path / "step_000000001" / QUARANTINE_FILE).exists()
    monkeypatch.undo()
    # only the hashing of the bytes no one needed fails: no verdict, the error is kept
    (tmp_path / "x").mkdir()
    reader, _ = reader_over(tmp_path / "x")
    original = local.read_ranges
    calls: list[str] = []

    def tail_fails(self, rel, ranges):
        calls.append(rel)
        if len(calls) > 1:
            raise StorageError("read", rel, "EIO (injected)")
        return original(self, rel, ranges)

    monkeypatch.setattr(local, "read_ranges", tail_fails)
    reader.read_ranges("f.distcp", [(0, out(100))])
    assert reader.finish_verification() == []  # no problem claimed
    assert reader.verify_error is not None and "EIO" in str(reader.verify_error)
    eng.close()
