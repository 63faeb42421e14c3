"""The sum of an input's id hashes as Spark computes it (``xxhash64``, seed 42), from an
Arrow column in the driver: the figure the id check records, for the write to match.

A run checks that its ``--id-col`` names each row once before sending anything; a local
Parquet input's ids are read for that by pyarrow, in the driver (no Spark job). The write
that sends the rows observes the sum of the ids' 64-bit hashes as it reads them
(:func:`.summary.id_hash_sum`). The same sum taken here, at the check, makes the two
comparable: an input replaced between the check and the write (an id twice in as many
rows) reads with another sum, and the run refuses to publish.

Spark hashes an ``int``, ``short`` or ``byte`` as the 4 bytes of an int, a ``long`` as
its 8 bytes, a string as its UTF-8 bytes, all with XXH64 (Spark's ``XXH64`` class is the
reference algorithm); here it runs in numpy on whole columns, strings grouped by length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["id_hash_sum_of", "xxhash64"]

_P1 = np.uint64(11400714785074694791)
_P2 = np.uint64(14029467366897019727)
_P3 = np.uint64(1609587929392839161)
_P4 = np.uint64(9650029242287828579)
_P5 = np.uint64(2870177450012600261)
#: Spark's seed for ``xxhash64``.
SEED = 42


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    return _rotl(acc + lane * _P2, 31) * _P1


def xxhash64(rows: np.ndarray, seed: int = SEED) -> np.ndarray:
    """XXH64 of each row of ``rows`` (uint8, shape ``(n, length)``, every row one input of
    ``length`` bytes) as signed 64-bit integers, as Spark's ``xxhash64`` gives them."""
    n, length = rows.shape
    with np.errstate(over="ignore"):
        s = np.uint64(seed % 2**64)
        h: np.ndarray
        words = np.ascontiguousarray(rows[:, : length // 8 * 8]).view("<u8")
        done = 0  # words read
        if length >= 32:
            v = [
                np.full(n, s + _P1 + _P2, np.uint64),
                np.full(n, s + _P2, np.uint64),
                np.full(n, s, np.uint64),
                np.full(n, s - _P1, np.uint64),
            ]
            while (done + 4) * 8 <= length:
                for lane in range(4):
                    v[lane] = _round(v[lane], words[:, done + lane])
                done += 4
            h = _rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)
            for acc in v:
                h = (h ^ _round(np.zeros(n, np.uint64), acc)) * _P1 + _P4
        else:
            h = np.full(n, s + _P5, np.uint64)
        h = h + np.uint64(length)
        while (done + 1) * 8 <= length:
            h ^= _round(np.zeros(n, np.uint64), words[:, done])
            h = _rotl(h, 27) * _P1 + _P4
            done += 1
        at = done * 8
        if at + 4 <= length:
            word = np.ascontiguousarray(rows[:, at : at + 4]).view("<u4")[:, 0]
            h ^= word.astype(np.uint64) * _P1
            h = _rotl(h, 23) * _P2 + _P3
            at += 4
        while at < length:
            h ^= rows[:, at].astype(np.uint64) * _P5
            h = _rotl(h, 11) * _P1
            at += 1
        h ^= h >> np.uint64(33)
        h *= _P2
        h ^= h >> np.uint64(29)
        h *= _P3
        h ^= h >> np.uint64(32)
    hashed: np.ndarray = h.view(np.int64)
    return hashed


def _exact_sum(hashes: np.ndarray) -> int:
    """The exact sum of signed 64-bit ``hashes`` (as Spark's decimal sum gives it): each
    split in a high and a low half, whose sums fit in 64 bits for 2**31 values."""
    high = (hashes >> np.int64(32)).sum(dtype=np.int64)
    low = (hashes & np.int64(0xFFFFFFFF)).sum(dtype=np.int64)
    return int(high) * 2**32 + int(low)


def _chunk_sum(chunk: Any) -> int | None:
    import pyarrow as pa

    kind = chunk.type
    if pa.types.is_int8(kind) or pa.types.is_int16(kind) or pa.types.is_int32(kind):
        values = chunk.to_numpy(zero_copy_only=False).astype("<i4")
        return _exact_sum(xxhash64(values.view(np.uint8).reshape(-1, 4)))
    if pa.types.is_int64(kind):
        values = chunk.to_numpy(zero_copy_only=False).astype("<i8")
        return _exact_sum(xxhash64(values.view(np.uint8).reshape(-1, 8)))
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        chunk = chunk.cast(pa.large_string())
        _, offsets_buffer, data_buffer = chunk.buffers()
        offsets = np.frombuffer(offsets_buffer, np.int64)[
            chunk.offset : chunk.offset + len(chunk) + 1
        ]
        data = (
            np.frombuffer(data_buffer, np.uint8)
            if data_buffer is not None
            else np.zeros(0, np.uint8)
        )
        lengths = np.diff(offsets)
        total = 0
        for length in np.unique(lengths):
            starts = offsets[:-1][lengths == length]
            rows = data[starts[:, None] + np.arange(int(length))]
            total += _exact_sum(xxhash64(rows.reshape(len(starts), int(length))))
        return total
    return None


def id_hash_sum_of(ids: Any) -> int | None:
    """The sum of Spark's ``xxhash64`` of each of ``ids`` (a pyarrow Array or
    ChunkedArray without nulls) as an exact integer; None for a type this does not
    hash as Spark does (then the write's figures are compared with the check's row
    count alone, and the input's files with their state at the check)."""
    import pyarrow as pa

    chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
    total = 0
    for chunk in chunks:
        found = _chunk_sum(chunk)
        if found is None:
            return None
        total += found
    return total
