"""CommitChannel and CommitDecision: the store-based two-phase commit exchange, with two
channel instances (rank 0 and rank 1) over one HashStore and an injected clock."""

import json
import threading

import pytest
import torch.distributed as dist

from lightning_elastic.core.dist.channel import CommitChannel, CommitDecision
from lightning_elastic.errors import CheckpointSaveError, Phase, RankFailure, SaveTimeoutError

NS = "test/commit"
SAVE = "00000000deadbeef"


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def channels(world_size: int = 2, clock: Clock | None = None) -> list[CommitChannel]:
    store = dist.HashStore()
    return [
        CommitChannel(
            store,
            rank=rank,
            world_size=world_size,
            namespace=NS,
            timeout_s=30.0,
            clock=clock or Clock(),
        )
        for rank in range(world_size)
    ]


def ok_report(rank: int) -> dict:
    return {"ok": True, "file": [100 + rank, f"sum{rank}"], "results": [], "rank": {"rank": rank}}


def has(channel: CommitChannel, *parts: object) -> bool:
    return channel.store.check([channel._key(SAVE, *parts)])


# ---------------------------------------------------------------- CommitDecision


def test_a_committed_decision_round_trips_through_json() -> None:
    decision = CommitDecision(True)
    assert CommitDecision.from_json(decision.to_json()) == decision
    assert json.loads(decision.to_json()) == {
        "committed": True,
        "failures": [],
        "missing": [],
        "timeout_s": 0.0,
    }


def test_a_failed_decision_round_trips_with_failures_missing_and_timeout() -> None:
    decision = CommitDecision(
        False,
        (RankFailure(1, Phase.WRITE, "StorageFullError", "no space"),),
        (2, 3),
        12.5,
    )
    back = CommitDecision.from_json(decision.to_json().encode())
    assert back == decision
    assert back.failures[0].phase == "write" and back.missing == (2, 3)


def test_a_decision_with_failures_raises_a_save_error_naming_them() -> None:
    failure = RankFailure(1, Phase.WRITE, "StorageFullError", "no space")
    error = CommitDecision(False, (failure,)).error("mem://r/step_000000001")
    assert type(error) is CheckpointSaveError
    assert error.failed_ranks == [1] and error.failures[1] == failure
    assert "mem://r/step_000000001" in str(error) and "no space" in str(error)


def test_a_decision_with_missing_ranks_raises_a_save_timeout_naming_them() -> None:
    failure = RankFailure(0, Phase.COMMIT, "RuntimeError", "late")
    error = CommitDecision(False, (failure,), (1,), 30.0).error("ckpt")
    assert type(error) is SaveTimeoutError
    assert error.missing_ranks == [1] and error.timeout_s == 30.0
    assert error.phase_name == "commit"
    assert error.failed_ranks == [0, 1]


# ---------------------------------------------------------------- report / collect / publish


def test_rank_zero_collects_every_report_sent_from_another_thread() -> None:
    rank0, rank1 = channels()
    rank0.report(SAVE, ok_report(0))
    sender = threading.Timer(0.05, rank1.report, args=(SAVE, ok_report(1)))
    sender.start()
    reports = rank0.collect(SAVE, deadline=100.0 + 10.0, checkpoint="ckpt")
    sender.join()
    assert reports == {0: ok_report(0), 1: ok_report(1)}


def test_rank_one_receives_the_decision_published_from_another_thread() -> None:
    rank0, rank1 = channels()
    decision = CommitDecision(False, (RankFailure(0, Phase.WRITE, "OSError", "eio"),))
    got = []
    waiter = threading.Thread(target=lambda: got.append(rank1.await_decision(SAVE, 110.0, "c")))
    waiter.start()
    rank0.publish(SAVE, decision)
    waiter.join(5)
    assert got == [decision]


def test_a_missing_report_is_a_save_timeout_naming_the_rank() -> None:
    clock = Clock(100.0)
    rank0, _rank1, rank2 = channels(world_size=3, clock=clock)
    rank0.report(SAVE, ok_report(0))
    rank2.report(SAVE, ok_report(2))
    with pytest.raises(SaveTimeoutError) as info:
        rank0.collect(SAVE, deadline=100.05, checkpoint="mem://r/ckpt")  # waits 50 ms
    assert info.value.missing_ranks == [1]
    assert info.value.phase_name == "commit" and info.value.timeout_s == 30.0
    assert "mem://r/ckpt" in str(info.value)


