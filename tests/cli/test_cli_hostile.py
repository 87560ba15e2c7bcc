"""The CLI on what users really point it at: wrong paths, damaged checkpoints, hand-edited
manifests, closed pipes, scripts that parse --json. Never a traceback; always a line that
says what the path is and what to run instead."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_elastic import Storage, cli
from lightning_elastic.cli import main
from lightning_elastic.cli.checks import NoBar, progress_bar
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest, Timings
from lightning_elastic.errors import StoragePermissionError
from tests.cli.test_cli import checkpoint_dirs, flip_byte, populate, run


@pytest.fixture
def root(tmp_path: Path) -> Path:
    populate(str(tmp_path / "root"))
    return tmp_path / "root"


def shard_of(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def assert_json_only(out: str) -> Any:
    return json.loads(out)  # the whole of stdout is one JSON document


# ----------------------------------------------------------------------------- paths


def test_ls_on_a_missing_path_is_an_error(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "ls", str(tmp_path / "nope"))
    assert code == 2 and out == "" and "does not exist" in err


def test_ls_on_a_file_or_a_checkpoint_says_what_it_is(root, capsys) -> None:
    code, _, err = run(capsys, "ls", str(root / "step_000000001" / MANIFEST_FILE))
    assert code == 2 and "is a file" in err and "inspect" in err
    code, _, err = run(capsys, "ls", str(root / "step_000000001"))
    assert code == 2 and "is a checkpoint" in err
    assert f"lightning-elastic inspect {root / 'step_000000001'}" in err


def test_ls_on_an_empty_root_says_it_is_empty(tmp_path, capsys) -> None:
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert code == 0 and "is empty" in out
    code, out, _ = run(capsys, "ls", str(tmp_path), "--json")
    assert code == 0 and assert_json_only(out) == []


def test_ls_ignores_folders_that_are_not_checkpoints(root, capsys) -> None:
    (root / "logs").mkdir()
    (root / "logs" / "events.txt").write_text("x")
    _, out, _ = run(capsys, "ls", str(root), "--json")
    assert [r["name"] for r in assert_json_only(out)] == [f"step_00000000{i}" for i in (1, 2, 3)]


def test_inspect_on_a_root_points_to_ls_and_a_checkpoint(root, capsys) -> None:
    code, out, err = run(capsys, "inspect", str(root))
    assert code == 2 and out == ""
    assert "checkpoint root holding 3" in err and f"lightning-elastic ls {root}" in err
    assert str(root / "step_000000003") in err


def test_inspect_on_an_unrelated_or_empty_folder_says_so(tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2 and "not a checkpoint" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "inspect", str(tmp_path / "empty"))
    assert code == 2 and "empty" in err
    code, _, err = run(capsys, "inspect", "/")
    assert code == 2 and err.startswith("error: ")


def test_inspect_takes_a_bare_relative_name(root, capsys, monkeypatch) -> None:
    monkeypatch.chdir(root)
    code, out, _ = run(capsys, "inspect", "step_000000002")
    assert code == 0 and "step 2" in out
    monkeypatch.chdir(root / "step_000000002")
    code, out, _ = run(capsys, "inspect", ".")
    assert code == 0 and "step 2" in out


# ----------------------------------------------------------------------------- what is checked


def test_ls_and_inspect_check_sizes_and_say_checksums_were_not_read(root, capsys) -> None:
    truncate(shard_of(root / "step_000000001"))
    flip_byte(shard_of(root / "step_000000002"))  # same size: only a checksum sees it
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and "checksums not read" in out and "size is" in out
    rows = assert_json_only(run(capsys, "ls", str(root), "--json")[1])
    assert [(r["status"], r["checked"]) for r in rows] == [
        ("corrupt", "size"),
        ("valid", "size"),
        ("valid", "size"),
    ]
    rows = assert_json_only(run(capsys, "ls", str(root), "--json", "--check", "full")[1])
    assert [r["status"] for r in rows] == ["corrupt", "corrupt", "valid"]
    _, out, _ = run(capsys, "ls", str(root), "--check", "none")
    assert out.count("valid (manifest only)") == 3

    _, out, _ = run(capsys, "inspect", str(root / "step_000000002"))
    assert "valid (sizes checked)" in out and "checksums not read" in out
    _, out, _ = run(capsys, "inspect", str(root / "step_000000002"), "--check", "full")
    assert "corrupt" in out and "checksum" in out
    _, out, _ = run(capsys, "inspect", str(root / "step_000000001"))
    assert "corrupt" in out and "size is" in out


# ----------------------------------------------------------------------------- prune


def test_prune_never_deletes_a_checkpoint_whose_sizes_do_not_match(root, capsys) -> None:
    truncate(shard_of(root / "step_000000001"))
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 0
    assert checkpoint_dirs(root) == ["step_000000001", "step_000000003"]
    assert "1 deleted" not in out and "1 checkpoint(s) deleted" in out
    assert "1 corrupt and 0 incomplete left alone" in out and "left alone: " in out


def test_prune_keeps_the_newest_intact_checkpoint_when_the_newest_is_damaged(root, capsys) -> None:
    truncate(shard_of(root / "step_000000003"))
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--json")
    body = assert_json_only(out)
    assert code == 0 and [d["step"] for d in body["deleted"]] == [1]
    assert [r["step"] for r in body["left_alone"]] == [3] and body["kept_valid"] == 1
    assert checkpoint_dirs(root) == ["step_000000002", "step_000000003"]


def test_prune_summary_counts_what_it_did(root, capsys) -> None:
    (root / "step_000000002" / MANIFEST_FILE).unlink()
    _, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--dry-run")
    assert "1 checkpoint(s) to delete, 1 valid kept" in out
    assert "0 corrupt and 1 incomplete left alone" in out


def test_prune_reports_a_failed_deletion(root, capsys, monkeypatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise StoragePermissionError("delete", "x", "permission denied")

    monkeypatch.setattr(cli.prune, "delete_checkpoint", refuse)
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 1 and "could not delete" in out and "2 failed to delete" in out
    assert "0 checkpoint(s) deleted" in out


# ----------------------------------------------------------------------------- --json


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "{tmp}/nope"],
        ["verify", "{tmp}"],  # empty: nothing to verify
        ["verify", "{tmp}", "--mode", "bogus"],
        ["ls", "{tmp}", "-o", "no-equals-sign"],
        ["prune", "{tmp}", "--keep-last", "0"],
        ["inspect", "{tmp}"],
    ],
)
def test_every_error_in_json_mode_is_json(tmp_path, capsys, argv) -> None:
    code, out, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv], "--json")
    body = assert_json_only(out)
    assert code in (1, 2) and body["exit_code"] == code and body["error"] and err == ""


def test_verify_json_reports_corruption_as_json_only(root, capsys) -> None:
    truncate(shard_of(root / "step_000000002"))
    code, out, err = run(capsys, "verify", str(root), "--json")
    rows = assert_json_only(out)
    assert code == 1 and err == "" and [r["status"] for r in rows] == ["valid", "corrupt", "valid"]


def test_exit_codes_are_documented() -> None:
    doc = cli.__doc__ or ""
    assert "Exit codes" in doc and all(f"* {c}:" in doc for c in (0, 1, 2, 3))


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "{root}", "--keep-last", "-1"],
        ["prune", "{root}", "--keep-last", "two"],
        ["prune", "{root}", "--keep-last", "1", "--keep-every-n-steps", "0"],
        ["ls", "{root}", "-o", "=1"],
        ["ls", "{root}", "--check", "everything"],
        ["frobnicate", "{root}"],
        ["consolidate", "{root}/step_000000001", "{root}/no/such/dir/out.pt"],
        ["consolidate", "{root}/step_000000001", "{root}"],
        ["consolidate", "{root}", "{root}/out.pt"],
        ["verify", "{root}/step_000000001/manifest.json"],
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(root, capsys, argv) -> None:
    code, out, err = run(capsys, *[a.format(root=root) for a in argv])
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--keep-last", "1" + "0" * 400),
        ("--keep-last", "1e3"),  # not a whole number: said with the range, as 0 is
        ("--keep-every-n-steps", "2.0"),
        ("--keep-every-n-steps", str(2**62 + 1)),
        ("--leftover-grace", "nan"),
        ("--leftover-grace", "inf"),
        ("--leftover-grace", "1e400"),
        ("--leftover-grace", "-1"),
        ("--leftover-grace", str(10**400)),
        ("--leftover-grace", "soon"),
    ],
)
def test_numeric_flags_refuse_values_they_cannot_represent(root, capsys, flag, value) -> None:
    """A grace of NaN or -1 used to run: -1 collected other jobs' saves in flight as leftovers."""
    before = checkpoint_dirs(root)
    keep = [] if flag == "--keep-last" else ["--keep-last", "1"]
    code, out, err = run(capsys, "prune", str(root), *keep, flag, value)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"argument {flag}" in err and value[:20] in err, err
    assert re.search(r"in \[\S+, \S+\]", err), err  # the allowed range
    assert checkpoint_dirs(root) == before


