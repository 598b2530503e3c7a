"""pipeline-run on files: formats, precisions, shards, crash + resume, bad files."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import corpus
import numpy as np
import pytest
from helpers import SAMPLE, FakePipelineBase

from pooling_pipeline import load_results

TOL = 1e-5


def run_launcher(args, expect_rc=0, **kw):
    """pipeline-run in a subprocess (quiet), checked for its exit code."""
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--quiet", *args], capture_output=True,
                            text=True, env=env, timeout=300, **kw)
    assert result.returncode == expect_rc, result.stderr[-3000:]
    return result


def manifest_of(out):
    """The manifest file as written (folded at the end of every run)."""
    return json.loads((out / "__job__" / "manifest.json").read_text())


def committed(out):
    """The manifest with the commit log applied: what a run has committed so far."""
    from pooling_pipeline.jobs.results_store import read_manifest

    return read_manifest(out)


_run = run_launcher


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


@pytest.mark.slow
def test_bundled_sample_to_disk_and_back(tmp_path, st_model):
    out = tmp_path / "out"
    result = _run(["--output", str(out), "--limit", "120", "--chunk-rows", "50", "--verbose"])
    assert "embedded 120 records" in result.stdout and "peak RSS" in result.stdout  # --verbose: the whole report
    ids, data = load_results(out, allow_partial=True)
    assert data.shape == (120, 384) and data.dtype == np.float32 and len(ids) == 120
    manifest = manifest_of(out)
    assert [c["rows"] for c in manifest["chunks"]] == [50, 50, 20] and not manifest["complete"]  # --limit: unfinished
    assert manifest["task"] == "embed" and len(manifest["model_sha256"]) == 64
    sample = [json.loads(line) for line in open(SAMPLE)][:120]
    assert ids == [r["id"] for r in sample]
    assert np.abs(data - st_model.encode([r["text"] for r in sample])).max() <= TOL


@pytest.mark.slow
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


@pytest.mark.slow
def test_precisions_round_trip(tmp_path, jsonl, expected):
    for precision in ("float16", "int8", "binary"):
        out = tmp_path / precision
        _run(["--input", str(jsonl), "--output", str(out), "--precision", precision, "--chunk-rows", "100"])
        _, data = load_results(out)
        if precision == "float16":
            assert data.dtype == np.float16 and np.abs(data.astype(np.float32) - expected).max() < 1e-3
        elif precision == "int8":
            cal = manifest_of(out)["int8"]
            step = np.asarray(cal["steps"])
            inside = (expected >= np.asarray(cal["starts"])) & (expected <= np.asarray(cal["starts"]) + 255 * step)
            assert data.dtype == np.float32
            assert np.all(np.abs(data - expected)[inside] <= (step / 2 + 1e-6)[None, :].repeat(len(data), 0)[inside])
        else:
            assert data.dtype == np.uint8 and np.array_equal(data, np.packbits(expected > 0, axis=-1))


@pytest.mark.slow
def test_shards_together_equal_the_whole(tmp_path, jsonl, expected, records):
    outs = [tmp_path / f"shard{i}" for i in range(3)]
    for i, out in enumerate(outs):
        _run(["--input", str(jsonl), "--output", str(out), "--shard", f"{i}/3", "--chunk-rows", "16"])
    assert [len(load_results(o)[0]) for o in outs] == [57, 57, 56]
    ids, data = load_results(*outs)
    assert ids == [r["id"] for r in records]
    assert np.abs(data - expected).max() <= TOL


@pytest.mark.slow
def test_sigkill_then_resume_gives_identical_output(tmp_path, jsonl):
    clean = tmp_path / "clean"
    _run(["--input", str(jsonl), "--output", str(clean), "--chunk-rows", "10", "--precision", "int8",
          "--int8-calibration-rows", "20"])
    clean_ids, clean_data = load_results(clean)
    # SIGKILL of the whole process group leaves no process to remove the group's socket
    # directory: the launcher's temporary directory is one this test removes.
    ipc_tmp = tempfile.mkdtemp(prefix="sigkill-")
    env = dict(os.environ, TMPDIR=ipc_tmp)
    rng = random.Random(3)
    for trial in range(3):
        out = tmp_path / f"crash{trial}"
        # int8 commits nothing before its calibration sample: a small one, so chunks land early.
        args = [sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--quiet", "--input", str(jsonl),
                "--output", str(out), "--chunk-rows", "10", "--precision", "int8", "--resume",
                "--int8-calibration-rows", "20"]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        wanted = rng.randint(1, 12)  # chunks committed before the kill
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                done = len(committed(out)["chunks"])  # mostly in the commit log: the kill lands between its lines
            except (OSError, ValueError):
                done = 0
            if done >= wanted:
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its whole process group
        proc.wait()
        _run(["--input", str(jsonl), "--output", str(out), "--chunk-rows", "10", "--precision", "int8", "--resume",
              "--int8-calibration-rows", "20"])
        ids, data = load_results(out)
        assert ids == clean_ids  # no record missing, none twice
        # The resumed run batches its records differently, and float results depend on batch
        # composition (in the last bits): after int8 rounding a value may land one step away.
        step = max(manifest_of(out)["int8"]["steps"])
        assert np.abs(data - clean_data).max() <= step * 1.001 + 1e-6
    shutil.rmtree(ipc_tmp, ignore_errors=True)


@pytest.mark.slow
def test_resume_refuses_a_different_job_and_a_plain_rerun_refuses_to_overwrite(tmp_path, jsonl):
    out = tmp_path / "job"
    _run(["--input", str(jsonl), "--output", str(out), "--limit", "10"])
    result = _run(["--input", str(jsonl), "--output", str(out), "--truncate", "64", "--resume"], expect_rc=2)
    assert "different 'params'" in result.stderr
    result = _run(["--input", str(jsonl), "--output", str(out)], expect_rc=2)
    assert "already holds results" in result.stderr


@pytest.mark.slow
def test_bad_files_name_the_file_and_line(tmp_path):
    cases = {
        "broken.jsonl": ('{"text": "fine"}\n{"text": oops}\n', "broken.jsonl line 2: not valid JSON"),
        "missing.jsonl": ('{"text": "fine"}\n{"body": "x"}\n', "missing.jsonl line 2: no field 'text'"),
        "wrongtype.jsonl": ('{"text": 5}\n', "wrongtype.jsonl line 1: field 'text' must be a string"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content)
        result = _run(["--input", str(tmp_path / name), "--output", str(tmp_path / f"o-{name}")], expect_rc=3)
        assert message in result.stderr, result.stderr
    result = _run(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")], expect_rc=3)
    assert "does not exist" in result.stderr


@pytest.mark.slow
def test_errors_return_lists_failed_records_and_goes_on(tmp_path, st_model):
    long_doc = corpus.long_document(20_000, seed=83)
    rows = [{"id": "a", "text": "short one"}, {"id": "b", "text": long_doc}, {"id": "c", "text": "short two"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    _run(["--input", str(path), "--output", str(out), "--long-inputs", "error", "--errors", "return"])
    ids, data = load_results(out)
    assert ids == ["a", "c"] and np.abs(data - st_model.encode(["short one", "short two"])).max() <= TOL
    errors = [json.loads(line) for line in (out / "__job__" / "errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == ["b"] and "long_inputs='error'" in errors[0]["error"]


@pytest.mark.slow
def test_stdin_plain_text(tmp_path, st_model):
    lines = ["first line of text", "second line", "third, with more words in it"]
    out = tmp_path / "stdin-out"
    _run(["--input", "-", "--output", str(out)], input="\n".join(lines) + "\n")
    ids, data = load_results(out)
    assert ids == ["stdin:1", "stdin:2", "stdin:3"]
    assert np.abs(data - st_model.encode(lines)).max() <= TOL


@pytest.mark.slow
def test_progress_bar_counts_records_without_reading_the_inputs_ahead(tmp_path):
    """The bar is not sized by reading every input beforehand (that read inputs of up to 2 GiB
    whole, and counted the blank JSONL lines the reader skips): it counts records done, failed
    ones included, of a total estimated from the bytes read so far (records, not lines), and its
    rate is records done over the time since the model was ready."""
    rows = [{"id": str(i), "text": f"record number {i}" if i != 3 else None} for i in range(6)]
    path = tmp_path / "gappy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # a blank line after each record
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--input", str(path),
                             "--output", str(tmp_path / "out"), "--errors", "return"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    bar = result.stderr.replace("\r", "\n")
    assert "6/6" in bar  # the failed record counts too
    assert "/12" not in bar  # no total that counts the blank lines
    assert load_results(tmp_path / "out")[0] == [r["id"] for r in rows if r["text"] is not None]
    assert "records (this run)  6" in result.stdout


# -- job runner: resumes, bad records, exit codes, signals (issues 14 and 15) ---------------------

@pytest.mark.slow
def test_limit_then_resume_finishes_the_whole_input(tmp_path, jsonl, expected, records):
    out = tmp_path / "out"
    result = _run(["--input", str(jsonl), "--output", str(out), "--limit", "10"])
    assert "not complete" in result.stdout and not manifest_of(out)["complete"]
    with pytest.raises(ValueError, match="unfinished job"):
        load_results(out)  # a partial result is never returned silently
    assert len(load_results(out, allow_partial=True)[0]) == 10
    result = _run(["--input", str(jsonl), "--output", str(out), "--resume"])
    assert "nothing to do" not in result.stdout
    ids, data = load_results(out)
    assert ids == [r["id"] for r in records] and np.abs(data - expected).max() <= TOL
    assert "nothing to do" in _run(["--input", str(jsonl), "--output", str(out), "--resume"]).stdout


@pytest.mark.slow
def test_errors_return_covers_bad_records_and_the_job_goes_on(tmp_path, st_model):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": "a", "text": "a good one"}\n'
                     b'{"id": "b", "text": null}\n'
                     b'{"id": "c", "text": ["not", "a", "string"]}\n'
                     b'{"id": "d", "text": oops}\n'
                     b'{"text": "a record without its id"}\n'
                     b'{"id": "f", "text": "bad \xff byte"}\n'
                     b'{"id": "g", "text": "another good one"}\n')
    out = tmp_path / "out"
    _run(["--input", str(path), "--output", str(out), "--errors", "return", "--chunk-rows", "3"])
    ids, data = load_results(out)
    assert ids == ["a", "g"] and np.abs(data - st_model.encode(["a good one", "another good one"])).max() <= TOL
    errors = [json.loads(line) for line in (out / "__job__" / "errors.jsonl").read_text().splitlines()]
    assert [(e["index"], e["line"]) for e in errors] == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert all(e["file"] == str(path) for e in errors)
    assert [e["id"] for e in errors] == ["b", "c", None, None, "f"]
    assert "no field 'id'" in errors[3]["error"] and "not valid UTF-8" in errors[4]["error"]
    assert manifest_of(out)["complete"] and manifest_of(out)["params"]["id_field"] == "id"


@pytest.mark.slow
def test_a_missing_id_stops_the_job_naming_file_and_line(tmp_path):
    path = tmp_path / "noid.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"text": "z"}\n')
    result = _run(["--input", str(path), "--output", str(tmp_path / "out")], expect_rc=3)
    assert f"{path} line 3: no field 'id'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_errors_under_a_shard_name_file_line_and_id(tmp_path):
    rows = [{"id": f"r{i}", "text": corpus.long_document(5_000, seed=90) if i == 5 else f"text {i}"} for i in range(8)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _run(["--input", str(path), "--output", str(tmp_path / "out"), "--shard", "1/2", "--long-inputs", "error"],
                  expect_rc=3)
    assert f"{path} line 6 (id 'r5')" in result.stderr and "request 2" not in result.stderr


def test_text_field_matching_nothing_is_found_before_the_model_starts(tmp_path, monkeypatch, capsys):
    import pooling_pipeline
    from pooling_pipeline.jobs.launcher import main

    def no_model(*a, **kw):
        raise AssertionError("the model was started")

    monkeypatch.setattr(pooling_pipeline, "Pipeline", no_model)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "body": "some text"}) + "\n" for i in range(3)))
    assert main(["--input", str(path), "--output", str(tmp_path / "out"), "--quiet"]) == 3
    assert "--text-field 'text' matches nothing" in capsys.readouterr().err


def test_help_explains_every_option_with_its_default():
    from pooling_pipeline.jobs.launcher import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False, ()):
            assert "default" in action.help, f"{action.option_strings} does not say its default"
    text = parser.format_help()
    assert "exit codes" in text and "130" in text


class FakePipeline(FakePipelineBase):
    """Stands in for the model in runs that test the launcher's own logic: outputs a fixed vector
    per text, and dies (as an engine would) after `die_after` outputs."""

    die_after = None

    def encode_stream(self, texts, task, **kw):
        from types import SimpleNamespace

        from pooling_pipeline.errors import EngineDeadError

        for i, _ in enumerate(texts):
            if i == self.die_after:
                raise EngineDeadError("engine core died (a test's stand-in)")
            yield SimpleNamespace(data=np.full(4, i, np.float32), error=None, num_prompt_tokens=1, index=i)


def test_exit_codes_tell_usage_input_and_runtime_failures_apart(tmp_path, jsonl, monkeypatch, capsys):
    import pooling_pipeline
    from pooling_pipeline.jobs.launcher import main

    assert _run(["--precision", "int4"], expect_rc=2).stderr  # argparse: usage
    assert "does not exist" in _run(["--input", str(tmp_path / "nope.jsonl")], expect_rc=3).stderr
    monkeypatch.setattr(pooling_pipeline, "Pipeline", FakePipeline)
    monkeypatch.setattr(FakePipeline, "die_after", 25)
    out = tmp_path / "out"
    assert main(["--input", str(jsonl), "--output", str(out), "--chunk-rows", "10", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "engine core died" in err and "--resume" in err and "Traceback" not in err
    manifest = manifest_of(out)
    assert manifest["records_done"] == 25 and not manifest["complete"]  # completed work kept, resumable


def test_data_parallel_size_reaches_the_pipeline(tmp_path, jsonl, monkeypatch, capsys):
    import pooling_pipeline
    from pooling_pipeline.jobs.launcher import main

    seen = {}

    class Recording(FakePipeline):
        def __init__(self, **kw):
            super().__init__(**kw)
            seen.update(kw)

        def stats(self):  # a whole run's summary needs every stage
            from pooling_pipeline.call_stats import CallStats

            return {**CallStats(engines=2).as_dict(), "cpu_plan": {}}

    monkeypatch.setattr(pooling_pipeline, "Pipeline", Recording)
    out = tmp_path / "out"
    assert main(["--input", str(jsonl), "--output", str(out), "--quiet", "--data-parallel-size", "2"]) == 0
    assert seen["data_parallel_size"] == 2 and manifest_of(out)["complete"]
    with pytest.raises(SystemExit) as info:  # argparse: a usage error
        main(["--input", str(jsonl), "--output", str(tmp_path / "out-0"), "--data-parallel-size", "0"])
    assert info.value.code == 2
    assert main(["--input", str(jsonl), "--output", str(tmp_path / "out-ray"), "--ray", "--data-parallel-size", "2"]) == 2
    assert "--ray-actors" in capsys.readouterr().err


def test_the_model_folder_is_read_once_per_job(tmp_path, jsonl, monkeypatch):
    """The job's description and its Pipeline share one reading of the model folder: the Pipeline
    gets the ModelSpec the launcher read (a hub id is not resolved twice)."""
    import pooling_pipeline
    from pooling_pipeline.core.shared.config import ModelSpec
    from pooling_pipeline.jobs import job_spec
    from pooling_pipeline.jobs.launcher import main

    reads, seen = [], {}
    real = job_spec.load_model_spec
    monkeypatch.setattr(job_spec, "load_model_spec", lambda *a, **kw: reads.append(a) or real(*a, **kw))

    class Recording(FakePipeline):
        def __init__(self, **kw):
            super().__init__(**kw)
            seen.update(kw)

    monkeypatch.setattr(pooling_pipeline, "Pipeline", Recording)
    monkeypatch.setattr("pooling_pipeline.jobs.launcher.format_stats", lambda stats: [])
    assert main(["--input", str(jsonl), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    assert len(reads) == 1 and isinstance(seen["model"], ModelSpec) and seen["revision"] is None


def test_a_pipeline_takes_a_model_spec_as_it_was_read():
    """Pipeline(model=spec): the options that shaped the reading cannot say otherwise (refused
    before any process starts)."""
    from pooling_pipeline import Pipeline
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    spec = load_model_spec(None)
    with pytest.raises(ValueError, match="revision applies to a hub model id"):
        Pipeline(model=spec, revision="main")
    with pytest.raises(ValueError, match="read with trust_remote_code=False"):
        Pipeline(model=spec, trust_remote_code=True)


def _feed_and_signal(tmp_path, sig, to_group):
    """A job reading stdin gets 40 records, then stdin stays open: the job waits for more. Once 20
    records are committed, it gets `sig`. (--max-num-seqs 1 keeps the pipeline's window at 16
    requests, so it hands results back before it waits for the 41st record.)"""
    out = tmp_path / f"out-{sig}"
    proc = subprocess.Popen([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--input", "-", "--input-format",
                             "jsonl", "--output", str(out), "--chunk-rows", "10", "--max-num-seqs", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = [json.dumps({"id": f"s{i}", "text": f"record number {i} of the stream"}) + "\n" for i in range(50)]
    proc.stdin.writelines(lines[:40])
    proc.stdin.flush()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if committed(out)["records_done"] >= 20:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    (os.killpg if to_group else os.kill)(proc.pid, sig)  # to_group: what a terminal's Ctrl-C does
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out, lines, proc.returncode, stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_signal_keeps_finished_work_and_the_job_resumes(tmp_path, sig, to_group):
    out, lines, rc, stderr = _feed_and_signal(tmp_path, sig, to_group)
    assert rc == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr
    # Every line but the progress bar's: the start-up line on the backend, then one saying how to resume.
    messages = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and "records [" not in line]
    assert messages and messages[0].startswith("pipeline-run: backend "), stderr[-3000:]
    manifest = manifest_of(out)
    assert messages[1:] == [f"pipeline-run: stopped by {signal.Signals(sig).name}; {manifest['records_done']} records kept in "
                        f"{out}; run the same command with --resume to continue"], stderr[-3000:]
    assert manifest["records_done"] >= 20 and not manifest["complete"]
    if sig == signal.SIGINT:  # the same stream, longer: the job continues where it stopped
        _run(["--input", "-", "--input-format", "jsonl", "--output", str(out), "--resume", "--chunk-rows", "10",
              "--max-num-seqs", "1"], input="".join(lines))
        assert load_results(out)[0] == [f"s{i}" for i in range(50)]
    else:  # another stream: refused, since its first records differ
        result = _run(["--input", "-", "--input-format", "jsonl", "--output", str(out), "--resume", "--chunk-rows", "10",
                       "--max-num-seqs", "1"], expect_rc=3, input="".join(reversed(lines)))
        assert "input stream differs" in result.stderr


@pytest.mark.slow
def test_sparse_embed_and_prompts_are_written_as_the_api_computes_them(tmp_path):
    """--task sparse_embed stores each record's non-zero terms as [token id, weight] rows;
    --prompt-name puts the model's prompt in front of each text, as the API does."""
    import model_zoo

    from pooling_pipeline import Pipeline

    texts = corpus.sentences(12, seed=91)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    splade = model_zoo.build_splade(tmp_path, "max")
    _run(["--input", str(path), "--output", str(tmp_path / "sparse"), "--model", splade, "--task", "sparse_embed"])
    prompted = model_zoo.build_st(tmp_path, "bert", prompts={"query": "query: "}, normalize=True)
    _run(["--input", str(path), "--output", str(tmp_path / "prompted"), "--model", prompted,
          "--prompt-name", "query"])
    with Pipeline(model=splade) as pipe:
        want = pipe.encode(texts, task="sparse_embed", use_tqdm=False)
    ids, rows = load_results(tmp_path / "sparse")
    assert ids == [f"r{i}" for i in range(len(texts))]
    for row, out in zip(rows, want):
        assert row.shape == (len(out.indices), 2)
        assert np.array_equal(row[:, 0].astype(np.int64), out.indices)
        assert np.abs(row[:, 1] - out.values).max() <= TOL
    with Pipeline(model=prompted) as pipe:
        want = np.stack([o.embedding for o in pipe.embed(texts, prompt_name="query", use_tqdm=False)])
        plain = np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])
    assert np.abs(load_results(tmp_path / "prompted")[1] - want).max() <= TOL
    assert np.abs(want - plain).max() > 1e-3  # the prompt changed the vectors
    result = _run(["--input", str(path), "--output", str(tmp_path / "p2"), "--model", prompted,
                   "--prompt-name", "nope"], expect_rc=2)
    assert "'nope' is not among the model's prompts" in result.stderr


