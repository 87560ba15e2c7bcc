"""The run history: a small event log in the checkpoint directory, one object per event.

Which rank calls what: only rank 0 records (the Lightning callback owns a
:class:`RunHistory` there): :meth:`RunHistory.record` at the moments worth remembering (a
start, a resume, a commit, a failed save, a straggler, a cadence decision, the end), from the
training thread or the writer thread; :meth:`RunHistory.progress` once per step (it writes at
most every ``progress_every_s``); :meth:`RunHistory.last_progress` at start-up, to learn where
the previous launch of the run was when it stopped. Tools (``lightning-elastic report``, the
cadence's restart count) call :func:`read_history` from any process.

On-disk layout, below the checkpoint root::

    _history/<time_ns:020d>-<session>-<seq:06d>-<kind>.json   one per event, created exclusively
    _history/progress-<session>.json                          overwritten in place (step, time)

Each object is versioned JSON (``{"version": 1, "kind", "time", "run_id", "session",
"fields"}``), never pickle. Names sort by time; the session and a per-session sequence make
them unique even under a clock that repeats. Objects are small and written with
``durable=False``: losing the last events in a power cut costs a report line, not a checkpoint,
while an fsync per event would cost the training step (or a PUT's latency on an object store).

Recording never raises: a failed write logs one warning per kind and is counted in
:attr:`RunHistory.failures`. Reading never trusts storage: links, folders, unknown names,
objects over :data:`MAX_OBJECT_BYTES`, invalid JSON, wrong types and newer versions are
skipped and counted, never followed and never a crash.

The directory holds no file a save writes (see
:func:`~lightning_elastic.core.format.catalog.holds_checkpoint_files`), so the catalog, ``ls``,
``prune``, retention and garbage collection never list or delete it.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.options import check_seconds
from lightning_elastic.core.storage.base import Entry, Storage
from lightning_elastic.core.storage.retry import RetryPolicy
from lightning_elastic.errors import CheckpointExistsError, ConfigError

__all__ = [
    "HISTORY_DIR",
    "HISTORY_VERSION",
    "KINDS",
    "MAX_OBJECT_BYTES",
    "Event",
    "RunHistory",
    "read_history",
]

log = fork_safe_logger(__name__)  # commits are recorded from the writer thread

HISTORY_DIR = "_history"
HISTORY_VERSION = 1
# The kinds this release writes; a reader accepts any well-formed kind (a newer writer's).
KINDS = (
    "start",
    "resume",
    "commit",
    "save_failed",
    "straggler",
    "cadence",
    "replica",
    "end",
    "progress",
)
# An event is a few hundred bytes (a start with 1,024 host names: ~20 KiB).
MAX_OBJECT_BYTES = 64 * 1024
# Recording retries briefly: a storage outage must not hold the training step for the
# engine's two-minute retry deadline; a lost event costs a report line.
_RECORD_RETRY = RetryPolicy(deadline_s=5.0, max_attempts=3)
_MAX_UNIX = 1e11  # year ~5100: anything later is not a timestamp
_MAX_RUN_ID = 256
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_SESSION = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_EVENT_NAME = re.compile(r"^\d{20}-([A-Za-z0-9_]{1,64})-\d{6,}-([a-z][a-z0-9_]{0,31})\.json$")
_PROGRESS_NAME = re.compile(r"^progress-([A-Za-z0-9_]{1,64})(?:-\d{6,})?\.json$")
_IN_FLIGHT = re.compile(r"\.json\.tmp-[0-9a-f]+$")  # an exclusive write on a local disk


@dataclass(frozen=True)
class Event:
    """One recorded event (``kind="progress"`` for a session's progress record).

    ``time`` is Unix seconds; ``session`` names one process group's lifetime (one fit of one
    launch); ``fields`` holds JSON values only (see each kind's fields in docs/monitoring.md).
    """

    kind: str
    time: float
    run_id: str | None
    session: str
    fields: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The event as a JSON object (the on-disk body, without its version)."""
        return {
            "kind": self.kind,
            "time": self.time,
            "run_id": self.run_id,
            "session": self.session,
            "fields": self.fields,
        }


class RunHistory:
    """Records the events of one session of a run in ``<storage>/_history``.

    Args:
        storage: the checkpoint root (used with a short retry: at most 3 attempts in 5 s).
        run_id: the run the events belong to (``None`` when not known yet).
        session: this session's id (letters, digits, ``_``); a new 12-digit hex id when
            ``None``.
        clock: Unix seconds (injected in tests).
        progress_every_s: the least time between two writes of the progress record.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        run_id: str | None,
        session: str | None = None,
        clock: Callable[[], float] = time.time,
        progress_every_s: float = 10.0,
    ) -> None:
        if run_id is not None and (not isinstance(run_id, str) or len(run_id) > _MAX_RUN_ID):
            raise ConfigError(f"run_id must be a string of at most {_MAX_RUN_ID} characters")
        if session is not None and (not isinstance(session, str) or not _SESSION.match(session)):
            raise ConfigError(f"session must be 1 to 64 letters, digits or '_', got {session!r}")
        progress_every_s = check_seconds(progress_every_s, "progress_every_s", zero=True)
        self.storage = _short_retry(storage)
        self.run_id = run_id
        self.session: str = session or uuid.uuid4().hex[:12]
        self.clock = clock
        self.progress_every_s = float(progress_every_s)
        self.failures = 0
        self._warned: set[str] = set()
        self._seq = 0
        self._last_progress: float | None = None
        self._progress_seq = 0
        self._progress_rel: str | None = None
        self._lock = threading.Lock()  # the training thread and the writer thread record

    def record(self, kind: str, **fields: Any) -> None:
        """One new object per event under ``_history/`` (name sortable by time, unique: time_ns
        + session + sequence + kind), exclusive create, ``durable=False``. Never raises:
        observability never fails training - a failed write logs one warning (per kind) and
        is counted in :attr:`failures`."""
        try:
            if not isinstance(kind, str) or not _KIND.match(kind) or kind == "progress":
                raise ValueError(f"{kind!r} is not an event kind (lowercase, not 'progress')")
            now = self._now()
            body = _encode(kind, now, self.run_id, self.session, fields)
            for _ in range(3):  # a repeating clock and a name already taken: next sequence
                with self._lock:
                    seq = self._seq
                    self._seq += 1
                rel = f"{HISTORY_DIR}/{round(now * 1e9):020d}-{self.session}-{seq:06d}-{kind}.json"
                try:
                    self.storage.write_bytes(rel, body, exclusive=True, durable=False)
                    return
                except CheckpointExistsError:
                    continue
            raise CheckpointExistsError(f"{HISTORY_DIR}: three event names were taken")
        except Exception as exc:
            self._failed(str(kind), exc)

    def progress(self, step: int, *, force: bool = False, **fields: Any) -> bool:
        """Replace this session's progress record (``_history/progress-<session>-<seq>.json``)
        with ``{step, time, **fields}`` when at least ``progress_every_s`` passed since the last
        write (or ``force``, or on the first call). Returns whether it wrote. Never raises.

        The new record is created exclusively (atomically) under the next sequence number and
        only then is the previous one deleted: a process killed at any moment leaves a readable
        record (rewriting one object in place, half of 20 kills during the write left none)."""
        try:
            if type(step) is not int:
                raise TypeError(f"step must be an int, got {step!r}")
            now = self._now()
            last = self._last_progress
            # a clock that went back (a fake one, NTP) writes rather than waits for it
            if not force and last is not None and 0 <= now - last < self.progress_every_s:
                return False
            # set before writing: a failing storage is tried once per period, not every step
            self._last_progress = now
            body = _encode("progress", now, self.run_id, self.session, {"step": step, **fields})
            with self._lock:
                self._progress_seq += 1
                seq = self._progress_seq
            rel = f"{HISTORY_DIR}/progress-{self.session}-{seq:06d}.json"
            self.storage.write_bytes(rel, body, exclusive=True, durable=False)
            previous, self._progress_rel = self._progress_rel, rel
            if previous is not None:
                self.storage.delete(previous)
            return True
        except Exception as exc:
            self._failed("progress", exc)
            return False

    def last_progress(self) -> Event | None:
        """The newest progress record of this run (any session, by its time): e.g. the previous
        launch's last step before it was killed. ``None`` when there is none, or on any error
        (never raises)."""
        try:
            newest: Event | None = None
            for entry in self.storage.listdir(HISTORY_DIR):
                if not _PROGRESS_NAME.match(entry.name):
                    continue
                event = _load(self.storage, entry)
                if event is None or event.run_id != self.run_id:
                    continue
                if newest is None or event.time > newest.time:
                    newest = event
            return newest
        except Exception as exc:
            log.debug("could not read the progress records of %s: %r", self.storage, exc)
            return None

    def _now(self) -> float:
        now = float(self.clock())
        if not 0 <= now <= _MAX_UNIX:  # also refuses nan
            raise ValueError(f"the clock returned {now!r}, not Unix seconds")
        return now

    def _failed(self, kind: str, exc: Exception) -> None:
        with self._lock:
            self.failures += 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            log.warning(
                "could not record a %r event in %s (training goes on; further failures of "
                "this kind are logged at debug level): %r",
                kind,
                self.storage.display(HISTORY_DIR),
                exc,
            )
        else:
            log.debug("could not record a %r event: %r", kind, exc)


def _short_retry(storage: Storage) -> Storage:
    """``storage`` (same files, same client) retrying as :data:`_RECORD_RETRY` says."""
    try:
        short = storage._copy()
    except NotImplementedError:  # a backend without copies (a test double): as it is
        return storage
    short.retry = _RECORD_RETRY
    return short


def read_history(
    storage: Storage, *, run_id: str | None = None, kinds: Collection[str] | None = None
) -> tuple[list[Event], int]:
    """All events in ``storage``'s history (progress records included, as
    ``kind="progress"``), oldest first, optionally only run ``run_id``'s and only ``kinds``
    (chosen by object name, so the others are never read: a start-up that needs the resumes
    of a long run does not fetch its thousands of commit events); and how many objects were
    skipped as unreadable or invalid (links, folders, unknown names, objects over
    :data:`MAX_OBJECT_BYTES`, bad JSON or fields, a newer version). A failure to list the
    directory raises :class:`~lightning_elastic.errors.StorageError`; a missing directory
    is an empty history."""
    events: list[tuple[float, str, Event]] = []
    skipped = 0
    for entry in storage.listdir(HISTORY_DIR):
        if _IN_FLIGHT.search(entry.name):
            continue  # another process's write, published under its own name in a moment
        named = _EVENT_NAME.match(entry.name)
        if not (named or _PROGRESS_NAME.match(entry.name)):
            skipped += 1
            continue
        if kinds is not None and (named.group(2) if named else "progress") not in kinds:
            continue
        event = _load(storage, entry)
        if event is None:
            skipped += 1
        elif run_id is None or event.run_id == run_id:
            events.append((event.time, entry.name, event))
    events.sort(key=lambda t: (t[0], t[1]))
    return [e for _, _, e in events], skipped


# ----------------------------------------------------------------------------- encoding


def _encode(
    kind: str, now: float, run_id: str | None, session: str, fields: Mapping[str, Any]
) -> bytes:
    body = {
        "version": HISTORY_VERSION,
        "kind": kind,
        "time": now,
        "run_id": run_id,
        "session": session,
        "fields": _jsonable(dict(fields)),
    }
    data = json.dumps(body, sort_keys=True, allow_nan=False).encode()
    if len(data) > MAX_OBJECT_BYTES:  # a reader would skip it
        raise ValueError(f"the {kind} event is {len(data)} bytes, over {MAX_OBJECT_BYTES}")
    return data


def _jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` with what strict JSON cannot hold replaced: a non-finite float by ``None``,
    anything else by its string (an odd field must not cost the whole event)."""
    if depth > 16:
        return str(value)
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    item = getattr(value, "item", None)  # a numpy or torch scalar
    if callable(item):
        try:
            return _jsonable(item(), depth + 1)
        except Exception:
            pass
    return str(value)