def test_an_unreadable_manifest_is_a_row_not_a_crash(root, capsys, monkeypatch) -> None:
    real = type(Storage(str(root))).read_bytes

    def read_bytes(self: Any, rel: str, *args: Any, **kwargs: Any) -> bytes:
        if rel.startswith("step_000000002/"):
            raise StoragePermissionError("read", rel, "permission denied")
        return real(self, rel, *args, **kwargs)

    monkeypatch.setattr(type(Storage(str(root))), "read_bytes", read_bytes)
    code, out, _ = run(capsys, "ls", str(root), "--json")
    rows = {r["step"]: r for r in assert_json_only(out)}
    assert code == 0 and rows[2]["status"] == "corrupt" and "permission" in rows[2]["problem"]
    code, _, err = run(capsys, "verify", str(root))
    assert code == 1 and "permission" in err


def test_an_unexpected_error_is_one_line_unless_debugging(root, capsys, monkeypatch) -> None:
    def boom(*_: object) -> None:
        raise RuntimeError("something odd")

    monkeypatch.setattr(cli.ls, "scan_root", boom)
    code, _, err = run(capsys, "ls", str(root))
    assert code == 3 and "RuntimeError: something odd" in err and err.count("\n") == 1
    monkeypatch.setenv("LIGHTNING_ELASTIC_DEBUG", "1")
    with pytest.raises(RuntimeError):
        main(["ls", str(root)])


