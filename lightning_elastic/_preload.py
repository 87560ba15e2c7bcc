"""What the warm-start fork server imports (``lightning-elastic run --warm-start``): the
modules named in the ``LIGHTNING_ELASTIC_PRELOAD`` environment variable, each on its own. One
that fails to import is reported on stderr and left to the workers, which import it themselves
(and fail there, with their own traceback, if it is broken): a preload never takes the server,
and with it every worker start, down. Importing this module does the preloading, so the
launcher does not import it."""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["PRELOAD_ENV", "preload"]

PRELOAD_ENV = "LIGHTNING_ELASTIC_PRELOAD"  # launcher.PRELOAD_ENV (not imported: see above)


def preload(names: str) -> list[str]:
    """Import each of the comma-separated ``names``; the ones that failed."""
    failed = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a module may even call sys.exit at import
            failed.append(name)
            print(
                f"lightning-elastic run --warm-start: could not preload {name} "
                f"({type(exc).__name__}: {exc}); the workers import it themselves",
                file=sys.stderr,
                flush=True,
            )
    return failed


preload(os.environ.get(PRELOAD_ENV, ""))
