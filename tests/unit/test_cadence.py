"""The adaptive cadence: Young-Daly with its bounds, "continuous", and option checking."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from lightning_elastic.core.options import MAX_SECONDS
from lightning_elastic.core.policy.cadence import (
    AutoCadence,
    Cadence,
    CadenceOptions,
    Continuous,
    mtbf_from_history,
    parse_duration,
    slowdown,
    young_daly,
)
from lightning_elastic.errors import ConfigError


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("4h", 14400.0),
        ("90m", 5400.0),
        ("90min", 5400.0),
        ("30s", 30.0),
        ("1.5d", 129600.0),
        ("120", 120.0),
        (7.5, 7.5),
        (timedelta(hours=2), 7200.0),
    ],
)
def test_durations_are_read_in_the_usual_units(text: object, seconds: float) -> None:
    assert parse_duration(text, "mtbf") == seconds


@pytest.mark.parametrize("bad", ["4 hours", "h", "", "-1h", "nan", "inf", 0, True, [1]])
def test_a_bad_duration_names_the_option(bad: object) -> None:
    with pytest.raises(ConfigError, match="mtbf"):
        parse_duration(bad, "mtbf")


def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf() -> None:
    assert young_daly(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly(0.5, 4 * 3600 / 2) == pytest.approx(math.sqrt(2 * 0.5 * 7200))


def test_a_node_mtbf_is_divided_by_the_number_of_nodes() -> None:
    cadence = AutoCadence(mtbf_s=4 * 3600.0, nodes=4, max_overhead=0.5)
    choice = cadence.observe(blocked_s=0.2, slowdown_s=0.3, write_s=2.0)
    assert choice.mtbf_s == 3600.0
    assert choice.cost_s == pytest.approx(0.5)
    assert choice.bound == "young_daly"
    assert choice.interval_s == pytest.approx(math.sqrt(2 * 0.5 * 3600))  # 60 s


def test_the_overhead_bound_wins_when_saves_are_expensive() -> None:
    # cost 2 s, MTBF 1 h: Young-Daly says 120 s, i.e. 1.7% of the time; max_overhead 1% -> 200 s
    cadence = AutoCadence(mtbf_s=3600.0, nodes=1, max_overhead=0.01)
    choice = cadence.observe(blocked_s=2.0, slowdown_s=0.0, write_s=5.0)
    assert (choice.bound, choice.interval_s) == ("overhead", pytest.approx(200.0))


def test_saves_are_never_queued_behind_a_slow_write() -> None:
    cadence = AutoCadence(mtbf_s=3600.0, nodes=1, max_overhead=0.5)
    choice = cadence.observe(blocked_s=0.01, slowdown_s=0.0, write_s=400.0)
    assert choice.bound == "write" and choice.interval_s >= 400.0


def test_without_an_mtbf_only_the_bounds_apply() -> None:
    cadence = AutoCadence(mtbf_s=None, nodes=8, max_overhead=0.01)
    assert cadence.choice.bound == "initial"
    choice = cadence.observe(blocked_s=0.3, slowdown_s=0.0, write_s=1.0)
    assert (choice.bound, choice.interval_s, choice.mtbf_s) == (
        "overhead",
        pytest.approx(30.0),
        None,
    )


def test_the_history_mtbf_is_used_when_none_is_given() -> None:
    assert mtbf_from_history(0, 10_000.0) is None
    assert mtbf_from_history(4, 10_000.0) == 2500.0
    cadence = AutoCadence(mtbf_s=None, nodes=2, history_mtbf_s=2500.0, max_overhead=0.5)
    assert cadence.observe(blocked_s=0.5, slowdown_s=0.0, write_s=1.0).interval_s == pytest.approx(
        50.0
    )
    given = AutoCadence(mtbf_s=10_000.0, nodes=2, history_mtbf_s=2500.0)
    assert given.job_mtbf_s == 5000.0  # an explicit mtbf wins


def test_the_cost_is_the_median_of_recent_saves() -> None:
    cadence = AutoCadence(mtbf_s=3600.0, nodes=1, max_overhead=0.5, window=3)
    for blocked in (0.5, 0.5, 50.0):  # one outlier (a stalled save) does not move the median
        choice = cadence.observe(blocked_s=blocked, slowdown_s=0.0, write_s=1.0)
    assert choice.cost_s == 0.5


def test_the_slowdown_counts_only_the_extra_time_of_overlapped_steps() -> None:
    assert slowdown([0.30, 0.30], [0.25, 0.25, 0.26]) == pytest.approx(0.10)
    assert slowdown([0.20], [0.25]) == 0.0  # faster while writing: no cost, never negative
    assert slowdown([], [0.25]) == 0.0 and slowdown([0.3], []) == 0.0


def test_continuous_waits_for_the_commit_and_the_minimum_interval() -> None:
    clock = FakeClock()
    continuous = Continuous(10.0, clock=clock)
    continuous.start()
    assert not continuous.due(busy=False)  # the first save: min_interval after the start
    clock.now += 10
    assert continuous.due(busy=False)
    continuous.saved()
    clock.now += 30
    assert not continuous.due(busy=True)  # still writing
    assert continuous.due(busy=False)
    continuous.saved()
    clock.now += 5
    assert not continuous.due(busy=False)  # committed, but too soon


def test_train_time_interval_options_are_checked_together() -> None:
    assert Cadence.of(None).interval is None
    assert Cadence.of(30).interval is not None and Cadence.of(30).auto is None
    auto = Cadence.of("auto", CadenceOptions(mtbf="4h", max_overhead=0.02))
    assert auto.auto == {"mtbf_s": 14400.0, "max_overhead": 0.02}
    assert auto.interval is not None and auto.interval.seconds == Cadence.AUTO_INITIAL_S
    built = auto.build_auto(nodes=2, history_mtbf_s=None)
    assert built is not None and built.job_mtbf_s == 7200.0
    assert Cadence.of("auto").auto == {"mtbf_s": None, "max_overhead": 0.01}
    assert Cadence.of("continuous", CadenceOptions(min_interval=5)).continuous is not None
    with pytest.raises(ConfigError, match="mtbf is used only"):
        Cadence.of(60, CadenceOptions(mtbf="4h"))
    continuous = Cadence.of("continuous", CadenceOptions(min_interval="5m")).continuous
    assert continuous is not None and continuous.min_interval_s == 300.0
    with pytest.raises(ConfigError, match="max_overhead is used only"):
        Cadence.of(60, CadenceOptions(max_overhead=0.01))  # the default value: meaningless here
    with pytest.raises(ConfigError, match="min_interval is used only"):
        Cadence.of("auto", CadenceOptions(min_interval=5))
    with pytest.raises(ConfigError, match='"auto" or "continuous"'):
        Cadence.of("hourly")
    with pytest.raises(ConfigError, match=r"cadence must be a CadenceOptions"):
        Cadence.of("auto", {"mtbf": "4h"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_overhead": 1.5}, "max_overhead must be a fraction"),
        ({"max_overhead": 0}, "max_overhead must be a fraction"),
        ({"mtbf": "soon"}, "mtbf must be a duration like '4h'"),
        ({"mtbf": -1}, "mtbf must be a duration"),
        ({"min_interval": "400d"}, r"min_interval .* \(at most a year\), got '400d'"),
    ],
)
def test_cadence_options_are_checked_when_built(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CadenceOptions(**options)


@pytest.mark.parametrize(
    ("given", "seconds"), [("30m", 1800.0), ("600", 600.0), ("1e3", 1000.0), (" 2h ", 7200.0)]
)
def test_train_time_interval_is_read_as_mtbf_and_min_interval_are(
    given: str, seconds: float
) -> None:
    """A string such as "30m" is a duration here too (YAML hands "1e3" over as a string);
    it used to be refused although mtbf="4h" and min_interval="5m" were accepted."""
    interval = Cadence.of(given).interval
    assert interval is not None and interval.seconds == seconds


def test_a_max_overhead_near_zero_waits_at_most_a_year() -> None:
    """5e-324 is a fraction in (0, 1): the overhead bound cost / max_overhead was infinite
    (a cadence of inf seconds, written to the run history as Infinity)."""
    cadence = AutoCadence(mtbf_s=None, nodes=1, max_overhead=5e-324)
    choice = cadence.observe(blocked_s=0.5, slowdown_s=0.0, write_s=1.0)
    assert choice.interval_s == MAX_SECONDS and choice.bound == "overhead"
