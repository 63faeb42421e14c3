"""Every public entry point refuses bad arguments clearly and changes nothing (one table).

One row per (entry point, argument, bad value, expected exception, message fragment). The
classes of bad value are the same everywhere: NaN and the infinities, bools, ints beyond
int64 (and far beyond), and the wrong container (dict, set, str, None, generator) where a
sequence or a collection is wanted. Each row asserts the exception type, that the
message names the argument (and the value, or its type), and that the object's state is
what it was before the call. Entry points on the core run on both implementations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from timewheel import (
    ExecuteProduceConsume,
    Fair,
    Implementation,
    ManualClock,
    PreferThenFair,
    ProduceConsume,
    ProduceExecuteConsume,
    Purgatory,
    QueueingSource,
    ResourceManager,
    Scheduler,
    SetQueue,
    TaskQueue,
    ThreadPool,
    Timer,
    implementation,
)

NAN, INF = math.nan, math.inf
HUGE = [2**63, 2**70, -(2**70)]


def _gen() -> Iterator[int]:
    yield 1


GEN = _gen  # a fresh generator per row: the table calls it at run time


@dataclass(frozen=True)
class Entry:
    """An entry point: how to make its object, call it with one bad value, read its state."""

    name: str
    make: Callable[[Implementation], Any]
    call: Callable[[Any, Any, Implementation], Any]
    state: Callable[[Any], Any] = lambda obj: None


class Source:
    """A source of ints 0, 1, 2, ... for QueueingSource and Scheduler."""

    def __init__(self) -> None:
        self.next = 0

    def get_next_batch(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


class Sink:
    def outstanding(self) -> int:
        return 0

    def submit(self, source: str, items: list[Any]) -> None:
        pass


def _wheel(impl: Implementation) -> Any:
    w = impl.TimingWheel()
    w.schedule(5, "a")
    w.schedule(500, "b")
    return w


def _wheel_state(w: Any) -> Any:
    return (len(w), w.now, w.next_deadline(), w.levels)


def _timer(impl: Implementation) -> Timer:
    timer = impl.Timer(clock=ManualClock())
    timer.add(10, lambda: None)
    return timer


def _purgatory(impl: Implementation) -> Purgatory:
    return impl.Purgatory(timer=impl.Timer(clock=ManualClock()), reaper=False)


def _manager(impl: Implementation) -> ResourceManager:
    return ResourceManager(purgatory=_purgatory(impl))


def _checkout(impl: Implementation) -> Any:
    rm = _manager(impl)
    rm.checkout(["held"])
    return rm.checkout(["held"])  # pending: result() and callbacks are live


def _scheduler(impl: Implementation) -> Scheduler:
    return Scheduler({"a": Source()}, Fair(), Sink(), max_outstanding=4, batch_size=2)


def _ctor(make: Callable[..., Any], arg: str, **fixed: Any) -> Callable[[Any, Any, Any], Any]:
    return lambda obj, v, impl: make(impl, **{**fixed, arg: v})


# -- the entry points -------------------------------------------------------------------
E: dict[str, Entry] = {
    "wheel.schedule": Entry(
        "schedule(deadline)", _wheel, lambda w, v, i: w.schedule(v, "x"), _wheel_state
    ),
    "wheel.cancel": Entry("cancel(handle)", _wheel, lambda w, v, i: w.cancel(v), _wheel_state),
    "wheel.advance": Entry("advance(now)", _wheel, lambda w, v, i: w.advance(v), _wheel_state),
    "wheel.advance_many": Entry(
        "advance_many(now)", _wheel, lambda w, v, i: w.advance_many(v), _wheel_state
    ),
    "wheel.schedule_many.deadlines": Entry(
        "schedule_many(deadlines)", _wheel, lambda w, v, i: w.schedule_many(v), _wheel_state
    ),
    "wheel.schedule_many.items": Entry(
        "schedule_many(items)",
        _wheel,
        lambda w, v, i: w.schedule_many(np.array([7], dtype=np.int64), v),
        _wheel_state,
    ),
    "wheel.cancel_many": Entry(
        "cancel_many(handles)", _wheel, lambda w, v, i: w.cancel_many(v), _wheel_state
    ),
    "ManualClock()": Entry("ManualClock(start_ms)", lambda i: None, lambda o, v, i: ManualClock(v)),
    "ManualClock.advance": Entry(
        "ManualClock.advance(ms)",
        lambda i: ManualClock(5),
        lambda c, v, i: c.advance(v),
        lambda c: c.now_ms(),
    ),
    "ManualClock.set": Entry(
        "ManualClock.set(ms)",
        lambda i: ManualClock(5),
        lambda c, v, i: c.set(v),
        lambda c: c.now_ms(),
    ),
    "Timer.add": Entry("Timer.add(delay_ms)", _timer, lambda t, v, i: t.add(v, lambda: None), len),
    "Timer.add.callback": Entry("Timer.add(callback)", _timer, lambda t, v, i: t.add(1, v), len),
    "Timer.add_task": Entry(
        "Timer.add_task(delay_ms)", _timer, lambda t, v, i: t.add_task(i.TimerTask(), v), len
    ),
    "Timer.add_task.task": Entry(
        "Timer.add_task(task)", _timer, lambda t, v, i: t.add_task(v, 1), len
    ),
    "Timer.advance_clock": Entry(
        "Timer.advance_clock(timeout_ms)", _timer, lambda t, v, i: t.advance_clock(v), len
    ),
    "Timer.start": Entry("Timer.start(poll_ms)", _timer, lambda t, v, i: t.start(v), len),
    "Timer.start.after_advance": Entry(
        "Timer.start(after_advance)", _timer, lambda t, v, i: t.start(after_advance=v), len
    ),
    "DelayedOperation()": Entry(
        "DelayedOperation(delay_ms)", lambda i: None, lambda o, v, i: i.DelayedOperation(v)
    ),
    "Purgatory.advance_clock": Entry(
        "Purgatory.advance_clock(timeout_ms)",
        _purgatory,
        lambda p, v, i: p.advance_clock(v),
        lambda p: p.metrics(),
    ),
    "Purgatory.watch.keys": Entry(
        "Purgatory.try_complete_else_watch(keys)",
        _purgatory,
        lambda p, v, i: p.try_complete_else_watch(implementation().DelayedOperation(10), v),
        lambda p: p.metrics(),
    ),
    "Purgatory.check_and_complete": Entry(
        "Purgatory.check_and_complete(key)",
        _purgatory,
        lambda p, v, i: p.check_and_complete(v),
        lambda p: p.metrics(),
    ),
    "rm.checkout.keys": Entry(
        "ResourceManager.checkout(keys)",
        _manager,
        lambda r, v, i: r.checkout(v),
        lambda r: r.metrics(),
    ),
    "rm.checkout.timeout_ms": Entry(
        "ResourceManager.checkout(timeout_ms)",
        _manager,
        lambda r, v, i: r.checkout(["k"], v),
        lambda r: r.metrics(),
    ),
    "rm.pause": Entry(
        "ResourceManager.pause(timeout)",
        _manager,
        lambda r, v, i: r.pause(v),
        lambda r: (r.paused, r.metrics()),
    ),
    "rm.evict": Entry(
        "ResourceManager.evict(key)", _manager, lambda r, v, i: r.evict(v), lambda r: r.metrics()
    ),
    "rm.checkin": Entry(
        "ResourceManager.checkin(checkout)",
        _manager,
        lambda r, v, i: r.checkin(v),
        lambda r: r.metrics(),
    ),
    "Checkout.result": Entry(
        "Checkout.result(timeout)", _checkout, lambda c, v, i: c.result(v), lambda c: c.done()
    ),
    "Checkout.add_done_callback": Entry(
        "Checkout.add_done_callback(fn)",
        _checkout,
        lambda c, v, i: c.add_done_callback(v),
        lambda c: c.done(),
    ),
    "pool.execute": Entry(
        "ThreadPool.execute(fn)",
        lambda i: ThreadPool(1),
        lambda p, v, i: p.execute(v),
        lambda p: (p.threads, p.queued),
    ),
    "pool.try_execute": Entry(
        "ThreadPool.try_execute(fn)",
        lambda i: ThreadPool(1),
        lambda p, v, i: p.try_execute(v),
        lambda p: (p.threads, p.queued),
    ),
    "pool.wait_idle.count": Entry(
        "ThreadPool.wait_idle(count)", lambda i: ThreadPool(2), lambda p, v, i: p.wait_idle(v, 0)
    ),
    "pool.wait_idle.timeout": Entry(
        "ThreadPool.wait_idle(timeout)", lambda i: ThreadPool(2), lambda p, v, i: p.wait_idle(1, v)
    ),
    "TaskQueue.offer": Entry(
        "TaskQueue.offer(task)", lambda i: TaskQueue(), lambda q, v, i: q.offer(v), len
    ),
    "TaskQueue.offer_all": Entry(
        "TaskQueue.offer_all(tasks)", lambda i: TaskQueue(), lambda q, v, i: q.offer_all(v), len
    ),
    "SetQueue()": Entry("SetQueue(items)", lambda i: None, lambda o, v, i: SetQueue(v)),
    "SetQueue.offer": Entry(
        "SetQueue.offer(item)", lambda i: SetQueue([1, 2]), lambda q, v, i: q.offer(v), len
    ),
    "SetQueue.offer_all": Entry(
        "SetQueue.offer_all(items)", lambda i: SetQueue([1, 2]), lambda q, v, i: q.offer_all(v), len
    ),
    "SetQueue.poll": Entry(
        "SetQueue.poll(n)", lambda i: SetQueue([1, 2]), lambda q, v, i: q.poll(v), len
    ),
    "qs.get_next_batch": Entry(
        "QueueingSource.get_next_batch(n)",
        lambda i: QueueingSource(Source(), 4, 1),
        lambda s, v, i: s.get_next_batch(v),
        lambda s: s.metrics(),
    ),
    "qs.ack": Entry(
        "QueueingSource.ack(items)",
        lambda i: QueueingSource(Source(), 4, 1),
        lambda s, v, i: s.ack(v),
        lambda s: s.metrics(),
    ),
    "qs.wait_idle": Entry(
        "QueueingSource.wait_idle(timeout)",
        lambda i: QueueingSource(Source(), 4, 1),
        lambda s, v, i: s.wait_idle(v),
    ),
    "qs.close": Entry(
        "QueueingSource.close(timeout)",
        lambda i: QueueingSource(Source(), 4, 1),
        lambda s, v, i: s.close(v),
    ),
    "Scheduler.run.idle_wait": Entry(
        "Scheduler.run(idle_wait)",
        _scheduler,
        lambda s, v, i: s.run(threading.Event(), idle_wait=v),
        lambda s: s.metrics(),
    ),
    "Scheduler.close": Entry("Scheduler.close(timeout)", _scheduler, lambda s, v, i: s.close(v)),
}


def ctor(name: str, make: Callable[..., Any], arg: str, **fixed: Any) -> Entry:
    return Entry(f"{name}({arg}=)", lambda i: None, _ctor(make, arg, **fixed))


for _arg in ("tick", "wheel_size", "start"):
    E[f"TimingWheel.{_arg}"] = ctor("TimingWheel", lambda i, **k: i.TimingWheel(**k), _arg)
for _arg in (
    "tick_ms",
    "wheel_size",
    "pool_threads",
    "max_pending",
    "name",
    "clock",
    "executor",
    "strategy",
):
    E[f"Timer.{_arg}"] = ctor("Timer", lambda i, **k: i.Timer(**k), _arg)
for _arg in ("name", "purge_interval", "reaper", "shards", "pool_threads", "timer", "strategy"):
    E[f"Purgatory.{_arg}"] = ctor(
        "Purgatory", lambda i, **k: i.Purgatory(**{"reaper": False, **k}), _arg
    )
for _arg in ("loader", "purgatory", "load_threads"):
    E[f"ResourceManager.{_arg}"] = ctor(
        "ResourceManager", lambda i, **k: ResourceManager(**k), _arg
    )
for _arg in ("max_threads", "name"):
    E[f"ThreadPool.{_arg}"] = ctor("ThreadPool", lambda i, **k: ThreadPool(**k), _arg)
E["ProduceConsume.producer"] = ctor(
    "ProduceConsume", lambda i, **k: ProduceConsume(**k), "producer"
)
for _cls in (ProduceExecuteConsume, ExecuteProduceConsume):
    E[f"{_cls.__name__}.producer"] = ctor(
        _cls.__name__, lambda i, c=_cls, **k: c(**{"pool": ThreadPool(1), **k}), "producer"
    )
    E[f"{_cls.__name__}.pool"] = ctor(
        _cls.__name__, lambda i, c=_cls, **k: c(**{"producer": TaskQueue(), **k}), "pool"
    )
E["Fair.names"] = ctor("Fair", lambda i, **k: Fair(**k), "names")
E["PreferThenFair.preferred"] = ctor(
    "PreferThenFair", lambda i, **k: PreferThenFair(**{"others": ["b"], **k}), "preferred"
)
E["PreferThenFair.others"] = ctor(
    "PreferThenFair", lambda i, **k: PreferThenFair(**{"preferred": "a", **k}), "others"
)
for _arg in ("wrapped", "capacity", "replenish_threshold", "executor", "dedup_in_flight"):
    E[f"QueueingSource.{_arg}"] = ctor(
        "QueueingSource",
        lambda i, **k: QueueingSource(
            **{"wrapped": Source(), "capacity": 4, "replenish_threshold": 1, **k}
        ),
        _arg,
    )
for _arg in ("sources", "strategy", "sink", "max_outstanding", "batch_size"):
    E[f"Scheduler.{_arg}"] = ctor(
        "Scheduler",
        lambda i, **k: Scheduler(
            **{
                "sources": {"a": Source()},
                "strategy": Fair(),
                "sink": Sink(),
                "max_outstanding": 4,
                "batch_size": 2,
                **k,
            }
        ),
        _arg,
    )


# -- the table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    entry: str
    arg: str
    bad: Any
    error: type[Exception]
    fragment: str  # the message names the argument with this

    @property
    def id(self) -> str:
        shown = "GEN" if self.bad is GEN else repr(self.bad)
        return f"{E[self.entry].name}-{shown}"


NOT_INTS = [NAN, INF, -INF, True, False, 1.5, "1", b"1", [1]]


def ints(
    entry: str, arg: str, *, none_ok: bool = False, huge: tuple[int, ...] = tuple(HUGE)
) -> list[Row]:
    """An int argument: non-ints are a TypeError, ints out of range a ValueError."""
    rows = [Row(entry, arg, v, TypeError, f"{arg} must be") for v in NOT_INTS]
    if not none_ok:
        rows.append(Row(entry, arg, None, TypeError, f"{arg} must be"))
    return rows + [Row(entry, arg, v, ValueError, arg) for v in huge]


def seconds(entry: str, arg: str) -> list[Row]:
    """A wait in seconds: None, inf and too long for the OS mean no limit."""
    return [
        Row(entry, arg, NAN, ValueError, f"{arg} must be"),
        Row(entry, arg, -INF, ValueError, f"{arg} must be"),
        Row(entry, arg, -1, ValueError, f"{arg} must be"),
        Row(entry, arg, -(2**70), ValueError, f"{arg} must be"),
        Row(entry, arg, True, TypeError, f"{arg} must be"),
        Row(entry, arg, "1", TypeError, f"{arg} must be"),
        Row(entry, arg, [1], TypeError, f"{arg} must be"),
    ]


def callables(entry: str, arg: str, *, none_ok: bool = False) -> list[Row]:
    bad: list[Any] = [42, "print", NAN, True]
    return [Row(entry, arg, v, TypeError, arg) for v in bad + ([] if none_ok else [None])]


def wrong(entry: str, arg: str, *values: Any, error: type[Exception] = TypeError) -> list[Row]:
    return [Row(entry, arg, v, error, arg) for v in values]


CONTAINERS = [None, 5, NAN, True]
ROWS: list[Row] = [
    *ints("TimingWheel.tick", "tick"),
    *ints("TimingWheel.wheel_size", "wheel_size"),
    *ints("TimingWheel.start", "start"),
    *ints("wheel.schedule", "deadline"),
    *ints("wheel.advance", "now"),
    *ints("wheel.advance_many", "now"),
    # A handle beyond int64 is a handle no wheel issued (cancel says False); beyond
    # HANDLE_BOUND it is nonsense.
    *ints("wheel.cancel", "handle", huge=(2**300, -(2**300))),
    *wrong("wheel.schedule_many.deadlines", "deadlines", [1, 2], {1: 2}, None, np.array([1.5])),
    *wrong("wheel.schedule_many.items", "items", {0: "a"}, {"a"}, "a", 5, GEN, frozenset("a")),
    *wrong("wheel.cancel_many", "handles", [1, 2], {1}, None, np.array([1.5])),
    *ints("ManualClock()", "start_ms"),
    *ints("ManualClock.advance", "ms"),
    *ints("ManualClock.set", "ms"),
    *ints("Timer.tick_ms", "tick_ms"),
    *ints("Timer.wheel_size", "wheel_size"),
    *ints("Timer.pool_threads", "pool_threads"),
    *ints("Timer.max_pending", "max_pending", none_ok=True),
    *wrong("Timer.name", "name", None, 5, NAN),
    *wrong("Timer.clock", "clock", 5, NAN, "now"),
    *wrong("Timer.executor", "executor", 5, NAN, "pool"),
    *wrong("Timer.strategy", "strategy", 5, NAN, "fair"),
    *ints("Timer.add", "delay_ms"),
    *callables("Timer.add.callback", "callback"),
    *ints("Timer.add_task", "delay_ms"),
    *wrong("Timer.add_task.task", "task", None, 5, print),
    *ints("Timer.advance_clock", "timeout_ms"),
    *ints("Timer.start", "poll_ms"),
    *callables("Timer.start.after_advance", "after_advance", none_ok=True),
    *ints("DelayedOperation()", "delay_ms"),
    *wrong("Purgatory.name", "name", None, 5, NAN),
    *ints("Purgatory.purge_interval", "purge_interval"),
    *wrong("Purgatory.reaper", "reaper", None, 1, NAN, "yes"),
    *ints("Purgatory.shards", "shards"),
    *ints("Purgatory.pool_threads", "pool_threads"),
    *wrong("Purgatory.timer", "timer", 5, NAN, ManualClock()),
    *wrong("Purgatory.strategy", "strategy", 5, NAN),
    *ints("Purgatory.advance_clock", "timeout_ms"),
    *wrong("Purgatory.watch.keys", "keys", *CONTAINERS, "ab", [[1]]),
    *wrong("Purgatory.watch.keys", "keys", [], [1, 1], error=ValueError),
    *wrong("Purgatory.check_and_complete", "key", [1], {1: 2}, {1}),
    *callables("ResourceManager.loader", "loader", none_ok=True),
    *wrong("ResourceManager.purgatory", "purgatory", 5, NAN, ManualClock()),
    *ints("ResourceManager.load_threads", "load_threads"),
    *wrong("rm.checkout.keys", "keys", *CONTAINERS, "ab", [[1]], b"ab"),
    *wrong("rm.checkout.keys", "keys", [], [1, 1], error=ValueError),
    *ints("rm.checkout.timeout_ms", "timeout_ms", none_ok=True),
    *seconds("rm.pause", "timeout"),
    *wrong("rm.evict", "key", [1], {1: 2}, {1}),
    *wrong("rm.checkin", "checkout", None, 5, ["k"]),
    *seconds("Checkout.result", "timeout"),
    *callables("Checkout.add_done_callback", "fn"),
    *ints("ThreadPool.max_threads", "max_threads"),
    *wrong("ThreadPool.name", "name", None, 5, NAN),
    *callables("pool.execute", "fn"),
    *callables("pool.try_execute", "fn"),
    *ints("pool.wait_idle.count", "count", huge=(2**63, 2**70, -(2**70), 0, 3)),
    *seconds("pool.wait_idle.timeout", "timeout"),
    *callables("TaskQueue.offer", "task"),
    *wrong("TaskQueue.offer_all", "tasks", *CONTAINERS, "ab", {print}, {print: 1}, [print, 5]),
    *wrong("ProduceConsume.producer", "producer", None, 5, NAN, print),
    *wrong("ProduceExecuteConsume.producer", "producer", None, 5, NAN, print),
    *wrong("ProduceExecuteConsume.pool", "pool", None, 5, NAN, TaskQueue()),
    *wrong("ExecuteProduceConsume.producer", "producer", None, 5, NAN, print),
    *wrong("ExecuteProduceConsume.pool", "pool", None, 5, NAN, TaskQueue()),
    *wrong("SetQueue()", "items", 5, NAN, True, [[1]]),
    *wrong("SetQueue.offer", "item", [1], {1: 2}, {1}),
    *wrong("SetQueue.offer_all", "items", *CONTAINERS, [[1]], [{1}]),
    *ints("SetQueue.poll", "n"),
    *wrong("QueueingSource.wrapped", "wrapped", None, 5, NAN, [1, 2]),
    *ints("QueueingSource.capacity", "capacity"),
    *ints("QueueingSource.replenish_threshold", "replenish_threshold"),
    *wrong("QueueingSource.executor", "executor", 5, NAN, print),
    *wrong("QueueingSource.dedup_in_flight", "dedup_in_flight", None, 1, NAN, "yes"),
    *ints("qs.get_next_batch", "n"),
    *wrong("qs.ack", "items", *CONTAINERS, [[1]]),
    *seconds("qs.wait_idle", "timeout"),
    *seconds("qs.close", "timeout"),
    *wrong("Scheduler.sources", "sources", None, 5, NAN, [Source()], {1: Source()}, {"a": 5}),
    *wrong("Scheduler.strategy", "strategy", None, 5, NAN, print),
    *wrong("Scheduler.sink", "sink", None, 5, NAN, print),
    *ints("Scheduler.max_outstanding", "max_outstanding"),
    *ints("Scheduler.batch_size", "batch_size"),
    *seconds("Scheduler.run.idle_wait", "idle_wait"),
    *wrong("Scheduler.run.idle_wait", "idle_wait", None),
    *seconds("Scheduler.close", "timeout"),
    *wrong("Fair.names", "names", 5, NAN, "ab", {"a"}, {"a": 1}, [1]),
    *wrong("Fair.names", "names", ["a", "a"], [], error=ValueError),
    *wrong("PreferThenFair.preferred", "preferred", None, 5, NAN, ["a"]),
    *wrong("PreferThenFair.others", "others", None, 5, NAN, "ab", {"b"}, [1]),
]

# The entry points of the core run on both implementations.
# (Timer takes either wheel; the purgatory and the manager above it run on the selected
# implementation, and their suites run on the twin in a child interpreter.)
CORE = ("TimingWheel.", "wheel.", "Timer", "DelayedOperation")


def _cases() -> list[Any]:
    cases = []
    for row in ROWS:
        impls = ["cython", "python"] if row.entry.startswith(CORE) else ["selected"]
        for name in impls:
            cases.append(pytest.param(row, name, id=f"{row.id}-{name}"))
    return cases


def _implementation(name: str) -> Implementation:
    if name == "selected":
        return implementation()
    try:
        return implementation(name)
    except LookupError:
        pytest.skip("the extensions are not in use")


def _forms(value: Any) -> list[str]:
    """How a message may show the bad value: its repr or its type, or for a container the
    part that is wrong (an item, a key, a value, its dtype) or that it is empty."""
    forms = [repr(value), type(value).__name__]
    if isinstance(value, int):
        forms.append(str(int(value)))
    if isinstance(value, np.ndarray):
        forms.append(str(value.dtype))
    elif isinstance(value, (list, tuple, dict)):
        forms += [repr(tuple(value)), *map(repr, value)] + ([] if value else ["empty"])
        if isinstance(value, dict):
            forms += map(repr, value.values())
    return forms


def _close(obj: Any) -> None:
    for method in ("close", "shutdown"):
        if callable(getattr(obj, method, None)):
            getattr(obj, method)()
            return
    manager = getattr(obj, "_manager", None)  # a Checkout: close its manager
    if manager is not None:
        manager.close()


@pytest.mark.parametrize(("row", "impl"), _cases())
def test_bad_argument_is_refused_clearly_and_changes_nothing(row: Row, impl: str) -> None:
    implementation_ = _implementation(impl)
    entry = E[row.entry]
    obj = entry.make(implementation_)
    try:
        before = entry.state(obj)
        bad = row.bad() if row.bad is GEN else row.bad
        with pytest.raises(row.error) as info:
            entry.call(obj, bad, implementation_)
        message = str(info.value)
        assert row.fragment in message, f"the message does not name {row.arg}: {message!r}"
        assert any(form in message for form in _forms(bad)), f"{message!r} does not show {bad!r}"
        assert entry.state(obj) == before, "a refused call changed the state"
    finally:
        _close(obj)
