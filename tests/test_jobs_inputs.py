"""pipeline-run's input reading, without a model: text as people write files (CR, CRLF, BOM,
invalid UTF-8), stdin, FIFOs, names with glob characters, bad records, the id rule, shards."""

import io
import json
import os
import sys
import threading

import pytest

from pooling_pipeline.jobs.job_errors import InputError, UsageError
from pooling_pipeline.jobs.records import RecordReader, expand_inputs


def read(paths, input_format="auto", **kw):
    shard = kw.pop("shard", (0, 1))
    return list(RecordReader(expand_inputs([str(p) for p in paths], input_format), **kw).records(shard))


def test_lone_cr_is_text_crlf_ends_a_line_and_a_bom_is_skipped(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"\xef\xbb\xbfone\rstill one\r\ntwo\n")
    records = read([text])
    assert [r.text for r in records] == ["one\rstill one", "two"]  # 2 lines, 2 records; no BOM in the text
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "x"}\r\n{"id": "b", "text": "y"}\r\n')
    assert [(r.id, r.text, r.error) for r in read([jsonl])] == [("a", "x", None), ("b", "y", None)]
    one = tmp_path / "one.jsonl"
    one.write_bytes(b'\xef\xbb\xbf{"id": "only", "text": "z"}\n')  # the BOM'd first record decides the ids
    assert [r.id for r in read([one])] == ["only"]


def test_invalid_utf8_is_the_error_of_its_line_not_of_the_file(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"fine\nbad \xff byte\nalso fine\n")
    records = read([path])
    assert [r.text for r in records] == ["fine", None, "also fine"]
    assert "not valid UTF-8" in records[1].error and records[1].where == f"{path} line 2"


def test_stdin_is_text_unless_declared_jsonl(monkeypatch):
    data = b'{"id": "x", "text": "braces"}\nplain\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    records = read(["-"])
    assert [(r.id, r.text) for r in records] == [("stdin:1", '{"id": "x", "text": "braces"}'), ("stdin:2", "plain")]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    records = read(["-"], "jsonl", id_field=None)
    assert records[0].text == "braces" and "not valid JSON" in records[1].error


def test_a_fifo_is_streamed(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    lines = [json.dumps({"id": f"f{i}", "text": f"text {i}"}) + "\n" for i in range(50)]

    def feed():
        with open(fifo, "w") as f:
            f.writelines(lines)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        sources = expand_inputs([str(fifo)])
        assert sources[0].stream and sources[0].format == "jsonl"
        reader = RecordReader(sources)
        reader.probe()  # reads the first lines; they must not be lost
        records = list(reader.records())
    finally:
        writer.join(10)
    assert [r.id for r in records] == [f"f{i}" for i in range(50)]


def test_an_existing_name_with_glob_characters_is_that_file(tmp_path):
    (tmp_path / "d[1].txt").write_text("the bracketed one\n")
    (tmp_path / "d1.txt").write_text("the one a glob would match\n")
    assert [r.text for r in read([tmp_path / "d[1].txt"])] == ["the bracketed one"]
    assert [r.text for r in read([tmp_path / "d?.txt"])] == ["the one a glob would match"]  # a real glob still globs


def test_bad_records_are_records_with_an_error_and_their_place(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": "a", "text": "ok"}\n'
                     b'{"id": "b", "text": null}\n'
                     b'{"id": "c", "text": 7}\n'
                     b'{"id": "d", "text": oops}\n'
                     b'{"text": "no id"}\n'
                     b'{"id": "f", "text": "caf\xc3\xa9 \xff"}\n'
                     b'\n'
                     b'{"id": "g", "text": "ok again"}\n')
    records = read([path])
    assert [r.index for r in records] == list(range(7))  # a blank line is no record
    assert [r.error is None for r in records] == [True, False, False, False, False, False, True]
    assert "must be a string, got NoneType" in records[1].error and "got int" in records[2].error
    assert "not valid JSON" in records[3].error
    assert "no field 'id'" in records[4].error and records[4].line == 5  # not a silent file:line id
    assert "not valid UTF-8" in records[5].error and records[5].line == 6
    assert records[6].line == 8 and records[6].where == f"{path} line 8 (id 'g')"


def test_ids_come_from_the_first_record_once(tmp_path):
    with_ids = tmp_path / "a.jsonl"
    with_ids.write_text('{"id": "x", "text": "t"}\n')
    without = tmp_path / "b.jsonl"
    without.write_text('{"text": "u"}\n')
    reader = RecordReader(expand_inputs([str(without), str(with_ids)]))
    assert [r.id for r in reader.records()] == [f"{without}:1", f"{with_ids}:1"]  # the first record decides
    assert reader.id_field is None
    reader = RecordReader(expand_inputs([str(with_ids), str(without)]))
    with pytest.raises(InputError, match="--id-field 'id' matches nothing"):
        reader.probe()
    text = tmp_path / "c.txt"
    text.write_text("line\n")
    with pytest.raises(UsageError, match="read as text"):
        RecordReader(expand_inputs([str(text)]), id_field="url").probe()


def test_text_field_matching_nothing_is_found_by_the_probe(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "body": "b"}) + "\n" for i in range(5)))
    with pytest.raises(InputError, match="--text-field 'text' matches nothing in its first 5 records"):
        RecordReader(expand_inputs([str(path)])).probe()


