"""Batches (issue 34): settings, bodies, keys, the accumulator, the reply split and the
isolation of bad rows. Pure Python: no Spark, no network."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from timewheel.spark.batch.accumulator import Accumulator
from timewheel.spark.batch.isolation import (
    ANSWERED,
    REFUSED,
    RETRY,
    SPLIT,
    Final,
    Isolation,
    Part,
    plan_for_status,
)
from timewheel.spark.batch.replies import ReplySplit, RowAnswer
from timewheel.spark.batch.run import AFTER_BACKOFF, NOTHING, NOW, BatchRun, RowEnd
from timewheel.spark.batch.spec import (
    MAX_BATCH_LINGER_MS,
    MAX_BATCH_SIZE,
    BatchBody,
    Batching,
    batch_deadline,
    batch_key,
)
from timewheel.spark.targets import Failure, Reply


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- settings -------------------------------------------------------------------------------
def test_settings_taken() -> None:
    s = Batching(np.int64(100), 5, 10)
    assert (s.size, s.linger_ms, s.max_cost) == (100, 5, 10.0)
    assert type(s.size) is int
    assert Batching(1).linger_ms == 0 and Batching(1).max_cost is None
    assert Batching(MAX_BATCH_SIZE, MAX_BATCH_LINGER_MS).size == MAX_BATCH_SIZE


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"size": 0}, ValueError, "size"),
        ({"size": -3}, ValueError, "size"),
        ({"size": True}, TypeError, "size"),
        ({"size": math.nan}, TypeError, "size"),
        ({"size": 2.0}, TypeError, "size"),
        ({"size": "10"}, TypeError, "size"),
        ({"size": MAX_BATCH_SIZE + 1}, ValueError, "size"),
        ({"size": 10**30}, ValueError, "size"),
        ({"size": 8, "linger_ms": -1}, ValueError, "linger_ms"),
        ({"size": 8, "linger_ms": False}, TypeError, "linger_ms"),
        ({"size": 8, "linger_ms": 2.5}, TypeError, "linger_ms"),
        ({"size": 8, "linger_ms": 10**12}, ValueError, "linger_ms"),
        ({"size": 8, "max_cost": 0}, ValueError, "max_cost"),
        ({"size": 8, "max_cost": -1.0}, ValueError, "max_cost"),
        ({"size": 8, "max_cost": math.nan}, ValueError, "max_cost"),
        ({"size": 8, "max_cost": math.inf}, ValueError, "max_cost"),
        ({"size": 8, "max_cost": True}, TypeError, "max_cost"),
        ({"size": 8, "max_cost": "5"}, TypeError, "max_cost"),
    ],
)
def test_settings_refused(kwargs: dict, error: type, named: str) -> None:
    with pytest.raises(error) as info:
        Batching(**kwargs)
    message = str(info.value)
    assert named in message and repr(kwargs[named])[:12] in message
    assert "\n" not in message


def test_settings_frozen() -> None:
    s = Batching(4)
    with pytest.raises(AttributeError):
        s.size = 0  # type: ignore[misc]
    assert s.size == 4


# -- the body -------------------------------------------------------------------------------
def test_body_array_of_the_rows_bodies() -> None:
    assert BatchBody().encode([{"a": 1}, "x", None]) == b'[{"a":1},"x",null]'
    assert json.loads(BatchBody(None).encode(["é", 2.5])) == ["é", 2.5]


def test_body_template_places_the_array() -> None:
    body = BatchBody('{"model": "m", "input": $rows, "n": [1, 2]}')
    assert json.loads(body.encode(["a", "b"])) == {"model": "m", "input": ["a", "b"], "n": [1, 2]}
    assert json.loads(BatchBody("$rows").encode([1])) == [1]
    assert json.loads(BatchBody('{"a": {"b": [$rows]}}').encode([])) == {"a": {"b": [[]]}}


def test_body_function() -> None:
    body = BatchBody(lambda bodies: {"count": len(bodies), "items": bodies})
    assert json.loads(body.encode([{"x": 1}, {"x": 2}])) == {
        "count": 2,
        "items": [{"x": 1}, {"x": 2}],
    }


@pytest.mark.parametrize(
    ("spec", "error", "says"),
    [
        ('{"input": []}', ValueError, "exactly once, found 0"),
        ('{"a": $rows, "b": $rows}', ValueError, "exactly once, found 2"),
        ('{"input": $rows', ValueError, "is not JSON"),
        ('{"input": $rows,}', ValueError, "is not JSON"),
        ('{"input": "$rows"}', ValueError, "not inside a string"),
        ('{"input": "x $rows y"}', ValueError, "not inside a string"),
        (5, TypeError, "BatchFormat.body"),
        (["$rows"], TypeError, "BatchFormat.body"),
    ],
)
def test_body_refused_when_made(spec: object, error: type, says: str) -> None:
    with pytest.raises(error, match=r"BatchFormat\.body") as info:
        BatchBody(spec)  # type: ignore[arg-type]
    assert says in str(info.value) and repr(spec) in str(info.value)


# -- keys and deadlines -----------------------------------------------------------------------
def test_batch_key_stable_and_order_sensitive() -> None:
    keys = ["k1", "k2", "k3"]
    key = batch_key(keys)
    assert key == batch_key(list(keys)) == batch_key(tuple(keys))
    assert len(key) == 32 and int(key, 16) >= 0
    assert key != batch_key(["k2", "k1", "k3"])
    assert key != batch_key(["k1", "k2"])
    assert batch_key(["k1k2"]) != batch_key(["k1", "k2"])
    assert batch_key(["k1"]) != "k1"


@given(st.lists(st.text(alphabet="0123456789abcdef", min_size=1, max_size=8), min_size=1))
def test_batch_key_same_rows_same_key(keys: list[str]) -> None:
    assert batch_key(keys) == batch_key(list(keys))
    if len(set(keys)) > 1:
        turned = keys[1:] + keys[:1]
        assert (batch_key(turned) == batch_key(keys)) == (turned == keys)


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ([], ValueError),
        ("abc", TypeError),
        (None, TypeError),
        (["a", None], TypeError),
        (["a", 7], TypeError),
        (["a\nb"], ValueError),
    ],
)
def test_batch_key_refused(keys: object, error: type) -> None:
    with pytest.raises(error, match="key"):
        batch_key(keys)  # type: ignore[arg-type]


def test_batch_deadline_is_the_earliest_rows() -> None:
    assert batch_deadline([5.0, None, 2.0, 9.0]) == 2.0
    assert batch_deadline([None, None]) is None


# -- the accumulator --------------------------------------------------------------------------
def test_goes_by_size_in_order() -> None:
    acc: Accumulator[int] = Accumulator(Batching(3, 1000), Clock())
    assert acc.add(1) == [] and acc.add(2) == []
    (batch,) = acc.add(3)
    assert (batch.rows, batch.why, batch.line) == ([1, 2, 3], "size", None)
    assert len(acc) == 0 and acc.due() is None


def test_goes_by_cost() -> None:
    acc: Accumulator[str] = Accumulator(Batching(100, 1000, max_cost=10), Clock())
    assert acc.add("a", cost=4) == [] and acc.add("b", cost=4) == []
    (full,) = acc.add("c", cost=4)  # 12 > 10: the open batch goes without c
    assert (full.rows, full.cost, full.why) == (["a", "b"], 8.0, "cost")
    (exact,) = acc.add("d", cost=6)  # 4 + 6 == 10: full
    assert (exact.rows, exact.cost) == (["c", "d"], 10.0)
    (alone,) = acc.add("big", cost=25)  # more than the limit on its own: alone
    assert (alone.rows, alone.why) == (["big"], "cost")
    acc.add("e", cost=1)
    big_after, alone2 = acc.add("huge", cost=30)
    assert (big_after.rows, alone2.rows) == (["e"], ["huge"])


def test_goes_by_linger() -> None:
    clock = Clock()
    acc: Accumulator[int] = Accumulator(Batching(10, 50), clock)
    clock.now = 1.0
    acc.add(1)
    clock.now = 1.03
    acc.add(2)
    assert acc.due() == pytest.approx(1.05)  # from the first row
    clock.now = 1.0499
    assert acc.take() == []
    clock.now = 1.05
    (batch,) = acc.take()
    assert (batch.rows, batch.why) == ([1, 2], "linger")
    assert acc.due() is None and acc.take() == []


def test_linger_ends_early_at_a_rows_deadline() -> None:
    clock = Clock()
    acc: Accumulator[str] = Accumulator(Batching(10, 1000), clock)
    acc.add("late", deadline=5.0)
    assert acc.due() == 1.0  # the linger comes first
    acc.add("soon", deadline=0.25)
    acc.add("later", deadline=3.0)
    assert acc.due() == 0.25
    clock.now = 0.25
    (batch,) = acc.take()
    assert (batch.rows, batch.why, batch.deadline) == (["late", "soon", "later"], "deadline", 0.25)


def test_one_open_batch_per_request_line() -> None:
    clock = Clock()
    acc: Accumulator[int] = Accumulator(Batching(2, 100), clock)
    assert acc.add(1, line=("POST", "/a")) == []
    assert acc.add(2, line=("POST", "/b")) == []
    (a,) = acc.add(3, line=("POST", "/a"))
    assert (a.line, a.rows) == (("POST", "/a"), [1, 3])
    clock.now = 0.05
    acc.add(4, line=("PUT", "/a"))
    clock.now = 0.1
    (b,) = acc.take()  # only /b has lingered its 100 ms
    assert (b.line, b.rows) == (("POST", "/b"), [2])
    (c,) = acc.flush()
    assert (c.line, c.rows, c.why) == (("PUT", "/a"), [4], "flush")
    assert acc.flush() == []


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"cost": math.nan}, ValueError, "cost"),
        ({"cost": -1}, ValueError, "cost"),
        ({"cost": True}, TypeError, "cost"),
        ({"cost": None}, TypeError, "cost"),
        ({"deadline": math.nan}, ValueError, "deadline"),
        ({"deadline": "soon"}, TypeError, "deadline"),
        ({"deadline": -2.0 * math.inf}, ValueError, "deadline"),
        ({"line": ["POST", "/a"]}, TypeError, "line"),
    ],
)
def test_add_refused_state_unchanged(kwargs: dict, error: type, named: str) -> None:
    acc: Accumulator[int] = Accumulator(Batching(2, 10, max_cost=5), Clock())
    acc.add(0, line=None)
    with pytest.raises(error, match=named):
        acc.add(1, **kwargs)
    assert len(acc) == 1
    (batch,) = acc.flush()
    assert batch.rows == [0] and batch.cost == 0.0


def test_accumulator_needs_settings() -> None:
    with pytest.raises(TypeError, match="settings"):
        Accumulator(3)  # type: ignore[arg-type]


_step = st.one_of(
    st.tuples(
        st.just("add"),
        st.sampled_from(["a", "b", "c"]),
        st.floats(0, 6, allow_nan=False),
        st.one_of(st.none(), st.floats(0, 0.5, allow_nan=False)),
    ),
    st.tuples(st.just("wait"), st.floats(0, 0.2, allow_nan=False)),
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(0, 100), st.sampled_from([None, 5.0, 10.0]), st.lists(_step))
def test_accumulator_every_row_once_and_never_late(
    size: int, linger_ms: int, max_cost: float | None, steps: list[tuple]
) -> None:
    """Every row leaves once, in its line's order; no batch breaks a limit; none is kept
    past its linger or its earliest row's deadline by a take at that time."""
    clock = Clock()
    acc: Accumulator[tuple[str, int, float, float | None]] = Accumulator(
        Batching(size, linger_ms, max_cost), clock
    )
    out = []
    added: list[tuple[str, int, float, float | None]] = []
    n = 0
    for step in steps:
        if step[0] == "add":
            _, line, cost, within = step
            deadline = None if within is None else clock.now + within
            row = (line, n, cost, deadline)
            added.append(row)
            out += acc.add(row, line=line, cost=cost, deadline=deadline)
            n += 1
        else:
            clock.now += step[1]
        taken = acc.take()
        for batch in taken:
            assert batch.why in ("linger", "deadline")
            if batch.why == "deadline":
                assert batch.deadline is not None and batch.deadline <= clock.now
        out += taken
        due = acc.due()
        assert due is None or due > clock.now
        waiting = {r[1] for r in added} - {r[1] for batch in out for r in batch.rows}
        assert all(r[3] is None or r[3] > clock.now for r in added if r[1] in waiting)
    out += acc.flush()
    seen = [row for batch in out for row in batch.rows]
    assert sorted(r[1] for r in seen) == list(range(n))
    for batch in out:
        assert 1 <= len(batch.rows) <= size
        assert {r[0] for r in batch.rows} == {batch.line}
        assert [r[1] for r in batch.rows] == sorted(r[1] for r in batch.rows)
        assert batch.cost == pytest.approx(sum(r[2] for r in batch.rows))
        if max_cost is not None and len(batch.rows) > 1:
            assert batch.cost <= max_cost + 1e-9
        assert batch.deadline == batch_deadline([r[3] for r in batch.rows])
    for line in "abc":  # a line's rows leave in the order they came
        order = [r[1] for batch in out if batch.line == line for r in batch.rows]
        assert order == sorted(order)


