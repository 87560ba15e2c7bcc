"""CheckpointEngine in one process: semantics, integrity, fallback, retention, leftovers."""

import json
import time
import warnings
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from lightning_elastic import (
    CheckpointEngine,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    CorruptCheckpointWarning,
    IntegrityError,
    KeepLastN,
    RetryPolicy,
    Storage,
    UnsupportedFormatError,
)
from lightning_elastic.core.format.manifest import MANIFEST_FILE, QUARANTINE_FILE
from lightning_elastic.testing.faults import Fault, FaultyFileSystem


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "bf16": torch.randn(16, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(10),
        "flags": torch.tensor([True, False]),
        "nested": {"list": [torch.ones(3) * seed, {"k": seed}], "text": f"seed={seed}"},
    }


def template() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
        "bf16": torch.zeros(16, dtype=torch.bfloat16),
        "scalar": torch.tensor(0.0),
        "ints": torch.zeros(10, dtype=torch.long),
        "flags": torch.zeros(2, dtype=torch.bool),
        "nested": {"list": [torch.zeros(3), {"k": None}], "text": None},
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def shard_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.distcp"))


@pytest.fixture
def engine(tmp_path):
    eng = CheckpointEngine(tmp_path / "ckpts")
    yield eng
    eng.close()


def test_roundtrip_all_value_kinds(engine: CheckpointEngine) -> None:
    state = make_state(1)
    handle = engine.save(
        state,
        step=7,
        epoch=2,
        metadata={"lr": 0.1},
        metrics={"loss": 0.5},
        rank_state={"rng": torch.get_rng_state(), "pos": 123},
    )
    result = handle.result()
    assert result.name == "step_000000007" and result.bytes_written > 0
    manifest = result.manifest
    assert manifest.step == 7 and manifest.epoch == 2 and manifest.world_size == 1
    assert manifest.metadata == {"lr": 0.1} and manifest.metrics == {"loss": 0.5}
    assert {"torch", "python", "lightning_elastic"} <= set(manifest.versions)
    loaded = template()
    out = engine.load(loaded)
    assert_same(state, loaded)
    assert out.rank_state["pos"] == 123
    assert torch.equal(out.rank_state["rng"], torch.get_rng_state())
    assert out.info.name == "step_000000007" and engine.resumed_from == "step_000000007"


