"""Sixth hostile review of multi-tier checkpoints: the spare pool's trim after each save
(``SparePool.trim``, ``TierSet._size_spares``) and how a transfer call raises when both of
its directions crash (``transfer._raise_crash``). One process each: hand-made pools and
lanes, and a one-process tiered engine."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.storage.local import SPARE_MIN_BYTES, LocalStorage
from lightning_elastic.core.tiers import transfer
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed.tier_engine_workers import load_latest, save_steps

MIB = SPARE_MIN_BYTES


def plant(pool: Path, name: str, size: int) -> Path:
    pool.mkdir(parents=True, exist_ok=True)
    path = pool / f"{name}.spare"
    path.write_bytes(b"\xee" * size)
    return path


def undeletable_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a ``*.spare`` file fails with EPERM (a file made immutable, a pool folder of
    another owner): everything else deletes as usual."""
    real = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path).endswith(".spare"):
            raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


# ----------------------------------------------------------------------------- trim


def test_a_spare_trim_cannot_delete_stays_counted_and_the_others_go(tmp_path) -> None:
    """The largest spare turns into a folder between trim's listing and its delete (another
    process took it and planted one): trim does not raise, counts what it could not delete,
    and deletes the next largest until the pool fits."""
    storage = Storage(str(tmp_path / "root"))
    assert isinstance(storage, LocalStorage)
    pool = storage.keep_spares()
    folder = Path(pool.directory)
    big = plant(folder, "big", 5 * MIB)
    plant(folder, "mid", 3 * MIB)
    plant(folder, "small", 2 * MIB)
    listed = pool._spares

    def racing() -> list[tuple[int, str]]:
        out = listed()
        big.unlink()
        big.mkdir()  # a folder where the listing saw the largest spare
        return out

    pool._spares = racing  # type: ignore[method-assign]
    pool.trim(8 * MIB)
    assert sorted(p.name for p in folder.iterdir()) == ["big.spare", "small.spare"]
    assert big.is_dir()


def test_a_spare_that_cannot_be_deleted_fails_no_save_and_retention_goes_on(
    tmp_path, monkeypatch
) -> None:
    """A killed run left spares larger than a save writes, and they cannot be deleted: the
    trim after each save used to raise out of the save's background part on the node's lead,
    so every save failed after its commit, local retention never ran again (the node-local
    tier in /dev/shm grew with every save) and nothing was persisted; close raised too."""
    local = tmp_path / "local"
    for i in range(3):
        plant(local / ".spares", f"killed{i}", 8 * MIB)
    undeletable_spares(monkeypatch)
    eng = CheckpointEngine(
        tmp_path / "persistent",
        local_root=local,
        async_save=False,
        persist_every_n_saves=2,
    )
    with eng:
        for step in range(1, 6):
            state = {"w": torch.arange(1 << 19, dtype=torch.float32) + step, "step": step}
            eng.save(state, step=step).result()
        eng.wait()
    kept = sorted(n for n in os.listdir(local) if n.startswith("step_"))
    assert kept == ["step_000000004", "step_000000005"]
    persisted = sorted(n for n in os.listdir(tmp_path / "persistent") if n.startswith("step_"))
    # step 4 persists unless step 2 still uploads then (the next save persists instead)
    assert persisted in (
        ["step_000000002", "step_000000004"],
        ["step_000000002", "step_000000005"],
    ), persisted


# ----------------------------------------------------------------------------- crashes


def lanes(sending: BaseException | None, receiving: BaseException | None) -> list[Any]:
    return [
        SimpleNamespace(crashed=sending, sending=True),
        SimpleNamespace(crashed=receiving, sending=False),
    ]


class NoNotes(Exception):
    """An exception whose ``__notes__`` is not a list: ``add_note`` raises TypeError."""

    @property
    def __notes__(self) -> tuple[str, ...]:  # type: ignore[override]
        return ()


class BadRepr(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("repr failed")


@pytest.mark.parametrize(
    ("sent", "received"),
    [
        (NoNotes("sending broke"), RuntimeError("receiving broke")),
        (RuntimeError("sending broke"), BadRepr("receiving broke")),
    ],
    ids=["add_note-fails", "repr-fails"],
)
def test_the_sending_crash_is_raised_even_when_naming_the_other_fails(
    sent: BaseException, received: BaseException, caplog
) -> None:
    """Naming the receiving direction's crash in a note of the sending one's failed (an
    exception that takes no notes, or whose repr raises): the note's TypeError/RuntimeError
    was raised instead, and the sending direction's crash was lost."""
    with caplog.at_level(logging.ERROR), pytest.raises(BaseException) as info:
        transfer._raise_crash(lanes(sent, received))
    assert info.value is sent
    assert any(r.exc_info and r.exc_info[1] is received for r in caplog.records)


def test_one_exception_in_both_directions_is_raised_once_without_a_note(caplog) -> None:
    crash = KeyboardInterrupt()
    with caplog.at_level(logging.ERROR), pytest.raises(KeyboardInterrupt) as info:
        transfer._raise_crash(lanes(crash, crash))
    assert info.value is crash
    assert not getattr(crash, "__notes__", [])
    assert not caplog.records


def test_an_interrupt_in_the_receiving_direction_is_named_and_logged(caplog) -> None:
    """A BaseException in the other direction is logged with its traceback and named."""
    sent, received = RuntimeError("sending broke"), KeyboardInterrupt("receiving")
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as info:
        transfer._raise_crash(lanes(sent, received))
    assert info.value is sent
    assert info.value.__notes__ == [
        "the receiving direction crashed too: KeyboardInterrupt('receiving')"
    ]
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [received]


# ----------------------------------------------------------------------------- world size


@pytest.mark.timeout(180)
def test_a_changed_world_size_with_a_shard_on_no_node_reads_it_from_the_persistent_tier(
    tmp_path,
) -> None:
    """Issue 11 (2): a changed world size recovers from the persistent tier where no node
    holds every shard. Without replicas node b's shard was on b alone, and b is gone: 3 ranks
    on a, a and a fresh b read b's old shard from the persistent tier; then 1 rank on node a
    alone (b's copy may now be on b only) recovers the same step."""
    run_distributed(save_steps, 2, str(tmp_path), ["a", "b"], [1, 2, 3], per_rank=False, replicas=0)
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(
        load_latest, 3, str(tmp_path), ["a", "a", "b"], per_rank=False, replicas=0
    )
    assert [(g["step"], g["w_ok"]) for g in got] == [(3, True)] * 3, got
    assert {g["recovery"]["plan_tier"] for g in got} == {"persistent"}, got
    assert sum(g["recovery"]["bytes"]["persistent"] for g in got) > 0, got
    shutil.rmtree(tmp_path / "local_b")
    (one,) = run_distributed(load_latest, 1, str(tmp_path), ["a"], per_rank=False, replicas=0)
    assert one["step"] == 3 and one["w_ok"], one