# -- the reply split ---------------------------------------------------------------------------
def _ok(value: object) -> RowAnswer:
    return RowAnswer(True, json.dumps(value, ensure_ascii=False, separators=(",", ":")), None)


def test_split_by_position_embeddings_shape() -> None:
    answer = {
        "object": "list",
        "data": [{"index": 0, "embedding": [0.1, 0.2]}, {"index": 1, "embedding": [0.3, 0.4]}],
        "usage": {"total_tokens": 9},
    }
    split = ReplySplit("data[*].embedding")
    assert split.split(json.dumps(answer).encode(), [1, 2]) == [_ok([0.1, 0.2]), _ok([0.3, 0.4])]
    assert ReplySplit("data").split(json.dumps(answer), ["a", "b"]) == [
        _ok(answer["data"][0]),  # type: ignore[index]
        _ok(answer["data"][1]),  # type: ignore[index]
    ]


def test_split_top_level_not_an_array() -> None:
    (got,) = ReplySplit("[*]").split('{"a": 1}', [0])
    assert got.reason == "the batch's answer is an object, not an array"


def test_split_paths_of_every_form() -> None:
    body = json.dumps({"out": {"results": [{"v": {"w": "é"}}, {"v": {"w": 2}}]}})
    assert ReplySplit("out.results[*].v.w").split(body, [0, 1]) == [_ok("é"), _ok(2)]
    assert ReplySplit("out.results[*]").split(body, [0, 1])[1] == _ok({"v": {"w": 2}})
    assert ReplySplit("[*]").split("[3, [4]]", [0, 1]) == [_ok(3), _ok([4])]
    assert ReplySplit("[*].x").split('[{"x": 1}]', [0]) == [_ok(1)]
    assert ReplySplit("[*]").split("[]", []) == []


