"""``lightning-elastic report``: from real checkpoints plus a recorded (synthetic) history.

Run as a script to redraw the documentation's figure from a realistic synthetic run::

    python -m tests.cli.test_report docs/images/run_report.png
"""

from __future__ import annotations

import base64
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_elastic.core.format.catalog import VALID, Catalog, CheckpointInfo
from lightning_elastic.core.format.manifest import FileRecord, Manifest, RankRecord, Timings
from lightning_elastic.core.observe.history import HISTORY_DIR, Event, RunHistory
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.report import CheckpointRow, build_report, render_html, render_text
from lightning_elastic.report.figures import overview_png
from tests.cli.test_cli import populate, run

RUN = "demo"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record_history(root: Path) -> None:
    """Two sessions of run ``demo`` around the checkpoints at steps 10, 20 and 30: the first
    (2 ranks) committed all three and was killed at step 35, 3 s after the last commit; the
    second (1 rank) resumed from step 30, 20 s after the last commit, and finished."""
    storage = Storage(str(root))
    created = {i.name: i.created_unix for i in Catalog(storage).scan()}
    t10, t30 = created["step_000000010"], created["step_000000030"]
    clock = Clock(t10 - 5)
    first = RunHistory(storage, run_id=RUN, session="first", clock=clock)
    first.record("start", step=0, world_size=2, hosts=["n0", "n1"], resumed_from=None)
    for i, (name, when) in enumerate(sorted(created.items())):
        clock.now = when
        first.record(
            "commit",
            name=name,
            step=int(name[5:]),
            bytes=6144,
            blocked_s=0.05 * (i + 1),
            commit_s=0.4,
            world_size=2,
            retained_bytes=6144 * (i + 1),
            retained=i + 1,
        )
    clock.now = t30 + 3
    first.progress(35, force=True)
    clock.now = t30 + 20
    second = RunHistory(storage, run_id=RUN, session="second", clock=clock)
    second.record(
        "start",
        step=30,
        world_size=1,
        hosts=["n0"],
        resumed_from="step_000000030",
        resumed_step=30,
    )
    second.record(
        "resume",
        checkpoint="step_000000030",
        checkpoint_step=30,
        interrupted_step=35,
        interrupted_time=t30 + 3,
        lost_steps=5,
        lost_s=3.0,
        planned=False,
        world_size=1,
        previous_world_size=2,
        recovery={"startup_s": 4.0, "setup_s": 1.5, "select_s": 0.1, "verify_s": None},
    )
    second.record("save_failed", step=38, phase="write", error="OSError: [Errno 28] ENOSPC")
    clock.now += 30
    second.progress(40, force=True)
    second.record("end", step=40, reason="max_steps")


@pytest.fixture
def root(tmp_path) -> Path:
    populate(str(tmp_path), steps=(10, 20, 30), run_id=RUN)
    Catalog(Storage(str(tmp_path))).quarantine(
        "step_000000020", "x-rank00000.distcp", "checksum mismatch"
    )
    record_history(tmp_path)
    return tmp_path


# ----------------------------------------------------------------------------- the verb


def test_the_summary_names_the_resume_its_lost_work_the_world_change_and_the_bad_checkpoint(
    root, capsys
) -> None:
    code, out, err = run(capsys, "report", str(root))
    assert code == 0, err
    assert f"run report of {root} (1 run(s): demo)" in out
    assert "checkpoints: 2 valid" in out and "1 corrupt" in out and "steps 10 to 30" in out
    assert "sessions: 2" in out and "world size 2 -> 1" in out
    assert re.search(
        r"from step_000000030 \(step 30\), world size 2 -> 1: lost 5 steps / 3.00 s", out
    )
    assert "recovery 5.60 s (unplanned)" in out
    assert "lost work: 5 steps, 3.00 s over 1 unplanned interruption(s)" in out
    assert "step_000000020: corrupt: quarantined: x-rank00000.distcp: checksum mismatch" in out
    assert "save failures: 1 (last at step 38, phase write" in out
    assert "storage: 12.0 KiB retained now, peak 18.0 KiB (commit records)" in out
    assert "history: 10 events, 0 unreadable object(s) skipped" in out


