"""ResourceManager: all or nothing under threads, lost wake-ups, loads once, pause, bad input."""

from __future__ import annotations

import logging
import math
import queue
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import CancelledError
from typing import Any

import pytest

from timewheel.purgatory import Purgatory
from timewheel.resources import Checkout, ResourceManager, _Entry, _global_order, _Stripe
from timewheel.timer import ManualClock, Timer

WAIT = 10.0  # seconds: an upper bound for things that should happen at once, never a delay


@pytest.fixture
def manager() -> Iterator[ResourceManager]:
    with ResourceManager() as rm:
        yield rm


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def manual(clock: ManualClock) -> Iterator[tuple[ResourceManager, Purgatory]]:
    """A manager whose timeouts move only with the ManualClock (no reaper thread)."""
    purgatory = Purgatory(timer=Timer(clock=clock), reaper=False)
    with purgatory, ResourceManager(purgatory=purgatory) as rm:
        yield rm, purgatory


def assert_all_free(rm: ResourceManager, keys: list[Hashable]) -> None:
    """Nothing is left marked: every key can be taken at once, without waiting (but for
    the loads of keys not resident, which run on the loader threads)."""
    m = rm.metrics()
    assert (m["checked_out"], m["waiting"]) == (0, 0)
    loads = rm._loader is not None
    everything = rm.checkout(keys, timeout_ms=None if loads else 0)
    assert loads or everything.done()
    everything.result(WAIT)
    assert not everything.cancelled()
    rm.checkin(everything)


# -- basics -----------------------------------------------------------------------------
def test_checkout_returns_keys_without_loader_and_objects_with_one() -> None:
    with ResourceManager() as rm:
        c = rm.checkout(["b", "a"])
        assert c.done() and c.result(0) == ("b", "a") and c.keys == ("b", "a")
        assert rm.metrics()["checked_out"] == 1
        rm.checkin(c)
    with ResourceManager(loader=lambda key: f"object {key}") as rm:
        c = rm.checkout([2, 1])
        assert c.result(WAIT) == {2: "object 2", 1: "object 1"}
        assert rm.metrics()["loads"] == 2
        rm.checkin(c)


def test_all_or_nothing_other_keys_go_on_while_a_request_waits(manager: ResourceManager) -> None:
    holder = manager.checkout(["a"])
    waiting = manager.checkout(["a", "b"])
    assert not waiting.done() and manager.metrics()["waiting"] == 1
    # b was rolled back when a was found busy, so others can have it meanwhile.
    other = manager.checkout(["b"], timeout_ms=0)
    assert other.result(0) == ("b",)
    furnished = threading.Event()
    waiting.add_done_callback(lambda c: furnished.set())
    manager.checkin(holder)
    assert not furnished.is_set(), "furnished while b was still checked out"
    manager.checkin(other)
    assert furnished.wait(WAIT) and waiting.result(0) == ("a", "b")
    manager.checkin(waiting)
    assert_all_free(manager, ["a", "b"])


def test_checkin_twice_foreign_or_pending_is_a_clear_error(manager: ResourceManager) -> None:
    c = manager.checkout(["k"])
    manager.checkin(c)
    with pytest.raises(ValueError, match="checked in"):
        manager.checkin(c)
    with pytest.raises(RuntimeError, match="already checked in"):
        c.result(0)
    with ResourceManager() as other:
        foreign = other.checkout(["k"])
        with pytest.raises(ValueError, match="another ResourceManager"):
            manager.checkin(foreign)
        assert other.metrics()["checked_out"] == 1
        other.checkin(foreign)
    holder = manager.checkout(["k"])
    pending = manager.checkout(["k"])
    with pytest.raises(ValueError, match="pending"):
        manager.checkin(pending)
    with pytest.raises(TypeError, match="must be a Checkout"):
        manager.checkin(["k"])  # type: ignore[arg-type]
    pending.cancel()
    manager.checkin(holder)
    assert_all_free(manager, ["k"])


def test_cancel_withdraws_a_waiting_request(manager: ResourceManager) -> None:
    holder = manager.checkout(["k"])
    pending = manager.checkout(["k"])
    assert pending.cancel() and pending.cancelled() and not pending.cancel()
    with pytest.raises(CancelledError):
        pending.result(0)
    manager.checkin(holder)
    assert manager.metrics()["waiting"] == 0
    assert not holder.cancel(), "a checkout no longer waiting cannot be cancelled"
    assert_all_free(manager, ["k"])


