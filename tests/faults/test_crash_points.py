"""A crash at every storage operation of a 2-rank run: nothing partial is ever selectable, a
load gets the newest committed save or nothing, and the next save recovers cleanly.

One real run (2 gloo ranks, 3 async saves, ``KeepLastN(1)`` so retention deletes twice) saves
through a :class:`~lightning_elastic.testing.recording.RecordingFileSystem`; every prefix of
its operation log is then rebuilt in a fresh directory - as written, and with the files not
yet closed at the crash emptied - and checked in this process. Nothing here knows the file
names the protocol uses: a checkpoint counts as committed exactly when its manifest parses
and every file it lists verifies, and temporary names are the sources of logged renames.

The ``incremental`` recording saves with ``full_every_n_saves=3``: the second and third saves
refer to the first one's unchanged tensor, so retention must keep the first while deleting
the second; "committed" then also needs every referenced file to verify, so no crash state
may show (or load) a checkpoint whose referenced file is missing.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_elastic import CheckpointEngine, KeepLastN, Storage, cli
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import VALID, Catalog
from lightning_elastic.core.format.integrity import verify_files
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.core.format.references import routes
from lightning_elastic.core.policy.housekeeping import collect_garbage
from lightning_elastic.errors import CheckpointNotFoundError
from lightning_elastic.testing.recording import (
    CrashState,
    Op,
    RecordingFileSystem,
    crash_states,
    materialize,
    read_log,
)
from lightning_elastic.testing.spawn import run_distributed
from tests.faults import crash_workers
from tests.faults.crash_workers import RUN_ID, rank_state_for, state_for

pytestmark = pytest.mark.timeout(240)

STEPS = [1, 2, 3]
KEEP = 1
FULL_EVERY = 3  # the incremental recording: steps 2 and 3 refer to step 1's files
# The engine's default leftover grace (twice its 10-minute timeout): "after the grace period"
# is emulated by collecting garbage at now + GRACE_S + 1 (see test_after_every_crash_...).
GRACE_S = 1200.0


@dataclass(frozen=True)
class Recording:
    ops: list[Op]
    states: list[CrashState]
    names: list[str]
    object_store: bool
    full_every_n_saves: int | None = None


@pytest.fixture(scope="module", params=["posix", "object-store", "incremental"])
def recording(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Recording:
    """The recorded run, through FsspecStorage on a POSIX-like filesystem (temporary name then
    rename for exclusive files) or on an object store (``xb`` creates, no renames);
    ``incremental``: POSIX, saves that refer to the first one's files."""
    object_store = request.param == "object-store"
    full_every = FULL_EVERY if request.param == "incremental" else None
    base = tmp_path_factory.mktemp("recorded")
    root, log = base / "root", base / "ops.jsonl"
    names = run_distributed(
        crash_workers.record_saves, 2, str(root), str(log), STEPS, KEEP, object_store, full_every
    )
    assert names[0] == names[1], names
    ops = read_log(log, root)
    states = crash_states(ops, object_store=object_store)
    return Recording(ops, states, names[0], object_store, full_every)


# --------------------------------------------------------------------------- helpers


class Violations:
    """Every broken invariant, each naming the crash point (op index and op); asserted at
    the end so one run reports all of them."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.checked = 0

    def add(self, state: CrashState, invariant: str, detail: object) -> None:
        self.lines.append(f"{state.describe()}\n    VIOLATED {invariant}: {detail}")

    def assert_none(self) -> None:
        assert not self.lines, (
            f"{len(self.lines)} invariant violation(s) in {self.checked} crash states:\n"
            + "\n".join(self.lines)
        )


def each_state(
    recording: Recording, tmp_path: Path, check: Callable[[CrashState, Path], None]
) -> None:
    for i, state in enumerate(recording.states):
        root = tmp_path / f"state-{i:04d}"
        materialize(state, root)
        check(state, root)


def committed(root: Path) -> dict[str, Manifest]:
    """The checkpoints a crash left committed, judged independently of the catalog: a
    manifest that parses and every file it lists present with its size and checksum."""
    storage = Storage(str(root))
    out = {}
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith(".") or not (d / MANIFEST_FILE).is_file():
            continue
        try:
            manifest = Manifest.from_json((d / MANIFEST_FILE).read_bytes(), str(d))
        except Exception:
            continue
        ckpt = storage.child(d.name)
        if not verify_files(ckpt, manifest, "full", routes=routes(ckpt, manifest)):
            out[d.name] = manifest
    return out


def newest(manifests: dict[str, Manifest]) -> str:
    return max(manifests, key=lambda n: (manifests[n].sequence, manifests[n].created_unix, n))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def engine(root: Path, recording: Recording) -> CheckpointEngine:
    """A single-process engine of the same run, on the backend the recorded run used."""
    fs = RecordingFileSystem(object_store=recording.object_store)
    return CheckpointEngine(
        storage=Storage(str(root), fs=fs),
        coordinator=Coordinator.single_process(),
        run_id=RUN_ID,
        async_save=False,
        retention=[KeepLastN(KEEP)],
        full_every_n_saves=recording.full_every_n_saves,
    )


def same_state(loaded: dict, step: int) -> str | None:
    """Why ``loaded`` is not exactly what was saved at ``step`` (None when it is)."""
    expected = state_for(step)
    if set(loaded) != set(expected):
        return f"keys {sorted(loaded)} != {sorted(expected)}"
    for key, value in expected.items():
        got = loaded[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(got, torch.Tensor) or not torch.equal(got, value):
                return f"tensor {key!r} differs from step {step}'s"
        elif got != value:
            return f"{key!r} is {got!r}, step {step} saved {value!r}"
    return None


def load_quietly(eng: CheckpointEngine) -> tuple[object, list[str]]:
    """``eng.load()``'s result or exception, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome: object = eng.load()
        except Exception as exc:
            outcome = exc
    return outcome, [str(w.message) for w in caught]


