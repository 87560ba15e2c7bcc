"""Concurrent writers never corrupt anything (issue #8, item 1).

Two jobs write into one root at once - two runs sharing a ``dirpath``, a requeued job whose old
copy still runs, two 2-rank jobs, both saving the same steps at the same moment - on local
disk and on a real S3 protocol server (moto). After they finish, the root is audited
independently of what the jobs believed:

* every save either returned a committed result or raised a typed ``ElasticCheckpointError``,
  and all ranks of a job saw the same outcome;
* every checkpoint in the root was reported committed by exactly the save that wrote it, and
  verifies with full checksums; every committed one still present has exactly the files it
  had right after its commit, all named after its save id (DCP metadata included);
* a run's checkpoints disappear only through its own retention, which leaves each run exactly
  its two newest commits (and the one it resumed from), and ``load`` of a run picks that run's
  newest; between different runs no save fails;
* a stale copy of a run is fenced: once the newer job holds the lease, the old one commits
  nothing, and its refusal (``StaleWriterError``) names the newer writer.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lightning_elastic import cli
from lightning_elastic.cli import prune as prune_verb
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import VALID, Catalog
from lightning_elastic.core.format.integrity import verify_files
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.core.policy import housekeeping
from lightning_elastic.core.policy.retention import KeepLastN
from lightning_elastic.core.save.request import SaveResult
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import (
    ElasticCheckpointError,
    StaleWriterError,
    StorageNotFoundError,
)
from lightning_elastic.testing.s3 import S3Server
from lightning_elastic.testing.spawn import run_distributed
from tests.faults.concurrent_workers import (
    JobReport,
    JobSpec,
    SaveOutcome,
    hooked,
    run_job,
    state_for,
)

pytestmark = pytest.mark.timeout(180)

# Steps each job saves: on S3 every save costs ~0.7 s of the moto server's CPU (in the pytest
# process), so the S3 jobs save fewer steps; the races they meet are the same each step.
STEPS = tuple(range(1, 31))
S3_STEPS = tuple(range(1, 13))
JOB_TIMEOUT_S = 120.0
_buckets = itertools.count()


# --------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class Backend:
    root: str
    options: dict[str, Any]
    cli_options: tuple[str, ...] = ()
    steps: tuple[int, ...] = STEPS


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return Backend(str(tmp_path / "ckpts"), {})
    server: S3Server = request.getfixturevalue("s3_server")
    root = server.create_bucket(f"concurrent-{next(_buckets)}") + "/ckpts"
    options = [f"endpoint_url={server.endpoint_url}", "key=testing", "secret=testing"]
    cli = tuple(a for o in options for a in ("-o", o))
    return Backend(root, server.storage_options, cli, S3_STEPS)


@pytest.fixture
def sync_dir(tmp_path: Path) -> str:
    path = tmp_path / "sync"
    path.mkdir()
    return str(path)


# --------------------------------------------------------------------------- running jobs


def run_jobs(jobs: Sequence[tuple[JobSpec, int]]) -> dict[str, list[JobReport]]:
    """Run every ``(spec, world_size)`` job at once (one thread per job, each job's ranks in
    fresh processes that are killed when the job ends or times out); every rank's report."""
    results: list[list[JobReport] | BaseException | None] = [None] * len(jobs)

    def run(i: int, spec: JobSpec, world: int) -> None:
        try:
            results[i] = run_distributed(run_job, world, spec, timeout=JOB_TIMEOUT_S)
        except BaseException as exc:
            results[i] = exc

    threads = [
        threading.Thread(target=run, args=(i, spec, world), daemon=True)
        for i, (spec, world) in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOB_TIMEOUT_S + 30)
    reports = {}
    for (spec, _), result in zip(jobs, results, strict=True):
        if not isinstance(result, list):
            raise AssertionError(f"job {spec.job} did not finish: {result!r}")
        reports[spec.job] = result
    return reports


def spec(backend: Backend, sync_dir: str, run_id: str, job: str, **kw: Any) -> JobSpec:
    defaults: dict[str, Any] = {"steps": backend.steps, "peers": ("a", "b")}
    return JobSpec(
        root=backend.root,
        storage_options=backend.options,
        run_id=run_id,
        job=job,
        sync_dir=sync_dir,
        **{**defaults, **kw},
    )


# --------------------------------------------------------------------------- the audit


@dataclass(frozen=True)
class Commit:
    """A save its job reported committed (rank 0's view)."""

    job: str
    run_id: str
    outcome: SaveOutcome

    @property
    def key(self) -> tuple[str, str]:
        assert self.outcome.save_id is not None
        return self.run_id, self.outcome.save_id


