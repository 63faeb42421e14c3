"""What a quota is: :class:`Quota`, its rate strings, and the protocol of a store.

See :mod:`timewheel.spark.quota.task` for the whole picture.
"""

from __future__ import annotations

import logging
import math
import re
import urllib.parse
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, TypeVar

from ..._validate import check_int, check_number

__all__ = [
    "BURST_S",
    "CATCH_UP_S",
    "DEFAULT_TTL_S",
    "HELD_FRESH_S",
    "HORIZON_S",
    "LEASE_S",
    "LEFT_SHARE",
    "LONG_PAUSE_S",
    "MAX_AMOUNT",
    "MAX_ASKS_PER_S",
    "MAX_PAUSE_S",
    "PACE_CUT",
    "PACE_CUT_EVERY_S",
    "PACE_FLOOR",
    "PACE_RECOVERY",
    "PROBE_AGAIN_S",
    "PROBE_WAIT_S",
    "RESTART_JITTER_S",
    "TERM_S",
    "Ask",
    "BudgetSpent",
    "Grant",
    "Quota",
    "QuotaState",
    "QuotaStore",
    "QuotaStoreError",
    "grant_size",
    "parse_rate",
    "term_of",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: A grant may start this many seconds before the timeline's last (none: a call over the
#: rate at the service's own limit is a refusal), and a holder catches up a lag of at
#: most CATCH_UP_S behind its grant's schedule. Over the run, a job sends at most its rate
#: (plus BURST_S + CATCH_UP_S of it); in one second, up to about 1.06x (several holders'
#: grants spent over their shares of a term overlap: test_quota_scale.py bounds it at 1.1x).
BURST_S = 0.0
CATCH_UP_S = 0.01
#: A grant is spent over a term: a holder asks the store about once a term while it is
#: busy (see ``Bucket.take``).
TERM_S = 0.25
#: The store is asked at most about this often: with more holders, the term grows.
MAX_ASKS_PER_S = 250.0
#: While the timeline is booked, a holder's next ask is due this share of its place among
#: the holders asking (its width times their number) after its grant's start (its span),
#: so it asks a little before the timeline reaches now: booked just in time, every late
#: wakeup or answer left the timeline idle (0.96 of a token rate with four tasks on a
#: driven clock; 1.00 at 0.8). Its calls go at their places on the timeline all the same.
SPREAD = 0.8
#: The timelines are booked at most this far ahead: a task that would be granted a slot
#: beyond it is told when to ask again instead (its turn in a queue, so the tasks
#: waiting ask one after another, at the pace grants free up, never all at once), and a
#: pause or an answer's headers reach every task within this.
HORIZON_S = TERM_S
#: A task waiting for a concurrency slot asks again after this long.
LEASE_S = 0.05
#: The longest random wait added to a pause, per task, so they do not restart together.
RESTART_JITTER_S = 0.25
#: The pace: a pause (a refusal, a window the service says is spent) slows the job's
#: rates by PACE_CUT (at most once per PACE_CUT_EVERY_S, never below PACE_FLOOR of
#: them); they come back by PACE_RECOVERY of the rate each second. A quota set at the
#: service's own limit then runs just under it, refused rarely, instead of meeting the
#: limit again each time a pause slides out of the service's window.
PACE_CUT = 0.02
PACE_CUT_EVERY_S = 1.0
PACE_FLOOR = 0.8
PACE_RECOVERY = 0.002
#: While a job's probe is out (its first call whose cost only the answer says, see
#: ``Ask.probe``), a holder that asks is told to ask again after this long, twice as long
#: each time after (at most a second): the tasks of a thousand-task job ask a few hundred
#: times a second, for as long as one call takes.
PROBE_WAIT_S = 0.05
#: A holder that asks for the probe when the job knows a ratio already is told it, and to
#: ask again after this long (at once: with the hold the ratio says).
PROBE_AGAIN_S = 1e-6
#: What a holder said it holds (``Ask.held``) keeps a need the budget left does not cover
#: waiting for this long after it said it, at most: a holder that asks no more (its calls
#: slow, or it has nothing left to send) no longer keeps the job from ending.
HELD_FRESH_S = 2.0
#: A holder not heard from for this long is dropped (its slots come back).
DEFAULT_TTL_S = 30.0
#: Near a cap or a budget, a lease is at most this fraction's inverse of what is left.
LEFT_SHARE = 8
#: The longest pause a service may ask of a quota (``Quota.max_pause_s``'s default: the
#: HTTP target's ``max_retry_after_s``'s too).
MAX_PAUSE_S = 30.0
#: A pause longer than this is said: one log line, and the ``quota_long_pauses`` metric.
LONG_PAUSE_S = 5.0
#: The largest rate, budget or cap: far from float rounding.
MAX_AMOUNT = 1e15
MAX_COUNT = int(MAX_AMOUNT)
#: The largest ``weight`` a job may give itself against others sharing a store.
MAX_WEIGHT = 1e6

_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "min": 60.0, "minute": 60.0}
_UNITS.update(h=3600.0, hour=3600.0)
_NUMBER_TEXT = re.compile(r"^\s*[0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?\s*$")
_RATE_TEXT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*/\s*([a-z]+)\s*$")


