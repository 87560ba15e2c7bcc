"""``lightning-elastic lighthouse``: torchft's Lighthouse for replica groups, in the foreground
(the server and its options are :mod:`lightning_elastic.lighthouse`)."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_elastic import lighthouse

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Add ``lighthouse`` to the subcommands."""
    beacon = sub.add_parser(
        "lighthouse",
        help="torchft's Lighthouse for replica groups (strategy='elastic_ft'), in the "
        "foreground until SIGTERM/Ctrl-C",
        description=lighthouse.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lighthouse.add_arguments(beacon)
    beacon.set_defaults(func=lighthouse.serve)