def test_result_timeout_leaves_the_request_waiting(manager: ResourceManager) -> None:
    holder = manager.checkout(["k"])
    pending = manager.checkout(["k"])
    with pytest.raises(TimeoutError, match="still waiting"):
        pending.result(0.01)
    manager.checkin(holder)
    assert pending.result(WAIT) == ("k",)
    manager.checkin(pending)


def test_checkout_timeout_follows_the_purgatory_clock(
    manual: tuple[ResourceManager, Purgatory], clock: ManualClock
) -> None:
    rm, purgatory = manual
    holder = rm.checkout(["a"])
    pending = rm.checkout(["b", "a"], timeout_ms=10)
    clock.advance(9)
    purgatory.advance_clock(0)
    assert not pending.done()
    clock.advance(1)
    purgatory.advance_clock(0)
    with pytest.raises(TimeoutError, match="within 10 ms"):
        pending.result(0)
    assert rm.metrics()["timeouts"] == 1 and rm.metrics()["waiting"] == 0
    assert rm.checkout(["b"], timeout_ms=0).done(), "a timed-out request must hold nothing"
    once = rm.checkout(["a"], timeout_ms=0)
    with pytest.raises(TimeoutError):
        once.result(0)
    rm.checkin(holder)


def test_done_callbacks_run_once_and_a_raising_one_is_logged_and_counted(
    manager: ResourceManager, caplog: pytest.LogCaptureFixture
) -> None:
    holder = manager.checkout(["k"])
    pending = manager.checkout(["k"])
    seen: list[Checkout] = []

    def bad(c: Checkout) -> None:
        raise RuntimeError("callback failed")

    pending.add_done_callback(bad)
    pending.add_done_callback(seen.append)
    with caplog.at_level(logging.ERROR, logger="timewheel"):
        manager.checkin(holder)
    assert seen == [pending] and pending.done()
    assert manager.metrics()["callback_errors"] == 1
    assert any(r.exc_info and "callback failed" in str(r.exc_info[1]) for r in caplog.records)
    late: list[Checkout] = []
    pending.add_done_callback(late.append)
    assert late == [pending], "a callback added when done runs at once"
    manager.checkin(pending)


def test_a_base_exception_from_a_woken_request_leaves_checkin_bookkeeping_whole(
    manager: ResourceManager,
) -> None:
    holder = manager.checkout([1, 2])
    exits = manager.checkout([1])
    other = manager.checkout([2])

    def leave(c: Checkout) -> None:
        raise SystemExit("callback exits")

    exits.add_done_callback(leave)
    with pytest.raises(SystemExit, match="callback exits"):
        manager.checkin(holder)
    assert other.result(WAIT) == (2,), "a request parked on the next key is woken too"
    assert exits.result(0) == (1,)
    assert manager.metrics()["checked_out"] == 2, "the checked-in request is no longer counted"
    manager.checkin(exits)
    manager.checkin(other)
    with manager.pause(timeout=WAIT):
        pass
    assert_all_free(manager, [1, 2])


def test_evict_drops_only_idle_resident_objects() -> None:
    loads: Counter[Hashable] = Counter()

    def loader(key: Hashable) -> Hashable:
        loads[key] += 1
        return key

    with ResourceManager(loader=loader) as rm:
        c = rm.checkout(["x"])
        c.result(WAIT)
        assert not rm.evict("x"), "a checked-out key must not be evicted"
        rm.checkin(c)
        assert rm.evict("x") and not rm.evict("x") and not rm.evict("never loaded")
        again = rm.checkout(["x"])
        again.result(WAIT)
        rm.checkin(again)
        assert loads["x"] == 2


# -- global order -----------------------------------------------------------------------
def test_global_order_is_the_same_whatever_the_input_order() -> None:
    keys: list[Hashable] = [-1, -2, "a", b"a", (1, "x"), 3.5, None, frozenset({1})]
    assert hash(-1) == hash(-2)  # the tie the order must break
    first = _global_order(keys)
    rng = random.Random(7)
    for _ in range(20):
        shuffled = keys[:]
        rng.shuffle(shuffled)
        assert _global_order(shuffled) == first
    assert sorted(first, key=repr) == sorted(keys, key=repr)