@dataclass
class Audit:
    problems: list[str] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    present: dict[tuple[str, str], str] = field(default_factory=dict)  # (run, save id) -> dir

    def check(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def assert_clean(self) -> None:
        """Fail on any violation; a run whose only violations are known bugs' symptoms is an
        expected failure naming them."""
        assert not self.problems, f"{len(self.problems)} violation(s):\n" + "\n".join(self.problems)

    def runs(self) -> dict[str, list[Commit]]:
        """Each run's commits, oldest first (one job's saves are sequential; two jobs of one
        run never commit at once, so the order of completion is the commit order)."""
        out: dict[str, list[Commit]] = defaultdict(list)
        for c in sorted(self.commits, key=lambda c: c.outcome.finished):
            out[c.run_id].append(c)
        return out


def audit(backend: Backend, reports: dict[str, list[JobReport]]) -> Audit:
    """Check the root against what every job reported (see the module docstring)."""
    result = Audit()
    for job, ranks in reports.items():
        _check_outcomes(result, job, ranks)
    storage = Storage(backend.root, storage_options=backend.options)
    committed = {c.key: c for c in result.commits}
    for info in Catalog(storage).scan():
        if info.status != VALID or info.manifest is None:
            result.problems.append(f"{info.name} is {info.status}: {info.problem}")
            continue
        manifest = info.manifest
        key = (manifest.run_id, manifest.save_id)
        result.present[key] = info.name
        bad = verify_files(storage.child(info.name), manifest, "full")
        result.check(not bad, f"{info.name} does not verify: {bad}")
        listing = {e.name: e.size for e in storage.listdir(info.name) if not e.is_dir}
        expected = {f.path for f in manifest.files} | {MANIFEST_FILE}
        result.check(
            set(listing) == expected,
            f"{info.name}: files {sorted(listing)} are not its manifest's {sorted(expected)}",
        )
        commit = committed.get(key)
        if commit is None:
            result.problems.append(
                f"{info.name}: a checkpoint of run {manifest.run_id} (save {manifest.save_id}, "
                f"generation {manifest.generation}) that no save reported committed"
            )
            continue
        result.check(
            commit.outcome.name == info.name,
            f"{info.name} was committed as {commit.outcome.name}",
        )
        before = commit.outcome.listing or {}
        result.check(
            before == listing,
            f"{info.name} changed after its commit: {before} -> {listing}",
        )
    resumed = {(r.run_id, r.resumed) for ranks in reports.values() for r in ranks if r.resumed}
    for run_id, commits in result.runs().items():
        newest = {c.key for c in commits[-2:]}
        for c in commits[-2:]:  # KeepLastN(2): a run's newest two survive anything else
            result.check(
                c.key in result.present,
                f"{c.outcome.name} (run {run_id}, step {c.outcome.step}) was deleted although "
                "it is one of its run's two newest",
            )
        # ... and are all it keeps, but for the checkpoint it resumed from (protected)
        beyond = sorted(
            name
            for key, name in result.present.items()
            if key[0] == run_id and key not in newest and (run_id, name) not in resumed
        )
        result.check(not beyond, f"run {run_id} kept {beyond} beyond its limit (keep-last-2)")
    return result


def assert_all_committed(reports: dict[str, list[JobReport]]) -> None:
    """No save failed: another run's saves and deletions are no reason to fail."""
    failed = [
        f"job {r.job} rank {r.rank} step {o.step}: {o.error_type}: {o.message}"
        for ranks in reports.values()
        for r in ranks
        for o in r.outcomes
        if o.name is None
    ]
    assert not failed, "\n".join(failed)


def _check_outcomes(result: Audit, job: str, ranks: list[JobReport]) -> None:
    seen = [[(o.step, o.name, o.error_type) for o in r.outcomes] for r in ranks]
    result.check(all(s == seen[0] for s in seen), f"job {job}: ranks disagree: {seen}")
    for r in ranks:
        for o in r.outcomes:
            result.check(o.typed, f"job {job} rank {r.rank} step {o.step}: untyped {o.message}")
    for o in ranks[0].outcomes:
        if o.name is None:
            continue
        result.commits.append(Commit(job, ranks[0].run_id, o))
        assert o.save_id is not None and o.listing is not None
        foreign = [f for f in o.listing if f != MANIFEST_FILE and not f.startswith(o.save_id)]
        result.check(
            not foreign,
            f"{o.name}: right after its commit it held other files: {foreign}",
        )


def newest_loads(backend: Backend, run_id: str, commit: Commit) -> None:
    """``load`` with the run's id picks that run's newest commit, with its content."""
    engine = CheckpointEngine(
        backend.root,
        storage_options=backend.options,
        coordinator=Coordinator.single_process(),
        run_id=run_id,
    )
    with engine:
        loaded = engine.load(None, trusted=True)
    assert loaded.info.name == commit.outcome.name
    assert loaded.state is not None
    expected = state_for(commit.outcome.step, commit.job)
    assert loaded.state["meta"] == expected["meta"]
    assert loaded.state["w"].equal(expected["w"])


def cli_verifies(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code = cli.main(["verify", backend.root, *backend.cli_options])
    out, err = capsys.readouterr()
    assert code == 0, out + err


def conclude(
    result: Audit, backend: Backend, capsys: pytest.CaptureFixture[str], runs: set[str]
) -> None:
    """Unless the audit already failed: each run's newest commit is what ``load`` picks for
    that run id, and the CLI verifies the whole root. Then the audit's verdict."""
    if not result.problems:
        by_run = result.runs()
        assert set(by_run) == runs, f"runs that committed: {sorted(by_run)}"
        for run_id, commits in by_run.items():
            newest_loads(backend, run_id, commits[-1])
        cli_verifies(backend, capsys)
    result.assert_clean()


# --------------------------------------------------------------------------- tests


def test_two_runs_share_a_root(
    backend: Backend, sync_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two single-process runs (different run ids, keep-last-2) save 30 steps (12 on S3)
    each into one root at once."""
    jobs = [
        (spec(backend, sync_dir, "run-a", "a"), 1),
        (spec(backend, sync_dir, "run-b", "b", async_save=True), 1),
    ]
    reports = run_jobs(jobs)
    conclude(audit(backend, reports), backend, capsys, {"run-a", "run-b"})
    assert_all_committed(reports)


def test_requeued_job_fences_its_old_copy(
    backend: Backend, sync_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same run twice: the old copy (a) keeps saving while its requeued copy (b) resumes from
    the run's newest checkpoint and saves 30 steps (12 on S3). b's load takes a newer lease;
    from then on every save of a is refused with StaleWriterError naming b, and b wins."""
    old = spec(backend, sync_dir, "run-r", "a", async_save=True, pause_s=0.03)
    new = spec(backend, sync_dir, "run-r", "b", after=("a", 3), resume=True)
    reports = run_jobs([(old, 1), (new, 1)])
    (a,), (b,) = reports["a"], reports["b"]
    assert b.leased_at is not None and b.resumed is not None
    a_generations = {o.generation for o in a.outcomes if o.name is not None}
    b_generations = {o.generation for o in b.outcomes}
    assert len(a_generations) == 1 and len(b_generations) == 1, (a_generations, b_generations)
    (a_gen,), (b_gen,) = a_generations, b_generations
    assert a_gen is not None and b_gen is not None and b_gen > a_gen
    assert [o.error_type for o in b.outcomes] == [None] * len(backend.steps), "the newer job wins"

    after = [o for o in a.outcomes if o.started > b.leased_at]
    assert after, "the old copy never saved after the new one took over: nothing was tested"
    assert all(o.name is None for o in after), [o.name for o in after if o.name]
    stale = [o for o in after if o.error_type == StaleWriterError.__name__]
    assert stale, f"no StaleWriterError: {[(o.error_type, o.message) for o in after]}"
    for o in stale:
        newer = f"generation {b_gen} (host {socket.gethostname()}, pid {b.pid},"
        assert newer in o.message, o.message

    result = audit(backend, reports)
    for o in after:
        result.check(
            o.error_type == StaleWriterError.__name__,
            f"old copy, step {o.step}: {o.error_type}: {o.message}",
        )
    for key, name in result.present.items():
        commit = next(c for c in result.commits if c.key == key)
        result.check(
            commit.job == "b" or commit.outcome.started < b.leased_at,
            f"{name}: committed by the old copy after the new one took over",
        )
    conclude(result, backend, capsys, {"run-r"})


def test_two_two_rank_jobs_share_a_root(
    backend: Backend, sync_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two 2-rank jobs (4 gloo processes) of different runs save 30 steps (12 on S3) into
    one root at once; every rank of a job sees the same outcome of every save."""
    jobs = [
        (spec(backend, sync_dir, "run-a", "a", async_save=True), 2),
        (spec(backend, sync_dir, "run-b", "b"), 2),
    ]
    reports = run_jobs(jobs)
    assert [len(reports[j]) for j in ("a", "b")] == [2, 2]
    conclude(audit(backend, reports), backend, capsys, {"run-a", "run-b"})
    assert_all_committed(reports)


def test_same_steps_at_the_same_moment(
    backend: Backend, sync_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs meet before every step, so both claim ``step_N`` at the same moment: one gets
    the plain name and the other a suffix (or a typed error, cleaning only its own files), and
    no committed checkpoint's files change afterwards (the audit compares every directory with
    its listing right after the commit)."""
    jobs = [
        (spec(backend, sync_dir, "run-a", "a", lockstep=True), 1),
        (spec(backend, sync_dir, "run-b", "b", lockstep=True, async_save=True), 1),
    ]
    reports = run_jobs(jobs)
    result = audit(backend, reports)
    names: dict[int, list[str]] = defaultdict(list)
    for c in result.commits:
        names[c.outcome.step].append(str(c.outcome.name))
    for step, taken in names.items():
        result.check(len(set(taken)) == len(taken), f"step {step}: one name, two commits: {taken}")
    suffixed = [n for taken in names.values() for n in taken if "-" in n]
    failed = [o for r in (*reports["a"], *reports["b"]) for o in r.outcomes if o.name is None]
    assert suffixed or failed, "no step collided: nothing was tested"
    conclude(result, backend, capsys, {"run-a", "run-b"})


# --------------------------------------------------------------------------- many short trials
#
# The runs above are one trial each (a launch of fresh processes costs seconds). A run that
# kept a checkpoint beyond its limit, or a save that failed for the other run's deletes, was
# seen in 12 and 3 of 29 such trials; catching that needs many trials, so these run two runs
# as two threads of one process - each with an engine of its own, as a process has - many
# times. The second run starts a few commits behind the first, so it keeps committing under
# names the first run's retention has just freed (the trigger), sometimes while it frees
# them. Before the fix, an 8-step trial failed 17 times in 40 and a 20-step one 28 in 30
# (local disk): 12 short trials locally, and on S3 - where a save costs ~1 s of requests to
# the moto server - one long one.

TRIALS = {"local": (12, 8), "s3": (1, 14)}  # (trials, steps of each run)


@dataclass
class Trial:
    """One run of a trial: what it committed (in order) and which saves failed."""

    engine: CheckpointEngine
    committed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def two_runs_in_threads(backend: Backend, root: str, steps: int, lag: int) -> dict[str, Trial]:
    """run-a (synchronous saves) and run-b (asynchronous, starting once run-a committed
    ``lag`` times) each save ``steps`` steps into ``root`` with keep-last-2."""
    runs = {
        run: Trial(
            CheckpointEngine(
                root,
                storage_options=backend.options,
                coordinator=Coordinator.single_process(),
                run_id=run,
                retention=[KeepLastN(2)],
                async_save=run == "run-b",
            )
        )
        for run in ("run-a", "run-b")
    }
    ahead = threading.Semaphore(0)

    def run(run_id: str) -> None:
        trial = runs[run_id]
        if run_id == "run-b":
            for _ in range(lag):
                ahead.acquire(timeout=JOB_TIMEOUT_S)
        for step in range(1, steps + 1):
            try:
                trial.committed.append(save(trial.engine, step, run_id).name)
            except Exception as exc:
                trial.failed.append(f"{run_id} step {step}: {type(exc).__name__}: {exc}")
            if run_id == "run-a":
                ahead.release()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOB_TIMEOUT_S)
        assert not t.is_alive(), "a run of the trial hung"
    return runs


def trial_problems(backend: Backend, root: str, runs: dict[str, Trial]) -> list[str]:
    """What went wrong in one trial: failed saves, a run keeping other than its two newest
    commits, a run's own engine not loading its newest."""
    problems = [f for trial in runs.values() for f in trial.failed]
    kept: dict[str, set[str]] = defaultdict(set)
    for info in Catalog(Storage(root, storage_options=backend.options)).scan():
        kept[str(info.run_id)].add(f"{info.name} ({info.status})")
    for run_id, trial in runs.items():
        want = {f"{name} ({VALID})" for name in trial.committed[-2:]}
        if kept[run_id] != want:
            problems.append(f"{run_id} kept {sorted(kept[run_id])}, not {sorted(want)}")
        try:
            loaded = trial.engine.load(None, trusted=True)
        except ElasticCheckpointError as exc:
            problems.append(f"{run_id} cannot load its newest: {exc!r}")
            continue
        if loaded.info.name != trial.committed[-1]:
            problems.append(f"{run_id} loaded {loaded.info.name}, not {trial.committed[-1]}")
    return problems


def test_two_runs_in_one_root_keep_exactly_their_limit_in_every_trial(backend: Backend) -> None:
    """Two runs (keep-last-2) share a root, the second a few commits behind, many times over:
    in every trial no save fails, each run keeps exactly its two newest commits, and each
    run's own engine - whose manifest cache saw the other run's checkpoints under the same
    names - loads its newest (its cache never takes one run's checkpoint for the other's)."""
    trials, steps = TRIALS["s3" if backend.root.startswith("s3://") else "local"]
    problems = []
    for i in range(trials):
        root = f"{backend.root}/trial-{i}"
        runs = two_runs_in_threads(backend, root, steps, lag=3 - i % 2)
        try:
            problems += [f"trial {i}: {p}" for p in trial_problems(backend, root, runs)]
        finally:
            for trial in runs.values():
                trial.engine.close()
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


# --------------------------------------------------------------------------- exact interleavings
#
# The runs above interleave two jobs as the scheduler pleases. The races below have windows too
# narrow to hit reliably that way, so one job's storage operation runs the other job's step at
# exactly the wrong moment, in one process.


def engine(
    run_id: str, *, root: Path | None = None, storage: Storage | None = None, keep: int = 0
) -> CheckpointEngine:
    """A one-process engine that saves synchronously (``keep``: ``KeepLastN(keep)``)."""
    return CheckpointEngine(
        None if root is None else str(root),
        storage=storage,
        coordinator=Coordinator.single_process(),
        run_id=run_id,
        retention=[KeepLastN(keep)] if keep else [],
        async_save=False,
    )


def save(eng: CheckpointEngine, step: int, job: str) -> SaveResult:
    handle = eng.save(state_for(step, job), step=step)
    assert handle is not None
    return handle.result()


def listing(root: Path, name: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / name).iterdir()}


def test_claim_racing_a_commit_leaves_the_winner_untouched(tmp_path: Path) -> None:
    """y finds ``step_5`` free; before y's claim lands, x claims, commits and releases
    ``step_5``, so y's exclusive claim succeeds in x's committed directory. y must end up with
    a name of its own or a typed error, and x's directory must stay as x committed it."""
    root = tmp_path / "ckpts"
    storage = hooked(root)
    seen: dict[str, Any] = {}
    with engine("run-x", root=root) as x, engine("run-y", storage=storage) as y:

        def x_commits() -> None:
            seen["x"] = save(x, 5, "x").name
            seen["listing"] = listing(root, seen["x"])

        storage.hooks["before-write:step_000000005/_staging.json"] = x_commits
        try:
            seen["y"] = save(y, 5, "y").name
        except ElasticCheckpointError as exc:
            seen["y"] = exc
    assert seen["x"] == "step_000000005"
    assert seen["y"] != seen["x"]
    assert listing(root, seen["x"]) == seen["listing"], (
        "the loser left a file in the winner's committed directory"
    )


def test_retention_spares_a_checkpoint_committed_under_the_freed_name(tmp_path: Path) -> None:
    """x's retention deletes x's ``step_1``: the manifest first, then the directory. In between,
    run y (lagging behind, saving step 1) finds ``step_1`` free, claims it and commits there.
    x's retention must not delete y's committed checkpoint."""
    root = tmp_path / "ckpts"
    storage = hooked(root)
    seen: dict[str, Any] = {}
    with engine("run-x", storage=storage, keep=1) as x, engine("run-y", root=root) as y:
        save(x, 1, "x")

        def y_commits() -> None:
            try:
                seen["y"] = save(y, 1, "y").name
            except Exception as exc:  # x's cleanup would swallow it
                seen["y"] = exc

        storage.hooks["delete:step_000000001/manifest.json"] = y_commits
        save(x, 2, "x")  # retention deletes step_1; y commits step 1 meanwhile
    assert isinstance(seen["y"], str), seen["y"]
    manifest = root / seen["y"] / MANIFEST_FILE
    assert manifest.exists(), f"y's committed {seen['y']} was deleted by x's retention"
    info = Catalog(Storage(str(root))).info(seen["y"])
    assert info.status == VALID and info.manifest is not None and info.run_id == "run-y"
    assert not verify_files(Storage(str(root)).child(info.name), info.manifest, "full")


def test_a_save_survives_another_runs_retention_during_its_commit(tmp_path: Path) -> None:
    """y's commit scans the root (for the commit sequence) while x's retention deletes one of
    x's checkpoints between y's listing of it and y's read of its manifest. y's save has
    nothing to do with that checkpoint and must commit."""
    root = tmp_path / "ckpts"
    storage = hooked(root)
    with engine("run-x", root=root, keep=1) as x, engine("run-y", storage=storage) as y:
        save(x, 1, "x")

        def x_commits_and_prunes() -> None:
            save(x, 2, "x")

        storage.hooks["listdir:step_000000001"] = x_commits_and_prunes
        assert save(y, 7, "y").name == "step_000000007"
    assert not (root / "step_000000001").exists(), "x's retention ran"


def recommitted(storage: Storage, name: str, run_id: str) -> Manifest:
    """Replace the checkpoint ``name`` with one of run ``run_id`` committed there by a save
    of its own (a new save id, its files named after it) whose manifest has exactly the old
    one's size: what another run's commit under a freed name can look like."""
    old = Manifest.from_json(storage.read_bytes(f"{name}/{MANIFEST_FILE}"), name)
    new_id = "f" * len(old.save_id)
    data = {f.path: storage.read_bytes(f"{name}/{f.path}") for f in old.files}
    storage.delete_tree(name)
    for path, body in data.items():
        storage.write_bytes(f"{name}/{path.replace(old.save_id, new_id)}", body)
    new = dataclasses.replace(
        old,
        run_id=run_id,
        save_id=new_id,
        files=tuple(
            dataclasses.replace(f, path=f.path.replace(old.save_id, new_id)) for f in old.files
        ),
        dcp_metadata=old.dcp_metadata.replace(old.save_id, new_id),
    )
    assert len(new.to_json()) == len(old.to_json())
    storage.write_bytes(f"{name}/{MANIFEST_FILE}", new.to_json().encode())
    return new


def test_a_cached_manifest_is_never_taken_for_a_later_commit_under_its_name(
    backend: Backend,
) -> None:
    """Run y's engine has read run x's ``step_5``; x's retention deletes it and y commits its
    own ``step_5`` there, with a manifest of the same size. y's catalog must see y's commit
    (taking it for x's, y never pruned it and failed to load it: the files x's manifest
    lists are gone). On S3 too, where the listing's sizes are what the cache is checked by."""

    def one(run_id: str) -> CheckpointEngine:
        return CheckpointEngine(
            backend.root,
            storage_options=backend.options,
            coordinator=Coordinator.single_process(),
            run_id=run_id,
            async_save=False,
        )

    with one("run-x") as x, one("run-y") as y:
        save(x, 5, "x")
        assert [i.run_id for i in y.catalog.scan()] == ["run-x"]
        mine = recommitted(
            Storage(backend.root, storage_options=backend.options), "step_000000005", "run-y"
        )
        (info,) = y.catalog.scan()
        assert (info.run_id, info.manifest) == ("run-y", mine)
        assert y.catalog.info("step_000000005").manifest == mine


def test_a_cached_manifest_is_reused_while_its_directory_holds_any_of_its_files(
    tmp_path: Path,
) -> None:
    """A node-local root (multi-tier) holds only its own ranks' shards of a checkpoint: the
    cache must still serve its manifest (read again at every scan, a scan of 100 such
    checkpoints took 48 ms instead of 3 ms), and still refuse it once a file it records has
    another size or another save's file is there."""
    root = tmp_path / "ckpts"
    with engine("run-x", root=root) as x:
        manifest = save(x, 5, "x").manifest
    assert manifest is not None
    name = "step_000000005"
    (root / name / f"{manifest.save_id}-rank00000.distcp").unlink()  # another node's shard
    catalog = Catalog(Storage(str(root)))
    reads: list[str] = []
    real = catalog._read

    def counted(rel: str) -> bytes:
        reads.append(rel)
        return real(rel)

    catalog._read = counted  # type: ignore[method-assign]
    for _ in range(3):
        (info,) = catalog.scan()
        assert info.manifest == manifest
    assert reads == [f"{name}/{MANIFEST_FILE}"]
    other = root / name / "0123456789abcdef-rank00001.distcp"
    other.write_bytes(b"another save's shard")
    catalog.scan()
    assert reads.count(f"{name}/{MANIFEST_FILE}") == 2
    other.unlink()
    catalog.scan()
    (root / name / manifest.dcp_metadata).write_bytes(b"{}")  # not the size recorded
    catalog.scan()
    assert reads.count(f"{name}/{MANIFEST_FILE}") == 3


def test_retention_spares_a_checkpoint_committed_under_the_name_while_its_data_goes(
    tmp_path: Path,
) -> None:
    """x's retention deletes x's ``step_1``: the manifest, then its files. Once they are gone,
    run y (lagging behind) claims the free ``step_1`` and commits there, before x removes the
    directory. x must leave y's checkpoint (and its claim) alone: it deletes only what it
    found there before the name was freed."""
    root = tmp_path / "ckpts"
    storage = hooked(root)
    seen: dict[str, Any] = {}
    with engine("run-x", storage=storage, keep=1) as x, engine("run-y", root=root) as y:
        last = save(x, 1, "x").manifest
        assert last is not None

        def y_commits() -> None:
            try:
                seen["y"] = save(y, 1, "y").name
            except Exception as exc:  # x's cleanup would swallow it
                seen["y"] = exc

        storage.hooks[f"retire:step_000000001/{last.files[-1].path}"] = y_commits
        save(x, 2, "x")
    assert seen["y"] == "step_000000001", seen["y"]
    info = Catalog(Storage(str(root))).info(seen["y"])
    assert info.status == VALID and info.manifest is not None and info.run_id == "run-y"
    assert not verify_files(Storage(str(root)).child(info.name), info.manifest, "full")


def test_a_claim_whose_directory_another_run_removes_is_written_again(tmp_path: Path) -> None:
    """x's retention removes the emptied directory of a checkpoint just as y, finding the name
    free, creates it to write its claim there: the claim fails (ENOENT). y's save must claim
    the name again and commit, not fail."""
    root = tmp_path / "ckpts"
    storage = hooked(root)

    def removed_under_it() -> None:
        cause = FileNotFoundError(errno.ENOENT, "removed by another run's retention")
        raise StorageNotFoundError("write", str(root / "step_000000003/_staging.json"), cause)

    storage.hooks["before-write:step_000000003/_staging.json"] = removed_under_it
    with engine("run-y", storage=storage) as y:
        assert save(y, 3, "y").name == "step_000000003"
        assert not storage.hooks, "the claim was never written"


# A deletion is decided on a scan and carried out later: a prune scans the whole root (and
# checks every file's size) before it deletes, and a run's retention deletes one checkpoint
# after another. Meanwhile the checkpoint may be gone already (the run's own retention, or
# a prune, in another process) and another run may have claimed its freed name.


def stale_plan(monkeypatch: pytest.MonkeyPatch, module: Any, meanwhile: Any) -> None:
    """``module.plan_deletions`` plans as before, then ``meanwhile()`` runs once (between the
    scan the plan came from and the deletions it asks for)."""
    real = module.plan_deletions
    ran: list[bool] = []

    def planned(*args: Any, **kwargs: Any) -> Any:
        doomed = real(*args, **kwargs)
        if doomed and not ran:
            ran.append(True)
            meanwhile()
        return doomed

    monkeypatch.setattr(module, "plan_deletions", planned)


def deleted_and_taken(root: str, options: dict[str, Any], name: str, y: CheckpointEngine) -> str:
    """Someone else deletes ``name`` (as a prune does), then run y, lagging behind, commits
    its own checkpoint of that step (``step_1``) under the freed name."""
    storage = Storage(root, storage_options=options)
    housekeeping.delete_checkpoint(storage, Catalog(storage), name)
    taken = save(y, 1, "y").name
    assert taken == name
    return taken


def assert_intact(root: str, options: dict[str, Any], name: str, run_id: str) -> None:
    storage = Storage(root, storage_options=options)
    info = Catalog(storage).info(name)
    assert info.status == VALID and info.manifest is not None, info
    assert info.run_id == run_id
    assert not verify_files(storage.child(name), info.manifest, "full")


def test_retention_leaves_a_checkpoint_another_run_committed_under_a_name_it_planned_to_delete(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x's retention plans to delete x's ``step_1``; before it does, a prune has deleted it
    and run y has committed its own ``step_1`` there. x must delete nothing of y's: the name
    it planned with now holds another commit (before, x deleted y's manifest and files)."""
    opts = backend.options
    with (
        CheckpointEngine(
            backend.root,
            storage_options=opts,
            coordinator=Coordinator.single_process(),
            run_id="run-x",
            retention=[KeepLastN(1)],
            async_save=False,
        ) as x,
        CheckpointEngine(
            backend.root,
            storage_options=opts,
            coordinator=Coordinator.single_process(),
            run_id="run-y",
            async_save=False,
        ) as y,
    ):
        name = save(x, 1, "x").name
        taken: list[str] = []
        stale_plan(
            monkeypatch,
            housekeeping,
            lambda: taken.append(deleted_and_taken(backend.root, opts, name, y)),
        )
        save(x, 2, "x")
        assert taken == [name]
    assert_intact(backend.root, opts, name, "run-y")


def test_a_stale_deletion_leaves_the_files_of_a_save_in_flight_under_the_name(
    tmp_path: Path,
) -> None:
    """x's retention (or a prune) decided to delete x's ``step_1``, which is gone by the time
    it acts: y has claimed the freed name and written its shards, and commits right after. The
    stale deletion must leave y's claim and shards (before, it deleted them, and y committed a
    checkpoint whose files were missing)."""
    root = tmp_path / "ckpts"
    storage = hooked(root)
    with engine("run-x", root=root) as x, engine("run-y", storage=storage) as y:
        name = save(x, 1, "x").name
        plain = Storage(str(root))
        stale = Catalog(plain).info(name)
        assert stale.manifest is not None
        housekeeping.delete_checkpoint(plain, Catalog(plain), name)  # a prune, say

        def stale_deletion() -> None:
            assert stale.manifest is not None
            housekeeping.delete_checkpoint(
                plain,
                Catalog(plain),
                name,
                listed=[f.path for f in stale.manifest.files],
                save_id=stale.manifest.save_id,
            )

        storage.hooks["before-write:manifest.json"] = stale_deletion
        assert save(y, 1, "y").name == name
        assert not storage.hooks, "the stale deletion never ran"
    assert_intact(str(root), {}, name, "run-y")


def test_a_prune_leaves_a_checkpoint_committed_under_a_name_since_it_scanned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``prune --keep-last 1`` scans the root and plans to delete x's ``step_1``; before it
    deletes, x's own retention has deleted it and run y has committed ``step_1``. The prune
    must leave y's checkpoint."""
    root = tmp_path / "ckpts"
    with engine("run-x", root=root) as x, engine("run-y", root=root) as y:
        name = save(x, 1, "x").name
        save(x, 2, "x")
        stale_plan(monkeypatch, prune_verb, lambda: deleted_and_taken(str(root), {}, name, y))
        assert cli.main(["prune", str(root), "--keep-last", "1", "--run-id", "run-x"]) == 0
    assert_intact(str(root), {}, name, "run-y")
    assert "deleted" in capsys.readouterr().out


def test_a_claim_is_kept_while_another_saves_claim_of_the_name_is_in_flight(
    tmp_path: Path,
) -> None:
    """Two saves claim ``step_5`` at once: on a local disk a claim is written to a temporary
    file and linked to ``_staging.json``, so y's link wins while x's temporary file is still
    there (x's link then fails and x moves on). y must keep its claim: it took x's temporary
    file for another save's data, gave the name back and left an empty directory behind, and
    with three runs both claimers could give up the name."""
    root = tmp_path / "ckpts"
    storage = hooked(root)

    def x_claims_meanwhile() -> None:
        (root / "step_000000005").mkdir(parents=True, exist_ok=True)
        (root / "step_000000005" / "_staging.json.tmp-0123456789ab").write_text('{"run_id": "x"')

    storage.hooks["before-write:step_000000005/_staging.json"] = x_claims_meanwhile
    with engine("run-y", storage=storage) as y:
        result = save(y, 5, "y")
    assert not storage.hooks, "the other claim never started"
    assert result.name == "step_000000005"
    assert result.manifest is not None
    assert set(listing(root, result.name)) == {MANIFEST_FILE} | {
        f.path for f in result.manifest.files
    }


def test_a_claim_that_crashed_half_written_keeps_its_name_until_it_is_collected(
    tmp_path: Path,
) -> None:
    """What a claim that crashed while being written leaves (an old ``_staging.json.tmp-*``,
    nothing else) is not a claim racing ours: the name stays taken (garbage collection may be
    removing that directory right now), the save takes the next name, and the leftover is
    collected once older than the grace period."""
    root = tmp_path / "ckpts"
    crashed = root / "step_000000005" / "_staging.json.tmp-0123456789ab"
    crashed.parent.mkdir(parents=True)
    crashed.write_text('{"run_id": "x"')
    a_minute_ago = time.time() - 60  # older than any racing claim, younger than the grace
    os.utime(crashed, (a_minute_ago, a_minute_ago))
    with engine("run-y", root=root) as y:
        assert save(y, 5, "y").name == "step_000000005-1"
    assert crashed.exists()
    plain = Storage(str(root))
    housekeeping.collect_garbage(plain, Catalog(plain), run_id="run-y", grace_s=30)
    assert not crashed.parent.exists()


def test_a_stale_writer_learns_it_is_stale_whatever_else_fails(tmp_path: Path) -> None:
    """The old copy (a) writes while its requeued copy (b) holds the run. The newer job's
    cleanup removes a's in-flight directory under it, so a's shard write fails (emulated:
    ENOENT, as in the concurrent runs above). a's save must still raise StaleWriterError."""
    root = tmp_path / "ckpts"
    storage = hooked(root)
    with engine("run-r", storage=storage) as a, engine("run-r", root=root) as b:
        save(a, 1, "a")
        b.load(None, trusted=True, take_over=True)  # the requeued copy resumes: a newer lease

        def removed_under_it() -> None:
            raise FileNotFoundError(errno.ENOENT, "removed by the newer job's cleanup")

        storage.hooks["before-write:*-rank00000.distcp"] = removed_under_it
        with pytest.raises(StaleWriterError, match="a newer job holds generation 2"):
            save(a, 2, "a")
