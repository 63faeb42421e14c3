"""timewheel.aio's purgatory: operations awaited on the loop, completed from any thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from test_aio import VirtualLoop, new_loop
from timewheel import Implementation


# Real clocks only: the virtual clock would jump to the timeouts while other threads work.
@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoop]:
    lp = new_loop(request.param)
    yield lp
    if not lp.is_closed():
        lp.close()


@pytest.fixture
def classes(implementation_: Implementation) -> tuple[type[Any], type[Any]]:
    return implementation_.AioDelayedOperation, implementation_.AioPurgatory


def make_op_class(base: type[Any]) -> type[Any]:
    class Op(base):  # type: ignore[misc]
        def __init__(self, delay_ms: int) -> None:
            super().__init__(delay_ms)
            self.ready = False
            self.log: list[str] = []

        def try_complete(self) -> bool:
            return bool(self.ready and self.force_complete())

        def on_complete(self) -> None:
            self.log.append("complete")

        def on_expiration(self) -> None:
            self.log.append("expired")

    return Op


def test_completed_by_key_on_the_loop(
    classes: tuple[type[Any], type[Any]], loop: asyncio.AbstractEventLoop
) -> None:
    Op = make_op_class(classes[0])

    async def main() -> None:
        purgatory = classes[1]("p")
        op = Op(10_000)
        assert purgatory.watch(op, ("a", "b")) is False
        assert purgatory.delayed == 1 and purgatory.watched == 1
        assert purgatory.check_and_complete("a") == 0  # not ready yet
        op.ready = True
        assert purgatory.check_and_complete("b") == 1
        assert await op is True
        assert op.log == ["complete"] and op.is_completed
        assert purgatory.delayed == 0 and len(purgatory._timer) == 0

    loop.run_until_complete(main())


def test_expires_through_the_loops_wheel(
    classes: tuple[type[Any], type[Any]], vloop: VirtualLoop
) -> None:
    Op = make_op_class(classes[0])

    async def main() -> float:
        purgatory = classes[1]("p")
        op = Op(2_500)
        start = vloop.time()
        purgatory.watch(op, ["k"])
        assert await op is False
        assert op.log == ["complete", "expired"]
        assert purgatory.delayed == 0
        assert purgatory.check_and_complete("k") == 0
        return vloop.time() - start

    took = vloop.run_until_complete(main())
    assert 2.5 <= took <= 2.502


def test_completed_at_once_and_bad_input(
    classes: tuple[type[Any], type[Any]], vloop: VirtualLoop
) -> None:
    Op = make_op_class(classes[0])

    async def main() -> None:
        purgatory = classes[1]("p")
        op = Op(1000)
        op.ready = True
        assert purgatory.watch(op, ["k"]) is True
        assert await op is True and purgatory.delayed == 0
        with pytest.raises(ValueError, match="already"):
            purgatory.watch(op, ["k"])
        with pytest.raises(TypeError, match="op"):
            purgatory.watch(object(), ["k"])
        fresh = Op(1000)
        with pytest.raises(RuntimeError, match="watch"):
            await fresh
        with pytest.raises(TypeError):
            purgatory.watch(fresh, [["unhashable"]])
        assert purgatory.delayed == 0 and purgatory.watch(fresh, ["k"]) is False
        fresh.ready = True
        assert purgatory.check_and_complete("k") == 1 and await fresh is True
        with pytest.raises((TypeError, ValueError), match="shards"):
            classes[1]("p", shards=3)

    vloop.run_until_complete(main())


def test_completed_from_other_threads(
    classes: tuple[type[Any], type[Any]], loop: asyncio.AbstractEventLoop
) -> None:
    Op = make_op_class(classes[0])
    n = 200

    async def main() -> None:
        purgatory = classes[1]("p")
        ops = [Op(60_000) for _ in range(n)]
        for i, op in enumerate(ops):
            purgatory.watch(op, [i % 7])
        for op in ops:
            op.ready = True

        def complete(keys: range) -> None:
            for k in keys:
                purgatory.check_and_complete(k)

        threads = [threading.Thread(target=complete, args=(range(j, 7, 2),)) for j in (0, 1)]
        for t in threads:
            t.start()
        results = await asyncio.gather(*ops)
        for t in threads:
            t.join(30)
        assert results == [True] * n
        assert all(op.log == ["complete"] for op in ops)
        await asyncio.sleep(0)  # the cancels posted to the loop run
        assert purgatory.delayed == 0 and len(purgatory._timer) == 0

    loop.run_until_complete(main())


def test_a_completion_racing_the_timeout_has_one_outcome(
    classes: tuple[type[Any], type[Any]], loop: asyncio.AbstractEventLoop
) -> None:
    Op = make_op_class(classes[0])
    n = 300

    async def main() -> None:
        purgatory = classes[1]("p")
        ops = [Op(1 + i % 5) for i in range(n)]  # timeouts of 1-5 ms
        for i, op in enumerate(ops):
            purgatory.watch(op, [i])
            op.ready = True

        def complete() -> None:
            for i in range(n):
                purgatory.check_and_complete(i)

        t = threading.Thread(target=complete)
        t.start()
        results = await asyncio.gather(*ops)
        t.join(30)
        for op, completed in zip(ops, results):
            assert op.log == (["complete"] if completed else ["complete", "expired"])

    loop.run_until_complete(main())


def test_shutdown_returns_what_never_completed(
    classes: tuple[type[Any], type[Any]], vloop: VirtualLoop
) -> None:
    Op = make_op_class(classes[0])

    async def main() -> None:
        purgatory = classes[1]("p")
        ops = [Op(60_000) for _ in range(3)]
        for op in ops:
            purgatory.watch(op, ["k"])
        left = purgatory.shutdown()
        assert sorted(map(id, left)) == sorted(map(id, ops))
        assert len(purgatory._timer) == 0
        for op in ops:
            with pytest.raises(asyncio.CancelledError):
                await op
        with pytest.raises(RuntimeError, match="shut down"):
            purgatory.watch(Op(1), ["k"])

    vloop.run_until_complete(main())


@pytest.fixture
def vloop() -> Iterator[VirtualLoop]:
    lp = VirtualLoop()
    yield lp
    if not lp.is_closed():
        lp.close()