# -- the lost wake-up -------------------------------------------------------------------
class HeldBeforeParking(ResourceManager):
    """Stops a request between finding a key busy and parking on it, until told to go on."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at_park = threading.Event()
        self.go_on = threading.Event()
        self.hold_next = False

    def _park(
        self, checkout: Checkout, entry: _Entry | None, stripe: _Stripe | None, delay: int
    ) -> None:
        if self.hold_next:
            self.hold_next = False
            self.at_park.set()
            assert self.go_on.wait(WAIT)
        super()._park(checkout, entry, stripe, delay)


def test_key_checked_in_between_busy_and_parked_still_furnishes_the_request() -> None:
    with HeldBeforeParking() as rm:
        holder = rm.checkout(["a", "b"])
        rm.hold_next = True
        got: list[Checkout] = []
        t = threading.Thread(target=lambda: got.append(rm.checkout(["b", "c"])))
        t.start()
        assert rm.at_park.wait(WAIT)
        # The request saw b busy and is not yet listed on it: this checkin finds nobody to wake.
        rm.checkin(holder)
        rm.go_on.set()
        t.join(WAIT)
        assert got and got[0].result(WAIT) == ("b", "c")
        rm.checkin(got[0])
        assert_all_free(rm, ["a", "b", "c"])


def test_resume_between_paused_and_parked_still_lets_the_request_go() -> None:
    with HeldBeforeParking() as rm:
        rm.pause()
        rm.hold_next = True
        got: list[Checkout] = []
        t = threading.Thread(target=lambda: got.append(rm.checkout(["k"])))
        t.start()
        assert rm.at_park.wait(WAIT)
        rm.resume()
        rm.go_on.set()
        t.join(WAIT)
        assert got and got[0].result(WAIT) == ("k",)
        rm.checkin(got[0])


# -- loading ----------------------------------------------------------------------------
class GatedLoader:
    """A slow loader: each call records its thread and key, then waits until released."""

    def __init__(self, fail: set[Hashable] | None = None) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail = fail or set()
        self.calls: list[tuple[Hashable, threading.Thread]] = []
        self.called = threading.Condition()

    def __call__(self, key: Hashable) -> str:
        with self.called:
            self.calls.append((key, threading.current_thread()))
            self.called.notify_all()
        self.started.set()
        assert self.release.wait(WAIT)
        if key in self.fail:
            raise OSError(f"cannot read {key}")
        return f"object {key}"

    def wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Whether ``done()`` became true within ``timeout``, asked at each call begun."""
        with self.called:
            return self.called.wait_for(done, timeout)


def test_checkout_returns_at_once_while_a_slow_loader_runs_on_its_own_thread() -> None:
    loader = GatedLoader()
    with ResourceManager(loader=loader) as rm:
        c = rm.checkout(["x"])
        # The caller is back before the load finished: the loader still waits on release.
        assert not c.done() and loader.started.wait(WAIT)
        assert [(k, t is threading.current_thread()) for k, t in loader.calls] == [("x", False)]
        assert loader.calls[0][1].name.startswith("timewheel-loader")
        assert rm.metrics()["waiting"] == 1
        loader.release.set()
        assert c.result(WAIT) == {"x": "object x"}
        rm.checkin(c)
        assert_all_free(rm, ["x"])


def test_the_missing_keys_of_one_request_load_side_by_side() -> None:
    loader = GatedLoader()
    both = threading.Barrier(3)
    with ResourceManager(loader=lambda key: (both.wait(WAIT), loader(key))[1]) as rm:
        # The barrier lets no load go on until three loader threads wait at it: one at a
        # time, the first would break it after WAIT and the checkout would fail.
        c = rm.checkout(["x", "y", "z"])
        assert not c.done()
        loader.release.set()
        assert c.result(WAIT) == {k: f"object {k}" for k in "xyz"}
        assert sorted(k for k, _ in loader.calls) == ["x", "y", "z"]
        assert len({t for _, t in loader.calls}) == 3
        rm.checkin(c)
        assert_all_free(rm, ["x", "y", "z"])