def leftovers(root: Path, temp_names: set[str], object_store: bool) -> list[str]:
    """What a clean directory would not hold: anything but committed checkpoints' listed
    files and manifests outside hidden folders; a temporary name (the source of a logged
    rename) or an empty file inside them. (On an object store an empty "directory" does not
    exist: the local disk the replay runs on shows it, the store would not.)"""
    keep = committed(root)
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        top = rel.split("/", 1)[0]
        if top.startswith("."):
            if path.is_file() and (rel in temp_names or path.stat().st_size == 0):
                out.append(rel)
            continue
        if path.is_dir():
            if object_store and not any(p.is_file() for p in path.rglob("*")):
                continue
            if top not in keep or rel != top:  # not a checkpoint, or a folder inside one
                out.append(rel + "/")
            continue
        if top not in keep or "/" not in rel:
            out.append(rel)
            continue
        listed = {f.path for f in keep[top].files} | {MANIFEST_FILE}
        if rel.split("/", 1)[1] not in listed:
            out.append(rel)
    # a directory already reported makes its contents redundant
    dirs = [o for o in out if o.endswith("/")]
    return [o for o in out if not any(o != d and o.startswith(d) for d in dirs)]


# --------------------------------------------------------------------------- tests


def test_the_recorded_run_commits_deletes_and_spans_both_ranks(recording: Recording) -> None:
    assert recording.names == [f"step_{s:09d}" for s in STEPS]
    if recording.full_every_n_saves:  # the last save refers to the first, which is kept
        deleted = {
            op.path.split("/", 1)[0]
            for op in recording.ops
            if op.op == "rm_file" and op.path.endswith(f"/{MANIFEST_FILE}")
        }
        assert recording.names[1] in deleted and recording.names[0] not in deleted, deleted
    kinds = {op.op for op in recording.ops}
    assert {"open", "write", "close", "rm_file"} <= kinds, kinds
    assert {op.rank for op in recording.ops} == {0, 1}
    # retention ran: some file was deleted after the first commit
    assert any(op.op == "rm_file" for op in recording.ops)
    points = crash_states(recording.ops, distinct=False)
    assert any(s.unclosed for s in points), "no crash point with a file open for writing"
    print(
        f"{len(recording.ops)} operations, {len(points)} crash points (all variants), "
        f"{len(recording.states)} distinct crash states checked"
    )