@pytest.mark.slow
def test_classify_pairs_job_writes_each_records_probabilities_in_order(tmp_path):
    """--task classify --pair-field NAME: each record is the pair (text field, pair field) of an NLI
    cross-encoder; its stored probs equal CrossEncoder.predict(pairs, apply_softmax=True), in input
    order; a record without its second text is a bad record (--errors return lists it); --pair-field
    needs --task classify (usage error, exit 2) and a field the records have (input error, exit 3)."""
    import model_zoo
    import torch
    from sentence_transformers import CrossEncoder

    nli = model_zoo.build_cross_encoder(tmp_path, 3)
    premises, hypotheses = corpus.sentences(14, seed=93), corpus.sentences(14, seed=94)
    hypotheses[3] = corpus.medium_texts(1, seed=95)[0]  # cut longest-first at the model's 128 tokens
    rows = [{"id": f"r{i}", "premise": p, "hypothesis": h} for i, (p, h) in enumerate(zip(premises, hypotheses))]
    rows.insert(5, {"id": "no-pair", "premise": "a premise without its hypothesis"})
    path = tmp_path / "nli.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    _run(["--input", str(path), "--output", str(out), "--model", nli, "--task", "classify",
          "--text-field", "premise", "--pair-field", "hypothesis", "--errors", "return", "--chunk-rows", "4"])
    ce = CrossEncoder(nli, device="cpu")
    want = ce.predict(list(zip(premises, hypotheses)), apply_softmax=True)
    logits = ce.predict(list(zip(premises, hypotheses)), activation_fn=torch.nn.Identity())
    unpaired = ce.predict([(p, "") for p in premises], activation_fn=torch.nn.Identity())
    assert np.abs(logits - unpaired).max() > 1e-3  # the hypothesis matters
    ids, data = load_results(out)
    assert ids == [f"r{i}" for i in range(len(premises))]
    assert data.shape == want.shape and np.abs(data - want).max() <= TOL
    errors = [json.loads(line) for line in (out / "__job__" / "errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == ["no-pair"] and "no field 'hypothesis'" in errors[0]["error"]
    assert manifest_of(out)["params"]["pair_field"] == "hypothesis"
    result = _run(["--input", str(path), "--output", str(tmp_path / "o2"), "--model", nli, "--text-field", "premise",
                   "--pair-field", "hypothesis"], expect_rc=2)
    assert "--pair-field" in result.stderr and "--task" in result.stderr
    result = _run(["--input", str(path), "--output", str(tmp_path / "o3"), "--model", nli, "--task", "classify",
                   "--text-field", "premise", "--pair-field", "nope"], expect_rc=3)
    assert "--pair-field 'nope' matches nothing" in result.stderr


class _ReadyFake(FakePipeline):
    """FakePipeline with the engine facts the start-up line reads."""

    def stats(self):
        return {**super().stats(), "engine": {"backend": "torch", "device": "cpu", "dtype": "float32"}}


def test_progress_shows_the_total_and_an_eta(tmp_path, monkeypatch, capsys):
    """pipeline-run's progress (issue 37, item 4): records done of the total -- estimated from the
    bytes read for JSONL, exact for Parquet, this shard's share --, the rate and the time left;
    a --resume starts from the records the job already has."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import pooling_pipeline
    from pooling_pipeline.jobs import launcher
    from pooling_pipeline.jobs.launcher import main

    monkeypatch.setattr(pooling_pipeline, "Pipeline", _ReadyFake)
    monkeypatch.setattr(launcher, "format_stats", lambda stats: [])  # the stand-in has no stage statistics
    total = sum(1 for _ in open(SAMPLE, encoding="utf-8"))
    out = tmp_path / "out"
    argv = ["--input", str(SAMPLE), "--output", str(out), "--chunk-rows", "50"]
    assert main([*argv, "--limit", "200"]) == 0
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"\b{total}/{total} \[\d\d:\d\d<\d\d:\d\d", err), err[-600:]  # the total, and the time left
    assert re.search(r"\b20[01]/\d+ \[", err) and not re.search(r"\b\d{1,2}/\d+ \[", err), err[-600:]  # from 200
    rows = [json.loads(line) for line in open(SAMPLE, encoding="utf-8")][:301]
    table = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), table)
    assert main(["--input", str(table), "--output", str(tmp_path / "pq"), "--shard", "1/2"]) == 0
    assert re.search(r"\b150/150 \[", capsys.readouterr().err)  # exact: rows 1, 3, ..., 299 of 301


def test_help_names_every_engine_option_plainly():
    """--help (issue 37): every Pipeline option a job can set has its flag (--max-num-batched-tokens
    too), in one metavar style, with defaults a user reads (no Python tuples, no None, no source file)."""
    from pooling_pipeline.jobs.job_spec import JobSpec
    from pooling_pipeline.jobs.launcher import build_parser

    text = build_parser().format_help()
    assert "--max-num-batched-tokens N" in text and "--workers N" in text and "--max-num-seqs N" in text
    assert "(0, 1)" not in text and ".py)" not in text and "or None" not in text
    args = JobSpec.from_args(build_parser().parse_args(["--max-num-batched-tokens", "4096", "--shard", "1/3"]))
    assert args.pipeline_options()["max_num_batched_tokens"] == 4096 and args.shard == (1, 3)


def test_the_end_of_run_report_is_short_unless_verbose(tmp_path, monkeypatch, capsys):
    """What a user reads in a few lines (records, time, rate, errors, where the output is); engine
    load, memory and the stage histograms behind --verbose (issue 37, item 4)."""
    import pooling_pipeline
    from pooling_pipeline.jobs import launcher
    from pooling_pipeline.jobs.launcher import main

    monkeypatch.setattr(pooling_pipeline, "Pipeline", _ReadyFake)
    monkeypatch.setattr(launcher, "peak_rss_mb", lambda pid: 100.0)
    argv = ["--input", str(SAMPLE), "--limit", "40", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "short")]) == 0
    short = capsys.readouterr().out
    for row in ("records (this run)", "wall time", "throughput", "errors", "output"):
        assert row in short, short
    assert "peak RSS" not in short and "engine busy" not in short and len(short.strip().splitlines()) <= 9, short
    monkeypatch.setattr(launcher, "format_stats", lambda stats: ["stage details"])
    assert main([*argv, "--output", str(tmp_path / "long"), "--verbose"]) == 0
    full = capsys.readouterr().out
    assert "peak RSS" in full and "engine busy" in full and "stage details" in full
