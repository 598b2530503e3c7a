"""pipeline-run's output directory: Parquet that standard readers load as is, int8 accuracy,
load_results refusing partial / mixed / corrupted results, one writer per directory, checks of
--output before the model loads, and resumes refused on changed inputs."""

import fcntl
import json
import os
import shutil
from pathlib import Path

import corpus
import numpy as np
import pytest
from helpers import rewrite_in_place
from test_launcher import TOL, FakePipeline, manifest_of, run_launcher

from pooling_pipeline import load_results


@pytest.fixture(scope="module")
def records():
    texts = corpus.sentences(60, seed=91)
    return [{"id": f"r{i}", "text": t, "title": f"title {i}"} for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def expected(st_model, records):
    return st_model.encode([r["text"] for r in records])


@pytest.fixture(scope="module")
def npy_out(tmp_path_factory, jsonl):
    out = tmp_path_factory.mktemp("npy") / "out"
    run_launcher(["--input", str(jsonl), "--output", str(out), "--chunk-rows", "20"])
    return out


@pytest.fixture(scope="module")
def parquet_out(tmp_path_factory, records):
    """A Parquet job with a kept field and a failed record (so __job__/ holds errors files too)."""
    rows = [dict(r) for r in records]
    rows[7]["text"] = None
    path = tmp_path_factory.mktemp("pin") / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path_factory.mktemp("parquet") / "out"
    run_launcher(["--input", str(path), "--output", str(out), "--format", "parquet", "--keep-fields", "title",
                  "--errors", "return", "--chunk-rows", "25"])
    assert (out / "__job__" / "errors.jsonl").exists()
    return out


@pytest.mark.slow
def test_parquet_output_reads_as_is_with_pandas_pyarrow_and_datasets(parquet_out, expected, tmp_path, monkeypatch):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.dataset as pads

    keep = [i for i in range(60) if i != 7]
    frame = pd.read_parquet(parquet_out).sort_values("index")
    assert list(frame["id"]) == [f"r{i}" for i in keep] and list(frame["title"]) == [f"title {i}" for i in keep]
    assert np.abs(np.stack(frame["embedding"].to_list()) - expected[keep]).max() <= TOL
    dataset = pads.dataset(parquet_out)
    assert dataset.schema.field("embedding").type == pa.list_(pa.float32(), 384)  # fixed-size, not bytes
    assert dataset.count_rows() == 59
    datasets = pytest.importorskip("datasets", reason="the test extra's `datasets` is not installed")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    loaded = datasets.load_dataset("parquet", data_dir=str(parquet_out), cache_dir=str(tmp_path / "hf-cache"))["train"]
    assert loaded.num_rows == 59 and loaded.features["embedding"].length == 384
    order = np.argsort(loaded["index"])
    assert np.abs(np.asarray(loaded["embedding"], dtype=np.float32)[order] - expected[keep]).max() <= TOL
    ids, data = load_results(parquet_out)
    assert ids == [f"r{i}" for i in keep] and np.abs(data - expected[keep]).max() <= TOL


@pytest.fixture(scope="module")
def sentences(tmp_path_factory, st_model):
    texts = corpus.sentences(200, seed=92)
    path = tmp_path_factory.mktemp("int8") / "sentences.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path, st_model.encode(texts)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_rows, calibration_rows", [(1, None), (10, None), (10, 100)])
