"""The monitor's step timing and its start-up agreement, in one process with a fake clock;
and the monitor around a plain ``CheckpointEngine`` loop (no Lightning): commits, a crash's
lost work and the resume, in the run history."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

from lightning_elastic import (
    CheckpointEngine,
    CheckpointNotFoundError,
    HealthMonitor,
    Storage,
)
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.observe.history import read_history
from lightning_elastic.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_local_step_time_leaves_out_backward_saves_and_validation() -> None:
    clock = Clock()
    monitor = HealthMonitor(straggler_factor=1.5, straggler_window=2, clock=clock)
    monitor.step_done()  # the previous step ended at t=100
    clock.now += 0.5  # validation ran between the steps ...
    monitor.validation_started()
    clock.now += 3.0
    monitor.validation_ended()
    clock.now += 0.02  # ... and 20 ms of data loading
    monitor.batch_start()
    with monitor.saving():
        clock.now += 0.4  # a deferred save taken at the batch's start
    clock.now += 0.1  # forward
    monitor.before_backward()
    clock.now += 0.7  # backward, waiting for the slowest rank's gradients
    monitor.before_optimizer_step()
    clock.now += 0.05  # optimizer
    monitor.step_end(step=1, writing=False)
    timing = monitor.window.take()
    assert timing.local_s == pytest.approx(0.5 + 0.02 + 0.1 + 0.05, abs=1e-9)
    assert timing.save_s == pytest.approx(0.4)


def test_a_port_no_rank_can_serve_fails_at_start_with_what_to_do() -> None:
    pytest.importorskip("prometheus_client")
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    monitor = HealthMonitor(straggler_factor=None, straggler_window=5)
    try:
        with pytest.raises(ConfigError, match=rf"metrics_port={port}: rank 0: cannot serve port"):
            monitor.start(Coordinator.single_process(), port=port, local_rank=0)
    finally:
        taken.close()
    monitor = HealthMonitor(straggler_factor=None, straggler_window=5)
    monitor.start(Coordinator.single_process(), port=0, local_rank=0)
    try:
        assert monitor.port and monitor.hosts and monitor.nodes == 1
    finally:
        monitor.close()


def _fit(root: Path, steps: range, *, crash: bool) -> HealthMonitor:
    """A loop of one's own around CheckpointEngine, fed to the monitor (no Lightning): a save
    every 5 steps; it ends by plan, or crashes (its last progress is recorded, no end)."""
    model = torch.nn.Linear(4, 2)
    state = {"model": model}
    setup = time.time()
    engine = CheckpointEngine(root, coordinator=Coordinator.single_process())
    monitor = HealthMonitor(straggler_factor=None, straggler_window=5)
    monitor.start(engine.coordinator, port=None, local_rank=0)
    try:
        resumed = engine.load(state)
    except CheckpointNotFoundError:
        resumed = None
    history = HealthMonitor.history_for(engine)
    monitor.train_start(
        history, engine.coordinator, step=steps[0] - 1, resumed=resumed, setup_unix=setup
    )
    for step in steps:
        monitor.batch_start()
        monitor.step_end(step=step, writing=False)
        monitor.agree(engine.coordinator, step)
        monitor.first_step([], step)
        monitor.step_recorded(step)
        monitor.step_done()
        if step % 5 == 0:
            with monitor.saving():
                handle = engine.save(state, step=step)
            monitor.committed(handle.result(), reason="step")
    if crash:
        monitor.crashed(steps[-1])
    else:
        monitor.train_end(steps[-1], reason="done")
    monitor.flush(timeout=30)
    monitor.close()
    engine.close()
    return monitor


def test_a_loop_around_checkpoint_engine_records_commits_and_what_a_crash_lost(
    tmp_path: Path,
) -> None:
    first = _fit(tmp_path, range(1, 8), crash=True)  # saves step 5, crashes at step 7
    assert first.health.snapshot()["lightning_elastic_saves_total/step"] == 1
    second = _fit(tmp_path, range(6, 9), crash=False)  # resumes at step 5
    values = second.health.snapshot()
    assert values["lightning_elastic_restarts_total"] == 1
    assert values["lightning_elastic_lost_work_steps"] == 2  # steps 6 and 7 are trained again
    events, _skipped = read_history(Storage(tmp_path), kinds=("resume", "commit", "end"))
    kinds = [e.kind for e in events]
    assert kinds == ["commit", "resume", "end"], kinds
    resume = events[1].fields
    assert resume["checkpoint_step"] == 5 and resume["interrupted_step"] == 7
    assert resume["lost_steps"] == 2 and resume["planned"] is False
