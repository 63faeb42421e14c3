"""The hot paths' JSON encoder makes the text json's own encoder makes."""

from __future__ import annotations

import datetime
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from timewheel.spark._json import encoder

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(_json)
def test_the_text_is_jsons_for_each_setting(value: object) -> None:
    for ascii in (True, False):
        for compact in (True, False):
            separators = (",", ":") if compact else (", ", ": ")
            ref = json.JSONEncoder(ensure_ascii=ascii, separators=separators).encode
            assert encoder(ascii=ascii, compact=compact)(value) == ref(value)


def test_what_json_cannot_hold_goes_to_default_or_is_refused() -> None:
    day = datetime.date(2026, 11, 27)
    assert encoder(default=str)([day]) == '["2026-11-27"]'
    with pytest.raises(TypeError, match="date is not JSON serializable"):
        encoder()([day])
