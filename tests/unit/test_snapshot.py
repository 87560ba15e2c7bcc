"""Lazy snapshots in one process: the save returns before its copy, a guard waits only while
the copy runs, and a tensor changed between the save point and its copy is never committed."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_elastic import CheckpointEngine, ConfigError
from lightning_elastic.core.save import snapshot as snapshot_module
from lightning_elastic.core.save.snapshot import (
    LazyRule,
    LazySnapshot,
    guard_optimizers,
    guarded_tensors,
    storage_key,
)
from lightning_elastic.errors import SnapshotChangedError, SnapshotFallbackWarning


@pytest.fixture
def gate(monkeypatch) -> Iterator[threading.Event]:
    """Holds every lazy copy until set: the state between the save point and the copy."""
    event = threading.Event()
    original = LazySnapshot.run

    def held(self: LazySnapshot) -> None:
        assert event.wait(30), "the test never released the copy"
        original(self)

    monkeypatch.setattr(LazySnapshot, "run", held)
    yield event
    event.set()


def release_later(gate: threading.Event, seconds: float = 0.2) -> None:
    threading.Timer(seconds, gate.set).start()


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def snapshot_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cloned(v) for v in value]
    return value


def assert_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_equal(x, y)
    else:
        assert a == b


def loaded(engine: CheckpointEngine, name: str) -> dict:
    state = engine.load(checkpoint=name, adopt_run=False).state
    assert state is not None
    return state


def test_the_snapshot_option_is_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match="snapshot must be one of"):
        CheckpointEngine(tmp_path, snapshot="eager")


def test_a_lazy_save_returns_before_its_copy_and_the_guard_waits_for_it(tmp_path, gate) -> None:
    model, opt = trained()
    expected = cloned(snapshot_of(model, opt))
    with CheckpointEngine(tmp_path, snapshot="lazy") as engine:
        guard_optimizers([opt], engine.wait_snapshot)
        handle = engine.save(
            snapshot_of(model, opt), step=1, guarded=guarded_tensors([model], [opt])
        )
        assert handle is not None and not handle.done()
        model(torch.randn(4, 8)).square().sum().backward()  # the copy is still held
        release_later(gate)
        began = time.monotonic()
        opt.step()  # its pre-hook waits for the copy
        assert time.monotonic() - began >= 0.15
        result = handle.result()
        assert result.snapshot == "lazy" and result.snapshot_wait_s >= 0.1
        assert result.blocked_s >= result.snapshot_wait_s
        opt.zero_grad()
        step(model, opt)  # nothing in flight: no wait
        assert engine.wait_snapshot() == 0.0
        assert_equal(loaded(engine, result.name), expected)


def test_the_guard_does_not_wait_once_the_copy_is_done(tmp_path) -> None:
    model, opt = trained()
    with CheckpointEngine(tmp_path, snapshot="lazy") as engine:
        handle = engine.save(
            snapshot_of(model, opt), step=1, guarded=guarded_tensors([model], [opt])
        )
        assert handle is not None
        handle.result()
        assert engine.wait_snapshot() == 0.0


def test_buffers_the_forward_changes_are_copied_before_the_save_returns(tmp_path, gate) -> None:
    model, opt = trained()
    expected = cloned(snapshot_of(model, opt))
    with CheckpointEngine(tmp_path, snapshot="lazy") as engine:
        handle = engine.save(
            snapshot_of(model, opt), step=1, guarded=guarded_tensors([model], [opt])
        )
        assert handle is not None
        loss = model(torch.randn(4, 8)).square().sum()  # BatchNorm's running stats move
        loss.backward()
        gate.set()
        engine.wait_snapshot()
        opt.step()
        result = handle.result()
        assert result.snapshot == "lazy"
        assert_equal(loaded(engine, result.name), expected)


def change_parameter(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        model[0].weight.mul_(2.0)


def change_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    step(model, opt)  # a step nobody guarded


def change_buffer(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8))  # BatchNorm's running statistics, in place


def change_step_counter(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for state in opt.state.values():
        state["step"].add_(1)  # a user's in-place update of a 0-d optimizer tensor


@pytest.mark.parametrize(
    "change",
    [change_parameter, change_optimizer_state, change_buffer, change_step_counter],
    ids=["parameter", "optimizer-state", "bn-buffer", "user-in-place-update"],
)
def test_a_tensor_changed_before_its_copy_is_never_committed_and_lazy_falls_back_once(
    tmp_path, gate, change
) -> None:
    model, opt = trained()
    with CheckpointEngine(tmp_path, snapshot="lazy") as engine:
        # every tensor left to the lazy copy (buffers too), so each change hits one
        handle = engine.save(snapshot_of(model, opt), step=1)
        assert handle is not None
        change(model, opt)
        gate.set()
        with pytest.raises(SnapshotChangedError, match="changed in place"):
            handle.result()
        assert [c.name for c in engine.list() if c.status == "valid"] == []
        expected = cloned(snapshot_of(model, opt))
        with pytest.warns(SnapshotFallbackWarning, match="blocking snapshots from now on"):
            second = engine.save(snapshot_of(model, opt), step=2)
        assert second is not None
        change(model, opt)  # after a blocking snapshot: harmless
        result = second.result()
        assert result.snapshot == "fallback"
        assert_equal(loaded(engine, result.name), expected)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            third = engine.save(snapshot_of(model, opt), step=3)
            assert third is not None and third.result().snapshot == "fallback"


def test_a_change_while_its_tensor_is_being_copied_is_caught_after_the_copy(
    tmp_path, monkeypatch
) -> None:
    model, opt = trained()
    original = snapshot_module._copy

    def copy_then_changed(targets, sources, event) -> None:
        original(targets, sources, event)
        with torch.no_grad():
            sources[0].add_(1.0)  # as if an update overlapped the copy's end

    monkeypatch.setattr(snapshot_module, "_copy", copy_then_changed)
    with CheckpointEngine(tmp_path, snapshot="lazy") as engine:
        handle = engine.save(snapshot_of(model, opt), step=1)
        assert handle is not None
        with pytest.raises(SnapshotChangedError):
            handle.result()
        with pytest.warns(SnapshotFallbackWarning):
            engine.wait()


def test_a_blocking_snapshot_copies_everything_before_the_save_returns(tmp_path, gate) -> None:
    model, opt = trained()
    expected = cloned(snapshot_of(model, opt))
    with CheckpointEngine(tmp_path) as engine:  # snapshot="blocking" is the engine's default
        handle = engine.save(snapshot_of(model, opt), step=1)
        assert handle is not None
        change_parameter(model, opt)
        result = handle.result()
        assert result.snapshot == "blocking" and result.snapshot_wait_s == 0.0
        assert_equal(loaded(engine, result.name), expected)


def test_guarded_tensors_are_the_parameters_and_the_optimizer_state_not_the_buffers() -> None:
    model, opt = trained()
    rule = LazyRule(guarded_tensors([model], [opt]))
    state = model.state_dict()  # detached views: the same memory
    assert rule(state["0.weight"]) and rule(state["1.weight"])
    assert not rule(state["1.running_mean"]) and not rule(state["1.num_batches_tracked"])
    assert all(rule(v) for s in opt.state_dict()["state"].values() for v in s.values())
    assert LazyRule(None)(state["1.running_mean"])  # no guard given: every tensor is lazy
    whole = torch.zeros(10)
    assert storage_key(whole[3:]) == storage_key(whole) != 0


def test_a_snapshot_that_ends_without_running_releases_its_waiters() -> None:
    snap = LazySnapshot([(torch.zeros(2), torch.ones(2), "x")])
    waiter = threading.Thread(target=snap.wait)
    waiter.start()
    snap.end()
    waiter.join(5)
    assert not waiter.is_alive() and snap.done and snap.failed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_are_copied_on_a_side_stream_into_pinned_memory(tmp_path, gate) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    with CheckpointEngine(tmp_path, snapshot="lazy") as engine:
        assert engine.arena.pin_memory
        guard_optimizers([opt], engine.wait_snapshot)
        handle = engine.save({"model": model.state_dict()}, step=1)
        assert handle is not None
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        release_later(gate, 0.05)
        opt.step()
        result = handle.result()
        assert result.snapshot == "lazy"
        assert_equal(loaded(engine, result.name)["model"], expected)


def test_every_optimizer_guard_waits_after_the_closure_and_before_the_update() -> None:
    from lightning_elastic.core.save.snapshot import EveryOptimizerGuard

    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    events: list[str] = []
    weight = net.weight.detach().clone()

    def wait() -> None:  # the update has not happened yet
        events.append("wait" if torch.equal(net.weight, weight) else "wait after the update")

    def closure() -> torch.Tensor:
        events.append("closure")
        opt.zero_grad()
        loss = net(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    guard = EveryOptimizerGuard(wait)
    try:
        assert guard.tensors() == []  # no optimizer has stepped yet
        loss = opt.step(closure)  # Lightning's automatic optimization passes it by keyword
        assert loss is not None and events == ["closure", "wait"]
        weight.copy_(net.weight)
        events.clear()
        opt.step(closure=closure)
        assert events == ["closure", "wait"]
        weight.copy_(net.weight)
        events.clear()
        opt.step()  # manual optimization, GradScaler.step: no closure
        assert events == ["wait"]
        guarded = {id(t) for t in guard.tensors()}
        assert {id(p) for p in net.parameters()} <= guarded
    finally:
        guard.remove()
    events.clear()
    opt.step()
    assert events == []  # removed


def test_every_optimizer_guard_leaves_other_step_arguments_alone() -> None:
    """A first argument that is not callable is no closure (``step(scale)``); a closure
    called with arguments gets them (a hostile review: the guard replaced ``scale`` and the
    step crashed)."""
    from lightning_elastic.core.save.snapshot import EveryOptimizerGuard

    class Scaled(torch.optim.SGD):
        def step(self, scale: Any = 1.0, closure: Any = None) -> Any:  # type: ignore[override]
            loss = closure(2.0, twice=True) if closure is not None else None
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad, alpha=-group["lr"] / scale)
            return loss

    net = torch.nn.Linear(2, 1)
    opt = Scaled(net.parameters(), lr=0.5)
    net(torch.ones(1, 2)).sum().backward()
    events: list[Any] = []
    guard = EveryOptimizerGuard(lambda: events.append("wait"))
    try:
        opt.step(2.0)
        assert events == ["wait"]
        events.clear()
        loss = opt.step(1.0, closure=lambda *a, **kw: events.append((a, kw)) or 3.0)
        assert loss == 3.0 and events == [((2.0,), {"twice": True}), "wait"]
    finally:
        guard.remove()
