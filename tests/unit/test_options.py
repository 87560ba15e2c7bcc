"""Option checkers: the canonical value, or a ConfigError naming option, value and range."""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jsonargparse import ArgumentParser

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.observe.history import RunHistory
from lightning_elastic.core.options import (
    DEFAULT_TIMEOUT,
    MAX_COUNT,
    MAX_SECONDS,
    MIN_SECONDS,
    MonitoringOptions,
    TierOptions,
    check_bool,
    check_choice,
    check_count,
    check_node_id,
    check_number,
    check_seconds,
    check_signals,
    one_timeout,
)
from lightning_elastic.core.policy.cadence import AutoCadence, CadenceOptions, Continuous
from lightning_elastic.core.policy.retention import KeepBestK, KeepEveryNSteps, KeepLastN
from lightning_elastic.core.policy.triggers import EveryInterval, EveryNEpochs, EveryNSteps
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.storage.retry import RetryPolicy
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning.callback import DistributedCheckpoint
from lightning_elastic.lightning.data import ElasticSampler
from lightning_elastic.lightning.fsdp import ElasticFSDPStrategy
from lightning_elastic.lightning.strategy import ElasticStrategy
from lightning_elastic.lightning.streaming import ElasticShardedIterable


@pytest.mark.parametrize("value", [0, -1, 2.5, 2.0, "3", True, None, 2**62 + 1, 10**400])
def test_counts_are_integers_only(value) -> None:
    with pytest.raises(ConfigError, match=r"n must be an integer in \[1, 2\*\*62\], got"):
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


# ----------------------------------------------------------------------------- numeric options
#
# Every numeric option, wherever it is given, refuses what it cannot represent - 10**400 used to
# escape float() as an OverflowError - and NaN, infinities, negatives and bools, with a
# ConfigError naming the option, the value and the allowed range.


def _engine(**kw: Any) -> CheckpointEngine:
    root = kw.pop("root")
    return CheckpointEngine(root, coordinator=Coordinator.single_process(), **kw)


def _tiers(**kw: Any) -> TierOptions:
    return TierOptions("/dev/shm/never-written", **kw)