def _amount(name: str, value: Any) -> float:
    """``value`` as a number > 0 and at most :data:`MAX_AMOUNT`, or raise naming ``name``."""
    return check_number(name, value, 0, MAX_AMOUNT, strict_lo=True)


def parse_rate(name: str, value: Any) -> float:
    """A rate as a float per second: a number (per second) or ``"N/s"``, ``"N/min"``, ``"N/hour"``.

    Anything else, or a rate not > 0 and at most :data:`MAX_AMOUNT` per second, is
    refused by one message that says all of this (:func:`rate_rule`).

    >>> parse_rate("cost_rate", "2000000/min")
    33333.333333333336
    """
    if isinstance(value, str):
        number = _NUMBER_TEXT.match(value)
        match = None if number else _RATE_TEXT.match(value.lower())
        if number:
            per_second = float(value.replace("_", ""))
        elif match is not None and match.group(2) in _UNITS:
            per_second = float(match.group(1).replace("_", "")) / _UNITS[match.group(2)]
        else:
            raise ValueError(f"{name} {_rate_rule(value)}")
        if not 0 < per_second <= MAX_AMOUNT:  # (an infinity too: the text held no NaN)
            raise ValueError(f"{name} {_rate_rule(value)}")
        return per_second
    try:
        return _amount(name, value)
    except TypeError:
        raise TypeError(f"{name} {_rate_rule(value)} ({type(value).__name__})") from None
    except ValueError:
        raise ValueError(f"{name} {_rate_rule(value)}") from None


def _rate_rule(value: Any) -> str:
    """What a rate must be, said to whoever gave ``value``."""
    return (
        f"must be > 0 and at most {MAX_AMOUNT:g} per second, written as a number per "
        f"second (1.5) or as N/s, N/min or N/hour ('2000000/min'); got {value!r}"
    )


