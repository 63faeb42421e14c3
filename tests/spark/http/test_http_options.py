"""The HTTP target's option objects: each refuses a bad value when made, naming its field
and the value, and the target takes them whole."""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from timewheel.spark.batch.replies import ReplySplit
from timewheel.spark.batch.spec import BatchBody
from timewheel.spark.targets import TLS, BatchFormat, HttpDownstream, HttpLimits

NAN = math.nan


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (
            {"max_connections": 0},
            ValueError,
            "HttpLimits.max_connections must be between 1 and 1000000, got 0",
        ),
        ({"max_connections": -3}, ValueError, "max_connections must be between 1 and 1000000"),
        ({"max_connections": 10**20}, ValueError, "got 100000000000000000000"),
        (
            {"max_connections": True},
            TypeError,
            "HttpLimits.max_connections must be an int, got True",
        ),
        ({"max_connections": 8.0}, TypeError, "HttpLimits.max_connections must be an int, got 8.0"),
        ({"max_connections": "8"}, TypeError, "HttpLimits.max_connections must be an int, got '8'"),
        ({"timeout_s": NAN}, ValueError, "HttpLimits.timeout_s must be .*, got nan"),
        ({"timeout_s": math.inf}, ValueError, "HttpLimits.timeout_s must be .*, got inf"),
        ({"timeout_s": -1}, ValueError, "HttpLimits.timeout_s must be .*, got -1"),
        ({"timeout_s": 0}, ValueError, "HttpLimits.timeout_s must be .*, got 0"),
        ({"timeout_s": 1e9}, ValueError, "HttpLimits.timeout_s must be .*<= 2.14748e\\+06"),
        ({"timeout_s": False}, TypeError, "HttpLimits.timeout_s must be a number, got False"),
        ({"timeout_s": "1"}, TypeError, "HttpLimits.timeout_s must be a number, got '1'"),
        ({"max_retry_after_s": NAN}, ValueError, "HttpLimits.max_retry_after_s must be .*nan"),
        ({"max_retry_after_s": -0.5}, ValueError, "HttpLimits.max_retry_after_s .*>= 0.*-0.5"),
        ({"max_retry_after_s": True}, TypeError, "HttpLimits.max_retry_after_s .*, got True"),
        ({"max_retry_after_s": None}, TypeError, "HttpLimits.max_retry_after_s .*, got None"),
        ({"max_reply_bytes": 0}, ValueError, "HttpLimits.max_reply_bytes must be between 1"),
        ({"max_reply_bytes": -1}, ValueError, "HttpLimits.max_reply_bytes .*, got -1"),
        ({"max_reply_bytes": 1.5}, TypeError, "HttpLimits.max_reply_bytes must be an int, got 1.5"),
        ({"max_reply_bytes": NAN}, TypeError, "HttpLimits.max_reply_bytes must be an int, got nan"),
        ({"max_reply_bytes": False}, TypeError, "HttpLimits.max_reply_bytes .*, got False"),
        ({"max_reply_bytes": 1 << 63}, ValueError, "HttpLimits.max_reply_bytes must be between"),
    ],
)
def test_limits_refuse_bad_values(kwargs: dict[str, Any], exc: type, words: str) -> None:
    with pytest.raises(exc, match=words):
        HttpLimits(**kwargs)


def test_limits_keep_what_they_take() -> None:
    import numpy as np

    limits = HttpLimits(
        max_connections=np.int64(4), timeout_s=2, max_retry_after_s=0, max_reply_bytes=10
    )
    assert limits == HttpLimits(4, 2.0, 0.0, 10)
    assert type(limits.max_connections) is int and type(limits.timeout_s) is float
    assert HttpLimits().max_reply_bytes == 1 << 20 and HttpLimits().max_retry_after_s == 30.0
    with pytest.raises(AttributeError):
        limits.max_connections = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"verify": "no"}, TypeError, "TLS.verify must be True or False, got 'no'"),
        ({"verify": 0}, TypeError, "TLS.verify must be True or False, got 0"),
        ({"verify": None}, TypeError, "TLS.verify must be True or False, got None"),
        ({"http2": 1}, TypeError, "TLS.http2 must be True or False, got 1"),
        ({"http2": NAN}, TypeError, "TLS.http2 must be True or False, got nan"),
        ({"ca_file": 3}, TypeError, "TLS.ca_file must be a file path .*, got 3"),
        ({"ca_file": True}, TypeError, "TLS.ca_file must be a file path .*, got True"),
        ({"ca_file": ""}, TypeError, "TLS.ca_file must be a file path .*, got ''"),
        ({"client_cert": b"c.pem"}, TypeError, "TLS.client_cert must be a file path"),
        ({"client_key": -1}, TypeError, "TLS.client_key must be a file path .*, got -1"),
    ],
)
def test_tls_refuses_bad_values(kwargs: dict[str, Any], exc: type, words: str) -> None:
    with pytest.raises(exc, match=words):
        TLS(**kwargs)