def test_stateful_objects_are_saved_and_restored(engine: CheckpointEngine) -> None:
    model = torch.nn.Linear(8, 4)
    engine.save({"model": model}, step=1).result()
    fresh = torch.nn.Linear(8, 4)
    engine.load({"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_async_save_captures_state_at_call_time(tmp_path) -> None:
    # a slow writer proves the copy happened before save() returned
    fs = FaultyFileSystem(LocalFileSystem(), [Fault("open", "*.distcp", "stall", seconds=0.5)])
    with CheckpointEngine(storage=Storage(tmp_path, fs=fs)) as eng:
        state = {"w": torch.zeros(1000), "opt": {"m": torch.ones(10)}}
        handle = eng.save(state, step=1)
        assert not handle.done()
        state["w"].add_(1)
        state["opt"]["m"].mul_(5)
        handle.result()
        loaded = {"w": torch.empty(1000), "opt": {"m": torch.empty(10)}}
        eng.load(loaded)
    assert torch.equal(loaded["w"], torch.zeros(1000))
    assert torch.equal(loaded["opt"]["m"], torch.ones(10))


def test_twenty_back_to_back_async_saves_reuse_the_arena(engine: CheckpointEngine) -> None:
    state = make_state()
    for step in range(1, 21):
        state["model"]["w"].fill_(step)
        assert engine.save(state, step=step) is not None
    last = engine.wait()
    assert last.step == 20
    assert engine.arena.allocations == 1
    assert [i.step for i in engine.list()] == list(range(1, 21))
    loaded = template()
    engine.load(loaded)
    assert torch.all(loaded["model"]["w"] == 20)


def test_when_busy_skip_returns_none(tmp_path) -> None:
    fs = FaultyFileSystem(LocalFileSystem(), [Fault("open", "*.distcp", "stall", seconds=0.5)])
    with CheckpointEngine(storage=Storage(tmp_path, fs=fs), when_busy="skip") as eng:
        first = eng.save({"x": torch.ones(4)}, step=1)
        assert eng.save({"x": torch.ones(4)}, step=2) is None
        first.result()
        assert eng.save({"x": torch.ones(4)}, step=3) is not None
        eng.wait()
        assert [i.step for i in eng.list()] == [1, 3]


def test_sync_save_is_committed_on_return(tmp_path) -> None:
    with CheckpointEngine(tmp_path, async_save=False) as eng:
        handle = eng.save({"x": torch.arange(5)}, step=3)
        assert handle.done() and (tmp_path / "step_000000003" / MANIFEST_FILE).exists()
        assert eng.arena.allocations == 0  # sync writes straight from the tensors


def test_zstd_compression_roundtrip_and_smaller(tmp_path) -> None:
    state = {"zeros": torch.zeros(100_000), "obj": {"a": "x" * 1000}}
    with (
        CheckpointEngine(tmp_path / "plain") as plain,
        CheckpointEngine(tmp_path / "z", compression="zstd") as z,
    ):
        raw = plain.save(state, step=1).result()
        packed = z.save(state, step=1).result()
        assert packed.manifest.compression == "zstd"
        assert packed.bytes_written * 20 < raw.bytes_written
        loaded = {"zeros": torch.ones(100_000), "obj": {"a": None}}
        z.load(loaded)
    assert torch.equal(loaded["zeros"], state["zeros"]) and loaded["obj"] == state["obj"]


def test_metadata_must_be_json_safe(engine: CheckpointEngine) -> None:
    with pytest.raises(ConfigError, match=r"metadata\['cfg'\] is a object"):
        engine.save({"x": torch.ones(1)}, step=1, metadata={"cfg": object()})
    with pytest.raises(ConfigError, match="step"):
        engine.save({"x": torch.ones(1)}, step=-1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"when_busy": "queue"}, "when_busy"),
        ({"compression": "lz4"}, "compression"),
        ({"checksum": "md5"}, "checksum"),
    ],
)
def test_options_validated(tmp_path, kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        CheckpointEngine(tmp_path, **kwargs)


def test_explicit_name_collision_and_overwrite(engine: CheckpointEngine) -> None:
    engine.save({"x": torch.ones(2)}, step=1, name="final").result()
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        engine.save({"x": torch.ones(2)}, step=2, name="final")
    engine.save({"x": torch.full((2,), 7.0)}, step=2, name="final", overwrite=True).result()
    loaded = {"x": torch.zeros(2)}
    engine.load(loaded, checkpoint="final")
    assert torch.equal(loaded["x"], torch.full((2,), 7.0))


def test_second_checkpoint_at_same_step_gets_new_name(engine: CheckpointEngine) -> None:
    engine.save({"x": torch.ones(2)}, step=5).result()
    second = engine.save({"x": torch.ones(2)}, step=5).result()
    assert second.name == "step_000000005-1"


# ---------------------------------------------------------------- integrity


def corrupt_bit(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def two_checkpoints(tmp_path) -> tuple[CheckpointEngine, Path, Path]:
    eng = CheckpointEngine(tmp_path)
    eng.save(make_state(1), step=1).result()
    eng.save(make_state(2), step=2).result()
    return eng, tmp_path / "step_000000001", tmp_path / "step_000000002"


@pytest.mark.parametrize(
    ("damage", "verify", "reason"),
    [
        (lambda d: corrupt_bit(shard_files(d)[0]), "full", "checksum"),
        (lambda d: corrupt_bit(next(d.glob("*-dcp_metadata.json")), 10), "full", "checksum"),
        (
            lambda d: shard_files(d)[0].write_bytes(shard_files(d)[0].read_bytes()[:-7]),
            "size",
            "size is",
        ),
        (lambda d: shard_files(d)[0].unlink(), "size", "missing"),
        (lambda d: shard_files(d)[0].unlink(), "full", "missing"),
    ],
)
def test_explicit_load_of_damaged_checkpoint_names_file(tmp_path, damage, verify, reason) -> None:
    eng, _, newest = two_checkpoints(tmp_path)
    damage(newest)
    with pytest.raises(IntegrityError, match=reason) as info:
        eng.load(template(), checkpoint="step_000000002", verify=verify)
    assert info.value.file.endswith((".distcp", ".json"))
    eng.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: corrupt_bit(shard_files(d)[0]),
        lambda d: shard_files(d)[0].unlink(),
        lambda d: (d / MANIFEST_FILE).write_text((d / MANIFEST_FILE).read_text()[:50]),
    ],
)
def test_latest_valid_falls_back_and_quarantines(tmp_path, damage) -> None:
    eng, _older, newest = two_checkpoints(tmp_path)
    damage(newest)
    loaded = template()
    with pytest.warns(CorruptCheckpointWarning, match="step_000000002"):
        result = eng.load(loaded)
    assert result.info.name == "step_000000001"
    assert_same(make_state(1), loaded)
    assert (newest / QUARANTINE_FILE).exists()  # quarantined, data kept
    assert any(newest.iterdir())
    statuses = {i.name: i.status for i in eng.list()}
    assert statuses == {"step_000000001": "valid", "step_000000002": "corrupt"}
    # a second resume skips it quietly and never deletes it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert eng.load(template()).info.name == "step_000000001"
    eng.close()


