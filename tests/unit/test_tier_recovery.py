"""Recovery from the fastest tier, as data: which checkpoint, and how each node gets its files.

Two "nodes" A (ranks 0, 1) and B (ranks 2, 3) unless said otherwise; each save writes one shard per
rank plus the global manifest, and with ``replicas=1`` each node also holds the other's shards.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TypeVar

import pytest

from lightning_elastic.core.tiers.recovery import (
    CheckpointCandidate,
    Fetch,
    NodeHoldings,
    RecoveryPlan,
    plan_recovery,
)
from lightning_elastic.errors import ConfigError

SHARD = 100
MANIFEST = 10


def files(world: int = 4, shard: int = SHARD) -> dict[str, int]:
    """Every file of a checkpoint saved by ``world`` ranks."""
    out = {f"__{r}_0.distcp": shard for r in range(world)}
    out["manifest.json"] = MANIFEST
    return out


def cand(name: str, seq: int, world: int = 4, persisted: bool = False) -> CheckpointCandidate:
    """A committed checkpoint whose commit sequence is ``seq`` (the order ``sort_key`` gives)."""
    return CheckpointCandidate(name, (False, seq, float(seq), name), files(world), persisted)


def shards(*ranks: int, world: int = 4, manifest: bool = True) -> dict[str, int]:
    """The files a node holds: the shards of ``ranks`` and (by default) the manifest."""
    all_files = files(world)
    out = {f"__{r}_0.distcp": all_files[f"__{r}_0.distcp"] for r in ranks}
    if manifest:
        out["manifest.json"] = MANIFEST
    return out


def node(name: str, ranks: tuple[int, ...], **ckpts: Mapping[str, int]) -> NodeHoldings:
    return NodeHoldings(name, ranks, dict(ckpts))


FULL = shards(0, 1, 2, 3)  # a node's root after a save with replicas=1 on two nodes
TOTAL = 4 * SHARD + MANIFEST


# --------------------------------------------------------------------- the cases


def test_a_worker_restarted_on_the_same_node_recovers_everything_locally() -> None:
    plan = plan_recovery(
        [cand("s20", 2), cand("s10", 1)],
        [node("A", (0, 1), s20=FULL, s10=FULL), node("B", (2, 3), s20=FULL, s10=FULL)],
        persistent_newest=cand("s10", 1),
    )
    assert plan == RecoveryPlan("s20", "local", (), 2 * TOTAL, {})
    assert plan.bytes_by_source() == {"local": 2 * TOTAL, "peer": 0, "persistent": 0}


def test_b_a_replaced_node_gets_every_file_from_the_replicas_on_the_other_node() -> None:
    plan = plan_recovery(
        [cand("s20", 2)],
        [node("A", (0, 1), s20=FULL), node("B2", (2, 3))],
        persistent_newest=cand("s10", 1),
    )
    assert (plan.checkpoint, plan.tier) == ("s20", "peer")
    assert plan.fetches == tuple(Fetch(f, s, 2, 0) for f, s in sorted(files().items()))
    assert plan.bytes_by_source() == {"local": TOTAL, "peer": TOTAL, "persistent": 0}


def test_c_both_nodes_lost_recover_from_the_persistent_tier() -> None:
    plan = plan_recovery(
        [], [node("A2", (0, 1)), node("B2", (2, 3))], persistent_newest=cand("s10", 1)
    )
    assert (plan.checkpoint, plan.tier) == ("s10", "persistent")
    expected = [Fetch(f, s, dst, None) for dst in (0, 2) for f, s in sorted(files().items())]
    assert list(plan.fetches) == expected
    assert plan.bytes_by_source() == {"local": 0, "peer": 0, "persistent": 2 * TOTAL}


def test_d_a_local_tier_older_than_the_persistent_tier_loses_to_it() -> None:
    plan = plan_recovery(
        [cand("s10", 1)],
        [node("A", (0, 1), s10=FULL), node("B", (2, 3), s10=FULL)],
        persistent_newest=cand("s90", 9),
    )
    assert (plan.checkpoint, plan.tier) == ("s90", "persistent")
    assert plan.skipped == {}


def test_d_a_persistent_checkpoint_partly_on_the_nodes_reads_only_the_rest_remotely() -> None:
    # node A kept its own shards of s90; B is new: A's files go to B by peer, the rest is remote
    plan = plan_recovery(
        [cand("s90", 9)],
        [node("A", (0, 1), s90=shards(0, 1)), node("B", (2, 3))],
        persistent_newest=cand("s90", 9),
    )
    assert (plan.checkpoint, plan.tier) == ("s90", "persistent")
    by_dst = {(f.dst_rank, f.file): f.src_rank for f in plan.fetches}
    assert by_dst == {
        (0, "__2_0.distcp"): None,
        (0, "__3_0.distcp"): None,
        (2, "__0_0.distcp"): 0,
        (2, "__1_0.distcp"): 0,
        (2, "__2_0.distcp"): None,
        (2, "__3_0.distcp"): None,
        (2, "manifest.json"): 0,
    }
    assert plan.bytes_by_source() == {
        "local": 2 * SHARD + MANIFEST,
        "peer": 2 * SHARD + MANIFEST,
        "persistent": 4 * SHARD,
    }


def test_e_a_truncated_local_copy_is_fetched_from_the_peer_that_has_it_whole() -> None:
    a = dict(FULL, **{"__2_0.distcp": SHARD // 2})
    plan = plan_recovery(
        [cand("s20", 2)],
        [node("A", (0, 1), s20=a), node("B", (2, 3), s20=FULL)],
        persistent_newest=None,
    )
    assert (plan.checkpoint, plan.tier) == ("s20", "peer")
    assert plan.fetches == (Fetch("__2_0.distcp", SHARD, 0, 2),)


def test_e_a_file_truncated_everywhere_falls_back_to_the_previous_checkpoint() -> None:
    bad = dict(FULL, **{"__3_0.distcp": 7})
    plan = plan_recovery(
        [cand("s20", 2), cand("s10", 1)],
        [node("A", (0, 1), s20=bad, s10=FULL), node("B", (2, 3), s20=bad, s10=FULL)],
        persistent_newest=None,
    )
    assert (plan.checkpoint, plan.tier) == ("s10", "local")
    reason = plan.skipped["s20"]
    assert "1 of 5 file(s)" in reason and "'__3_0.distcp'" in reason
    assert "wrong-size copies" in reason and "on 'A'" in reason and "on 'B'" in reason


# --------------------------------------------------------------------- choosing


def test_the_newest_incomplete_everywhere_falls_back_to_an_older_complete_one() -> None:
    plan = plan_recovery(
        [cand("s30", 3), cand("s20", 2)],
        [node("A", (0, 1), s30=shards(0, 1), s20=FULL), node("B", (2, 3), s20=FULL)],
        persistent_newest=cand("s10", 1),
    )
    assert (plan.checkpoint, plan.tier) == ("s20", "local")
    assert list(plan.skipped) == ["s30"]
    assert "2 of 5 file(s)" in plan.skipped["s30"]
    assert "not on the persistent tier" in plan.skipped["s30"]


def test_a_persistent_checkpoint_newer_than_the_newest_complete_one_wins() -> None:
    plan = plan_recovery(
        [cand("s30", 3), cand("s10", 1)],
        [node("A", (0, 1), s30=shards(0, 1), s10=FULL), node("B", (2, 3), s10=FULL)],
        persistent_newest=cand("s20", 2),
    )
    assert (plan.checkpoint, plan.tier) == ("s20", "persistent")
    assert list(plan.skipped) == ["s30"]


def test_the_same_checkpoint_on_the_nodes_and_persisted_is_read_from_the_nodes() -> None:
    plan = plan_recovery(
        [cand("s20", 2)],
        [node("A", (0, 1), s20=FULL), node("B", (2, 3))],
        persistent_newest=cand("s20", 2),
    )
    assert (plan.checkpoint, plan.tier) == ("s20", "peer")
    assert plan.bytes_by_source()["persistent"] == 0


def test_a_candidate_flagged_persisted_completes_from_the_persistent_tier() -> None:
    plan = plan_recovery(
        [cand("s20", 2, persisted=True)],
        [node("A", (0, 1), s20=shards(0, 1)), node("B", (2, 3), s20=shards(0, 1))],
        persistent_newest=None,
    )
    assert (plan.checkpoint, plan.tier) == ("s20", "persistent")
    assert {f.file for f in plan.fetches} == {"__2_0.distcp", "__3_0.distcp"}


def test_newest_is_commit_order_never_the_step_in_the_name() -> None:
    # a rollback: step_900 was committed first, the new branch's step_100 after it
    plan = plan_recovery(
        [cand("step_900", 1), cand("step_100", 2)],
        [node("A", (0, 1), step_900=FULL, step_100=FULL), node("B", (2, 3))],
        persistent_newest=None,
    )
    assert plan.checkpoint == "step_100"


def test_nothing_anywhere_is_a_fresh_start() -> None:
    plan = plan_recovery([], [node("A", (0, 1)), node("B", (2, 3))], persistent_newest=None)
    assert plan == RecoveryPlan(None, "none")
    assert plan.bytes_by_source() == {"local": 0, "peer": 0, "persistent": 0}


def test_only_incomplete_local_checkpoints_and_no_persistent_one_is_a_fresh_start() -> None:
    plan = plan_recovery(
        [cand("s20", 2), cand("s10", 1)],
        [node("A", (0, 1), s20=shards(0), s10=shards(1)), node("B", (2, 3))],
        persistent_newest=None,
    )
    assert (plan.checkpoint, plan.tier, plan.fetches) == (None, "none", ())
    assert list(plan.skipped) == ["s20", "s10"]


def test_files_and_checkpoints_outside_the_manifests_are_ignored() -> None:
    plan = plan_recovery(
        [cand("s20", 2)],
        [
            node("A", (0, 1), s20=dict(FULL, stray=5), other=FULL),
            node("B", (2, 3), s20=FULL),
        ],
        persistent_newest=None,
    )
    assert plan == RecoveryPlan("s20", "local", (), 2 * TOTAL)


# --------------------------------------------------------------------- world-size change


def test_three_nodes_to_two_recovers_the_lost_nodes_shards_from_its_replica() -> None:
    # 6 ranks on A, B, C saved with replicas=1 in a ring (A->B, B->C, C->A); C is gone and the
    # new world has 4 ranks on A and B. C's shards 4, 5 are on A only.
    old = cand("s20", 2, world=6)
    a = shards(0, 1, 4, 5, world=6)
    b = shards(2, 3, 0, 1, world=6)
    plan = plan_recovery(
        [old], [node("A", (0, 1), s20=a), node("B", (2, 3), s20=b)], persistent_newest=None
    )
    assert (plan.checkpoint, plan.tier) == ("s20", "peer")
    assert [(f.file, f.dst_rank, f.src_rank) for f in plan.fetches] == [
        ("__2_0.distcp", 0, 2),
        ("__3_0.distcp", 0, 2),
        ("__4_0.distcp", 2, 0),
        ("__5_0.distcp", 2, 0),
    ]


def test_three_nodes_to_two_without_the_lost_nodes_replica_uses_the_persistent_tier() -> None:
    a = shards(0, 1, world=6)
    b = shards(2, 3, 0, 1, world=6)
    holdings = [node("A", (0, 1), s20=a), node("B", (2, 3), s20=b)]
    plan = plan_recovery([cand("s20", 2, world=6)], holdings, persistent_newest=None)
    assert plan.checkpoint is None and "2 of 7 file(s)" in plan.skipped["s20"]
    persisted = cand("s20", 2, world=6)
    plan = plan_recovery([persisted], holdings, persistent_newest=persisted)
    assert (plan.checkpoint, plan.tier) == ("s20", "persistent")
    remote = sorted((f.dst_rank, f.file) for f in plan.fetches if f.src_rank is None)
    assert remote == [(d, f"__{r}_0.distcp") for d in (0, 2) for r in (4, 5)]


# --------------------------------------------------------------------- spreading, determinism


def test_bytes_are_spread_over_the_nodes_that_hold_them() -> None:
    sizes = {"big": 300, "m1": 100, "m2": 100, "m3": 100}
    c = CheckpointCandidate("s1", (1,), sizes)
    plan = plan_recovery(
        [c],
        [node("A", (0,), s1=sizes), node("B", (1,), s1=sizes), node("C", (2,))],
        persistent_newest=None,
    )
    sent = {0: 0, 1: 0}
    for f in plan.fetches:
        assert f.dst_rank == 2 and f.src_rank is not None
        sent[f.src_rank] += f.size
    assert sent == {0: 300, 1: 300}
    # ties go to the first node by id: the largest file to A, then B serves the next ones
    assert {f.file: f.src_rank for f in plan.fetches} == {"big": 0, "m1": 1, "m2": 1, "m3": 1}


def test_the_source_is_the_holding_nodes_lowest_rank() -> None:
    plan = plan_recovery(
        [cand("s20", 2)],
        [node("A", (5, 3, 4), s20=FULL), node("B", (2, 0, 1))],
        persistent_newest=None,
    )
    assert {(f.dst_rank, f.src_rank) for f in plan.fetches} == {(0, 3)}


V = TypeVar("V")


def _shuffled_dict(d: Mapping[str, V], rng: random.Random) -> dict[str, V]:
    items = list(d.items())
    rng.shuffle(items)
    return dict(items)


def test_every_rank_gets_the_same_plan_from_the_same_inputs_in_any_order() -> None:
    base_cands = [cand("s30", 3), cand("s20", 2), cand("s10", 1)]
    base_nodes = [
        node("A", (0, 1), s30=shards(0, 1), s20=shards(0, 1, 2), s10=FULL),
        node("B", (2, 3), s20=shards(2, 3)),
        node("C", (4, 5), s20=shards(3, 0)),
        node("D", (6, 7)),
    ]
    persistent = cand("s10", 1)
    reference = plan_recovery(base_cands, base_nodes, persistent_newest=persistent)
    assert reference.checkpoint == "s20" and reference.tier == "peer"
    for seed in range(20):
        rng = random.Random(seed)
        cands = [
            CheckpointCandidate(c.name, c.order, _shuffled_dict(c.files, rng), c.persisted)
            for c in rng.sample(base_cands, len(base_cands))
        ]
        nodes = []
        for n in rng.sample(base_nodes, len(base_nodes)):
            ranks = tuple(rng.sample(n.ranks, len(n.ranks)))
            ckpts = {k: _shuffled_dict(v, rng) for k, v in n.checkpoints.items()}
            nodes.append(NodeHoldings(n.node, ranks, _shuffled_dict(ckpts, rng)))
        assert plan_recovery(cands, nodes, persistent_newest=persistent) == reference


# --------------------------------------------------------------------- validation


def test_a_node_id_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="node 'A' appears twice"):
        plan_recovery([], [node("A", (0,)), node("A", (1,))], persistent_newest=None)


def test_a_rank_on_two_nodes_is_refused() -> None:
    with pytest.raises(ConfigError, match="rank 1 is listed on two nodes: 'A' and 'B'"):
        plan_recovery([], [node("A", (0, 1)), node("B", (1, 2))], persistent_newest=None)


@pytest.mark.parametrize(
    ("ranks", "match"),
    [((), "runs no ranks"), ((0, 0), "lists a rank twice"), ((-1,), "integers >= 0")],
)
def test_a_node_without_usable_ranks_is_refused(ranks: tuple[int, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        NodeHoldings("gone", ranks, {})


def test_no_nodes_at_all_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least one node"):
        plan_recovery([], [], persistent_newest=None)


def test_a_candidate_listed_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        plan_recovery([cand("s1", 1), cand("s1", 1)], [node("A", (0,))], persistent_newest=None)


def test_a_persistent_checkpoint_disagreeing_with_the_nodes_manifest_is_refused() -> None:
    with pytest.raises(ConfigError, match="differs between the nodes and the persistent tier"):
        plan_recovery([cand("s1", 1)], [node("A", (0,))], persistent_newest=cand("s1", 2))


def test_orders_that_do_not_compare_are_refused() -> None:
    odd = CheckpointCandidate("s2", ("two",), files())
    with pytest.raises(ConfigError, match="orders are not comparable"):
        plan_recovery([cand("s1", 1), odd], [node("A", (0,))], persistent_newest=None)


def test_an_unknown_need_is_refused() -> None:
    with pytest.raises(ConfigError, match="need must be one of 'all'"):
        plan_recovery([], [node("A", (0,))], persistent_newest=None, need="mine")
