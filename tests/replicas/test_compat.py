"""The torchft adapter against the installed torchft: every API it reaches exists, and the
version is the one the ``ft`` extra pins (run after a torchft upgrade)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="replica groups need torchft (the ft extra)")


def test_every_torchft_api_the_adapter_uses_exists_in_the_pinned_version() -> None:
    from lightning_elastic.core.replicas import _compat

    assert _compat.missing() == []
    assert _compat.version() == _compat.TESTED_VERSION


def test_the_managers_quorum_thread_is_a_daemon_and_runs_calls_in_order() -> None:
    from lightning_elastic.core.replicas._compat import _DaemonExecutor

    executor = _DaemonExecutor("test-quorum")
    order: list[int] = []
    futures = [executor.submit(order.append, i) for i in range(5)]
    failing = executor.submit(lambda: 1 / 0)
    assert [f.result(timeout=10) for f in futures] == [None] * 5 and order == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    assert executor._thread.daemon
    executor.shutdown(wait=True)
    assert not executor._thread.is_alive()
