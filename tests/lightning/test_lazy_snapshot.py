"""Lazy snapshots under Lightning, in one process: checkpoints taken while the next step's
forward and backward run are bitwise the blocking ones, and resume bitwise, with plain
training, gradient accumulation and manual optimization with two optimizers; an in-place
update outside the optimizer step costs one save and one warning, never a mixed checkpoint.

Every lazy copy is held back until the training thread reaches a guard (``slow_copy``), so
each optimizer step after a save really waits for it: without the guard the version counters
would give the save up.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_elastic import CheckpointEngine, DistributedCheckpoint
from lightning_elastic.core.save.snapshot import LazySnapshot
from lightning_elastic.errors import SnapshotFallbackWarning
from tests.lightning.models import IdDataset, make_trainer

pytestmark = pytest.mark.timeout(120)

STEPS = 6


class Net(pl.LightningModule):
    """Linear-BatchNorm-Linear, AdamW with a per-step StepLR (automatic), or two SGD
    optimizers with momentum, one per half (manual)."""

    def __init__(self, manual: bool = False, poke_at: int = -1, poke_state_at: int = -1) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.poke_at = poke_at
        self.poke_state_at = poke_state_at
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        self.head = torch.nn.Linear(16, 1)

    def loss(self, batch: Any) -> torch.Tensor:
        _, x, y = batch
        return torch.nn.functional.mse_loss(self.head(torch.relu(self.body(x))), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.global_step == self.poke_at:  # a user's in-place update, outside the step
            with torch.no_grad():
                self.head.bias.mul_(1.0)
        if self.global_step == self.poke_state_at:  # the same, of the optimizer's state
            optimizer = self.optimizers().optimizer  # type: ignore[union-attr]
            optimizer.state[self.head.bias]["exp_avg"].mul_(1.0)
        if self.automatic_optimization:
            return self.loss(batch)
        first, second = self.optimizers()  # type: ignore[misc]
        loss = self.loss(batch)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return None

    def configure_optimizers(self) -> Any:
        if not self.automatic_optimization:
            return [
                torch.optim.SGD(self.body.parameters(), lr=0.05, momentum=0.9),
                torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9),
            ]
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(32), batch_size=4, shuffle=True)


@pytest.fixture
def slow_copy(monkeypatch) -> list[int]:
    """Every lazy copy starts only once the training thread reached a guard (or after 2 s,
    when none comes): the latest the guard allows. The list counts the lazy copies made."""
    run, wait = LazySnapshot.run, LazySnapshot.wait
    made: list[int] = []

    def reached(snapshot: LazySnapshot) -> threading.Event:
        return snapshot.__dict__.setdefault("_reached", threading.Event())

    def late(self: LazySnapshot) -> None:
        reached(self).wait(2.0)
        run(self)
        made.append(1)

    def guard(self: LazySnapshot) -> float:
        reached(self).set()
        return wait(self)

    monkeypatch.setattr(LazySnapshot, "run", late)
    monkeypatch.setattr(LazySnapshot, "wait", guard)
    return made


# name: (trainer kwargs, model kwargs, the step the first lazy run stops after: its last save
# is the one the second resumes from). Accumulating, it stops at step 3 and resumes from 2,
# mid-epoch: a resume from step 4, the epoch's last batch, after a fit that max_steps ended
# there, is not bitwise even with blocking snapshots (reported; not a snapshot matter)
CASES = {
    "plain": ({}, {}, 4),
    "accumulate-2": ({"accumulate_grad_batches": 2}, {}, 3),
    "manual-two-optimizers": ({}, {"manual": True}, 4),
}


def fit(root: Path, case: str, snapshot: str, max_steps: int, **net: Any) -> Net:
    trainer_kwargs, net_kwargs, _ = CASES[case]
    pl.seed_everything(3, verbose=False)
    model = Net(**net_kwargs, **net)
    checkpoint = DistributedCheckpoint(
        root / "ckpts", every_n_train_steps=2, snapshot=snapshot, save_on_train_end=False
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


def checkpoints(root: Path) -> dict[int, dict]:
    with CheckpointEngine(root / "ckpts") as engine:
        out = {}
        for info in engine.list():
            if info.status == "valid":
                state = engine.load(checkpoint=info.name, adopt_run=False).state
                assert state is not None
                out[info.step] = {k: state[k] for k in ("state_dict", "optimizer_states")}
        return out


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("case", list(CASES))
def test_lazy_checkpoints_are_the_blocking_ones_and_resume_bitwise(
    tmp_path, slow_copy, case
) -> None:
    reference = fit(tmp_path / "blocking", case, "blocking", STEPS)
    assert not slow_copy  # blocking snapshots make no lazy copy
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotFallbackWarning)  # no save is given up
        fit(tmp_path / "lazy", case, "lazy", CASES[case][2])
        assert slow_copy  # each optimizer step after a save waited for a late copy
        resumed = fit(tmp_path / "lazy", case, "lazy", STEPS)  # resumes from the last save
    blocking, lazy = checkpoints(tmp_path / "blocking"), checkpoints(tmp_path / "lazy")
    assert sorted(lazy) == sorted(blocking) == [2, 4, 6]
    for step in lazy:
        assert_bitwise(lazy[step], blocking[step], f"step {step}")
    assert_bitwise(resumed.state_dict(), reference.state_dict(), "after resume")


def test_an_update_outside_the_step_costs_one_save_and_one_warning(tmp_path, slow_copy) -> None:
    with pytest.warns(SnapshotFallbackWarning) as caught:
        fit(tmp_path, "plain", "lazy", STEPS + 2, poke_at=4)  # right after the step-4 save
    assert len([w for w in caught if w.category is SnapshotFallbackWarning]) == 1
    saved = checkpoints(tmp_path)
    assert sorted(saved) == [2, 6, 8]  # step 4's was given up, never written mixed


# ElasticCheckpointIO under ModelCheckpoint: it holds neither the module nor the optimizers, so
# every optimizer step of the process waits for its copy (torch's global step pre-hook, after
# the closure: Lightning's automatic optimization runs the forward and backward in it)


def fit_plugin(root: Path, case: str, snapshot: str, max_steps: int, **net: Any) -> Net:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elastic import ElasticCheckpointIO

    trainer_kwargs, net_kwargs, _ = CASES[case]
    pl.seed_everything(3, verbose=False)
    model = Net(**net_kwargs, **net)
    trainer = make_trainer(
        str(root),
        max_steps=max_steps,
        strategy="auto",
        devices=1,
        callbacks=[ModelCheckpoint(root / "mc", every_n_train_steps=2, save_top_k=-1)],
        plugins=[ElasticCheckpointIO(snapshot=snapshot)],
        enable_checkpointing=True,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return model


def plugin_checkpoints(root: Path) -> dict[int, dict]:
    from lightning_elastic import ElasticCheckpointIO

    io, out = ElasticCheckpointIO(), {}
    for path in sorted((root / "mc").glob("*.ckpt")):
        state = io.load_checkpoint(path)
        out[state["global_step"]] = {k: state[k] for k in ("state_dict", "optimizer_states")}
    return out


@pytest.mark.filterwarnings(
    "ignore:Using ModelCheckpoint with manual optimization:UserWarning",  # (what we compare)
)
@pytest.mark.parametrize("case", list(CASES))
def test_the_plugins_lazy_checkpoints_are_the_blocking_ones(tmp_path, slow_copy, case) -> None:
    """(A resume from them is Lightning's: mid-epoch it cannot restore the data position.)"""
    fit_plugin(tmp_path / "blocking", case, "blocking", STEPS)
    assert not slow_copy
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotFallbackWarning)  # no save is given up
        fit_plugin(tmp_path / "lazy", case, "lazy", STEPS)
    assert len(slow_copy) >= 2  # the optimizer steps after the saves waited for late copies
    blocking, lazy = (
        plugin_checkpoints(tmp_path / "blocking"),
        plugin_checkpoints(tmp_path / "lazy"),
    )
    assert sorted(blocking) == [2, 4, 6] and sorted(lazy) == sorted(blocking)
    for step in lazy:
        assert_bitwise(lazy[step], blocking[step], f"step {step}")


