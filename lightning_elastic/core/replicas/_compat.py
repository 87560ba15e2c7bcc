"""Every torchft API lightning_elastic uses, each behind one named function.

torchft is an optional dependency (``pip install "lightning_elastic[ft]"``), pinned to the
version these adapters were tested with (:data:`TESTED_VERSION`). What we use of it: the
Lighthouse (decides the quorum of replica groups each step), the Manager (quorum, fault-
tolerant allreduce, the per-group commit vote, the transfer of live state to a healing group)
and its reconfigurable gloo process group. What we deliberately do *not* use: its
``DistributedDataParallel`` wrapper (its gradient hook asserts on the future a failed
allreduce leaves unset, which crashes the survivor of a peer's death in 0.2.0; we reduce the
gradients ourselves, after the backward pass), its ``DistributedSampler`` (lossy by design:
a lost group's shard is skipped) and its optimizer wrapper (refuses Lightning's closure), and
its HTTP checkpoint transport (unpickles what a peer sends with ``weights_only=False``; ours
is :mod:`lightning_elastic.core.replicas.transport`).

After a torchft upgrade run ``tests/replicas/test_compat.py``: it calls :func:`missing`.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_elastic.core._compat import unmet
from lightning_elastic.errors import ConfigError

__all__ = [
    "REQUIREMENTS",
    "TESTED_VERSION",
    "allreduce_sum",
    "lighthouse_server",
    "make_manager",
    "make_process_group",
    "missing",
    "probe_lighthouse",
    "quorum_id",
    "require",
    "transport_base",
    "version",
]

TESTED_VERSION = "0.2.0"

# (module, attribute path) of everything below
REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("torchft.manager", "Manager"),
    ("torchft.manager", "Manager.start_quorum"),
    ("torchft.manager", "Manager.allreduce"),
    ("torchft.manager", "Manager.should_commit"),
    ("torchft.manager", "Manager.register_state_dict_fn"),
    ("torchft.manager", "Manager.participating_rank"),
    ("torchft.manager", "Manager.num_participants"),
    ("torchft.manager", "Manager.current_step"),
    ("torchft.manager", "Manager.errored"),
    ("torchft.manager", "Manager.shutdown"),
    # (and the instance attributes Manager._quorum_id, which names quorum changes in our
    # metrics, and Manager._executor, replaced by a daemon thread: see make_manager)
    ("torchft.process_group", "ProcessGroupGloo.configure"),
    ("torchft.process_group", "ProcessGroupGloo.allreduce"),
    ("torchft.coordination", "LighthouseServer"),
    ("torchft.checkpointing.transport", "CheckpointTransport"),
)

_HINT = 'install it with `pip install "lightning_elastic[ft]"` (torchft=={version})'


def require() -> Any:
    """The ``torchft`` module, or a ``ConfigError`` saying how to install it."""
    try:
        return importlib.import_module("torchft")
    except ImportError as exc:
        raise ConfigError(
            f"replica groups need torchft, which is not installed ({exc}); "
            + _HINT.format(version=TESTED_VERSION)
        ) from None


def version() -> str | None:
    """The installed torchft version, or ``None``."""
    try:
        from importlib.metadata import version as dist_version

        return dist_version("torchft")
    except Exception:
        return None


def missing() -> list[str]:
    """The entries of :data:`REQUIREMENTS` the installed torchft lacks (instance attributes
    such as ``Manager._quorum_id`` are checked on a live Manager by the tests)."""
    return unmet(REQUIREMENTS)


def lighthouse_server(
    *,
    bind: str,
    min_replicas: int,
    heartbeat_timeout_ms: int,
    join_timeout_ms: int,
    quorum_tick_ms: int,
) -> Any:
    """torchft's Lighthouse, serving on ``bind`` (``host:port``) until ``shutdown()``."""
    coordination = importlib.import_module("torchft.coordination")
    return coordination.LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def probe_lighthouse(address: str, timeout: float) -> str | None:
    """Whether torchft's Lighthouse answers at ``address`` within ``timeout`` seconds: ``None``
    when it does, else what answered instead or why nothing did. Its status page is served
    on the same port as its RPCs (the dashboard's title names it); a refused connection is
    tried again until the timeout, since a Lighthouse started with the job may still be
    starting."""
    import urllib.error

    from lightning_elastic.core.replicas.transport import direct_opener

    deadline = time.monotonic() + timeout
    problem = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return problem
        try:
            with direct_opener().open(address, timeout=max(0.1, left)) as page:
                head = page.read(8192)
            if b"Lighthouse" in head:
                return None
            return f"something answered that is not a torchft Lighthouse ({head[:80]!r})"
        except urllib.error.HTTPError as exc:
            return f"something answered that is not a torchft Lighthouse (HTTP {exc.code})"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            problem = str(getattr(exc, "reason", exc))  # refused, unknown host, timed out
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def make_process_group(timeout: timedelta, on_configure: Callable[[float], None]) -> Any:
    """torchft's reconfigurable gloo process group (one per group rank: rank ``r`` of every
    replica group), calling ``on_configure(seconds)`` after each rebuild."""
    process_group = importlib.import_module("torchft.process_group")

    class _TimedGloo(process_group.ProcessGroupGloo):  # type: ignore[misc, name-defined]
        def configure(self, *args: Any, **kwargs: Any) -> None:
            began = time.perf_counter()
            super().configure(*args, **kwargs)
            on_configure(time.perf_counter() - began)

    return _TimedGloo(timeout=timeout)


