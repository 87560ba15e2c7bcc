"""The plan phase (plan cache, directory naming) and rank 0's commit, in one process through
the engine with ``Coordinator.single_process()`` and directly."""

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_elastic.core import engine as engine_module
from lightning_elastic.core.dist.channel import CommitChannel, CommitDecision
from lightning_elastic.core.dist.commit import commit_as_coordinator
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import (
    MANIFEST_FILE,
    QUARANTINE_FILE,
    STAGING_FILE,
    shard_file_name,
)
from lightning_elastic.core.save.plan import plan_save
from lightning_elastic.core.save.request import (
    PlannedSave,
    RunState,
    SaveConfig,
    SaveRequest,
    SaveTarget,
)
from lightning_elastic.core.save.stage import HostArena
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import CheckpointExistsError, CheckpointSaveError, Phase, RankFailure


@pytest.fixture
def engine(tmp_path):
    eng = CheckpointEngine(tmp_path / "ckpts", coordinator=Coordinator.single_process())
    yield eng
    eng.close()


@pytest.fixture
def plans(monkeypatch) -> list[PlannedSave]:
    """Every PlannedSave the engine makes, in order."""
    seen: list[PlannedSave] = []

    def spy(target, run, state_dict, request, walked=None, cache=None):
        planned = plan_save(target, run, state_dict, request, walked, cache)
        seen.append(planned)
        return planned

    monkeypatch.setattr(engine_module, "plan_save", spy)
    return seen


def root(eng: CheckpointEngine) -> Path:
    return Path(eng.storage.full())


# ---------------------------------------------------------------- plan cache


def test_an_unchanged_state_reuses_the_cached_plan(engine, plans) -> None:
    engine.save({"w": torch.ones(4), "opt": {"m": torch.zeros(2)}}, step=1).result()
    engine.save({"w": torch.full((4,), 2.0), "opt": {"m": torch.ones(2)}}, step=2).result()
    assert [p.cached for p in plans] == [False, True]
    assert plans[1].dcp_metadata is plans[0].dcp_metadata  # rank 0's metadata reused
    loaded = {"w": torch.zeros(4), "opt": {"m": torch.zeros(2)}}
    engine.load(loaded)
    assert torch.equal(loaded["w"], torch.full((4,), 2.0))
    assert torch.equal(loaded["opt"]["m"], torch.ones(2))


def test_a_cached_plan_still_writes_the_new_value_of_an_object(engine, plans) -> None:
    engine.save({"w": torch.ones(2), "note": "first"}, step=1).result()
    engine.save({"w": torch.ones(2), "note": "second, and longer"}, step=2).result()
    assert plans[1].cached
    loaded = {"w": torch.zeros(2), "note": None}
    engine.load(loaded)
    assert loaded["note"] == "second, and longer"


@pytest.mark.parametrize(
    "changed",
    [
        {"w": torch.ones(5), "b": torch.zeros(2)},  # a shape
        {"w": torch.ones(4, dtype=torch.float64), "b": torch.zeros(2)},  # a dtype
        {"w": torch.ones(4), "b": torch.zeros(2), "c": torch.ones(1)},  # a key added
        {"w": torch.ones(4)},  # a key removed
        {"w": torch.ones(4), "renamed": torch.zeros(2)},  # a key renamed
        {"w": torch.ones(4), "b": torch.zeros(2), "empty": {}},  # only the skeleton
        {"w": torch.ones(4), "b": {0: torch.zeros(2)}},  # an int key where DCP sees "0"
        {"w": torch.ones(4).requires_grad_(), "b": torch.zeros(2)},  # in DCP's properties
        {"w": torch.ones(4), "b": "an object now"},  # same paths, a tensor became an object
        {"w": torch.ones(2, 2), "b": torch.zeros(2)},  # same numel, another shape
    ],
    ids=[
        "shape",
        "dtype",
        "added",
        "removed",
        "renamed",
        "empty-dict",
        "key-type",
        "requires-grad",
        "tensor-to-object",
        "reshaped",
    ],
)
def test_a_structural_change_misses_the_cache_and_is_saved_exactly(engine, plans, changed) -> None:
    first = {"w": torch.ones(4), "b": torch.zeros(2)}
    if isinstance(changed.get("b"), dict):
        first = {"w": torch.ones(4), "b": {"0": torch.zeros(2)}}
    engine.save(first, step=1).result()
    engine.save(changed, step=2).result()
    engine.save(changed, step=3).result()
    assert [p.cached for p in plans] == [False, False, True]
    loaded = engine.load().state  # no template: rebuilt from the saved skeleton
    assert list(loaded) == list(changed)
    assert_same(loaded, changed)


