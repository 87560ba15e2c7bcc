"""A rank's shard file: write_shard and ShardReader round trips (raw and zstd), ranged reads
of whole rows, and what damaged files or inconsistent metadata raise."""

import dataclasses
import os

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from lightning_elastic.core.format.dcp_json import ItemLocation
from lightning_elastic.core.load.reader import ShardReader
from lightning_elastic.core.save.stage import HostArena, direct_payload, stage_payload
from lightning_elastic.core.save.write import check_compression, write_shard
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ConfigError, ManifestError, StorageError

SHARD = "shard_rank00000.distcp"
W = torch.arange(48, dtype=torch.float32).view(6, 8)


def state() -> dict:
    return {
        "w": W.clone(),
        "half": torch.linspace(0, 1, 5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "obj": {"name": "x", "ids": [1, 2, 3]},
        "empty": torch.zeros(0, 4),
    }


def template() -> dict:
    return {
        "w": torch.zeros(6, 8),
        "half": torch.zeros(5, dtype=torch.bfloat16),
        "scalar": torch.tensor(0.0, dtype=torch.float64),
        "obj": {"name": None, "ids": None},
        "empty": torch.ones(0, 4),
    }


def write(storage: Storage, compression: str | None, staged: bool = True):
    """Plan, stage and write ``state()`` as one rank; the metadata with its storage data."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state(), None, True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    items = planner.finish_plan(plans[0]).items
    payload = (
        stage_payload(items, planner, HostArena()) if staged else direct_payload(items, planner)
    )
    shard = write_shard(storage, SHARD, payload, checksum="crc32", compression=compression)
    storage_data = {r.index: r.storage_data for r in shard.results}
    return dataclasses.replace(metadata, storage_data=storage_data), shard, payload


def read(storage: Storage, metadata, target: dict) -> ShardReader:
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, metadata, True)
    plan = planner.finish_plan(planner.create_global_plan([planner.create_local_plan()])[0])
    reader = ShardReader(storage, metadata)
    reader.read_data(plan, planner).wait()
    return reader


def assert_loaded(target: dict) -> None:
    expected = state()
    for key in ("w", "half", "scalar", "empty"):
        assert target[key].dtype == expected[key].dtype
        assert torch.equal(target[key], expected[key]), key
    assert target["obj"] == expected["obj"]


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(str(tmp_path))


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "direct"])
def test_uncompressed_shard_round_trips_every_value_kind(storage, staged) -> None:
    metadata, shard, payload = write(storage, None, staged=staged)
    assert shard.written.size == payload.size == os.path.getsize(storage.full(SHARD))
    target = template()
    reader = read(storage, metadata, target)
    assert_loaded(target)
    assert 0 < reader.bytes_read <= payload.size


def test_uncompressed_locations_are_the_payload_layout(storage) -> None:
    _, shard, payload = write(storage, None)
    locations = [r.storage_data for r in shard.results]
    assert locations == [ItemLocation(SHARD, i.offset, i.length) for i in payload.items]
    assert [r.index for r in shard.results] == [i.write_item.index for i in payload.items]
    sizes = {r.index.fqn: r.size_in_bytes for r in shard.results}
    assert sizes["w"] == 48 * 4 and sizes["scalar"] == 8


def test_zstd_shard_round_trips_with_one_frame_per_item(storage) -> None:
    metadata, shard, payload = write(storage, "zstd")
    locations = [r.storage_data for r in shard.results]
    assert all(loc.transforms == ("stream.zstd/1",) for loc in locations)
    assert all(loc.file == SHARD for loc in locations)
    # frames are contiguous, in item order, and fill the file exactly
    position = 0
    for loc in locations:
        assert loc.offset == position
        position += loc.length
    assert position == shard.written.size == os.path.getsize(storage.full(SHARD))
    assert shard.written.size < payload.size  # arange/linspace compress
    target = template()
    reader = read(storage, metadata, target)
    assert_loaded(target)
    frames = {r.index.fqn: r.storage_data.length for r in shard.results}
    # every frame is read whole, except the empty tensor's, which DCP never asks for
    assert reader.bytes_read == shard.written.size - frames["empty"]


def test_the_checksum_is_that_of_the_bytes_on_disk(storage) -> None:
    import zlib

    for compression in (None, "zstd"):
        _, shard, _ = write(storage, compression)
        with open(storage.full(SHARD), "rb") as f:
            on_disk = f.read()
        assert shard.written.checksum == f"{zlib.crc32(on_disk):08x}"


def test_unknown_compression_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="lz4"):
        check_compression("lz4")
    check_compression(None)
    check_compression("zstd")


# ---------------------------------------------------------------- ranged reads


class Target:
    """A stand-in LoadPlanner that hands out one destination tensor and records commits."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.committed: list[torch.Tensor] = []

    def resolve_tensor(self, req):
        return self.tensor

    def commit_tensor(self, req, tensor) -> None:
        self.committed.append(tensor)


def read_item(offsets, lengths, fqn="w") -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, (0,) * len(lengths)),
        dest_offsets=torch.Size((0,) * len(lengths)),
        storage_index=MetadataIndex(fqn, (0, 0)),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


def recording(storage: Storage, monkeypatch) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []
    original = storage.read_into

    def read_into(rel, offset, out):
        calls.append((rel, offset, out.nbytes))
        return original(rel, offset, out)

    def read_ranges(rel, ranges):
        for offset, out in ranges:
            read_into(rel, offset, out)

    monkeypatch.setattr(storage, "read_into", read_into)
    monkeypatch.setattr(storage, "read_ranges", read_ranges)
    return calls