NUMERIC_OPTIONS: dict[str, Callable[[Any, Path], object]] = {
    "every_n_train_steps": lambda v, _: DistributedCheckpoint(every_n_train_steps=v),
    "every_n_epochs": lambda v, _: DistributedCheckpoint(every_n_epochs=v),
    "train_time_interval": lambda v, _: DistributedCheckpoint(train_time_interval=v),
    "mtbf": lambda v, _: CadenceOptions(mtbf=v),
    "max_overhead": lambda v, _: CadenceOptions(max_overhead=v),
    "min_interval": lambda v, _: CadenceOptions(min_interval=v),
    "keep_last_n": lambda v, _: DistributedCheckpoint(keep_last_n=v),
    "keep_best_k": lambda v, _: DistributedCheckpoint(keep_best_k=v, monitor="loss"),
    "metrics_port": lambda v, _: MonitoringOptions(metrics_port=v),
    "straggler_factor": lambda v, _: MonitoringOptions(straggler_factor=v),
    "straggler_window": lambda v, _: MonitoringOptions(straggler_window=v),
    "persist_every_n_saves": lambda v, _: _tiers(persist_every_n_saves=v),
    "replicas": lambda v, _: _tiers(replicas=v),
    "local_keep": lambda v, _: _tiers(local_keep=v),
    "checkpoint_timeout": lambda v, _: ElasticStrategy(checkpoint_timeout=v),
    "strategy timeout": lambda v, _: ElasticStrategy(timeout=v),
    "fsdp timeout": lambda v, _: ElasticFSDPStrategy(timeout=v),
    "global_batch_size": lambda v, _: ElasticStrategy(global_batch_size=v),
    "tensor_parallel_size": lambda v, _: ElasticFSDPStrategy(tensor_parallel_size=v),
    "data_parallel_size": lambda v, _: ElasticFSDPStrategy(data_parallel_size=v),
    "engine timeout": lambda v, root: _engine(root=root, timeout=v),
    "leftover_grace": lambda v, root: _engine(root=root, leftover_grace=v),
    "engine replicas": lambda v, root: _engine(root=root, local_root=root / "l", replicas=v),
    "KeepLastN": lambda v, _: KeepLastN(v),
    "KeepEveryNSteps": lambda v, _: KeepEveryNSteps(v),
    "KeepBestK": lambda v, _: KeepBestK(v, "loss"),
    "EveryNSteps": lambda v, _: EveryNSteps(v),
    "EveryNEpochs": lambda v, _: EveryNEpochs(v),
    "EveryInterval": lambda v, _: EveryInterval(v),
    "Continuous": lambda v, _: Continuous(v),
    "AutoCadence.mtbf_s": lambda v, _: AutoCadence(mtbf_s=v, nodes=1),
    "AutoCadence.nodes": lambda v, _: AutoCadence(mtbf_s=3600.0, nodes=v),
    "AutoCadence.window": lambda v, _: AutoCadence(mtbf_s=3600.0, nodes=1, window=v),
    "RetryPolicy.deadline_s": lambda v, _: RetryPolicy(deadline_s=v),
    "RetryPolicy.max_attempts": lambda v, _: RetryPolicy(max_attempts=v),
    "RetryPolicy.initial_backoff_s": lambda v, _: RetryPolicy(initial_backoff_s=v),
    "RetryPolicy.max_backoff_s": lambda v, _: RetryPolicy(max_backoff_s=v),
    "RetryPolicy.multiplier": lambda v, _: RetryPolicy(multiplier=v),
    "progress_every_s": lambda v, root: RunHistory(
        Storage(str(root)), run_id="r", progress_every_s=v
    ),
    "num_replicas": lambda v, _: ElasticSampler(range(4), num_replicas=v),
    "rank": lambda v, _: ElasticSampler(range(4), num_replicas=2, rank=v),
    "batch_size": lambda v, _: ElasticSampler(range(4), batch_size=v),
    "samples_per_shard": lambda v, _: ElasticShardedIterable(["a"], [v], lambda *a: []),
    "seed": lambda v, _: ElasticSampler(range(4), seed=v),
}
# in the message: what each option is called there
_CALLED = {
    "engine timeout": "timeout",
    "strategy timeout": "timeout",
    "fsdp timeout": "timeout",
    "engine replicas": "replicas",
    "KeepLastN": "keep_last_n",
    "KeepEveryNSteps": "keep_every_n_steps",
    "KeepBestK": "keep_best_k",
    "EveryNSteps": "every_n_train_steps",
    "EveryNEpochs": "every_n_epochs",
    "EveryInterval": "train_time_interval",
    "Continuous": "min_interval",
    "AutoCadence.mtbf_s": "mtbf",
    "AutoCadence.nodes": "nodes",
    "AutoCadence.window": "window",
    "samples_per_shard": "samples_per_shard of a",
}
ABSURD = {
    "1e400": 10**400,
    "-1e400": -(10**400),
    "nan": float("nan"),
    "inf": float("inf"),
    "-inf": float("-inf"),
    "bool": True,
    "-1": -1,  # but for a seed: torch takes any signed 64-bit one
}


