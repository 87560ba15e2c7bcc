import itertools
import os
import signal
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pytest

from lightning_elastic.testing.s3 import S3Server
from tests.hygiene import DIST_ENV

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_root(s3_server: S3Server) -> str:
    return s3_server.create_bucket(f"bucket-{os.getpid()}-{next(_buckets)}") + "/ckpts"


@pytest.fixture(params=["local", "memory", "s3"])
def any_root(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict]:
    """A checkpoint root on each backend the storage suite runs against."""
    if request.param == "local":
        return str(tmp_path / "ckpts"), {}
    if request.param == "memory":
        return f"memory://suite-{os.getpid()}-{next(_buckets)}/ckpts", {}
    server = request.getfixturevalue("s3_server")
    return server.create_bucket(f"suite-{next(_buckets)}") + "/ckpts", server.storage_options


# ------------------------------------------------------------------------------------ markers
# ``multiprocess``, ``torchrun`` and ``s3`` are put on each test here, from what the test can
# reach, so that a new test is marked without anyone remembering to: ``pytest -m "not
# multiprocess"`` is the fast subset for the edit-test loop (README, "Tests").
#
# A test is ``multiprocess`` when its function, a fixture it uses, or a helper they call (in
# tests/ or lightning_elastic/testing/, followed through module attributes such as
# ``workers.fit``) calls one of the process starters below or names Lightning's ``ddp_spawn``;
# ``torchrun`` when what it reaches names torch's elastic launcher or ``lightning-elastic run``
# (also ``multiprocess``); ``s3`` when it uses the moto server (``s3_server``, ``s3_root``, the
# ``s3`` case of ``any_root``). The walk reads code objects only: nothing is called.

_STARTERS: set[int] = set()
_STARTER_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing"}
_SPAWN_WORDS = ("ddp_spawn",)
_TORCHRUN_WORDS = ("torch.distributed.run", "torchrun")
_CLI = "lightning_elastic.cli import main"  # with the verb "run" beside it: lightning-elastic run
_OURS = ("tests.", "lightning_elastic.testing")


def _ours(module: str) -> bool:
    """Code the walk follows: the tests' and lightning_elastic.testing's, not this walk's own."""
    return module.startswith(_OURS) and module != __name__


def _starters() -> set[int]:
    if not _STARTERS:
        import multiprocessing
        import subprocess

        import torch.multiprocessing

        from lightning_elastic.testing import spawn

        for obj in (
            spawn.run_distributed,
            subprocess.Popen,
            subprocess.run,
            subprocess.call,
            subprocess.check_call,
            subprocess.check_output,
            multiprocessing.Process,
            multiprocessing.Pool,
            multiprocessing.get_context,
            torch.multiprocessing.spawn,
            torch.multiprocessing.start_processes,
        ):
            _STARTERS.add(id(obj))
    return _STARTERS


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, tuple | list | frozenset):
        for item in value:
            yield from _strings(item)


