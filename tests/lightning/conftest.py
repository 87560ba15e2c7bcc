"""Shared by the Lightning tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """ElasticStrategy in-process initializes a (1-process) default group that Lightning's
    teardown keeps, and Lightning writes MASTER_ADDR/MASTER_PORT/... into os.environ: destroy
    the group and put the environment back, or later tests of this session think they run
    distributed (Lightning then warns, an error here), and the scripts they start inherit a
    port that is taken."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
