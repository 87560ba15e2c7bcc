"""Lazy snapshots and incremental checkpoints together under Lightning (the callback's default
``snapshot="lazy"`` with ``full_every_n_saves``), in one process: the incremental selection
hashes the staged bytes after the lazy copy, so every checkpoint of a chain is bitwise the one
a blocking, full save takes, resumes bitwise, and a save given up by the version counters
makes the next one full, never a reference to bytes that were not committed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_elastic import DistributedCheckpoint
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.errors import SnapshotFallbackWarning
from tests.lightning import test_lazy_snapshot as lazy_tests
from tests.lightning.models import make_trainer
from tests.lightning.test_lazy_snapshot import CASES, STEPS, Net, assert_bitwise, checkpoints

slow_copy = lazy_tests.slow_copy  # the fixture: every lazy copy waits for a guard

pytestmark = pytest.mark.timeout(180)


class FrozenNet(Net):
    """Net behind a frozen projection: its weight is the same at every save (referred to)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def loss(self, batch: Any) -> torch.Tensor:
        _, x, y = batch
        return super().loss((None, self.frozen(x), y))


def fit(root: Path, case: str, snapshot: str, max_steps: int, every: int | None, **net: Any):
    trainer_kwargs, net_kwargs, _ = CASES[case]
    pl.seed_everything(3, verbose=False)
    model = FrozenNet(**net_kwargs, **net)
    checkpoint = DistributedCheckpoint(
        root / "ckpts",
        every_n_train_steps=2,
        snapshot=snapshot,
        save_on_train_end=False,
        full_every_n_saves=every,
    )
    trainer = make_trainer(
        str(root),
        max_steps=max_steps,
        strategy="auto",
        devices=1,
        callbacks=[checkpoint],
        **trainer_kwargs,
    )
    trainer.fit(model)
    return model


def references(root: Path) -> dict[str, frozenset[str]]:
    out = {}
    for d in sorted((root / "ckpts").iterdir()):
        if (d / MANIFEST_FILE).exists():
            m = Manifest.from_json((d / MANIFEST_FILE).read_bytes(), d.name)
            out[d.name] = m.referenced_checkpoints
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_lazy_incremental_checkpoints_are_the_blocking_full_ones_and_resume_bitwise(
    tmp_path, slow_copy, case
) -> None:
    reference = fit(tmp_path / "blocking", case, "blocking", STEPS, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotFallbackWarning)
        fit(tmp_path / "lazy", case, "lazy", CASES[case][2], 8)
        assert slow_copy
        resumed = fit(tmp_path / "lazy", case, "lazy", STEPS, 8)
    refs = references(tmp_path / "lazy")
    assert any(refs.values()), refs  # the chain really referred to something
    blocking, lazy = checkpoints(tmp_path / "blocking"), checkpoints(tmp_path / "lazy")
    assert sorted(lazy) == sorted(blocking) == [2, 4, 6]
    for step in lazy:
        assert_bitwise(lazy[step], blocking[step], f"step {step}")
    assert_bitwise(resumed.state_dict(), reference.state_dict(), "after resume")


def test_a_given_up_lazy_save_makes_the_next_incremental_save_full(tmp_path, slow_copy) -> None:
    fit(tmp_path / "blocking", "plain", "blocking", STEPS + 2, None, poke_at=4)
    with pytest.warns(SnapshotFallbackWarning):
        fit(tmp_path / "lazy", "plain", "lazy", STEPS + 2, 8, poke_at=4)
    refs = references(tmp_path / "lazy")
    names = sorted(refs)
    assert len(names) == 3  # steps 2, 6, 8: step 4's was given up
    assert refs[names[1]] == frozenset()  # after the failure: full
    blocking, lazy = checkpoints(tmp_path / "blocking"), checkpoints(tmp_path / "lazy")
    for step in lazy:
        assert_bitwise(lazy[step], blocking[step], f"step {step}")
    assert sorted(lazy) == [2, 6, 8]