def test_a_key_is_loaded_once_however_many_requests_want_it() -> None:
    loader = GatedLoader()
    with ResourceManager(loader=loader) as rm:
        requests = [rm.checkout(["x"]) for _ in range(8)]
        assert loader.started.wait(WAIT)
        # The marker is busy while the first request's load runs: all of them park on it.
        assert not any(c.done() for c in requests) and rm.metrics()["waiting"] == 8
        furnished: queue.Queue[Checkout] = queue.Queue()
        for c in requests:
            c.add_done_callback(furnished.put)
        loader.release.set()
        for _ in requests:
            ready = furnished.get(timeout=WAIT)
            # One at a time: each checkin furnishes the next request, in the checkin itself.
            assert [c for c in requests if c.done()] == [ready]
            assert ready.result(0) == {"x": "object x"}
            requests.remove(ready)
            rm.checkin(ready)
        assert [k for k, _ in loader.calls] == ["x"]


def test_a_request_timing_out_while_its_key_loads_comes_back_timed_out_and_the_load_stays(
    manual: tuple[ResourceManager, Purgatory], clock: ManualClock
) -> None:
    loader = GatedLoader()
    purgatory = manual[1]
    with ResourceManager(loader=loader, purgatory=purgatory) as rm:
        short = rm.checkout(["x"], timeout_ms=10)
        patient = rm.checkout(["x"])
        assert loader.started.wait(WAIT)
        clock.advance(10)
        purgatory.advance_clock(0)
        with pytest.raises(TimeoutError, match="within 10 ms"):
            short.result(0)
        assert not patient.done() and rm.metrics()["timeouts"] == 1
        loader.release.set()
        assert patient.result(WAIT) == {"x": "object x"}
        rm.checkin(patient)
        # The load the timed-out request started still made x resident.
        again = rm.checkout(["x"], timeout_ms=0)
        assert again.result(0) == {"x": "object x"}
        rm.checkin(again)
        assert [k for k, _ in loader.calls] == ["x"]


def test_close_while_a_key_loads_fails_its_waiters_and_the_loader_thread_exits() -> None:
    loader = GatedLoader()
    rm = ResourceManager(loader=loader)
    waiting = rm.checkout(["x"])
    assert loader.started.wait(WAIT)
    rm.close()
    with pytest.raises(RuntimeError, match="closed"):
        waiting.result(0)
    loader.release.set()
    thread = loader.calls[0][1]
    thread.join(WAIT)
    assert not thread.is_alive(), "the loader thread outlived close() and its load"


def test_concurrent_loads_happen_once_per_key() -> None:
    loads: Counter[Hashable] = Counter()
    lock = threading.Lock()

    def loader(key: Hashable) -> str:
        with lock:
            loads[key] += 1
        return f"object {key}"

    keys = list(range(20))
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait()
        try:
            for _ in range(100):
                c = rm.checkout(rng.sample(keys, rng.randint(1, 4)), timeout_ms=5000)
                values = c.result(WAIT)
                assert all(values[k] == f"object {k}" for k in c.keys)
                rm.checkin(c)
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)

    with ResourceManager(loader=loader) as rm:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert set(loads.values()) == {1}
        assert rm.metrics()["loads"] == len(loads)
        assert_all_free(rm, keys)


def test_a_failing_load_fails_exactly_its_waiters_logs_and_leaves_nothing_marked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = GatedLoader(fail={"x"})
    with ResourceManager(loader=loader) as rm, caplog.at_level(logging.ERROR, logger="timewheel"):
        loader.release.set()
        warm = rm.checkout(["a", "b"])
        assert warm.result(WAIT) == {"a": "object a", "b": "object b"}
        rm.checkin(warm)
        other = rm.checkout(["c"])
        assert other.result(WAIT) == {"c": "object c"}
        # From here on every request waits on x's one load (a, b and c are resident).
        loader.release.clear()
        loader.started.clear()
        waiters = [rm.checkout(["a", "x"]), rm.checkout(["x", "b"]), rm.checkout(["x"])]
        bystander = rm.checkout(["c", "d"])  # waits on c, which is checked out, not on x
        assert loader.started.wait(WAIT)
        assert not any(c.done() for c in [*waiters, bystander])
        loader.release.set()
        for c in waiters:
            with pytest.raises(OSError, match="cannot read x"):
                c.result(WAIT)
        assert not bystander.done(), "a request not waiting on x failed with x's load"
        # Each load is counted when begun and in loader.calls once a loader thread calls it
        # (d's, begun while the bystander waits on c, may be between the two): every load
        # counted is one call of the loader, x's one load among them.
        assert loader.wait_until(lambda: len(loader.calls) == rm.metrics()["loads"], WAIT)
        assert Counter(k for k, _ in loader.calls)["x"] == 1
        m = rm.metrics()
        assert (m["load_errors"], m["checked_out"], m["waiting"]) == (1, 1, 1)
        assert any("raised for key 'x'" in r.getMessage() for r in caplog.records)
        rm.checkin(other)
        assert bystander.result(WAIT) == {"c": "object c", "d": "object d"}
        rm.checkin(bystander)
        loader.fail.clear()
        again = rm.checkout(["x", "a", "b"])
        assert again.result(WAIT) == {"x": "object x", "a": "object a", "b": "object b"}
        rm.checkin(again)
        assert_all_free(rm, ["a", "b", "c", "d", "x"])


