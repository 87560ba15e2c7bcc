import errno

import pytest

from lightning_elastic.core.storage.retry import RetryPolicy, classify_error, retry_call
from lightning_elastic.errors import (
    ConfigError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
    TransientStorageError,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ClientError(Exception):  # shaped like botocore's
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class EndpointConnectionError(Exception):
    pass


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.EIO, "io"),
        OSError(errno.EBUSY, "SlowDown"),  # what s3fs makes of S3 throttling
        ConnectionResetError(),
        TimeoutError(),
        ClientError("SlowDown"),
        ClientError("503"),
        EndpointConnectionError(),
    ],
)
def test_transient(exc) -> None:
    assert classify_error(exc) is None


@pytest.mark.parametrize(
    ("exc", "typed"),
    [
        (PermissionError(errno.EACCES, "denied"), StoragePermissionError),
        (OSError(errno.ENOSPC, "full"), StorageFullError),
        (OSError(errno.EDQUOT, "quota"), StorageFullError),
        (FileNotFoundError(errno.ENOENT, "no bucket"), StorageNotFoundError),
        (ValueError("bad"), StorageError),
        (ClientError("AccessDenied"), StorageError),
    ],
)
def test_permanent(exc, typed) -> None:
    assert classify_error(exc) is typed


def test_backoff_is_exponential_and_capped() -> None:
    clock = FakeClock()
    policy = RetryPolicy(
        deadline_s=100, initial_backoff_s=1, max_backoff_s=4, sleep=clock.sleep, clock=clock
    )
    calls = []

    def flaky() -> str:
        calls.append(clock.now)
        if len(calls) < 6:
            raise ConnectionResetError()
        return "ok"

    assert retry_call(policy, "read", "x", flaky) == "ok"
    assert len(clock.sleeps) == 5
    caps = [1, 2, 4, 4, 4]
    for slept, cap in zip(clock.sleeps, caps, strict=True):
        assert cap * 0.5 <= slept <= cap


def test_deadline_is_respected() -> None:
    clock = FakeClock()
    policy = RetryPolicy(
        deadline_s=10, initial_backoff_s=1, max_backoff_s=8, sleep=clock.sleep, clock=clock
    )

    def always() -> None:
        raise TimeoutError("slow")

    with pytest.raises(TransientStorageError, match="gave up"):
        retry_call(policy, "write", "s3://b/k", always)
    assert clock.now <= 10


def test_policy_validation() -> None:
    with pytest.raises(ConfigError, match="deadline_s"):
        RetryPolicy(deadline_s=0)
    with pytest.raises(ConfigError, match="initial_backoff_s"):
        RetryPolicy(initial_backoff_s=5, max_backoff_s=1)
