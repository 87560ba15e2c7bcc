"""Checking user options once, the same way everywhere: each checker returns the value in its
canonical type or raises :class:`~lightning_elastic.errors.ConfigError` naming the option, the
value given and what is accepted. Two of the option groups ``DistributedCheckpoint`` takes are
here too, checked by these checkers: :class:`TierOptions` and :class:`MonitoringOptions`
(the third, ``CadenceOptions``, is beside the cadence it configures; retention rules are the
policy classes themselves).

Options arrive from Python, from YAML (LightningCLI, where ``2.5`` or ``"yes"`` are easy to
write) and from the command line, so nothing is coerced silently: ``every_n_train_steps=2.5``
is an error, not "every 2 steps" or "every 5"; ``shard_optimizer_state="yes"`` is an error, not
``True``.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import operator
import os
import re
import signal as signal_module
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from lightning_elastic.errors import ConfigError

__all__ = [
    "DEFAULT_LOCAL_KEEP",
    "DEFAULT_PERSIST_EVERY_N_SAVES",
    "DEFAULT_REPLICAS",
    "DEFAULT_TIMEOUT",
    "MAX_COUNT",
    "MAX_SECONDS",
    "MIN_SECONDS",
    "MonitoringOptions",
    "TierOptions",
    "check_bool",
    "check_choice",
    "check_count",
    "check_duration",
    "check_factor",
    "check_node_id",
    "check_number",
    "check_port",
    "check_run_name",
    "check_seconds",
    "check_seed",
    "check_signals",
    "one_timeout",
    "tier_options",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)
#: multi-tier defaults: persist every save, one copy of each shard on another node, two
#: checkpoints kept on each node
DEFAULT_PERSIST_EVERY_N_SAVES = 1
DEFAULT_REPLICAS = 1
DEFAULT_LOCAL_KEEP = 2
MAX_SECONDS = 365 * 24 * 3600.0  # beyond this a "timeout" is a mistake (and overflows timers)
MIN_SECONDS = 1e-6  # a timedelta's resolution: a shorter duration becomes 0
#: the largest count an option takes: what a manifest records (and far below what C sizes,
#: deques and torch's seeds overflow at)
MAX_COUNT = 2**62
# signals a process cannot catch: a checkpoint on them is impossible
_UNCATCHABLE = {int(signal_module.SIGKILL), int(signal_module.SIGSTOP)}
_UNSET: Any = object()


def _given(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:  # 10**400 is 401 digits: enough to see what it was
        text = f"{text[:24]}...{text[-12:]} ({len(text)} characters)"
    return f"{text} ({type(value).__name__})"


def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    what: str | None = None,
    unit: str = "",
    given: Any = _UNSET,
) -> Any:
    """The one check of a numeric option: ``value`` as an ``int`` (``integer``: ints only,
    ``2.0`` refused) or a ``float`` within ``low``..``high`` (``*_open``: that end excluded;
    ``None``: unbounded, yet finite). Refused, with a :class:`ConfigError` naming the option,
    the value (``given`` when the user wrote something else, e.g. ``"4h"``) and the range:
    bools, strings and other types, NaN, infinities, and (for a float) integers beyond a
    float's range. Numpy scalars, ``Fraction`` and (for a float) ``Decimal`` are numbers like
    any other; what is returned is always a plain ``int`` or ``float`` (``-0.0`` as ``0.0``),
    which is what the caller should keep.
    """
    shown = value if given is _UNSET else given
    kind = what or ("an integer" if integer else "a number")
    wanted = f"{name} must be {kind} {_range(low, high, low_open, high_open)}{unit}"
    if not _numeric(value, integer):
        raise ConfigError(f"{wanted}, got {_given(shown)}")
    try:
        # + 0.0: a -0.0 would print as another value than 0
        number: Any = operator.index(value) if integer else float(value) + 0.0
    except (OverflowError, ValueError):  # an int beyond a float's range; Decimal('sNaN')
        raise ConfigError(f"{wanted}, got {_given(shown)}") from None
    if not integer and not math.isfinite(number):
        raise ConfigError(f"{wanted}, got {_given(shown)}")
    inside = (low is None or (number > low if low_open else number >= low)) and (
        high is None or (number < high if high_open else number <= high)
    )
    if not inside:
        raise ConfigError(f"{wanted}, got {_given(shown)}")
    return number


def _numeric(value: Any, integer: bool) -> bool:
    """An int (any integral type but bool), or for a float any real number but a bool (a
    ``Decimal`` too: not a ``numbers.Real``, but what ``Decimal("0.05")`` means is clear)."""
    kind = numbers.Integral if integer else (numbers.Real, Decimal)
    return isinstance(value, kind) and not isinstance(value, bool)


def _range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return "" if low is None else f"{'>' if low_open else '>='} {_bound(low)}"
    if low is None:
        return f"{'<' if high_open else '<='} {_bound(high)}"
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    return f"in {left}{_bound(low)}, {_bound(high)}{right}"


def _bound(x: float) -> str:
    if isinstance(x, int):
        for n, text in ((abs(x), ""), (abs(x) + 1, "-1")):  # 2**62, 2**63-1, -2**63
            if n >= 2**20 and n & (n - 1) == 0:
                return f"{'-' if x < 0 else ''}2**{n.bit_length() - 1}{text}"
        return str(x)
    return f"{x:g}"


def check_count(value: Any, name: str, *, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """``value`` as an ``int`` in ``minimum``..``maximum``; floats (even ``2.0``), strings and
    bools are refused."""
    number: int = check_number(value, name, low=minimum, high=maximum, integer=True)
    return number


def check_port(value: Any, name: str = "metrics_port") -> int | None:
    """``None`` or a TCP port number (``0``: any free port)."""
    if value is None:
        return None
    port = check_number(value, name, low=0, high=65535, integer=True, what="None or a port")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"{name}={port} serves metrics with prometheus_client, which is not installed: "
            "pip install 'lightning_elastic[metrics]' (or leave metrics_port=None)"
        )
    return int(port)


def check_factor(value: Any, name: str = "straggler_factor") -> float | None:
    """``None`` or a finite number > 1 (a ratio to the median)."""
    if value is None:
        return None
    factor: float = check_number(value, name, low=1, low_open=True, what="None or a number")
    return factor


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a ``bool`` (``"yes"``, ``1`` and ``None`` are refused)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {_given(value)}")
    return value


def check_choice(value: Any, name: str, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        accepted = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name} must be one of {accepted}, got {_given(value)}")
    return value


def check_seconds(
    value: Any,
    name: str,
    *,
    zero: bool = False,
    maximum: float = MAX_SECONDS,
    given: Any = _UNSET,
    what: str = "a duration (a timedelta or seconds)",
) -> float:
    """A finite duration given as a ``timedelta`` or a number of seconds: at least a
    microsecond (a timedelta's resolution; ``zero``: or 0) and at most ``maximum`` (a year).
    ``what``: how the message calls it."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    years = maximum / MAX_SECONDS
    limit = f" (at most {'a year' if years == 1 else f'{years:g} years'})"
    checked: float = check_number(
        seconds,
        name,
        low=0.0 if zero else MIN_SECONDS,
        high=maximum,
        what=what,
        unit=f" s{limit}",
        given=value if given is _UNSET else given,
    )
    return checked


def check_duration(value: Any, name: str) -> timedelta:
    """:func:`check_seconds`'s duration as a ``timedelta`` (given as one or as seconds)."""
    return timedelta(seconds=check_seconds(value, name))


def check_seed(value: Any, name: str = "seed") -> int:
    """A random seed: an integer torch's generators take (a signed 64-bit one)."""
    seed: int = check_number(value, name, low=-(2**63), high=2**63 - 1, integer=True)
    return seed


def check_signals(value: Any, name: str = "signals") -> tuple[int, ...]:
    """Signal numbers from names (``"SIGTERM"``, ``"term"``), numbers, a sequence of either, or
    one string of comma-separated names (``"SIGTERM,SIGUSR1"``); empty means none."""
    if value is None:
        return ()
    if isinstance(value, (bytes, bytearray)):
        raise ConfigError(f"{name}: {_given(value)} is not a signal name or number")
    items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
    if isinstance(items, (int, bool)) or not isinstance(items, Sequence):
        items = [items]
    numbers = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ConfigError(f"{name}: {_given(item)} is not a signal name or number")
        try:
            if isinstance(item, int):
                numbers.append(int(signal_module.Signals(item)))
            else:
                upper = item.strip().upper()
                numbers.append(
                    int(signal_module.Signals[upper if upper.startswith("SIG") else f"SIG{upper}"])
                )
        except (KeyError, ValueError):
            raise ConfigError(
                f"{name}: unknown signal {item!r}; use names like 'SIGTERM' or 'SIGUSR1'"
            ) from None
    caught = [n for n in numbers if n in _UNCATCHABLE]
    if caught:
        names = ", ".join(signal_module.Signals(n).name for n in caught)
        raise ConfigError(f"{name}: {names} cannot be caught, so no checkpoint can be taken on it")
    return tuple(numbers)


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_name(value: Any, name: str = "run_name") -> str:
    """A run name usable in paths on every storage: 1-128 letters, digits, ``.``, ``_``,
    ``-``, starting with a letter or digit."""
    if not isinstance(value, str) or not _RUN_NAME.match(value):
        raise ConfigError(
            f"{name} must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter or "
            f"digit), got {_given(value)}"
        )
    return value


def one_timeout(**sources: timedelta | float | None) -> timedelta:
    """The one checkpoint timeout from the places a user may set it (e.g. the strategy's
    ``checkpoint_timeout`` and the callback's ``timeout``): the one given, or
    :data:`DEFAULT_TIMEOUT`; two different values are an error rather than one silently
    winning."""
    given = {name: check_seconds(v, name) for name, v in sources.items() if v is not None}
    if len(set(given.values())) > 1:
        said = ", ".join(f"{name}={seconds:g}s" for name, seconds in given.items())
        raise ConfigError(
            f"two different checkpoint timeouts: {said}; set it in one place (or give both the "
            "same value)"
        )
    return timedelta(seconds=next(iter(given.values()))) if given else DEFAULT_TIMEOUT


def tier_options(
    local_dirpath: Any,
    *,
    persist_every_n_saves: Any = None,
    replicas: Any = None,
    local_keep: Any = None,
    node: Any = None,
) -> dict[str, Any]:
    """The multi-tier options as :class:`CheckpointEngine` keywords (``local_root=`` ...),
    validated; empty without ``local_dirpath`` (then the others must not be given)."""
    given = {
        "persist_every_n_saves": persist_every_n_saves,
        "replicas": replicas,
        "local_keep": local_keep,
        "node": node,
    }
    if local_dirpath is None:
        extra = sorted(k for k, v in given.items() if v is not None)
        if extra:
            raise ConfigError(f"{', '.join(extra)} need local_dirpath (a node-local directory)")
        return {}
    if not isinstance(local_dirpath, (str, os.PathLike)) or not str(local_dirpath):
        raise ConfigError(f"local_dirpath must be a path, got {local_dirpath!r}")
    if persist_every_n_saves is not None:
        given["persist_every_n_saves"] = check_count(persist_every_n_saves, "persist_every_n_saves")
    if replicas is not None:
        given["replicas"] = check_count(replicas, "replicas", minimum=0)
    if local_keep is not None:
        given["local_keep"] = check_count(local_keep, "local_keep")
    if node is not None:
        check_node_id(node)
    return {"local_root": str(local_dirpath), **given}


@dataclass(frozen=True)
class TierOptions:
    """Multi-tier checkpoints (docs/tiers.md): every save commits on a node-local directory
    first and each rank's shard is copied to ``replicas`` other nodes; the callback's
    ``dirpath`` becomes the persistent tier, written every ``persist_every_n_saves``-th save
    and at the end of a fit or on a signal; resume reads each node's files from the fastest
    tier holding them.

    Args:
        local_dirpath: a node-local directory (``/dev/shm/...``, a local NVMe disk).
        persist_every_n_saves: persist every k-th save to ``dirpath``.
        replicas: other nodes holding a copy of each rank's shard (``0``: none; capped at the
            number of other nodes).
        local_keep: checkpoints kept on each node.
        node: this node's id (default ``$LIGHTNING_ELASTIC_NODE``, else the host name).
    """

    local_dirpath: str | Path  # kept as a string
    persist_every_n_saves: int = DEFAULT_PERSIST_EVERY_N_SAVES
    replicas: int = DEFAULT_REPLICAS
    local_keep: int = DEFAULT_LOCAL_KEEP
    node: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.local_dirpath, os.PathLike):  # a Path is welcome; kept as a string
            object.__setattr__(self, "local_dirpath", os.fspath(self.local_dirpath))
        self.engine_options()  # checks every field (ConfigError)

    def engine_options(self) -> dict[str, Any]:
        """These options as :class:`~lightning_elastic.core.engine.CheckpointEngine` keywords
        (``local_root=`` ...)."""
        return tier_options(
            self.local_dirpath,
            persist_every_n_saves=self.persist_every_n_saves,
            replicas=self.replicas,
            local_keep=self.local_keep,
            node=self.node,
        )


