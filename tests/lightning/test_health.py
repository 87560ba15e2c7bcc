"""Observability in a real 2-process fit: stragglers, loggers, the metrics endpoint, the
adaptive cadence, and what a resume records (lost work, recovery, restarts)."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest

from lightning_elastic import CadenceOptions, MonitoringOptions
from lightning_elastic.core.observe.history import read_history
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.testing.spawn import run_distributed
from tests.cli.test_cli import run
from tests.lightning import health_workers

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def tensorboard_tags(folder: Path) -> set[str]:
    """Scalar tags of the TensorBoard event files under ``folder`` (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in folder.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        at = 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            tags.update(v.tag for v in event.summary.value)
            at += 12 + length + 4
    return tags


def test_a_slow_rank_is_reported_and_metrics_reach_loggers_and_the_endpoint(tmp_path) -> None:
    out = run_distributed(
        health_workers.fit_observed,
        2,
        str(tmp_path),
        16,
        slow_rank=1,
        slow_s=0.08,
        loggers=True,
        scrape=True,
        every_n_train_steps=5,
        monitoring=MonitoringOptions(straggler_window=4, straggler_factor=1.5, metrics_port=0),
    )
    for rank in range(2):
        found = out[rank]["stragglers"]
        assert [(s["rank"], s["where"]) for s in found] == [(1, "step")], found
        assert found[0]["host"] == out[rank]["hosts"][1]
        metrics = out[rank]["metrics"]
        assert metrics["lightning_elastic_stragglers"] == 1.0
        assert metrics["lightning_elastic_saves_total/step"] >= 3.0
        assert metrics["lightning_elastic_world_size"] == 2.0
        scraped = out[rank]["scraped"]
        assert "lightning_elastic_stragglers 1.0" in scraped
        assert 'lightning_elastic_saves_total{reason="step"}' in scraped
        assert "# TYPE lightning_elastic_seconds_since_last_checkpoint gauge" in scraped
    # rank 0's loggers: CSV columns and TensorBoard tags
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:
        columns = set(next(csv.reader(f)))
    tags = tensorboard_tags(tmp_path / "tb")
    for name in (
        "lightning_elastic_save_blocked_seconds",
        "lightning_elastic_save_commit_seconds",
        "lightning_elastic_seconds_since_last_checkpoint",
        "lightning_elastic_stragglers",
        "lightning_elastic_step_seconds/local",
    ):
        assert name in columns, sorted(columns)
        assert name in tags, sorted(tags)
    events, skipped = read_history(Storage(str(tmp_path / "ckpts")))
    assert skipped == 0
    kinds = [e.kind for e in events]
    assert kinds.count("start") == 1 and kinds.count("end") == 1
    assert kinds.count("commit") >= 3
    assert any(e.kind == "straggler" and e.fields["rank"] == 1 for e in events)


def test_auto_cadence_chooses_the_interval_from_measured_saves(tmp_path) -> None:
    out = run_distributed(
        health_workers.fit_observed,
        2,
        str(tmp_path),
        24,
        step_sleep=0.05,
        auto_initial_s=0.3,
        train_time_interval="auto",
        cadence=CadenceOptions(mtbf="4h", max_overhead=0.5),
    )
    # both ranks use rank 0's decisions: the same checkpoints; the interval is set from
    # measurements on every rank's copy of the cadence
    root = tmp_path / "ckpts"
    bodies = [json.loads(p.read_text()) for p in sorted(root.glob("step_*/manifest.json"))]
    reasons = [b["metadata"]["reason"] for b in bodies]
    assert "interval" in reasons
    events, _ = read_history(Storage(str(root)))
    chosen = [e.fields for e in events if e.kind == "cadence"]
    assert chosen and all(c["mtbf_s"] == 4 * 3600.0 for c in chosen)  # one node here
    assert all(c["bound"] in ("young_daly", "overhead", "write") for c in chosen)
    assert out[0]["interval_s"] == pytest.approx(chosen[-1]["interval_s"])
    assert out[0]["metrics"]["lightning_elastic_checkpoint_interval_seconds"] > 0


def test_a_resume_records_lost_work_recovery_and_restarts(tmp_path, capsys) -> None:
    run_distributed(
        health_workers.fit_observed,
        2,
        str(tmp_path),
        20,
        kill_at=13,
        every_n_train_steps=5,
        may_die={0, 1},
    )
    out = run_distributed(
        health_workers.fit_observed, 3, str(tmp_path), 20, every_n_train_steps=5, devices=3
    )
    events, _ = read_history(Storage(str(tmp_path / "ckpts")))
    (resume,) = [e.fields for e in events if e.kind == "resume"]
    assert resume["checkpoint_step"] == 10 and resume["interrupted_step"] == 13
    assert resume["lost_steps"] == resume["interrupted_step"] - 10
    assert resume["lost_s"] > 0 and resume["planned"] is False
    assert (resume["previous_world_size"], resume["world_size"]) == (2, 3)
    recovery = resume["recovery"]
    assert recovery["first_step_s"] > 0 and recovery["load_s"] > 0
    assert recovery["startup_s"] is not None and recovery["startup_s"] > 0
    for rank in range(3):
        metrics = out[rank]["metrics"]
        assert metrics["lightning_elastic_restarts_total"] == 1.0
        assert metrics["lightning_elastic_world_size_changes_total"] == 1.0
        assert metrics["lightning_elastic_lost_work_steps"] == resume["lost_steps"]
        assert metrics["lightning_elastic_recovery_seconds/load"] > 0
    # the report of this real run: 2 ranks killed at step 13, resumed on 3
    page = tmp_path / "report.html"
    code, text, _ = run(capsys, "report", str(tmp_path / "ckpts"), "--output", str(page))
    assert code == 0, text
    assert "world size 2 -> 3" in text
    assert f"lost {resume['lost_steps']} steps" in text and "(unplanned)" in text
    assert "from step_000000010 (step 10)" in text
    assert page.read_text().count('src="data:image/png;base64,') >= 1
    code, data, _ = run(capsys, "report", str(tmp_path / "ckpts"), "--json")
    report = json.loads(data)
    assert [s["world_size"] for s in report["world_size"]] == [2, 3]
    assert report["totals"]["lost_steps"] == resume["lost_steps"]


def test_a_crash_by_exception_records_exactly_how_far_training_got(tmp_path) -> None:
    # a second's throttle, as on an object store: only the crash's own record is exact
    run_distributed(
        health_workers.fit_observed,
        2,
        str(tmp_path),
        20,
        raise_at=13,
        every_n_train_steps=5,
        progress_every_s=3600.0,
    )
    out = run_distributed(health_workers.fit_observed, 2, str(tmp_path), 20, every_n_train_steps=5)
    events, _ = read_history(Storage(str(tmp_path / "ckpts")))
    (resume,) = [e.fields for e in events if e.kind == "resume"]
    assert (resume["checkpoint_step"], resume["interrupted_step"]) == (10, 13)
    assert resume["lost_steps"] == 3 and resume["planned"] is False
    assert out[0]["metrics"]["lightning_elastic_lost_work_steps"] == 3.0


def test_skipped_saves_and_the_save_in_flight_are_counted(tmp_path) -> None:
    import lightning_elastic.testing.faults  # noqa: F401  (registers faulty://)
    from lightning_elastic import DistributedCheckpoint, ElasticStrategy
    from lightning_elastic.testing.faults import Fault
    from tests.lightning.models import TinyModule, make_trainer

    # every shard write stalls 0.5 s: saves due at every step find the last one in flight
    faults = [Fault("open", "*.distcp", "stall", seconds=0.5)]
    checkpoint = DistributedCheckpoint(
        f"faulty://{tmp_path}/ckpts", every_n_train_steps=1, when_busy="skip"
    )
    trainer = make_trainer(
        str(tmp_path),
        max_steps=6,
        strategy=ElasticStrategy(storage_options={"faults": faults}),
        devices=1,
        callbacks=[checkpoint],
    )
    trainer.fit(TinyModule())
    assert checkpoint.health is not None
    metrics = checkpoint.health.health.snapshot()
    assert metrics["lightning_elastic_saves_skipped_total"] >= 1
    assert metrics["lightning_elastic_save_in_flight"] == 0.0  # all written by the end
    committed = sum(v for k, v in metrics.items() if k.startswith("lightning_elastic_saves_total"))
    assert committed + metrics["lightning_elastic_saves_skipped_total"] >= 6
