"""The run history: recording never fails training, reading never trusts storage."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.observe.history import (
    HISTORY_DIR,
    MAX_OBJECT_BYTES,
    Event,
    RunHistory,
    read_history,
)
from lightning_elastic.core.policy.housekeeping import collect_garbage
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ConfigError
from lightning_elastic.testing.faults import Fault, FaultyFileSystem


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def history(root: Path, run_id: str | None = "run1", **kwargs) -> RunHistory:
    return RunHistory(Storage(str(root)), run_id=run_id, **kwargs)


# ----------------------------------------------------------------------------- round trip


def test_events_round_trip_in_time_order_with_their_fields(tmp_path) -> None:
    clock = FakeClock()
    h = history(tmp_path, clock=clock)
    h.record("start", step=0, world_size=2, hosts=["a", "b"], resumed_from=None)
    clock.now += 5
    h.record("commit", name="step_000000010", step=10, bytes=1234, blocked_s=0.25)
    clock.now -= 10  # a clock that went back: still read in time order
    h.record("straggler", step=3, rank=1, host="b", factor=2.5)

    events, skipped = read_history(Storage(str(tmp_path)))
    assert skipped == 0 and h.failures == 0
    assert [e.kind for e in events] == ["straggler", "start", "commit"]
    start = events[1]
    assert start == Event(
        "start",
        1_700_000_000.0,
        "run1",
        h.session,
        {"step": 0, "world_size": 2, "hosts": ["a", "b"], "resumed_from": None},
    )
    assert len(h.session) == 12 and int(h.session, 16) >= 0
    body = json.loads(next((tmp_path / HISTORY_DIR).glob("*-start.json")).read_text())
    assert body["version"] == 1 and body["kind"] == "start" and body["session"] == h.session


def test_a_repeating_clock_still_gives_every_event_its_own_object(tmp_path) -> None:
    h = history(tmp_path, clock=FakeClock())
    for step in range(5):
        h.record("commit", step=step)
    events, _ = read_history(Storage(str(tmp_path)))
    assert sorted(e.fields["step"] for e in events) == [0, 1, 2, 3, 4] and h.failures == 0


def test_read_history_filters_by_run_and_odd_field_values_are_kept_as_json(tmp_path) -> None:
    history(tmp_path, run_id="a").record("end", step=3, reason="done", loss=float("nan"))
    history(tmp_path, run_id="b").record("end", step=4, reason=Path("x"))
    events, skipped = read_history(Storage(str(tmp_path)), run_id="a")
    assert [e.fields for e in events] == [{"step": 3, "reason": "done", "loss": None}]
    events, _ = read_history(Storage(str(tmp_path)), run_id="b")
    assert events[0].fields["reason"] == "x" and skipped == 0


def test_a_missing_history_is_empty(tmp_path) -> None:
    assert read_history(Storage(str(tmp_path))) == ([], 0)
    assert history(tmp_path).last_progress() is None


def test_bad_options_are_refused_at_construction(tmp_path) -> None:
    with pytest.raises(ConfigError, match="session"):
        history(tmp_path, session="../x")
    with pytest.raises(ConfigError, match="progress_every_s"):
        history(tmp_path, progress_every_s=-1)
    with pytest.raises(ConfigError, match="progress_every_s"):
        history(tmp_path, progress_every_s=float("nan"))


# ----------------------------------------------------------------------------- progress


def test_progress_writes_first_then_at_most_every_period_and_overwrites(tmp_path) -> None:
    clock = FakeClock()
    h = history(tmp_path, clock=clock, progress_every_s=10.0, session="s1")
    assert h.progress(1, loss=0.5) is True
    clock.now += 9.9
    assert h.progress(2) is False
    assert h.progress(3, force=True) is True
    clock.now += 10.0
    assert h.progress(4) is True
    files = sorted(p.name for p in (tmp_path / HISTORY_DIR).iterdir())
    assert files == ["progress-s1-000003.json"]  # each replaced the one before
    last = h.last_progress()
    assert last is not None and last.kind == "progress"
    assert last.fields == {"step": 4} and last.time == clock.now


def test_last_progress_is_the_newest_of_the_run_across_sessions(tmp_path) -> None:
    clock = FakeClock()
    first = history(tmp_path, clock=clock, session="launch1")
    first.progress(100)
    clock.now += 60
    first.progress(160)  # the previous launch's last step before it was killed
    history(tmp_path, run_id="other", clock=clock, session="x").progress(999, force=True)
    clock.now += 30
    second = history(tmp_path, clock=clock, session="launch2")
    last = second.last_progress()
    assert last is not None and (last.session, last.fields["step"]) == ("launch1", 160)
    second.progress(120)  # resumed from an older checkpoint: its own record is newer
    last = second.last_progress()
    assert last is not None and (last.session, last.fields["step"]) == ("launch2", 120)


# ----------------------------------------------------------------------------- failures


def _faulty(tmp_path: Path, faults: list[Fault]) -> tuple[Storage, FaultyFileSystem]:
    fs = FaultyFileSystem(LocalFileSystem(), faults)
    return Storage(str(tmp_path), fs=fs), fs


def test_a_failing_storage_never_raises_counts_failures_and_warns_once_per_kind(
    tmp_path, caplog
) -> None:
    storage, fs = _faulty(tmp_path, [Fault("open", "*", "ENOSPC", times=0)])
    h = RunHistory(storage, run_id="r")
    with caplog.at_level(logging.DEBUG, logger="lightning_elastic.core.observe.history"):
        started = time.monotonic()
        for step in range(3):
            h.record("commit", step=step)
            assert h.progress(step, force=True) is False
        h.record("end", step=3)
        elapsed = time.monotonic() - started
    assert h.failures == 7 and fs.fired
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("training goes on" in r.getMessage() for r in warnings)
    assert elapsed < 30  # a permanent error is not retried for the engine's two minutes


def test_reading_through_a_failing_storage_never_raises_in_last_progress(tmp_path) -> None:
    history(tmp_path).progress(5)
    storage, _ = _faulty(tmp_path, [Fault("list", "*", "EACCES", times=0)])
    assert RunHistory(storage, run_id="run1").last_progress() is None


def test_an_invalid_event_is_a_counted_failure_not_an_exception(tmp_path) -> None:
    h = history(tmp_path)
    h.record("Bad Kind")
    h.record("progress", step=1)  # progress has its own object
    h.record("start", hosts=["h" * 1000] * 100)  # over the size cap: a reader would skip it
    assert h.progress("7") is False  # type: ignore[arg-type]
    assert h.failures == 4 and read_history(Storage(str(tmp_path))) == ([], 0)


# ----------------------------------------------------------------------------- hostile files


def test_hostile_history_objects_are_skipped_counted_and_never_followed(tmp_path) -> None:
    h = history(tmp_path, session="good")
    h.record("start", step=0)
    d = tmp_path / HISTORY_DIR
    name = "00000000000000000001-evil-000000-start.json"
    secret = tmp_path.parent / f"{tmp_path.name}-secret.json"
    secret.write_text(json.dumps(_body("start", session="evil")))
    os.symlink(secret, d / name)  # a link with a good name and a good target
    (d / "00000000000000000002-evil-000000-end.json").write_text("{not json")
    (d / "00000000000000000003-evil-000000-end.json").write_text(
        json.dumps(_body("end", session="evil")) + " " * MAX_OBJECT_BYTES
    )
    (d / "00000000000000000004-evil-000000-end.json").write_text(
        json.dumps(_body("end", session="evil", version=2))
    )
    (d / "00000000000000000005-evil-000000-end.json").write_text(
        json.dumps(_body("end", session="other"))  # name and body disagree
    )
    (d / "00000000000000000006-evil-000000-end.json").write_text(
        json.dumps({**_body("end", session="evil"), "time": "yesterday"})
    )
    (d / "00000000000000000007-evil-000000-end.json").write_text("[" * 100_00 + "]" * 100_00)
    (d / "00000000000000000008-evil-000000-end.json").write_text('{"time": NaN}')
    (d / "progress-evil.json").write_text(json.dumps(_body("progress", session="evil")))
    (d / "progress-dir.json").mkdir()
    (d / "..json").write_text("{}")
    (d / "notes.txt").write_text("hello")
    os.mkfifo(d / "00000000000000000009-evil-000000-end.json")  # opening it would block
    (d / "00000000000000000010-good-000001-end.json.tmp-0123456789ab").write_text("")

    events, skipped = read_history(Storage(str(tmp_path)))
    assert [(e.session, e.kind) for e in events] == [("good", "start")]
    assert skipped == 13
    assert h.last_progress() is None  # the progress record without a step is not one


def test_a_symlinked_history_folder_is_not_followed(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    history(elsewhere).record("start", step=0)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere / HISTORY_DIR, root / HISTORY_DIR)
    assert read_history(Storage(str(root))) == ([], 0)


def test_a_file_where_the_history_folder_belongs_is_no_history_and_no_crash(tmp_path) -> None:
    (tmp_path / HISTORY_DIR).write_text("not a folder")
    h = history(tmp_path)
    h.record("start", step=0)
    assert h.progress(1) is False and h.failures == 2
    assert read_history(Storage(str(tmp_path))) == ([], 0) and h.last_progress() is None


def _body(kind: str, *, session: str, version: int = 1) -> dict:
    fields: dict = {} if kind == "progress" else {"step": 1}
    return {
        "version": version,
        "kind": kind,
        "time": 1.0,
        "run_id": "run1",
        "session": session,
        "fields": fields,
    }


# ----------------------------------------------------------------------------- the catalog


def test_the_catalog_and_garbage_collection_ignore_the_history(tmp_path) -> None:
    h = history(tmp_path, clock=FakeClock(1.0))  # an ancient clock: past every grace period
    h.record("start", step=0)
    h.progress(3)
    storage = Storage(str(tmp_path))
    catalog = Catalog(storage)
    assert catalog.scan() == []
    assert collect_garbage(storage, catalog, grace_s=0.0, now=time.time()) == []
    assert len(read_history(storage)[0]) == 2


def test_reading_only_some_kinds_never_opens_the_others(tmp_path, monkeypatch) -> None:
    from lightning_elastic.core.observe import history as module

    history = RunHistory(Storage(str(tmp_path)), run_id="r", session="s")
    history.record("start", step=0)
    for step in range(5):
        history.record("commit", step=step, name=f"step_{step}")
    history.record("resume", checkpoint="step_3")
    history.progress(7, force=True)
    opened: list[str] = []
    load = module._load
    monkeypatch.setattr(
        module, "_load", lambda st, entry: opened.append(entry.name) or load(st, entry)
    )
    events, skipped = read_history(Storage(str(tmp_path)), kinds=("start", "resume"))
    assert [e.kind for e in events] == ["start", "resume"] and skipped == 0
    assert len(opened) == 2 and not any("commit" in name for name in opened)
    assert [e.kind for e in read_history(Storage(str(tmp_path)), kinds=("progress",))[0]] == [
        "progress"
    ]


def test_a_process_killed_between_writing_and_deleting_leaves_a_readable_record(
    tmp_path, monkeypatch
) -> None:
    clock = FakeClock()
    h = history(tmp_path, clock=clock, session="s1")
    h.progress(5, force=True)
    clock.now += 1
    # the new record is written, the old one's delete never happens (the process died)
    monkeypatch.setattr(h.storage, "delete", lambda rel: (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        h.progress(6, force=True)
    fresh = history(tmp_path, clock=clock, session="s2")
    last = fresh.last_progress()
    assert last is not None and last.fields["step"] == 6
    assert read_history(Storage(str(tmp_path)))[1] == 0  # both records are valid objects