def test_the_reused_plan_reads_every_value_of_the_new_state(engine, plans) -> None:
    """A reused plan resolves each FQN in the state being saved now, not in the cached one:
    new tensor objects (a re-created optimizer state) and new values are what is written."""
    nested = {f"layer{i}": {"w": torch.full((3,), float(i))} for i in range(5)}
    engine.save({"model": nested, "steps": [1, 2]}, step=1).result()
    fresh = {f"layer{i}": {"w": torch.full((3,), 10.0 + i)} for i in range(5)}
    engine.save({"model": fresh, "steps": [3, 4, 5]}, step=2).result()
    assert [p.cached for p in plans] == [False, True]
    assert plans[1].planner.state_dict["model.layer4.w"] is fresh["layer4"]["w"]
    loaded = engine.load().state
    for i in range(5):
        assert torch.equal(loaded["model"][f"layer{i}"]["w"], torch.full((3,), 10.0 + i))
    assert loaded["steps"] == [3, 4, 5]


def test_a_reused_plan_looks_leaves_up_by_the_states_own_keys(engine, plans) -> None:
    """DCP's FQN paths hold str(key): a Counter or defaultdict with int keys would answer
    "3" with a made-up 0 instead of the value under 3 (found by review)."""
    from collections import Counter, defaultdict

    def state(i: int) -> dict:
        return {
            "counts": Counter({1: 15 + i, 2: 7}),
            "hits": defaultdict(int, {3: 10 + i, 7: 20 + i}),
            "table": defaultdict(lambda: torch.zeros(3), {5: torch.full((3,), float(i))}),
        }

    for i in range(3):
        saved = state(i)
        engine.save(saved, step=i + 1).result()
        assert dict(saved["hits"]) == {3: 10 + i, 7: 20 + i}  # nothing added by a lookup
    assert [p.cached for p in plans] == [False, True, True]
    loaded = engine.load().state
    assert loaded["counts"] == {1: 17, 2: 7} and loaded["hits"] == {3: 12, 7: 22}
    assert torch.equal(loaded["table"][5], torch.full((3,), 2.0))


def test_an_optimizer_state_with_int_keys_reuses_the_local_plan(engine, monkeypatch) -> None:
    from lightning_elastic.core.save import plan as plan_module

    calls = []
    real = plan_module.DefaultSavePlanner.set_up_planner
    monkeypatch.setattr(
        plan_module.DefaultSavePlanner,
        "set_up_planner",
        lambda self, *a, **k: calls.append(1) or real(self, *a, **k),
    )
    for i in range(3):
        optim = {"state": {0: {"exp_avg": torch.full((2,), float(i))}}, "groups": [{"lr": 0.1}]}
        engine.save({"optim": optim}, step=i + 1).result()
    assert len(calls) == 1  # DCP flattened and planned the first save only
    loaded = engine.load().state
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], torch.full((2,), 2.0))