def test_int8_stays_accurate_at_any_chunk_size(tmp_path, sentences, chunk_rows, calibration_rows):
    """int8 ranges come from a sample of a fixed size (default 1000 rows, or the whole input when
    shorter), not from the first chunk: with --chunk-rows 1 that gave 499/500 rows a cosine < 0.9
    to float32. (10, 100): rows after a 100-row sample, some clipped, still hold >= 0.99."""
    path, expected = sentences
    out = tmp_path / "out"
    extra = ["--int8-calibration-rows", str(calibration_rows)] if calibration_rows else []
    run_launcher(["--input", str(path), "--output", str(out), "--precision", "int8", "--chunk-rows", str(chunk_rows),
                  *extra])
    _, data = load_results(out)
    cosine = np.sum(data * expected, axis=1) / (np.linalg.norm(data, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.99, cosine.min()
    assert manifest_of(out)["int8"]["sample_rows"] == (calibration_rows or 200)


def _copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(out, change):
    path = out / "__job__" / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.slow
def test_a_corrupted_chunk_is_an_error_naming_the_file(npy_out, parquet_out, tmp_path):
    assert len(manifest_of(npy_out)["chunks"]) == 3
    flipped = _copy(npy_out, tmp_path, "flipped")
    data = bytearray((flipped / "data-00001.npy").read_bytes())
    data[-5] ^= 0x10  # one bit of one float
    (flipped / "data-00001.npy").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="data-00001.npy: its sha256 differs"):
        load_results(flipped)
    short = _copy(npy_out, tmp_path, "short")
    ids = (short / "ids-00002.json").read_text()
    (short / "ids-00002.json").write_text(ids[: len(ids) // 2])
    with pytest.raises(ValueError, match="ids-00002.json"):
        load_results(short)
    pflip = _copy(parquet_out, tmp_path, "pflip")
    data = bytearray((pflip / "data-00001.parquet").read_bytes())
    data[len(data) // 3] ^= 0x01
    (pflip / "data-00001.parquet").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="data-00001.parquet"):
        load_results(pflip)


def test_a_broken_manifest_is_an_error_naming_it(npy_out, tmp_path):
    lacking = _copy(npy_out, tmp_path, "lacking")
    _edit_manifest(lacking, lambda m: m.pop("chunks"))
    with pytest.raises(ValueError, match=r"manifest.json: the manifest lacks \['chunks'\]"):
        load_results(lacking)
    chunk_lacking = _copy(npy_out, tmp_path, "chunk-lacking")
    _edit_manifest(chunk_lacking, lambda m: m["chunks"][1].pop("sha256"))
    with pytest.raises(ValueError, match="chunk 1 lacks"):
        load_results(chunk_lacking)
    garbled = _copy(npy_out, tmp_path, "garbled")
    (garbled / "__job__" / "manifest.json").write_text('{"task": "embed", ')
    with pytest.raises(ValueError, match="manifest.json: not valid JSON"):
        load_results(garbled)


def test_load_results_refuses_partial_twice_and_mixed(npy_out, tmp_path):
    unfinished = _copy(npy_out, tmp_path, "unfinished")
    _edit_manifest(unfinished, lambda m: m.update(complete=False))
    with pytest.raises(ValueError, match="unfinished job"):
        load_results(unfinished)
    assert len(load_results(unfinished, allow_partial=True)[0]) == 60
    with pytest.raises(ValueError, match="given twice"):
        load_results(npy_out, str(npy_out) + "/")
    with pytest.raises(ValueError, match="both hold shard 0/1"):
        load_results(npy_out, _copy(npy_out, tmp_path, "same-shard"))
    other = _copy(npy_out, tmp_path, "float16-job")
    _edit_manifest(other, lambda m: (m["params"].update(precision="float16"), m.update(shard=[1, 2])))
    with pytest.raises(ValueError, match="different jobs.*precision"):
        load_results(npy_out, other)
    other_model = _copy(npy_out, tmp_path, "other-model")
    _edit_manifest(other_model, lambda m: m.update(model_sha256="0" * 64, shard=[1, 1]))
    with pytest.raises(ValueError, match="different jobs.*model_sha256"):
        load_results(npy_out, other_model)


@pytest.fixture
def no_model(monkeypatch):
    """pipeline-run in-process with a stand-in for the model (FakePipeline), or none at all."""
    import pooling_pipeline
    from pooling_pipeline.jobs import launcher

    monkeypatch.setattr(pooling_pipeline, "Pipeline", FakePipeline)
    monkeypatch.setattr(launcher, "format_stats", lambda stats: [])  # the stand-in has no stage statistics
    return monkeypatch


def test_one_writer_per_output_directory(tmp_path, jsonl, no_model, capsys):
    from pooling_pipeline.jobs.launcher import main

    out = tmp_path / "out"
    (out / "__job__").mkdir(parents=True)
    with open(out / "__job__" / "lock", "w") as held:  # another run holds the directory
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")
        held.flush()
        assert main(["--input", str(jsonl), "--output", str(out), "--quiet", "--resume"]) == 2
        assert f"in use by another pipeline-run (pid {os.getpid()})" in capsys.readouterr().err
        assert not (out / "__job__" / "manifest.json").exists()
    assert main(["--input", str(jsonl), "--output", str(out), "--quiet", "--resume"]) == 0  # the lock went with it
    assert manifest_of(out)["complete"]


def test_output_directory_is_checked_before_the_model_loads(tmp_path, jsonl, monkeypatch, capsys):
    import pooling_pipeline
    from pooling_pipeline.jobs import output_dir
    from pooling_pipeline.jobs.launcher import main

    def no_model(*a, **kw):
        raise AssertionError("the model was started")

    monkeypatch.setattr(pooling_pipeline, "Pipeline", no_model)
    a_file = tmp_path / "taken.txt"
    a_file.write_text("not a directory\n")
    assert main(["--input", str(jsonl), "--output", str(a_file), "--quiet"]) == 2
    assert "is a file" in capsys.readouterr().err
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    shutil.copy(jsonl, corpus_dir / "docs.jsonl")
    assert main(["--input", str(corpus_dir), "--output", str(corpus_dir / "out"), "--quiet"]) == 2
    assert "inside the input directory" in capsys.readouterr().err
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.access(read_only, os.W_OK):  # root writes anywhere: the check is what is tested, not the OS
        real = os.access
        monkeypatch.setattr(output_dir.os, "access",
                            lambda p, mode: False if str(p).startswith(str(read_only)) else real(p, mode))
    assert main(["--input", str(jsonl), "--output", str(read_only), "--quiet"]) == 2
    assert "is not writable" in capsys.readouterr().err


def test_resume_refuses_an_input_changed_since_the_job_began(tmp_path, records, no_model, capsys):
    from pooling_pipeline.jobs.launcher import main

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    assert main(["--input", str(path), "--output", str(out), "--quiet", "--limit", "20", "--chunk-rows", "10"]) == 0
    size = path.stat().st_size
    inserted = json.dumps({"id": "new", "text": "a record inserted at the top"}) + "\n"
    path.write_text(inserted + "".join(json.dumps(r) + "\n" for r in records))  # one record inserted in place
    capsys.readouterr()
    assert main(["--input", str(path), "--output", str(out), "--quiet", "--resume", "--chunk-rows", "10"]) == 3
    err = capsys.readouterr().err
    assert f"input {path} changed since the job began (size {size} then, {path.stat().st_size} now)" in err
    assert manifest_of(out)["records_done"] == 20  # nothing added to the old job


# -- the model's fingerprint covers every file that shapes the output (issue 25) ------------------

@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """A SentenceTransformer whose last module (2_Dense/) holds its own small weights."""
    import model_zoo as zoo

    return Path(zoo.build_bert_dense(tmp_path_factory.mktemp("dense")))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _job_on_a_model_copy(tmp_path, records, dense_model):
    """A copy of the model (to change), the records as JSONL; returns the copy, the output
    directory and the job's arguments."""
    model = tmp_path / "model"
    shutil.copytree(dense_model, model)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    return model, out, ["--input", str(path), "--output", str(out), "--model", str(model), "--quiet", "--chunk-rows", "10"]


@pytest.mark.parametrize("changed", ["2_Dense/model.safetensors", "2_Dense/config.json", "tokenizer.json"])
def test_resume_refuses_a_model_changed_in_any_of_its_files(tmp_path, records, dense_model, changed, no_model,
                                                            capsys):
    """--limit, then a file in a module folder (or a tokenizer file) of the model changes, then
    --resume: refused (exit 2) naming the file, never rows from two models in one job."""
    from pooling_pipeline.jobs.launcher import main

    model, out, argv = _job_on_a_model_copy(tmp_path, records, dense_model)
    assert main([*argv, "--limit", "20"]) == 0
    assert changed in manifest_of(out)["model_files"]
    target = model / changed
    if changed.endswith(".json"):  # the same meaning to json.loads' eye would still be a change
        target.write_text(target.read_text().rstrip() + " \n")
    else:
        _flip_last_byte(target)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"the model changed since the job began (changed: {changed})" in err and "another --output" in err
    assert manifest_of(out)["records_done"] == 20  # nothing added to the old job


def test_resume_refuses_weights_rewritten_in_place_with_size_and_mtime_kept(tmp_path, records, dense_model, no_model,
                                                                            capsys):
    """The model's identity is the whole content of each file (a sample let a rewrite in place
    pass): the resume is refused, naming the weights file (issue 35, item 2)."""
    from pooling_pipeline.jobs.launcher import main

    model, out, argv = _job_on_a_model_copy(tmp_path, records, dense_model)
    assert main([*argv, "--limit", "20"]) == 0
    rewrite_in_place(model / "model.safetensors")
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    assert "the model changed since the job began (changed: model.safetensors)" in capsys.readouterr().err


def test_a_manifest_with_sampled_model_fingerprints_is_refused_clearly(tmp_path, records, dense_model, no_model,
                                                                       capsys):
    from pooling_pipeline.jobs.launcher import main

    model, out, argv = _job_on_a_model_copy(tmp_path, records, dense_model)
    assert main([*argv, "--limit", "20"]) == 0

    def older(m):  # what the sampling fingerprint wrote for a large file
        m["model_files"]["model.safetensors"] = "sampled:" + "0" * 64
        m["model_sha256"] = "1" * 64
    _edit_manifest(out, older)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    assert "fingerprinted large model files by samples" in capsys.readouterr().err


def test_a_model_unchanged_but_for_its_readme_resumes(tmp_path, records, dense_model, no_model):
    from pooling_pipeline.jobs.launcher import main

    model, out, argv = _job_on_a_model_copy(tmp_path, records, dense_model)
    assert main([*argv, "--limit", "20"]) == 0
    (model / "README.md").write_text("# edited\n")
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert main([*argv, "--resume"]) == 0
    assert manifest_of(out)["complete"] and manifest_of(out)["records_done"] == len(records)


def test_a_manifest_of_the_older_model_fingerprint_is_refused_clearly(tmp_path, records, dense_model, no_model,
                                                                       capsys):
    from pooling_pipeline.jobs.launcher import main

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    argv = ["--input", str(path), "--output", str(out), "--model", str(dense_model), "--quiet"]
    assert main([*argv, "--limit", "20"]) == 0

    def older(m):  # what the top-level-only fingerprint wrote: another hash, no per-file table
        m.pop("model_files")
        m["model_sha256"] = "0" * 64
    _edit_manifest(out, older)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "begun by an older pipeline-run whose model fingerprint covered only" in err and "Traceback" not in err


def test_the_model_fingerprint_follows_symlinks_and_names_files_by_their_place(tmp_path, dense_model):
    """A Hugging Face cache snapshot is links into blobs/: the content counts, under the link's name."""
    from pooling_pipeline.core.shared.content_hash import model_files

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    blob_of = {}
    for i, f in enumerate(sorted(p for p in dense_model.rglob("*") if p.is_file())):
        blob_of[f.relative_to(dense_model).as_posix()] = blob = blobs / f"blob{i}"
        shutil.copy(f, blob)
        link = snapshot / f.relative_to(dense_model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    real = model_files(str(dense_model))
    assert model_files(str(snapshot)) == real
    assert {"2_Dense/model.safetensors", "1_Pooling/config.json", "tokenizer.json", "modules.json"} <= set(real)
    assert "README.md" not in real
    _flip_last_byte(blob_of["2_Dense/model.safetensors"])
    linked = model_files(str(snapshot))
    assert [n for n in real if real[n] != linked[n]] == ["2_Dense/model.safetensors"]


# -- an input that changes while the job reads it (issue 25) -------------------------------------

def _lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture
def after_fingerprint(monkeypatch):
    """Runs `change(path)` right after the job fingerprints its inputs, before it reads them: the
    deterministic form of a file written to while the job runs."""
    from pooling_pipeline.jobs import fingerprint

    real = fingerprint.input_fingerprints

    def arm(path, change):
        def fingerprint_then_change(sources):
            prints = real(sources)
            change(path)
            return prints
        monkeypatch.setattr(fingerprint, "input_fingerprints", fingerprint_then_change)
    return arm


def test_an_input_appended_to_while_read_gives_the_records_it_had(tmp_path, records, no_model, after_fingerprint,
                                                                  capsys):
    from pooling_pipeline.jobs.launcher import main

    path = tmp_path / "docs.jsonl"
    path.write_text(_lines(records))
    extra = [{"id": f"late{i}", "text": f"appended {i}"} for i in range(25)]
    after_fingerprint(path, lambda p: p.open("a").write(_lines(extra) + '{"id": "half", "te'))
    out = tmp_path / "out"
    argv = ["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "7"]
    assert main(argv) == 0
    manifest = manifest_of(out)
    assert manifest["complete"] and manifest["records_done"] == len(records) and manifest["errors"] == 0
    ids, _ = load_results(out)
    assert ids == [r["id"] for r in records]  # exactly the fingerprinted records: no appended one, no fragment
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0  # the complete job stays complete, as load_results says
    captured = capsys.readouterr()
    assert "is complete" in captured.out and "has grown since the job began" in captured.err


def test_a_resume_after_an_append_finishes_the_job_on_the_records_it_began_with(tmp_path, records, no_model, capsys):
    from pooling_pipeline.jobs.launcher import main

    path = tmp_path / "docs.jsonl"
    path.write_text(_lines(records))
    out = tmp_path / "out"
    argv = ["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "10"]
    assert main([*argv, "--limit", "20"]) == 0
    with path.open("a") as f:
        f.write(_lines([{"id": "late", "text": "appended between runs"}]))
    assert main([*argv, "--resume"]) == 0
    assert load_results(out)[0] == [r["id"] for r in records]
    assert "has grown since the job began" in capsys.readouterr().err


def _finish_last_line_and_append(path):
    with path.open("a") as f:
        f.write('xt": "the rest of the line"}\n' + _lines([{"id": "later", "text": "more"}]))


def _truncate_to_half(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _rewrite_same_size(path):
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"r1"', b'"R1"', 1))


@pytest.mark.parametrize("change, message", [
    (_finish_last_line_and_append, "was being written when the job began: its line that ends the"),
    (_truncate_to_half, "shrank while it was read"),
    (_rewrite_same_size, "changed while it was read"),
])
def test_an_input_cut_or_rewritten_while_read_is_refused(tmp_path, records, no_model, after_fingerprint, change,
                                                         message, capsys):
    """Never a record made of half a line, nor a job of two versions of a file: exit 3, naming it."""
    from pooling_pipeline.jobs.launcher import main

    path = tmp_path / "docs.jsonl"
    text = _lines(records)
    path.write_text(text + '{"id": "half", "te' if change is _finish_last_line_and_append else text)
    after_fingerprint(path, change)
    out = tmp_path / "out"
    assert main(["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "10"]) == 3
    err = capsys.readouterr().err
    assert f"input {path} {message}" in err and "Traceback" not in err
    assert not manifest_of(out)["complete"]
    with pytest.raises(ValueError, match="unfinished job"):
        load_results(out)
    ids, _ = load_results(out, allow_partial=True)
    assert "half" not in ids and len(ids) <= len(records)
    # Nor does a resume make it whole: the file is still not one the job can read as it began.
    assert main(["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "10", "--resume"]) == 3


# -- the commit log: O(1) per chunk, and what a crash leaves (issue 25) ---------------------------

def _job(fmt="npy", keep=(), chunk_rows=1):
    return {"task": "embed", "model_sha256": "0" * 64, "inputs": ["in.jsonl"], "shard": [0, 1],
            "params": {"precision": "float32", "format": fmt, "chunk_rows": chunk_rows, "keep_fields": list(keep)}}


def _record(i, fields=None):
    from pooling_pipeline.jobs.records import Record

    return Record(index=i, file="in.jsonl", line=i + 1, id=f"r{i}", text="t", fields=fields)


def _write(out, start, stop, resume=False, finish=None, **job):
    """Records start..stop-1 through a ResultWriter; finish=None leaves it as a crash would."""
    from pooling_pipeline.jobs.results_store import ResultWriter

    writer = ResultWriter(out, _job(**job), resume=resume)
    assert writer.records_done == start
    for i in range(start, stop):
        writer.add(_record(i), np.full(4, i, np.float32), None)
    if finish is not None:
        writer.finish(None, complete=finish)
    else:
        writer.log.close()  # what the kernel does for a killed process
    return writer


def _chunks(out):
    from pooling_pipeline.jobs.results_store import read_manifest

    return [c["name"] for c in read_manifest(out)["chunks"]]


def test_a_chunk_commit_costs_the_same_at_chunk_1_and_chunk_2000(tmp_path, monkeypatch):
    """--chunk-rows 1 on 3,000 records took 264 s against 21 s at 1,000 rows a chunk: every commit
    rewrote and fsynced the whole manifest. Now the bytes written to __job__/ and the fsyncs per
    commit stay bounded as the chunks go 1..2,000 (the log's occasional folding into the manifest
    included: amortized, it stays bounded too)."""
    import builtins

    from pooling_pipeline.jobs import results_store

    meta = {"bytes": 0, "fsyncs": 0}

    class Counted:
        def __init__(self, f, counts):
            self.f, self.counts = f, counts

        def write(self, data):
            if self.counts:
                meta["bytes"] += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def counting_open(path, mode="r", *a, **kw):
        return Counted(builtins.open(path, mode, *a, **kw), "__job__" in str(path) and ("w" in mode or "a" in mode))

    def counting_fsync(fd):
        meta["fsyncs"] += 1

    monkeypatch.setattr(results_store, "open", counting_open, raising=False)
    monkeypatch.setattr(results_store.os, "fsync", counting_fsync)
    from pooling_pipeline.jobs.results_store import ResultWriter

    writer = ResultWriter(tmp_path / "out", _job(), resume=False)
    per_commit = []
    for i in range(2100):
        before = dict(meta)
        writer.add(_record(i), np.full(4, i, np.float32), None)
        per_commit.append((meta["bytes"] - before["bytes"], meta["fsyncs"] - before["fsyncs"]))
    first, later = per_commit[1:100], per_commit[400:500]
    print(f"bytes to __job__/ per commit: chunks 2-100 at most {max(b for b, _ in first)}, chunks 401-500 at most "
          f"{max(b for b, _ in later)}; 2,100 commits: {sum(b for b, _ in per_commit) / 2100:.0f} on average")
    assert max(b for b, _ in later) <= max(b for b, _ in first) + 16  # a longer chunk number, not the chunks so far
    assert max(b for b, _ in per_commit[1:1000]) < 1024 and max(f for _, f in per_commit) <= 3
    average_500 = sum(b for b, _ in per_commit[:500]) / 500
    assert sum(b for b, _ in per_commit) / len(per_commit) < 4 * average_500  # the folding: amortized O(1)
    writer.finish(None, complete=True)
    assert not (tmp_path / "out" / "__job__" / "commits.jsonl").exists()  # folded at the end
    assert len(manifest_of(tmp_path / "out")["chunks"]) == 2100


def test_a_torn_last_log_line_is_not_a_chunk_and_the_resume_cuts_it_off(tmp_path):
    out = tmp_path / "out"
    _write(out, 0, 10)
    log = out / "__job__" / "commits.jsonl"
    assert len(log.read_bytes().splitlines()) == 9  # the first commit wrote the manifest
    assert _chunks(out) == [f"{i:05d}" for i in range(10)]
    whole = log.read_bytes()
    log.write_bytes(whole[:-30])  # the last append cut short: no newline
    assert _chunks(out)[-1] == "00008"
    lines = whole.splitlines(keepends=True)
    garbled = lines[-1][:70] + b"X" + lines[-1][71:]  # whole, with its newline, but its checksum fails
    log.write_bytes(b"".join(lines[:-1]) + garbled)
    assert _chunks(out)[-1] == "00008"
    _write(out, 9, 15, resume=True, finish=True)  # cuts the torn line off before its first append
    ids, data = load_results(out)
    assert ids == [f"r{i}" for i in range(15)] and list(data[:, 0]) == list(range(15))
    assert not log.exists() and manifest_of(out)["complete"] and manifest_of(out)["layout"] == 3


def test_a_chunk_written_but_not_logged_is_written_again(tmp_path):
    out = tmp_path / "out"
    _write(out, 0, 5)
    log = out / "__job__" / "commits.jsonl"
    log.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[:-1]))  # killed before chunk 4's line
    assert (out / "data-00004.npy").exists() and _chunks(out)[-1] == "00003"
    _write(out, 4, 8, resume=True, finish=True)
    ids, data = load_results(out)
    assert ids == [f"r{i}" for i in range(8)] and list(data[:, 0]) == list(range(8))


def test_a_logged_chunk_whose_file_is_missing_or_corrupted_is_an_error_naming_it(tmp_path):
    out = tmp_path / "out"
    _write(out, 0, 6)
    assert len(load_results(out, allow_partial=True)[0]) == 6
    data = bytearray((out / "data-00004.npy").read_bytes())
    data[-2] ^= 0x10
    (out / "data-00004.npy").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="data-00004.npy: its sha256 differs"):
        load_results(out, allow_partial=True)
    (out / "data-00004.npy").unlink()
    with pytest.raises(ValueError, match="data-00004.npy: cannot be read"):
        load_results(out, allow_partial=True)


def test_a_corrupted_log_line_before_the_last_is_an_error_naming_the_log(tmp_path):
    out = tmp_path / "out"
    _write(out, 0, 6)
    log = out / "__job__" / "commits.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"rows":1', b'"rows":2')
    log.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=r"commits.jsonl: line 3 is corrupted"):
        load_results(out, allow_partial=True)
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[:2] + lines[3:]))  # a commit missing in the middle
    with pytest.raises(ValueError, match=r"commits.jsonl: line 3 is not the commit of chunk 3"):
        load_results(out, allow_partial=True)


def test_a_crash_between_folding_the_log_and_removing_it_counts_no_chunk_twice(tmp_path):
    out = tmp_path / "out"
    writer = _write(out, 0, 7)
    log = out / "__job__" / "commits.jsonl"
    lines = log.read_bytes()
    writer._compact()  # the manifest now holds all 7 chunks ...
    log.write_bytes(lines)  # ... and the log was not removed yet
    assert _chunks(out) == [f"{i:05d}" for i in range(7)]
    _write(out, 7, 9, resume=True, finish=True)
    assert load_results(out)[0] == [f"r{i}" for i in range(9)]


def test_a_layout_2_directory_loads_and_resumes_and_a_newer_layout_is_refused(tmp_path):
    """Layout 2 (the manifest rewritten per chunk, no log) is a folded layout 3."""
    out = tmp_path / "out"
    _write(out, 0, 4, finish=False)
    _edit_manifest(out, lambda m: m.update(layout=2))
    assert len(load_results(out, allow_partial=True)[0]) == 4
    _write(out, 4, 6, resume=True, finish=True)
    assert load_results(out)[0] == [f"r{i}" for i in range(6)] and manifest_of(out)["layout"] == 3
    _edit_manifest(out, lambda m: m.update(layout=4))
    with pytest.raises(ValueError, match="layout 4, written by a newer pipeline-run"):
        load_results(out)


# -- --keep-fields: each value as the input had it, or a refusal naming field and record (issue 25)

def _keep_job(tmp_path, values, name="out", chunk_rows=2, rc=0):
    """A Parquet job (stand-in model) keeping field `v` of records whose values are `values`;
    returns the directory and the error output."""
    from pooling_pipeline.jobs.launcher import main

    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": f"text {i}", "v": v}) + "\n"
                            for i, v in enumerate(values)))
    out = tmp_path / name
    got = main(["--input", str(path), "--output", str(out), "--quiet", "--format", "parquet", "--keep-fields", "v",
                "--chunk-rows", str(chunk_rows)])
    return out, path, got


def _kept(out):
    """Column `v` as every reader of the directory sees it: pyarrow.dataset (one schema for every
    chunk), and the values decoded where the column holds JSON text."""
    import pyarrow.dataset as pads

    from pooling_pipeline.jobs.kept_fields import ENCODING_KEY

    table = pads.dataset(out).to_table().sort_by("index")
    field = table.schema.field("v")
    values = table.column("v").to_pylist()
    if (field.metadata or {}).get(ENCODING_KEY) == b"json":
        return "json", [None if v is None else json.loads(v) for v in values]
    return str(field.type), values


@pytest.mark.parametrize("values, kind", [
    (["a", "b", None, "c", "d"], "string"),
    ([1, 2, None, -(2**63), 2**63 - 1], "int64"),
    ([1.5, 2.0, None, 1e300, -0.0], "double"),
    ([True, False, None, True, False], "bool"),
    ([{"a": 1}, {"a": 2}, {"a": 3, "b": [1, 2]}, None, {"c": {"d": None}}], "json"),  # a dict gains keys
    ([None, None, 150, "x", [1, [2, [3]]]], "json"),  # null throughout the first chunk, then anything
    ([1, True, 0, False, 1.0], "json"),  # True is not 1, 1.0 is not 1: mixed in the first chunk
    (["5", 5, "x", 6.5, None], "json"),  # strings and numbers
    ([[1, 2], [3, [4, 5]], [], None, [{"a": "b"}]], "json"),  # nested lists
    ([2**64, 1, 2, 3, 4], "json"),  # beyond int64
])
def test_kept_fields_read_back_exactly_as_the_input_had_them(tmp_path, no_model, values, kind):
    out, _, rc = _keep_job(tmp_path, values)
    assert rc == 0
    got_kind, got = _kept(out)
    assert got_kind == kind
    assert got == values and [type(v) for v in got] == [type(v) for v in values]  # 1 stays 1, True stays True
    assert len(load_results(out)[0]) == len(values)


@pytest.mark.parametrize("values, bad, shown", [
    ([150, 151, 150.5], 2, "150.5 (float), but the column is int64"),  # was stored as 150
    ([1, 2, True], 2, "True (bool), but the column is int64"),
    ([1.5, 2.5, 3], 2, "3 (int), but the column is double"),
    (["a", "b", None, "c", 5], 4, "5 (int), but the column is string"),
    ([True, False, 1], 2, "1 (int), but the column is bool"),
])
def test_a_kept_value_that_does_not_fit_its_column_is_refused_naming_field_and_record(tmp_path, no_model, capsys,
                                                                                      values, bad, shown):
    out, path, rc = _keep_job(tmp_path, values)
    assert rc == 3
    err = capsys.readouterr().err
    assert f"--keep-fields 'v': {path} line {bad + 1} (id 'r{bad}') has {shown}" in err, err
    _, got = _kept(out)
    assert got == values[:bad]  # the records before it are kept
    assert not manifest_of(out)["complete"]


def test_kept_parquet_columns_keep_the_input_type_null_first_rows_included(tmp_path, no_model):
    """A Parquet input's column type is known before the first chunk: a column null in the first
    rows keeps its type (the first chunk used to decide 'null', and the job stopped after it)."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pooling_pipeline.jobs.launcher import main

    stamps = [None, None, datetime.datetime(2024, 1, 2, 3, 4, 5), None, datetime.datetime(1999, 12, 31)]
    values = [None, None, 150, 7, None]
    table = pa.table({"id": [f"r{i}" for i in range(5)], "text": [f"t {i}" for i in range(5)],
                      "v": pa.array(values, pa.int32()), "when": pa.array(stamps, pa.timestamp("us"))})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out"
    assert main(["--input", str(tmp_path / "in.parquet"), "--output", str(out), "--quiet", "--format", "parquet",
                 "--keep-fields", "v,when", "--chunk-rows", "2"]) == 0
    import pyarrow.dataset as pads

    got = pads.dataset(out).to_table().sort_by("index")
    assert got.schema.field("v").type == pa.int32() and got.schema.field("when").type == pa.timestamp("us")
    assert got.column("v").to_pylist() == values and got.column("when").to_pylist() == stamps


# -- a resume re-reads the records already done and checks their hash (issue 48, item 8) --------

FIXED_WIDTH_RECORDS = 3000


def _fixed_width_line(i: int) -> bytes:
    """One record of a fixed-width JSONL (every line 200 bytes): two lines swap in place, size kept."""
    line = json.dumps({"id": f"r{i:05d}", "text": f"record {i:05d} " + "x" * 150})
    return (line + " " * (199 - len(line)) + "\n").encode()


def _fixed_width_jsonl(path: Path, records=range(FIXED_WIDTH_RECORDS)) -> Path:
    path.write_bytes(b"".join(_fixed_width_line(i) for i in records))
    return path


def _unsampled_line(path: Path, lines: range) -> int:
    """A line (0-based) among `lines` that lies wholly outside the blocks the input fingerprint
    samples (fingerprint.SAMPLE_BLOCKS blocks of SAMPLE_BYTES): a change there passes the sample."""
    from pooling_pipeline.jobs.fingerprint import SAMPLE_BLOCKS, SAMPLE_BYTES

    size = path.stat().st_size
    last = size - SAMPLE_BYTES
    blocks = [(last * k // (SAMPLE_BLOCKS - 1), last * k // (SAMPLE_BLOCKS - 1) + SAMPLE_BYTES) for k in range(SAMPLE_BLOCKS)]
    width = len(_fixed_width_line(0))
    for n in lines:
        if all(n * width >= end or (n + 1) * width <= start for start, end in blocks):
            return n
    raise AssertionError(f"no line of {lines} lies outside the sampled blocks {blocks}")


def _swap_lines_in_place(path: Path, a: int, b: int) -> None:
    """Swaps two lines of equal length in place: the same size and inode; the sampled blocks untouched."""
    width = len(_fixed_width_line(0))
    with open(path, "r+b") as f:
        f.seek(a * width)
        line_a = f.read(width)
        f.seek(b * width)
        line_b = f.read(width)
        f.seek(a * width)
        f.write(line_b)
        f.seek(b * width)
        f.write(line_a)


def _append_lines(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"".join(_fixed_width_line(i) for i in range(FIXED_WIDTH_RECORDS, FIXED_WIDTH_RECORDS + 10)))


def _put_the_mtime_back(path: Path, before: os.stat_result) -> None:
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_size == before.st_size


def _not_started(*args, **kwargs):
    raise AssertionError("the model was started")


@pytest.mark.parametrize("then", ["append", "utime"])
def test_a_resume_refuses_lines_swapped_in_place_outside_the_sampled_blocks(tmp_path, no_model, then, capsys):
    """The issue's case: --limit 1000, then one finished and one unfinished line of equal length
    swap places in the file (outside the blocks the fingerprint samples), then lines are appended
    (the "grown" path) or the modification time is put back. The resume used to exit 0 with one
    record twice and another missing; now it re-reads the records done, finds that they hash
    differently from when they were read, and refuses (exit 3) before adding anything."""
    import pooling_pipeline
    from pooling_pipeline.jobs.launcher import main

    path = _fixed_width_jsonl(tmp_path / "docs.jsonl")
    out = tmp_path / "out"
    argv = ["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "250"]
    assert main([*argv, "--limit", "1000"]) == 0
    done, undone = _unsampled_line(path, range(300, 1000)), _unsampled_line(path, range(1000, FIXED_WIDTH_RECORDS))
    before = path.stat()
    _swap_lines_in_place(path, done, undone)
    if then == "append":
        _append_lines(path)
    else:
        _put_the_mtime_back(path, before)
    capsys.readouterr()
    no_model.setattr(pooling_pipeline, "Pipeline", _not_started)  # refused before the model starts
    assert main([*argv, "--resume"]) == 3
    err = capsys.readouterr().err
    assert "input error: --resume: the inputs differ from the ones the job began with" in err, err
    assert f"its first 1000 records of this shard (read up to {path} line 1000)" in err, err
    assert "Traceback" not in err
    manifest = manifest_of(out)
    assert manifest["records_done"] == 1000 and not manifest["complete"]  # nothing added to the old job
    ids, _ = load_results(out, allow_partial=True)
    assert ids == [f"r{i:05d}" for i in range(1000)]


def test_an_untouched_resume_and_one_after_an_append_finish_exactly(tmp_path, no_model, capsys):
    """What a run commits is the sha256 of exactly the bytes it consumed (every line up to its last
    record done), and the check costs a correct resume nothing but the reading: untouched, the job
    finishes with every record once; appended to (its first bytes unchanged), it finishes on the
    records it began with and says so."""
    import hashlib

    from pooling_pipeline.jobs.launcher import main

    everything = [f"r{i:05d}" for i in range(FIXED_WIDTH_RECORDS)]
    for name, change in [("untouched", None), ("appended", _append_lines)]:
        path = _fixed_width_jsonl(tmp_path / f"{name}.jsonl")
        out = tmp_path / f"out-{name}"
        argv = ["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "250"]
        assert main([*argv, "--limit", "1000"]) == 0
        assert main([*argv, "--limit", "1700", "--resume"]) == 0  # a second resume point, mid-chunk
        consumed = b"".join(_fixed_width_line(i) for i in range(1700))
        assert manifest_of(out)["read_sha256"] == hashlib.sha256(consumed).hexdigest()
        if change is not None:
            change(path)
        capsys.readouterr()
        assert main([*argv, "--resume"]) == 0
        assert ("has grown since the job began" in capsys.readouterr().err) == (change is not None)
        assert manifest_of(out)["complete"]
        assert load_results(out)[0] == everything, name  # no record twice, none missing


def test_a_resume_checks_every_file_of_a_glob_under_a_shard(tmp_path, no_model, capsys):
    """Several files (a glob), --shard I/2: two lines swapped in place in the first file, which both
    shards finished, are refused by each shard's resume (each would have held the other's record);
    the files as they were resume, and the shards together are the whole input exactly."""
    from pooling_pipeline.jobs.launcher import main

    folder = tmp_path / "in"
    folder.mkdir()
    _fixed_width_jsonl(folder / "a.jsonl", range(0, 3000))
    _fixed_width_jsonl(folder / "b.jsonl", range(3000, 6000))
    outs = [tmp_path / f"out-{i}" for i in (0, 1)]
    argvs = [["--input", str(folder / "*.jsonl"), "--output", str(out), "--quiet", "--chunk-rows", "100",
              "--shard", f"{i}/2"] for i, out in enumerate(outs)]
    for argv in argvs:
        assert main([*argv, "--limit", "1600"]) == 0  # shard i: half of a.jsonl, and b.jsonl's first lines
    kept = tmp_path / "kept"
    shutil.copytree(folder, kept)  # (copy2: the modification times too)
    before = (folder / "a.jsonl").stat()
    _swap_lines_in_place(folder / "a.jsonl", _unsampled_line(folder / "a.jsonl", range(300, 700)),
                         _unsampled_line(folder / "a.jsonl", range(701, 1400, 2)))  # one line of each shard
    _put_the_mtime_back(folder / "a.jsonl", before)
    capsys.readouterr()
    for argv in argvs:
        assert main([*argv, "--resume"]) == 3
        assert f"(read up to {folder / 'b.jsonl'} line {199 + argv[-1].startswith('1')})" in capsys.readouterr().err
    shutil.rmtree(folder)
    kept.rename(folder)
    for argv in argvs:
        assert main([*argv, "--resume"]) == 0
    ids, _ = load_results(*outs)
    assert ids == [f"r{i:05d}" for i in range(6000)]


@pytest.mark.parametrize("change", ["gains", "renames"])
def test_a_glob_that_now_matches_other_files_is_a_changed_input(tmp_path, no_model, change, capsys):
    """A glob that gains a file, or one whose file was renamed, is an input changed since the job
    began: exit 3 (it was 2, a usage error), naming the files added and removed."""
    from pooling_pipeline.jobs.launcher import main

    folder = tmp_path / "in"
    folder.mkdir()
    _fixed_width_jsonl(folder / "a.jsonl", range(0, 100))
    _fixed_width_jsonl(folder / "b.jsonl", range(100, 200))
    out = tmp_path / "out"
    argv = ["--input", str(folder / "*.jsonl"), "--output", str(out), "--quiet", "--chunk-rows", "10"]
    assert main([*argv, "--limit", "50"]) == 0
    if change == "gains":
        _fixed_width_jsonl(folder / "c.jsonl", range(200, 210))
        how = f"2 files then, 3 now; added: {folder / 'c.jsonl'}"
    else:
        (folder / "b.jsonl").rename(folder / "c.jsonl")
        how = f"2 files then, 2 now; added: {folder / 'c.jsonl'}; removed: {folder / 'b.jsonl'}"
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 3
    err = capsys.readouterr().err
    assert f"input error: --resume: the input files are not the job's ({how})" in err, err
    assert manifest_of(out)["records_done"] == 50


def test_a_resume_refuses_parquet_rows_swapped_in_place_outside_the_sampled_blocks(tmp_path, no_model, capsys):
    """The same for Parquet: two text values of equal length swap places (uncompressed, no
    dictionary: the size is kept, and both changes lie outside the sampled blocks), the time put
    back. The resume reads the rows done again and refuses (exit 3)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pooling_pipeline.jobs.fingerprint import SAMPLE_BLOCKS, SAMPLE_BYTES
    from pooling_pipeline.jobs.launcher import main

    texts = [f"record {i:05d} " + "x" * 150 for i in range(FIXED_WIDTH_RECORDS)]
    path = tmp_path / "rows.parquet"

    def write(values):
        pq.write_table(pa.table({"text": values}), path, compression="none", use_dictionary=False)

    write(texts)
    out = tmp_path / "out"
    argv = ["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "250"]
    assert main([*argv, "--limit", "1000"]) == 0
    before, data = path.stat(), path.read_bytes()
    last = len(data) - SAMPLE_BYTES
    blocks = [(last * k // (SAMPLE_BLOCKS - 1), last * k // (SAMPLE_BLOCKS - 1) + SAMPLE_BYTES) for k in range(SAMPLE_BLOCKS)]

    def unsampled(rows):
        for i in rows:
            start = data.find(texts[i].encode())
            if all(start >= end or start + len(texts[i]) <= begin for begin, end in blocks):
                return i
        raise AssertionError(f"no row of {rows} lies outside the sampled blocks {blocks}")

    done, undone = unsampled(range(300, 1000)), unsampled(range(1000, FIXED_WIDTH_RECORDS))
    texts[done], texts[undone] = texts[undone], texts[done]
    write(texts)
    _put_the_mtime_back(path, before)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 3
    err = capsys.readouterr().err
    assert f"first 1000 records of this shard (read up to {path} row 1000) hashes differently now" in err, err
    assert manifest_of(out)["records_done"] == 1000


def test_a_job_begun_by_an_older_pipeline_run_is_refused_on_resume(tmp_path, no_model, capsys):
    """A job whose manifest holds no hash of what it read (an older pipeline-run checked files by
    samples only) cannot be checked: its resume is refused (exit 2), saying why, as one whose model
    fingerprint was sampled is; done, it still says it is complete."""
    from pooling_pipeline.jobs.launcher import main

    path = _fixed_width_jsonl(tmp_path / "docs.jsonl", range(100))
    out = tmp_path / "out"
    argv = ["--input", str(path), "--output", str(out), "--quiet", "--chunk-rows", "10"]
    assert main([*argv, "--limit", "50"]) == 0
    _edit_manifest(out, lambda m: m.pop("read_sha256"))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    assert "was begun by an older pipeline-run that checked its input files by samples" in capsys.readouterr().err
    assert manifest_of(out)["records_done"] == 50