def test_split_fewer_elements_fails_only_the_rows_past_the_end() -> None:
    got = ReplySplit("results[*]").split('{"results": [1, 2]}', ["a", "b", "c", "d"])
    assert got[:2] == [_ok(1), _ok(2)]
    assert [a.ok for a in got[2:]] == [False, False]
    assert "2 elements for 4 rows: none for this row" in str(got[3].reason)


def test_split_more_elements_fails_every_row() -> None:
    got = ReplySplit("results").split('{"results": [1, 2, 3]}', ["a", "b"])
    assert len(got) == 2 and not any(a.ok for a in got)
    assert "3 elements for 2 rows" in str(got[0].reason)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe\xfa", "not JSON"),
        (b"", "empty"),
        (None, "empty"),
        (b'{"results": {"a": 1}}', "results in the batch's answer is an object, not an array"),
        (b'{"other": []}', "no field 'results'"),
        (b"[1, 2]", "it is an array, not an object"),
        (b'{"results": null}', "is null, not an array"),
    ],
)
def test_split_whole_answer_unusable_fails_every_row(body: bytes | None, says: str) -> None:
    got = ReplySplit("results[*]").split(body, [1, 2, 3])
    assert len(got) == 3 and not any(a.ok or a.response for a in got)
    assert all(says in str(a.reason) for a in got)