def test_a_subclassed_tensor_never_matches_the_cached_leaves() -> None:
    """A DTensor's plan depends on its placement: a subclass never reuses a plan."""
    from lightning_elastic.core.save.walk import walk_state

    class Sharded(torch.Tensor):
        pass

    def props(state: dict) -> list:
        return walk_state(state).props()

    leaves = props({"a": torch.ones(2).as_subclass(Sharded), "b": torch.ones(2)})
    assert leaves != props({"a": torch.ones(2).as_subclass(Sharded), "b": torch.ones(2)})
    assert props({"b": torch.ones(2), "c": 3}) == props({"b": torch.zeros(2), "c": "x"})


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif not isinstance(a, dict):
        assert a == b
    else:
        assert isinstance(a, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])


def test_a_state_with_int_and_str_top_level_keys_loads_back(engine) -> None:
    engine.save({"w": torch.ones(2), 0: torch.zeros(2), 1: {"n": 3}}, step=1).result()
    template = {"w": torch.empty(2), 0: torch.empty(2), 1: {"n": 0}}
    engine.load(template)
    assert torch.equal(template[0], torch.zeros(2))
    assert template[1] == {"n": 3}
    whole = engine.load().state
    assert sorted(whole, key=str) == [0, 1, "w"] and whole[1] == {"n": 3}
    assert torch.equal(whole[0], torch.zeros(2))


def test_a_failed_plan_does_not_poison_the_cache(engine, plans) -> None:
    engine.save({"w": torch.ones(2)}, step=1, name="fixed").result()
    with pytest.raises(CheckpointExistsError):
        engine.save({"w": torch.ones(2)}, step=2, name="fixed")
    engine.save({"w": torch.full((2,), 3.0)}, step=3).result()
    assert [p.cached for p in plans] == [False, True]  # the refused save planned nothing
    loaded = {"w": torch.zeros(2)}
    engine.load(loaded, checkpoint="step_000000003")
    assert torch.equal(loaded["w"], torch.full((2,), 3.0))


# ---------------------------------------------------------------- naming


def test_saves_at_one_step_are_numbered(engine) -> None:
    names = [engine.save({"x": torch.ones(1)}, step=5).result().name for _ in range(3)]
    assert names == ["step_000000005", "step_000000005-1", "step_000000005-2"]
    assert sorted(i.name for i in engine.list()) == names


def test_a_quarantined_name_is_not_reused(engine) -> None:
    quarantined = root(engine) / "step_000000004"
    quarantined.mkdir(parents=True)
    (quarantined / QUARANTINE_FILE).write_text("{}")
    assert engine.save({"x": torch.ones(1)}, step=4).result().name == "step_000000004-1"


def test_an_uncommitted_leftover_does_not_take_the_name(engine) -> None:
    leftover = root(engine) / "step_000000006"
    leftover.mkdir(parents=True)
    (leftover / "junk.distcp").write_bytes(b"partial")
    result = engine.save({"x": torch.ones(1)}, step=6).result()
    assert result.name == "step_000000006"
    assert [i.name for i in engine.list() if i.status == "valid"] == ["step_000000006"]


def test_an_explicit_name_is_used_as_given_with_slashes_stripped(engine, plans) -> None:
    result = engine.save({"x": torch.ones(1)}, step=7, name="/best/").result()
    assert result.name == "best" and plans[0].name == "best"
    assert (root(engine) / "best" / MANIFEST_FILE).exists()


def test_an_existing_name_is_refused_without_overwrite_and_kept(engine) -> None:
    engine.save({"x": torch.ones(2)}, step=1, name="final").result()
    manifest = (root(engine) / "final" / MANIFEST_FILE).read_bytes()
    with pytest.raises(CheckpointExistsError, match="overwrite=True") as info:
        engine.save({"x": torch.zeros(2)}, step=2, name="final")
    assert "final" in str(info.value)
    assert (root(engine) / "final" / MANIFEST_FILE).read_bytes() == manifest
    loaded = {"x": torch.zeros(2)}
    engine.load(loaded, checkpoint="final")
    assert torch.equal(loaded["x"], torch.ones(2))


