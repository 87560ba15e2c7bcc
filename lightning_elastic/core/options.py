"""Checking user options once, the same way everywhere: each checker returns the value in its
canonical type or raises :class:`~lightning_elastic.errors.ConfigError` naming the option, the
value given and what is accepted.

Options arrive from Python, from YAML (LightningCLI, where ``2.5`` or ``"yes"`` are easy to
write) and from the command line, so nothing is coerced silently: ``every_n_train_steps=2.5``
is an error, not "every 2 steps" or "every 5"; ``shard_optimizer_state="yes"`` is an error, not
``True``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal as signal_module
import unicodedata
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning_elastic.errors import ConfigError

__all__ = [
    "DEFAULT_TIMEOUT",
    "check_bool",
    "check_choice",
    "check_count",
    "check_factor",
    "check_port",
    "check_run_name",
    "check_seconds",
    "check_signals",
    "one_timeout",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)
MAX_SECONDS = 365 * 24 * 3600.0  # beyond this a "timeout" is a mistake (and overflows timers)
# signals a process cannot catch: a checkpoint on them is impossible
_UNCATCHABLE = {int(signal_module.SIGKILL), int(signal_module.SIGSTOP)}


def _given(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_count(value: Any, name: str, *, minimum: int = 1) -> int:
    """``value`` as an ``int`` >= ``minimum``; floats (even ``2.0``), strings and bools are
    refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {_given(value)}")
    if value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def check_port(value: Any, name: str = "metrics_port") -> int | None:
    """``None`` or a TCP port number (``0``: any free port)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{name} must be None or a port in 0..65535, got {_given(value)}")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"{name}={value} serves metrics with prometheus_client, which is not installed: "
            "pip install 'lightning_elastic[metrics]' (or leave metrics_port=None)"
        )
    return int(value)


def check_factor(value: Any, name: str = "straggler_factor") -> float | None:
    """``None`` or a finite number > 1 (a ratio to the median)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be None or a number > 1, got {_given(value)}")
    if not (math.isfinite(value) and value > 1):
        raise ConfigError(f"{name} must be None or a number > 1, got {value!r}")
    return float(value)


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


def check_seconds(value: Any, name: str) -> float:
    """A positive, finite duration given as a ``timedelta`` or a number of seconds."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigError(
            f"{name} must be a timedelta or a number of seconds > 0, got {_given(value)}"
        )
    if not (seconds > 0 and math.isfinite(seconds)) or seconds > MAX_SECONDS:
        raise ConfigError(
            f"{name} must be a duration > 0 and <= {MAX_SECONDS:g} s (a year), got {value!r}"
        )
    return seconds


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
        check_count(persist_every_n_saves, "persist_every_n_saves")
    if replicas is not None:
        check_count(replicas, "replicas", minimum=0)
    if local_keep is not None:
        check_count(local_keep, "local_keep")
    if node is not None:
        check_node_id(node)
    return {"local_root": str(local_dirpath), **given}


MAX_NODE_ID = 255


def check_node_id(node: Any, where: str = "node") -> str:
    """A node id: a non-empty string of at most :data:`MAX_NODE_ID` characters, in UTF-8,
    without '/', control characters or line breaks (it names a node in logs, manifests and
    the CLI's output)."""
    if not (
        isinstance(node, str)
        and 0 < len(node) <= MAX_NODE_ID
        and "/" not in node
        and not any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in node)
        and _utf8(node)
    ):
        raise ConfigError(
            f"{where} must be a non-empty UTF-8 name of at most {MAX_NODE_ID} characters "
            f"without '/', control characters or line breaks, got {node!r}"
        )
    return node


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate escape: bytes of an environment not in UTF-8
        return False
    return True