def test_split_a_bad_element_fails_only_its_row() -> None:
    body = json.dumps({"data": [{"e": 1}, {"x": 2}, None, 7, {"e": None}, {"e": [5]}]})
    got = ReplySplit("data[*].e").split(body, list(range(6)))
    assert [a.ok for a in got] == [True, False, False, False, False, True]
    assert "element 1" in str(got[1].reason) and "no field 'e'" in str(got[1].reason)
    assert "it is null, not an object" in str(got[2].reason)
    assert "it is a number, not an object" in str(got[3].reason)
    assert got[4].reason == "element 4 of the batch's answer is null"
    assert got[5] == _ok([5])


@pytest.mark.parametrize(
    "path",
    ["", "data[*].", "a[*][*]", "a[*]b", "a..b", ".a", "a[0]", "a[*].b c", "a]", "[*]["],
)
def test_split_path_refused_when_made(path: str) -> None:
    with pytest.raises(ValueError, match=r"BatchFormat\.reply") as info:
        ReplySplit(path)
    assert repr(path) in str(info.value) and "does not parse" in str(info.value)


@pytest.mark.parametrize(("path", "id_field"), [(None, None), (3, None), ("data", 5), ("data", "")])
def test_split_arguments_of_the_wrong_type(path: object, id_field: object) -> None:
    with pytest.raises(TypeError, match=r"BatchFormat\.reply|BatchFormat\.id_field"):
        ReplySplit(path, id_field)  # type: ignore[arg-type]


