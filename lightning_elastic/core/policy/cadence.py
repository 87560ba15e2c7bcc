"""How often to save, chosen from what saves cost and how often the job fails.

Young's first-order optimum (refined by Daly) for the interval between checkpoints is
``sqrt(2 * C * MTBF)``: ``C`` is the training time one save costs, ``MTBF`` the mean time
between failures of the *job* (a node's MTBF divided by the number of nodes). Saving more often
loses throughput to ``C``; less often loses more work to each failure (half an interval on
average). docs/cadence.md works an example.

:class:`AutoCadence` measures ``C`` as the time training was blocked by a save (staging) plus the
slowdown while its write ran in the background (the extra step time of the steps that overlapped
the write, against the steps that did not), and bounds the interval from below twice: by
``C / max_overhead`` (saves never cost more than that fraction of training time) and by the time
a save takes to commit (a save is never due while the previous one is still being written).
:class:`Continuous` saves as soon as the previous save committed and ``min_interval`` passed.

Only rank 0 consults these (the time trigger is rank 0's clock, agreed with every rank by
:class:`~lightning_elastic.core.policy.triggers.Agreement`); the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from statistics import median

from lightning_elastic.core.options import MAX_SECONDS, check_count, check_number, check_seconds
from lightning_elastic.core.policy.triggers import EveryInterval
from lightning_elastic.errors import ConfigError

__all__ = [
    "MAX_MTBF_S",
    "AutoCadence",
    "Cadence",
    "CadenceChoice",
    "CadenceOptions",
    "Continuous",
    "check_overhead",
    "mtbf_from_history",
    "parse_duration",
    "slowdown",
    "young_daly",
]

_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


#: a node's mean time between failures may well exceed a year (it is the job's, over the
#: number of nodes, that sets the interval): up to a century
MAX_MTBF_S = 100 * 365 * 24 * 3600.0


def parse_duration(
    value: object, what: str, *, maximum: float = MAX_SECONDS, modes: Sequence[str] = ()
) -> float:
    """Seconds from a number, a ``timedelta`` or a string such as ``"4h"``, ``"90m"``,
    ``"1.5d"``, ``"30s"``, ``"600"``; :class:`ConfigError` when it is none of these or not in
    :func:`~lightning_elastic.core.options.check_seconds`'s range (up to ``maximum``).
    ``modes``: the other words the option takes (named in the message)."""
    given = value
    if isinstance(value, str):
        text = value.strip().lower()
        scale = 1.0
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                text, scale = text[: -len(unit)].strip(), _UNITS[unit]
                break
        try:
            value = float(text) * scale
        except ValueError:
            forms = ["a duration like '4h', '90m', '30s'", "a number of seconds"]
            forms += [f'"{m}"' for m in modes]
            raise ConfigError(
                f"{what} must be {', '.join(forms[:-1])} or {forms[-1]}, got {value!r}"
            ) from None
    return check_seconds(value, what, maximum=maximum, given=given)


def check_overhead(value: object, name: str = "max_overhead") -> float:
    """The fraction of training time saves may cost: a number in (0, 1)."""
    fraction: float = check_number(
        value, name, low=0, high=1, low_open=True, high_open=True, what="a fraction"
    )
    return fraction


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The interval ``sqrt(2 * cost * MTBF)`` in seconds."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def mtbf_from_history(failures: int, observed_s: float) -> float | None:
    """The job's MTBF from its own past: observed run time over unplanned interruptions;
    ``None`` before the first failure (no failure in a short history says little)."""
    if failures <= 0 or observed_s <= 0:
        return None
    return observed_s / failures


@dataclass(frozen=True)
class CadenceChoice:
    """One chosen interval and what it was computed from (logged and exported as metrics)."""

    interval_s: float
    cost_s: float  # training seconds one save costs (blocked + slowdown while writing)
    write_s: float  # seconds from a save's start to its commit
    mtbf_s: float | None  # the job's (all nodes) MTBF used, None when unknown
    bound: str  # "young_daly", "overhead", "write" or "initial": which rule set the interval

    def describe(self) -> str:
        """One line for the log."""
        mtbf = "unknown" if self.mtbf_s is None else f"{self.mtbf_s:.0f} s"
        return (
            f"interval {self.interval_s:.1f} s ({self.bound}): save cost {self.cost_s:.3f} s, "
            f"write {self.write_s:.2f} s, job MTBF {mtbf}"
        )


class AutoCadence:
    """The time interval between saves, recomputed after every committed save.

    Args:
        mtbf_s: one node's MTBF in seconds (``None``: from ``history_mtbf_s`` or unknown).
        nodes: nodes the job runs on (the job fails when any does).
        max_overhead: the largest fraction of training time saves may cost.
        initial_s: the interval before the first save is measured.
        history_mtbf_s: the job's MTBF measured from its restart history, used when ``mtbf_s``
            is not given.
        window: how many recent saves the cost estimate takes the median of.
    """

    def __init__(
        self,
        *,
        mtbf_s: float | None,
        nodes: int,
        max_overhead: float = 0.01,
        initial_s: float = 600.0,
        history_mtbf_s: float | None = None,
        window: int = 5,
    ) -> None:
        self.max_overhead = check_overhead(max_overhead)
        self.nodes = check_count(nodes, "nodes")
        self.mtbf_s = None if mtbf_s is None else parse_duration(mtbf_s, "mtbf", maximum=MAX_MTBF_S)
        self.initial_s = check_seconds(initial_s, "initial interval")
        self.history_mtbf_s = history_mtbf_s
        window = check_count(window, "window")
        self._costs: deque[float] = deque(maxlen=window)
        self._writes: deque[float] = deque(maxlen=window)
        self.choice = CadenceChoice(self.initial_s, 0.0, 0.0, self.job_mtbf_s, "initial")

    @property
    def job_mtbf_s(self) -> float | None:
        """The MTBF of the whole job: a node's over the number of nodes, else the history's."""
        if self.mtbf_s is not None:
            return self.mtbf_s / self.nodes
        return self.history_mtbf_s

    @property
    def interval_s(self) -> float:
        """The interval now in force."""
        return self.choice.interval_s

    def observe(self, *, blocked_s: float, slowdown_s: float, write_s: float) -> CadenceChoice:
        """Take one committed save's measured cost into account and choose the interval."""
        self._costs.append(max(0.0, blocked_s) + max(0.0, slowdown_s))
        self._writes.append(max(0.0, write_s))
        cost, write = median(self._costs), median(self._writes)
        candidates = [("overhead", cost / self.max_overhead), ("write", write * 1.25)]
        mtbf = self.job_mtbf_s
        if mtbf is not None:
            candidates.append(("young_daly", young_daly(cost, mtbf)))
        # the Young-Daly optimum unless a bound is larger: the largest candidate wins, and a
        # tie goes to young_daly (listed last, max keeps the first: reverse the order)
        bound, interval = max(reversed(candidates), key=lambda c: c[1])
        # a max_overhead near 0 (5e-324 is a fraction in (0, 1)) makes the overhead bound
        # infinite: no time trigger is meant to wait more than a year
        interval = min(interval, MAX_SECONDS)
        self.choice = CadenceChoice(interval, cost, write, mtbf, bound)
        return self.choice


