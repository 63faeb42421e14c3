"""Tests for timewheel.sources: SetQueue, QueueingSource, strategies and Scheduler."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from timewheel.sources import Fair, PreferThenFair, QueueingSource, Scheduler, SetQueue

WAIT = 10.0  # generous bound on every wait: a hang fails the test instead of blocking CI


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Switch threads as often as possible so races show up in short tests."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def run_threads(*targets: Callable[[], None]) -> None:
    """Run the targets on threads released together; re-raise the first failure."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def wrap(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait(WAIT)
                target()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
        assert not t.is_alive(), "worker thread hung"
    if errors:
        raise errors[0]


class InlineExecutor:
    """Runs a refill at once, on the caller's thread."""

    def submit(self, fn: Callable[[], None]) -> None:
        fn()


class ManualExecutor:
    """Holds refills until the test runs them: a query that is still running."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def submit(self, fn: Callable[[], None]) -> None:
        self.pending.append(fn)

    def run_pending(self) -> None:
        pending, self.pending = self.pending, []
        for fn in pending:
            fn()


class OverlappingRanges:
    """Like the write-up's SQL query: each batch starts ``overlap`` ids before the end of
    the previous one, up to ``total`` ids."""

    def __init__(self, total: int, overlap: int) -> None:
        self.total = total
        self.overlap = overlap
        self.high = 0  # one past the largest id returned so far
        self.calls = 0

    def get_next_batch(self, n: int) -> list[int]:
        self.calls += 1
        start = max(0, self.high - self.overlap)
        stop = min(start + n, self.total)
        self.high = max(self.high, stop)
        return list(range(start, stop))


class UnmigratedRows:
    """The write-up's query, ``SELECT id WHERE NOT migrated ORDER BY id LIMIT n``: it
    returns rows still queued, as nothing marks them until they are processed."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.migrated: set[int] = set()
        self.returned = 0

    def get_next_batch(self, n: int) -> list[int]:
        rows = (i for i in range(self.total) if i not in self.migrated)
        batch = list(itertools.islice(rows, n))
        self.returned += len(batch)
        return batch