def allreduce_sum(process_group: Any, tensor: Any) -> Any:
    """Sum ``tensor`` over ``process_group`` (made by :func:`make_process_group`) directly,
    not through the Manager (which skips collectives once it has seen an error): a group
    whose heal failed still takes its part in the step's ring, so the others do not wait
    for it. Returns the work (``wait()`` it)."""
    from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

    options = AllreduceOptions()
    options.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
    return process_group.allreduce([tensor], options)


def transport_base() -> type:
    """torchft's ``CheckpointTransport`` ABC (what a Manager sends live state through)."""
    transport = importlib.import_module("torchft.checkpointing.transport")
    base: type = transport.CheckpointTransport
    return base


def make_manager(
    *,
    process_group: Any,
    transport: Any,
    key: str,
    get_state: Callable[[], Any],
    put_state: Callable[[Any], None],
    min_groups: int,
    group_rank: int,
    group_size: int,
    store_addr: str,
    store_port: int,
    lighthouse: str,
    name: str,
    timeout: timedelta,
    quorum_timeout: timedelta,
    connect_timeout: timedelta,
    heartbeat_interval: timedelta,
    init_sync: bool,
) -> Any:
    """A torchft Manager with a synchronous quorum: a healing group receives the live state
    (``put_state``) before its step starts and takes part in that step."""
    manager_module = importlib.import_module("torchft.manager")
    manager = manager_module.Manager(
        pg=process_group,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_groups,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=quorum_timeout,
        connect_timeout=connect_timeout,
        rank=group_rank,
        world_size=group_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=name,
        heartbeat_interval=heartbeat_interval,
        checkpoint_transport=transport,
        init_sync=init_sync,
        # a lost Lighthouse: its server retries the quorum about once a second (with a new
        # connection each time) until the quorum timeout, so a restarted Lighthouse is found
        quorum_retries=max(1, int(quorum_timeout.total_seconds())),
    )
    manager.register_state_dict_fn(key, put_state, get_state)
    # its quorum thread in a daemon thread: the Manager's ThreadPoolExecutor thread is joined
    # at interpreter exit, and a quorum that waits (for the Lighthouse, for more groups) held
    # a Ctrl-C'd or failed process for the whole quorum timeout (60 s of 60, measured)
    manager._executor.shutdown(wait=False)
    manager._executor = _DaemonExecutor("torchft-quorum")
    return manager


class _DaemonExecutor:
    """What torchft's Manager needs of its executor (``submit``, ``shutdown``): one daemon
    thread running the submitted calls in order."""

    def __init__(self, name: str) -> None:
        import queue
        import threading

        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        from concurrent.futures import Future

        future: Future[Any] = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, **_: Any) -> None:
        self._calls.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)


def quorum_id(manager: Any) -> int:
    """The id of the manager's current quorum (``-1`` before the first)."""
    return int(getattr(manager, "_quorum_id", -1))