def test_no_crash_state_shows_a_partial_checkpoint_as_valid(
    recording: Recording, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v = Violations()

    def check(state: CrashState, root: Path) -> None:
        v.checked += 1
        truth = committed(root)
        storage = Storage(str(root))
        for info in Catalog(storage).scan():
            if info.status == VALID and info.name not in truth:
                v.add(state, "Catalog.scan() lists only complete checkpoints as valid", info.name)
        code, out = run_cli(capsys, "ls", str(root), "--json", "--check", "none")
        if code != 0:
            v.add(state, "`ls` lists a crashed directory", f"exit {code}: {out.strip()}")
        else:
            for row in json.loads(out):
                if row["status"] == VALID.value and row["name"] not in truth:
                    v.add(state, "`ls --check none` shows only complete checkpoints", row["name"])
        code, out = run_cli(capsys, "verify", str(root), "--json")
        if code == 0:
            passed = {row["name"] for row in json.loads(out) if row["status"] == VALID.value}
            if not passed <= set(truth):
                v.add(state, "`verify ROOT` never passes a partial checkpoint", passed)
        for d in sorted(root.iterdir()):
            if d.is_dir() and not d.name.startswith(".") and d.name not in truth:
                code, out = run_cli(capsys, "verify", str(d), "--json")
                if code == 0:
                    v.add(state, "`verify CKPT` fails on a partial checkpoint", d.name)

    each_state(recording, tmp_path, check)
    v.assert_none()


def test_every_crash_state_loads_the_newest_committed_save_or_nothing(
    recording: Recording, tmp_path: Path
) -> None:
    v = Violations()

    def check(state: CrashState, root: Path) -> None:
        v.checked += 1
        truth = committed(root)
        with engine(root, recording) as eng:
            outcome, warned = load_quietly(eng)
        if isinstance(outcome, CheckpointNotFoundError):
            if truth:
                v.add(state, "load() finds a committed checkpoint", f"{outcome} ({sorted(truth)})")
            return
        if isinstance(outcome, Exception):
            v.add(state, "load() returns or raises CheckpointNotFoundError", repr(outcome))
            return
        result = outcome
        name = result.info.name  # type: ignore[attr-defined]
        if not truth:
            v.add(state, "load() finds nothing when nothing is committed", f"loaded {name}")
            return
        if name != newest(truth):
            v.add(state, "load() takes the newest committed", f"{name}, not {newest(truth)}")
        step = result.manifest.step  # type: ignore[attr-defined]
        why = same_state(result.state, step)  # type: ignore[attr-defined]
        if why is not None:
            v.add(state, "load() returns exactly a saved state", why)
        if result.rank_state != rank_state_for(step, 0):  # type: ignore[attr-defined]
            v.add(state, "load() returns rank 0's saved rank state", result.rank_state)  # type: ignore[attr-defined]
        if warned:
            v.add(state, "a committed checkpoint loads without quarantining anything", warned)

    each_state(recording, tmp_path, check)
    v.assert_none()


@pytest.mark.parametrize("gap", [1, 10], ids=["same-step-again", "later-step"])
def test_after_every_crash_the_next_save_succeeds_and_nothing_is_left_over(
    recording: Recording, tmp_path: Path, capsys: pytest.CaptureFixture[str], gap: int
) -> None:
    """Resume (or start over), save step ``loaded + gap`` as the same run (``gap=1``: the
    crashed save's step again, its directory name taken; ``10``: a later one), let the grace
    period pass (garbage collection at now + grace, as the next commit after it would run
    it): only committed checkpoints remain, ``verify`` passes and the new save loads."""
    v = Violations()
    temp_names = {op.path for op in recording.ops if op.op == "mv"}

    def check(state: CrashState, root: Path) -> None:
        v.checked += 1
        with engine(root, recording) as eng:
            outcome, _ = load_quietly(eng)
            if isinstance(outcome, Exception) and not isinstance(outcome, CheckpointNotFoundError):
                v.add(state, "load() before the next save", repr(outcome))
                return
            loaded = 0 if isinstance(outcome, Exception) else outcome.manifest.step  # type: ignore[attr-defined]
            step = loaded + gap
            try:
                handle = eng.save(state_for(step), step=step, rank_state=rank_state_for(step, 0))
                assert handle is not None
                name = handle.result().name
            except Exception as exc:
                v.add(state, f"the next save (step {step}) succeeds", repr(exc))
                return
        storage = Storage(str(root), fs=RecordingFileSystem(object_store=recording.object_store))
        collect_garbage(
            storage, Catalog(storage), run_id=RUN_ID, grace_s=GRACE_S, now=time.time() + GRACE_S + 1
        )
        left = leftovers(root, temp_names, recording.object_store)
        if left:
            v.add(state, "no leftover after the next save and the grace period", left)
        code, out = run_cli(capsys, "verify", str(root))
        if code != 0:
            v.add(state, "`verify ROOT` exits 0 after recovery", f"exit {code}: {out.strip()}")
        with engine(root, recording) as eng:
            outcome, _ = load_quietly(eng)
        if isinstance(outcome, Exception):
            v.add(state, "the new save loads", repr(outcome))
        elif outcome.info.name != name or same_state(outcome.state, step):  # type: ignore[attr-defined]
            v.add(state, "the new save is the one loaded", outcome.info.name)  # type: ignore[attr-defined]

    each_state(recording, tmp_path, check)
    v.assert_none()
