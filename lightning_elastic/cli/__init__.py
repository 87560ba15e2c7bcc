"""``lightning-elastic``: list, inspect, verify, prune and consolidate checkpoints, import a
Lightning ``.ckpt`` or DCP directory, report on a run; ``run`` launches training like torchrun
(see :mod:`lightning_elastic.launcher`).

Works on local paths and fsspec URLs (``-o key=value`` passes storage options, e.g.
``-o endpoint_url=http://127.0.0.1:9000``). Every verb takes ``--json``: then everything it
prints on stdout is JSON, errors included (``{"error": "...", "exit_code": N}``).
Multi-tier runs: ``ls DIR --local PATH`` (one per node's local root) adds the tiers holding
each checkpoint (``ls --help`` explains the notation).

What is checked: ``ls``, ``inspect`` and ``prune`` read the manifests and compare the file
sizes they record with one listing per checkpoint (``--check none|size|full`` for ``ls`` and
``inspect``; ``prune`` never deletes a checkpoint whose sizes do not match, and counts it as
corrupt). Only ``verify`` (and ``--check full``) reads the data and compares checksums.
``verify`` and ``consolidate`` draw a progress bar on stderr when stderr is a terminal.

Exit codes:

* 0: done; for ``verify``, every checkpoint it checked is valid;
* 1: ``verify``/``consolidate`` found a checkpoint corrupt (or, named alone, incomplete),
  ``import`` found its source corrupt or wrote one that does not read back as it, or had
  nothing to check (``report``: neither checkpoints nor history); ``prune`` could not delete
  a checkpoint it planned to delete. In a root, ``verify`` lists directories without a
  manifest as ``incomplete`` (a save in flight, or a crashed one that the next save or
  ``prune`` collects) without failing for them;
* 2: bad arguments, or a path that is not what the verb needs (missing, a file, a checkpoint
  root where one checkpoint is expected or the reverse), or a storage error;
* 3: an unexpected error (one line; ``LIGHTNING_ELASTIC_DEBUG=1`` shows the traceback);
* 130: interrupted; 141: stdout was closed early (``lightning-elastic ls DIR | head -1``).

The manifest-only verbs (``ls``, ``inspect``, ``prune``, ``verify --mode size``, ``report``)
import neither Lightning nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from lightning_elastic.cli import (
    consolidate,
    import_,
    inspect,
    lighthouse,
    ls,
    prune,
    report,
    run,
    verify,
)
from lightning_elastic.cli.common import (
    DEBUG_ENV,
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    EXIT_UNEXPECTED,
    EXIT_USAGE,
    CliError,
    Parser,
)
from lightning_elastic.errors import ElasticCheckpointError

__all__ = ["main"]

# the subcommands, in the order --help lists them (one module each)
VERBS = (run, lighthouse, ls, inspect, verify, prune, consolidate, import_, report)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit code.
    Errors are printed (as JSON with ``--json``), not raised; see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's own command line, passed through untouched
        return run.launch(argv[1:])
    as_json = "--json" in argv
    try:
        args = _parser().parse_args(argv)
        code: int = args.func(args)
        sys.stdout.flush()  # a closed pipe fails here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _pipe_closed()
    except CliError as exc:
        return _fail(str(exc), exc.code, as_json)
    except ElasticCheckpointError as exc:
        return _fail(str(exc), EXIT_USAGE, as_json)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED, as_json)
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        message = f"unexpected {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 for a traceback)"
        return _fail(message, EXIT_UNEXPECTED, as_json)


def _fail(message: str, code: int, as_json: bool) -> int:
    try:
        if as_json:
            print(json.dumps({"error": message, "exit_code": code}))
            sys.stdout.flush()
        else:
            print(f"error: {message}", file=sys.stderr)
    except BrokenPipeError:
        return _pipe_closed()
    return code


def _pipe_closed() -> int:
    """The reader went away: say nothing, and keep Python's final flush from complaining."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (captured in tests): nothing will be flushed to it
    return EXIT_PIPE_CLOSED


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="lightning-elastic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(required=True, dest="verb")
    for verb in VERBS:
        verb.add_parser(sub)
    return parser
