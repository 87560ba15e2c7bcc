"""``lightning-elastic run``: torchrun's own command line, passed through untouched to
:mod:`lightning_elastic.launcher` (which imports torch: only when the verb runs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["add_parser", "launch"]


def add_parser(sub: Any) -> None:
    """List ``run`` among the subcommands (for ``--help``: :func:`launch` takes it before the
    parser does)."""
    sub.add_parser(
        "run",
        help="torchrun (same arguments), except that a planned membership change does not "
        "use up --max-restarts; --warm-start forks workers with torch and Lightning imported",
    )


def launch(argv: Sequence[str]) -> int:
    """Run the launcher on torchrun's arguments ``argv`` (everything after ``run``)."""
    from lightning_elastic.launcher import main

    code: int = main(list(argv))
    return code
