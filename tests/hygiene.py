"""What one test can leave in the pytest process for the tests after it."""

from __future__ import annotations

import os

# what Lightning's in-process fits leave in os.environ (_init_dist_connection writes
# MASTER_ADDR/MASTER_PORT and nothing removes them): a later test's child processes inherited
# the port of a store still open in this process and failed with EADDRINUSE
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


def job_environ() -> dict[str, str]:
    """This process's environment for a child that is a job of its own: without this
    process's torch.distributed variables."""
    return {k: v for k, v in os.environ.items() if k not in DIST_ENV}