def test_overwrite_replaces_a_named_checkpoint(engine) -> None:
    engine.save({"x": torch.ones(2)}, step=1, name="final").result()
    engine.save({"x": torch.full((2,), 9.0)}, step=2, name="final", overwrite=True).result()
    manifest = json.loads((root(engine) / "final" / MANIFEST_FILE).read_text())
    assert manifest["step"] == 2
    assert [(i.name, i.step) for i in engine.list()] == [("final", 2)]
    loaded = {"x": torch.zeros(2)}
    engine.load(loaded, checkpoint="final")
    assert torch.equal(loaded["x"], torch.full((2,), 9.0))


def test_overwrite_of_a_new_name_is_a_plain_save(engine) -> None:
    result = engine.save({"x": torch.ones(1)}, step=1, name="fresh", overwrite=True).result()
    assert result.name == "fresh"


def test_an_overwrite_keeps_the_old_checkpoint_committed_until_its_own_commit(engine) -> None:
    engine.save({"x": torch.ones(2)}, step=1, name="last").result()
    ckpt = root(engine) / "last"
    old_files = {p.name for p in ckpt.iterdir()}
    handle = engine.save({"x": torch.full((2,), 5.0)}, step=2, name="last", overwrite=True)
    # planned and claimed, maybe written: the old manifest was never removed meanwhile
    assert json.loads((ckpt / MANIFEST_FILE).read_text())["step"] in (1, 2)
    handle.result()
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    assert manifest["step"] == 2 and manifest["sequence"] == 2
    # the replaced save's files went with the commit's cleanup: only the new one's are left
    assert {p.name for p in ckpt.iterdir()} == {f["path"] for f in manifest["files"]} | {
        MANIFEST_FILE
    }
    assert not old_files & {f["path"] for f in manifest["files"]}


def test_an_overwrite_that_fails_before_its_commit_leaves_the_old_checkpoint(
    tmp_path, monkeypatch
) -> None:
    """A crash between the new files and the new manifest: the old checkpoint is what a
    load finds; the next overwrite commits and removes what the crashed one left."""
    from lightning_elastic.core.dist import commit as commit_module

    eng = CheckpointEngine(tmp_path / "ckpts", coordinator=Coordinator.single_process())
    eng.save({"x": torch.ones(2)}, step=1, name="last").result()

    def crash(*args, **kwargs):
        raise OSError("killed before the manifest")

    monkeypatch.setattr(Storage, "replace_bytes", crash)
    monkeypatch.setattr(commit_module, "discard_uncommitted", lambda *a, **k: None)  # no cleanup
    with pytest.raises(CheckpointSaveError, match="killed before the manifest"):
        eng.save({"x": torch.full((2,), 5.0)}, step=2, name="last", overwrite=True).result()
    monkeypatch.undo()
    ckpt = root(eng) / "last"
    assert len(list(ckpt.glob("*.distcp"))) == 2  # the old save's and the crashed one's
    loaded = {"x": torch.zeros(2)}
    eng.load(loaded, checkpoint="last")
    assert torch.equal(loaded["x"], torch.ones(2))
    eng.save({"x": torch.full((2,), 7.0)}, step=3, name="last", overwrite=True).result()
    assert len(list(ckpt.glob("*.distcp"))) == 1
    eng.load(loaded, checkpoint="last")
    assert torch.equal(loaded["x"], torch.full((2,), 7.0))
    eng.close()


def test_an_overwrite_that_fails_to_write_leaves_the_old_checkpoint_and_no_new_files(
    tmp_path,
) -> None:
    from fsspec.implementations.local import LocalFileSystem

    from lightning_elastic import RetryPolicy
    from lightning_elastic.testing.faults import Fault, FaultyFileSystem

    fs = FaultyFileSystem(LocalFileSystem(), [Fault("write", "*.distcp", "EACCES", skip=1)])
    retry = RetryPolicy(deadline_s=0.5, initial_backoff_s=0.01, max_backoff_s=0.01)
    eng = CheckpointEngine(
        storage=Storage(str(tmp_path), fs=fs, retry=retry),
        coordinator=Coordinator.single_process(),
    )
    eng.save({"x": torch.ones(2)}, step=1, name="last").result()
    before = sorted(p.name for p in (tmp_path / "last").glob("*.distcp"))
    with pytest.raises(CheckpointSaveError):
        eng.save({"x": torch.zeros(2)}, step=2, name="last", overwrite=True, blocking=True)
    assert sorted(p.name for p in (tmp_path / "last").glob("*.distcp")) == before
    assert [(i.name, i.step, str(i.status)) for i in eng.list()] == [("last", 1, "valid")]
    eng.close()


