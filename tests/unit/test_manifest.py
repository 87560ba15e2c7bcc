import json

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_elastic.core.format.dcp_json import (
    ItemLocation,
    metadata_from_json,
    metadata_to_json,
)
from lightning_elastic.core.format.manifest import (
    FORMAT_VERSION,
    FileRecord,
    Manifest,
    RankRecord,
    ReferenceRecord,
    Timings,
    _content_digest,
    check_json_safe,
)
from lightning_elastic.errors import ManifestError, UnsupportedFormatError


def make_manifest(**overrides) -> Manifest:
    fields = dict(
        run_id="run",
        save_id="sid",
        name="step_000000001",
        step=1,
        epoch=0,
        created_unix=1.5,
        world_size=2,
        ranks=(RankRecord(0, "h", 1, 0, 10, 0.1, 0.2), RankRecord(1, "h", 2, 1, 5, 0.1, 0.3)),
        files=(FileRecord("a.distcp", 10, "ff", 0), FileRecord("dcp_metadata.json", 3, "ee")),
        checksum_algorithm="xxh3_64",
        timings=Timings(0.1, 0.3, 0.05, 0.5),
        versions={"torch": "2.13.0"},
        metrics={"val_loss": 0.25},
        metadata={"hparams": {"lr": 0.1}, "config": "a: 1"},
    )
    fields.update(overrides)
    return Manifest(**fields)


def test_roundtrip() -> None:
    m = make_manifest()
    text = m.to_json()
    body = json.loads(text)
    assert body["format"] == "lightning_elastic.checkpoint"
    assert body["format_version"] == 2  # without references: readable by version-2 releases
    assert body["total_bytes"] == 13
    assert Manifest.from_json(text, "x") == m


def test_newer_version_names_required_version() -> None:
    body = json.loads(make_manifest().to_json())
    body["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match=f"format version {FORMAT_VERSION + 1}"):
        Manifest.from_json(json.dumps(body), "ckpt/manifest.json")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "[]",
        '{"format": "other", "format_version": 1}',
        '{"format": "lightning_elastic.checkpoint", "format_version": 1}',
    ],
)
def test_malformed(text) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(text, "m")


def test_truncated_manifest_is_malformed() -> None:
    text = make_manifest().to_json()
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(text[: len(text) // 2], "m")


def test_json_safety_names_the_bad_path() -> None:
    check_json_safe({"a": [1, 2.0, None, {"b": "c"}]}, "metadata")
    with pytest.raises(TypeError, match=r"metadata\['a'\]\[1\] is a set"):
        check_json_safe({"a": [1, {2}]}, "metadata")
    with pytest.raises(TypeError, match="nan"):
        check_json_safe({"x": float("nan")}, "metadata")


def test_dcp_metadata_json_roundtrip() -> None:
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                torch.Size([4, 2]),
                [
                    ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                    ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2])),
                ],
            ),
            "obj": BytesStorageMetadata(),
        },
        planner_data={"w": ("model", "w"), "obj": ("extra", 0)},
        storage_data={
            MetadataIndex("w", [0, 0], 0): ItemLocation("f0", 0, 8),
            MetadataIndex("w", [2, 0], 1): ItemLocation("f1", 64, 8, ("stream.zstd/1",)),
            MetadataIndex("obj"): ItemLocation("f0", 64, 30),
        },
        version="1.0.0",
    )
    back = metadata_from_json(metadata_to_json(md), "x")
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data
    assert back.storage_data == md.storage_data
    assert [k.index for k in back.storage_data] == [0, 1, None]


def test_dcp_metadata_rejects_unknown_dtype() -> None:
    body = json.loads(
        metadata_to_json(
            Metadata(
                {"w": TensorStorageMetadata(TensorProperties(), torch.Size([1]), [])},
                storage_data={},
            )
        )
    )
    body["tensors"]["w"]["dtype"] = "nonsense"
    with pytest.raises(ManifestError, match="nonsense"):
        metadata_from_json(json.dumps(body), "x")


def test_a_manifest_with_references_is_format_3_and_roundtrips() -> None:
    refs = (ReferenceRecord("step_1", "abc-rank00000.distcp", 1000, "beef", 0),)
    m = make_manifest(references=refs)
    body = json.loads(m.to_json())
    assert body["format_version"] == FORMAT_VERSION == 3
    assert body["references"][0]["checkpoint"] == "step_1"
    back = Manifest.from_json(m.to_json(), "x")
    assert back == m and back.referenced_checkpoints == {"step_1"}
    assert back.total_bytes == 13 and back.referenced_bytes == 1000


@pytest.mark.parametrize(
    "reference",
    [
        {"checkpoint": "../elsewhere", "path": "a-rank00000.distcp", "size": 1, "checksum": "ff"},
        {"checkpoint": "step_1", "path": "a/b", "size": 1, "checksum": "ff"},
        {"checkpoint": "step_1", "path": "a.distcp", "size": 1, "checksum": "ff"},  # own file
        {"checkpoint": "step_9", "path": "x.distcp", "size": 1, "checksum": "ff"},  # itself
        {"checkpoint": "step_1", "path": "x.distcp", "size": -1, "checksum": "ff"},
        {"checkpoint": "step_1", "path": "x.distcp", "size": 1, "checksum": "XY"},
    ],
)
def test_a_malformed_reference_makes_the_manifest_corrupt(reference) -> None:
    refs = (ReferenceRecord("step_1", "abc-rank00000.distcp", 1000, "beef", 0),)
    body = json.loads(make_manifest(references=refs, name="step_9").to_json())
    body["references"] = [reference]
    body["manifest_checksum"] = _content_digest(body)
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(body), "x")


def test_a_manifest_without_references_is_written_as_version_2_for_older_readers() -> None:
    body = json.loads(make_manifest().to_json())
    assert body["format_version"] == 2 and "references" not in body
