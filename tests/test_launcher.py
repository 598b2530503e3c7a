"""pipeline-run on files: formats, precisions, shards, crash + resume, bad files."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import corpus
import numpy as np
import pytest
from helpers import SAMPLE
from pooling_pipeline import load_results

TOL = 1e-5


def _run(args, expect_rc=0, **kw):
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--quiet", *args], capture_output=True,
                            text=True, env=env, timeout=300, **kw)
    assert result.returncode == expect_rc, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def records():
    texts = corpus.sentences(150, seed=81) + corpus.medium_texts(20, seed=82)
    return [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("in") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def expected(st_model, records):
    return st_model.encode([r["text"] for r in records])


def test_bundled_sample_to_disk_and_back(tmp_path, st_model):
    out = tmp_path / "out"
    result = _run(["--output", str(out), "--limit", "120", "--chunk-rows", "50"])
    assert "embedded 120 records" in result.stdout and "peak RSS" in result.stdout
    ids, data = load_results(out)
    assert data.shape == (120, 384) and data.dtype == np.float32 and len(ids) == 120
    manifest = json.loads((out / "manifest.json").read_text())
    assert [c["rows"] for c in manifest["chunks"]] == [50, 50, 20] and manifest["complete"]
    assert manifest["task"] == "embed" and len(manifest["model_sha256"]) == 64
    sample = [json.loads(line) for line in open(SAMPLE)][:120]
    assert ids == [r["id"] for r in sample]
    assert np.abs(data - st_model.encode([r["text"] for r in sample])).max() <= TOL


def test_every_input_format(tmp_path, records, jsonl, expected, st_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [r["text"] for r in records]
    lines = [t.replace("\n", " ") for t in texts]  # plain text: one record per line
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"id": [r["id"] for r in records], "text": texts}), tmp_path / "corpus.parquet")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:70]))
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[70:]))
    for name, inputs in [("jsonl", [str(jsonl)]), ("text", [str(tmp_path / "lines.txt")]),
                         ("parquet", [str(tmp_path / "corpus.parquet")]), ("dir", [str(folder)]),
                         ("glob", [str(folder / "*.jsonl")])]:
        out = tmp_path / f"out-{name}"
        _run(["--input", *inputs, "--output", str(out), "--chunk-rows", "64"])
        ids, data = load_results(out)
        if name == "text":
            assert np.abs(data - st_model.encode(lines)).max() <= TOL
            assert ids[:2] == [f"{tmp_path / 'lines.txt'}:1", f"{tmp_path / 'lines.txt'}:2"]
        else:
            assert np.abs(data - expected).max() <= TOL, name
            assert ids == [r["id"] for r in records], name
    out = tmp_path / "out-parquet-format"
    _run(["--input", str(jsonl), "--output", str(out), "--format", "parquet", "--chunk-rows", "64"])
    ids, data = load_results(out)
    assert np.abs(data - expected).max() <= TOL and ids == [r["id"] for r in records]


def test_precisions_round_trip(tmp_path, jsonl, expected):
    for precision in ("float16", "int8", "binary"):
        out = tmp_path / precision
        _run(["--input", str(jsonl), "--output", str(out), "--precision", precision, "--chunk-rows", "100"])
        _, data = load_results(out)
        if precision == "float16":
            assert data.dtype == np.float16 and np.abs(data.astype(np.float32) - expected).max() < 1e-3
        elif precision == "int8":
            cal = json.loads((out / "manifest.json").read_text())["int8"]
            step = np.asarray(cal["steps"])
            inside = (expected >= np.asarray(cal["starts"])) & (expected <= np.asarray(cal["starts"]) + 255 * step)
            assert data.dtype == np.float32
            assert np.all(np.abs(data - expected)[inside] <= (step / 2 + 1e-6)[None, :].repeat(len(data), 0)[inside])
        else:
            assert data.dtype == np.uint8 and np.array_equal(data, np.packbits(expected > 0, axis=-1))


def test_shards_together_equal_the_whole(tmp_path, jsonl, expected, records):
    outs = [tmp_path / f"shard{i}" for i in range(3)]
    for i, out in enumerate(outs):
        _run(["--input", str(jsonl), "--output", str(out), "--shard", f"{i}/3", "--chunk-rows", "16"])
    assert [len(load_results(o)[0]) for o in outs] == [57, 57, 56]
    ids, data = load_results(*outs)
    assert ids == [r["id"] for r in records]
    assert np.abs(data - expected).max() <= TOL


def test_sigkill_then_resume_gives_identical_output(tmp_path, jsonl):
    clean = tmp_path / "clean"
    _run(["--input", str(jsonl), "--output", str(clean), "--chunk-rows", "10", "--precision", "int8"])
    clean_ids, clean_data = load_results(clean)
    env = dict(os.environ)
    rng = random.Random(3)
    for trial in range(3):
        out = tmp_path / f"crash{trial}"
        args = [sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--quiet", "--input", str(jsonl),
                "--output", str(out), "--chunk-rows", "10", "--precision", "int8", "--resume"]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        wanted = rng.randint(1, 12)  # chunks committed before the kill
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                done = len(json.loads((out / "manifest.json").read_text())["chunks"])
            except (OSError, ValueError):
                done = 0
            if done >= wanted:
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its whole process group
        proc.wait()
        _run(["--input", str(jsonl), "--output", str(out), "--chunk-rows", "10", "--precision", "int8", "--resume"])
        ids, data = load_results(out)
        assert ids == clean_ids  # no record missing, none twice
        # The resumed run batches its records differently, and float results depend on batch
        # composition (in the last bits): after int8 rounding a value may land one step away.
        step = max(json.loads((out / "manifest.json").read_text())["int8"]["steps"])
        assert np.abs(data - clean_data).max() <= step * 1.001 + 1e-6


def test_resume_refuses_a_different_job_and_a_plain_rerun_refuses_to_overwrite(tmp_path, jsonl):
    out = tmp_path / "job"
    _run(["--input", str(jsonl), "--output", str(out), "--limit", "10"])
    result = _run(["--input", str(jsonl), "--output", str(out), "--truncate", "64", "--resume"], expect_rc=2)
    assert "different 'params'" in result.stderr
    result = _run(["--input", str(jsonl), "--output", str(out)], expect_rc=2)
    assert "already holds results" in result.stderr


def test_bad_files_name_the_file_and_line(tmp_path):
    cases = {
        "broken.jsonl": ('{"text": "fine"}\n{"text": oops}\n', "broken.jsonl line 2: not valid JSON"),
        "missing.jsonl": ('{"text": "fine"}\n{"body": "x"}\n', "missing.jsonl line 2: no field 'text'"),
        "wrongtype.jsonl": ('{"text": 5}\n', "wrongtype.jsonl line 1: field 'text' must be a string"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content)
        result = _run(["--input", str(tmp_path / name), "--output", str(tmp_path / f"o-{name}")], expect_rc=2)
        assert message in result.stderr, result.stderr
    result = _run(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")], expect_rc=2)
    assert "does not exist" in result.stderr


def test_errors_return_lists_failed_records_and_goes_on(tmp_path, st_model):
    long_doc = corpus.long_document(20_000, seed=83)
    rows = [{"id": "a", "text": "short one"}, {"id": "b", "text": long_doc}, {"id": "c", "text": "short two"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    _run(["--input", str(path), "--output", str(out), "--long-inputs", "error", "--errors", "return"])
    ids, data = load_results(out)
    assert ids == ["a", "c"] and np.abs(data - st_model.encode(["short one", "short two"])).max() <= TOL
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == ["b"] and "long_inputs='error'" in errors[0]["error"]


def test_stdin_plain_text(tmp_path, st_model):
    lines = ["first line of text", "second line", "third, with more words in it"]
    out = tmp_path / "stdin-out"
    _run(["--input", "-", "--output", str(out)], input="\n".join(lines) + "\n")
    ids, data = load_results(out)
    assert ids == ["stdin:1", "stdin:2", "stdin:3"]
    assert np.abs(data - st_model.encode(lines)).max() <= TOL


def test_progress_bar_counts_records_without_reading_the_inputs_ahead(tmp_path):
    """The bar is not sized by reading every input beforehand (that read inputs of up to 2 GiB
    whole, and counted the blank JSONL lines the reader skips): it counts records done."""
    rows = [{"id": str(i), "text": f"record number {i}"} for i in range(5)]
    path = tmp_path / "gappy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # a blank line after each record
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--input", str(path),
                             "--output", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    bar = result.stderr.replace("\r", "\n")
    assert "5records" in bar.replace(" ", "") or "5 records" in bar
    assert "/10" not in bar  # no total that counts the blank lines
    assert load_results(tmp_path / "out")[0] == [r["id"] for r in rows]