def test_a_passed_deadline_does_not_wait_at_all() -> None:
    clock = Clock(500.0)
    rank0, _ = channels(clock=clock)
    rank0.report(SAVE, ok_report(0))
    with pytest.raises(SaveTimeoutError) as info:
        rank0.collect(SAVE, deadline=100.0, checkpoint="c")  # an hour would hang the test
    assert info.value.missing_ranks == [1]


def test_reports_already_present_are_collected_after_the_deadline() -> None:
    rank0, rank1 = channels(clock=Clock(500.0))
    rank0.report(SAVE, ok_report(0))
    rank1.report(SAVE, {"ok": False, "failure": RankFailure(1, "write", "E", "m").to_json()})
    reports = rank0.collect(SAVE, deadline=100.0, checkpoint="c")
    assert reports[1]["ok"] is False and reports[1]["failure"]["rank"] == 1


def test_missing_reports_lists_every_rank_that_has_not_reported() -> None:
    rank0, _, rank2, _ = channels(world_size=4)
    rank2.report(SAVE, ok_report(2))
    assert rank0.missing_reports(SAVE) == [0, 1, 3]
    rank0.report(SAVE, ok_report(0))
    assert rank0.missing_reports(SAVE) == [1, 3]


def test_a_missing_decision_names_the_ranks_that_never_reported() -> None:
    rank0, rank1, _rank2 = channels(world_size=3, clock=Clock(500.0))
    rank0.report(SAVE, ok_report(0))
    rank1.report(SAVE, ok_report(1))
    with pytest.raises(SaveTimeoutError) as info:
        rank1.await_decision(SAVE, deadline=100.0, checkpoint="c")
    assert info.value.missing_ranks == [2]


def test_a_missing_decision_after_every_report_blames_rank_zero() -> None:
    rank0, rank1 = channels(clock=Clock(500.0))
    rank0.report(SAVE, ok_report(0))
    rank1.report(SAVE, ok_report(1))
    with pytest.raises(SaveTimeoutError) as info:
        rank1.await_decision(SAVE, deadline=100.0, checkpoint="c")
    assert info.value.missing_ranks == [0]


def test_saves_do_not_see_each_others_reports() -> None:
    rank0, rank1 = channels(clock=Clock(500.0))
    rank0.report("other-save", ok_report(0))
    rank1.report("other-save", ok_report(1))
    with pytest.raises(SaveTimeoutError) as info:
        rank0.collect(SAVE, deadline=100.0, checkpoint="c")
    assert info.value.missing_ranks == [0, 1]


# ---------------------------------------------------------------- ack


def test_the_last_ack_removes_every_key_of_the_save() -> None:
    rank0, rank1 = channels()
    rank0.report(SAVE, ok_report(0))
    rank1.report(SAVE, ok_report(1))
    rank0.publish(SAVE, CommitDecision(True))
    rank1.report("next-save", ok_report(1))
    rank0.ack(SAVE)
    assert has(rank0, "report", 0) and has(rank0, "decision") and has(rank0, "acks")
    rank1.ack(SAVE)
    for parts in (("report", 0), ("report", 1), ("decision",), ("acks",)):
        assert not has(rank0, *parts), parts
    assert rank0.store.check([rank0._key("next-save", "report", 1)])  # other saves untouched


def test_ack_cleans_up_even_when_a_report_never_came() -> None:
    rank0, rank1 = channels()
    rank0.report(SAVE, ok_report(0))
    rank0.publish(SAVE, CommitDecision(False, (), (1,), 30.0))
    rank0.ack(SAVE)
    rank1.ack(SAVE)
    assert not has(rank0, "report", 0) and not has(rank0, "decision")
    assert not has(rank0, "acks")


def test_reports_land_under_the_namespace_in_the_shared_store() -> None:
    store = dist.HashStore()
    channel = CommitChannel(store, rank=0, world_size=1, namespace=NS, timeout_s=1.0)
    channel.report(SAVE, ok_report(0))
    assert json.loads(store.get(f"{NS}/save/{SAVE}/report/0")) == ok_report(0)
