"""Where each option of ``DistributedCheckpoint`` lives, and what its old spellings become.

One home per option (docs/options.md argues each):

* **flat on the callback**, named as ``ModelCheckpoint`` names them: when to save
  (``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``,
  ``save_on_train_end``), which to keep (``keep_last_n``; ``keep_best_k`` with ``monitor``
  and ``mode``), where (``dirpath``), whether to resume, how to write (``async_save``,
  ``snapshot``, ``when_busy``, ``compression``, ``full_every_n_saves``) and the signals;
* **small typed groups on the callback**: ``cadence=CadenceOptions``,
  ``tiers=TierOptions``, ``monitoring=MonitoringOptions``, and ``retention=[...]`` holding the
  exported policy classes (:class:`~lightning_elastic.KeepLastN`, ...);
* **on the strategy**: what applies to *every* checkpoint the trainer reads or writes,
  whoever asks (the callback, ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``, a peer's
  live state under ``elastic_ft``): ``checkpoint_timeout`` (the one gloo group all of them
  share), ``verify``, ``trusted`` and ``storage_options``. They configure the trainer's
  session, which lives on the strategy.

The old flat spellings still work, with an
:class:`~lightning_elastic.errors.ElasticDeprecationWarning` naming the new one; an old
spelling given together with its new home is a ``ConfigError`` (two values, one of which would
be ignored).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

from lightning_elastic.core.format.integrity import VERIFY_MODES
from lightning_elastic.core.options import (
    MonitoringOptions,
    TierOptions,
    check_bool,
    check_choice,
    check_seconds,
    one_timeout,
)
from lightning_elastic.core.policy.cadence import CadenceOptions
from lightning_elastic.core.policy.retention import KeepBestK, KeepEveryNSteps, KeepLastN
from lightning_elastic.errors import ConfigError, ElasticDeprecationWarning

__all__ = [
    "MOVED",
    "DeprecatedOptions",
    "SessionOptions",
    "Translated",
    "recorded_metrics",
    "retention_policies",
    "session_options",
    "translate",
]

#: the strategy's ``verify`` when it is not given
DEFAULT_VERIFY = "full"


class DeprecatedOptions(TypedDict, total=False):
    """The old flat spellings of options that moved (each still works, with a warning).

    Args:
        storage_options: deprecated: ``ElasticStrategy(storage_options=...)`` (the strategy's
            for every checkpoint location the trainer opens).
        verify: deprecated: ``ElasticStrategy(verify=...)`` (every load the trainer does).
        timeout: deprecated: ``ElasticStrategy(checkpoint_timeout=...)`` (the one checkpoint
            process group's).
        trusted: deprecated: ``ElasticStrategy(trusted=...)`` (every load the trainer does).
        mtbf: deprecated: ``cadence=CadenceOptions(mtbf=...)``.
        max_overhead: deprecated: ``cadence=CadenceOptions(max_overhead=...)``.
        min_interval: deprecated: ``cadence=CadenceOptions(min_interval=...)``.
        metrics_port: deprecated: ``monitoring=MonitoringOptions(metrics_port=...)``.
        straggler_factor: deprecated: ``monitoring=MonitoringOptions(straggler_factor=...)``.
        straggler_window: deprecated: ``monitoring=MonitoringOptions(straggler_window=...)``.
        history: deprecated: ``monitoring=MonitoringOptions(history=...)``.
        local_dirpath: deprecated: ``tiers=TierOptions(local_dirpath=...)``.
        persist_every_n_saves: deprecated: ``tiers=TierOptions(persist_every_n_saves=...)``.
        replicas: deprecated: ``tiers=TierOptions(replicas=...)``.
        local_keep: deprecated: ``tiers=TierOptions(local_keep=...)``.
        node: deprecated: ``tiers=TierOptions(node=...)``.
        keep_every_n_steps: deprecated: ``retention=[KeepEveryNSteps(n)]``.
    """

    storage_options: dict[str, Any] | None
    verify: str | None
    timeout: timedelta | float | None
    trusted: bool | None
    mtbf: timedelta | float | str | None
    max_overhead: float | None
    min_interval: timedelta | float | str | None
    metrics_port: int | None
    straggler_factor: float | None
    straggler_window: int | None
    history: bool | None
    local_dirpath: str | Path | None
    persist_every_n_saves: int | None
    replicas: int | None
    local_keep: int | None
    node: str | None
    keep_every_n_steps: int | None


_STRATEGY = {
    "storage_options": "storage_options",
    "verify": "verify",
    "timeout": "checkpoint_timeout",
    "trusted": "trusted",
}
_GROUPS: dict[str, tuple[str, type[Any], tuple[str, ...]]] = {
    "cadence": ("CadenceOptions", CadenceOptions, ("mtbf", "max_overhead", "min_interval")),
    "monitoring": (
        "MonitoringOptions",
        MonitoringOptions,
        ("metrics_port", "straggler_factor", "straggler_window", "history"),
    ),
    "tiers": (
        "TierOptions",
        TierOptions,
        ("local_dirpath", "persist_every_n_saves", "replicas", "local_keep", "node"),
    ),
}

#: every old spelling -> its new one
MOVED: dict[str, str] = {
    **{
        old: f"ElasticStrategy({new}=...) (or the same option of ElasticFSDPStrategy or "
        "ElasticFTStrategy): it applies to every checkpoint the trainer reads or writes"
        for old, new in _STRATEGY.items()
    },
    **{
        old: f"{group}={cls}({old}=...)"
        for group, (cls, _, olds) in _GROUPS.items()
        for old in olds
    },
    "keep_every_n_steps": "retention=[KeepEveryNSteps(n)]",
}


@dataclass
class Translated:
    """The groups after the old spellings were moved into them, and the strategy's options
    the callback was given (applied at set-up, when the strategy is known)."""

    cadence: CadenceOptions | None
    tiers: TierOptions | None
    monitoring: MonitoringOptions | None
    keep_every_n_steps: int | None = None
    session: dict[str, Any] = field(default_factory=dict)


def translate(
    owner: str,
    deprecated: Mapping[str, Any],
    *,
    cadence: CadenceOptions | None,
    tiers: TierOptions | None,
    monitoring: MonitoringOptions | None,
) -> Translated:
    """Move each old spelling in ``deprecated`` to its new home, with one warning per
    spelling; an unknown keyword is a ``TypeError`` as Python's own, an old spelling given with
    its group a ``ConfigError``."""
    unknown = sorted(set(deprecated) - set(MOVED))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    for old in deprecated:  # in the order written
        _warn(f"{owner}({old}=...) is deprecated: use {MOVED[old]}")
    groups: dict[str, Any] = {"cadence": cadence, "tiers": tiers, "monitoring": monitoring}
    for name, (cls_name, cls, olds) in _GROUPS.items():
        given = {old: deprecated[old] for old in olds if old in deprecated}
        if not given:
            continue
        if groups[name] is not None:
            said = ", ".join(given)
            raise ConfigError(
                f"{owner}: {said} and {name}={cls_name}(...) both given; give {said} in "
                f"{name}={cls_name}(...) only"
            )
        # None was the old default of the cadence's and the tiers' options (but for
        # monitoring, straggler_factor=None means "never": passed on as given)
        values = given
        if name != "monitoring":
            values = {k: v for k, v in given.items() if v is not None}
        if name == "tiers" and "local_dirpath" not in values:
            if values:
                raise ConfigError(
                    f"{', '.join(sorted(values))} need local_dirpath (a node-local directory): "
                    "tiers=TierOptions(local_dirpath=...)"
                )
            continue  # local_dirpath=None: no tiers, as before
        groups[name] = cls(**values)
    session = {old: deprecated[old] for old in _STRATEGY if old in deprecated}
    _check_session(session)
    return Translated(
        cadence=groups["cadence"],
        tiers=groups["tiers"],
        monitoring=groups["monitoring"],
        keep_every_n_steps=deprecated.get("keep_every_n_steps"),
        session=session,
    )


def _warn(message: str) -> None:
    # attributed to the line that built the callback: _warn, translate, __init__, the caller
    warnings.warn(message, ElasticDeprecationWarning, stacklevel=4)


def _check_session(given: Mapping[str, Any]) -> None:
    """Check the strategy's options given to the callback, at construction as before."""
    if given.get("storage_options") is not None and not isinstance(given["storage_options"], dict):
        raise ConfigError(f"storage_options must be a dict, got {given['storage_options']!r}")
    if given.get("verify") is not None:
        check_choice(given["verify"], "verify", VERIFY_MODES)
    if given.get("timeout") is not None:
        check_seconds(given["timeout"], "timeout")
    if given.get("trusted") is not None:
        check_bool(given["trusted"], "trusted")


def retention_policies(
    *,
    keep_last_n: int | None,
    keep_best_k: int | None,
    monitor: str | None,
    mode: str,
    retention: Sequence[Any] | None,
    keep_every_n_steps: int | None = None,
) -> tuple[Any, ...]:
    """The callback's retention rules: ``retention``'s policies, plus the flat ``keep_last_n``
    and ``keep_best_k`` (on ``monitor``) and the deprecated ``keep_every_n_steps``. A rule
    given both flat and in ``retention`` is refused (one of the two values would be moot)."""
    if retention is None:
        retention = ()
    if isinstance(retention, (str, bytes)) or not isinstance(retention, Sequence):
        raise ConfigError(
            "retention must be a list of policies (KeepLastN, KeepEveryNSteps, KeepBestK, "
            f"KeepAll or your own with a keep() method), got {retention!r}"
        )
    for policy in retention:
        if not callable(getattr(policy, "keep", None)) or isinstance(policy, type):
            raise ConfigError(
                f"retention: {policy!r} is not a retention policy (an object with a keep() "
                "method, e.g. KeepLastN(3))"
            )
    if keep_best_k is not None and not monitor:
        raise ConfigError("keep_best_k needs monitor=<metric name>")
    flat: list[tuple[str, Any]] = []
    if keep_last_n is not None:
        flat.append(("keep_last_n", KeepLastN(keep_last_n)))
    if keep_every_n_steps is not None:
        flat.append(("keep_every_n_steps", KeepEveryNSteps(keep_every_n_steps)))
    if keep_best_k is not None:
        assert monitor is not None
        flat.append(("keep_best_k", KeepBestK(keep_best_k, monitor, mode)))
    for name, policy in flat:
        twin = next((p for p in retention if _same_rule(p, policy)), None)
        if twin is not None:
            raise ConfigError(
                f"{name}={getattr(policy, 'n', getattr(policy, 'k', None))} and "
                f"retention=[{twin!r}] are the same rule given twice: give one"
            )
    return (*retention, *(policy for _, policy in flat))


def _same_rule(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    return not isinstance(a, KeepBestK) or a.monitor == b.monitor


def recorded_metrics(monitor: str | None, policies: Sequence[Any]) -> tuple[str, ...]:
    """The metrics each checkpoint records: ``monitor`` and every ``KeepBestK``'s."""
    names = [] if monitor is None else [monitor]
    for policy in policies:
        if isinstance(policy, KeepBestK) and policy.monitor not in names:
            names.append(policy.monitor)
    return tuple(names)


@dataclass(frozen=True)
class SessionOptions:
    """The options of every checkpoint a trainer reads or writes (the strategy's)."""

    timeout: timedelta
    verify: str
    trusted: bool
    storage_options: dict[str, Any]


def session_options(strategy: object, given: Mapping[str, Any]) -> SessionOptions:
    """The strategy's checkpoint options (defaults for Lightning's own strategies), with the
    deprecated spellings ``given`` to the callback applied as they were before (the callback's
    value for every checkpoint of the trainer); a value the strategy sets too, differently,
    is a ``ConfigError`` naming both."""
    name = type(strategy).__name__
    timeout = one_timeout(
        timeout=given.get("timeout"),
        checkpoint_timeout=getattr(strategy, "checkpoint_timeout", None),
    )
    verify = str(getattr(strategy, "verify", DEFAULT_VERIFY))
    if given.get("verify") is not None and given["verify"] != verify:
        if verify != DEFAULT_VERIFY:
            raise ConfigError(
                f"two different verify modes: {name}(verify={verify!r}) and "
                f"DistributedCheckpoint(verify={given['verify']!r}); set it on the strategy only"
            )
        verify = given["verify"]
    trusted = bool(getattr(strategy, "trusted", False)) or bool(given.get("trusted"))
    options = dict(getattr(strategy, "storage_options", None) or {})
    if given.get("storage_options"):
        if options and options != given["storage_options"]:
            raise ConfigError(
                f"two different storage_options: {name}'s and DistributedCheckpoint's; set "
                "them on the strategy only"
            )
        options = dict(given["storage_options"])
    return SessionOptions(timeout, verify, trusted, options)
