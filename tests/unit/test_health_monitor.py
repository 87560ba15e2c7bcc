"""The monitor's step timing and its start-up agreement, in one process with a fake clock."""

from __future__ import annotations

import socket

import pytest

from lightning_elastic import HealthMonitor
from lightning_elastic.core.dist.coordinator import Coordinator
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