def test_tls_files_must_be_there(tmp_path: Path) -> None:
    gone = str(tmp_path / "gone.pem")
    with pytest.raises(ValueError, match=re.escape(f"TLS.client_cert: {gone!r} is not a file")):
        TLS(client_cert=gone)
    (tmp_path / "key.pem").write_text("k")
    with pytest.raises(ValueError, match=r"TLS.client_key .*key.pem.* needs TLS.client_cert"):
        TLS(client_key=str(tmp_path / "key.pem"))
    # the key in the certificate's file
    both = TLS(client_cert=str(tmp_path / "key.pem"))
    assert (both.client_cert, both.client_key) == (str(tmp_path / "key.pem"), None)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"body": 7}, TypeError, "BatchFormat.body must be None, a template .*, got 7"),
        ({"body": NAN}, TypeError, "BatchFormat.body must be .*, got nan"),
        ({"body": True}, TypeError, "BatchFormat.body must be .*, got True"),
        ({"body": '{"input": []}'}, ValueError, r"BatchFormat.body template must hold \$rows"),
        ({"body": '{"input": "$rows"}'}, ValueError, "BatchFormat.body .* not inside a string"),
        ({"body": "$rows,"}, ValueError, "BatchFormat.body template '\\$rows,' is not JSON"),
        ({"reply": 3}, TypeError, "BatchFormat.reply must be a path \\(str\\), got 3"),
        ({"reply": None}, TypeError, "BatchFormat.reply must be a path \\(str\\), got None"),
        ({"reply": ""}, ValueError, "BatchFormat.reply '' does not parse"),
        ({"reply": "data[*].x[*]"}, ValueError, "BatchFormat.reply 'data\\[\\*\\].x\\[\\*\\]'"),
        ({"id_field": 3}, TypeError, "BatchFormat.id_field must be a field name .*, got 3"),
        ({"id_field": ""}, TypeError, "BatchFormat.id_field must be a field name .*, got ''"),
        ({"id_field": False}, TypeError, "BatchFormat.id_field .*, got False"),
    ],
)
def test_batch_format_refuses_bad_values(kwargs: dict[str, Any], exc: type, words: str) -> None:
    with pytest.raises(exc, match=words):
        BatchFormat(**kwargs)


def test_batch_format_makes_its_body_and_its_split() -> None:
    given = BatchFormat('{"model": "m", "input": $rows}', reply="data[*].embedding")
    assert isinstance(given.encoder, BatchBody) and isinstance(given.split, ReplySplit)
    assert given.encoder.encode([1, "a"]) == b'{"model": "m", "input": [1,"a"]}'
    assert (given.split.path, given.split.id_field) == ("data[*].embedding", None)
    # what it was given, not what it made, is its identity
    assert given == BatchFormat('{"model": "m", "input": $rows}', "data[*].embedding")
    assert repr(given) == (
        'BatchFormat(body=\'{"model": "m", "input": $rows}\', reply=\'data[*].embedding\', '
        "id_field=None)"
    )
    assert pickle.loads(pickle.dumps(given)).encoder.encode([2]) == given.encoder.encode([2])


def test_max_reply_bytes_is_per_row_and_a_batch_reads_as_many_times_it() -> None:
    from timewheel.spark.http.request import too_large

    limits = HttpLimits(max_reply_bytes=1 << 20)
    assert [limits.reply_limit(rows) for rows in (1, 50, 100)] == [1 << 20, 50 << 20, 100 << 20]
    assert HttpLimits(max_reply_bytes=(1 << 63) - 1).reply_limit(100) == (1 << 63) - 1
    # A row's own request: the words it always had.
    assert too_large(limits) == "answer larger than 1048576 bytes (max_reply_bytes): not read"
    # A batch's: the setting to raise, and to what, when the answer said its length.
    small = HttpLimits(max_reply_bytes=20_000)
    error = too_large(small, 100, "3256794")
    assert error == (
        "the batch's answer (3256794 bytes for 100 rows) is larger than 2000000 bytes "
        "(100 x HttpLimits.max_reply_bytes 20000, per row): not read; raise "
        "HttpLimits.max_reply_bytes (--max-reply-bytes) to at least 32568 (per row)"
    )
    assert error.retry_after_s is None  # final: a retry would get the same answer
    # No length (chunked), or one the limit does not bound (a compressed answer's): what
    # is known is that it is more than the limit.
    for length in (None, "-1", "1200"):
        assert too_large(small, 1, length) == (
            "the batch's answer for 1 row is larger than 20000 bytes (1 x "
            "HttpLimits.max_reply_bytes 20000, per row): not read; raise "
            "HttpLimits.max_reply_bytes (--max-reply-bytes) above 20000 (per row; the answer "
            "did not say its length)"
        )


def test_the_target_takes_the_objects_whole(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("x")
    tls = TLS(ca_file=str(tmp_path / "ca.pem"), http2=False)
    limits = HttpLimits(max_connections=2, max_reply_bytes=64)
    batch = BatchFormat(reply="data[*]", id_field="id")
    target = HttpDownstream("https://api.example/v1/x", tls=tls, limits=limits, batch=batch)
    assert (target.tls, target.limits, target.batch) == (tls, limits, batch)
    assert target.batch_reply is batch.split  # what the engine splits answers with
    copy = pickle.loads(pickle.dumps(target))
    assert (copy.tls, copy.limits, copy.batch) == (tls, limits, batch)
    # the defaults: the same objects a target made without them has
    plain = HttpDownstream("http://127.0.0.1:9/x")
    assert (plain.tls, plain.limits, plain.batch) == (TLS(), HttpLimits(), BatchFormat())


def test_the_repr_is_stable_and_shows_no_secret(tmp_path: Path) -> None:
    from timewheel.spark.secrets import Secret

    (tmp_path / "ca.pem").write_text("x")
    target = HttpDownstream(
        "https://user:hunter2@api.example/v1/x?key=sk-live",
        headers={"Authorization": Secret("env:TOKEN_FOR_REPR_TEST")},
        tls=TLS(ca_file=str(tmp_path / "ca.pem")),
        limits=HttpLimits(max_connections=3),
    )
    # A stream's record digests it: the options do not change it, and no secret shows.
    shown = repr(target)
    assert shown == repr(HttpDownstream("https://user:hunter2@api.example/v1/x?key=sk-live"))
    assert "hunter2" not in shown and "sk-live" not in shown
    assert shown.startswith("HttpDownstream(POST ")