def test_shards_keep_file_line_and_id(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": "t" if i != 5 else None}) + "\n" for i in range(8)))
    records = read([path], shard=(1, 2))
    assert [r.id for r in records] == ["r1", "r3", "r5", "r7"]
    assert records[2].error and records[2].where == f"{path} line 6 (id 'r5')" and records[2].index == 5


def test_a_parquet_input_of_another_size_than_its_fingerprint_is_refused(tmp_path):
    """A Parquet file is read as one version: one rewritten since its fingerprint is refused, naming it."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from pooling_pipeline.jobs.fingerprint import input_fingerprints

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["x", "y"]}), path)
    sources = expand_inputs([str(path)])
    snapshot = input_fingerprints(sources)
    assert [r.id for r in RecordReader(sources).records(snapshot=snapshot)] == ["a", "b"]
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["x", "y", "z"]}), path)
    with pytest.raises(InputError, match=f"input {path} changed while the job read it"):
        list(RecordReader(sources).records(snapshot=snapshot))


def test_the_snapshot_ends_at_the_fingerprinted_size_and_keeps_a_crlf_line_whole(tmp_path):
    from pooling_pipeline.jobs.fingerprint import input_fingerprints

    path = tmp_path / "lines.txt"
    path.write_bytes(b"one\r\ntwo")
    sources = expand_inputs([str(path)])
    snapshot = input_fingerprints(sources)
    with path.open("ab") as f:
        f.write(b"\r\nthree\n")  # "two" was whole: its line end came after the fingerprint
    assert [r.text for r in RecordReader(sources).records(snapshot=snapshot)] == ["one", "two"]
    assert [r.text for r in RecordReader(sources).records()] == ["one", "two", "three"]  # without one: all of it


def test_the_progress_estimate_counts_records_across_formats(tmp_path):
    """The progress bar's total (pipeline-run): Parquet inputs count their rows exactly, JSONL ones
    are estimated from the records per byte read so far -- the two never summed as one unit -- and
    a shard gets its share."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from helpers import SAMPLE

    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    table = tmp_path / "more.parquet"
    rows = [json.loads(line) for line in lines[:301]]
    pq.write_table(pa.table({"id": [f"pq-{r['id']}" for r in rows], "text": [r["text"] for r in rows]}), table)
    reader = RecordReader(expand_inputs([str(SAMPLE), str(table)]))
    records = reader.records()
    for _ in range(120):  # part of the JSONL file read
        next(records)
    total, exact = reader.estimated_total()
    # (the Parquet rows whole, the JSONL part at least what was read; an estimate, not a count)
    assert not exact and 301 + 120 <= total <= 2 * (len(lines) + 301), total
    rest = sum(1 for _ in records)
    assert 120 + rest == len(lines) + 301
    assert reader.estimated_total() == (len(lines) + 301, True)  # all read: exact
    assert reader.estimated_total((1, 2)) == ((len(lines) + 301) // 2, True)
