"""Manifests as an attacker, a bit flip or a hand edit leaves them (issue #8, items 5 and 6).

A manifest carries a checksum of its own canonical content (and an HMAC when
``LIGHTNING_ELASTIC_HMAC_KEY`` is set), and is validated strictly: types, ranges, plain file
names, known format and version. Whatever fails is ``corrupt`` everywhere: in
``Catalog.scan()``, in every CLI verb (a row or one line, never a traceback) and for resume,
which sets it aside and falls back to the newest valid checkpoint instead of raising.

The hand edits below recompute the self-checksum (as a user with an editor and this file
would), so what is tested is the validation, not only the checksum.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# from the defining modules: mypy --strict does not see the lazy top-level re-exports
from lightning_elastic.cli import main
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import CORRUPT, VALID, Catalog, CheckpointInfo
from lightning_elastic.core.format.manifest import MANIFEST_FILE, QUARANTINE_FILE, Manifest
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointWarning,
    ElasticCheckpointError,
    ManifestError,
    UnsupportedFormatError,
)

KEY_ENV = "LIGHTNING_ELASTIC_HMAC_KEY"
OLD, NEW = "step_000000001", "step_000000002"  # NEW is the one the tests damage
DELETE = object()  # an edit that removes the key
OWN_CHECKSUM = "does not match its own checksum"  # the self-checksum's complaint


# ----------------------------------------------------------------------------- helpers


def canonical(body: dict[str, Any]) -> bytes:
    # The manifest's canonical content (core/format/manifest.py), recomputed independently.
    content = {k: v for k, v in body.items() if k not in ("manifest_checksum", "hmac")}
    return json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(body)).hexdigest()


def read_body(root: Path, name: str = NEW) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((root / name / MANIFEST_FILE).read_text())
    return body


def write_body(root: Path, body: dict[str, Any], *, name: str = NEW, recompute: bool) -> bool:
    """Write ``body`` as the manifest of ``name``; whether its checksum was made to match."""
    matches = False
    if recompute:
        try:
            body["manifest_checksum"] = digest(body)
            matches = True
        except ValueError:
            pass  # NaN/Infinity: canonical JSON cannot hold it, so no checksum can match
    # allow_nan: NaN/Infinity land in the file as a user's tool would write them
    (root / name / MANIFEST_FILE).write_text(json.dumps(body, indent=1))
    return matches


def apply_edit(body: dict[str, Any], key: str, value: Any) -> None:
    """Set (or with ``DELETE`` remove) ``key``, a dotted path with list indices; a callable
    ``value`` gets the whole body instead."""
    if callable(value):
        value(body)
        return
    *parents, last = key.split(".")
    target: Any = body
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if isinstance(target, list):
        target[int(last)] = value
    elif value is DELETE:
        del target[last]
    else:
        target[last] = value


def scan(root: Path) -> dict[str, CheckpointInfo]:
    return {i.name: i for i in Catalog(Storage(str(root))).scan()}


def template() -> dict[str, Any]:
    return {"w": torch.zeros(4), "step": None}


def resume(root: Path) -> tuple[str | None, dict[str, Any]]:
    """What a restarted job gets: (the checkpoint it resumed from, the loaded state)."""
    loaded = template()
    with CheckpointEngine(root) as eng:
        eng.load(loaded)
        return eng.resumed_from, loaded


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def populate(root: Path) -> None:
    with CheckpointEngine(root) as eng:
        for step in (1, 2):
            handle = eng.save(
                {"w": torch.full((4,), float(step)), "step": step},
                step=step,
                epoch=0,
                metrics={"loss": 1.0 / step},
                metadata={"note": "original"},
            )
            assert handle is not None
            handle.result()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "ckpts"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(KEY_ENV, raising=False)
        populate(root)
    return root


@pytest.fixture
def root(pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(KEY_ENV, raising=False)
    copy = tmp_path / "ckpts"
    shutil.copytree(pristine, copy)
    return copy


def assert_corrupt_everywhere(
    root: Path, capsys: pytest.CaptureFixture[str], problem: str = ""
) -> None:
    """NEW is corrupt for the catalog and every CLI verb (rows, exit codes as cli.py
    documents them, never a traceback), and OLD is still valid. Leaves the files as found."""
    info = scan(root)[NEW]
    assert info.status == CORRUPT and info.manifest is None, info
    assert info.problem and problem in info.problem, info.problem
    assert scan(root)[OLD].status == VALID
    ckpt = str(root / NEW)
    expected = [
        (["ls", str(root)], 0),
        (["ls", str(root), "--check", "none"], 0),
        (["inspect", ckpt], 0),
        (["verify", str(root)], 1),
        (["verify", ckpt], 1),
        (["verify", str(root), "--mode", "size"], 1),
        (["prune", str(root), "--keep-last", "1", "--dry-run"], 0),
    ]
    for argv, code in expected:
        got, out, err = cli(capsys, *argv)
        assert got == code, (argv, got, out, err)
        assert "Traceback" not in out + err, (argv, err)
        assert all(line.startswith("error: ") for line in err.splitlines()), (argv, err)
        assert len(err.splitlines()) <= 1, (argv, err)
        if argv[0] != "prune":
            assert "corrupt" in out, (argv, out)
        got, out, err = cli(capsys, *argv, "--json")
        assert got == code and "Traceback" not in err, (argv, got, err)
        rows = json.loads(out)  # stdout is one JSON document
        if argv[0] in ("ls", "verify") and argv[1] == str(root):
            status = {r["name"]: r["status"] for r in rows}
            assert status == {OLD: "valid", NEW: "corrupt"}, (argv, rows)
        elif argv[0] in ("inspect", "verify"):
            row = rows[0] if isinstance(rows, list) else rows
            assert row["status"] == "corrupt", (argv, rows)
    assert (root / NEW / MANIFEST_FILE).exists()  # a dry run and a check touch nothing
    assert not (root / NEW / QUARANTINE_FILE).exists()


def assert_resume_falls_back(root: Path, *, quarantined: bool = True) -> None:
    """Resume warns about NEW and loads OLD; a damaged NEW is quarantined (``quarantined``:
    not required for an HMAC refusal, which a wrong key alone can cause)."""
    with pytest.warns(CorruptCheckpointWarning, match=NEW):
        resumed, loaded = resume(root)
    assert resumed == OLD and loaded["step"] == 1 and torch.equal(loaded["w"], torch.ones(4))
    if quarantined:
        assert (root / NEW / QUARANTINE_FILE).exists()


# ----------------------------------------------------------------------------- item 6: strict


def _duplicate_file(body: dict[str, Any]) -> None:
    body["files"].append(dict(body["files"][0]))


def _drop_dcp_metadata_file(body: dict[str, Any]) -> None:
    body["files"] = [f for f in body["files"] if f["path"] != body["dcp_metadata"]]


EDITS: list[Any] = [
    # wrong types
    ("step", "7"),
    ("step", 1.5),
    ("step", True),
    ("step", None),
    ("epoch", "0"),
    ("created_unix", "yesterday"),
    ("timings", [0.1, 0.2, 0.3, 0.4]),
    ("timings.staging_s", "slow"),
    ("timings.total_s", None),
    ("versions", ["torch", "2.0"]),
    ("versions.torch", 2),
    ("metrics", [0.5]),
    ("metrics.loss", "high"),
    ("metrics.loss", True),
    ("metadata", ["note"]),
    ("metadata", "note"),
    ("ranks", {"0": {}}),
    ("ranks.0", "rank zero"),
    ("ranks.0.pid", "1234"),
    ("ranks.0.host", 5),
    ("files", "none"),
    ("files", {}),
    ("files.0", ["a.distcp", 10, "ff"]),
    ("files.0.size", "10"),
    ("files.0.size", 10.0),
    ("world_size", "1"),
    ("run_id", 7),
    ("save_id", None),
    ("sequence", "3"),
    ("sequence", 1.5),
    ("generation", "1"),
    ("parent", 5),
    ("parent", ["step_000000001"]),
    # missing fields
    ("step", DELETE),
    ("run_id", DELETE),
    ("files", DELETE),
    ("timings", DELETE),
    ("world_size", DELETE),
    ("timings.commit_s", DELETE),
    ("files.0", {"path": "x.distcp"}),
    # non-finite and absurd numbers
    ("created_unix", math.nan),
    ("created_unix", math.inf),
    ("created_unix", 1e300),
    ("created_unix", -5.0),
    ("timings.writing_s", math.nan),
    ("timings.total_s", -1.0),
    ("timings.commit_s", 1e300),
    ("metrics.loss", math.nan),
    ("metrics.loss", math.inf),
    ("ranks.0.staging_s", -math.inf),
    ("ranks.0.bytes_written", -1),
    ("step", -1),
    ("step", 2**63),
    ("epoch", -1),
    ("files.0.size", -1),
    ("files.0.size", 2**70),
    ("files.0.rank", 5),
    ("ranks.0.rank", 5),
    ("world_size", 0),
    ("world_size", -1),
    ("world_size", 2**63),
    pytest.param("world_size", 2**40, id="world_size=2**40"),
    ("sequence", -1),
    ("sequence", 2**63),
    ("generation", -1),
    # file names that leave the checkpoint directory or are not names
    ("files.0.path", "../escape.distcp"),
    ("files.0.path", "../../etc/passwd"),
    ("files.0.path", "/etc/passwd"),
    ("files.0.path", "sub/shard.distcp"),
    ("files.0.path", "sub\\shard.distcp"),
    ("files.0.path", ".."),
    ("files.0.path", "."),
    ("files.0.path", ""),
    ("files.0.path", "nul\x00.distcp"),
    ("name", "../step_000000002"),
    ("name", "/tmp/step_000000002"),
    ("dcp_metadata", "../dcp_metadata.json"),
    ("dcp_metadata", "missing-dcp_metadata.json"),
    ("parent", "../../step_000000001"),
    ("resumed_from", "/abs/step_000000001"),
    ("resumed_from", "a/b"),
    # inconsistent content
    ("files", _duplicate_file),
    ("files", _drop_dcp_metadata_file),
    ("files.0.checksum", "NOT-HEX"),
    ("files.0.checksum", ""),
    ("files.0.checksum", "f" * 129),
    # unknown layout, format or version
    ("format", "other.tool.checkpoint"),
    ("format", DELETE),
    ("format_version", "2"),
    ("format_version", 2.0),
    ("format_version", True),
    ("format_version", None),
    ("format_version", DELETE),
    pytest.param("format_version", 0, id="format_version=0"),
    pytest.param("format_version", -1, id="format_version=-1"),
    ("compression", "lz4"),
    ("checksum_algorithm", "md5"),
    ("checksum_algorithm", None),
]


def _edit_id(edit: Any) -> str:
    key, value = edit
    shown = "<deleted>" if value is DELETE else getattr(value, "__name__", None) or repr(value)
    return f"{key}={shown[:40]}"


@pytest.mark.parametrize(
    ("key", "value"),
    [pytest.param(*e, id=_edit_id(e)) if type(e) is tuple else e for e in EDITS],
)
def test_an_invalid_manifest_is_corrupt_everywhere_and_resume_falls_back(
    root: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any
) -> None:
    body = read_body(root)
    apply_edit(body, key, value)
    if write_body(root, body, recompute=True):  # then the validation, not the checksum, refuses
        assert OWN_CHECKSUM not in (scan(root)[NEW].problem or "")
    assert_corrupt_everywhere(root, capsys)
    assert_resume_falls_back(root)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"{", id="truncated"),
        pytest.param(b"[]", id="list"),
        pytest.param(b'"manifest"', id="string"),
        pytest.param(b"null", id="null"),
        pytest.param(b"42", id="number"),
        pytest.param(b"\xff\xfe\x00garbage", id="binary"),
        pytest.param(b'{"format": "lightning_elastic.checkpoint"}', id="only-format"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deeply-nested"),
        pytest.param(b'{"step": ' + b"7" * 5000 + b"}", id="5000-digit-int"),
    ],
)
def test_an_unparseable_manifest_is_corrupt_everywhere_and_resume_falls_back(
    root: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    (root / NEW / MANIFEST_FILE).write_bytes(content)
    assert_corrupt_everywhere(root, capsys)
    assert_resume_falls_back(root)


def test_a_newer_format_version_is_unsupported_not_silently_skipped(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = read_body(root)
    body["format_version"] = 99
    write_body(root, body, recompute=True)
    info = scan(root)[NEW]
    assert info.status == CORRUPT and info.unsupported and "99" in (info.problem or "")
    assert_corrupt_everywhere(root, capsys, problem="upgrade")
    with pytest.raises(UnsupportedFormatError, match="99"):
        resume(root)


def test_the_strict_parser_accepts_what_the_engine_writes(root: Path) -> None:
    for name in (OLD, NEW):
        text = (root / name / MANIFEST_FILE).read_text()
        manifest = Manifest.from_json(text, name)
        assert Manifest.from_json(manifest.to_json(), name) == manifest


# ----------------------------------------------------------------------------- item 5: checksum


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("step", 3),
        ("epoch", 1),
        ("run_id", "someone-else"),
        ("name", "step_000000009"),
        ("sequence", 99),
        ("parent", "step_000000009"),
        ("resumed_from", "step_000000001"),
        ("created_unix", 1.0),
        ("world_size", 2),
        ("files.0.size", 1),
        ("files.0.checksum", "0" * 16),
        ("metrics.loss", 0.001),
        ("metadata.note", "edited"),
        ("timings.total_s", 123.0),
        ("versions.torch", "0.0.1"),
        ("total_bytes", 1),
        ("generation", 7),
        ("compression", "zstd"),
        ("checksum_algorithm", "crc32"),
        ("metadata.extra", {"added": True}),
    ],
)
def test_an_edited_field_fails_the_manifests_own_checksum(
    root: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any
) -> None:
    body = read_body(root)
    apply_edit(body, key, value)
    write_body(root, body, recompute=False)
    assert_corrupt_everywhere(root, capsys, problem=OWN_CHECKSUM)
    # control: the same edit with the checksum recomputed passes the parser, so it was the
    # checksum that caught it
    write_body(root, body, recompute=True)
    assert scan(root)[NEW].status == VALID


def test_a_manifest_without_its_checksum_is_corrupt(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = read_body(root)
    del body["manifest_checksum"]
    write_body(root, body, recompute=False)
    assert_corrupt_everywhere(root, capsys, problem=OWN_CHECKSUM)
    assert_resume_falls_back(root)


def test_a_changed_checksum_is_corrupt(root: Path) -> None:
    body = read_body(root)
    body["manifest_checksum"] = "0" * 64
    write_body(root, body, recompute=False)
    assert scan(root)[NEW].status == CORRUPT
    assert_resume_falls_back(root)


def _format_version_digit(raw: bytes) -> int:
    marker = b'"format_version": '
    return raw.index(marker) + len(marker)


def test_every_single_bit_flip_of_a_manifest_is_refused(root: Path) -> None:
    raw = (root / NEW / MANIFEST_FILE).read_bytes()
    original = Manifest.from_json(raw, "original")
    accepted = []
    for i in range(len(raw)):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[i] ^= 1 << bit
            try:
                parsed = Manifest.from_json(bytes(flipped), "flipped")
            except ManifestError:
                continue
            if parsed != original:  # a flip that changes nothing (1e-05 -> 1E-05) is harmless
                accepted.append((i, bit, raw[max(0, i - 20) : i + 5]))
    assert accepted == []


def test_a_bit_flip_of_the_format_version_does_not_disable_the_checksum(root: Path) -> None:
    raw = bytearray((root / NEW / MANIFEST_FILE).read_bytes())
    digit = _format_version_digit(bytes(raw))
    assert raw[digit : digit + 1] == b"2"
    raw[digit] ^= 0x02  # -> b"0"
    text = bytes(raw).replace(b'"step": 2,', b'"step": 9,')
    (root / NEW / MANIFEST_FILE).write_bytes(text)
    assert scan(root)[NEW].status == CORRUPT


def test_a_downgraded_format_version_does_not_disable_the_checksum(root: Path) -> None:
    body = read_body(root)
    body["format_version"] = 1
    body["step"] = 9
    write_body(root, body, recompute=False)
    assert scan(root)[NEW].status == CORRUPT


# ----------------------------------------------------------------------------- item 5: HMAC


def signature(key: bytes, body: dict[str, Any]) -> str:
    return hmac.new(key, canonical(body), hashlib.sha256).hexdigest()


@pytest.fixture
def signed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Steps 1, 2 written with the key ``k1`` set (it stays set)."""
    monkeypatch.setenv(KEY_ENV, "k1")
    root = tmp_path / "signed"
    populate(root)
    return root