def test_deleted_manifest_means_no_checkpoint(tmp_path) -> None:
    eng, _, newest = two_checkpoints(tmp_path)
    (newest / MANIFEST_FILE).unlink()
    assert {i.name: i.status for i in eng.list()}["step_000000002"] == "incomplete"
    assert eng.load(template()).info.name == "step_000000001"
    with pytest.raises(CheckpointNotFoundError):
        eng.load(template(), checkpoint="step_000000002")
    eng.close()


def test_newer_format_version_is_refused_with_the_version(tmp_path) -> None:
    eng, _, newest = two_checkpoints(tmp_path)
    body = json.loads((newest / MANIFEST_FILE).read_text())
    body["format_version"] = 99
    (newest / MANIFEST_FILE).write_text(json.dumps(body))
    with pytest.raises(UnsupportedFormatError, match="version 99"):
        eng.load(template())
    with pytest.raises(UnsupportedFormatError, match="version 99"):
        eng.load(template(), checkpoint="step_000000002")
    assert not (newest / QUARANTINE_FILE).exists()  # not corrupt, just newer
    eng.close()


def test_no_checkpoint_raises_not_found(engine: CheckpointEngine) -> None:
    assert engine.latest() is None
    with pytest.raises(CheckpointNotFoundError, match="no valid checkpoint"):
        engine.load(template())


# ---------------------------------------------------------------- failures and cleanup


def test_background_failure_surfaces_at_next_save_and_keeps_previous(tmp_path) -> None:
    fs = FaultyFileSystem(LocalFileSystem(), [Fault("write", "*.distcp", "EACCES", skip=1)])
    retry = RetryPolicy(deadline_s=1, initial_backoff_s=0.01, max_backoff_s=0.01)
    eng = CheckpointEngine(storage=Storage(tmp_path, fs=fs, retry=retry))
    eng.save({"x": torch.ones(3)}, step=1).result()
    eng.save({"x": torch.ones(3)}, step=2)  # fails in the background
    time.sleep(0.2)
    with pytest.raises(CheckpointSaveError) as info:
        eng.save({"x": torch.ones(3)}, step=3)
    assert info.value.failed_ranks == [0] and info.value.phases == {"write"}
    assert "EACCES" in str(info.value) or "denied" in str(info.value).lower()
    assert not (tmp_path / "step_000000002").exists()  # fully discarded
    assert [i.name for i in eng.list()] == ["step_000000001"]
    eng.save({"x": torch.ones(3)}, step=3).result()  # the engine keeps working
    eng.close()