@dataclass
class Continuous:
    """Due as soon as the previous save committed and ``min_interval_s`` passed since it was
    taken."""

    min_interval_s: float
    clock: Callable[[], float] = time.monotonic
    last: float | None = None

    def __post_init__(self) -> None:
        self.min_interval_s = check_seconds(self.min_interval_s, "min_interval")

    def start(self) -> None:
        """Training starts: the first save is due ``min_interval_s`` from now."""
        self.last = self.clock()

    def due(self, *, busy: bool) -> bool:
        """Whether to save now (``busy``: a save is still being written)."""
        if busy:
            return False
        return self.last is None or self.clock() - self.last >= self.min_interval_s

    def saved(self) -> None:
        """Record a save taken now."""
        self.last = self.clock()


@dataclass(frozen=True)
class CadenceOptions:
    """How an adaptive (``train_time_interval="auto"``) or continuous
    (``train_time_interval="continuous"``) time trigger chooses when to save (docs/cadence.md).
    Each option belongs to one mode; giving it with the other is a ``ConfigError``.

    Args:
        mtbf: with ``"auto"``: one node's mean time between failures (``"4h"``, ``"90m"``,
            seconds or a ``timedelta``, up to a century); the job's is this over the number of
            nodes. Default: measured from the run's restart history in ``dirpath`` (until a
            first failure, saves are only bounded by ``max_overhead``).
        max_overhead: with ``"auto"``: the largest fraction of training time saves may cost
            (default 0.01).
        min_interval: with ``"continuous"``: the least time between two saves, and from the
            start to the first (default 60 s; seconds, a ``timedelta`` or ``"5m"``).
    """

    mtbf: timedelta | float | str | None = None
    max_overhead: float | None = None
    min_interval: timedelta | float | str | None = None

    def __post_init__(self) -> None:  # checked here, converted by Cadence.of
        if self.mtbf is not None:
            parse_duration(self.mtbf, "mtbf", maximum=MAX_MTBF_S)
        if self.max_overhead is not None:
            check_overhead(self.max_overhead)
        if self.min_interval is not None:
            parse_duration(self.min_interval, "min_interval")