@dataclass(frozen=True, init=False)
class Quota:
    """A job's quota. Every argument is optional, but at least one must be set.

    ``rate`` and ``cost_rate`` are kept in units per second (a string such as
    ``"5000/min"`` is read by :func:`parse_rate`); ``ttl_s`` is how long a holder that
    is not heard from keeps its slots. A quota holds no secret and pickles as it is.

    ``max_pause_s`` (default :data:`MAX_PAUSE_S`, 30 s) caps every pause the quota takes
    from a service's answer: ``Retry-After`` (seconds or an HTTP date), a used-up
    window's ``x-ratelimit-reset-*`` or ``RateLimit`` reset. One header cannot stall a
    job for longer; if the service still says no, the next answer pauses it again. A
    pause longer than :data:`LONG_PAUSE_S` is said in one WARNING line (the header, what
    it asked, what was taken) and counted (the ``quota_long_pauses`` metric).

    Where it lives: by default a service in the driver, for one job (or one
    streaming query: the same ``Quota`` object keeps one service for as long as it
    lives). ``store="redis://HOST:PORT/DB"`` and a ``name`` keep it in Redis instead,
    shared by every job and process that names it; ``store_password`` names where
    Redis's password is read (``"env:NAME"`` or ``"file:PATH"``, resolved where it is
    used), since a URL with a password would travel in the job's plan.
    ``store="static"``: no store; each of the job's concurrent tasks keeps an equal
    share of the quota (what a store that cannot be reached falls back to).

    ``weight`` (default 1): this job's claim on the rates against the other jobs that
    share a store's ``name`` (a job of weight 2 gets twice the share of one of weight 1
    while both want more than they get).
    """

    rate: float | None
    cost_rate: float | None
    concurrency: int | None
    budget: float | None
    max_requests: int | None
    ttl_s: float
    store: str | None
    name: str | None
    store_password: str | None
    max_pause_s: float
    weight: float

    def __init__(
        self,
        rate: float | str | None = None,
        cost_rate: float | str | None = None,
        concurrency: int | None = None,
        budget: float | None = None,
        max_requests: int | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        store: str | None = None,
        name: str | None = None,
        store_password: str | None = None,
        max_pause_s: float = MAX_PAUSE_S,
        weight: float = 1.0,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "rate", None if rate is None else parse_rate("rate", rate))
        set_(self, "cost_rate", None if cost_rate is None else parse_rate("cost_rate", cost_rate))
        if concurrency is not None:
            concurrency = check_int("concurrency", concurrency, 1, MAX_COUNT)
        set_(self, "concurrency", concurrency)
        set_(self, "budget", None if budget is None else _amount("budget", budget))
        if max_requests is not None:
            max_requests = check_int("max_requests", max_requests, 1, MAX_COUNT)
        set_(self, "max_requests", max_requests)
        set_(self, "ttl_s", _amount("ttl_s", ttl_s))
        _check_store(store, name, store_password)
        set_(self, "store", store)
        set_(self, "name", name)
        set_(self, "store_password", store_password)
        set_(self, "max_pause_s", check_number("max_pause_s", max_pause_s, 0, MAX_AMOUNT))
        set_(self, "weight", check_number("weight", weight, 0, MAX_WEIGHT, strict_lo=True))
        if (rate, cost_rate, concurrency, budget, max_requests) == (None,) * 5:
            raise ValueError(
                "a Quota needs at least one of rate, cost_rate, concurrency, budget, max_requests"
            )

    def share(
        self, fraction: float, budget_left: float | None = None, requests_left: int | None = None
    ) -> Quota | None:
        """One process's static share: this quota's rates and concurrency times
        ``fraction`` (concurrency rounded down, at least 1), and that share of the budget
        and requests left (all of them unless given); None when that leaves nothing."""
        fraction = check_number("fraction", fraction, 0, 1, strict_lo=True)
        budget = self.budget if budget_left is None or self.budget is None else budget_left
        cap = self.max_requests
        if requests_left is not None and cap is not None:
            cap = requests_left
        budget = None if budget is None else budget * fraction
        cap = None if cap is None else math.floor(cap * fraction)
        if (budget is not None and budget <= 0) or (cap is not None and cap < 1):
            return None
        return replace(
            self,
            rate=None if self.rate is None else self.rate * fraction,
            cost_rate=None if self.cost_rate is None else self.cost_rate * fraction,
            concurrency=None
            if self.concurrency is None
            else max(1, math.floor(self.concurrency * fraction)),
            budget=budget,
            max_requests=cap,
        )


_STORE_SCHEMES = ("redis", "rediss", "unix")
_NAME = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,200}$")


def term_of(holders: int) -> float:
    """The term of ``holders`` busy holders: :data:`TERM_S`, longer with more of them, so
    that the store is asked at most about :data:`MAX_ASKS_PER_S` times a second."""
    return max(TERM_S, holders / MAX_ASKS_PER_S)


def grant_size(quota: Quota, rate: float, holders: int, booked: bool) -> float:
    """The most of ``rate`` (requests or cost per second, already paced) one grant holds:
    :data:`TERM_S` of it; while the timeline is booked ahead (others want it too), a term
    of it (:func:`term_of` the ``holders`` asking) divided among them, times the job's
    weight."""
    if not booked:
        return rate * TERM_S
    return rate * term_of(holders) * quota.weight / max(1, holders)


def _check_store(store: Any, name: Any, password: Any) -> None:
    """ValueError/TypeError unless ``store`` is None or a Redis URL without a password,
    given with a ``name``; ``password`` a secret reference (``env:`` or ``file:``)."""
    if store is None:
        if name is not None or password is not None:
            what = "name" if name is not None else "store_password"
            raise ValueError(f"{what} is given without a store (store='redis://HOST:PORT/DB')")
        return
    if not isinstance(store, str):
        raise TypeError(f"store must be a redis://HOST:PORT/DB URL (str), got {store!r}")
    if store == "static":  # each task keeps its own share: nothing to name or reach
        if name is not None or password is not None:
            raise ValueError("store='static' keeps no quota anywhere: it takes no name")
        return
    parts = urllib.parse.urlsplit(store)
    if parts.scheme not in _STORE_SCHEMES:
        raise ValueError(f"store must be a redis://HOST:PORT/DB URL, got {parts.scheme}:...")
    if parts.password is not None:
        raise ValueError(
            "store must not hold a password (it would travel in the job's plan): give "
            "store_password='env:NAME' or 'file:PATH' instead"
        )
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"a store needs a name of 1 to 200 letters, digits or _.:@/+- "
            f"(the quota's key in Redis), got {name!r}"
        )
    if password is not None and (
        not isinstance(password, str) or not password.startswith(("env:", "file:"))
    ):
        raise ValueError("store_password must be 'env:NAME' or 'file:PATH' (not the password)")


