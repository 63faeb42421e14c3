"""The core benchmark: every contender runs its whole workload and the table reports it."""

from __future__ import annotations

from typing import Any

import pytest

from timewheel import implementation
from timewheel.cli.bench import core

PyTimingWheel = implementation("python").TimingWheel
CTimingWheel = implementation("cython").TimingWheel if implementation().name == "cython" else None


@pytest.mark.parametrize("cls", [PyTimingWheel, CTimingWheel], ids=["python", "cython"])
def test_schedule_cancel_pair_cancels_everything_it_scheduled(cls: Any) -> None:
    if cls is None:
        pytest.skip("the extension is not built")
    wheels: list[Any] = []

    def setup() -> core.Contender:
        w = cls(1, 20, 0)
        wheels.append(w)
        return w.schedule, "item", w.cancel, None

    core._pair(setup, [5, 1, 5, 300])()()
    [w] = wheels
    assert len(w) == 0 and w.advance(1_000) == []


def test_dict_floor_cancels_by_key_and_asyncio_closes_its_loop() -> None:
    tables: list[dict[int, Any]] = []

    def setup() -> core.Contender:
        schedule, item, cancel, close = core._dict_setup()
        tables.append(schedule.__self__)  # type: ignore[attr-defined]
        return schedule, item, cancel, close

    core._pair(setup, [3, 1, 2], cancel_by_key=True)()()
    assert tables == [{}]
    closes: list[Any] = []

    def asyncio_setup() -> core.Contender:
        contender = core._asyncio_setup()
        closes.append(contender[3].__self__)  # type: ignore[union-attr]
        return contender

    core._pair(asyncio_setup, [1, 2])()()
    assert closes[0].is_closed()


def test_run_core_bench_reports_every_contender_against_the_base() -> None:
    rows = core.run_core_bench(n=300, repeat=1)
    names = {(r["case"], r["name"]) for r in rows}
    assert names == {(case, name) for case, name, _ in core.build_cases(300)}
    base = core.EXT if CTimingWheel is not None else core.PURE
    assert all(r["ratio"] == 1.0 for r in rows if r["name"] == base)
    assert all(r["ns_per_timer"] > 0 for r in rows)
    assert "ratio = contender's time" in core.format_table(rows)