def test_failure_surfaces_at_close(tmp_path) -> None:
    fs = FaultyFileSystem(LocalFileSystem(), [Fault("write", "*.distcp", "EACCES")])
    eng = CheckpointEngine(storage=Storage(tmp_path, fs=fs))
    eng.save({"x": torch.ones(3)}, step=1)
    with pytest.raises(CheckpointSaveError):
        eng.close()


def test_enospc_never_deletes_the_only_valid_checkpoint(tmp_path) -> None:
    fs = FaultyFileSystem(
        LocalFileSystem(), [Fault("write", "*.distcp", "ENOSPC", skip=1, times=0)]
    )
    eng = CheckpointEngine(storage=Storage(tmp_path, fs=fs), retention=[KeepLastN(1)])
    eng.save({"x": torch.ones(3)}, step=1).result()
    for step in (2, 3):
        with pytest.raises(CheckpointSaveError) as info:
            eng.save({"x": torch.ones(3)}, step=step).result()
        assert "StorageFullError" in str(info.value)
    assert [(i.name, i.status) for i in eng.list()] == [("step_000000001", "valid")]
    assert eng.load({"x": torch.zeros(3)}).info.name == "step_000000001"


def test_leftovers_of_crashed_saves_are_cleaned_by_next_commit(tmp_path) -> None:
    eng = CheckpointEngine(tmp_path, run_id="run-a")
    eng.save({"x": torch.ones(3)}, step=1).result()
    # a crashed save of this run, a recent one of another run (maybe still writing), an old
    # one of another run (past the grace period), and a stray file in a committed dir
    now = time.time()
    for name, run, born in (
        ("step_000000002", "run-a", now),
        ("step_000000009", "run-b", now),
        ("step_000000008", "run-c", now - 3 * 3600),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "_staging.json").write_text(
            json.dumps({"run_id": run, "save_id": "dead", "step": 2, "created_unix": born})
        )
        (tmp_path / name / "dead-rank00000.distcp").write_bytes(b"partial")
    statuses = {i.name: i.status for i in eng.list()}
    assert statuses["step_000000002"] == "incomplete"
    # same step: the crashed save's directory is never written again, its claim is honoured
    eng.save({"x": torch.ones(3)}, step=2).result()
    committed = tmp_path / "step_000000002-1"
    assert sorted(p.name for p in committed.iterdir()) == sorted(
        [MANIFEST_FILE, *[p.name for p in committed.glob("*-dcp_metadata.json")]]
        + [p.name for p in shard_files(committed)]
    )
    assert len(shard_files(committed)) == 1
    assert not (tmp_path / "step_000000002").exists()  # this run's leftover: collected
    assert (tmp_path / "step_000000009").exists()  # another run's, recent: untouched
    assert not (tmp_path / "step_000000008").exists()  # another run's, past the grace
    eng.close()


def test_retention_keeps_last_n_and_resumed_from(tmp_path) -> None:
    with CheckpointEngine(tmp_path, run_id="r") as first:
        for step in (1, 2, 3):
            first.save({"x": torch.ones(1)}, step=step)
    eng = CheckpointEngine(tmp_path, retention=[KeepLastN(2)])
    eng.load({"x": torch.zeros(1)}, checkpoint="step_000000001")
    assert eng.run_id == "r"  # adopted
    for step in (4, 5, 6):
        eng.save({"x": torch.ones(1)}, step=step).result()
    assert [i.step for i in eng.list()] == [1, 5, 6]
    eng.close()


def test_retention_only_runs_after_commit(tmp_path) -> None:
    fs = FaultyFileSystem(LocalFileSystem(), [Fault("write", "*manifest.json*", "EACCES", skip=2)])
    eng = CheckpointEngine(storage=Storage(tmp_path, fs=fs), retention=[KeepLastN(1)])
    eng.save({"x": torch.ones(1)}, step=1).result()
    eng.save({"x": torch.ones(1)}, step=2).result()
    with pytest.raises(CheckpointSaveError, match="commit"):
        eng.save({"x": torch.ones(1)}, step=3).result()
    assert [i.name for i in eng.list()] == ["step_000000002"]