def test_the_plugins_first_save_copies_at_once_and_a_dropped_plugin_guards_nothing(
    tmp_path, slow_copy
) -> None:
    """Before any optimizer step nothing is known to guard: everything is copied at the save
    point. The global hook holds the plugin weakly; teardown removes it, and so does the end
    of a plugin never torn down (Fabric's)."""
    import gc

    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from lightning_elastic import ElasticCheckpointIO

    before = len(_global_optimizer_pre_hooks)
    io = ElasticCheckpointIO()
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    io.save_checkpoint({"w": net.state_dict(), "global_step": 0}, tmp_path / "a.ckpt")
    assert not slow_copy  # (the lazy copy would wait up to 2 s for a guard: none was lazy)
    assert len(_global_optimizer_pre_hooks) == before + 1
    net(torch.ones(1, 2)).sum().backward()
    opt.step()  # now known: the next save copies the parameters late
    io.save_checkpoint({"w": net.state_dict(), "global_step": 1}, tmp_path / "b.ckpt")
    opt.step()  # waits for that copy
    assert slow_copy
    io.teardown()
    assert len(_global_optimizer_pre_hooks) == before
    io.save_checkpoint({"w": net.state_dict(), "global_step": 2}, tmp_path / "c.ckpt")
    assert len(_global_optimizer_pre_hooks) == before + 1
    io.wait()
    del io
    gc.collect()
    assert len(_global_optimizer_pre_hooks) == before
    opt.step()