def test_overwriting_a_quarantined_checkpoint_commits_a_valid_one(engine) -> None:
    engine.save({"x": torch.ones(2)}, step=1, name="last").result()
    engine.catalog.quarantine("last", "x.distcp", "checksum mismatch")
    engine.save({"x": torch.full((2,), 3.0)}, step=2, name="last", overwrite=True).result()
    assert [(i.name, i.step, str(i.status)) for i in engine.list()] == [("last", 2, "valid")]


def test_hostile_a_named_save_never_writes_into_a_directory_that_is_not_a_checkpoint(
    engine,
) -> None:
    """Its commit's cleanup removes every file the manifest does not list: a user's folder of
    that name would be emptied. Refused, with or without overwrite, naming what is there."""
    folder = root(engine) / "results"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(CheckpointExistsError, match=r"not a checkpoint of ours .*notes\.txt"):
            engine.save({"x": torch.ones(2)}, step=1, name="results", overwrite=overwrite)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    engine.save({"x": torch.ones(2)}, step=1, name="empty").result()  # a new name: fine


@pytest.fixture
def parts(tmp_path) -> tuple[SaveTarget, RunState]:
    """What the phases of one save take, as an engine of one process makes them."""
    coord = Coordinator.single_process()
    storage = Storage(tmp_path / "ckpts")
    channel = CommitChannel(
        coord.store, rank=0, world_size=1, namespace=coord.key("commit"), timeout_s=60.0
    )
    config = SaveConfig(timeout_s=60.0)
    return SaveTarget(storage, Catalog(storage), coord, channel, HostArena(), config), RunState("r")


def test_the_staging_record_is_written_before_any_rank_writes(parts) -> None:
    target, run = parts
    planned = plan_save(target, run, {"x": torch.ones(1)}, SaveRequest(step=8))
    record = json.loads((Path(target.storage.full()) / planned.name / STAGING_FILE).read_text())
    assert planned.name == "step_000000008"
    assert record["run_id"] == run.run_id == "r"
    assert planned.save_id in json.dumps(record) and record["step"] == 8
    assert len(planned.save_id) == 16
    assert planned.deadline == pytest.approx(planned.started + target.config.timeout_s)


def test_every_save_gets_a_new_save_id(parts) -> None:
    target, run = parts
    saves = [plan_save(target, run, {"x": torch.ones(1)}, SaveRequest(step=s)) for s in range(5)]
    assert len({p.save_id for p in saves}) == 5


# ---------------------------------------------------------------- commit


def planned_save(parts: tuple[SaveTarget, RunState], step: int = 1) -> PlannedSave:
    return plan_save(*parts, {"x": torch.ones(3)}, SaveRequest(step=step))


def failed_report(rank: int) -> dict:
    failure = RankFailure(rank, Phase.WRITE, "StorageFullError", "no space left")
    return {"ok": False, "failure": failure.to_json()}


def published(channel: CommitChannel, save_id: str) -> CommitDecision:
    return CommitDecision.from_json(channel.store.get(channel._key(save_id, "decision")))