@dataclass(frozen=True)
class MonitoringOptions:
    """What ``DistributedCheckpoint`` observes and exports (docs/monitoring.md).

    Args:
        metrics_port: serve this rank's health metrics for Prometheus on
            ``metrics_port + local rank`` (``0``: any free port; needs ``prometheus_client``,
            the ``metrics`` extra). ``None``: not served (the loggers still get them).
        straggler_factor: report a rank whose step time exceeds the median rank's by this
            factor over a window (``None``: never).
        straggler_window: optimizer steps per straggler window (every rank's timings ride on
            the per-step agreement at each window's last step).
        history: record the run's events (starts, resumes, commits, progress) in
            ``dirpath/_history`` for ``lightning-elastic report`` and the lost-work metrics.
    """

    metrics_port: int | None = None
    straggler_factor: float | None = 1.5
    straggler_window: int = 50
    history: bool = True

    def __post_init__(self) -> None:
        check_port(self.metrics_port)
        object.__setattr__(self, "straggler_factor", check_factor(self.straggler_factor))
        check_count(self.straggler_window, "straggler_window")
        check_bool(self.history, "history")


MAX_NODE_ID = 255


# Unicode's bidirectional controls (embeddings, overrides, isolates, marks): they reorder
# what follows them on a terminal, so a log line or the CLI's table could show other text
# than it holds
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
# control (Cc) and format (Cf: invisible, e.g. zero-width spaces, which make two ids look
# alike) characters, and line and paragraph separators
_HIDDEN_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


def check_node_id(node: Any, where: str = "node") -> str:
    """A node id: a non-empty string of at most :data:`MAX_NODE_ID` characters, in UTF-8,
    that is not ``.`` or ``..`` and holds no ``/``, no control, format or bidirectional
    control character and no line break (it names a node in logs, manifests and the CLI's
    output, and must never read as a path component)."""
    if not (
        isinstance(node, str)
        and 0 < len(node) <= MAX_NODE_ID
        and node not in (".", "..")
        and "/" not in node
        and not any(c in _BIDI or unicodedata.category(c) in _HIDDEN_CATEGORIES for c in node)
        and _utf8(node)
    ):
        raise ConfigError(
            f"{where} must be a non-empty UTF-8 name of at most {MAX_NODE_ID} characters, not "
            "'.' or '..', without '/', control, format or bidirectional control characters "
            f"or line breaks, got {node!a}"
        )
    return node


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate escape: bytes of an environment not in UTF-8
        return False
    return True