class _Reach:
    """What a test can reach: ``spawns`` and ``torchrun`` once seen."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.spawns = False
        self.torchrun = False

    def words(self, values: Iterable[object]) -> None:
        texts = [s for v in values for s in _strings(v)]
        if any(w in t for t in texts for w in _TORCHRUN_WORDS) or (
            "run" in texts and any(_CLI in t for t in texts)
        ):
            self.torchrun = self.spawns = True
        elif any(w in t for t in texts for w in _SPAWN_WORDS):
            self.spawns = True

    def obj(self, obj: object, names: Sequence[str] = ()) -> None:
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if id(obj) in _starters():
            self.spawns = True
        elif isinstance(obj, types.ModuleType):
            if obj.__name__ in _STARTER_MODULES:
                self.spawns = True
            elif _ours(obj.__name__):
                for name in names:  # the attributes the referring code reads, e.g. w.fit
                    if name in vars(obj):
                        self.obj(vars(obj)[name], names)
        elif isinstance(obj, types.FunctionType) and _ours(obj.__module__):
            self.words([obj.__defaults__, *(obj.__kwdefaults__ or {}).values()])
            self.code(obj.__code__, obj.__globals__, obj.__doc__)
        elif isinstance(obj, type) and _ours(obj.__module__):
            for value in vars(obj).values():
                if callable(getattr(value, "__func__", value)):
                    self.obj(getattr(value, "__func__", value))

    def code(self, code: types.CodeType, globals_: dict[str, Any], doc: str | None = None) -> None:
        texts = [c for c in code.co_consts if not isinstance(c, types.CodeType) and c != doc]
        for name in code.co_names:
            value = globals_.get(name)
            if isinstance(value, str | tuple | list):
                texts.append(value)  # a module constant: a command line, a launcher
            elif name in globals_:
                self.obj(value, code.co_names)
        self.words(texts)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const, globals_)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        reach = _Reach()
        reach.obj(item.function)
        fixtures = item._fixtureinfo.name2fixturedefs
        for name in item.fixturenames:
            for fixture in fixtures.get(name, ()):
                reach.obj(fixture.func)
        params = getattr(item, "callspec", None)
        if {"s3_server", "s3_root"} & set(item.fixturenames) or (
            params is not None and params.params.get("any_root") == "s3"
        ):
            item.add_marker(pytest.mark.s3)
        if reach.torchrun:
            item.add_marker(pytest.mark.torchrun)
        if reach.spawns:
            item.add_marker(pytest.mark.multiprocess)
    _heavy_modules_first(items)


def _heavy_modules_first(items: list[pytest.Item]) -> None:
    """Modules with torchrun tests first, then those with other multi-process tests, then the
    rest, each module's tests in their order. .ci/run hands whole modules to pytest-xdist
    workers in this order (``--dist loadfile --no-loadscope-reorder``): a module of several
    torchrun chains takes minutes, and one scheduled last kept one worker busy for minutes
    after the other had finished (xdist's own order puts modules with the most tests first)."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    def kind(item: pytest.Item) -> int:
        return next(
            (i for i, m in enumerate(("torchrun", "multiprocess")) if item.get_closest_marker(m)),
            2,
        )

    weight: dict[str, int] = {}
    for item in items:
        weight[module(item)] = min(kind(item), weight.get(module(item), 2))
    items.sort(key=lambda item: weight[module(item)])


# --------------------------------------------------------------------------- process hygiene
#
# One pytest process runs every test, so a test that leaves a signal handler changes the
# tests after it. LitData's optimize() left a SIGINT handler that calls os._exit(0): the next
# Ctrl-C test ended the whole run there, with exit code 0 and two-thirds of the suite unrun.
# Every test's teardown compares the handlers with the session's and fails the test that
# changed them (after putting them back), and puts torch.distributed's variables back;
# .ci/run fails when the session never finished.

_GUARDED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
_session_handlers: dict[int, Any] = {}
_session_env: dict[str, str | None] = {}


def _handlers() -> dict[int, Any]:
    return {s: signal.getsignal(s) for s in _GUARDED_SIGNALS}


_SESSION_PID = os.getpid()  # a forked child that escaped into pytest must not write the marker


def pytest_sessionstart(session: pytest.Session) -> None:
    _session_handlers.update(_handlers())
    _session_env.update({k: os.environ.get(k) for k in DIST_ENV})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    # (a module- or session-scoped fixture that installs a handler is blamed on its first
    # test: such a fixture must install it per test instead)
    try:
        result = yield
    except BaseException:  # a fixture's teardown raised: put back all the same (the next
        _put_back()  # test must not be blamed), and let its error be the report
        raise
    changed = _put_back()
    if changed:
        names = ", ".join(
            f"{signal.Signals(s).name} -> {h!r} (was {_session_handlers[s]!r})"
            for s, h in changed.items()
        )
        raise AssertionError(f"{item.nodeid} left signal handlers changed (put back): {names}")
    return result


def _put_back() -> dict[int, Any]:
    """Put the session's torch.distributed variables and signal handlers back; the handlers
    that had changed."""
    for key, value in _session_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if threading.current_thread() is not threading.main_thread():
        return {}
    changed = {s: h for s, h in _handlers().items() if h != _session_handlers.get(s)}
    for signum in changed:
        signal.signal(signum, _session_handlers[signum])
    return changed


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    marker = os.environ.get("LIGHTNING_ELASTIC_SESSION_MARKER")
    # the controller of a pytest-xdist run (its workers run the tests and finish first)
    controller = not hasattr(session.config, "workerinput")
    if marker and os.getpid() == _SESSION_PID and controller:
        with open(marker, "w") as f:
            f.write(f"finished {int(exitstatus)} {session.testscollected}\n")