def test_a_failed_report_commits_nothing_and_discards_the_directory(parts) -> None:
    ctx, run = parts
    planned = planned_save(parts)
    ckpt_dir = Path(ctx.storage.full()) / planned.name
    (ckpt_dir / shard_file_name(planned.save_id, 0)).write_bytes(b"x" * 10)  # partial
    ctx.channel.report(planned.save_id, failed_report(0))
    decision, manifest = commit_as_coordinator(ctx, run, planned, ctx.storage.child(planned.name))
    assert manifest is None and not decision.committed
    assert decision.failures == (RankFailure(0, "write", "StorageFullError", "no space left"),)
    assert published(ctx.channel, planned.save_id) == decision
    assert not ckpt_dir.exists()  # staging record included: nobody writes any more
    error = decision.error("ckpt")
    assert isinstance(error, CheckpointSaveError) and error.failed_ranks == [0]


def test_a_missing_rank_commits_nothing_and_keeps_only_the_staging_record(parts) -> None:
    ctx, run = parts
    planned = planned_save(parts)
    ckpt_dir = Path(ctx.storage.full()) / planned.name
    (ckpt_dir / shard_file_name(planned.save_id, 0)).write_bytes(b"x" * 10)
    two_ranks = CommitChannel(
        dist.HashStore(),
        rank=0,
        world_size=2,
        namespace="t",
        timeout_s=ctx.config.timeout_s,
        clock=lambda: planned.deadline + 1.0,  # the deadline has passed: no waiting
    )
    ctx = dataclasses.replace(ctx, channel=two_ranks)
    two_ranks.report(planned.save_id, {"ok": True, "file": None, "results": [], "rank": {}})
    decision, manifest = commit_as_coordinator(ctx, run, planned, ctx.storage.child(planned.name))
    assert manifest is None and not decision.committed
    assert decision.missing == (1,) and decision.timeout_s == ctx.config.timeout_s
    assert published(two_ranks, planned.save_id) == decision
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [STAGING_FILE]
    assert decision.error("ckpt").missing_ranks == [1]


def test_a_manifest_that_appeared_meanwhile_is_not_overwritten_or_removed(parts) -> None:
    ctx, run = parts
    planned = planned_save(parts)
    ckpt_dir = Path(ctx.storage.full()) / planned.name
    (ckpt_dir / MANIFEST_FILE).write_text('{"someone": "else"}')
    payload = engine_module.stage_save(ctx, planned, copy=False)
    from lightning_elastic.core.save import pipeline

    report = pipeline._write_and_report(ctx, planned, payload, 0.0)
    assert report["ok"]
    for local in ("written", "selection"):  # what stays on the rank, as finish_save does
        report.pop(local)
    ctx.channel.report(planned.save_id, report)
    decision, manifest = commit_as_coordinator(ctx, run, planned, ctx.storage.child(planned.name))
    assert manifest is None and not decision.committed
    (failure,) = decision.failures
    assert failure.rank == 0 and failure.phase == "commit"
    assert failure.error_type == "CheckpointExistsError"
    assert (ckpt_dir / MANIFEST_FILE).read_text() == '{"someone": "else"}'
    assert not (ckpt_dir / shard_file_name(planned.save_id, 0)).exists()  # ours: removed


def test_a_failed_write_through_the_engine_leaves_no_checkpoint(tmp_path) -> None:
    from fsspec.implementations.local import LocalFileSystem

    from lightning_elastic import RetryPolicy, Storage
    from lightning_elastic.testing.faults import Fault, FaultyFileSystem

    fs = FaultyFileSystem(LocalFileSystem(), [Fault("write", "*.distcp", "EACCES")])
    retry = RetryPolicy(deadline_s=0.5, initial_backoff_s=0.01, max_backoff_s=0.01)
    eng = CheckpointEngine(
        storage=Storage(str(tmp_path), fs=fs, retry=retry),
        coordinator=Coordinator.single_process(timeout=timedelta(seconds=30)),
    )
    with pytest.raises(CheckpointSaveError) as info:
        eng.save({"x": torch.ones(3)}, step=1, blocking=True)
    eng.close()  # the failure was raised once, by the blocking save
    assert info.value.failed_ranks == [0] and info.value.phases == {"write"}
    assert not (tmp_path / "step_000000001").exists()
    assert not list(tmp_path.rglob(MANIFEST_FILE))