def test_an_update_outside_the_step_costs_the_plugin_one_save_and_one_warning(
    tmp_path, slow_copy
) -> None:
    with pytest.warns(SnapshotFallbackWarning) as caught:  # the optimizer's state: copied late
        fit_plugin(tmp_path, "plain", "lazy", STEPS + 2, poke_state_at=4)  # after step 4's save
    assert len([w for w in caught if w.category is SnapshotFallbackWarning]) == 1
    assert sorted(plugin_checkpoints(tmp_path)) == [2, 6, 8]  # step 4's was given up


@pytest.mark.filterwarnings("ignore:SWA is currently only supported every epoch")  # (Net's StepLR)
def test_the_plugin_copies_parameters_at_once_so_callbacks_may_change_them(
    tmp_path, slow_copy
) -> None:
    """Callbacks change parameters in place outside the optimizer step, and the plugin sees
    no callback: a user's update right after a save, and StochasticWeightAveraging, which
    writes the averaged weights into the module at the end of the fit, right after the last
    epoch's save (a hostile review found that save given up when parameters were lazy)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging

    from lightning_elastic import ElasticCheckpointIO

    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotFallbackWarning)
        fit_plugin(tmp_path / "poke", "plain", "lazy", STEPS + 2, poke_at=4)
    assert sorted(plugin_checkpoints(tmp_path / "poke")) == [2, 4, 6, 8]
    saved = {}
    for snapshot in ("blocking", "lazy"):
        root = tmp_path / snapshot
        pl.seed_everything(3, verbose=False)
        trainer = make_trainer(
            str(root),
            max_epochs=3,
            max_steps=-1,
            strategy="auto",
            devices=1,
            callbacks=[
                ModelCheckpoint(root / "mc", every_n_epochs=1, save_top_k=-1),
                StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
            ],
            plugins=[ElasticCheckpointIO(snapshot=snapshot)],
            enable_checkpointing=True,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", SnapshotFallbackWarning)
            trainer.fit(Net())
        saved[snapshot] = plugin_checkpoints(root)
    assert sorted(saved["lazy"]) == sorted(saved["blocking"])
    assert {8, 16, 24} <= set(saved["lazy"])  # (and SWA's own step at the end)
    for step in saved["lazy"]:
        assert_bitwise(saved["lazy"][step], saved["blocking"][step], f"step {step}")


def test_the_plugins_wait_raises_a_save_its_lazy_snapshot_gave_up(tmp_path, slow_copy) -> None:
    """Fabric: ``fabric.save(path)`` then ``io.wait()`` must not pass when ``path`` still
    holds its previous checkpoint (a hostile review saw it return quietly)."""
    from lightning_elastic import ElasticCheckpointIO
    from lightning_elastic.errors import SnapshotChangedError

    io = ElasticCheckpointIO()
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    io.save_checkpoint({"model": net.state_dict(), "opt": opt.state_dict()}, tmp_path / "a.ckpt")
    io.wait()  # committed (at once: no optimizer had stepped since the hook came)
    opt.step()  # now known: its state is copied late
    io.save_checkpoint({"model": net.state_dict(), "opt": opt.state_dict()}, tmp_path / "a.ckpt")
    with torch.no_grad():  # outside the step, before the late copy
        opt.state[net.weight]["exp_avg"].mul_(2.0)
    with pytest.warns(SnapshotFallbackWarning), pytest.raises(SnapshotChangedError):
        io.wait()
    held = io.load_checkpoint(tmp_path / "a.ckpt")["opt"]["state"][0]["exp_avg"]
    assert not torch.equal(held, opt.state[net.weight]["exp_avg"])  # the previous one
    io.save_checkpoint({"model": net.state_dict(), "opt": opt.state_dict()}, tmp_path / "a.ckpt")
    io.wait()  # copied at once from now on
    io.teardown()
