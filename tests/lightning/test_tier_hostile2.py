"""DistributedCheckpoint with tiers on the Lightning paths the first review of #11
did not cover: ckpt_path="last", a signal on one rank, a fit that raises, resume="never"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_elastic import TierOptions
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import tier_hostile2_workers as w
from tests.lightning import workers

pytestmark = pytest.mark.timeout(300)


def steps(root: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("_")[1].split("-")[0]) for p in root.glob("step_*/manifest.json")
    )


def tiers(tmp_path: Path, every: int = 10) -> dict:
    return {"tiers": TierOptions(str(tmp_path / "local"), persist_every_n_saves=every)}


def test_ckpt_path_last_resumes_from_the_newest_local_checkpoint(tmp_path) -> None:
    run = str(tmp_path / "run")
    run_distributed(workers.fit, 2, run, 20, 13, may_die={0, 1}, **tiers(tmp_path))
    assert steps(tmp_path / "local") == [5, 10] and steps(tmp_path / "run" / "ckpts") == []
    got = run_distributed(w.fit, 2, run, 15, ckpt_path="last", **tiers(tmp_path))
    # today: "holds no valid checkpoint: no checkpoint will be loaded": a fresh start at 0
    assert [g["first_step"] for g in got] == [10, 10], got


def test_ckpt_path_last_is_not_older_than_what_an_auto_resume_picks(tmp_path) -> None:
    run = str(tmp_path / "run")
    # saves at 5 (persisted: every=2 -> no; forced? no), 10 (2nd: persisted), 15 local only
    run_distributed(workers.fit, 2, run, 20, 17, may_die={0, 1}, **tiers(tmp_path, 2))
    assert steps(tmp_path / "run" / "ckpts") == [10] and 15 in steps(tmp_path / "local")
    got = run_distributed(w.fit, 2, run, 20, ckpt_path="last", **tiers(tmp_path, 2))
    assert [g["first_step"] for g in got] == [15, 15], got  # today: 10 (the persisted one)


def test_sigterm_on_one_rank_persists_and_a_lost_node_resumes_there(tmp_path) -> None:
    run = str(tmp_path / "run")
    kw = {"model_kwargs": {"signal_at": 7, "signal_rank": 1}, "every": None}
    got = run_distributed(w.fit, 2, run, 50, **kw, **tiers(tmp_path))
    assert [g["global_step"] for g in got] == [8, 8], got
    assert steps(tmp_path / "run" / "ckpts") == [8]
    shutil.rmtree(tmp_path / "local")
    again = run_distributed(w.fit, 2, run, 12, every=None, **tiers(tmp_path))
    assert [a["recovery"]["tier"] for a in again] == ["persistent"] * 2
    assert [a["first_step"] for a in again] == [8, 8]


def test_a_fit_that_raises_resumes_from_the_local_tier(tmp_path) -> None:
    run = str(tmp_path / "run")
    got = run_distributed(w.fit, 2, run, 20, raise_at=12, **tiers(tmp_path))
    assert all("boom" in g.get("error", "") for g in got), got
    again = run_distributed(w.fit, 2, run, 20, **tiers(tmp_path))
    assert [a["first_step"] for a in again] == [10, 10], again
    assert [a["recovery"]["tier"] for a in again] == ["local"] * 2


def test_resume_never_starts_fresh_and_the_next_auto_resume_takes_the_new_run(tmp_path) -> None:
    run = str(tmp_path / "run")
    run_distributed(w.fit, 2, run, 20, **tiers(tmp_path))  # saves 5..20, 20 persisted
    fresh = run_distributed(w.fit, 2, run, 7, resume="never", **tiers(tmp_path))
    assert [f["first_step"] for f in fresh] == [0, 0] and fresh[0]["recovery"] is None
    again = run_distributed(w.fit, 2, run, 12, **tiers(tmp_path))
    assert [a["first_step"] for a in again] == [7, 7], again  # the newest: the fresh run's end


def test_the_last_save_of_a_fit_is_persisted_without_save_on_train_end(tmp_path) -> None:
    # docs/tiers.md: "The last save of a fit and saves on a preemption signal always are"
    run = str(tmp_path / "run")
    run_distributed(w.fit, 2, run, 15, save_on_train_end=False, **tiers(tmp_path))
    assert steps(tmp_path / "local") == [10, 15]
    assert steps(tmp_path / "run" / "ckpts") == [15]  # today: [] (nothing ever persisted)
