"""Multi-tier checkpoints, second hostile review (issue #11): the first review's fixes
(name reservation, variant resolution by commit order) against nodes that were away, and the
c10d store over many saves."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_elastic.testing.spawn import WorkerFailure, run_distributed
from tests.faults.tier_hostile_workers import (
    close_while_uploading,
    load,
    save,
    shared_local_root,
    store_keys,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


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


def test_the_c10d_store_does_not_grow_with_the_number_of_saves(tmp_path) -> None:
    counts = run_distributed(store_keys, 2, str(tmp_path), ["a", "b"], 50)[0]
    assert counts[-1] - counts[1] <= 4, counts


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


def test_one_local_root_shared_by_two_node_ids_is_refused_at_construction(tmp_path) -> None:
    # local_dirpath on a shared file system: the replicas would land in the directory they
    # protect (every save warned "this node keeps no copy", recovery reported "local")
    with pytest.raises(WorkerFailure, match="see the local root of another node"):
        run_distributed(shared_local_root, 2, str(tmp_path), ["a", "b"], 2)


def test_a_checkpoint_kept_for_its_upload_is_trimmed_once_uploaded_also_at_close(tmp_path) -> None:
    """local_keep=1: step 1 stays on the nodes while its upload stalls and steps 2 and 3
    commit; close() waits for the upload, then each node keeps one checkpoint (no commit
    comes after the upload to apply the local retention)."""
    out = run_distributed(close_while_uploading, 2, str(tmp_path), ["a", "b"])
    assert all(r["failures"] == 0 and r["close_s"] > 1.0 for r in out), out
    for node in ("a", "b"):
        held = sorted(p.parent.name for p in (tmp_path / f"local_{node}").glob("*/manifest.json"))
        assert held == ["step_000000003"], (node, held)
    persisted = sorted(p.parent.name for p in (tmp_path / "persistent").glob("*/manifest.json"))
    assert persisted == ["step_000000001"]
