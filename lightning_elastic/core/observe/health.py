"""This rank's health metrics: one small registry, read by the trainer's loggers and, when
``prometheus_client`` is installed (extra ``metrics``) and a port is given, served on an HTTP
``/metrics`` endpoint.

Names follow Prometheus conventions (``lightning_elastic_..._seconds``, ``_bytes``, counters end
in ``_total``); every metric is declared in :data:`METRICS` with its type and help, and
docs/monitoring.md lists them. Values are plain floats guarded by a lock (the exporter's thread
reads while training writes); setting one costs a dict update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["METRICS", "Health", "metric_key"]

log = logging.getLogger(__name__)

_P = "lightning_elastic_"

#: name -> (type, help, label names)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    f"{_P}last_checkpoint_timestamp_seconds": (
        "gauge",
        "Unix time of the last durable checkpoint (the newest committed save of this run).",
        (),
    ),
    f"{_P}seconds_since_last_checkpoint": (
        "gauge",
        "Seconds since the last durable checkpoint was taken: the training time at risk.",
        (),
    ),
    f"{_P}steps_since_last_checkpoint": (
        "gauge",
        "Optimizer steps since the step of the last durable checkpoint: the work at risk.",
        (),
    ),
    f"{_P}save_blocked_seconds": (
        "gauge",
        "Seconds the last save blocked training on this rank (staging to host memory).",
        (),
    ),
    f"{_P}save_write_seconds": (
        "gauge",
        "Seconds the last save spent writing shards (the slowest rank's).",
        (),
    ),
    f"{_P}save_commit_seconds": (
        "gauge",
        "Seconds from the last save's start to its commit being known on this rank.",
        (),
    ),
    f"{_P}save_bytes": ("gauge", "Bytes this rank wrote in the last save.", ()),
    f"{_P}saved_bytes_total": ("counter", "Bytes this rank wrote in all saves.", ()),
    f"{_P}saves_total": ("counter", "Committed saves, by trigger.", ("reason",)),
    f"{_P}save_failures_total": ("counter", "Failed saves, by phase.", ("phase",)),
    f"{_P}saves_skipped_total": (
        "counter",
        "Saves skipped because the previous one was still being written (when_busy='skip').",
        (),
    ),
    f"{_P}save_in_flight": (
        "gauge",
        "1 while a save is being written in the background, else 0.",
        (),
    ),
    f"{_P}world_size": ("gauge", "Processes in the job now.", ()),
    f"{_P}replica_groups": (
        "gauge",
        "Replica groups taking part in the last committed step (strategy='elastic_ft').",
        (),
    ),
    f"{_P}replica_events_total": (
        "counter",
        "Quorum events seen by this group, by kind (join: this group received the live state; "
        "change: the participating groups changed; failed: a step attempt failed and was redone).",
        ("kind",),
    ),
    f"{_P}replica_stall_seconds": (
        "gauge",
        "Seconds the last quorum event of each kind cost this group's step.",
        ("kind",),
    ),
    f"{_P}replica_heal_seconds": (
        "gauge",
        "Seconds this group's last heal took, by part (quorum: the whole quorum call; transfer: "
        "fetching and loading the live state; configure: rebuilding the cross-group group).",
        ("part",),
    ),
    f"{_P}replica_heal_bytes": (
        "gauge",
        "Bytes of live state this group's last heal received.",
        (),
    ),
    f"{_P}world_size_changes_total": (
        "counter",
        "Resumes of this run at another world size than its checkpoint's.",
        (),
    ),
    f"{_P}restarts_total": (
        "counter",
        "Times this run was resumed from a checkpoint (this launch's included).",
        (),
    ),
    f"{_P}lost_work_steps": (
        "gauge",
        "Steps trained after the resumed checkpoint before the interruption (done again).",
        (),
    ),
    f"{_P}lost_work_seconds": (
        "gauge",
        "Training seconds after the resumed checkpoint before the interruption.",
        (),
    ),
    f"{_P}recovery_seconds": (
        "gauge",
        "The last resume's recovery time, by phase (downtime, startup, setup, select, "
        "verify, load, first_step).",
        ("phase",),
    ),
    f"{_P}step_seconds": (
        "gauge",
        "This rank's median step time over the last straggler window, by part "
        "(local: data, forward, optimizer; save: checkpoint work).",
        ("part",),
    ),
    f"{_P}stragglers": (
        "gauge",
        "Ranks found slower than the median rank by the straggler factor in the last window.",
        (),
    ),
    f"{_P}straggler_reports_total": (
        "counter",
        "Straggler findings (one per slow rank per window).",
        (),
    ),
    f"{_P}checkpoint_interval_seconds": (
        "gauge",
        "The interval between saves chosen by the adaptive cadence from this rank's own "
        "measurements (rank 0's is the one in force).",
        (),
    ),
    f"{_P}checkpoint_cost_seconds": (
        "gauge",
        "Training seconds one save costs (blocked + slowdown while writing), as measured.",
        (),
    ),
    f"{_P}mtbf_seconds": (
        "gauge",
        "The job's mean time between failures the cadence uses (absent when unknown).",
        (),
    ),
}


def metric_key(name: str, labels: Mapping[str, str]) -> str:
    """``name/x/y`` (the label values, by label name): the key the trainer's loggers get, the
    same in CSV columns and TensorBoard tags (which keep only letters, digits, ``_./-``)."""
    if not labels:
        return name
    return "/".join([name, *(str(v) for _k, v in sorted(labels.items()))])


class Health:
    """The registry of one rank's metrics (see :data:`METRICS`)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self._last_checkpoint: tuple[float, int] | None = None
        self._server: Any = None

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        self._put(name, labels, lambda _old: float(value))

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add to a counter."""
        self._put(name, labels, lambda old: old + float(amount))

    def get(self, name: str, **labels: str) -> float | None:
        """A metric's value, ``None`` when never set."""
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))))

    def checkpointed(self, unix: float, step: int) -> None:
        """A checkpoint taken at ``unix`` of ``step`` is durable now."""
        self._last_checkpoint = (unix, step)
        self.set(f"{_P}last_checkpoint_timestamp_seconds", unix)

    def at_risk_since(self, unix: float, step: int) -> None:
        """Nothing is checkpointed yet: the work at risk counts from ``unix`` (the start) and
        ``step`` (no timestamp gauge: there is no checkpoint)."""
        if self._last_checkpoint is None:
            self._last_checkpoint = (unix, step)

    def at_step(self, step: int) -> None:
        """Bring the work-at-risk gauges up to date (cheap: call it every step)."""
        if self._last_checkpoint is None:
            return
        unix, saved_step = self._last_checkpoint
        self.set(f"{_P}seconds_since_last_checkpoint", max(0.0, self.clock() - unix))
        self.set(f"{_P}steps_since_last_checkpoint", max(0, step - saved_step))

    def snapshot(self, *names: str) -> dict[str, float]:
        """``{metric_key: value}`` of every metric set (or of ``names`` only)."""
        with self._lock:
            return {
                metric_key(name, dict(labels)): value
                for (name, labels), value in sorted(self._values.items())
                if not names or name in names
            }

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: any free port) in a daemon thread; returns
        the port. Needs ``prometheus_client`` (``pip install lightning_elastic[metrics]``)."""
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        server, _thread = start_http_server(port, addr=addr, registry=registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        """Stop the HTTP endpoint, if serving."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def families(self) -> Iterator[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """``(name, type, help, [(labels, value)])`` of every metric set, for exporters."""
        with self._lock:
            items = sorted(self._values.items())
        grouped: dict[str, list[tuple[dict[str, str], float]]] = {}
        for (name, labels), value in items:
            grouped.setdefault(name, []).append((dict(labels), value))
        for name, samples in grouped.items():
            kind, help_text, _labels = METRICS[name]
            yield name, kind, help_text, samples

    def _put(self, name: str, labels: Mapping[str, str], update: Callable[[float], float]) -> None:
        spec = METRICS.get(name)
        if spec is None or set(labels) != set(spec[2]):
            raise KeyError(f"undeclared metric {metric_key(name, labels)}")
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        with self._lock:
            self._values[key] = update(self._values.get(key, 0.0))


class _Collector:
    """Turns the registry into prometheus_client metric families at every scrape."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, kind, help_text, samples in self.health.families():
            labelnames = sorted(samples[0][0])
            if kind == "counter":
                family: Any = CounterMetricFamily(
                    name.removesuffix("_total"), help_text, labels=labelnames
                )
            else:
                family = GaugeMetricFamily(name, help_text, labels=labelnames)
            for labels, value in samples:
                family.add_metric([labels[k] for k in labelnames], value)
            yield family