def test_with_a_key_manifests_carry_a_valid_hmac_and_load(
    signed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in (OLD, NEW):
        body = read_body(signed, name)
        assert body["hmac"] == signature(b"k1", body)
        assert body["manifest_checksum"] == digest(body)
    assert {i.status for i in scan(signed).values()} == {VALID}
    code, out, _ = cli(capsys, "verify", str(signed))
    assert code == 0 and out.count("valid") == 2
    code, out, _ = cli(capsys, "ls", str(signed), "--json")
    assert code == 0 and [r["status"] for r in json.loads(out)] == ["valid", "valid"]
    resumed, loaded = resume(signed)
    assert resumed == NEW and loaded["step"] == 2


def test_with_another_key_every_manifest_is_refused(
    signed: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "k2")
    infos = scan(signed)
    assert {i.status for i in infos.values()} == {CORRUPT}
    assert all("HMAC" in (i.problem or "") for i in infos.values())
    code, out, err = cli(capsys, "verify", str(signed))
    assert code == 1 and "HMAC" in err and "Traceback" not in err
    code, out, _ = cli(capsys, "ls", str(signed), "--json")
    assert code == 0 and [r["status"] for r in json.loads(out)] == ["corrupt", "corrupt"]
    with CheckpointEngine(signed) as eng, pytest.raises(ElasticCheckpointError, match="HMAC"):
        eng.load(template(), checkpoint=NEW)
    with (
        pytest.warns(CorruptCheckpointWarning, match="HMAC"),
        pytest.raises(CheckpointNotFoundError),
    ):
        resume(signed)


def test_a_wrong_key_does_not_quarantine_intact_checkpoints_for_good(
    signed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "k2")
    with (
        pytest.warns(CorruptCheckpointWarning),
        pytest.raises(CheckpointNotFoundError),
    ):
        resume(signed)
    monkeypatch.setenv(KEY_ENV, "k1")  # the operator fixes the job's environment
    assert resume(signed)[0] == NEW


def test_with_a_key_an_unsigned_manifest_is_refused(
    signed: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.rmtree(signed / NEW)
    monkeypatch.delenv(KEY_ENV)
    with CheckpointEngine(signed) as eng:  # a job without the key writes NEW again
        handle = eng.save({"w": torch.full((4,), 2.0), "step": 2}, step=2)
        assert handle is not None and handle.result().name == NEW
    assert "hmac" not in read_body(signed)
    assert scan(signed)[NEW].status == VALID  # without a key an HMAC is not required
    monkeypatch.setenv(KEY_ENV, "k1")
    with CheckpointEngine(signed) as eng, pytest.raises(ElasticCheckpointError, match="HMAC"):
        eng.load(template(), checkpoint=NEW)
    assert_corrupt_everywhere(signed, capsys, problem="HMAC")
    assert_resume_falls_back(signed, quarantined=False)


def _keep_stale_hmac(body: dict[str, Any]) -> None:
    pass


def _drop_hmac(body: dict[str, Any]) -> None:
    del body["hmac"]


def _sign_with_another_key(body: dict[str, Any]) -> None:
    body["hmac"] = signature(b"k2", body)


def _garbage_hmac(body: dict[str, Any]) -> None:
    body["hmac"] = 12345


@pytest.mark.parametrize(
    "forge", [_keep_stale_hmac, _drop_hmac, _sign_with_another_key, _garbage_hmac]
)
def test_an_edit_with_a_recomputed_checksum_but_no_valid_hmac_is_refused(
    signed: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    forge: Callable[[dict[str, Any]], None],
) -> None:
    body = read_body(signed)
    body["step"] = 9
    body["manifest_checksum"] = digest(body)
    forge(body)
    write_body(signed, body, recompute=False)
    assert_corrupt_everywhere(signed, capsys, problem="HMAC")
    with monkeypatch.context() as mp:  # control: only the HMAC refuses it
        mp.delenv(KEY_ENV)
        assert scan(signed)[NEW].status == VALID
    assert_resume_falls_back(signed, quarantined=False)


def test_with_a_key_a_format_version_flip_is_still_refused(signed: Path) -> None:
    body = read_body(signed)
    body["format_version"] = 1
    body["step"] = 9
    write_body(signed, body, recompute=False)
    info = scan(signed)[NEW]
    # the HMAC covers every version (so does the self-checksum, once fixed: see above)
    assert info.status == CORRUPT
    assert any(why in (info.problem or "") for why in ("HMAC", OWN_CHECKSUM)), info.problem
    assert_resume_falls_back(signed, quarantined=False)