def test_split_by_id_field() -> None:
    answer = {
        "results": [
            {"id": "c", "v": 3},
            {"id": 7, "v": "seven"},
            {"id": "a", "v": 1},
            {"id": "zz", "v": "not ours"},
            {"v": "no id"},
            {"id": "d", "v": 4},
            {"id": "d", "v": 44},
            {"id": "e"},
        ]
    }
    split = ReplySplit("results[*].v", id_field="id")
    got = split.split(json.dumps(answer), ["a", "b", "c", "7", 7, "d", "e"])
    assert got[0] == _ok(1) and got[2] == _ok(3) and got[4] == _ok("seven")
    assert not got[1].ok and got[1].reason == 'no element of the batch\'s answer with id "b"'
    assert not got[3].ok  # "7" is not 7
    assert not got[5].ok and "2 elements" in str(got[5].reason)
    assert not got[6].ok and "no field 'v'" in str(got[6].reason)
    whole = ReplySplit("results", id_field="id").split(json.dumps(answer), ["c"])
    assert whole == [_ok({"id": "c", "v": 3})]


def test_split_by_id_rows_sharing_an_id_both_fail() -> None:
    got = ReplySplit("r", id_field="k").split('{"r": [{"k": 1}, {"k": 2}]}', [1, 1, 2])
    assert [a.ok for a in got] == [False, False, True]
    assert got[0].reason == "2 rows of the batch have id 1"


_element = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=3),
    st.fixed_dictionaries({"v": st.integers()}),
    st.fixed_dictionaries({"w": st.integers()}),
)


@given(st.integers(0, 12), st.lists(_element, max_size=15))
def test_split_every_row_gets_one_answer(n: int, elements: list) -> None:
    got = ReplySplit("out[*].v").split(json.dumps({"out": elements}), list(range(n)))
    assert len(got) == n
    for i, answer in enumerate(got):
        assert answer.ok == (answer.response is not None) == (answer.reason is None)
        if answer.ok:  # it is its own element's, never another's
            assert json.loads(str(answer.response)) == elements[i]["v"]
    if len(elements) > n:
        assert not any(a.ok for a in got)


@given(st.integers(1, 12), st.lists(_element, max_size=15), st.sampled_from(["out[*].v", "out"]))
@example(3, [{"v": 1}, {"v": "é"}, {"v": [2.5]}], "out[*].v")
@example(2, [1, {"a": None}], "out")
def test_texts_is_the_split_when_every_row_is_answered(n: int, elements: list, path: str) -> None:
    # The engine's cheap way for the common answer: the same texts as the split, or
    # None (and the engine reads the answer with split) when any row would fail.
    body = json.dumps({"out": elements})
    split = ReplySplit(path)
    got, texts = split.split(body, list(range(n))), split.texts(body, n)
    if all(a.ok for a in got):
        assert texts == [a.response for a in got]
    else:
        assert texts is None
    assert ReplySplit(path, id_field="id").texts(body, n) is None  # by id: split says


@given(st.permutations(list(range(8))), st.sets(st.integers(0, 7)))
def test_split_by_id_matches_each_row_to_its_element(order: list[int], dropped: set) -> None:
    answer = {"r": [{"id": i, "v": i * 10} for i in order if i not in dropped]}
    got = ReplySplit("r[*].v", id_field="id").split(json.dumps(answer), list(range(8)))
    for i, a in enumerate(got):
        assert a == (_ok(i * 10) if i not in dropped else RowAnswer(False, None, a.reason))
        assert a.ok or a.reason


# -- failure isolation -------------------------------------------------------------------------
def test_classify() -> None:
    assert [plan_for_status(s) for s in (200, 204, 299)] == [ANSWERED] * 3
    assert [plan_for_status(s) for s in (None, 500, 502, 503, 599, 408, 409, 429)] == [RETRY] * 8
    assert [plan_for_status(s) for s in (400, 413, 415, 422, 451)] == [SPLIT] * 5
    assert [plan_for_status(s) for s in (401, 403, 404, 405, 407, 100, 301, 304)] == [REFUSED] * 8


def _isolate(n: int, bad: set[int], iso: Isolation | None = None) -> Isolation:
    """Drive an Isolation against a service that refuses any request holding a bad row."""
    iso = iso or Isolation(n)
    while not iso.done:
        parts = iso.take()
        assert parts, "not done, yet nothing to send"
        for part in parts:
            refused = [i for i in part.rows if i in bad]
            if refused:
                iso.refused_as_bad_input(part, f"HTTP 400: row {refused[0]} is bad")
            else:
                iso.answered(part)
    return iso


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_isolation_bound_and_one_outcome_per_row(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 600), label="N")
    bad = data.draw(st.sets(st.integers(0, n - 1), max_size=min(n, 12)), label="bad")
    iso = _isolate(n, bad)
    k = len(bad)
    extra = iso.requests - 1
    assert extra <= k * (2 * math.ceil(math.log2(n)) + 1)
    assert extra <= 2 * k * math.ceil(math.log2(n))  # the halving alone: tighter still
    for i, final in enumerate(iso.finals):
        if i in bad:
            assert final == Final("failed", f"HTTP 400: row {i} is bad")
        else:
            assert final == Final("ok", None)
    # Each row was in one request, plus one per refused part it was in.
    assert all(a >= 1 for a in iso.attempts)
    assert sum(iso.attempts) >= n