# -- pause ------------------------------------------------------------------------------
class SignalsDraining(ResourceManager):
    """Tells the test when pause() has raised the flag and starts waiting for checkins."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.draining = threading.Event()

    def _wait_drained(self, timeout: float | None) -> bool:
        self.draining.set()
        return super()._wait_drained(timeout)


def test_pause_waits_for_outstanding_checkouts_and_holds_new_ones() -> None:
    with SignalsDraining() as rm:
        out = rm.checkout(["a"])
        state_when_paused: list[bool] = []

        def pauser() -> None:
            rm.pause()
            state_when_paused.append(out.done() and rm.metrics()["checked_out"] == 0)

        t = threading.Thread(target=pauser)
        t.start()
        assert rm.draining.wait(WAIT)
        held_back = rm.checkout(["b"])
        assert not held_back.done(), "a new checkout must wait while paused"
        rm.checkin(out)
        t.join(WAIT)
        assert state_when_paused == [True], "pause returned before the checkout came back"
        assert not held_back.done()
        rm.resume()
        assert held_back.result(WAIT) == ("b",)
        rm.checkin(held_back)


def test_pause_context_manager_timeouts_while_paused(
    manual: tuple[ResourceManager, Purgatory], clock: ManualClock
) -> None:
    rm, purgatory = manual
    with rm.pause() as same:
        assert same is rm and rm.paused
        short = rm.checkout(["a"], timeout_ms=5)
        long = rm.checkout(["a"], timeout_ms=50)
        clock.advance(5)
        purgatory.advance_clock(0)
        with pytest.raises(TimeoutError):
            short.result(0)
        assert not long.done()
    assert not rm.paused
    assert long.result(WAIT) == ("a",)
    rm.checkin(long)
    assert rm.metrics()["timeouts"] == 1


def test_pause_with_a_timeout_gives_up_and_resumes(manager: ResourceManager) -> None:
    out = manager.checkout(["a"])
    with pytest.raises(TimeoutError, match="still out"):
        manager.pause(timeout=0.01)
    assert not manager.paused
    after = manager.checkout(["b"], timeout_ms=0)
    assert after.done(), "a pause that gave up must not hold checkouts back"
    with pytest.raises(RuntimeError, match="not paused"):
        manager.resume()
    manager.checkin(out)
    manager.checkin(after)
    manager.pause()
    with pytest.raises(RuntimeError, match="already paused"):
        manager.pause()
    manager.resume()


@pytest.mark.parametrize("forever", [math.inf, 2**70, 1e300, threading.TIMEOUT_MAX * 2])
def test_pause_with_a_timeout_too_long_for_the_os_waits_without_limit(forever: float) -> None:
    with SignalsDraining() as rm:
        out = rm.checkout(["a"])
        returned: list[bool] = []
        t = threading.Thread(target=lambda: returned.append(rm.pause(timeout=forever) is not None))
        t.start()
        assert rm.draining.wait(WAIT)
        assert rm.paused and not returned
        rm.checkin(out)
        t.join(WAIT)
        assert returned == [True] and rm.paused
        rm.resume()
        assert not rm.paused
        rm.checkin(rm.checkout(["a"], timeout_ms=0))


@pytest.mark.parametrize(
    ("timeout", "error"), [(math.nan, ValueError), (-math.inf, ValueError), (True, TypeError)]
)
def test_pause_with_a_bad_timeout_changes_nothing(
    manager: ResourceManager, timeout: Any, error: type
) -> None:
    with pytest.raises(error, match="timeout must be"):
        manager.pause(timeout=timeout)
    assert not manager.paused
    with manager.pause(timeout=WAIT):
        assert manager.paused


# -- stress -----------------------------------------------------------------------------
@pytest.fixture
def fine_switching() -> Iterator[None]:
    """Switch threads every few microseconds so that checkouts really interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("fine_switching")
