"""The scrubber: secret values taken out of text by value, in the shapes an echoing service
gives them (raw, JSON-escaped, URL-encoded, base64 at any alignment, hex, HTML), and
nothing else touched."""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import sys
import warnings
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from secret_shapes import cores, encodings
from timewheel.spark.scrubber import (
    MASK,
    MIN_CHARS,
    ScrubbedStream,
    Scrubber,
    hide,
    scrub,
    scrub_bytes,
    scrub_value,
    scrubbed_output,
    scrubber,
)
from timewheel.spark.secrets import Secret, hide_url

TOKEN = "tok-7f3a9c1e-never-on-disk"
# The properties' examples: .ci/slow runs them at TIMEWHEEL_INVARIANT_EXAMPLES=500.
_EXAMPLES = int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "60"))


def test_each_encoding_of_a_value_is_masked_where_it_stands() -> None:
    s = Scrubber()
    value = 'pw/"x y"\\é😀+&<' + TOKEN
    assert s.add(value)
    for shape in encodings(value):
        out = s.scrub(f"before {shape} after")
        assert MASK in out and not [e for e in encodings(value) if e in out], shape
    assert s.scrub(f"<<{json.dumps(value)[1:-1]}>>") == "<<***>>"
    # base64 of a longer text holding it, at each alignment: what stands for it is gone
    for lead in (b"Basic ", b"Basic x", b"Basic xy"):
        blob = base64.b64encode(lead + value.encode() + b"!").decode()
        out = s.scrub(blob)
        assert MASK in out and not [c for c in cores(value.encode()) if c in out]


def test_two_shapes_of_a_value_are_masked_at_any_distance_apart() -> None:
    # The scrubber looks around each needle (a shape's run of letters and digits) it
    # finds: two shapes near each other share a window, whatever the distance.
    s = Scrubber()
    value = '"/+ /"%=' * 3 + "run0fletters"  # a long spelling before its needle
    s.add(value)
    double = json.dumps(json.dumps(value)[1:-1])[1:-1]  # escaped twice
    for gap in range(0, 1200):
        for first, second in ((value, double), (double, value)):
            out = s.scrub(first + "." * gap + second)
            assert out == f"***{'.' * gap}***", gap


def test_text_without_a_value_is_left_as_it_is_and_nothing_costs_nothing() -> None:
    s = Scrubber()
    text = "HTTP 500: {'error': 'bad token'} tok-7f3a9c1e"
    assert s.scrub(text) is text  # nothing registered: returned at once
    s.add(TOKEN)
    assert s.scrub(text) == text
    assert s.scrub("") == ""


def test_a_short_value_is_not_taken_and_said_once_by_its_name_only() -> None:
    s = Scrubber()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert not s.add("abc", "secret 'env:PIN'")
        assert not s.add("abc", "secret 'env:PIN'")
    assert len(said) == 1
    message = str(said[0].message)
    assert "secret 'env:PIN'" in message and str(MIN_CHARS) in message and "abc" not in message
    assert s.scrub("abc") == "abc" and len(s) == 0
    assert s.add("abcd")  # MIN_CHARS characters are taken


def test_a_scrubber_shows_no_value_and_refuses_to_pickle() -> None:
    s = Scrubber()
    s.add(TOKEN)
    assert TOKEN not in repr(s) and "1 values" in repr(s)
    with pytest.raises(TypeError, match="not pickled") as info:
        pickle.dumps(s)
    assert TOKEN not in str(info.value)
    with pytest.raises(TypeError) as bad:
        s.add(b"bytes-value")  # type: ignore[arg-type]
    assert "bytes-value" not in str(bad.value)


def test_a_value_made_again_by_the_masks_is_masked_too() -> None:
    s = Scrubber()
    s.add("a***")
    s.add("bcdefg")
    assert s.scrub("abcdefg") == MASK  # 'a' + mask spells the first value


def test_a_secret_registers_its_value_and_the_header_it_sends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("TW_SCRUB_TOKEN", TOKEN)
    value, _ = Secret("env:TW_SCRUB_TOKEN", prefix="Basic ").resolve()
    assert value == f"Basic {TOKEN}"
    sent = base64.b64encode(value.encode()).decode()
    assert scrub(f"a {TOKEN} b {sent}") == "a *** b ***"
    # a Basic credential's value is base64: what it decodes to, and its password, too
    monkeypatch.setenv("TW_SCRUB_BASIC", base64.b64encode(b"bob:basic-pass-123").decode())
    Secret("env:TW_SCRUB_BASIC", prefix="Basic ").resolve()
    assert scrub("user bob:basic-pass-123 password basic-pass-123") == "user *** password ***"
    # the driver's own: read here without being kept, a function's never called
    path = tmp_path / "key"
    path.write_text("file-key-0123456789\n")
    assert Secret(f"file:{path}").hide() and scrub("k=file-key-0123456789") == "k=***"
    assert not Secret(_never_called, name="oauth").hide()
    assert not Secret("env:TW_SCRUB_UNSET").hide()


def _never_called() -> str:
    raise AssertionError("called")


