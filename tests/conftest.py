import itertools
import os
from collections.abc import Iterator

import pytest

from lightning_elastic.testing.s3 import S3Server

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
