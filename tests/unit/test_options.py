"""Option checkers: the canonical value, or a ConfigError naming option, value and range."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest

from lightning_elastic.core.options import (
    DEFAULT_TIMEOUT,
    check_bool,
    check_choice,
    check_count,
    check_seconds,
    check_signals,
    one_timeout,
)
from lightning_elastic.core.policy.retention import KeepBestK, KeepLastN
from lightning_elastic.core.policy.triggers import EveryInterval, EveryNSteps
from lightning_elastic.errors import ConfigError


@pytest.mark.parametrize("value", [0, -1, 2.5, 2.0, "3", True, None])
def test_counts_are_integers_only(value) -> None:
    with pytest.raises(ConfigError, match=r"n must be an integer >= 1, got"):
        check_count(value, "n")


def test_count_message_names_the_type() -> None:
    with pytest.raises(ConfigError, match=r"got 2\.5 \(float\)"):
        check_count(2.5, "every_n_train_steps")
    assert check_count(3, "n") == 3 and check_count(0, "n", minimum=0) == 0


@pytest.mark.parametrize("value", ["yes", 1, 0, None])
def test_bools_are_bools(value) -> None:
    with pytest.raises(ConfigError, match="must be True or False"):
        check_bool(value, "flag")


def test_choices() -> None:
    assert check_choice(None, "compression", (None, "zstd")) is None
    with pytest.raises(ConfigError, match="one of None, 'zstd', got 'lz4'"):
        check_choice("lz4", "compression", (None, "zstd"))


@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf"), "60", True, timedelta(0)])
def test_seconds_refused(value) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        check_seconds(value, "timeout")


def test_seconds_accepted() -> None:
    assert check_seconds(timedelta(minutes=1), "t") == 60.0
    assert check_seconds(1.5, "t") == 1.5


def test_signals() -> None:
    assert check_signals("term") == (int(signal.SIGTERM),)
    assert check_signals("SIGTERM,SIGUSR1") == (int(signal.SIGTERM), int(signal.SIGUSR1))
    assert check_signals(int(signal.SIGUSR2)) == (int(signal.SIGUSR2),)
    assert check_signals(None) == () and check_signals("") == ()
    with pytest.raises(ConfigError, match="unknown signal 'S'"):
        check_signals(["S"])
    with pytest.raises(ConfigError, match="unknown signal 99999"):
        check_signals([99999])


def test_one_timeout() -> None:
    assert one_timeout(a=None, b=None) == DEFAULT_TIMEOUT
    assert one_timeout(a=None, b=30) == timedelta(seconds=30)
    assert one_timeout(a=timedelta(seconds=30), b=30.0) == timedelta(seconds=30)
    with pytest.raises(ConfigError, match="a=30s, b=60s"):
        one_timeout(a=30, b=60)


def test_policies_use_the_checkers() -> None:
    with pytest.raises(ConfigError, match="every_n_train_steps must be an integer"):
        EveryNSteps(2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keep_last_n must be an integer"):
        KeepLastN("2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mode must be one of"):
        KeepBestK(1, "loss", "avg")
    with pytest.raises(ConfigError, match="train_time_interval"):
        EveryInterval(float("nan"))
