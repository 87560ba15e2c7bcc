"""Straggler detection: timings ride in per-rank slots of the agreement vector."""

from __future__ import annotations

import pytest

from lightning_elastic.core.dist.straggler import (
    RankTiming,
    StepWindow,
    decode_slots,
    encode_slots,
    find_stragglers,
)


def test_per_rank_slots_survive_an_element_wise_maximum() -> None:
    timings = [RankTiming(0.1, 0.0), RankTiming(0.25, 0.002), RankTiming(0.1, 0.5)]
    vectors = [encode_slots(r, 3, t) for r, t in enumerate(timings)]
    reduced = [max(column) for column in zip(*vectors, strict=True)]
    assert decode_slots(reduced, 3) == [
        RankTiming(pytest.approx(t.local_s), pytest.approx(t.save_s)) for t in timings
    ]


def test_a_window_reports_medians_and_starts_over() -> None:
    window = StepWindow(3)
    for local in (0.1, 5.0, 0.12):  # one validation-heavy step does not count
        window.add(local, 0.0)
    assert window.take() == RankTiming(0.12, 0.0)
    assert window.take() == RankTiming(0.0, 0.0)


def test_a_slow_rank_is_named_with_its_host_and_cause() -> None:
    timings = [
        RankTiming(0.10, 0.0),
        RankTiming(0.10, 0.0),
        RankTiming(0.30, 0.0),
        RankTiming(0.10, 0.25),
        RankTiming(0.11, 0.0),
    ]
    found = find_stragglers(timings, ["a", "a", "b", "c", "c"], factor=1.5)
    assert [(s.rank, s.host, s.where) for s in found] == [(2, "b", "step"), (3, "c", "save")]
    assert found[0].factor == pytest.approx(0.30 / 0.11)
    assert "rank 2 on b" in found[0].describe() and "checkpoint" in found[1].describe()


def test_equal_ranks_and_tiny_differences_are_not_stragglers() -> None:
    assert find_stragglers([RankTiming(0.1, 0)] * 4, ["h"] * 4, factor=1.5) == []
    tiny = [RankTiming(0.0014, 0), RankTiming(0.0025, 0)]  # rank 0's logging on 1 ms steps
    assert find_stragglers(tiny, ["h", "h"], factor=1.5) == []  # below the timer noise
    assert find_stragglers([RankTiming(9.0, 0)], ["h"], factor=1.5) == []  # one rank
