"""Rollbacks and fresh starts with tiers: a job that loads an older checkpoint and saves a new
branch under names the persistent tier (or a node that was away) still holds for the abandoned
branch, and a fresh start beside an old run's node-local copies. Whichever was committed last
is what the next resume loads. Rank ``r`` runs on node ``nodes[r]``, local roots
``<root>/local_<node>``, the persistent root ``<root>/persistent`` (engine_workers.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_elastic.testing.spawn import run_distributed
from tests.tiers.engine_workers import (
    load,
    save,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
NODES = ["a", "b"]


def sequences(path: Path) -> dict[str, int]:
    return {
        m.parent.name: json.loads(m.read_text())["sequence"]
        for m in sorted(path.glob("step_*/manifest.json"))
    }


def rollback_on_fresh_nodes(tmp_path: Path, new_branch: list[tuple[int, float]]) -> list[str]:
    """Steps 1-4 (tags 1-4) persisted; the job moves to fresh nodes, rolls back to step 1 and
    saves ``new_branch`` (the last with persist=True)."""
    run_distributed(save, 2, str(tmp_path), NODES, [(1, 1), (2, 2), (3, 3), (4, 4)])
    for node in NODES:
        shutil.rmtree(tmp_path / f"local_{node}")
    return run_distributed(
        save,
        2,
        str(tmp_path),
        NODES,
        new_branch,
        load="step_000000001",
        persist_every_n_saves=10,
    )[0]


def rollback_while_b_was_away(tmp_path: Path, new_branch: list[tuple[int, float, bool]]) -> None:
    """Job 1 on nodes a, b: steps 1-4, only step 1 persisted (it then crashed: no end
    persist). Node a is replaced by a fresh one; node b is drained. Job 2 on a and c rolls
    back to step 1 and saves ``new_branch``. Then b comes back (hostPath NVMe, as the docs
    recommend to keep the local tier across pod replacements)."""
    run_distributed(
        save,
        2,
        str(tmp_path),
        ["a", "b"],
        [(1, 1, True), (2, 2, False), (3, 3, False), (4, 4, False)],
        settle=True,
        persist_every_n_saves=10,
    )
    shutil.rmtree(tmp_path / "local_a")
    run_distributed(
        save,
        2,
        str(tmp_path),
        ["a", "c"],
        new_branch,
        load="step_000000001",
        settle=True,
        persist_every_n_saves=10,
    )


def test_a_rollback_whose_name_exists_on_the_persistent_tier_still_recovers_the_new_branch(
    tmp_path,
) -> None:
    # the new branch's step 4 (persist=True) is named like the abandoned, persisted step 4
    rollback_on_fresh_nodes(tmp_path, [(4, 40)])
    got = run_distributed(load, 2, str(tmp_path), NODES)  # today: KeyError on every rank
    assert [g["tag"] for g in got] == [40.0, 40.0]


def test_a_forced_persist_after_a_rollback_reaches_the_persistent_tier(tmp_path) -> None:
    names = rollback_on_fresh_nodes(tmp_path, [(2, 20), (3, 30), (4, 40)])
    newest = names[-1]
    for node in NODES:  # the nodes are lost: the persistent tier must hold the new branch
        shutil.rmtree(tmp_path / f"local_{node}")
    got = run_distributed(load, 2, str(tmp_path), NODES)
    assert [g["tag"] for g in got] == [40.0, 40.0], (newest, sequences(tmp_path / "persistent"))


def test_the_newest_checkpoint_is_recovered_after_a_rollback_on_the_same_nodes(tmp_path) -> None:
    rollback_on_fresh_nodes(tmp_path, [(2, 20), (3, 30), (4, 40)])
    got = run_distributed(load, 2, str(tmp_path), NODES)  # today: step 3 (tag 30)
    assert [g["tag"] for g in got] == [40.0, 40.0]


def test_a_node_away_during_a_rollback_does_not_resurrect_the_abandoned_branch(tmp_path) -> None:
    # the new branch is shorter than the abandoned one: its commit sequences (2, 3) are below
    # the sequence of the abandoned step 4 (4) that only node b holds
    rollback_while_b_was_away(tmp_path, [(2, 20, False), (3, 30, True)])
    got = run_distributed(load, 2, str(tmp_path), ["a", "b"])
    assert [g["tag"] for g in got] == [30.0, 30.0], got  # today: 4.0 (abandoned branch)


def test_a_stale_copy_under_the_new_branchs_name_does_not_replace_the_new_branch(
    tmp_path,
) -> None:
    # the new branch's only save is named step_000000004 (nobody present holds that name);
    # node b's abandoned step_000000004 has a higher commit sequence (4 vs 2)
    rollback_while_b_was_away(tmp_path, [(4, 40, True)])
    got = run_distributed(load, 2, str(tmp_path), ["a", "b"])
    assert [g["tag"] for g in got] == [40.0, 40.0], got  # today: 4.0, and a's manifest dropped


def test_a_fresh_start_is_not_superseded_by_the_old_run_on_another_nodes_local_root(
    tmp_path,
) -> None:
    # every node present at every step: job 1 on a, b saves 1-4 (step 1 persisted); node a
    # is replaced; job 2 starts fresh (resume="never", or a new experiment in the same
    # dirs) and saves two steps; job 3 resumes. Without tiers job 2's end is the newest.
    run_distributed(
        save,
        2,
        str(tmp_path),
        ["a", "b"],
        [(1, 1, True), (2, 2, False), (3, 3, False), (4, 4, False)],
        settle=True,
        persist_every_n_saves=10,
    )
    shutil.rmtree(tmp_path / "local_a")
    names = run_distributed(
        save,
        2,
        str(tmp_path),
        ["a", "b"],
        [(1, 10, False), (2, 20, False)],
        settle=True,
        persist_every_n_saves=10,
    )[0]
    got = run_distributed(load, 2, str(tmp_path), ["a", "b"])
    assert [g["tag"] for g in got] == [20.0, 20.0], (names, got)  # today: 4.0 (job 1)
