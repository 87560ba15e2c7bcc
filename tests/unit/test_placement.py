"""The seam between the engine and where checkpoints live (core/placement/), in one process: a
recording placement driving the engine, and one root and tiers behind the same calls."""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

import pytest
import torch

from lightning_elastic import CheckpointEngine, ConfigError
from lightning_elastic.core import engine as engine_module
from lightning_elastic.core.format.catalog import CheckpointInfo
from lightning_elastic.core.load.walk import Filters, LoadRequest, Retry, Selected
from lightning_elastic.core.placement import SingleRoot, Tiered, make_placement
from lightning_elastic.core.save.request import RunState, SaveConfig, SaveResult
from tests.unit.test_engine import assert_same, make_state, template


class Recording(SingleRoot):
    """One root, noting every call the engine makes (and on which thread); ``persist``: what
    :meth:`decide` answers."""

    persist = False
    save_metadata: Mapping[str, Any] = MappingProxyType({"placed_by": "recording"})

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[str] = []
        self.finished: list[tuple[str, bool]] = []

    def decide(self, force: bool) -> bool:
        self.calls.append(f"decide({force})")
        return self.persist or force

    def finish(self, planned, payload, blocked_s, staging_s, persist) -> SaveResult:  # type: ignore[no-untyped-def]
        self.calls.append("finish")
        self.finished.append((threading.current_thread().name, persist))
        return super().finish(planned, payload, blocked_s, staging_s, persist)

    def select(self, request: LoadRequest, excluded: Collection[str]) -> Selected | Retry | None:
        self.calls.append("select")
        return super().select(request, excluded)

    def loaded(self, selected: Selected, seconds: float) -> None:
        self.calls.append(f"loaded({selected.info.name})")

    def newest(self, filters: Filters, verify: str) -> CheckpointInfo | None:
        self.calls.append("newest")
        return super().newest(filters, verify)

    def take_over(self, *, renew: bool = False) -> None:
        self.calls.append("take_over")
        super().take_over(renew=renew)

    def persist_latest(self) -> bool:
        self.calls.append("persist_latest")
        return False

    def wait(self) -> None:
        self.calls.append("wait")

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def recording(monkeypatch) -> list[Recording]:
    """Every engine made meanwhile gets a :class:`Recording` placement (listed here)."""
    made: list[Recording] = []

    def make(root, catalog, coordinator, config, run, **tiers: Any) -> Recording:
        assert not tiers
        placed = make_placement(root, catalog, coordinator, config, run)
        made.append(Recording(placed.target, run))
        return made[-1]

    monkeypatch.setattr(engine_module, "make_placement", make)
    return made


def test_the_engine_reaches_where_checkpoints_live_only_through_its_placement(
    tmp_path, recording
) -> None:
    with CheckpointEngine(tmp_path / "ckpts") as eng:
        (placed,) = recording
        eng.save(make_state(1), step=1).result()
        eng.wait()
        state = template()
        eng.load(state)
        assert eng.latest() is not None
        eng.take_over()
        assert not eng.persist_latest()
        assert eng.load_storage is placed.target.storage and eng.arena is placed.target.arena
        assert not eng.multi_tier and eng.last_recovery is None
    assert_same(state, make_state(1))
    assert placed.calls == [
        "decide(False)",
        "finish",
        "wait",  # eng.wait()
        "wait",  # load waits for the save (and persist) in flight
        "select",
        "loaded(step_000000001)",
        "newest",
        "take_over",
        "wait",  # persist_latest waits first
        "persist_latest",
        "wait",  # close
        "close",
    ]
    assert placed.finished == [("lightning-elastic-writer_0", False)]