# ----------------------------------------------------------------------------- hand-edited


def _canonical_digest(body: dict[str, Any]) -> str:
    # The manifest's own checksum (see core/format/manifest.py): recomputed so the edit
    # reaches the field validators instead of failing the checksum.
    content = {k: v for k, v in body.items() if k not in ("manifest_checksum", "hmac")}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _edit(manifest: Path, key: str, value: Any) -> None:
    body = json.loads(manifest.read_text())
    target = body
    *parents, last = key.split(".")
    for part in parents:
        target = target[part]
    target[last] = value
    with contextlib.suppress(ValueError):  # NaN: no checksum matches, it is corrupt anyway
        body["manifest_checksum"] = _canonical_digest(body)
    manifest.write_text(json.dumps(body))  # allow_nan: writes NaN/Infinity as a user might


EDITS = [
    ("created_unix", math.nan),
    ("created_unix", 1e300),
    ("created_unix", -5),
    ("created_unix", "yesterday"),
    ("timings.staging_s", "slow"),
    ("step", "7"),
    ("files", "none"),
    ("metrics", {"loss": "high"}),
    ("versions", [1, 2]),
]


@pytest.mark.parametrize(("key", "value"), EDITS, ids=[f"{k}={v!r}" for k, v in EDITS])
@pytest.mark.parametrize("version", [1, 2])
def test_hand_edited_manifests_never_crash_a_verb(root, capsys, key, value, version) -> None:
    manifest = root / "step_000000002" / MANIFEST_FILE
    if version == 1:
        _edit(manifest, "format_version", 1)
    _edit(manifest, key, value)
    for argv in (
        ["ls", str(root)],
        ["inspect", str(manifest.parent)],
        ["verify", str(root), "--mode", "size"],
        ["prune", str(root), "--keep-last", "1", "--dry-run"],
    ):
        code, _, err = run(capsys, *argv)
        assert code in (0, 1) and "Traceback" not in err, (argv, err)
        code, out, _ = run(capsys, *argv, "--json")
        assert code in (0, 1)
        assert_json_only(out)


