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


# -- a resume reads the records done again and checks them (issue 48, item 8) ------------------

def _write_input(path, fmt, texts):
    """`texts` as one input of format `fmt`; Parquet uncompressed and without dictionaries, so two
    rows of equal length swap places with the file's size kept."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [t.split()[0] for t in texts], "text": texts}), path, compression="none",
                       use_dictionary=False)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": t.split()[0], "text": t}) + "\n" for t in texts))
    else:
        path.write_text("".join(t + "\n" for t in texts))


@pytest.mark.parametrize("fmt", ["jsonl", "text", "parquet"])
@pytest.mark.parametrize("shard", [(0, 1), (1, 3)])
def test_a_resume_reads_the_records_done_again_and_refuses_them_changed(tmp_path, fmt, shard):
    """Every record carries the hash of all that was read up to it; a resume at record K reads the
    first K again and goes on only when they hash the same: with the records that follow exactly,
    never one twice or one lost. Two records swapped in place (the size kept, so no other check
    sees it) are refused when the resume is asked for, before anything is computed."""
    from pooling_pipeline.jobs.fingerprint import input_fingerprints

    texts = [f"r{i:03d} the text of record {i:03d}" for i in range(60)]
    first, second = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
    _write_input(first, fmt, texts[:30])
    _write_input(second, fmt, texts[30:])
    sources = expand_inputs([str(tmp_path / f"*.{fmt}")], fmt)
    snapshot = input_fingerprints(sources)
    whole = list(RecordReader(sources).records(shard, snapshot=snapshot))
    assert [r.text for r in whole] == texts[shard[0]::shard[1]]
    for k in (1, 9, len(whole) - 1, len(whole)):  # a resume point in the first file, in the second, at the end
        rest = RecordReader(sources).records(shard, skip=k, resume_sha256=whole[k - 1].read_sha256, snapshot=snapshot)
        assert [(r.index, r.id, r.text, r.read_sha256) for r in rest] == \
            [(r.index, r.id, r.text, r.read_sha256) for r in whole[k:]]
    size = first.stat().st_size
    swapped = list(texts[:30])
    swapped[3], swapped[27] = swapped[27], swapped[3]  # record 3 lies in what any shard's first 9 records read
    _write_input(first, fmt, swapped)
    assert first.stat().st_size == size
    with pytest.raises(InputError, match=r"the inputs differ from the ones the job began with: what it read for its "
                                         r"first 9 records of this shard \(read up to .* (line|row) \d+\) hashes "
                                         "differently now"):
        RecordReader(sources).records(shard, skip=9, resume_sha256=whole[8].read_sha256, snapshot=snapshot)


def test_a_stream_is_checked_as_it_always_was(monkeypatch):
    """A stream's records hash as its bytes (what an older run committed for streams, so its
    resumes still check); another stream's first records are refused, naming it a stream."""
    import hashlib

    lines = [json.dumps({"id": f"s{i}", "text": f"text {i}"}) + "\n" for i in range(20)]

    def stdin_records(text, **kw):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
        return RecordReader(expand_inputs(["-"], "jsonl")).records(**kw)

    whole = list(stdin_records("".join(lines)))
    assert whole[4].read_sha256 == hashlib.sha256("".join(lines[:5]).encode()).hexdigest()
    assert [r.id for r in stdin_records("".join(lines), skip=5, resume_sha256=whole[4].read_sha256)] == \
        [f"s{i}" for i in range(5, 20)]
    with pytest.raises(InputError, match="the input stream differs from the one the job began with"):
        stdin_records("".join(reversed(lines)), skip=5, resume_sha256=whole[4].read_sha256)


def test_an_image_folder_resumes_at_its_records_and_keeps_its_listing_check(tmp_path):
    """A folder of images: a resume goes on at the images it had not done (their names are in the
    running hash); what it checks of the images themselves stays the folder's listing."""
    from pooling_pipeline.jobs.fingerprint import changed_input, input_fingerprints
    from pooling_pipeline.jobs.image_records import ImageRecordReader, expand_job_inputs

    folder = tmp_path / "photos"
    (folder / "a").mkdir(parents=True)
    names = ["a/1.png", "a/2.jpg", "b.png", "c.webp", "d.png"]
    for n, name in enumerate(names):
        (folder / name).write_bytes(b"not decoded here %d" % n)
    sources = expand_job_inputs([str(folder)], "auto", None, lambda: "image")
    snapshot = input_fingerprints(sources)
    whole = list(ImageRecordReader(sources, None).records(snapshot=snapshot))
    assert [r.id for r in whole] == names
    rest = ImageRecordReader(sources, None).records(skip=2, resume_sha256=whole[1].read_sha256, snapshot=snapshot)
    assert [(r.id, r.text) for r in rest] == [(r.id, r.text) for r in whole[2:]]
    (folder / "a" / "2.jpg").write_bytes(b"rewritten")
    assert "input folder" in changed_input(snapshot, input_fingerprints(sources))
