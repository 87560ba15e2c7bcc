"""Multi-tier checkpoints through Lightning, fourth hostile review: validate/test with
``ckpt_path="last"``/``"best"``, world-size changes after a partial recovery (every sample
once per epoch), the local retention trim beside another run's checkpoints, a preemption
with every local root lost after it, bad configurations, and ``ls --local`` on half-written
local copies. Two "nodes" a, b on one machine (one rank each, local roots
``<root>/local/<node>``) unless said otherwise."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from lightning_elastic import DistributedCheckpoint, TierOptions
from lightning_elastic.errors import ConfigError
from lightning_elastic.testing.spawn import run_distributed
from tests.faults import tier_hostile4_workers as w

pytestmark = pytest.mark.timeout(120)


def steps(root: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("_")[1].split("-")[0]) for p in root.glob("step_*/manifest.json")
    )


def local(root: Path, node: str) -> Path:
    return root / "local" / node


# ------------------------------------------------------------------ (1) validate/test aliases


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


# ------------------------------------------------------ (2) world-size changes, every sample


def _epochs(runs: list[tuple[list[dict], int, int]]) -> dict[int, Counter]:
    """Sample ids per epoch over the kept part of each run: steps in [start, end)."""
    seen: dict[int, Counter] = {}
    for results, start, end in runs:
        for r in results:
            for step, epoch, ids in r["seen"]:
                if start <= step < end:
                    seen.setdefault(epoch, Counter()).update(ids)
    return seen


@pytest.mark.timeout(180)
def test_world_size_changes_after_a_partial_recovery_skip_and_repeat_nothing(tmp_path) -> None:
    """As above, but every leg ends normally at a max_steps (persisted, the local tiers keep
    theirs) so each leg's samples come back: 2 nodes to step 10; b wiped, 2 nodes to 12
    (b recovers from a's replica); node a alone to 22 (mid epoch 2); then a and b to 37
    (b's root has old copies only). Epochs 0-3 each see the 64 samples exactly once."""
    root = str(tmp_path)
    tiers = {"persist_every_n_saves": 100, "every": 2}
    legs = []
    first = run_distributed(w.fit, 2, root, 10, **tiers)
    legs.append((first, 0, 10))
    shutil.rmtree(local(tmp_path, "b"))
    second = run_distributed(w.fit, 2, root, 12, **tiers)
    assert [r["recovery"]["tier"] for r in second] == ["local", "peer"]
    assert [r["first_step"] for r in second] == [10, 10]
    legs.append((second, 10, 12))
    third = run_distributed(w.fit, 1, root, 22, **tiers)
    assert third[0]["first_step"] == 12 and third[0]["recovery"]["tier"] == "local"
    legs.append((third, 12, 22))
    fourth = run_distributed(w.fit, 2, root, 37, **tiers)
    assert [r["first_step"] for r in fourth] == [22, 22]
    assert fourth[0]["recovery"]["checkpoint"].startswith("step_000000022")
    legs.append((fourth, 22, 37))
    seen = _epochs(legs)
    assert sorted(seen) == [0, 1, 2, 3]
    for epoch, counts in seen.items():
        dupes = {i: c for i, c in counts.items() if c != 1}
        missing = set(range(64)) - set(counts)
        assert not dupes and not missing, (epoch, dupes, missing)


# ------------------------------------------------------------------ (3) local retention


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


# ------------------------------------------------------------------ (4) preemption


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


# ------------------------------------------------------------------ (5) bad configuration


@pytest.mark.parametrize("inside", ["local_in_dirpath", "dirpath_in_local"])
def test_a_local_root_nested_with_the_persistent_root_is_refused(tmp_path, inside) -> None:
    from tests.lightning import workers

    ckpts, nested = tmp_path / "ckpts", tmp_path / "ckpts" / "local"
    if inside == "dirpath_in_local":  # the persistent root (<root>/ckpts) inside the local
        with pytest.raises(ConfigError, match="one holds the other"):
            workers.fit(
                str(tmp_path), 4, strategy="auto", devices=1, tiers=TierOptions(str(tmp_path))
            )
        return
    with pytest.raises(ConfigError, match="one holds the other"):
        workers.fit(str(tmp_path), 4, strategy="auto", devices=1, tiers=TierOptions(str(nested)))
    assert not list(ckpts.glob("step_*"))


def test_an_unwritable_local_root_on_one_node_fails_every_rank_with_a_typed_error(
    tmp_path,
) -> None:
    """Node b's local root lies under a regular file (not creatable); node a's is fine. Both
    ranks must fail at setup with one clear error naming the local root, not hang and not
    train without a local tier on b."""
    (tmp_path / "file").write_text("not a directory")
    local_of = {"a": str(tmp_path / "local_a"), "b": str(tmp_path / "file" / "local_b")}
    got = run_distributed(w.fit_config, 2, str(tmp_path), 6, local_of, timeout=90)
    for g in got:
        assert "global_step" not in g, g
        assert g["error"] == "ConfigError", g
        assert "local_b" in g["message"] and "local_dirpath" in g["message"], g


def test_replicas_beyond_the_other_nodes_are_capped_and_every_node_holds_every_shard(
    tmp_path,
) -> None:
    """replicas=5 with 2 nodes: capped at 1 (docs/tiers.md); each node's root holds both
    shards of each save, and a wiped node recovers from its peer."""
    local_of = {n: str(tmp_path / f"local_{n}") for n in "ab"}
    got = run_distributed(w.fit_config, 2, str(tmp_path), 6, local_of, replicas=5)
    assert [g.get("global_step") for g in got] == [6, 6], got
    for n in "ab":
        shards = list((tmp_path / f"local_{n}" / "step_000000006").glob("*.distcp"))
        assert len(shards) == 2, (n, shards)


@pytest.mark.parametrize("node", ["a b", "..", "nœud-1", "a*?", "a\\b", "x" * 255])
def test_a_node_id_accepted_by_the_options_trains(tmp_path, node) -> None:
    """Validation refuses '/', control characters and ids over 255 characters; every other
    id must then work (the shared-root probe once embedded the raw id in a file name: a
    backslash or a 240-character id failed at setup with a StorageError)."""
    DistributedCheckpoint(tmp_path / "ckpts", tiers=TierOptions(tmp_path / "local", node=node))
    local_of = {node: str(tmp_path / "local")}
    (got,) = run_distributed(w.fit_config, 1, str(tmp_path), 3, local_of, names=[node])
    assert got == {"global_step": 3}, got
    assert steps(tmp_path / "ckpts") == [3] and steps(tmp_path / "local") == [3]


@pytest.mark.parametrize("node", ["a\x00b", "a\nb", "x" * 256, "", "a/b"])
def test_an_illegal_node_id_is_a_config_error(tmp_path, node) -> None:
    """Refused with ConfigError, at construction (docs: "validated at construction") or at
    the latest at setup, never another error."""
    try:
        DistributedCheckpoint(tmp_path / "ckpts", tiers=TierOptions(tmp_path / "local", node=node))
    except ConfigError:
        return
    local_of = {node: str(tmp_path / "local")}
    (got,) = run_distributed(w.fit_config, 1, str(tmp_path), 3, local_of, names=[node])
    assert got.get("error") == "ConfigError", got
    assert not (tmp_path / "ckpts").exists() or not steps(tmp_path / "ckpts")


# ------------------------------------------------------------------ (6) ls --local


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a killed two-node Lightning run leaves: steps 5 and 10 on both nodes' local
    roots, 10 persisted (persist_every_n_saves=2)."""
    root = tmp_path_factory.mktemp("layout")
    run_distributed(w.fit, 2, str(root), 20, 13, may_die={0, 1}, persist_every_n_saves=2)
    assert steps(root / "ckpts") == [10]
    assert steps(local(root, "a")) == steps(local(root, "b")) == [5, 10]
    return root


def _copy(layout: Path, tmp_path: Path) -> Path:
    shutil.copytree(layout, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _ls(capsys, root: Path, *extra: str) -> tuple[int, str]:
    from tests.cli.test_cli import run

    code, out, err = run(
        capsys,
        "ls",
        str(root / "ckpts"),
        "--local",
        str(local(root, "a")),
        "--local",
        str(local(root, "b")),
        *extra,
    )
    assert "Traceback" not in err, err
    return code, out


def _tiers(out: str) -> dict[str, tuple[str, str]]:
    rows = [line.split() for line in out.splitlines() if line.startswith("step_")]
    return {r[0]: (r[-2], r[-1]) for r in rows}


def test_ls_local_on_a_half_written_local_manifest(layout, tmp_path, capsys) -> None:
    root = _copy(layout, tmp_path)
    manifest = local(root, "b") / "step_000000005" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # a half-written copy on b
    code, out = _ls(capsys, root)
    assert code == 0
    assert _tiers(out)["step_000000005"] == ("local-only", "local:1/2+peer"), out
    code, out = _ls(capsys, root, "--json")
    row = {r["name"]: r for r in json.loads(out)}["step_000000005"]
    assert row["tiers"]["nodes"][str(local(root, "b"))]["complete"] is False
    # the broken older copy does not disturb the resume (from step 10, on both nodes)
    got = run_distributed(w.fit, 2, str(root), 12, persist_every_n_saves=2)
    assert [g["first_step"] for g in got] == [10, 10]


def test_ls_check_full_does_not_list_a_corrupt_local_only_checkpoint_as_held(
    layout, tmp_path, capsys
) -> None:
    """Step 5 lives on the nodes only, and rank 0's shard is corrupt (same size) on both.
    ``ls --check full --local`` says "checked: manifests, file sizes and checksums", yet
    lists step 5 as ``local-only  local:2/2``: a checkpoint no recovery can load shown as
    complete on both nodes."""
    root = _copy(layout, tmp_path)
    for n in "ab":
        shard = next((local(root, n) / "step_000000005").glob("*rank00000.distcp"))
        body = bytearray(shard.read_bytes())
        body[len(body) // 2] ^= 0xFF
        shard.write_bytes(bytes(body))
    _, out = _ls(capsys, root, "--check", "full")
    assert "checksums" in out
    assert _tiers(out).get("step_000000005", ("", ""))[1] != "local:2/2", out