class Counting:
    """Hands out ``prefix0, prefix1, ...`` with no end; counts calls and concurrency."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.next = 0
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()

    def get_next_batch(self, n: int) -> list[str]:
        with self.lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            start, self.next = self.next, self.next + n
        with self.lock:
            self.active -= 1
        return [f"{self.prefix}{i}" for i in range(start, start + n)]


class Blocking(Counting):
    """A slow source: each call blocks until the test sets ``release``."""

    def __init__(self, prefix: str = "") -> None:
        super().__init__(prefix)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def get_next_batch(self, n: int) -> list[str]:
        self.entered.set()
        self.release.wait(WAIT)
        batch = super().get_next_batch(n)
        self.returned.set()
        return batch


class FailsFirst(Counting):
    """Raises on its first call, then behaves."""

    def get_next_batch(self, n: int) -> list[str]:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            raise RuntimeError("database went away")
        return super().get_next_batch(n)


def replenish_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "timewheel-replenish"]


# --- SetQueue -------------------------------------------------------------------------


def test_setqueue_is_fifo() -> None:
    q: SetQueue[int] = SetQueue()
    assert [q.offer(i) for i in (3, 1, 2)] == [True, True, True]
    assert q.poll() == [3]
    assert q.poll(5) == [1, 2]
    assert q.poll() == [] and q.poll(3) == [] and q.poll(0) == []
    assert len(q) == 0


def test_duplicate_is_refused_and_keeps_its_place() -> None:
    q = SetQueue(["a", "b", "c"])
    assert q.offer("a") is False
    assert q.offer_all(["c", "d", "a", "d"]) == 1
    assert len(q) == 4 and "a" in q and "e" not in q
    assert q.poll(2) == ["a", "b"]
    assert "a" not in q
    assert q.offer("a") is True  # no longer queued: welcome back, at the end
    assert q.poll(10) == ["c", "d", "a"]


def test_setqueue_bad_input_names_it_and_changes_nothing() -> None:
    q = SetQueue([1, 2])
    with pytest.raises(TypeError, match=r"item must be hashable, got \[3\]"):
        q.offer([3])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"items must be an iterable .* got 5"):
        q.offer_all(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="items must be an iterable"):
        q.offer_all([7, [8], 9])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"n must be between 0 and .*, got -1"):
        q.poll(-1)
    with pytest.raises(TypeError, match="n must be an int, got '2'"):
        q.poll("2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"n must be an int, got 1.0 \(float\)"):
        q.poll(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"n must be an int, got True \(bool\)"):
        q.poll(True)
    assert len(q) == 2 and 7 not in q
    assert q.poll(5) == [1, 2]


def test_offer_all_rolls_back_when_an_items_eq_raises() -> None:
    class Touchy:
        def __hash__(self) -> int:
            return 1

        def __eq__(self, other: object) -> bool:
            raise RuntimeError("cannot compare")

    q = SetQueue([Touchy()])
    with pytest.raises(RuntimeError, match="cannot compare"):
        q.offer_all(["fine", Touchy()])
    assert len(q) == 1 and "fine" not in q


@dataclass(frozen=True)
class Key:
    """An item hashed by Python code, so the interpreter may switch threads mid-offer."""

    n: int


def test_concurrent_producers_queue_each_item_once(busy_switching: None) -> None:
    span = 1000
    singles = [Key(i) for i in range(span)]
    batches = [[Key(i) for i in range(start, start + 10)] for start in range(span, 2 * span, 10)]

    def producer(q: SetQueue[Key], accepted: list[int], reverse: bool) -> Callable[[], None]:
        def run() -> None:
            for item in reversed(singles) if reverse else singles:
                accepted.append(q.offer(item))  # list.append is atomic: threads may share it
            for batch in reversed(batches) if reverse else batches:
                accepted.append(q.offer_all(batch))

        return run

    for _ in range(4):  # races are rare: give them several chances
        q: SetQueue[Key] = SetQueue()
        accepted: list[int] = []
        run_threads(*(producer(q, accepted, k % 2 == 1) for k in range(4)))
        assert sum(accepted) == 2 * span  # each item accepted by exactly one producer
        everything = q.poll(10 * span)
        assert sorted(k.n for k in everything) == list(range(2 * span)) and len(q) == 0


def test_concurrent_consumers_take_each_item_once_in_order(busy_switching: None) -> None:
    q = SetQueue(range(5000))
    taken: list[list[int]] = [[] for _ in range(4)]

    def consumer(k: int) -> Callable[[], None]:
        def run() -> None:
            while batch := q.poll(1 + k * 3):  # mixes the single-item and batch paths
                taken[k].extend(batch)

        return run

    run_threads(*(consumer(k) for k in range(4)))
    for mine in taken:
        assert mine == sorted(mine)  # FIFO as seen by each consumer
    assert sorted(itertools.chain(*taken)) == list(range(5000))


def test_mixed_producers_and_consumers_deliver_what_was_accepted(busy_switching: None) -> None:
    q: SetQueue[int] = SetQueue()
    accepted: Counter[int] = Counter()
    delivered: Counter[int] = Counter()
    lock = threading.Lock()
    done = threading.Event()
    producers_left = [3]

    def producer() -> None:
        mine: Counter[int] = Counter(i % 300 for i in range(3000) if q.offer(i % 300))
        with lock:
            accepted.update(mine)
            producers_left[0] -= 1
            if not producers_left[0]:
                done.set()

    def consumer() -> None:
        mine: Counter[int] = Counter()
        while not done.is_set() or len(q):
            mine.update(q.poll(7))
        with lock:
            delivered.update(mine)

    run_threads(producer, producer, producer, consumer, consumer)
    # An item may come back after it was polled, but every accepted offer is delivered
    # exactly once, and nothing is delivered that was not accepted.
    assert delivered == accepted
    assert len(q) == 0


# --- QueueingSource -------------------------------------------------------------------


def test_queueing_source_validates_like_the_write_up() -> None:
    src = Counting()
    with pytest.raises(ValueError, match=r"capacity must be between 11 and .*, got 10"):
        QueueingSource(src, 10, 10)
    with pytest.raises(ValueError, match=r"replenish_threshold must be between 0 and .*, got -1"):
        QueueingSource(src, 10, -1)
    with pytest.raises(TypeError, match=r"capacity must be an int, got 2\.5"):
        QueueingSource(src, 2.5, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wrapped must have a get_next_batch"):
        QueueingSource(object(), 10, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="executor must have a submit"):
        QueueingSource(src, 10, 5, executor=object())  # type: ignore[arg-type]
    qs = QueueingSource(src, 10, 5, executor=InlineExecutor())
    with pytest.raises(ValueError, match=r"n must be between 0 and .*, got -3"):
        qs.get_next_batch(-3)
    assert src.calls == 0 and qs.metrics()["replenishes"] == 0


@pytest.mark.parametrize("refill_while_in_flight", [False, True])
def test_write_up_example_hands_out_nothing_twice_and_starves_nothing(
    refill_while_in_flight: bool,
) -> None:
    # Capacity 20, threshold 10: each refill's query returns the rows still queued
    # ("items 10-20 again") ahead of new ones. When a refill runs while a batch is
    # still being processed, it returns that batch too: dedup_in_flight covers that.
    query = UnmigratedRows(total=200)
    ex = InlineExecutor() if refill_while_in_flight else ManualExecutor()
    qs: QueueingSource[int] = QueueingSource(
        query, 20, 10, executor=ex, dedup_in_flight=refill_while_in_flight
    )
    handed_out: list[int] = []
    for _ in range(100):
        batch = qs.get_next_batch(4)
        handed_out += batch
        query.migrated.update(batch)
        qs.ack(batch)
        if isinstance(ex, ManualExecutor):
            ex.run_pending()  # the query finishes after the batch was processed
    assert handed_out == list(range(200))  # once each, in order: none left behind
    m = qs.metrics()
    assert m["duplicates_dropped"] == query.returned - 200 > 0
    assert m["queued"] == 0 and m["in_flight"] == 0 and m["errors"] == 0


@pytest.mark.parametrize("dedup_in_flight", [False, True])
def test_refill_returning_rows_still_in_flight(dedup_in_flight: bool) -> None:
    # The query is slow: by the time it returns, the consumer has taken everything,
    # including the 5 overlapping ids it returns again.
    query = OverlappingRanges(total=100, overlap=5)
    ex = ManualExecutor()
    qs: QueueingSource[int] = QueueingSource(
        query, 20, 10, executor=ex, dedup_in_flight=dedup_in_flight
    )
    qs.get_next_batch(1)
    ex.run_pending()
    first = qs.get_next_batch(12)  # down to 8 queued: a refill is submitted
    assert len(ex.pending) == 1
    first += qs.get_next_batch(20)
    assert first == list(range(20))
    ex.run_pending()  # asks for 20 and gets 15..34
    second = qs.get_next_batch(20)
    if dedup_in_flight:
        assert second == list(range(20, 35))
        assert qs.metrics()["in_flight"] == 35
        assert qs.ack(range(10)) == 10 and qs.ack([0, 99]) == 0
        assert qs.metrics()["in_flight"] == 25
    else:
        assert second == list(range(15, 35))  # 15..19 handed out a second time
        assert qs.ack(range(10)) == 0


def test_acked_items_may_come_back() -> None:
    class Again:
        def get_next_batch(self, n: int) -> list[str]:
            return ["x", "y"][:n]

    qs: QueueingSource[str] = QueueingSource(
        Again(), 4, 2, executor=InlineExecutor(), dedup_in_flight=True
    )
    qs.get_next_batch(0)
    assert qs.get_next_batch(2) == ["x", "y"]
    assert qs.get_next_batch(2) == []  # both in flight: the refill dropped them
    assert qs.ack(["x"]) == 1
    qs.get_next_batch(0)
    assert qs.get_next_batch(2) == ["x"]


def test_one_replenish_at_a_time_under_concurrent_callers(busy_switching: None) -> None:
    slow = Blocking()
    with QueueingSource(slow, 50, 25) as qs:
        assert qs.get_next_batch(5) == []
        assert slow.entered.wait(WAIT)

        def caller() -> None:
            for _ in range(200):
                assert qs.get_next_batch(3) == []

        run_threads(*([caller] * 4))
        assert slow.calls == 0 and not slow.returned.is_set()  # still the first refill
        slow.release.set()
        assert qs.wait_idle(WAIT)
        assert slow.calls == 1 and qs.metrics()["replenishes"] == 1

    fast = Counting()
    got: list[list[str]] = [[] for _ in range(4)]
    with QueueingSource(fast, 30, 10) as qs2:

        def consumer(k: int) -> Callable[[], None]:
            def run() -> None:
                while len(got[k]) < 300:
                    got[k] += qs2.get_next_batch(4)

            return run

        run_threads(*(consumer(k) for k in range(4)))
    assert fast.max_active == 1 and fast.calls > 10
    everything = list(itertools.chain(*got))
    assert len(everything) == len(set(everything))


def test_failed_replenish_is_logged_counted_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    src = FailsFirst()
    with QueueingSource(src, 10, 5) as qs:
        with caplog.at_level(logging.ERROR, logger="timewheel"):
            assert qs.get_next_batch(3) == []
            assert qs.wait_idle(WAIT)
        assert isinstance(qs.last_error, RuntimeError)
        assert qs.metrics()["errors"] == 1 and qs.metrics()["replenishes"] == 0
        [record] = [r for r in caplog.records if r.name.startswith("timewheel")]
        assert "replenish" in record.getMessage() and record.exc_info is not None
        assert qs.get_next_batch(3) == []  # tries again
        assert qs.wait_idle(WAIT)
        assert qs.get_next_batch(3) == ["0", "1", "2"]
        assert qs.metrics()["replenishes"] == 1 and qs.metrics()["errors"] == 1


def test_executor_that_refuses_work_does_not_wedge_the_source() -> None:
    class Refusing:
        def __init__(self) -> None:
            self.refuse = True

        def submit(self, fn: Callable[[], None]) -> None:
            if self.refuse:
                raise RuntimeError("cannot schedule new futures after shutdown")
            fn()

    ex = Refusing()
    qs: QueueingSource[str] = QueueingSource(Counting(), 10, 5, executor=ex)
    assert qs.get_next_batch(2) == []
    assert qs.metrics()["errors"] == 1 and isinstance(qs.last_error, RuntimeError)
    ex.refuse = False
    qs.get_next_batch(0)
    assert qs.get_next_batch(2) == ["0", "1"]


def test_threads_are_started_lazily_and_do_not_outlive_close() -> None:
    before = set(replenish_threads())
    src = Blocking()
    qs: QueueingSource[str] = QueueingSource(src, 10, 5)
    assert set(replenish_threads()) == before and not src.entered.is_set()
    qs.get_next_batch(1)
    assert src.entered.wait(WAIT)
    assert len(set(replenish_threads()) - before) == 1
    assert qs.close(timeout=0) is False  # the refill is still running
    src.release.set()
    assert qs.close(WAIT) is True
    for t in set(replenish_threads()) - before:
        t.join(WAIT)
        assert not t.is_alive()
    # Closed: queued items are still handed out, but nothing is fetched any more.
    assert qs.get_next_batch(10) == [str(i) for i in range(10)]
    assert qs.get_next_batch(10) == [] and src.calls == 1


def _fetch_in_child(conn: Any) -> None:
    with QueueingSource(Counting(), 10, 5) as qs:
        qs.get_next_batch(0)
        qs.wait_idle(WAIT)
        conn.send(qs.get_next_batch(3))
    conn.close()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_works_when_created_in_a_forked_worker() -> None:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_fetch_in_child, args=(child,))
    proc.start()
    assert parent.poll(WAIT)
    assert parent.recv() == ["0", "1", "2"]
    proc.join(WAIT)
    assert proc.exitcode == 0


# --- strategies -----------------------------------------------------------------------


class Recorder:
    """A fake ``take``: each source has ``available`` items; records (name, n) asks."""

    def __init__(self, available: dict[str, int]) -> None:
        self.available = dict(available)
        self.asks: list[tuple[str, int]] = []

    def __call__(self, name: str, n: int) -> int:
        self.asks.append((name, n))
        got = min(n, self.available[name])
        self.available[name] -= got
        return got


def test_fair_splits_evenly_and_rotates() -> None:
    fair = Fair()
    take = Recorder({"a": 100, "b": 100, "c": 100})
    fair.allocate(["a", "b", "c"], 10, take)
    fair.allocate(["a", "b", "c"], 10, take)
    assert take.asks == [("a", 4), ("b", 3), ("c", 3), ("b", 4), ("c", 3), ("a", 3)]


def test_fair_passes_what_a_source_cannot_fill_to_the_next() -> None:
    take = Recorder({"a": 1, "b": 0, "c": 100})
    Fair(["a", "b", "c"]).allocate(["a", "b", "c", "d"], 9, take)
    assert take.asks == [("a", 3), ("b", 3), ("c", 3), ("c", 5)]
    around = Recorder({"a": 100, "b": 100, "c": 0})
    Fair().allocate(["a", "b", "c"], 9, around)
    assert around.asks == [("a", 3), ("b", 3), ("c", 3), ("a", 2), ("b", 1)]
    small = Recorder({"a": 5, "b": 5})
    Fair().allocate(["a", "b"], 1, small)
    assert small.asks == [("a", 1)]


def test_prefer_then_fair() -> None:
    strategy = PreferThenFair("z", ["x", "y"])
    take = Recorder({"z": 100, "x": 100, "y": 100})
    strategy.allocate(["x", "y", "z"], 10, take)
    assert take.asks == [("z", 10)]
    take = Recorder({"z": 4, "x": 100, "y": 100})
    strategy.allocate(["x", "y", "z"], 10, take)
    assert take.asks == [("z", 10), ("x", 3), ("y", 3)]
    assert strategy.names() == ("z", "x", "y")


def test_strategy_validation() -> None:
    with pytest.raises(ValueError, match="must not also be in others"):
        PreferThenFair("x", ["x", "y"])
    with pytest.raises(TypeError, match="preferred must be a source name"):
        PreferThenFair(3, ["x"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="others must be a sequence"):
        PreferThenFair("z", "xy")
    with pytest.raises(ValueError, match="names must be distinct"):
        Fair(["a", "a"])


# --- Scheduler ------------------------------------------------------------------------


class Sink:
    """Records submissions; ``outstanding`` is submitted minus ``finish``-ed items."""

    def __init__(self, max_outstanding: int | None = None) -> None:
        self.max_outstanding = max_outstanding
        self.batches: list[tuple[str, list[Any]]] = []
        self.pending = 0
        self.total = 0
        self.peak = 0
        self.violations = 0
        self.lock = threading.Lock()
        self.fail_next = 0

    def outstanding(self) -> int:
        with self.lock:
            return self.pending

    def submit(self, source: str, items: list[Any]) -> None:
        with self.lock:
            if self.fail_next:
                self.fail_next -= 1
                raise ConnectionError("downstream unavailable")
            self.batches.append((source, items))
            self.pending += len(items)
            self.total += len(items)
            self.peak = max(self.peak, self.pending)
            if self.max_outstanding is not None and self.pending > self.max_outstanding:
                self.violations += 1

    def finish(self, n: int) -> None:
        with self.lock:
            self.pending -= min(n, self.pending)

    def delivered(self, source: str | None = None) -> list[Any]:
        with self.lock:
            return [i for s, items in self.batches if source in (None, s) for i in items]


def inline(source: Any, capacity: int = 40, threshold: int = 20) -> QueueingSource[Any]:
    return QueueingSource(source, capacity, threshold, executor=InlineExecutor())


def test_scheduler_validation() -> None:
    sink = Sink()
    ok = {"a": Counting()}
    with pytest.raises(ValueError, match=r"max_outstanding must be between 1 and .*, got 0"):
        Scheduler(ok, Fair(), sink, max_outstanding=0, batch_size=5)
    with pytest.raises(TypeError, match="batch_size must be an int, got None"):
        Scheduler(ok, Fair(), sink, max_outstanding=5, batch_size=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sources must be a non-empty mapping"):
        Scheduler({}, Fair(), sink, max_outstanding=5, batch_size=5)
    with pytest.raises(TypeError, match=r"sources\['b'\] has no get_next_batch"):
        Scheduler({"b": 1}, Fair(), sink, max_outstanding=5, batch_size=5)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="sink must have an outstanding"):
        Scheduler(ok, Fair(), object(), max_outstanding=5, batch_size=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown sources \['z'\]"):
        Scheduler(ok, PreferThenFair("z", ["a"]), sink, max_outstanding=5, batch_size=5)
    with Scheduler(ok, Fair(), sink, max_outstanding=5, batch_size=5) as scheduler:
        with pytest.raises(TypeError, match="strategy must be a SchedulingStrategy"):
            scheduler.strategy = "fair"  # type: ignore[assignment]
        assert isinstance(scheduler.strategy, Fair)


def test_scheduler_rounds_follow_the_strategy() -> None:
    sources = {"x": inline(Counting("x")), "y": inline(Counting("y")), "z": inline(Counting("z"))}
    sink = Sink()
    with Scheduler(sources, Fair(), sink, max_outstanding=1000, batch_size=9) as scheduler:
        assert scheduler.run_once() == 0  # queues were empty: refills ran
        assert scheduler.run_once() == 9  # the second round starts with the second source
        assert sink.batches == [("y", ["y0", "y1", "y2"]), ("z", ["z0", "z1", "z2"]),
                                ("x", ["x0", "x1", "x2"])]  # fmt: skip
        scheduler.strategy = PreferThenFair("z", ["x", "y"])
        assert scheduler.run_once() == 9
        assert sink.batches[-1] == ("z", [f"z{i}" for i in range(3, 12)])
        assert scheduler.metrics() == {"rounds": 3, "submitted": 18, "errors": 0}


def test_slow_source_does_not_stall_the_rounds() -> None:
    slow = Blocking("s")  # a plain source: the scheduler wraps it
    sink = Sink()
    sources = {"slow": slow, "a": inline(Counting("a")), "b": inline(Counting("b"))}
    with Scheduler(sources, Fair(), sink, max_outstanding=10_000, batch_size=6) as scheduler:
        try:
            scheduler.run_once()  # starts every refill; the slow one blocks in its query
            assert slow.entered.wait(WAIT)
            fed = [scheduler.run_once() for _ in range(20)]
            # All of that happened while the slow query was still blocked.
            assert not slow.returned.is_set()
        finally:
            slow.release.set()
        assert fed == [6] * 20
        assert len(sink.delivered("a")) == len(sink.delivered("b")) == 60
        assert sink.delivered("slow") == []
        assert scheduler.sources["slow"].wait_idle(WAIT)
        assert scheduler.run_once() == 6
        assert sink.delivered("slow") == ["s0", "s1"]


def test_failing_source_and_sink_are_logged_and_nothing_is_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def get_next_batch(self, n: int) -> list[str]:
            raise OSError("disk on fire")

    broken = inline(Counting("b"))
    broken.get_next_batch = Broken().get_next_batch  # type: ignore[method-assign]
    sink = Sink()
    sources = {"broken": broken, "ok": inline(Counting("k"))}
    with Scheduler(sources, Fair(), sink, max_outstanding=100, batch_size=4) as scheduler:
        with caplog.at_level(logging.ERROR, logger="timewheel"):
            assert scheduler.run_once() == 0  # "ok" refilled; "broken" raised
            assert scheduler.run_once() == 4  # "ok" also took the share "broken" left
            sink.fail_next = 1
            assert scheduler.run_once() == 0  # the sink refused ok's batch
            assert scheduler.run_once() == 4  # ...which goes first in the next round
        assert sink.delivered("ok") == [f"k{i}" for i in range(8)]
        assert scheduler.metrics()["errors"] == 4 + 1  # broken in every round, the sink once
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("timewheel")]
        assert sum("source 'broken' failed" in m for m in messages) == 4
        assert sum("sink.submit()" in m for m in messages) == 1


def test_back_pressure_bounds_outstanding() -> None:
    sink = Sink(max_outstanding=25)
    sources = {"a": inline(Counting("a")), "b": inline(Counting("b"))}
    with Scheduler(sources, Fair(), sink, max_outstanding=25, batch_size=10) as scheduler:
        scheduler.run_once()
        rounds = [scheduler.run_once() for _ in range(4)]
        assert rounds == [10, 10, 5, 0]  # full: nothing more until the sink drains
        sink.finish(7)
        assert scheduler.run_once() == 7
        for k in range(200):
            sink.finish(k % 13)
            scheduler.run_once()
            assert sink.outstanding() <= 25
    assert sink.peak == 25 and sink.violations == 0


def test_back_pressure_holds_with_a_concurrent_downstream() -> None:
    sink = Sink(max_outstanding=30)
    target = 500
    enough = threading.Event()
    stop = threading.Event()

    def downstream() -> None:
        while not enough.is_set():
            sink.finish(3)
            if sink.total >= target:
                enough.set()

    sources = {"a": Counting("a"), "b": Counting("b"), "c": Counting("c")}
    with Scheduler(sources, Fair(), sink, max_outstanding=30, batch_size=8) as scheduler:
        worker = threading.Thread(target=downstream)
        loop_result: list[int] = []
        loop = threading.Thread(
            target=lambda: loop_result.append(scheduler.run(stop, idle_wait=0.001))
        )
        worker.start()
        loop.start()
        assert enough.wait(30)
        stop.set()
        loop.join(WAIT)
        worker.join(WAIT)
        assert not loop.is_alive() and not worker.is_alive()
    assert sink.violations == 0 and sink.peak <= 30
    delivered = sink.delivered()
    assert loop_result == [len(delivered)] and len(delivered) >= target
    assert len(set(delivered)) == len(delivered)
