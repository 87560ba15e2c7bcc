"""The health registry: declared names only, logger keys, and the Prometheus endpoint."""

from __future__ import annotations

import urllib.request

import pytest

from lightning_elastic.core.observe.health import METRICS, Health


def test_every_metric_follows_the_prometheus_naming_rules() -> None:
    for name, (kind, help_text, _labels) in METRICS.items():
        assert name.startswith("lightning_elastic_") and help_text
        assert kind in ("gauge", "counter")
        assert name.endswith("_total") == (kind == "counter"), name


def test_only_declared_metrics_with_their_labels_can_be_set() -> None:
    health = Health()
    with pytest.raises(KeyError):
        health.set("lightning_elastic_nonsense", 1)
    with pytest.raises(KeyError):
        health.inc("lightning_elastic_save_failures_total")  # needs its phase label
    health.inc("lightning_elastic_save_failures_total", phase="write")
    health.inc("lightning_elastic_save_failures_total", phase="write")
    assert health.get("lightning_elastic_save_failures_total", phase="write") == 2.0
    assert health.snapshot() == {"lightning_elastic_save_failures_total/write": 2.0}


def test_work_at_risk_grows_until_the_next_checkpoint() -> None:
    now = [100.0]
    health = Health(clock=lambda: now[0])
    health.at_step(5)  # nothing saved yet: no gauge
    assert health.get("lightning_elastic_seconds_since_last_checkpoint") is None
    health.checkpointed(90.0, step=4)
    now[0] = 130.0
    health.at_step(10)
    assert health.get("lightning_elastic_seconds_since_last_checkpoint") == 40.0
    assert health.get("lightning_elastic_steps_since_last_checkpoint") == 6.0


def test_the_endpoint_serves_the_registry_in_prometheus_text_form() -> None:
    pytest.importorskip("prometheus_client")
    health = Health()
    health.set("lightning_elastic_world_size", 3)
    health.inc("lightning_elastic_saves_total", reason="step")
    health.set("lightning_elastic_recovery_seconds", 1.5, phase="load")
    port = health.serve(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        health.set("lightning_elastic_world_size", 4)  # read at every scrape
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            again = reply.read().decode()
    finally:
        health.close()
    assert "# TYPE lightning_elastic_world_size gauge" in text
    assert "lightning_elastic_world_size 3.0" in text
    assert 'lightning_elastic_saves_total{reason="step"} 1.0' in text
    assert 'lightning_elastic_recovery_seconds{phase="load"} 1.5' in text
    assert "lightning_elastic_world_size 4.0" in again


def test_the_docs_and_the_dashboard_name_exactly_the_declared_metrics() -> None:
    import json
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    table = (docs / "monitoring.md").read_text()
    listed = set(re.findall(r"^\| `(lightning_elastic_\w+)", table, flags=re.M))
    assert listed == set(METRICS)
    dashboard = json.loads((docs / "grafana-dashboard.json").read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"lightning_elastic_\w+", target["expr"])
    }
    assert used <= set(METRICS), used - set(METRICS)
    assert set(METRICS) - used == set(), "a metric the dashboard does not show"