@pytest.mark.parametrize("with_loader", [False, True], ids=["marks", "loads+evictions"])
def test_stress_no_key_held_twice_no_deadlock_nothing_left_marked(with_loader: bool) -> None:
    keys = list(range(50))
    held: set[Hashable] = set()
    held_lock = threading.Lock()
    overlaps: list[Hashable] = []
    outcomes: Counter[str] = Counter()
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait()
        try:
            for _ in range(500):
                c = rm.checkout(
                    rng.sample(keys, rng.randint(1, 4)), timeout_ms=rng.choice([0, 50, None])
                )
                if not c.done():
                    with held_lock:
                        outcomes["waited"] += 1
                try:
                    c.result(WAIT)
                except TimeoutError:
                    assert c.done(), "a request neither furnished nor timed out"
                    with held_lock:
                        outcomes["timed out"] += 1
                    continue
                with held_lock:
                    overlaps.extend(k for k in c.keys if k in held)
                    held.update(c.keys)
                    outcomes["held"] += 1
                # Holding briefly: give the other threads the GIL while we hold.
                threading.Event().wait(0)
                with held_lock:
                    held.difference_update(c.keys)
                rm.checkin(c)
                if with_loader and rng.random() < 0.2:
                    rm.evict(rng.choice(keys))
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)

    loader = (lambda key: key) if with_loader else None
    with ResourceManager(loader=loader) as rm:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "deadlock: a worker never finished"
        assert not errors, errors
        assert not overlaps, f"keys held twice: {overlaps[:10]}"
        assert outcomes["held"] + outcomes["timed out"] == 8 * 500
        assert outcomes["held"] > 0 and outcomes["waited"] > 0, outcomes
        assert rm.metrics()["timeouts"] == outcomes["timed out"]
        # Every rollback, parking and checkin left the pause gate's count it entered:
        # a count left behind would make this pause time out.
        rm.pause(timeout=WAIT)
        rm.resume()
        assert_all_free(rm, keys)


# -- bad input --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("keys", "timeout_ms", "error", "match"),
    [
        ([], None, ValueError, "keys must not be empty"),
        ([[1]], None, TypeError, "keys must be hashable"),
        ("ab", None, TypeError, "not a single str"),
        (5, None, TypeError, "iterable of hashable keys"),
        ([1, 1], None, ValueError, "distinct"),
        ([1], -1, ValueError, "timeout_ms must be between 0"),
        ([1], 1.5, TypeError, "timeout_ms must be an int"),
        ([1], True, TypeError, "timeout_ms must be an int"),
    ],
)
def test_bad_checkout_input_raises_and_changes_nothing(
    manager: ResourceManager, keys: Any, timeout_ms: Any, error: type, match: str
) -> None:
    before = manager.metrics()
    with pytest.raises(error, match=match):
        manager.checkout(keys, timeout_ms)
    assert manager.metrics() == before
    assert_all_free(manager, [1])


def test_bad_constructor_and_call_arguments(manager: ResourceManager) -> None:
    with pytest.raises(TypeError, match="loader must be callable"):
        ResourceManager(loader=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="purgatory must be a Purgatory"):
        ResourceManager(purgatory=object())  # type: ignore[arg-type]
    c = manager.checkout(["k"])
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        c.result(-1)
    with pytest.raises(TypeError, match="timeout must be None or a number of seconds"):
        c.result("soon")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn must be callable"):
        c.add_done_callback(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key must be hashable"):
        manager.evict([1])
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        manager.pause(timeout=-1)
    assert not manager.paused
    manager.checkin(c)


def test_close_fails_waiting_requests_and_refuses_new_ones() -> None:
    rm = ResourceManager()
    holder = rm.checkout(["k"])
    pending = rm.checkout(["k"])
    rm.close()
    with pytest.raises(RuntimeError, match="closed"):
        pending.result(0)
    with pytest.raises(RuntimeError, match="closed"):
        rm.checkout(["j"])
    rm.checkin(holder)
