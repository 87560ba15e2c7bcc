"""The markers tests/conftest.py puts on each test from what it can reach: ``multiprocess`` for
a process starter (run_distributed, subprocess, multiprocessing, ``ddp_spawn``), ``torchrun``
for torch's elastic launcher or ``lightning-elastic run``; neither for code that only names
them in a docstring or calls nothing of the kind."""

from __future__ import annotations

import subprocess
import sys

from lightning_elastic.testing.spawn import run_distributed
from tests.conftest import _Reach

LAUNCH = "import sys; from lightning_elastic.cli import main; sys.exit(main())"


def _rank(x: int) -> int:
    return x


def _spawns_through_a_helper() -> None:
    run_distributed(_rank, 2, 1)


def _starts_the_elastic_launcher() -> None:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "script.py"], check=True)


def _starts_lightning_elastic_run() -> None:
    subprocess.run([sys.executable, "-c", LAUNCH, "run", "script.py"], check=True)


def _starts_the_cli_for_ls() -> None:
    subprocess.run([sys.executable, "-c", LAUNCH, "ls", "root"], check=True)


def _asks_for_a_spawning_strategy() -> dict:
    return {"strategy": "ddp_spawn"}


def _only_mentions_them() -> int:
    """Would be run by torchrun, or by run_distributed, or ddp_spawn: not here."""
    return _rank(1)


def reach(name: str) -> tuple[bool, bool]:
    """By name, so that the tests below reach none of these helpers themselves (they would be
    marked, and leave the fast subset)."""
    r = _Reach()
    r.obj(globals()[name])
    return r.spawns, r.torchrun


def test_a_test_calling_a_helper_that_spawns_is_multiprocess() -> None:
    assert reach("_spawns_through_a_helper") == (True, False)


def test_a_test_starting_torchrun_or_lightning_elastic_run_is_torchrun_and_multiprocess() -> None:
    assert reach("_starts_the_elastic_launcher") == (True, True)
    assert reach("_starts_lightning_elastic_run") == (True, True)


def test_another_cli_verb_in_a_subprocess_is_multiprocess_only() -> None:
    assert reach("_starts_the_cli_for_ls") == (True, False)


def test_ddp_spawn_is_multiprocess() -> None:
    assert reach("_asks_for_a_spawning_strategy") == (True, False)


def test_a_docstring_naming_the_launchers_marks_nothing() -> None:
    assert reach("_only_mentions_them") == (False, False)