def test_garbage_manifest_files_are_corrupt_rows(root, capsys) -> None:
    (root / "step_000000001" / MANIFEST_FILE).write_bytes(b"\xff\xfe\x00garbage")
    (root / "step_000000002" / MANIFEST_FILE).write_text("[1, 2, 3]")
    rows = assert_json_only(run(capsys, "ls", str(root), "--json")[1])
    assert [r["status"] for r in rows] == ["corrupt", "corrupt", "valid"]


@pytest.fixture
def lenient_parser(monkeypatch):
    """The manifest parser letting anything through (as it did before it was made strict):
    the CLI must not depend on the parser for its own safety."""
    real = Manifest.from_json.__func__  # type: ignore[attr-defined]
    weird: dict[str, Any] = {}

    def from_json(cls: type[Manifest], text: Any, where: str, *a: Any, **k: Any) -> Manifest:
        manifest = real(cls, text, where, *a, **k)
        return dataclasses.replace(manifest, **weird) if manifest.step == 2 else manifest

    monkeypatch.setattr(Manifest, "from_json", classmethod(from_json))
    return weird


@pytest.mark.parametrize(
    "weird",
    [
        {"created_unix": math.nan},
        {"created_unix": 1e300},
        {"created_unix": "now"},
        {"timings": Timings("a", "b", "c", "d")},  # type: ignore[arg-type]
        {"step": "2", "sequence": None},
        {"metrics": {"loss": "high"}, "versions": {"torch": None}},
    ],
    ids=["nan", "1e300", "string-time", "string-timings", "string-step", "string-metric"],
)
def test_the_cli_formats_whatever_a_lenient_parser_returns(
    root, capsys, lenient_parser, weird
) -> None:
    lenient_parser.update(weird)
    for argv in (
        ["ls", str(root)],
        ["ls", str(root), "--json"],
        ["inspect", str(root / "step_000000002")],
        ["inspect", str(root / "step_000000002"), "--json"],
        ["verify", str(root), "--mode", "size", "--json"],
        ["prune", str(root), "--keep-last", "1", "--dry-run"],
    ):
        code, out, err = run(capsys, *argv)
        assert code in (0, 1) and err.count("Traceback") == 0, (argv, err)
        if "--json" in argv:
            assert_json_only(out)


def test_a_manifest_with_fields_decisions_need_broken_is_never_pruned(
    root, capsys, lenient_parser
) -> None:
    lenient_parser.update({"step": "2"})
    run(capsys, "prune", str(root), "--keep-last", "1")
    assert checkpoint_dirs(root) == ["step_000000002", "step_000000003"]


# ----------------------------------------------------------------------------- processes


def _cli(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_elastic.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


@pytest.mark.parametrize("as_json", [False, True])
def test_a_closed_pipe_prints_no_traceback(root, as_json) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_elastic.cli", "ls", str(root)]
            + (["--json"] if as_json else []),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 141


def test_ls_into_head_prints_no_traceback(root, tmp_path) -> None:
    for i in range(4, 40):  # enough rows to fill a pipe buffer is not needed: head exits
        (root / f"step_{i:09d}").mkdir()
        (root / f"step_{i:09d}" / "_staging.json").write_text("{}")
    proc = subprocess.run(
        f"{sys.executable} -m lightning_elastic.cli ls {root} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.startswith("NAME") and "Traceback" not in proc.stderr


def test_progress_is_quiet_without_a_terminal_and_shown_when_asked(root) -> None:
    quiet = _cli("verify", str(root))
    assert quiet.returncode == 0 and quiet.stderr == ""
    shown = _cli("verify", str(root), "--progress")
    assert shown.returncode == 0 and "verifying" in shown.stderr


def test_consolidate_shows_progress_when_asked(root, tmp_path, capsys) -> None:
    out_file = tmp_path / "model.pt"
    code, _, err = run(
        capsys, "consolidate", str(root / "step_000000003"), str(out_file), "--progress"
    )
    assert code == 0 and out_file.exists() and "reading" in err and "writing" in err
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_progress_defaults_to_a_bar_only_on_a_terminal(monkeypatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    args = argparse.Namespace(progress=None)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(progress_bar(args, 10, "x"), NoBar)
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress_bar(args, 10, "x")
    assert not isinstance(bar, NoBar)
    bar.close()
    assert isinstance(progress_bar(argparse.Namespace(progress=False), 10, "x"), NoBar)