def plan_of(*items: ReadItem):
    from torch.distributed.checkpoint.planner import LoadPlan

    return LoadPlan(list(items))


def test_a_row_range_reads_only_those_rows_straight_into_the_destination(
    storage, monkeypatch
) -> None:
    metadata, shard, _ = write(storage, None)
    w_offset = next(r.storage_data.offset for r in shard.results if r.index.fqn == "w")
    calls = recording(storage, monkeypatch)
    target = Target(torch.zeros(3, 8))
    reader = ShardReader(storage, metadata)
    reader.read_data(plan_of(read_item((2, 0), (3, 8))), target).wait()
    assert torch.equal(target.tensor, W[2:5])
    assert target.committed[0].data_ptr() == target.tensor.data_ptr()  # no staging buffer
    row = 8 * 4
    assert calls == [(SHARD, w_offset + 2 * row, 3 * row)]
    assert reader.bytes_read == 3 * row


def test_a_row_range_into_a_mismatched_dtype_is_converted(storage) -> None:
    metadata, _, _ = write(storage, None)
    target = Target(torch.zeros(2, 8, dtype=torch.float64))
    ShardReader(storage, metadata).read_data(plan_of(read_item((4, 0), (2, 8))), target).wait()
    assert torch.equal(target.tensor, W[4:6].double())


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_column_slice_reads_the_chunk_and_narrows_it(storage, compression) -> None:
    metadata, _, _ = write(storage, compression)
    target = Target(torch.zeros(6, 3))
    ShardReader(storage, metadata).read_data(plan_of(read_item((0, 2), (6, 3))), target).wait()
    assert torch.equal(target.tensor, W[:, 2:5])


def test_a_zstd_row_range_decodes_the_frame_and_narrows_it(storage) -> None:
    metadata, shard, _ = write(storage, "zstd")
    target = Target(torch.zeros(2, 8))
    reader = ShardReader(storage, metadata)
    reader.read_data(plan_of(read_item((1, 0), (2, 8))), target).wait()
    assert torch.equal(target.tensor, W[1:3])
    w_frame = next(r.storage_data.length for r in shard.results if r.index.fqn == "w")
    assert reader.bytes_read == w_frame  # a compressed item is read whole


# ---------------------------------------------------------------- damage and inconsistency


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_truncated_shard_is_a_storage_error_naming_the_file(storage, compression) -> None:
    metadata, shard, _ = write(storage, compression)
    path = storage.full(SHARD)
    with open(path, "r+b") as f:
        f.truncate(shard.written.size // 2)
    with pytest.raises(StorageError) as info:
        read(storage, metadata, template())
    assert info.value.op == "read"
    assert SHARD in str(info.value) and "ended after" in str(info.value)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_destination_of_another_shape_than_the_stored_chunk_is_a_manifest_error(
    storage, compression
) -> None:
    metadata, _, _ = write(storage, compression)
    target = Target(torch.zeros(2, 8))  # the region asked for is 3 rows
    with pytest.raises(ManifestError, match=r"w: stored chunk has shape \(3, 8\).*\(2, 8\)"):
        ShardReader(storage, metadata).read_data(plan_of(read_item((0, 0), (3, 8))), target)
    assert target.committed == []


def test_a_chunk_missing_from_the_metadata_is_a_manifest_error(storage) -> None:
    metadata, _, _ = write(storage, None)
    item = dataclasses.replace(read_item((0, 0), (6, 8)), storage_index=MetadataIndex("w", (3, 0)))
    metadata.storage_data[item.storage_index] = metadata.storage_data[MetadataIndex("w", (0, 0))]
    with pytest.raises(ManifestError, match="no chunk metadata for w"):
        ShardReader(storage, metadata).read_data(plan_of(item), Target(torch.zeros(6, 8)))


def test_an_item_without_stored_bytes_is_a_manifest_error(storage) -> None:
    metadata, _, _ = write(storage, None)
    metadata = dataclasses.replace(
        metadata,
        storage_data={k: v for k, v in metadata.storage_data.items() if k.fqn != "w"},
    )
    with pytest.raises(ManifestError, match="no stored bytes for w"):
        read(storage, metadata, template())


def test_a_missing_shard_is_a_storage_error(storage) -> None:
    metadata, _, _ = write(storage, None)
    os.remove(storage.full(SHARD))
    with pytest.raises(StorageError):
        read(storage, metadata, template())


def test_the_reader_reports_the_metadata_it_was_given(storage) -> None:
    metadata, _, _ = write(storage, None)
    reader = ShardReader(storage, metadata)
    assert reader.read_metadata() is metadata
    assert not ShardReader.validate_checkpoint_id(storage.url)
    reader.bytes_read = 7
    reader.reset()
    assert reader.bytes_read == 0


def test_drain_hashes_large_chunks_while_writing_even_from_a_reused_buffer() -> None:
    """Chunks of 1 MiB and more are hashed on a second thread while they are written; each
    before the next is asked for, so a source that refills one buffer hashes right."""
    from lightning_elastic.core.storage.checksum import new_hasher
    from lightning_elastic.core.storage.local import drain

    buffer = bytearray(3 << 20)
    written = bytearray()

    def chunks():
        for fill in (1, 2, 3, 4):
            buffer[:] = bytes([fill]) * len(buffer)  # the same buffer, refilled
            yield buffer
        yield b"tail"  # a small one, hashed inline

    result = drain(chunks(), "xxh3_64", written.extend)
    expected = new_hasher("xxh3_64")
    expected.update(bytes(written))
    assert result.size == len(written) == 4 * (3 << 20) + 4
    assert result.checksum == expected.hexdigest()