def test_a_urls_secret_parts_are_registered_and_its_other_parts_not() -> None:
    path_token = "aBcD1234eFgH5678iJkL9012"
    hide_url(
        f"https://bob:p%40ss-9x7@h.example/hook/{path_token}/in/{{id}}?api_key=K3y-value"
        "&user={user}#frag-ment"
    )
    basic = base64.b64encode(b"bob:p@ss-9x7").decode()  # what libcurl sends for it
    text = f"{path_token} p@ss-9x7 K3y-value frag-ment Basic {basic} h.example hook {{user}}"
    assert scrub(text) == "*** *** *** *** Basic *** h.example hook {user}"
    assert len(scrubber()) >= 5


def test_text_values_streams_and_bytes_go_through_the_scrubber(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hide(TOKEN)
    nested = {"a": [TOKEN, 1, (f"x{TOKEN}",)], TOKEN: None}
    assert scrub_value(nested) == {"a": ["***", 1, ("x***",)], "***": None}
    assert scrub_bytes(TOKEN.encode() + b"\n\xff") == b"***\n\xff"  # bytes not UTF-8 kept
    stream = ScrubbedStream(sys.stdout)
    print(f"token {TOKEN}", file=stream)
    with scrubbed_output():
        print(f"out {TOKEN}")
        print(f"err {TOKEN}", file=sys.stderr)
    printed = capsys.readouterr()
    assert printed.out == "token ***\nout ***\n" and printed.err == "err ***\n"


def test_log_records_are_scrubbed_whatever_prints_them(caplog: pytest.LogCaptureFixture) -> None:
    hide(TOKEN)
    log = logging.getLogger("timewheel.test_scrubber")
    with caplog.at_level(logging.INFO, logger="timewheel.test_scrubber"):
        log.info("answer: %s", {"echo": TOKEN})
        try:
            raise RuntimeError(f"said {TOKEN}")
        except RuntimeError:
            log.exception("failed")
    assert TOKEN not in caplog.text and "answer: {'echo': '***'}" in caplog.text
    assert "RuntimeError: said ***" in caplog.text


def test_a_forked_child_keeps_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(TOKEN)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            hide("child-value-1234")  # its own lock, not one a lost thread may hold
            os.write(write, scrub(f"{TOKEN} child-value-1234").encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        got = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert got == b"*** ***"


# -- over random values, texts and shapes ---------------------------------------------
_SPECIAL = list("\"\\/%&+=?#<>' :;,{}[]\t*.-_~")
_CHARS = st.one_of(
    st.characters(whitelist_categories=("Lu", "Ll", "Nd")),
    st.sampled_from(_SPECIAL),
    st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, blacklist_categories=("Cs",)),
)
_VALUES = st.lists(st.text(_CHARS, min_size=MIN_CHARS, max_size=24), min_size=1, max_size=3)
# Random text, or a run long enough to put two shapes at any distance (the scrubber looks
# around each needle it finds, as far as a shape can reach).
_TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.integers(0, 3000).map(lambda n: "." * n),
)


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True)
@given(values=_VALUES, data=st.data())
def test_no_shape_of_a_value_survives_whatever_surrounds_it(
    values: list[str], data: st.DataObject
) -> None:
    s = Scrubber()
    for value in values:
        s.add(value)
    parts = [data.draw(_TEXT)]
    for _ in range(data.draw(st.integers(1, 4))):
        value = data.draw(st.sampled_from(values))
        parts += [data.draw(st.sampled_from(encodings(value))), data.draw(_TEXT)]
    out = s.scrub("".join(parts))
    left = [shape for value in values for shape in encodings(value) if shape in out]
    assert not left


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True)
@given(values=_VALUES, text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_a_text_holding_no_shape_of_a_value_is_left_unchanged(values: list[str], text: str) -> None:
    assume(not any(shape in text for value in values for shape in encodings(value)))
    s = Scrubber()
    for value in values:
        s.add(value)
    assert s.scrub(text) == text


_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), _TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True)
@given(values=_VALUES, data=st.data())
def test_a_json_value_is_scrubbed_as_if_walked_str_by_str(
    values: list[str], data: st.DataObject
) -> None:
    """scrub_value's shortcut (the value's JSON text searched whole first) leaves nothing
    that scrubbing every str, keys too, would take out, and changes nothing it would not;
    scrub_json's text is the walked value's."""
    from unittest import mock

    from timewheel.spark import scrubber as module

    s = Scrubber()
    for value in values:
        s.add(value)

    def shaped() -> str:  # a str that may hold a shape of a value, anywhere in it
        if not data.draw(st.booleans()):
            return data.draw(_TEXT)
        shape = data.draw(st.sampled_from(encodings(data.draw(st.sampled_from(values)))))
        return data.draw(_TEXT) + shape + data.draw(_TEXT)

    def place(v: Any) -> Any:
        if isinstance(v, str):
            return shaped()
        if isinstance(v, list):
            return [place(x) for x in v]
        if isinstance(v, dict):
            return {shaped(): place(x) for x in v.values()}
        return v

    given_value = place(data.draw(_JSON))
    with mock.patch.object(module, "_SCRUBBER", s):
        got = module.scrub_value(given_value)
        walked = module._walk(given_value)
        text = module.scrub_json(given_value)  # (a provider's answer on its way to a row)
    assert got == walked
    assert text == json.dumps(walked, separators=(",", ":"), ensure_ascii=False)