@pytest.mark.parametrize(
    ("option", "value"),
    [
        pytest.param(option, value, id=f"{option}-{label}")
        for option in sorted(NUMERIC_OPTIONS)
        for label, value in ABSURD.items()
        if (option, label) != ("seed", "-1")
    ],
)
def test_every_numeric_option_refuses_values_it_cannot_represent(
    option: str, value: Any, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        NUMERIC_OPTIONS[option](value, tmp_path)
    message = str(info.value)
    assert f"{_CALLED.get(option, option)} must be " in message
    assert repr(value)[:20] in message, message  # the value (10**400 shortened)
    assert re.search(r" (in [\[(]\S+, \S+[\])]|>=? \S+)", message), message  # the range


def test_the_value_of_a_duration_string_is_named_as_written() -> None:
    with pytest.raises(ConfigError, match=r"mtbf must be a duration .* got '1e400h' \(str\)"):
        CadenceOptions(mtbf="1e400h")
    with pytest.raises(ConfigError, match=r"min_interval .* \(at most a year\), got '400d'"):
        CadenceOptions(min_interval="400d")


def test_numbers_at_the_edges_of_their_ranges() -> None:
    assert check_count(MAX_COUNT, "n") == MAX_COUNT
    assert check_count(np.int64(3), "n") == 3 and type(check_count(np.int64(3), "n")) is int
    assert check_seconds(MAX_SECONDS, "t") == MAX_SECONDS
    assert check_seconds(MIN_SECONDS, "t") == MIN_SECONDS
    assert check_seconds(0, "t", zero=True) == 0.0
    assert check_seconds(np.float32(0.5), "t") == 0.5
    for refused in (MAX_SECONDS * 1.000001, MIN_SECONDS / 2, timedelta.max, timedelta(0)):
        with pytest.raises(ConfigError, match="t must be a duration"):
            check_seconds(refused, "t")
    assert check_number(0.5, "f", low=0, high=1, low_open=True, high_open=True) == 0.5
    with pytest.raises(ConfigError, match=r"f must be a number in \(0, 1\), got 1 \(int\)"):
        check_number(1, "f", low=0, high=1, low_open=True, high_open=True)
    # a node's MTBF may exceed a year (the job's is over the nodes): up to a century
    assert AutoCadence(mtbf_s="5000d", nodes=1).mtbf_s == 5000 * 86400.0
    year = timedelta(days=365)
    assert ElasticStrategy(checkpoint_timeout=year).checkpoint_timeout == year


def test_numbers_of_any_numeric_type_are_kept_as_plain_ints_and_floats() -> None:
    """Numpy scalars, Fraction and Decimal are numbers like any other (a Decimal used to be
    refused as not "a fraction in (0, 1)", a message that made 0.5 look out of range), and
    what an option keeps is a plain int or float: a Decimal kept by RetryPolicy would not
    add to a float, and a numpy int kept by the sampler went into the data position."""
    policy = RetryPolicy(
        deadline_s=Decimal("2.5"),
        max_attempts=np.int64(3),
        initial_backoff_s=Fraction(1, 20),
        max_backoff_s=np.float32(0.5),
        multiplier=Decimal(2),
    )
    kept = (
        policy.deadline_s,
        policy.max_attempts,
        policy.initial_backoff_s,
        policy.max_backoff_s,
        policy.multiplier,
    )
    assert kept == (2.5, 3, 0.05, 0.5, 2.0)
    assert [type(v) for v in kept] == [float, int, float, float, float]
    for policy_n in (KeepLastN(np.int64(2)).n, KeepEveryNSteps(np.int64(2)).n):
        assert type(policy_n) is int
    assert type(KeepBestK(np.int64(2), "loss").k) is int
    assert type(EveryNSteps(np.int64(5)).n) is int and type(EveryNEpochs(np.uint8(5)).n) is int
    sampler = ElasticSampler(range(8), num_replicas=np.int64(2), rank=np.int64(1))
    position = sampler.position(1)
    assert type(position.world_size) is int and type(position.consumed) is int
    assert type(ElasticStrategy(global_batch_size=np.int64(8)).global_batch_size) is int
    auto = DistributedCheckpoint(
        train_time_interval="auto", cadence=CadenceOptions(max_overhead=Decimal("0.05"))
    )
    assert auto._schedule.cadence.auto == {"mtbf_s": None, "max_overhead": 0.05}
    assert check_seconds(Decimal("1.5"), "t") == 1.5
    for refused in (Decimal("NaN"), Decimal("sNaN"), Decimal("1e400"), Decimal("-1")):
        with pytest.raises(ConfigError, match=r"t must be a duration .* got Decimal"):
            check_seconds(refused, "t")
    with pytest.raises(ConfigError, match=r"n must be an integer in \[1, 2\*\*62\], got Decimal"):
        check_count(Decimal(3), "n")  # as 3.0 is: a count is an int


def test_negative_zero_is_kept_as_zero() -> None:
    for seconds in (
        check_seconds(-0.0, "t", zero=True),
        check_seconds(Decimal("-0"), "t", zero=True),
    ):
        assert seconds == 0.0 and math.copysign(1.0, seconds) == 1.0
    with pytest.raises(ConfigError, match=r"t must be a duration .* got -0.0"):
        check_seconds(-0.0, "t")  # no zero allowed: -0.0 is none either


def test_the_process_group_timeout_is_a_duration_like_the_others() -> None:
    """It went to Lightning unchecked: True, "10", 10**400 or a timedelta of a million days
    were accepted and failed (or overflowed) only when the process group was created."""
    # Lightning's DDPStrategy and ModelParallelStrategy keep it as _timeout
    assert ElasticStrategy(timeout=600)._timeout == timedelta(minutes=10)
    assert ElasticFSDPStrategy(timeout=timedelta(hours=1))._timeout == timedelta(hours=1)
    assert ElasticStrategy(timeout=None)._timeout is None
    with pytest.raises(ConfigError, match=r"timeout must be a duration .* \(at most a year\)"):
        ElasticStrategy(timeout=timedelta(days=10**6))


def test_yaml_values_reach_the_options_as_lightning_cli_hands_them_over() -> None:
    """LightningCLI parses the config with jsonargparse: quoted numbers, YAML 1.1's "1e3" (a
    string there) and durations like "30m" must mean what they say, and an absurd value must
    still be refused by the option, naming it and its range."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(DistributedCheckpoint, "checkpoint")
    parser.add_class_arguments(ElasticStrategy, "strategy")
    config = parser.parse_string(
        """
checkpoint:
  keep_last_n: "10"
  every_n_train_steps: 1_000
  train_time_interval: 30m
strategy:
  timeout: 600
  checkpoint_timeout: "1e3"
  global_batch_size: "64"
"""
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # < 4.49
    init = instantiate(config)
    callback, strategy = init.checkpoint, init.strategy
    assert callback.retention == (KeepLastN(10),)
    assert callback._schedule.step_trigger == EveryNSteps(1000)
    assert callback._schedule.cadence.interval.seconds == 1800.0
    assert strategy.checkpoint_timeout == 1000.0  # a number, not the string YAML gave
    assert strategy._timeout == timedelta(minutes=10)
    assert strategy.global_batch_size == 64
    for option, value in (
        ("checkpoint.keep_last_n", "0"),
        ("strategy.checkpoint_timeout", "1e400"),
        ("checkpoint.train_time_interval", "400d"),
    ):
        group, option = option.split(".")
        bad = parser.parse_string(f"{group}:\n  {option}: {value}\n")
        with pytest.raises(ConfigError, match=rf"{option} must be .* (in|>=) "):
            instantiate(bad)


# ----------------------------------------------------------------------------- node ids


@pytest.mark.parametrize(
    "node",
    [
        ".",
        "..",
        "a/b",
        "",
        "n" * 256,
        "node\u202e1",  # RIGHT-TO-LEFT OVERRIDE: "node1" shown as "node" + reversed tail
        *[f"n{c}1" for c in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069"],
        "a\u200bb",  # zero-width space: looks like "ab"
        "a\x00b",
        "a\tb",
        "a\x7fb",
        "a\nb",
        7,
    ],
)
def test_node_ids_that_are_path_components_or_hold_controls_are_refused(node: Any) -> None:
    with pytest.raises(ConfigError, match=r"node must be a non-empty UTF-8 name") as info:
        check_node_id(node)
    assert str(info.value).isascii()  # the message shows the id escaped: it cannot lie either
    with pytest.raises(ConfigError):
        TierOptions("/dev/shm/x", node=node)


@pytest.mark.parametrize(
    "node", ["node-1", "gpu017.cluster", "ümlaut node", "a\\b", "n" * 255, "..a"]
)
def test_ordinary_node_ids_are_accepted(node: str) -> None:
    assert check_node_id(node) == node