def test_what_the_placement_decides_reaches_its_finish_and_its_metadata_the_manifest(
    tmp_path, recording
) -> None:
    with CheckpointEngine(tmp_path / "ckpts", async_save=False) as eng:
        (placed,) = recording
        placed.persist = True
        result = eng.save({"w": torch.ones(2)}, step=3).result()
        eng.save({"w": torch.ones(2)}, step=4, persist=True)
    assert placed.calls[:4] == ["decide(False)", "finish", "decide(True)", "finish"]
    assert [persist for _, persist in placed.finished] == [True, True]
    assert placed.finished[0][0] == threading.current_thread().name  # a blocking save: inline
    assert result.manifest is not None
    assert result.manifest.metadata["placed_by"] == "recording"


@pytest.mark.parametrize("tiered", [False, True], ids=["single_root", "tiered"])
def test_one_root_and_tiers_serve_the_same_engine_calls(tmp_path, tiered) -> None:
    """Save, list, latest, load: the same answers whichever placement holds the checkpoints
    (tiers in one process: one node, no peers)."""
    tiers = {"local_root": tmp_path / "local", "node": "n0"} if tiered else {}
    with CheckpointEngine(tmp_path / "ckpts", **tiers) as eng:
        assert isinstance(eng._placement, Tiered if tiered else SingleRoot)
        assert eng.multi_tier == tiered
        for step in (1, 2):
            eng.save(make_state(step), step=step, persist=True).result()
        eng.wait()
        latest = eng.latest()
        assert latest is not None and latest.name == "step_000000002"
        state = template()
        eng.load(state)
        assert eng.resumed_from == "step_000000002"
        assert [i.name for i in eng.list()] == ["step_000000001", "step_000000002"]
        root = (tmp_path / "local") if tiered else (tmp_path / "ckpts")
        assert eng.load_storage.display() == str(root)
        assert (eng.last_recovery is not None) == tiered
    assert_same(state, make_state(2))


def test_the_tiered_placement_writes_both_roots_and_marks_its_saves(tmp_path) -> None:
    with CheckpointEngine(tmp_path / "ckpts", local_root=tmp_path / "local", node="n0") as eng:
        placement = eng._placement
        assert [r.display() for r in placement.roots] == [
            str(tmp_path / "ckpts"),
            str(tmp_path / "local"),
        ]
        result = eng.save({"w": torch.ones(2)}, step=1).result()
        assert result.manifest is not None
        assert result.manifest.metadata["tier_persistent_root"] == str(tmp_path / "ckpts")


# ----------------------------------------------------------------------------- configuration


def test_save_options_are_validated_when_the_config_is_made() -> None:
    with pytest.raises(ConfigError, match="timeout must be positive, got 0:00:00"):
        SaveConfig(timeout_s=0.0)
    with pytest.raises(ConfigError, match="leftover_grace must be >= 0"):
        SaveConfig(leftover_grace_s=-1.0)
    with pytest.raises(ConfigError, match="compression must be one of"):
        SaveConfig(compression="lz4")
    with pytest.raises(ConfigError, match="unknown checksum algorithm"):
        SaveConfig(checksum="md4")
    with pytest.raises(AttributeError):  # frozen
        SaveConfig().timeout_s = 1.0  # type: ignore[misc]


def test_the_run_state_moves_the_lineage_and_keeps_what_it_protects() -> None:
    run = RunState("a")
    assert run.loaded("step_1", adopt="b")  # the run changed
    assert (run.run_id, run.resumed_from, run.parent) == ("b", "step_1", "step_1")
    assert not run.loaded("step_1", adopt="b") and not run.loaded("step_1")
    run.committed("step_2")
    assert (run.resumed_from, run.parent) == ("step_1", "step_2")
    run.protect("step_2")
    frozen = run.protected
    run.release("step_2")
    assert frozen == {"step_1", "step_2"} and run.protected == {"step_1"}
    run.raise_floor([3, 9, 4])
    run.raise_floor([5])
    assert run.sequence_floor == 9
    run.reserve(["x"])
    run.reserve(["y"])
    assert run.reserved_names == {"x", "y"}
