"""Resuming a Lightning fit with tiers after it stopped: a signal on one rank (persisted before the
exit, then a lost node or every local root lost), a fit that raises, ``resume="never"``, the
last save persisted without ``save_on_train_end``, and another run's checkpoints in the same
local roots."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_elastic import TierOptions
from lightning_elastic.testing.spawn import run_distributed
from tests.tiers import lightning_workers as w
from tests.tiers import resume_workers


def steps(root: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("_")[1].split("-")[0]) for p in root.glob("step_*/manifest.json")
    )


def tiers(tmp_path: Path, every: int = 10) -> dict:
    return {"tiers": TierOptions(str(tmp_path / "local"), persist_every_n_saves=every)}


def local(root: Path, node: str) -> Path:
    return root / "local" / node


@pytest.mark.timeout(300)
def test_sigterm_on_one_rank_persists_and_a_lost_node_resumes_there(tmp_path) -> None:
    run = str(tmp_path / "run")
    kw = {"model_kwargs": {"signal_at": 7, "signal_rank": 1}, "every": None}
    got = run_distributed(resume_workers.fit, 2, run, 50, **kw, **tiers(tmp_path))
    assert [g["global_step"] for g in got] == [8, 8], got
    assert steps(tmp_path / "run" / "ckpts") == [8]
    shutil.rmtree(tmp_path / "local")
    again = run_distributed(resume_workers.fit, 2, run, 12, every=None, **tiers(tmp_path))
    assert [a["recovery"]["tier"] for a in again] == ["persistent"] * 2
    assert [a["first_step"] for a in again] == [8, 8]


@pytest.mark.timeout(300)
def test_a_fit_that_raises_resumes_from_the_local_tier(tmp_path) -> None:
    run = str(tmp_path / "run")
    got = run_distributed(resume_workers.fit, 2, run, 20, raise_at=12, **tiers(tmp_path))
    assert all("boom" in g.get("error", "") for g in got), got
    again = run_distributed(resume_workers.fit, 2, run, 20, **tiers(tmp_path))
    assert [a["first_step"] for a in again] == [10, 10], again
    assert [a["recovery"]["tier"] for a in again] == ["local"] * 2


@pytest.mark.timeout(300)
def test_resume_never_starts_fresh_and_the_next_auto_resume_takes_the_new_run(tmp_path) -> None:
    run = str(tmp_path / "run")
    run_distributed(resume_workers.fit, 2, run, 20, **tiers(tmp_path))  # saves 5..20, 20 persisted
    fresh = run_distributed(resume_workers.fit, 2, run, 7, resume="never", **tiers(tmp_path))
    assert [f["first_step"] for f in fresh] == [0, 0] and fresh[0]["recovery"] is None
    again = run_distributed(resume_workers.fit, 2, run, 12, **tiers(tmp_path))
    assert [a["first_step"] for a in again] == [7, 7], again  # the newest: the fresh run's end


@pytest.mark.timeout(300)
def test_the_last_save_of_a_fit_is_persisted_without_save_on_train_end(tmp_path) -> None:
    # docs/tiers.md: "The last save of a fit and saves on a preemption signal always are"
    run = str(tmp_path / "run")
    run_distributed(resume_workers.fit, 2, run, 15, save_on_train_end=False, **tiers(tmp_path))
    assert steps(tmp_path / "local") == [10, 15]
    assert steps(tmp_path / "run" / "ckpts") == [15]  # today: [] (nothing ever persisted)


@pytest.mark.timeout(120)
@pytest.mark.timeout(180)
def test_another_runs_checkpoints_in_the_same_local_roots_survive_and_still_recover(
    tmp_path,
) -> None:
    """Run X (dirpath x) saves 5 and 10 on nodes a, b (nothing persisted) and is killed.
    Run Y (dirpath y) shares the local roots with local_keep=1 and saves 5..20, its uploads
    ending in between (each save persisted). Y starts fresh (X's copies belong to another
    persistent root), keeps one checkpoint of its own per node, and leaves X's alone: X then
    resumes from step 10 on its nodes."""
    root = str(tmp_path)
    x = {"dirpath": f"{root}/x", "persist_every_n_saves": 100}
    run_distributed(w.fit, 2, root, 20, 13, may_die={0, 1}, **x)
    before = {n: steps(local(tmp_path, n)) for n in "ab"}
    assert before == {"a": [5, 10], "b": [5, 10]}
    snapshot = {
        n: {
            str(p.relative_to(local(tmp_path, n))): p.read_bytes()
            for p in local(tmp_path, n).glob("step_*/*")
        }
        for n in "ab"
    }
    y = {"dirpath": f"{root}/y", "persist_every_n_saves": 1, "local_keep": 1}
    got = run_distributed(w.fit, 2, root, 20, **y)
    assert [g["recovery"] for g in got] == [None, None]
    assert [g["first_step"] for g in got] == [0, 0]
    assert steps(tmp_path / "y")[-1] == 20  # a save due while an upload runs stays local
    for n in "ab":
        names = sorted(p.parent.name for p in local(tmp_path, n).glob("step_*/manifest.json"))
        theirs = [m for m in names if m not in ("step_000000005", "step_000000010")]
        assert len(theirs) == 1, (n, names)  # local_keep=1 for Y's own
        for rel, body in snapshot[n].items():
            assert (local(tmp_path, n) / rel).read_bytes() == body, (n, rel)
    again = run_distributed(w.fit, 2, root, 15, **x)
    assert [g["first_step"] for g in again] == [10, 10]
    assert [g["recovery"]["tier"] for g in again] == ["local", "local"]


@pytest.mark.timeout(120)
@pytest.mark.timeout(180)
def test_sigterm_on_one_node_then_every_local_root_lost_resumes_exactly_from_dirpath(
    tmp_path,
) -> None:
    """SIGTERM on rank 1 (node b) during step 8's batch, which is also a scheduled save
    (every 2): one save at 8, persisted before the exit (143 on both ranks). Both nodes'
    local roots are then lost; the job resumes from dirpath alone and continues exactly as
    the uninterrupted run (losses bitwise, the same batches)."""
    root = str(tmp_path / "run")
    tiers = {"persist_every_n_saves": 3, "every": 2}
    ref = run_distributed(w.fit, 2, str(tmp_path / "ref"), 14, **tiers)
    kw = {"model_kwargs": {"signal_at": 7, "signal_rank": 1}}
    got = run_distributed(w.fit, 2, root, 14, **kw, **tiers)
    assert [g.get("exit") for g in got] == [143, 143], got
    assert [g["global_step"] for g in got] == [8, 8]
    assert steps(tmp_path / "run" / "ckpts")[-1] == 8
    shutil.rmtree(tmp_path / "run" / "local")
    again = run_distributed(w.fit, 2, root, 14, **tiers)
    assert [a["recovery"]["tier"] for a in again] == ["persistent"] * 2
    for rank in range(2):
        ref_losses = {s: v for s, v in ref[rank]["losses"] if s >= 8}
        assert dict(again[rank]["losses"]) == ref_losses
        assert again[rank]["seen"] == [s for s in ref[rank]["seen"] if s[0] >= 8]
