"""Which storage errors are worth retrying, and the backoff used for them.

Transient: connection resets, timeouts, throttling (S3 ``SlowDown``/503), ``EIO``/``EAGAIN``.
Permanent: permission denied, no space, missing bucket or file, invalid requests; these
fail at once with a typed :class:`~lightning_elastic.errors.StorageError`.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.options import check_count, check_number, check_seconds
from lightning_elastic.errors import (
    ConfigError,
    ElasticCheckpointError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
    TransientStorageError,
)

__all__ = ["RetryPolicy", "classify_error", "retry_call"]

log = fork_safe_logger(__name__)  # also logs from the writer thread
T = TypeVar("T")

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "EAGAIN",
        "EINTR",
        "EBUSY",
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "EHOSTUNREACH",
        "EREMOTEIO",
        "ESTALE",
    )
    if hasattr(errno, name)
)
_FULL_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT") if hasattr(errno, n))
_DENIED_ERRNOS = frozenset(getattr(errno, n) for n in ("EACCES", "EPERM", "EROFS"))
# Exception class names from botocore/aiohttp/urllib3 that mean "the network hiccuped".
_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "ProtocolError",
        "IncompleteRead",
        "FSTimeoutError",
    }
)
_TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "500",
        "502",
        "503",
        "504",
    }
)


def classify_error(exc: BaseException) -> type[StorageError] | None:
    """Return the typed error for a permanent failure, or ``None`` when it is transient."""
    if isinstance(exc, StorageError):
        return type(exc)
    code = getattr(exc, "errno", None)
    if isinstance(exc, PermissionError) or code in _DENIED_ERRNOS:
        return StoragePermissionError
    if code in _FULL_ERRNOS:
        return StorageFullError
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)) or code == errno.ENOENT:
        return StorageNotFoundError
    if isinstance(exc, FileExistsError):
        return StorageError
    if isinstance(exc, (TimeoutError, ConnectionError)) or code in _TRANSIENT_ERRNOS:
        return None
    for klass in type(exc).__mro__:
        if klass.__name__ in _TRANSIENT_NAMES:
            return None
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        s3_code = str(response.get("Error", {}).get("Code", ""))
        if s3_code in _TRANSIENT_S3_CODES:
            return None
    return StorageError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient storage errors.

    Args:
        deadline_s: give up once this many seconds have passed since the first attempt.
        max_attempts: give up after this many attempts (``0`` = limited by the deadline only).
        initial_backoff_s: first wait between attempts.
        max_backoff_s: upper bound of one wait.
        multiplier: growth of the wait after each failed attempt.
    """

    deadline_s: float = 120.0
    max_attempts: int = 0
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        checked = {
            "deadline_s": check_seconds(self.deadline_s, "RetryPolicy.deadline_s"),
            "max_attempts": check_count(self.max_attempts, "RetryPolicy.max_attempts", minimum=0),
            "initial_backoff_s": check_seconds(
                self.initial_backoff_s, "RetryPolicy.initial_backoff_s"
            ),
            "max_backoff_s": check_seconds(self.max_backoff_s, "RetryPolicy.max_backoff_s"),
            "multiplier": check_number(self.multiplier, "RetryPolicy.multiplier", low=1),
        }
        for name, value in checked.items():  # plain numbers (a Decimal does not add to a float)
            object.__setattr__(self, name, value)
        if self.initial_backoff_s > self.max_backoff_s:
            raise ConfigError(
                "RetryPolicy needs initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s} and {self.max_backoff_s}"
            )


def retry_call(policy: RetryPolicy, op: str, where: str, fn: Callable[[], T]) -> T:
    """Call ``fn`` until it succeeds, retrying transient errors within ``policy``.

    Permanent errors raise a typed :class:`StorageError` at once (the cause chained);
    transient ones that outlive the policy raise :class:`TransientStorageError`.
    """
    start = policy.clock()
    backoff = policy.initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except ElasticCheckpointError:
            raise  # already typed (e.g. CheckpointExistsError from an exclusive create)
        except Exception as exc:
            typed = classify_error(exc)
            if typed is not None:
                raise typed(op, where, exc) from exc
            elapsed = policy.clock() - start
            wait = backoff * random.uniform(0.5, 1.0)
            out_of_attempts = policy.max_attempts and attempt >= policy.max_attempts
            if out_of_attempts or elapsed + wait > policy.deadline_s:
                raise TransientStorageError(
                    op,
                    where,
                    exc,
                    hint=f"gave up after {attempt} attempts in {elapsed:.1f}s",
                ) from exc
            log.warning(
                "transient storage error during %s of %s (attempt %d): %r; retrying in %.2fs",
                op,
                where,
                attempt,
                exc,
                wait,
            )
            policy.sleep(wait)
            backoff = min(backoff * policy.multiplier, policy.max_backoff_s)