def test_isolation_bound_reached_for_one_bad_row() -> None:
    iso = _isolate(8, {5})
    assert iso.requests == 1 + 2 * 3  # 8 -> 4+4 -> 2+2 -> 1+1
    assert iso.attempts[5] == 4 and iso.attempts[0] == 2
    assert _isolate(1, {0}).requests == 1 and _isolate(5, set()).requests == 1


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 64),
    st.sets(st.integers(0, 63), max_size=6),
    st.integers(0, 3),
    st.lists(st.booleans(), max_size=200),
)
def test_isolation_with_interruptions_ends_every_row_once(
    n: int, bad: set[int], retries: int, flakes: list[bool]
) -> None:
    """Timeouts and 5xx between the refusals: a part is retried whole until its retries
    are spent; every row still ends exactly once, a bad one never ok."""
    bad = {i for i in bad if i < n}
    iso = Isolation(n, retries=retries)
    flaky = iter(flakes)
    retried = 0
    while not iso.done:
        for part in iso.take():
            if next(flaky, False):
                again = iso.interrupted(part, "timeout", "no reply within 1 s", now=0.0)
                if again is not None:
                    assert again == Part(part.rows, part.tries + 1)
                    retried += 1
            elif any(i in bad for i in part.rows):
                iso.refused_as_bad_input(part, "HTTP 422: bad")
            else:
                iso.answered(part)
    assert all(f is not None for f in iso.finals)
    for i, final in enumerate(iso.finals):
        assert final is not None
        assert final.status in (("failed", "timeout") if i in bad else ("ok", "timeout"))
        if final.status == "timeout":
            assert final.reason == "no reply within 1 s"
    extra = iso.requests - 1 - retried
    assert extra <= len(bad) * (2 * math.ceil(math.log2(n)) + 1)


def test_interrupted_keeps_the_part_whole_within_the_rows_deadlines() -> None:
    iso = Isolation(4, retries=2, deadlines=[10.0, 3.0, None, 5.0])
    (part,) = iso.take()
    again = iso.interrupted(part, "failed", "HTTP 503: busy", now=4.0)
    assert again == Part((0, 2, 3), 1)
    assert iso.finals[1] == Final("timeout", "deadline passed; last attempt: HTTP 503: busy")
    assert iso.take() == [again]
    third = iso.interrupted(again, "failed", "HTTP 500: oops", now=4.5)
    assert third == Part((0, 2, 3), 2)
    (part,) = iso.take()
    assert iso.interrupted(part, "failed", "HTTP 500: oops", now=4.6) is None  # retries spent
    assert iso.finals == [
        Final("failed", "HTTP 500: oops"),
        Final("timeout", "deadline passed; last attempt: HTTP 503: busy"),
        Final("failed", "HTTP 500: oops"),
        Final("failed", "HTTP 500: oops"),
    ]
    assert iso.done and iso.attempts == [3, 1, 3, 3] and iso.requests == 3


def test_interrupted_past_every_deadline_ends_the_part() -> None:
    iso = Isolation(2, retries=5, deadlines=[1.0, 2.0])
    (part,) = iso.take()
    assert iso.interrupted(part, "timeout", "no reply", now=2.0) is None
    assert iso.done and iso.take() == []


def test_answered_with_rows_whose_element_is_bad() -> None:
    iso = Isolation(3)
    (part,) = iso.take()
    iso.answered(part, {1: "element 1 of the batch's answer is null"})
    assert [f.status for f in iso.finals if f] == ["ok", "failed", "ok"]


def test_fail_ends_every_row_of_the_part() -> None:
    iso = Isolation(4)
    (part,) = iso.take()
    left, right = iso.refused_as_bad_input(part, "HTTP 400")
    iso.take()
    iso.fail(left, "failed", "HTTP 403: forbidden")
    assert not iso.done
    iso.answered(right)
    assert iso.done and [f.status for f in iso.finals if f] == ["failed"] * 2 + ["ok"] * 2