def test_json_gives_the_same_data(root, capsys) -> None:
    code, out, _ = run(capsys, "report", str(root), "--json")
    data = json.loads(out)
    assert code == 0 and data["version"] == 1 and data["runs"] == [RUN]
    assert {
        "checkpoints",
        "problems",
        "sessions",
        "world_size",
        "resumes",
        "save_failures",
        "stragglers",
        "cadence",
        "storage",
        "totals",
        "history",
    } <= data.keys()
    assert [c["step"] for c in data["checkpoints"]] == [10, 20, 30]
    assert [c["blocked_s"] for c in data["checkpoints"]] == pytest.approx([0.05, 0.1, 0.15])
    assert data["checkpoints"][0]["blocked_from"] == "history"
    (resume,) = data["resumes"]
    assert (resume["checkpoint"], resume["lost_steps"], resume["lost_s"]) == (
        "step_000000030",
        5,
        3.0,
    )
    assert [s["world_size"] for s in data["world_size"]] == [2, 1]
    assert [p["name"] for p in data["problems"]] == ["step_000000020"]
    assert [p["bytes"] for p in data["storage"]] == [6144, 12288, 18432]
    assert data["totals"]["lost_steps"] == 5 and data["history"] == {"events": 10, "skipped": 0}


def test_the_html_page_is_self_contained_with_the_figure_embedded(root, tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    page = tmp_path / "out" / "report.html"
    page.parent.mkdir()
    code, out, _ = run(capsys, "report", str(root), "--output", str(page), "--json")
    assert code == 0 and json.loads(out)["html"] == str(page)
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "</html>" in text
    assert "http://" not in text and "https://" not in text and "<script" not in text
    match = re.search(r'<img alt="run report figures" src="data:image/png;base64,([^"]+)"', text)
    assert match is not None
    assert base64.b64decode(match.group(1)).startswith(b"\x89PNG\r\n\x1a\n")
    assert "step_000000030" in text and "checksum mismatch" in text and "max_steps" in text


def test_without_matplotlib_the_page_keeps_its_tables_and_says_why(
    root, tmp_path, monkeypatch, capsys
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    page = tmp_path / "report.html"
    code, _, _ = run(capsys, "report", str(root), "--output", str(page))
    text = page.read_text()
    assert code == 0 and "data:image/png" not in text
    assert "Figures need matplotlib" in text and "<td>step_000000030</td>" in text


def test_values_from_storage_are_escaped_in_the_page(tmp_path) -> None:
    RunHistory(Storage(str(tmp_path)), run_id="<b>x</b>").record(
        "end", step=1, reason="<script>alert(1)</script>"
    )
    events = [
        Event("end", 1.0, "<b>x</b>", "s", {"step": 1, "reason": "<script>alert(1)</script>"})
    ]
    page = render_html(build_report("<root>", [], events))
    assert "<script>" not in page and "&lt;script&gt;" in page and "<b>x</b>" not in page


def test_lost_work_is_derived_from_progress_when_no_resume_was_recorded(tmp_path, capsys) -> None:
    populate(str(tmp_path), steps=(10,), run_id=RUN)
    storage = Storage(str(tmp_path))
    t10 = Catalog(storage).scan()[0].created_unix
    clock = Clock(t10 - 1)
    first = RunHistory(storage, run_id=RUN, session="a", clock=clock)
    first.record("start", step=0, world_size=4)
    clock.now = t10 + 7
    first.progress(17, force=True)
    clock.now = t10 + 60
    RunHistory(storage, run_id=RUN, session="b", clock=clock).record(
        "start", step=10, world_size=3, resumed_from="step_000000010", resumed_step=10
    )
    code, out, _ = run(capsys, "report", str(tmp_path), "--json")
    (resume,) = json.loads(out)["resumes"]
    assert code == 0 and resume["derived"] is True
    assert (resume["lost_steps"], resume["lost_s"]) == (7, pytest.approx(7.0))
    assert (resume["previous_world_size"], resume["world_size"]) == (4, 3)
    code, out, _ = run(capsys, "report", str(tmp_path))
    assert "lost 7 steps / 7.00 s" in out and "derived from progress records" in out


def test_a_directory_without_history_gets_an_honest_summary(tmp_path, capsys) -> None:
    populate(str(tmp_path), steps=(1, 2), run_id=RUN)
    code, out, _ = run(capsys, "report", str(tmp_path))
    assert code == 0 and "checkpoints: 2 valid" in out
    assert "history: none recorded in _history/" in out and "resumes:" not in out
    assert "(manifests present)" in out


def test_unreadable_history_objects_are_counted_not_fatal(root, capsys) -> None:
    (root / HISTORY_DIR / "00000000000000000001-x-000000-start.json").write_text("{oops")
    code, out, _ = run(capsys, "report", str(root))
    assert code == 0 and "history: 10 events, 1 unreadable object(s) skipped" in out


def test_run_filter(root, capsys) -> None:
    populate(str(root), steps=(50,), run_id="other")
    code, out, _ = run(capsys, "report", str(root), "--run", RUN, "--json")
    data = json.loads(out)
    assert code == 0 and {c["run_id"] for c in data["checkpoints"]} == {RUN}
    code, _, err = run(capsys, "report", str(root), "--run", "nope")
    assert code == 1 and "runs here: demo, other" in err


def test_errors_follow_the_other_verbs(tmp_path, root, capsys) -> None:
    code, _, err = run(capsys, "report", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "report", str(empty))
    assert code == 1 and "is empty: nothing to report" in err
    (empty / "notes.txt").write_text("x")
    code, out, _ = run(capsys, "report", str(empty), "--json")
    assert code == 1 and "no checkpoints and no history" in json.loads(out)["error"]
    code, _, err = run(capsys, "report", str(root / "step_000000010"))
    assert code == 2 and "is a checkpoint, not a directory of checkpoints" in err
    code, _, err = run(capsys, "report", str(root), "--output", str(tmp_path / "no" / "x.html"))
    assert code == 2 and "could not write" in err


def test_the_other_verbs_ignore_the_history(root, capsys) -> None:
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert code == 0 and [r["name"] for r in json.loads(out)] == [
        "step_000000010",
        "step_000000020",
        "step_000000030",
    ]
    code, _, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--leftover-grace", "0")
    assert code == 0 and len(list((root / HISTORY_DIR).iterdir())) == 10
    code, out, _ = run(capsys, "report", str(root))
    assert "1 deleted by retention or prune" in out  # step 10, known from its commit event


def test_report_imports_neither_torch_nor_lightning(root, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    code = (
        "import sys\nfrom lightning_elastic.cli import main\n"
        f"assert main(['report', {str(root)!r}, '--output', {str(tmp_path / 'r.html')!r}]) == 0\n"
        "print('\\n'.join(sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    loaded = set(out.split())
    assert "matplotlib" in loaded and "torch" not in loaded and "lightning" not in loaded


# ----------------------------------------------------------------------------- a realistic run


def realistic_report() -> dict:
    """A 5-hour run of a 1.1 GB model, checkpoint every 500 steps, keep the last 3: killed
    at step 6,120 (a node lost: 4 -> 2 ranks); the newest checkpoint fails verification and
    the resume falls back to step 5,500; a planned resize to 3 ranks at step 8,300."""
    t0, gb = 1_796_000_000.0, 1_100_000_000
    noise = random.Random(0)
    events: list[Event] = []
    infos: dict[str, tuple[CheckpointInfo, str, str | None]] = {}

    def event(kind: str, t: float, session: str, **fields) -> None:
        events.append(Event(kind, t, RUN, session, fields))

    def session(
        name: str, start: float, first: int, last: int, world: int, s_per_step: float
    ) -> float:
        t = start
        for step in range(first, last + 1):
            t += s_per_step
            if step % 500 == 0 and step > first:
                ckpt = f"step_{step:09d}" + ("-1" if f"step_{step:09d}" in infos else "")
                blocked = 0.16 + 0.06 * noise.random()
                write_s = 5.5 + 2.0 * noise.random() + 4.0 / world
                event(
                    "commit",
                    t,
                    name,
                    name=ckpt,
                    step=step,
                    bytes=gb,
                    blocked_s=blocked,
                    commit_s=write_s,
                    world_size=world,
                    retained_bytes=gb * min(3, len([e for e in events if e.kind == "commit"]) + 1),
                    retained=3,
                )
                infos[ckpt] = (
                    _manifest_info(ckpt, step, t, world, gb, blocked, write_s),
                    "valid",
                    None,
                )
                if sum(v[1] == "valid" for v in infos.values()) > 3:
                    infos.pop(next(n for n, v in infos.items() if v[1] == "valid"))
            if step % 100 == 0:
                event("progress", t, name, step=step)
        return t

    event("start", t0, "s1", step=0, world_size=4, hosts=["node0", "node0", "node1", "node1"])
    event(
        "straggler",
        t0 + 3600,
        "s1",
        step=3000,
        rank=2,
        host="node1",
        factor=1.9,
        local_s=2.3,
        median_s=1.2,
        where="step",
    )
    killed = session("s1", t0, 0, 6120, 4, 1.2)
    bad = "step_000006000"
    infos[bad] = (infos[bad][0], "corrupt", "quarantined: x-rank00001.distcp: checksum mismatch")
    restart = killed + 170
    event(
        "start",
        restart,
        "s2",
        step=5500,
        world_size=2,
        hosts=["node0", "node0"],
        resumed_from="step_000005500",
        resumed_step=5500,
    )
    event(
        "resume",
        restart + 30,
        "s2",
        checkpoint="step_000005500",
        checkpoint_step=5500,
        interrupted_step=6120,
        interrupted_time=killed,
        lost_steps=620,
        lost_s=killed - infos["step_000005500"][0].created_unix,
        planned=False,
        world_size=2,
        previous_world_size=4,
        recovery={
            "startup_s": 9.1,
            "setup_s": 5.4,
            "select_s": 0.3,
            "verify_s": 4.2,
            "load_s": 7.9,
            "first_step_s": 2.6,
        },
    )
    event("save_failed", restart + 1800, "s2", step=6500, phase="write", error="ENOSPC")
    planned = session("s2", restart + 30, 5500, 8300, 2, 2.3)
    event("end", planned, "s2", step=8300, reason="planned resize")
    event(
        "start",
        planned + 40,
        "s3",
        step=8300,
        world_size=3,
        hosts=["node0"] * 2 + ["node2"],
        resumed_from="step_000008300",
        resumed_step=8300,
    )
    event(
        "resume",
        planned + 55,
        "s3",
        checkpoint="step_000008300",
        checkpoint_step=8300,
        interrupted_step=8300,
        interrupted_time=planned,
        lost_steps=0,
        lost_s=0.0,
        planned=True,
        world_size=3,
        previous_world_size=2,
        recovery={
            "startup_s": 3.8,
            "setup_s": 2.1,
            "select_s": 0.2,
            "verify_s": 4.1,
            "load_s": 6.8,
            "first_step_s": 1.9,
        },
    )
    event(
        "cadence",
        planned + 600,
        "s3",
        step=8600,
        interval_s=1560.0,
        cost_s=0.21,
        mtbf_s=14400.0,
        bound="young_daly",
    )
    done = session("s3", planned + 55, 8300, 10500, 3, 1.6)
    event("end", done, "s3", step=10500, reason="max_steps")
    events.sort(key=lambda e: e.time)
    rows = [CheckpointRow(i, s, p) for i, s, p in infos.values()]
    return build_report("/data/runs/demo/checkpoints", rows, events, now=done + 60)


def _manifest_info(
    name: str, step: int, t: float, world: int, size: int, blocked: float, write_s: float
) -> CheckpointInfo:
    per_rank = size // world
    manifest = Manifest(
        run_id=RUN,
        save_id=f"{step:016x}",
        name=name,
        step=step,
        epoch=step // 1000,
        created_unix=t,
        world_size=world,
        ranks=tuple(
            RankRecord(r, f"node{r // 2}", 100 + r, r % 2, per_rank, blocked, 5.0)
            for r in range(world)
        ),
        files=tuple(
            FileRecord(f"{step:016x}-rank{r:05d}.distcp", per_rank, "0" * 16, r)
            for r in range(world)
        ),
        checksum_algorithm="xxh3_64",
        timings=Timings(blocked, write_s - 0.3, 0.05, write_s),
        versions={},
    )
    return CheckpointInfo(name, f"/data/runs/demo/checkpoints/{name}", VALID, manifest)


def test_a_realistic_run_renders_every_panel() -> None:
    pytest.importorskip("matplotlib")
    report = realistic_report()
    text = render_text(report)
    assert "resumes: 2" in text and "world size 4 -> 2 -> 3" in text
    assert "lost 620 steps" in text and "(planned)" in text and "1 corrupt" in text
    png = overview_png(report)
    assert png is not None and png.startswith(b"\x89PNG")


if __name__ == "__main__":
    Path(sys.argv[1]).write_bytes(overview_png(realistic_report(), dpi=80) or b"")
    print(render_text(realistic_report()))


def test_a_resume_whose_lost_work_is_unknown_is_not_counted_as_nothing_lost(root, capsys) -> None:
    storage = Storage(str(root))
    third = RunHistory(storage, run_id=RUN, session="third")
    third.record(
        "resume",
        checkpoint="step_000000030",
        checkpoint_step=30,
        interrupted_step=None,
        interrupted_time=None,
        lost_steps=None,
        lost_s=None,
        planned=False,
        world_size=1,
        previous_world_size=1,
        recovery={},
    )
    code, out, _ = run(capsys, "report", str(root))
    assert code == 0
    assert "lost work: 5 steps" in out and "(unknown for 1:" in out
    code, out, _ = run(capsys, "report", str(root), "--json")
    assert json.loads(out)["totals"]["lost_unknown"] == 1


def test_hand_edited_values_no_run_produces_never_reach_the_sums_or_break_the_page(
    root, tmp_path, capsys
) -> None:
    hostile = RunHistory(Storage(str(root)), run_id=RUN, session="evil")
    hostile.record("start", step=0, world_size=10**30, hosts=["x"], resumed_from=None)
    hostile.record(
        "resume",
        checkpoint="step_000000010",
        checkpoint_step=10,
        lost_steps=-500,
        lost_s=-1e300,
        planned=False,
        world_size=1,
        previous_world_size=1,
        recovery={},
    )
    page = tmp_path / "page.html"
    code, out, _ = run(capsys, "report", str(root), "--output", str(page), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["totals"]["lost_steps"] == 5  # the -500 is unknown, not subtracted
    assert page.exists()


def test_a_planned_rollback_is_listed_but_not_summed_as_lost(root, capsys) -> None:
    later = RunHistory(Storage(str(root)), run_id=RUN, session="later")
    later.record(
        "resume",
        checkpoint="step_000000010",
        checkpoint_step=10,
        interrupted_step=40,
        lost_steps=30,
        lost_s=20.0,
        planned=True,
        world_size=1,
        previous_world_size=1,
        recovery={},
    )
    code, out, _ = run(capsys, "report", str(root))
    assert code == 0 and "lost 30 steps" in out and "(planned)" in out
    assert "lost work: 5 steps, 3.00 s over 1 unplanned interruption(s)" in out


def test_retained_now_is_what_the_valid_checkpoints_present_hold(root, capsys) -> None:
    import shutil

    shutil.rmtree(root / "step_000000030")  # deleted by hand after the last commit record
    code, out, _ = run(capsys, "report", str(root))
    assert code == 0
    assert "storage: 6.0 KiB retained now, peak 18.0 KiB (commit records)" in out
