"""Planned-exit markers and the launcher's rule for a restart that keeps the failure budget."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_elastic.core.elastic.planned_exit import (
    PLANNED_EXIT_ENV,
    read_planned_exit,
    record_planned_exit,
)
from lightning_elastic.launcher import PlannedExitAgent


def failures(*pairs: tuple[int, int]) -> SimpleNamespace:
    return SimpleNamespace(
        failures={
            rank: SimpleNamespace(pid=pid, exitcode=code) for rank, (pid, code) in enumerate(pairs)
        }
    )


def test_no_launcher_no_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLANNED_EXIT_ENV, raising=False)
    assert record_planned_exit(143, 7) is None


def test_marker_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLANNED_EXIT_ENV, str(tmp_path))
    path = record_planned_exit(143, 7)
    assert path == tmp_path / f"{os.getpid()}.json"
    assert read_planned_exit(tmp_path, os.getpid()) == {
        "pid": os.getpid(),
        "exitcode": 143,
        "step": 7,
    }
    assert read_planned_exit(tmp_path, 1) is None
    (tmp_path / "2.json").write_text("{not json")
    assert read_planned_exit(tmp_path, 2) is None


def test_only_a_group_whose_every_failure_left_a_matching_marker_is_planned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PLANNED_EXIT_ENV, str(tmp_path))
    record_planned_exit(143, 5, pid=11)
    record_planned_exit(138, 5, pid=12)
    planned = PlannedExitAgent._planned
    assert planned(failures((11, 143), (12, 138)))
    assert not planned(failures((11, 143), (13, 143))), "a worker without a marker crashed"
    assert not planned(failures((11, -9))), "killed after writing the marker: not planned"
    assert not planned(failures()), "no failure reported"
    monkeypatch.delenv(PLANNED_EXIT_ENV)
    assert not planned(failures((11, 143))), "not launched by lightning-elastic run"
