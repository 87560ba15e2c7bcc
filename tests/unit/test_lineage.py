"""Lineage and run identity (issue #8, items 2 and 3), in one process.

"Newest" is the most recently committed checkpoint, never the highest step: a rollback's new
branch wins over the abandoned one in resume and in retention, records where it came from
(``parent``, ``resumed_from``) and never overwrites a directory of the abandoned branch. An
engine with a ``run_id`` resumes and prunes only its own run; one without continues the run
it loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

# from the defining modules: mypy --strict does not see the lazy top-level re-exports
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import VALID, Catalog, CheckpointInfo
from lightning_elastic.core.format.manifest import MANIFEST_FILE, QUARANTINE_FILE
from lightning_elastic.core.policy.retention import KeepLastN, plan_deletions
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import CheckpointNotFoundError, CorruptCheckpointWarning


@pytest.fixture(autouse=True)
def _no_hmac_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_ELASTIC_HMAC_KEY", raising=False)


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((8,), float(value)), "meta": {"value": value}}


def template() -> dict[str, Any]:
    return {"w": torch.zeros(8), "meta": {"value": None}}


def step_name(step: int, attempt: int = 0) -> str:
    return f"step_{step:09d}" + (f"-{attempt}" if attempt else "")


def save(eng: CheckpointEngine, step: int, value: float | None = None) -> str:
    handle = eng.save(state(step if value is None else value), step=step)
    assert handle is not None
    return handle.result().name


def resume(root: Path, **kwargs: Any) -> tuple[CheckpointEngine, dict[str, Any]]:
    """A fresh engine (a restarted job) that auto-resumes; the caller closes it."""
    eng = CheckpointEngine(root, **kwargs)
    loaded = template()
    eng.load(loaded)
    return eng, loaded


def manifest_of(root: Path, name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((root / name / MANIFEST_FILE).read_text())
    return body


def committed(root: Path) -> list[str]:
    """Names of the committed checkpoints in commit order (the catalog's view)."""
    return [i.name for i in Catalog(Storage(str(root))).scan() if i.status == VALID]


def tree_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture
def rolled_back(tmp_path: Path) -> Path:
    """Steps 100, 200, 300 committed; a new job resumed from step 100 and saved 101, 102
    with ``KeepLastN(2)``."""
    root = tmp_path / "ckpts"
    with CheckpointEngine(root, retention=[KeepLastN(3)]) as eng:
        for step in (100, 200, 300):
            save(eng, step)
    with CheckpointEngine(root, retention=[KeepLastN(2)]) as eng:
        loaded = template()
        eng.load(loaded, checkpoint=step_name(100))
        assert loaded["meta"]["value"] == 100
        assert save(eng, 101) == step_name(101)
        assert (root / step_name(101) / MANIFEST_FILE).exists()  # not deleted by its own commit
        assert save(eng, 102) == step_name(102)
        assert (root / step_name(101) / MANIFEST_FILE).exists()
        assert (root / step_name(102) / MANIFEST_FILE).exists()
    return root


# ----------------------------------------------------------------------------- item 2: rollback


def test_rollback_branch_survives_retention_and_the_abandoned_one_goes(rolled_back: Path) -> None:
    # KeepLastN(2) in commit order keeps 101 and 102 (step order would keep 200 and 300 and
    # delete the new branch); 100 survives as the checkpoint the job resumed from.
    assert committed(rolled_back) == [step_name(100), step_name(101), step_name(102)]
    assert not (rolled_back / step_name(300)).exists()
    assert not (rolled_back / step_name(200)).exists()


def test_auto_resume_after_rollback_picks_the_last_commit_not_the_highest_step(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(root) as eng:
        for step in (100, 200, 300):
            save(eng, step)
    with CheckpointEngine(root) as eng:
        eng.load(template(), checkpoint=step_name(100))
        save(eng, 101)
        save(eng, 102)
    eng, loaded = resume(root)
    with eng:
        assert eng.resumed_from == step_name(102)
        assert loaded["meta"]["value"] == 102 and torch.equal(loaded["w"], torch.full((8,), 102.0))
        latest = eng.latest()
        assert latest is not None and latest.name == step_name(102)
    # the abandoned branch is still there (no retention), just older in commit order
    assert committed(root) == [step_name(s) for s in (100, 200, 300, 101, 102)]


def test_rollback_records_parent_and_resumed_from(rolled_back: Path) -> None:
    m100, m101, m102 = (manifest_of(rolled_back, step_name(s)) for s in (100, 101, 102))
    assert m100["parent"] is None and m100["resumed_from"] is None
    assert m101["parent"] == step_name(100) and m101["resumed_from"] == step_name(100)
    assert m102["parent"] == step_name(101) and m102["resumed_from"] == step_name(100)
    assert m101["sequence"] == m100["sequence"] + 3  # 200 and 300 were committed in between
    assert m102["sequence"] == m101["sequence"] + 1


def test_sequence_is_commit_order_across_jobs_and_runs(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(root, run_id="a") as eng:
        save(eng, 500)
    with CheckpointEngine(root, run_id="b") as eng:
        save(eng, 3)  # a lower step, committed later
    with CheckpointEngine(root, run_id="a") as eng:
        save(eng, 1)
    infos = Catalog(Storage(str(root))).scan()
    assert [i.step for i in infos] == [500, 3, 1]
    assert [i.sequence for i in infos] == [1, 2, 3]
    assert [i.name for i in infos] == [i.name for i in sorted(infos, key=CheckpointInfo.sort_key)]


def test_retention_plans_by_commit_sequence_not_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(root, run_id="r") as eng:
        for step in (100, 200, 300):
            save(eng, step)
        eng.load(template(), checkpoint=step_name(100))
        for step in (101, 102):
            save(eng, step)
    infos = Catalog(Storage(str(root))).scan()
    doomed = plan_deletions(infos, [KeepLastN(2)], run_id="r")
    assert [i.name for i in doomed] == [step_name(s) for s in (100, 200, 300)]


def test_a_rolled_back_save_at_an_existing_step_gets_a_new_name(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(root) as eng:
        for step in (100, 200):
            save(eng, step)
    abandoned = tree_bytes(root / step_name(200))
    with CheckpointEngine(root) as eng:
        eng.load(template(), checkpoint=step_name(100))
        assert save(eng, 200, value=-200) == step_name(200, 1)
    with CheckpointEngine(root) as eng:  # and once more, from the same place
        eng.load(template(), checkpoint=step_name(100))
        assert save(eng, 200, value=-2000) == step_name(200, 2)
    assert tree_bytes(root / step_name(200)) == abandoned  # never overwritten
    assert manifest_of(root, step_name(200, 1))["parent"] == step_name(100)
    assert manifest_of(root, step_name(200, 2))["step"] == 200
    eng, loaded = resume(root)
    with eng:
        assert eng.resumed_from == step_name(200, 2) and loaded["meta"]["value"] == -2000
    with CheckpointEngine(root) as eng:  # the abandoned one is still loadable by name
        loaded = template()
        eng.load(loaded, checkpoint=step_name(200))
        assert loaded["meta"]["value"] == 200


def test_a_hand_edited_step_is_corrupt_and_resume_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(root) as eng:
        for step in (100, 200, 300):
            save(eng, step)
    path = root / step_name(300) / MANIFEST_FILE
    path.write_text(path.read_text().replace('"step": 300', '"step": 299'))  # valid JSON
    info = {i.name: i for i in Catalog(Storage(str(root))).scan()}[step_name(300)]
    assert info.status == "corrupt" and info.manifest is None
    assert info.problem is not None and "does not match its own checksum" in info.problem
    with pytest.warns(CorruptCheckpointWarning, match=step_name(300)):
        eng, loaded = resume(root)
    with eng:
        assert eng.resumed_from == step_name(200) and loaded["meta"]["value"] == 200
        # the next commit continues 200 and is the newest; the edited one stays, set aside
        assert save(eng, 201) == step_name(201)
    assert (root / step_name(300) / QUARANTINE_FILE).exists()
    assert manifest_of(root, step_name(201))["parent"] == step_name(200)
    eng, loaded = resume(root)
    with eng:
        assert eng.resumed_from == step_name(201)


def test_a_hand_edited_step_is_refused_when_named(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(root) as eng:
        save(eng, 100)
    path = root / step_name(100) / MANIFEST_FILE
    path.write_text(path.read_text().replace('"step": 100', '"step": 7'))
    with CheckpointEngine(root) as eng, pytest.raises(CheckpointNotFoundError, match="corrupt"):
        eng.load(template(), checkpoint=step_name(100))


def _digest(body: dict[str, Any]) -> str:
    content = {k: v for k, v in body.items() if k not in ("manifest_checksum", "hmac")}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_sequence_at_the_parsers_limit_does_not_poison_later_commits(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with CheckpointEngine(root) as eng:
        save(eng, 1)
        save(eng, 2)
    path = root / step_name(2) / MANIFEST_FILE
    body = manifest_of(root, step_name(2))
    body["sequence"] = 2**62  # accepted by the parser (checksum recomputed: a deliberate edit)
    body["manifest_checksum"] = _digest(body)
    path.write_text(json.dumps(body))
    with CheckpointEngine(root) as eng, warnings.catch_warnings():
        # refusing the absurd sequence (resuming from 1) is as right as accepting it
        warnings.simplefilter("ignore", CorruptCheckpointWarning)
        eng.load(template())
        save(eng, 3)
    statuses = {i.name: i.status for i in Catalog(Storage(str(root))).scan()}
    # today the new, successfully "committed" checkpoint is unreadable
    assert statuses[step_name(3)] == VALID


# ----------------------------------------------------------------------------- item 3: run identity


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    """Run "a" committed steps 1, 2; then run "b" committed 10, 11 (newer) in the same root."""
    root = tmp_path / "ckpts"
    with CheckpointEngine(root, run_id="a") as eng:
        save(eng, 1)
        save(eng, 2)
    with CheckpointEngine(root, run_id="b") as eng:
        save(eng, 10)
        save(eng, 11)
    return root


def test_an_explicit_run_resumes_its_own_checkpoint_not_a_newer_one(two_runs: Path) -> None:
    eng, loaded = resume(two_runs, run_id="a")
    with eng:
        assert eng.resumed_from == step_name(2) and loaded["meta"]["value"] == 2
        assert eng.run_id == "a"
        latest = eng.latest()
        assert latest is not None and latest.name == step_name(2)
        save(eng, 3)
    assert manifest_of(two_runs, step_name(3))["run_id"] == "a"
    eng, loaded = resume(two_runs, run_id="b")
    with eng:
        assert eng.resumed_from == step_name(11)


def test_an_explicit_run_without_checkpoints_raises_naming_the_run(two_runs: Path) -> None:
    with CheckpointEngine(two_runs, run_id="c") as eng:
        with pytest.raises(CheckpointNotFoundError, match="'c'"):
            eng.load(template())
        assert eng.latest() is None
    # nothing was touched on the way
    assert committed(two_runs) == [step_name(s) for s in (1, 2, 10, 11)]
    assert not list(two_runs.glob(f"*/{QUARANTINE_FILE}"))


def test_retention_never_deletes_another_runs_checkpoints(two_runs: Path) -> None:
    before = {s: tree_bytes(two_runs / step_name(s)) for s in (10, 11)}
    with CheckpointEngine(two_runs, run_id="a", retention=[KeepLastN(1)]) as eng:
        eng.load(template())
        for step in (3, 4, 5):
            save(eng, step)
    # a's own: 2 (resumed from, protected) and 5 (newest); b's untouched
    assert committed(two_runs) == [step_name(s) for s in (2, 10, 11, 5)]
    assert {s: tree_bytes(two_runs / step_name(s)) for s in (10, 11)} == before
    with CheckpointEngine(two_runs, run_id="b", retention=[KeepLastN(1)]) as eng:
        save(eng, 12)
    assert committed(two_runs) == [step_name(s) for s in (2, 5, 12)]


def test_an_explicit_run_never_quarantines_another_runs_corrupt_checkpoint(
    two_runs: Path,
) -> None:
    (two_runs / step_name(11) / MANIFEST_FILE).write_text("{damaged")
    with CheckpointEngine(two_runs, run_id="a") as eng:
        eng.load(template())  # no CorruptCheckpointWarning: b's checkpoint is not looked at
        assert eng.resumed_from == step_name(2)
    assert not (two_runs / step_name(11) / QUARANTINE_FILE).exists()


def test_an_explicit_run_may_load_another_runs_checkpoint_by_name(two_runs: Path) -> None:
    with CheckpointEngine(two_runs, run_id="c") as eng:
        loaded = template()
        eng.load(loaded, checkpoint=step_name(11))
        assert loaded["meta"]["value"] == 11 and eng.run_id == "c"
        save(eng, 12)
    m = manifest_of(two_runs, step_name(12))
    assert m["run_id"] == "c" and m["parent"] == step_name(11)


def test_without_a_run_id_the_engine_continues_the_loaded_run(
    two_runs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lightning_elastic")
    eng, loaded = resume(two_runs, retention=[KeepLastN(1)])
    with eng:
        assert loaded["meta"]["value"] == 11 and eng.run_id == "b"
        assert f"resuming run b from {two_runs / step_name(11)}" in caplog.text
        save(eng, 12)
        save(eng, 13)
    assert manifest_of(two_runs, step_name(13))["run_id"] == "b"
    # retention acted for run b (its adopted identity), never for run a
    assert committed(two_runs) == [step_name(s) for s in (1, 2, 11, 13)]


def test_without_a_run_id_a_named_load_of_another_run_is_continued(
    two_runs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lightning_elastic")
    with CheckpointEngine(two_runs) as eng:
        eng.load(template(), checkpoint=step_name(2))
        assert eng.run_id == "a" and "resuming run a from" in caplog.text
        save(eng, 3)
    m = manifest_of(two_runs, step_name(3))
    assert m["run_id"] == "a" and m["parent"] == step_name(2)


def test_adopt_run_false_keeps_the_engines_own_run(two_runs: Path) -> None:
    with CheckpointEngine(two_runs) as eng:
        own = eng.run_id
        eng.load(template(), adopt_run=False)
        assert eng.run_id == own not in ("a", "b")
        save(eng, 12)
    m = manifest_of(two_runs, step_name(12))
    assert m["run_id"] == own and m["parent"] == step_name(11)