def test_skip_ends_a_part_not_sent_and_does_not_count_its_request() -> None:
    iso = Isolation(3)
    (part,) = iso.take()
    left, right = iso.refused_as_bad_input(part, "HTTP 400")
    iso.take()  # both halves out: three requests, each row in two
    with pytest.raises(ValueError, match="status must be"):
        iso.fail(right, "skipped", "budget spent: not sent")  # skip says it
    iso.skip(right, "budget spent: not sent")
    assert iso.requests == 2 and iso.attempts == [2, 2, 1]
    iso.answered(left)
    assert iso.done and iso.finals == [
        Final("ok", None),
        Final("ok", None),
        Final("skipped", "budget spent: not sent"),
    ]


def test_a_status_other_than_failed_or_timeout_is_refused() -> None:
    iso = Isolation(2, retries=1)
    (part,) = iso.take()
    for feed in (iso.fail, lambda p, s, r: iso.interrupted(p, s, r, now=0.0)):
        with pytest.raises(ValueError, match="status must be"):
            feed(part, "ok", "no")
    iso.fail(part, "failed", "HTTP 401: who are you")  # still out: nothing changed
    assert iso.done and iso.finals == [Final("failed", "HTTP 401: who are you")] * 2


def test_a_part_not_out_is_refused_and_nothing_changes() -> None:
    iso = Isolation(2)
    with pytest.raises(ValueError, match="is not out"):
        iso.answered(Part((0, 1)))  # not taken yet
    (part,) = iso.take()
    iso.answered(part)
    with pytest.raises(ValueError, match="is not out"):
        iso.answered(part)  # a second ending for the same request
    assert iso.finals == [Final("ok", None)] * 2


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((0,), {}, ValueError),
        ((True,), {}, TypeError),
        ((MAX_BATCH_SIZE + 1,), {}, ValueError),
        ((2,), {"retries": -1}, ValueError),
        ((2,), {"deadlines": [1.0]}, ValueError),
    ],
)
def test_isolation_refuses_bad_arguments(args: tuple, kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        Isolation(*args, **kwargs)


# -- one batch driven to one ending per row ----------------------------------------------------
def _service(ids: list[int], bad: set[int], flaky: bool) -> tuple[bool, str | None, Reply]:
    """An embeddings-style service: 503 when flaky, 400 naming the first bad row, else
    one element per row, in order."""
    if flaky:
        return False, Failure("HTTP 503: busy", 0.0), Reply(503, b"busy")
    refused = [i for i in ids if i in bad]
    if refused:
        text = json.dumps({"error": f"row {refused[0]} is bad"}).encode()
        return False, Failure(f"HTTP 400: {text.decode()}", None), Reply(400, text)
    answer = {"data": [{"index": n, "embedding": [i, i / 2]} for n, i in enumerate(ids)]}
    return True, None, Reply(200, json.dumps(answer).encode())


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 100),
    st.sets(st.integers(0, 99), max_size=5),
    st.integers(0, 2),
    st.lists(st.booleans(), max_size=60),
)
def test_batch_run_every_row_ends_once_as_a_single_request_would(
    n: int, bad: set[int], retries: int, flakes: list[bool]
) -> None:
    bad = {i for i in bad if i < n}
    ids = [10 * i for i in range(n)]
    bad_ids = {10 * i for i in bad}
    run = BatchRun(ids, ReplySplit("data[*].embedding"), retries=retries)
    flaky = iter(flakes)
    ends: list[RowEnd] = []
    parts = run.take()
    while parts:
        waiting = []
        for part in parts:
            got, then = run.ended(
                part, *_service([ids[i] for i in part.rows], bad_ids, next(flaky, False))
            )
            ends += got
            waiting.append(then)
        parts = run.take()
        assert bool(parts) == any(t != NOTHING for t in waiting)
    assert run.done
    assert sorted(e.at for e in ends) == list(range(n))  # each row once
    for e in ends:
        assert e.attempts == run.attempts[e.at] >= 1
        if e.status == "ok":
            assert e.error is None and e.at not in bad
            assert e.reply == Reply(200, json.dumps([ids[e.at], ids[e.at] / 2]).replace(" ", ""))
        elif e.reply is not None and e.reply.status == 400:  # refused alone, with its reason
            assert e.at in bad and e.error == f'HTTP 400: {{"error": "row {ids[e.at]} is bad"}}'
            assert e.reply.body == json.dumps({"error": f"row {ids[e.at]} is bad"}).encode()
        else:  # a 503 and no retry left
            assert (e.status, e.error, e.reply) == ("failed", "HTTP 503: busy", Reply(503, b"busy"))
    if not any(flakes):
        assert sorted(e.at for e in ends if e.status == "ok") == sorted(set(range(n)) - bad)


