"""The journal's files as a hostile disk leaves them: damaged bytes anywhere are set aside and
named, never trusted, so a resume sends those rows again instead of taking another row's
answer for theirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from timewheel.spark.delivery.journal import (
    JOURNAL,
    JournalWriter,
    compact,
    journal_rows,
    read_batches,
    run_dir,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

BATCH = 200
#: The column numbering the test batches' rows.
ORDINAL = "row"


def batch(first: int, status: str = "ok") -> pa.RecordBatch:
    ordinals = list(range(first, first + BATCH))
    return pa.record_batch(
        {
            ORDINAL: ordinals,
            "status": [status] * BATCH,
            "response": [f"answer for row {i} " * 4 for i in ordinals],
        }
    )


def write_run(out: Path, run: int, firsts: list[int]) -> Path:
    writer = JournalWriter(str(run_dir(out, run)))
    for first in firsts:
        writer.write(batch(first))
    writer.close()
    (file,) = run_dir(out, run).glob("*.arrow")
    return file


def frame_heads(path: Path) -> list[int]:
    """Where the file's frames start: the schema's, then one a batch."""
    data = path.read_bytes()
    return [i for i in range(len(data)) if data.startswith(b"TWJ1", i)]


def overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_garbage_in_a_batch_sets_that_batch_aside_and_keeps_the_rest(tmp_path: Path) -> None:
    file = write_run(tmp_path, 1, [0, 200, 400, 600])
    overwrite(file, frame_heads(file)[2] + 1000, b"\x5a" * 200)  # inside batch 1's bytes
    damaged: list[str] = []
    got = list(read_batches(file, damaged))
    assert len(got) == 3
    assert len(damaged) == 1 and "fails its checksum" in damaged[0], damaged
    originals = {b.column(ORDINAL)[0].as_py(): b for b in (batch(f) for f in (0, 200, 400, 600))}
    for b in got:  # every batch read is one that was written, byte for byte
        assert b.equals(originals[b.column(ORDINAL)[0].as_py()])


def test_no_damaged_byte_anywhere_yields_a_batch_that_was_not_written(tmp_path: Path) -> None:
    # Flip one byte at a time over the whole file (every 7th position): a reader may lose
    # batches, never invent or alter one. Before checksums, a flipped ordinal was trusted.
    file = write_run(tmp_path, 1, [0, 200, 400])
    pristine = file.read_bytes()
    written = [batch(f) for f in (0, 200, 400)]
    for at in range(0, len(pristine), 7):
        damaged_bytes = bytearray(pristine)
        damaged_bytes[at] ^= 0xFF
        file.write_bytes(bytes(damaged_bytes))
        damaged: list[str] = []
        got = list(read_batches(file, damaged))
        assert all(any(b.equals(w) for w in written) for b in got), at
        assert len(got) < 3 and damaged, at  # every byte is covered by a checksum or a header


def test_a_broken_frame_header_loses_the_rest_of_its_file_but_names_it(tmp_path: Path) -> None:
    file = write_run(tmp_path, 1, [0, 200, 400])
    heads = frame_heads(file)
    assert len(heads) == 4
    overwrite(file, heads[2], b"\x00" * 4096)  # batch 1's header and more
    damaged: list[str] = []
    got = list(read_batches(file, damaged))
    assert [b.column(ORDINAL)[0].as_py() for b in got] == [0]
    assert damaged and all(file.name in d for d in damaged)
    assert journal_rows(run_dir(tmp_path, 1)) == sum(b.num_rows for b in got)


def test_a_file_cut_short_is_not_damage(tmp_path: Path) -> None:
    file = write_run(tmp_path, 1, [0, 200])
    os.truncate(file, file.stat().st_size - 10)
    damaged: list[str] = []
    assert [b.num_rows for b in read_batches(file, damaged)] == [BATCH]
    assert damaged == []


def test_compaction_leaves_out_damaged_batches_and_says_so(tmp_path: Path) -> None:
    file = write_run(tmp_path, 1, [0, 200, 400])
    overwrite(file, file.stat().st_size - 500, b"garbage!" * 8)  # in the last batch
    damaged: list[str] = []
    (done,) = compact(tmp_path, damaged)
    assert sorted(pq.read_table(done).column(ORDINAL).to_pylist()) == list(range(400))
    assert len(damaged) == 1 and "run-0001/" in damaged[0]


@pytest.mark.parametrize("how", ["cut short", "pages changed"])
def test_a_damaged_compacted_file_is_set_aside_and_named(tmp_path: Path, how: str) -> None:
    write_run(tmp_path, 1, [0, 200])
    write_run(tmp_path, 2, [400])
    files = compact(tmp_path)
    assert [f.name for f in files] == ["run-0001.parquet", "run-0002.parquet"]
    broken = files[0]
    if how == "cut short":
        os.truncate(broken, broken.stat().st_size // 2)
    else:  # the data pages, not the footer: only the page checksums can tell
        overwrite(broken, 200, b"\xff" * 64)
    damaged: list[str] = []
    assert [f.name for f in compact(tmp_path, damaged)] == ["run-0002.parquet"]
    assert len(damaged) == 1 and damaged[0].startswith("run-0001.parquet: "), damaged
    assert (tmp_path / JOURNAL / "damaged-run-0001.parquet").exists()
    assert compact(tmp_path) == [tmp_path / JOURNAL / "run-0002.parquet"]  # settled
