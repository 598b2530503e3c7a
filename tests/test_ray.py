"""Ray Data scale-out on a local Ray instance limited to this machine (2 CPUs, no dashboard,
loopback only): map_batches and `pipeline-run --ray` give the single-machine API's results,
every id once; every task of the API is reachable; no process group outlives its actor."""

import gc
import json
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install -e '.[ray]')")

import corpus
from helpers import ROOT, wait_gone
from tiny_models import build_bert

from pooling_pipeline import Pipeline  # noqa: E402
from pooling_pipeline.integrations.ray_data import PoolingBatches, _column, default_ray_init_kwargs  # noqa: E402
from pooling_pipeline.jobs.results_store import load_results  # noqa: E402

TOL = 1e-5
N_TEXTS = 3000


@pytest.fixture(scope="module")
def records():
    texts = corpus.sentences(N_TEXTS - 300, seed=81) + corpus.medium_texts(300, seed=82)
    return [{"id": f"rec-{i:05d}", "text": t} for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    """The model of the 3000-record jobs: a small BERT (32 wide, 2 layers, 128 positions: the medium
    texts are cut), so the Ray plumbing -- blocks, batches, actors, chunk offsets, every id once --
    is what the time goes to, not MiniLM's forward passes (3000 records 3 times took ~70 s). The
    bundled model itself goes through Ray in the other tests (the default model in the actors,
    the killed actor's job)."""
    return build_bert(tmp_path_factory.mktemp("ray-embed") / "embed")


@pytest.fixture(scope="module")
def expected(embed_model, records):
    with Pipeline(model=embed_model) as pipe:
        outs = pipe.embed([r["text"] for r in records], use_tqdm=False)
    return {r["id"]: o.embedding for r, o in zip(records, outs)}


def group_processes() -> set[int]:
    """Engine cores and render workers of this test session's (conftest marks its environment, which
    they inherit), not started by this test process nor by another pytest-xdist worker (whose groups
    come and go while these tests run). Another run's on the machine -- another suite, a benchmark --
    are not ours to judge: a run beside this one once failed these tests with its own groups."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if (cmd[:1] == [sys.executable] and ("pooling_pipeline.core.engine.main" in cmd or "pooling_pipeline.workers.main" in cmd)
                and p.info["pid"] not in mine and of_this_test_worker(p)):
            found.add(p.info["pid"])
    return found


def of_this_test_worker(p: psutil.Process) -> bool:
    """A process of this session and this xdist worker: its environment, inherited from the test
    process, says so. (A Ray actor's groups inherit it through the launcher and the Ray instance it
    starts, and keep it when orphaned.)"""
    try:
        env = p.environ()
    except (psutil.Error, OSError):
        return False
    return (env.get("POOLING_PIPELINE_TEST_SESSION") == os.environ["POOLING_PIPELINE_TEST_SESSION"]
            and env.get("PYTEST_XDIST_WORKER") == os.environ.get("PYTEST_XDIST_WORKER"))


BEFORE = group_processes()  # another run's groups on this machine are not ours to judge


def assert_no_group_left(timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while group_processes() - BEFORE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_processes() - BEFORE, f"process groups outlived their Ray actors: {group_processes() - BEFORE}"


@pytest.mark.slow
def test_pipeline_run_ray_matches_the_api(tmp_path, records, expected, embed_model):
    """The launcher starts its own local Ray instance (2 CPUs), reads JSONL with Ray Data and
    writes the launcher's output format; load_results reads it back in input order."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--ray", "--ray-num-cpus", "2",
                           "--ray-batch-size", "256", "--model", embed_model, "--input", str(src), "--output", str(out),
                           "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"embedded {len(records)} records" in proc.stdout
    ids, vectors = load_results(out)
    assert ids == [r["id"] for r in records]  # every id once, in input order
    want = np.stack([expected[i] for i in ids])
    assert np.abs(vectors - want).max() <= TOL
    manifest = json.loads((out / "__job__" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == len(records) and manifest["ray"]["actors"] >= 1
    assert len(manifest["chunks"]) > 1  # several write tasks: the per-chunk offsets are exercised
    # A complete job is not redone.
    again = subprocess.run([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--ray", "--resume", "--model", embed_model,
                            "--input", str(src), "--output", str(out), "--quiet"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert_no_group_left()


@pytest.fixture(scope="module")
def local_ray():
    ray.init(**default_ray_init_kwargs("local", num_cpus=2), object_store_memory=256 * 2**20)
    yield ray
    ray.shutdown()
    gc.collect()  # Ray's leftovers with finalizers go now, not in the middle of a later test
    assert_no_group_left()


@pytest.mark.slow
def test_map_batches_embed_matches_the_api(local_ray, records, expected, embed_model):
    ds = ray.data.from_items(records, override_num_blocks=8)
    ds = ds.map_batches(PoolingBatches, fn_constructor_kwargs={"task": "embed", "model": embed_model}, batch_size=200,
                        num_cpus=1,
                        compute=ray.data.ActorPoolStrategy(size=1), batch_format="numpy")
    rows = ds.take_all()
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(expected) and len(set(ids)) == len(ids)  # every id exactly once
    diff = max(float(np.abs(np.asarray(r["embedding"]) - expected[r["id"]]).max()) for r in rows)
    assert diff <= TOL


@pytest.mark.slow
def test_every_task_through_map_batches(local_ray, bert_task_models, bert_task_pipe):
    """classify, score (two columns) and a token task, as pandas batches, with bad rows returned."""
    import pandas as pd

    texts = corpus.sentences(60, seed=83)
    docs = corpus.medium_texts(60, seed=84)
    frame = pd.DataFrame({"id": range(60), "text": texts, "doc": docs})
    cases = [("classify", "classify3", {}, "probs"),
             ("score", "cross", {"pair_column": "doc"}, "score"),
             ("token_classify", "token_cls", {}, "token_probs")]
    for task, name, extra, column in cases:
        model = bert_task_models[name]
        ds = ray.data.from_pandas(frame).map_batches(
            PoolingBatches, fn_constructor_kwargs={"task": task, "model": model, **extra}, batch_size=25,
            num_cpus=1, compute=ray.data.ActorPoolStrategy(size=1), batch_format="pandas")
        got = ds.to_pandas().sort_values("id")
        pipe = bert_task_pipe(name)  # the API's results: a Pipeline of the same model in this process
        if task == "score":
            want = [o.score for o in pipe.score(texts, docs, use_tqdm=False)]
            np.testing.assert_allclose(got[column].to_numpy(dtype=np.float64), want, atol=TOL, rtol=0)
            continue
        outs = pipe.classify(texts, use_tqdm=False) if task == "classify" else \
            pipe.encode(texts, task, use_tqdm=False)
        assert len(got) == 60
        for value, out in zip(got[column], outs):
            np.testing.assert_allclose(np.asarray(value, dtype=np.float32).reshape(out.data.shape), out.data,
                                       atol=TOL, rtol=0)


@pytest.mark.slow
def test_bad_rows_are_returned_with_errors(local_ray):
    items = [{"id": 0, "text": "fine"}, {"id": 1, "text": None}, {"id": 2, "text": "also fine"}]
    ds = ray.data.from_items(items).map_batches(
        PoolingBatches, fn_constructor_kwargs={"task": "embed", "errors": "return"}, batch_size=10, num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=1), batch_format="numpy")
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    assert [bool(r["error"]) for r in rows] == [False, True, False]
    assert "request 1" in rows[1]["error"]
    assert np.isnan(np.asarray(rows[1]["embedding"])).all() and np.isfinite(np.asarray(rows[0]["embedding"])).all()


@pytest.mark.slow
def test_pooling_batches_closes_its_group_when_collected():
    """The object owns its process group: when it is collected, the group goes (nothing keeps it
    alive until the interpreter exits)."""
    fn = PoolingBatches("embed", num_render_workers=1)
    out = fn({"text": np.array(["a text"], dtype=object)})
    assert out["embedding"].shape == (1, 384)
    pids = [fn.pipe.pids["engine"], *fn.pipe.pids["workers"]]
    del fn, out
    gc.collect()
    assert wait_gone(pids, 5.0) == []


def test_a_missing_column_is_a_clear_error():
    with pytest.raises(ValueError, match="no column 'body'"):
        _column({"text": np.array(["x"])}, "body")


@pytest.mark.slow
def test_pipeline_run_ray_errors_return_and_clear_refusals(local_ray, tmp_path, capsys):
    """In-process on the module's Ray instance: failed records go to errors.jsonl under their own
    input index (chunk offsets applied), and what --ray cannot do is refused clearly."""
    from pooling_pipeline.jobs.launcher import main

    texts = corpus.sentences(40, seed=85)
    lines = [json.dumps({"id": f"r{i}", "text": None if i in (7, 33) else t}) for i, t in enumerate(texts)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["--ray", "--input", str(src), "--output", str(out), "--errors", "return", "--ray-batch-size", "8",
                 "--quiet"]) == 0
    ids, vectors = load_results(out)
    assert ids == [f"r{i}" for i in range(40) if i not in (7, 33)] and vectors.shape == (38, 384)
    errors = [json.loads(line) for line in (out / "__job__" / "errors.jsonl").read_text().splitlines()]
    assert [(e["index"], e["id"]) for e in errors] == [(7, "r7"), (33, "r33")]

    no_ids = tmp_path / "no-ids.jsonl"
    no_ids.write_text('{"text": "a"}\n')
    for argv, message in [(["--input", str(no_ids)], "no ['id'] field"),
                          (["--input", str(src), "--precision", "int8"], "cannot calibrate int8"),
                          (["--input", str(src), "--shard", "1/2"], "drop --shard"),
                          (["--input", str(src)], "already holds a job")]:
        target = out if message == "already holds a job" else tmp_path / "refused"
        assert main(["--ray", *argv, "--output", str(target), "--quiet"]) == 2
        assert message in capsys.readouterr().err



@pytest.mark.slow
def test_pipeline_run_ray_survives_a_killed_actor(tmp_path, pipe):
    """The README promises that Ray restarts a dead actor and retries its task: an actor killed
    outright (SIGKILL, its process group with it) while it computes still gives a complete job,
    every record once, with a clean run's vectors."""
    subset = [{"id": f"k{i:04d}", "text": t} for i, t in enumerate(corpus.sentences(200, seed=86))]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in subset))
    out = tmp_path / "out"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "pooling_pipeline.jobs.launcher", "--ray", "--ray-num-cpus", "2",
                             "--ray-batch-size", "50", "--input", str(src), "--output", str(out), "--quiet"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        engine = _wait_for_a_computing_engine(proc, deadline_s=300)
        actor = engine.parent()
        group = [p.pid for p in actor.children(recursive=True)]  # the engine and its render workers
        actor.kill()  # SIGKILL: no cleanup in the actor; its engine and workers watch it and go
        assert wait_gone([actor.pid, *group], 10.0) == []
        assert not (out / "__job__" / "manifest.json").exists()  # killed mid-job, not after it
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    ids, vectors = load_results(out)
    assert ids == [r["id"] for r in subset]  # every record once, in input order
    want = np.stack([o.embedding for o in pipe.embed([r["text"] for r in subset], use_tqdm=False)])
    assert np.abs(vectors - want).max() <= TOL
    assert_no_group_left()


def _wait_for_a_computing_engine(proc, deadline_s: float) -> psutil.Process:
    """The engine core of `proc`'s job once it has done a second of work (its model is loaded and
    batches are coming): the job is under way, its one block not yet written."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        for p in psutil.Process(proc.pid).children(recursive=True):  # the job's Ray instance is its own
            try:
                if "pooling_pipeline.core.engine.main" in p.cmdline() and sum(p.cpu_times()[:2]) > 1.0:
                    return p
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.05)
    raise AssertionError("no engine core of the job started computing in time")