def test_batch_run_timeouts_retried_whole_then_timeout() -> None:
    clock = Clock()
    run = BatchRun([1, 2, 3], ReplySplit("[*]"), retries=1, deadlines=[5.0, 0.5, None], clock=clock)
    (part,) = run.take()
    clock.now = 1.0
    ends, then = run.timed_out(part, "no reply within 1000 ms")
    assert then == AFTER_BACKOFF
    assert ends == [
        RowEnd(1, "timeout", "deadline passed; last attempt: no reply within 1000 ms", None, 1)
    ]
    (again,) = run.take()
    assert again.rows == (0, 2)
    ends, then = run.timed_out(again, "no reply within 1000 ms")
    assert then == NOTHING and run.done
    assert ends == [
        RowEnd(0, "timeout", "no reply within 1000 ms", None, 2),
        RowEnd(2, "timeout", "no reply within 1000 ms", None, 2),
    ]


def test_batch_run_counts_its_requests_and_not_a_part_left_unsent() -> None:
    run = BatchRun([1, 2, 3, 4], ReplySplit("[*]"))
    (part,) = run.take()
    ends, then = run.ended(part, False, "HTTP 400: bad", Reply(400, b"bad"))
    assert (ends, then) == ([], NOW)
    first, second = run.take()
    assert run.skipped(second, "budget spent: not sent") == [
        RowEnd(2, "skipped", "budget spent: not sent", None, 1),
        RowEnd(3, "skipped", "budget spent: not sent", None, 1),
    ]
    assert run.answered_whole(first, Reply(200, b"[1,2]")) == ["1", "2"]
    assert run.done and run.requests == 2 and run.alone == 0
    assert run.attempts == [2, 2, 1, 1]


def test_batch_run_answers_that_fail_only_some_rows() -> None:
    run = BatchRun(["a", "b", "c"], ReplySplit("r[*].v", id_field="id"))
    (part,) = run.take()
    body = b'{"r": [{"id": "c", "v": 3}, {"id": "a", "v": {"x": 1}}]}'
    ends, then = run.ended(part, True, None, Reply(200, body))
    assert then == NOTHING and run.done
    assert ends == [
        RowEnd(0, "ok", None, Reply(200, '{"x":1}'), 1),
        RowEnd(1, "failed", 'no element of the batch\'s answer with id "b"', Reply(200, None), 1),
        RowEnd(2, "ok", None, Reply(200, "3"), 1),
    ]


@pytest.mark.parametrize(
    ("ok", "error", "reply", "then", "says"),
    [
        # refused before any answer (a row's URL column is null, say): no retry
        (False, Failure("url column 'x' is null: not sent", None), None, NOTHING, "not sent"),
        # the caller is refused: halving cannot help
        (False, Failure("HTTP 401: no key", None), Reply(401, b"no key"), NOTHING, "401"),
        # a 2xx the target failed (too large) but says is worth a retry
        (False, Failure("connection reset", 0.0), Reply(200, b"[1]"), AFTER_BACKOFF, None),
        (False, Failure("HTTP 429: slow down", 2.0), Reply(429, b""), AFTER_BACKOFF, None),
        (False, "HTTP 502: bad gateway", Reply(502, b"x"), AFTER_BACKOFF, None),
        # a target that reports success with no answer: nothing to split
        (True, None, None, NOTHING, "empty"),
    ],
)
def test_batch_run_reads_each_ending(
    ok: bool, error: str | None, reply: Reply | None, then: str, says: str | None
) -> None:
    run = BatchRun([1, 2], ReplySplit("[*]"), retries=1)
    (part,) = run.take()
    ends, next_step = run.ended(part, ok, error, reply)
    assert next_step == then
    if then == NOTHING:
        assert [e.at for e in ends] == [0, 1] and all(e.status == "failed" for e in ends)
        assert all(says in str(e.error) for e in ends)
    else:
        assert ends == [] and run.take() == [Part((0, 1), 1)]


def test_batch_run_refuses_a_bad_split() -> None:
    with pytest.raises(TypeError, match="split"):
        BatchRun([1], "[*]")  # type: ignore[arg-type]


def test_take_returns_due_batches_earliest_first() -> None:
    clock = Clock()
    acc: Accumulator[int] = Accumulator(Batching(10, 100), clock)
    acc.add(1, line="late")
    clock.now = 0.01
    acc.add(2, line="soon", deadline=0.05)
    acc.add(3, line="early")  # opened at 0.01: due at 0.11
    clock.now = 0.2
    assert [(b.line, b.why) for b in acc.take()] == [
        ("soon", "deadline"),
        ("late", "linger"),
        ("early", "linger"),
    ]
