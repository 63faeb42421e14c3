"""All-or-nothing checkout of several keys at once, without a global lock.

The design of Terracotta's concurrent object manager, on the purgatory:

* A request marks its keys in use one at a time, in one global order, each under the lock
  of the key's stripe. On the first busy key it unmarks what it marked (waking anyone who
  saw those marks) and waits in the purgatory, watched on that busy key. Marking never
  blocks, so no request ever waits while holding a key: there is nothing to deadlock on.
* Parking is check, change, re-check: the purgatory re-checks the busy key after listing
  the request on it, so a key checked in between "busy" and "parked" sends the request
  round again instead of leaving it waiting with everything free.
* A key that is not resident gets a marker entry, put there if absent under the stripe
  lock, that is busy until its ``loader(key)`` call returns. Only the request that put the
  marker starts the load, on the manager's loader pool (never on the caller's thread), and
  then parks on the marker like every other request that wants the key: one load per key
  however many wait, and each waiter's ``timeout_ms`` runs meanwhile. A failed load
  removes the marker and fails the requests parked on it with the loader's error. A load
  outlives the requests that timed out or were cancelled while it ran: its object becomes
  resident all the same (the next checkout finds it loaded).
* ``pause()`` is a read-write gate made of striped counters: every attempt and every
  checked-out request counts itself in its first key's stripe, under the lock it reads the
  pause flag with (and marks that key with); ``pause`` sets the flag, then waits for the
  counts to sum to zero.

Callbacks and the retries of parked requests run in whichever thread made them possible:
the caller of :meth:`ResourceManager.checkout`, the thread that checks a key in, a loader
thread that finished a load, or the purgatory's reaper for timeouts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable
from concurrent.futures import CancelledError
from types import TracebackType
from typing import Any, Callable

from ._validate import INT64_MAX, check_int, check_keys, check_timeout
from .execution import PoolShutDown, ThreadPool
from .metrics import register
from .purgatory import DelayedOperation, Purgatory

__all__ = ["Checkout", "ResourceManager"]

logger = logging.getLogger(__name__)

_PENDING, _HELD, _RETURNED, _TIMED_OUT, _CANCELLED, _FAILED = range(6)
_STATE_NAMES = ("pending", "held", "checked in", "timed out", "cancelled", "failed")

# A wait with no timeout still needs a timer entry (the purgatory's one strong reference):
# about 35 years.
_FOREVER_MS = 1 << 40
_STRIPES = 64
#: The most loader threads a manager may run.
MAX_LOAD_THREADS = 1024


class _Entry:
    """One key's in-use mark and, with a loader, its object; ``error`` is a failed load's.

    ``watched`` says a request may be parked on the entry: set (under the stripe lock) by
    every request that parks or stays parked, taken by the unmark that then wakes them,
    so that an uncontended checkin skips the purgatory.
    """

    __slots__ = ("busy", "error", "value", "watched")

    def __init__(self) -> None:
        self.value: Any = None
        self.busy = True
        self.watched = False
        self.error: BaseException | None = None


class _Stripe:
    """The lock and entries of the keys that hash here, and this stripe's share of the counters."""

    __slots__ = (
        "active",
        "callback_errors",
        "entries",
        "held",
        "load_errors",
        "loads",
        "lock",
        "timeouts",
        "waiting",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[Hashable, _Entry] = {}
        # Requests in an attempt plus requests checked out: what pause() waits on. A
        # request may leave in another stripe than it entered, so only the sum means much.
        self.active = 0
        self.held = 0
        self.waiting = 0
        self.loads = 0
        self.load_errors = 0
        self.timeouts = 0
        self.callback_errors = 0


_Slots = list[tuple[Hashable, _Stripe]]
# What an attempt must wait for: (key, stripe, entry, whether this attempt must load it),
# or _AT_GATE while the manager is paused.
_Busy = tuple[Hashable, "_Stripe | None", "_Entry | None", bool]
_AT_GATE: _Busy = (None, None, None, False)


def _tie_rank(key: Hashable) -> tuple[int, str, str, str]:
    return (hash(key), type(key).__module__, type(key).__qualname__, repr(key))


def _global_order(keys: Iterable[Hashable]) -> list[Hashable]:
    """Return ``keys`` in the order every checkout marks them in.

    The order is by ``hash``, which is total over keys of any mix of types and costs
    nothing extra; distinct keys that share a hash (``hash(-1) == hash(-2)``) are ordered
    by type name, then ``repr``. A tie left unbroken (equal reprs) could only cost a retry,
    never a deadlock, because marking never blocks.
    """
    ordered = sorted(keys, key=hash)
    if len(set(map(hash, ordered))) < len(ordered):
        return sorted(ordered, key=_tie_rank)
    return ordered


class Checkout:
    """A request for several keys, all or none: the future :meth:`ResourceManager.checkout` returns.

    :meth:`result` gives a mapping key -> object when the manager has a loader, else the
    keys; it raises :class:`TimeoutError` when the checkout's ``timeout_ms`` passed with
    nothing held, :class:`concurrent.futures.CancelledError` after :meth:`cancel`, and the
    loader's error when a load it waited on failed. Give it back with
    :meth:`ResourceManager.checkin`.
    """

    __slots__ = (
        "_again",
        "_blocked",
        "_callbacks",
        "_deadline",
        "_event",
        "_home",
        "_keys",
        "_lock",
        "_manager",
        "_marked",
        "_parked",
        "_running",
        "_slots",
        "_state",
        "_timeout_ms",
        "_value",
        "_wait",
    )

    def __init__(
        self,
        manager: ResourceManager,
        keys: tuple[Hashable, ...],
        slots: _Slots,
        timeout_ms: int | None,
        deadline: int | None,
    ) -> None:
        self._manager = manager
        self._keys = keys
        self._slots = slots
        # The last key's stripe: its lock guards the state too, so the critical section that
        # marks the last key also hands the checkout over, and the counters change with it.
        self._home = slots[-1][1]
        self._timeout_ms = timeout_ms
        self._deadline = deadline
        self._lock = self._home.lock
        self._state = _PENDING
        self._value: Any = None
        self._marked: list[_Entry] | None = None
        self._event: threading.Event | None = None
        # Made by the first add_done_callback: most checkouts never get one.
        self._callbacks: list[Callable[[Checkout], Any]] | None = None
        # One thread at a time runs the request's attempts; a wake-up that arrives while
        # one runs sets _again instead of recursing into a second runner.
        self._running = False
        self._again = False
        self._wait: _Wait | None = None
        self._blocked: _Entry | None = None
        self._parked = False

    @property
    def keys(self) -> tuple[Hashable, ...]:
        """The keys requested, in the caller's order."""
        return self._keys

    def done(self) -> bool:
        """True once the checkout is held, checked in, timed out, cancelled or failed."""
        return self._state != _PENDING

    def cancelled(self) -> bool:
        """True if :meth:`cancel` withdrew the request."""
        return self._state == _CANCELLED

    def cancel(self) -> bool:
        """Withdraw a waiting request; True only if it was still waiting."""
        return self._manager._finish(self, _CANCELLED, None)

    def result(self, timeout: float | None = None) -> Any:
        """Wait up to ``timeout`` seconds (forever if None) and return what was checked out.

        Raises :class:`TimeoutError` if the request is still waiting after ``timeout``
        (it goes on waiting), or for the reasons given in the class docstring.
        """
        if timeout is not None:
            timeout = check_timeout("timeout", timeout)
        state = self._state
        if state == _PENDING:
            with self._lock:
                # Made under the lock that _finish takes, so a finish either sees it or
                # happened first and shows in the state.
                if self._state == _PENDING and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"checkout of {self._keys!r} still waiting after {timeout} s")
            state = self._state
        if state == _HELD:
            return self._value
        if state == _TIMED_OUT:
            raise TimeoutError(
                f"checkout of {self._keys!r} timed out: not all free within {self._timeout_ms} ms"
            )
        if state == _CANCELLED:
            raise CancelledError(f"checkout of {self._keys!r} was cancelled")
        if state == _FAILED:
            raise self._value
        raise RuntimeError(f"checkout of {self._keys!r} was already checked in")

    def add_done_callback(self, fn: Callable[[Checkout], Any]) -> None:
        """Call ``fn(checkout)`` once it is done, at once if it already is.

        The callback runs in the thread that finished the request; if it raises, the error
        is logged on the ``timewheel.resources`` logger and counted in ``callback_errors``.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        with self._lock:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        self._manager._call_back(self, fn)

    def __repr__(self) -> str:
        return f"<Checkout {self._keys!r} {_STATE_NAMES[self._state]}>"


class _Wait(DelayedOperation):
    """One parking of a checkout, watched on the entry it found busy (None: the pause gate)."""

    __slots__ = ("checkout", "entry", "stripe")

    def __init__(
        self, checkout: Checkout, entry: _Entry | None, stripe: _Stripe | None, delay_ms: int
    ) -> None:
        DelayedOperation.__init__(self, delay_ms)
        self.checkout = checkout
        self.entry = entry
        self.stripe = stripe

    def try_complete(self) -> bool:
        """Complete once the entry is no longer busy (or the manager is resumed)."""
        entry, stripe = self.entry, self.stripe
        if entry is None or stripe is None:
            free = not self.checkout._manager._paused
        else:
            with stripe.lock:
                free = not entry.busy
                if not free:
                    # Still parked: the next unmark must wake us again.
                    entry.watched = True
        return free and self.force_complete()

    def on_complete(self) -> None:
        """Send the checkout round again; on a timeout, that attempt times it out."""
        self.checkout._manager._run(self.checkout)


class _Pause:
    """What :meth:`ResourceManager.pause` returns: leaving the ``with`` block resumes."""

    __slots__ = ("_manager",)

    def __init__(self, manager: ResourceManager) -> None:
        self._manager = manager

    def __enter__(self) -> ResourceManager:
        return self._manager

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._manager.resume()


class ResourceManager:
    """Check out several keys at once, all or none, with no global lock (Terracotta's design).

    ``ResourceManager(*, loader=None, purgatory=None, load_threads=16)``. With a
    ``loader``, a key not yet resident is loaded by ``loader(key)`` exactly once however
    many requests want it, on a pool of up to ``load_threads`` threads the manager owns
    (started when first needed, shut down by :meth:`close`), and :meth:`Checkout.result`
    maps each key to its object. Requests that must wait, for a key in use or loading,
    park in the ``purgatory`` (a new one, with its reaper thread, unless one is given; an
    owned purgatory is shut down by :meth:`close`). Timeouts follow the purgatory timer's
    clock.
    """

    def __init__(
        self,
        *,
        loader: Callable[[Hashable], Any] | None = None,
        purgatory: Purgatory | None = None,
        load_threads: int = 16,
    ) -> None:
        if loader is not None and not callable(loader):
            raise TypeError(f"loader must be callable or None, got {loader!r}")
        if purgatory is not None and not isinstance(purgatory, Purgatory):
            raise TypeError(f"purgatory must be a Purgatory or None, got {purgatory!r}")
        load_threads = check_int("load_threads", load_threads, 1, MAX_LOAD_THREADS)
        self._loader = loader
        self._load_pool = (
            ThreadPool(load_threads, name="timewheel-loader") if loader is not None else None
        )
        self._owns_purgatory = purgatory is None
        self._purgatory = purgatory if purgatory is not None else Purgatory("resources")
        self._now = self._purgatory.timer.now_ms
        self._stripes = [_Stripe() for _ in range(_STRIPES)]
        self._mask = _STRIPES - 1
        self._paused = False
        self._gate = threading.Condition(threading.Lock())
        # Requests parked by pause() are watched on this object; resume() wakes them.
        self._gate_key = object()
        self._closed = False
        register("resource_manager", self, self._purgatory.name)

    # -- the public calls ------------------------------------------------------------
    def checkout(self, keys: Iterable[Hashable], timeout_ms: int | None = None) -> Checkout:
        """Request every key in ``keys``, all or none; return at once with a :class:`Checkout`.

        ``timeout_ms`` (an int >= 0, None for no limit) bounds the wait; 0 means try once.
        """
        keys = check_keys(keys)
        deadline = None
        if timeout_ms is not None:
            timeout_ms = check_int("timeout_ms", timeout_ms, 0, INT64_MAX)
            deadline = self._now() + timeout_ms
        if self._closed:
            raise RuntimeError("ResourceManager is closed")
        stripes, mask = self._stripes, self._mask
        if len(keys) == 1:
            key = keys[0]
            slots = [(key, stripes[hash(key) & mask])]
        else:
            slots = [(key, stripes[hash(key) & mask]) for key in _global_order(keys)]
        checkout = Checkout(self, keys, slots, timeout_ms, deadline)
        # No other thread can see it yet: this one is its runner without asking.
        checkout._running = True
        self._drive(checkout)
        return checkout

    def checkin(self, checkout: Checkout) -> None:
        """Give back every key of a held ``checkout`` and wake the requests waiting on them."""
        if not isinstance(checkout, Checkout):
            raise TypeError(f"checkout must be a Checkout, got {checkout!r}")
        if checkout._manager is not self:
            raise ValueError(f"checkout {checkout!r} belongs to another ResourceManager")
        home = checkout._home
        with home.lock:
            state = checkout._state
            if state != _HELD:
                raise ValueError(
                    f"checkout must be held to be checked in; {checkout!r} is {_STATE_NAMES[state]}"
                )
            checkout._state = _RETURNED
            marked = checkout._marked
            checkout._marked = None
            home.held -= 1
        assert marked is not None
        self._unmark(checkout._slots, marked)

    def evict(self, key: Hashable) -> bool:
        """Drop a resident key's object unless it is checked out or loading; True if dropped.

        The next checkout of the key loads it again (a cache's flush).
        """
        try:
            stripe = self._stripes[hash(key) & self._mask]
        except TypeError:
            raise TypeError(f"key must be hashable, got {key!r}") from None
        with stripe.lock:
            entry = stripe.entries.get(key)
            if entry is None or entry.busy:
                return False
            del stripe.entries[key]
            return True

    def pause(self, timeout: float | None = None) -> _Pause:
        """Hold new checkouts and return once every outstanding checkout is checked in.

        Usable as ``with manager.pause(): ...`` or ``pause()`` ... ``resume()``. If checkouts
        are still out after ``timeout`` seconds (None, ``math.inf`` or more than
        ``threading.TIMEOUT_MAX``: no limit), resumes and raises :class:`TimeoutError`.
        Requests held by the pause keep their own timeouts. A thread that holds a checkout
        and pauses without a timeout waits for itself forever.
        """
        timeout = check_timeout("timeout", timeout)
        with self._gate:
            if self._paused:
                raise RuntimeError("ResourceManager is already paused")
            self._paused = True
        if not self._wait_drained(timeout):
            self.resume()
            raise TimeoutError(f"checkouts still out after {timeout} s; resumed")
        return _Pause(self)

    def resume(self) -> None:
        """Let the checkouts held by :meth:`pause` go."""
        with self._gate:
            if not self._paused:
                raise RuntimeError("ResourceManager is not paused")
            self._paused = False
        self._purgatory.check_and_complete(self._gate_key)

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    def metrics(self) -> dict[str, int]:
        """Counters: checked_out (held now), waiting (parked now, on a key, a load or the
        pause), loads (loader calls), load_errors, timeouts and callback_errors."""
        names = ("held", "waiting", "loads", "load_errors", "timeouts", "callback_errors")
        totals = dict.fromkeys(names, 0)
        for stripe in self._stripes:
            with stripe.lock:
                for name in names:
                    totals[name] += getattr(stripe, name)
        totals["checked_out"] = totals.pop("held")
        return totals

    def close(self) -> None:
        """Refuse new checkouts; shut down an owned purgatory, failing the requests in it.

        The loader pool is shut down without waiting: the loads already handed to it
        finish on its threads, which then exit; a load asked for after that fails the
        requests waiting on it.
        """
        self._closed = True
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=False)
        if not self._owns_purgatory:
            return
        for op in self._purgatory.shutdown():
            if isinstance(op, _Wait):
                self._finish(op.checkout, _FAILED, RuntimeError("ResourceManager was closed"))

    def __enter__(self) -> ResourceManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running a request -----------------------------------------------------------
    def _run(self, checkout: Checkout) -> None:
        """Run the checkout's attempts here, unless another thread is: then it runs one more."""
        with checkout._lock:
            if checkout._running:
                checkout._again = True
                return
            checkout._running = True
        self._drive(checkout)

    def _drive(self, checkout: Checkout) -> None:
        """Attempt until the checkout is held, finished or parked with no wake-up owed."""
        again = True
        try:
            while again:
                self._attempt(checkout)
                if not checkout._parked:
                    # Never parked, so no other thread can have asked for another attempt.
                    checkout._running = False
                    return
                with checkout._lock:
                    again = checkout._again
                    checkout._again = False
                    checkout._running = again
        except BaseException as exc:
            with checkout._lock:
                checkout._running = False
            self._finish(checkout, _FAILED, exc)
            raise

    def _attempt(self, checkout: Checkout) -> None:
        """Mark all the keys, or park on the busy one (starting its load if it is new)."""
        if checkout._state != _PENDING:
            return
        blocked = checkout._blocked
        if blocked is not None and blocked.error is not None:
            self._finish(checkout, _FAILED, blocked.error)
            return
        busy = self._mark_all(checkout)
        if busy is None:
            return
        key, stripe, entry, must_load = busy
        checkout._blocked = entry
        if must_load:
            assert stripe is not None and entry is not None
            self._start_load(key, stripe, entry)
            self._load_the_rest(checkout, key)
        self._park_or_time_out(checkout, entry, stripe)

    def _mark_all(self, checkout: Checkout) -> _Busy | None:
        """Enter the pause gate, mark every key in order and hand the checkout over; or
        say what to wait for (None: held, or finished meanwhile).

        The attempt counts itself in the pause gate in the critical section that marks the
        first key and reads the pause flag: either pause() sees the count, or it set the
        flag first and this attempt sees that (and waits at the gate, marking nothing). On
        the first busy key the attempt rolls back, leaving the gate again. The hand-over
        shares the last key's critical section: that key's stripe is the checkout's home.
        """
        slots = checkout._slots
        n = len(slots)
        loader = self._loader
        marked: list[_Entry] = []
        held = False
        for key, stripe in slots:
            with stripe.lock:
                if not marked and self._paused:
                    return _AT_GATE
                entry = stripe.entries.get(key)
                if entry is None:
                    # Put-if-absent: a new entry is born marked, so with a loader it is the
                    # marker everyone else parks on while this request loads.
                    entry = stripe.entries[key] = _Entry()
                    if loader is not None:
                        busy: _Busy = (key, stripe, entry, True)
                        break
                elif entry.busy:
                    busy = (key, stripe, entry, False)
                    break
                else:
                    entry.busy = True
                if not marked:
                    stripe.active += 1
                marked.append(entry)
                if len(marked) == n:
                    held = self._hand_over(checkout, marked)
        else:
            if not held:
                # Cancelled or closed while marking: give the keys straight back.
                self._unmark(slots, marked)
            elif checkout._parked:
                # Only a request that was parked can have a result() waiter, callbacks
                # or a timer entry: another thread could not see it before.
                self._settled(checkout)
            return None
        if marked:
            self._unmark(slots, marked)
        return busy

    def _unmark(self, slots: _Slots, marked: list[_Entry]) -> None:
        """Clear the marks, then wake whoever parked on them (they may have seen only our mark).

        It also takes the request out of the pause gate's count, in the last key's critical
        section rather than a lock of its own: the stripes' counts are only ever summed.
        That is before the wake-ups, so a BaseException from a woken request cannot leave
        the count stuck.
        """
        forget = self._loader is None
        last = marked[-1]
        wake = []
        for (key, stripe), entry in zip(slots, marked):
            with stripe.lock:
                entry.busy = False
                if entry.watched:
                    entry.watched = False
                    wake.append(entry)
                # Without a loader an entry is only a mark; dropping it keeps the map small.
                if forget and stripe.entries.get(key) is entry:
                    del stripe.entries[key]
                if entry is last:
                    stripe.active -= 1
        if self._paused:
            self._notify_pauser()
        if wake:
            self._wake(wake)

    def _wake(self, entries: Iterable[_Entry]) -> None:
        """Wake every request parked on ``entries``, then re-raise a BaseException one raised.

        Woken requests run here, so their loaders and callbacks do; an Exception from those
        is logged and counted where it happens and never reaches this caller.
        """
        error: BaseException | None = None
        for entry in entries:
            while True:
                try:
                    self._purgatory.check_and_complete(entry)
                    break
                except BaseException as exc:
                    # The request that raised is completed now, so going round wakes the
                    # rest of this entry's list and ends; whoever is left would otherwise
                    # wait for an unmark that already happened.
                    if error is None:
                        error = exc
        if error is not None:
            raise error

    def _hand_over(self, checkout: Checkout, marked: list[_Entry]) -> bool:
        """Under the home lock, every key marked: make a pending checkout held; else False."""
        if checkout._state != _PENDING:
            return False
        if self._loader is None:
            value: Any = checkout._keys
        else:
            # A plain loop: a comprehension costs a function call more on Python 3.11.
            value = {}
            for (key, _), entry in zip(checkout._slots, marked):
                value[key] = entry.value
        checkout._marked = marked
        self._settle(checkout, _HELD, value)
        return True

    def _park_or_time_out(
        self, checkout: Checkout, entry: _Entry | None, stripe: _Stripe | None
    ) -> None:
        deadline = checkout._deadline
        if deadline is None:
            delay = _FOREVER_MS
        else:
            delay = deadline - self._now()
            if delay <= 0:
                self._finish(checkout, _TIMED_OUT, None)
                return
        self._park(checkout, entry, stripe, delay)

    def _park(
        self, checkout: Checkout, entry: _Entry | None, stripe: _Stripe | None, delay: int
    ) -> None:
        """Watch the checkout on the busy entry (or the gate); the purgatory re-checks after."""
        wait = _Wait(checkout, entry, stripe, delay)
        with checkout._lock:
            if checkout._state != _PENDING:
                return
            checkout._wait = wait
            if not checkout._parked:
                checkout._parked = True
                checkout._home.waiting += 1
        if entry is None or stripe is None:
            watched: object = self._gate_key
        else:
            watched = entry
            with stripe.lock:
                entry.watched = True
        try:
            self._purgatory.try_complete_else_watch(wait, (watched,))
        except Exception as exc:
            self._finish(checkout, _FAILED, exc)
            return
        if checkout._state != _PENDING:
            # Cancelled while being listed: _finish found no timer entry to drop yet.
            wait.cancel()

    def _load_the_rest(self, checkout: Checkout, first: Hashable) -> None:
        """Start the loads of the checkout's other missing keys after ``first``, so that
        they run side by side instead of one per wake-up. Their markers are the pool's
        to clear, never the checkout's, so nothing is marked on its behalf."""
        slots = checkout._slots
        i = next(i for i, (key, _) in enumerate(slots) if key is first)
        for key, stripe in slots[i + 1 :]:
            with stripe.lock:
                if key in stripe.entries:
                    continue
                marker = stripe.entries[key] = _Entry()
            self._start_load(key, stripe, marker)

    def _start_load(self, key: Hashable, stripe: _Stripe, marker: _Entry) -> None:
        """Hand the load of a marker this attempt put in place to the loader pool."""
        assert self._load_pool is not None
        with stripe.lock:
            stripe.loads += 1
        try:
            self._load_pool.execute(lambda: self._load(key, stripe, marker))
        except PoolShutDown:
            # Closed since the checkout began: fail whoever waits instead of loading.
            self._load_failed(key, stripe, marker, RuntimeError("ResourceManager was closed"))

    def _load(self, key: Hashable, stripe: _Stripe, marker: _Entry) -> None:
        """On a loader thread: run the loader, then wake who parked on the marker."""
        assert self._loader is not None
        try:
            value = self._loader(key)
        except BaseException as exc:
            if isinstance(exc, Exception):
                logger.error("loader %r raised for key %r", self._loader, key, exc_info=exc)
            self._load_failed(key, stripe, marker, exc)
            if not isinstance(exc, Exception):
                raise  # the pool logs it and carries on
            return
        with stripe.lock:
            marker.value = value
            marker.busy = False
        self._wake((marker,))

    def _load_failed(
        self, key: Hashable, stripe: _Stripe, marker: _Entry, exc: BaseException
    ) -> None:
        """Drop the marker, then fail exactly the requests parked on it with ``exc``."""
        with stripe.lock:
            if stripe.entries.get(key) is marker:
                del stripe.entries[key]
            marker.error = exc
            marker.busy = False
            stripe.load_errors += 1
        self._wake((marker,))

    def _finish(self, checkout: Checkout, state: int, value: Any) -> bool:
        """Move a pending checkout to its final state once; count it; run its callbacks."""
        with checkout._home.lock:
            if checkout._state != _PENDING:
                return False
            self._settle(checkout, state, value)
        self._settled(checkout)
        return True

    def _settle(self, checkout: Checkout, state: int, value: Any) -> None:
        """Under the home lock, the checkout pending: move it to ``state`` and count it."""
        home = checkout._home
        checkout._state = state
        checkout._value = value
        if checkout._parked:
            home.waiting -= 1
        # Counted before the callbacks run: one may check the keys straight back in.
        if state == _HELD:
            home.held += 1
        elif state == _TIMED_OUT:
            home.timeouts += 1

    def _settled(self, checkout: Checkout) -> None:
        """After :meth:`_settle`, outside the lock: drop the timer entry, wake, call back.

        The fields read here are set only under the lock while the checkout is pending,
        so once it is settled only this thread touches them.
        """
        event, callbacks, wait = checkout._event, checkout._callbacks, checkout._wait
        checkout._callbacks = None
        checkout._wait = None
        if wait is not None:
            # Drops the timer entry of a request cancelled or closed while parked.
            wait.cancel()
        if event is not None:
            event.set()
        for fn in callbacks or ():
            self._call_back(checkout, fn)

    def _call_back(self, checkout: Checkout, fn: Callable[[Checkout], Any]) -> None:
        try:
            fn(checkout)
        except Exception:
            home = checkout._home
            with home.lock:
                home.callback_errors += 1
            logger.exception("done callback %r of %r raised", fn, checkout)

    # -- the pause gate --------------------------------------------------------------
    def _notify_pauser(self) -> None:
        if self._paused:
            with self._gate:
                self._gate.notify_all()

    def _active(self) -> int:
        total = 0
        for stripe in self._stripes:
            with stripe.lock:
                total += stripe.active
        return total

    def _wait_drained(self, timeout: float | None) -> bool:
        """Wait until no request is checked out or mid-attempt; False if ``timeout`` passed."""
        with self._gate:
            return self._gate.wait_for(lambda: self._active() == 0, timeout)

    def __repr__(self) -> str:
        m = self.metrics()
        state = "paused" if self._paused else "closed" if self._closed else "open"
        return f"<ResourceManager {state} checked_out={m['checked_out']} waiting={m['waiting']}>"