@dataclass
class Cadence:
    """The time trigger ``train_time_interval`` asks for: a fixed interval, an adaptive one
    (``"auto"``: an :class:`EveryInterval` whose seconds follow an :class:`AutoCadence` built
    once the number of nodes is known), or ``"continuous"``."""

    interval: EveryInterval | None = None
    auto: dict[str, float | None] | None = None  # AutoCadence options but nodes
    continuous: Continuous | None = None

    #: the interval ``"auto"`` uses until the first save is measured
    AUTO_INITIAL_S = 60.0

    @classmethod
    def of(cls, value: object, options: CadenceOptions | None = None) -> Cadence:
        """Check ``train_time_interval`` with its :class:`CadenceOptions` (each option only
        with its mode; ``max_overhead`` defaults to 0.01)."""
        if options is not None and not isinstance(options, CadenceOptions):
            raise ConfigError(f"cadence must be a CadenceOptions, got {options!r}")
        given = options or CadenceOptions()
        if value != "auto" and given.mtbf is not None:
            raise ConfigError('mtbf is used only with train_time_interval="auto"')
        if value != "auto" and given.max_overhead is not None:
            raise ConfigError('max_overhead is used only with train_time_interval="auto"')
        if value != "continuous" and given.min_interval is not None:
            raise ConfigError('min_interval is used only with train_time_interval="continuous"')
        if value is None:
            return cls()
        if value == "auto":
            overhead = 0.01 if given.max_overhead is None else check_overhead(given.max_overhead)
            mtbf = given.mtbf
            mtbf_s = None if mtbf is None else parse_duration(mtbf, "mtbf", maximum=MAX_MTBF_S)
            return cls(
                interval=EveryInterval(cls.AUTO_INITIAL_S),
                auto={"mtbf_s": mtbf_s, "max_overhead": overhead},
            )
        if value == "continuous":
            minimum = given.min_interval
            seconds = 60.0 if minimum is None else parse_duration(minimum, "min_interval")
            return cls(continuous=Continuous(seconds))
        # "30m" as for mtbf and min_interval; "600" and "1e3" as YAML may hand them over
        seconds = parse_duration(value, "train_time_interval", modes=("auto", "continuous"))
        return cls(interval=EveryInterval(seconds))

    def build_auto(self, *, nodes: int, history_mtbf_s: float | None) -> AutoCadence | None:
        """The adaptive cadence for a job on ``nodes`` nodes (``None`` unless ``"auto"``)."""
        if self.auto is None:
            return None
        return AutoCadence(
            mtbf_s=self.auto["mtbf_s"],
            nodes=nodes,
            max_overhead=float(self.auto["max_overhead"] or 0.01),
            initial_s=self.AUTO_INITIAL_S,
            history_mtbf_s=history_mtbf_s,
        )


def slowdown(during_write: Sequence[float], idle: Iterable[float]) -> float:
    """Training seconds a background write cost: the steps that overlapped it, each against the
    median step that did not (0 when there is nothing to compare with)."""
    idle = list(idle)
    if not during_write or not idle:
        return 0.0
    base = median(idle)
    return max(0.0, sum(during_write) - base * len(during_write))
