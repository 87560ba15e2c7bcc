"""``lightning-elastic run``: torchrun, except that a planned membership change does not use up
the failure budget.

With plain torchrun, draining a node (SIGTERM to its agent) makes every worker take the
agreed checkpoint and exit ``143``; the surviving agents see their workers *fail* and spend
one of ``--max-restarts`` on the restart, so a job drained N times dies although nothing
failed. This launcher is torchrun (same arguments, same elastic agent, same c10d rendezvous)
with one difference: a worker group whose failed workers all left a planned-exit marker (see
:mod:`lightning_elastic.core.elastic.planned_exit`; ``DistributedCheckpoint`` writes it right
before exiting after the agreed checkpoint, with the exit code it is about to use) is restarted
without counting a failure. Anything else (a crash, a SIGKILL, an exit code that does not match
the marker) counts as before.

Usage: ``lightning-elastic run [torchrun arguments] train.py [script arguments]``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from lightning_elastic.core._compat import elastic_agent_class, torchrun_entry
from lightning_elastic.core.elastic.planned_exit import PLANNED_EXIT_ENV, read_planned_exit

__all__ = ["PlannedExitAgent", "main"]

log = logging.getLogger(__name__)


class PlannedExitAgent(LocalElasticAgent):
    """torch's local elastic agent, counting a worker group that exited after an agreed
    checkpoint as a membership change (a restart that keeps the failure budget)."""

    def _monitor_workers(self, worker_group: Any) -> Any:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._planned(result):
            # the agent's loop spends one restart on a failed group: give it back
            self._remaining_restarts += 1
            log.warning(
                "worker group left after an agreed checkpoint (planned exit of ranks %s): "
                "restarting without counting a failure (%d restarts left)",
                sorted(result.failures),
                self._remaining_restarts - 1,
            )
        return result

    @staticmethod
    def _planned(result: Any) -> bool:
        folder = os.environ.get(PLANNED_EXIT_ENV)
        if not folder or not result.failures:
            return False
        for failure in result.failures.values():
            marker = read_planned_exit(folder, failure.pid)
            if marker is None or marker.get("exitcode") != failure.exitcode:
                return False
        return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun's command line ``argv`` with :class:`PlannedExitAgent`; the exit code is
    0, 1 when the job failed, 2 for a bad option (a one-line error)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parse_args, run = torchrun_entry()
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory(prefix="lightning-elastic-exits-") as folder:
        previous = os.environ.get(PLANNED_EXIT_ENV)
        os.environ[PLANNED_EXIT_ENV] = folder  # the workers inherit the agent's environment
        try:
            with elastic_agent_class(PlannedExitAgent):
                run(args)
        except ChildFailedError as exc:
            print(f"error: the job failed:\n{exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # a bad rendezvous option, found when the agent starts
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            if previous is None:
                os.environ.pop(PLANNED_EXIT_ENV, None)
            else:
                os.environ[PLANNED_EXIT_ENV] = previous
    return 0