def test_engine_on_memory_and_s3(any_root) -> None:
    root, options = any_root
    with CheckpointEngine(root, storage_options=options, retention=[KeepLastN(1)]) as eng:
        eng.save(make_state(1), step=1)
        eng.save(make_state(2), step=2).result()
        loaded = template()
        assert eng.load(loaded).info.name == "step_000000002"
        assert_same(make_state(2), loaded)
        assert [i.name for i in eng.list()] == ["step_000000002"]


def test_closed_engine_refuses(tmp_path) -> None:
    eng = CheckpointEngine(tmp_path)
    eng.close()
    eng.close()
    with pytest.raises(ConfigError, match="closed"):
        eng.save({"x": torch.ones(1)}, step=1)


def test_save_blocks_only_briefly(tmp_path) -> None:
    # not a speed target (those live in benchmarks/): only that async returns before the write
    fs = FaultyFileSystem(LocalFileSystem(), [Fault("closed", "*.distcp", "stall", seconds=1.0)])
    with CheckpointEngine(storage=Storage(tmp_path, fs=fs)) as eng:
        handle = eng.save({"x": torch.ones(1000)}, step=1)
        assert not handle.done()
        assert handle.result().blocked_s < handle.result().total_s


def test_plan_cache_follows_structure_changes(engine: CheckpointEngine) -> None:
    engine.save({"a": torch.ones(4)}, step=1).result()
    engine.save({"a": torch.ones(4) * 2}, step=2).result()  # cached plan
    assert engine._plan_cache is not None
    engine.save({"a": torch.ones(6) * 3, "b": torch.zeros(2)}, step=3).result()  # new plan
    loaded = {"a": torch.empty(6), "b": torch.empty(2)}
    engine.load(loaded)
    assert torch.equal(loaded["a"], torch.ones(6) * 3)
    loaded = {"a": torch.empty(4)}
    engine.load(loaded, checkpoint="step_000000002")
    assert torch.equal(loaded["a"], torch.ones(4) * 2)


def test_load_without_template_rebuilds_exact_structure(engine: CheckpointEngine) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {
        "optim": opt.state_dict(),
        "empty": {},
        "nested": {"e": {}, 3: "int key", "t": (1, 2), "l": [torch.ones(2), "x"]},
        "objs": {0: {"name": "zero"}, 1: [1, 2]},
    }
    engine.save(state, step=1).result()
    loaded = engine.load().state
    assert loaded["empty"] == {} and loaded["nested"]["e"] == {}
    assert loaded["nested"][3] == "int key" and loaded["nested"]["t"] == (1, 2)
    assert loaded["objs"] == {0: {"name": "zero"}, 1: [1, 2]}
    assert set(loaded["optim"]["state"]) == {0, 1}  # int keys survive
    fresh = torch.optim.Adam(torch.nn.Linear(4, 3).parameters())
    fresh.load_state_dict(loaded["optim"])
    assert torch.equal(
        fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def test_template_with_int_keyed_objects_keeps_keys(engine: CheckpointEngine) -> None:
    engine.save({"s": {0: {"x": 1}, 1: torch.ones(2)}}, step=1).result()
    template = {"s": {0: {"x": None}, 1: torch.zeros(2)}}
    engine.load(template)
    assert template == {"s": {0: {"x": 1}, 1: template["s"][1]}} and set(template["s"]) == {0, 1}
    assert torch.equal(template["s"][1], torch.ones(2))


def test_new_ranks_get_deterministic_distinct_rng_streams() -> None:
    from lightning_elastic.core.elastic import rng

    a, b, again = rng.derived_states(7, 3), rng.derived_states(7, 4), rng.derived_states(7, 3)
    assert torch.equal(a["torch"], again["torch"]) and a["python"] == again["python"]
    assert not torch.equal(a["torch"], b["torch"])
    saved = rng.capture()
    rng.restore(a)
    first = torch.rand(3)
    rng.restore(again)
    assert torch.equal(torch.rand(3), first)
    rng.restore(saved)