class BudgetSpent(Exception):
    """The job's budget or request cap is spent: no further request may be sent."""


class QuotaStoreError(Exception):
    """A remote store could not be reached (or answered nonsense)."""


class Ask(NamedTuple):
    """What one take asks of a store: up to ``requests`` requests, ``cost`` cost and
    ``slots`` slots, and at least one request, ``need_cost`` and ``need_slots``, or
    nothing; ``owed`` settles a cost difference and ``unused`` gives back requests an
    earlier grant's term ended with (they count against a request cap no more), in the
    same call. ``seen_spent`` and ``seen_taken`` are the job's cost spent and requests
    taken as the store last told this holder, and ``gen`` the store's count they came
    from: a store whose count is another (a Redis restarted, its count lost) takes them
    back from its holders, never counting less than one of them saw.

    ``ratio`` is the largest ratio of a call's actual cost to its estimate this holder
    has seen (0.0: none yet); the store keeps the job's largest (``Grant.ratio``).
    ``probe``: the holder knows no ratio and asks for the job's *probe*, its one call
    out while no answer has said what a call costs: granted to one holder at a time
    (for ``Quota.ttl_s`` at most, or until a ratio is known), the others wait.

    ``held``: what the holder's calls out hold of the budget (each its worst case). A
    need the budget left does not cover waits while another holder of the job said,
    within :data:`HELD_FRESH_S`, that its calls hold something (it may come back), and
    ends the job only once none does."""

    requests: int
    cost: float = 0.0
    need_cost: float = 0.0
    slots: int = 0
    need_slots: int = 0
    owed: float = 0.0
    unused: int = 0
    seen_spent: float = 0.0
    seen_taken: int = 0
    gen: str = ""
    ratio: float = 0.0
    probe: bool = False
    held: float = 0.0


@dataclass(frozen=True)
class Grant:
    """What one take got: requests, cost and slots, or why not.

    Granted: the requests and cost are the holder's to send from ``start_s`` seconds
    after the store answered, within ``width_s`` seconds, its slot of the rate's
    timeline, and its next ask is due about ``span_s`` after that start (its share of
    the booked timeline). Its calls go at their places in the slot, later only as late
    as the holder is (until the end of its span, or a term). A quota without rates: 0,
    0 and 0, at once and for good. What the holder did not send by the end of its span
    is gone: a rate does not keep. Nothing granted:
    ``wait_s`` is how long until asking again may succeed (a concurrency slot), or
    ``spent`` says the budget or the request cap is spent.
    """

    requests: int = 0
    cost: float = 0.0
    slots: int = 0
    wait_s: float = 0.0
    paused: bool = False
    spent: bool = False
    start_s: float = 0.0
    span_s: float = 0.0
    width_s: float = 0.0
    #: Which count of the store this is (see :class:`Ask`); "" from a fallback.
    gen: str = ""

    #: What the store had left after this take (inf: no budget, no cap).
    budget_left: float = math.inf
    requests_left: float = math.inf
    #: The job's largest ratio of actual cost to estimate (0.0: none known; see Ask).
    ratio: float = 0.0

    @property
    def granted(self) -> bool:
        return not self.spent and self.wait_s <= 0.0


@dataclass(frozen=True)
class QuotaState:
    """A snapshot of a store: what was taken and spent, what is held and paused."""

    requests_taken: int = 0
    cost_spent: float = 0.0
    slots_used: int = 0
    holders: int = 0
    paused_for_s: float = 0.0
    exhausted: bool = False
    pauses: int = 0
    #: The pause longer than LONG_PAUSE_S in effect, as a service asked for it: how long
    #: (before ``Quota.max_pause_s`` capped it), and the header that asked ("": none).
    asked_pause_s: float = 0.0
    asked_by: str = ""


class QuotaStore(Protocol):
    """Where a quota lives: every method may raise :class:`QuotaStoreError`."""

    quota: Quota

    def take(self, holder: str, ask: Ask) -> Grant: ...

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None: ...

    def leave(
        self, holder: str, owed: float = 0.0, requests: int = 0, cost: float = 0.0
    ) -> None: ...

    def settle(self, holder: str, owed: float, ratio: float = 0.0) -> None: ...

    def pause(self, seconds: float, asked: float = 0.0, header: str = "") -> None: ...

    def state(self) -> QuotaState: ...

    def close(self) -> None: ...
