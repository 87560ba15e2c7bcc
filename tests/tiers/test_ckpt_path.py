"""Lightning's ``ckpt_path`` with a multi-tier ``dirpath``: ``"last"`` (fit, validate) finds the
newest checkpoint even when only the nodes hold it, ``"best"`` and ``best_model_path`` name
persisted checkpoints as docs/tiers.md says, and a path naming a save of ``dirpath`` (in any
spelling) is matched, never another job's checkpoint of the same name in a local root."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_elastic import TierOptions
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import VALID, Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import CheckpointNotFoundError, ConfigError
from lightning_elastic.lightning.resume import _tiered_engine
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import workers
from tests.tiers import lightning_workers as w
from tests.tiers import resume_workers

NAME = "step_000000002"


def steps(root: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("_")[1].split("-")[0]) for p in root.glob("step_*/manifest.json")
    )


def tiers(tmp_path: Path, every: int = 10) -> dict:
    return {"tiers": TierOptions(str(tmp_path / "local"), persist_every_n_saves=every)}


def local(root: Path, node: str) -> Path:
    return root / "local" / node


def state_of(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step}


def session_with(dirpath: str) -> SimpleNamespace:
    engine = SimpleNamespace(multi_tier=True, storage=Storage(dirpath))
    return SimpleNamespace(engines={dirpath: engine}), engine


@pytest.mark.timeout(300)
def test_ckpt_path_last_resumes_from_the_newest_local_checkpoint(tmp_path) -> None:
    run = str(tmp_path / "run")
    run_distributed(workers.fit, 2, run, 20, 13, may_die={0, 1}, **tiers(tmp_path))
    assert steps(tmp_path / "local") == [5, 10] and steps(tmp_path / "run" / "ckpts") == []
    got = run_distributed(resume_workers.fit, 2, run, 15, ckpt_path="last", **tiers(tmp_path))
    # today: "holds no valid checkpoint: no checkpoint will be loaded": a fresh start at 0
    assert [g["first_step"] for g in got] == [10, 10], got


@pytest.mark.timeout(300)
def test_ckpt_path_last_is_not_older_than_what_an_auto_resume_picks(tmp_path) -> None:
    run = str(tmp_path / "run")
    # saves at 5 (persisted: every=2 -> no; forced? no), 10 (2nd: persisted), 15 local only
    run_distributed(workers.fit, 2, run, 20, 17, may_die={0, 1}, **tiers(tmp_path, 2))
    assert steps(tmp_path / "run" / "ckpts") == [10] and 15 in steps(tmp_path / "local")
    got = run_distributed(resume_workers.fit, 2, run, 20, ckpt_path="last", **tiers(tmp_path, 2))
    assert [g["first_step"] for g in got] == [15, 15], got  # today: 10 (the persisted one)


@pytest.mark.timeout(120)
def test_validate_last_loads_the_newest_checkpoint_when_only_the_nodes_hold_it(tmp_path) -> None:
    """Saves at 5 and 10 committed on both nodes, none persisted, then SIGKILL. A fresh
    ``trainer.validate(ckpt_path="last")`` must run on step 10's weights (the newest, local
    only), with node b's local root wiped (its shard from a's replica)."""
    tiers = {"persist_every_n_saves": 100}
    ref = run_distributed(w.fit, 2, str(tmp_path / "ref"), 10, every=None, **tiers)
    run_distributed(w.fit, 2, str(tmp_path), 20, 13, may_die={0, 1}, **tiers)
    assert steps(local(tmp_path, "a")) == [5, 10] and steps(tmp_path / "ckpts") == []
    shutil.rmtree(local(tmp_path, "b"))
    got = run_distributed(w.evaluate, 2, str(tmp_path), "validate", "last", **tiers)
    for rank in range(2):
        assert "error" not in got[rank], got[rank]
        assert got[rank]["ckpt_path"].endswith("step_000000010"), got[rank]
        assert got[rank]["eval_weights"], got[rank]
        assert got[rank]["eval_weights"][0] == pytest.approx(ref[rank]["weights"], abs=0, rel=0)


@pytest.mark.timeout(120)
def test_test_best_ranks_only_persisted_checkpoints_as_documented(tmp_path) -> None:
    """docs/tiers.md: ``ckpt_path="best"`` looks at dirpath only. The best score is at step
    10, saved locally only (persist_every_n_saves=3: 15 persisted, the end 20 forced); the
    best persisted one is 15 (score 5). Pins that a local-only best never loads and never
    fails the call."""
    tiers = {"persist_every_n_saves": 3, "local_keep": 4}
    run_distributed(w.fit, 2, str(tmp_path), 20, monitor="score", **tiers)
    assert steps(tmp_path / "ckpts") == [15, 20]
    assert 10 in steps(local(tmp_path, "a"))
    got = run_distributed(w.evaluate, 2, str(tmp_path), "test", "best", monitor="score", **tiers)
    for g in got:
        assert "error" not in g, g
        assert g["ckpt_path"].endswith("step_000000015"), g


@pytest.mark.timeout(120)
def test_best_model_path_names_a_checkpoint_that_test_can_load(tmp_path) -> None:
    """After fit, ``checkpoint.best_model_path`` (and ``last_model_path``) is what Lightning
    users pass to ``trainer.test(ckpt_path=...)``. With tiers the best save (step 10) was
    committed on the nodes only, but the path names ``dirpath/step_000000010``, which does
    not exist: test() must load it (or the path must name a checkpoint that exists)."""
    tiers = {"persist_every_n_saves": 3, "local_keep": 4}
    got = run_distributed(w.fit_then_test_best_path, 2, str(tmp_path), 20, **tiers)
    for g in got:
        assert g["best"].endswith("step_000000010"), g
        assert "error" not in g, g
        assert g["tested"].endswith("step_000000010"), g


def test_a_ckpt_path_of_dirpath_spelled_as_lightning_gives_it_is_matched(tmp_path) -> None:
    # regression guard: best_model_path / last_model_path (dirpath + "/" + name), with a
    # trailing slash; a Lightning file in dirpath, another dirpath and None are not
    dirpath = str(tmp_path / "ckpts")
    session, engine = session_with(dirpath)
    assert _tiered_engine(session, f"{dirpath}/{NAME}") is engine
    assert _tiered_engine(session, f"{dirpath}/{NAME}/") is engine
    assert _tiered_engine(session, f"{dirpath}/{NAME}-1") is engine
    assert _tiered_engine(session, f"{dirpath}/last.ckpt") is None
    assert _tiered_engine(session, f"{dirpath}/epoch=0-step=2.ckpt") is None
    assert _tiered_engine(session, str(tmp_path / "other" / NAME)) is None
    assert _tiered_engine(session, f"{dirpath}/{NAME}/{MANIFEST_FILE}") is None
    assert _tiered_engine(session, None) is None


@pytest.mark.parametrize("spelling", ["relative", "dot", "file_url", "double_slash"])
def test_a_ckpt_path_naming_a_save_of_dirpath_in_another_spelling_is_matched(
    tmp_path, monkeypatch, spelling
) -> None:
    # the same directory spelled otherwise than dirpath (a path relative to the working
    # directory, "./", a file:// URL, a doubled slash) is still a save of the multi-tier
    # dirpath: unmatched, it falls through to a non-tiered engine on the persistent root (a
    # second engine of the same root) or to Lightning's loader (FileNotFoundError) whenever
    # the save is on the nodes only - the bug the commit fixed, back for these spellings
    monkeypatch.chdir(tmp_path)
    dirpath = str(tmp_path / "ckpts")
    session, engine = session_with(dirpath)
    path = {
        "relative": f"ckpts/{NAME}",
        "dot": f"{dirpath}/./{NAME}",
        "file_url": f"file://{dirpath}/{NAME}",
        "double_slash": f"{tmp_path}//ckpts/{NAME}",
    }[spelling]
    assert os.path.realpath(path.removeprefix("file://")) == f"{dirpath}/{NAME}"
    assert _tiered_engine(session, path) is engine, path


def test_a_missing_named_checkpoint_with_tiers_is_named_in_the_error(tmp_path) -> None:
    # trainer.fit(ckpt_path=dirpath/step_000000099) now goes to the tiered engine: the error
    # must name what was asked for, as without tiers ("no checkpoint at .../step_...99"),
    # not "no valid checkpoint in ...; start without resuming or point to a directory"
    missing = "step_000000099"
    with CheckpointEngine(tmp_path / "plain", async_save=False) as eng:
        eng.save(state_of(1), step=1)
        with pytest.raises(CheckpointNotFoundError, match=missing):
            eng.load(state_of(0), checkpoint=missing)
    with CheckpointEngine(
        tmp_path / "persistent", local_root=tmp_path / "local", async_save=False
    ) as eng:
        eng.save(state_of(1), step=1)
        eng.wait()
        with pytest.raises(CheckpointNotFoundError) as caught:
            eng.load(state_of(0), checkpoint=missing)
    assert missing in str(caught.value), str(caught.value)


def test_another_jobs_checkpoint_of_the_same_name_in_the_local_root_is_never_loaded(
    tmp_path,
) -> None:
    # two jobs share one node-local root (both use /dev/shm/ckpt): job Y committed step 2
    # there; job X persisted its own step 2. X's recovery must load X's step 2 (from its
    # persistent root), never Y's copy under the same name
    shared = tmp_path / "shared_local"
    with CheckpointEngine(tmp_path / "y", local_root=shared, async_save=False) as eng:
        for step in (1, 2):
            eng.save({"w": torch.full((8,), 70.0 + step), "step": step}, step=step)
        eng.wait()
    with CheckpointEngine(tmp_path / "x", local_root=tmp_path / "x_local", async_save=False) as e:
        for step in (1, 2):
            e.save({"w": torch.full((8,), 50.0 + step), "step": step}, step=step, persist=True)
        e.wait()
    shutil.rmtree(tmp_path / "x_local")  # X restarts on the machine Y used
    before = sorted(p.name for p in (shared / NAME).iterdir())
    state = {"w": torch.zeros(8), "step": -1}
    # X's files would go beside Y's under one name, and the node's manifest is Y's: X is
    # refused, typed and told what to do, and neither checkpoint is touched (not Y's 72)
    with (
        CheckpointEngine(tmp_path / "x", local_root=shared, async_save=False) as eng,
        pytest.raises(ConfigError, match="own local_dirpath"),
    ):
        eng.load(state)
    assert state["step"] == -1 and torch.equal(state["w"], torch.zeros(8))
    assert sorted(p.name for p in (shared / NAME).iterdir()) == before
    assert Catalog(Storage(shared)).info(NAME).status == VALID
    assert Catalog(Storage(tmp_path / "x")).info(NAME).status == VALID