def _load(storage: Storage, entry: Entry) -> Event | None:
    """The event in ``entry`` (a name already matched), or ``None`` when it is not a valid one."""
    if entry.is_link or entry.is_dir or not 0 < entry.size <= MAX_OBJECT_BYTES:
        return None  # size 0 also keeps us from opening a FIFO planted with a good name
    rel = f"{HISTORY_DIR}/{entry.name}"
    try:
        data = storage.read_bytes(rel)
        if len(data) > MAX_OBJECT_BYTES:  # grew since the listing
            return None
        event = _parse(json.loads(data, parse_constant=_no_constant))
    except Exception as exc:  # unreadable, a link planted since the listing, bad JSON, ...
        log.debug("skipping history object %s: %r", storage.display(rel), exc)
        return None
    if event is None:
        log.debug("skipping history object %s: invalid or newer version", storage.display(rel))
        return None
    named = _EVENT_NAME.match(entry.name)
    if named is not None and named.groups() != (event.session, event.kind):
        return None  # moved or edited: the name and the body disagree
    progress = _PROGRESS_NAME.match(entry.name)
    if progress is not None and (progress.group(1) != event.session or event.kind != "progress"):
        return None
    return event


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse(data: Any) -> Event | None:
    if not isinstance(data, dict):
        return None
    version, kind, when = data.get("version"), data.get("kind"), data.get("time")
    run_id, session, fields = data.get("run_id"), data.get("session"), data.get("fields")
    if type(version) is not int or not 1 <= version <= HISTORY_VERSION:
        return None  # a newer writer's format is refused, never guessed at
    if not isinstance(kind, str) or not _KIND.match(kind):
        return None
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        return None
    if not (math.isfinite(when) and 0 <= when <= _MAX_UNIX):
        return None
    if run_id is not None and (not isinstance(run_id, str) or len(run_id) > _MAX_RUN_ID):
        return None
    if not isinstance(session, str) or not _SESSION.match(session):
        return None
    if not isinstance(fields, dict):
        return None
    if kind == "progress" and type(fields.get("step")) is not int:
        return None
    return Event(kind, float(when), run_id, session, fields)
