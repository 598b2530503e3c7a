"""Backends: what `backend=` and `quantize=` choose, refuse and report; the OpenVINO backend's
results against the torch backend's for every kind of output; its conversion cache and the
start-up check that guards it. Every test asserts what holds with the openvino package installed
and what holds without it (no skips): CI installs the extra, a plain install has none."""

import importlib.util
import json
import os
import shutil

import corpus
import numpy as np
import pytest
from model_zoo import build_colbert, build_cross_encoder, build_llm_reranker, build_splade
from tiny_models import build_bert
from transformers import BertForTokenClassification

from pooling_pipeline import Pipeline
from pooling_pipeline.backends import describe_backend
from pooling_pipeline.core.shared.devices import openvino_cpu_has_bfloat16

HAVE_OPENVINO = importlib.util.find_spec("openvino") is not None
TOL = 1e-5
TEXTS = corpus.sentences(24, seed=71) + corpus.medium_texts(4, seed=72)


@pytest.mark.slow
def test_auto_runs_openvino_where_installed_and_matches_st(pipe, reference, mixed_texts):
    """The session's default Pipeline (backend "auto") is what every other test runs against."""
    engine = pipe.stats()["engine"]
    assert engine["backend"] == ("openvino" if HAVE_OPENVINO else "torch"), engine
    if HAVE_OPENVINO:
        assert engine["verified_max_diff"] <= 1e-5
        assert engine["precision"] == "f32", "float32 unless bfloat16 is asked for"
        assert "backend openvino" in describe_backend(engine)
    out = np.stack([o.data for o in pipe.embed(mixed_texts, use_tqdm=False)])
    assert np.abs(out - reference).max() < TOL


@pytest.mark.parametrize("options, message", [
    ({"backend": "openvino", "device": "sim"}, "runs on the CPU"),
    ({"backend": "openvino", "dtype": "float16"}, "runs in float32"),
    ({"backend": "openvino", "quantize": "int8"}, "int8' runs on the torch backend"),
    ({"quantize": "int8", "device": "sim"}, "dynamic quantization for a CPU"),
    ({"quantize": "int8", "dtype": "bf16"}, "not float32"),
    ({"backend": "onnx"}, "backend"),
    ({"quantize": "int4"}, "quantize"),
])
def test_combinations_that_cannot_be_honoured_fail_in_the_caller(options, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(**options)


def test_openvino_without_the_package_names_the_extra(monkeypatch):
    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match=r"pooling-pipeline\[openvino\]"):
            Pipeline(backend="openvino")
        return
    # Installed: the same check, with the package hidden from the caller's lookup.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(ValueError, match=r"pooling-pipeline\[openvino\]"):
        Pipeline(backend="openvino")


@pytest.mark.slow
def test_bfloat16_on_openvino_is_opt_in_and_close(model_path, st_model):
    """dtype="bfloat16" compiles the (float32-checked) conversion for bfloat16 where the CPU has the
    units: faster, and visibly not float32; elsewhere, or without openvino, a clear error."""
    if not (HAVE_OPENVINO and openvino_cpu_has_bfloat16()):
        with pytest.raises(ValueError, match=r"bfloat16 units|pooling-pipeline\[openvino\]"):
            Pipeline(model=model_path, backend="openvino", dtype="bfloat16")
        return
    with Pipeline(model=model_path, backend="openvino", dtype="bfloat16") as pipe:
        engine = pipe.stats()["engine"]
        out = np.stack([o.embedding for o in pipe.embed(TEXTS, use_tqdm=False)])
    assert (engine["backend"], engine["precision"], engine["dtype"]) == ("openvino", "bf16", "bfloat16"), engine
    assert engine["verified_max_diff"] <= 1e-5 and 0 < engine["verified_bf16_max_diff"] <= 5e-2, engine
    assert "bfloat16" in describe_backend(engine)
    ref = st_model.encode(TEXTS)
    cos = np.sum(out * ref, axis=1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.999, cos.min()
    assert np.abs(out - ref).max() > 1e-5, "bfloat16 gave float32's results: the precision hint was not applied"


@pytest.fixture(scope="module")
def task_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend-models")
    return {
        "cross": build_cross_encoder(root / "cross"),
        "token_cls": build_bert(root / "token_cls", BertForTokenClassification, num_labels=5),
        "colbert": build_colbert(root / "colbert"),
        "splade": build_splade(root / "splade"),
        "llm_reranker": build_llm_reranker(root / "llm"),
    }


def _run(model: str, backend: str, kind: str):
    with Pipeline(model=model, backend=backend) as pipe:
        engine = pipe.stats()["engine"]
        if kind == "score":
            outs = pipe.score(TEXTS[:6], TEXTS[6:12], use_tqdm=False)
        elif kind == "token":
            outs = pipe.encode(TEXTS, "token_classify", use_tqdm=False)
        elif kind == "colbert":
            outs = pipe.encode(TEXTS, "token_embed", use_tqdm=False)
        else:
            outs = pipe.encode(TEXTS, "sparse_embed", use_tqdm=False)
    return engine, [o.score if kind == "score" else o.data for o in outs]


def _dense_pair(got: tuple, want: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Two sparse vectors (ids, weights) over the union of their active dimensions: a dimension
    active in one only must then have a weight within the tolerance of 0 (a weight that rounds to
    exactly 0 in one backend and not in the other), and every other one the same weight."""
    dims = np.union1d(got[0], want[0])
    dense = []
    for ids, weights in (got, want):
        values = np.zeros(len(dims))
        values[np.searchsorted(dims, ids)] = weights
        dense.append(values)
    return dense[0], dense[1]


def _flat(data) -> np.ndarray:
    if isinstance(data, tuple):  # sparse: (ids, weights)
        return np.concatenate([np.asarray(d, dtype=np.float64).ravel() for d in data])
    return np.asarray(data, dtype=np.float64).ravel()


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", [("cross", "score"), ("token_cls", "token"), ("colbert", "colbert"),
                                        ("splade", "sparse"), ("llm_reranker", "score")])
def test_openvino_gives_the_torch_backends_results_for_every_output(task_models, name, kind):
    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match="openvino"):
            Pipeline(model=task_models[name], backend="openvino")
        return
    engine, got = _run(task_models[name], "openvino", kind)
    assert engine["backend"] == "openvino", engine
    _, want = _run(task_models[name], "torch", kind)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, tuple):  # the same active dimensions, the same weights
            g, w = _dense_pair(g, w)
        g, w = _flat(g), _flat(w)
        assert g.shape == w.shape
        assert np.abs(g - w).max() <= TOL * max(1.0, np.abs(w).max())


@pytest.mark.slow
def test_conversion_is_cached_and_a_wrong_cache_entry_is_refused(tmp_path, monkeypatch, model_path):
    """The second start reads the cached conversion; an entry that does not compute the model
    (here: another model's conversion under this model's key) fails the start-up check: an
    explicit backend='openvino' refuses to start, 'auto' runs torch."""
    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match="openvino"):
            Pipeline(backend="openvino")
        return
    monkeypatch.setenv("POOLING_PIPELINE_CACHE", str(tmp_path / "cache"))
    other = build_bert(tmp_path / "other")
    texts = TEXTS[:8]
    with Pipeline(backend="openvino") as pipe:
        first = pipe.stats()["engine"]
        want = np.stack([o.data for o in pipe.embed(texts, use_tqdm=False)])
    assert first["conversion"] == "converted" and first["conversion_s"] > 0
    assert os.path.isfile(os.path.join(first["conversion_cache"], "model.xml"))
    assert "converted in" in describe_backend(first)
    with Pipeline(backend="openvino") as pipe:
        second = pipe.stats()["engine"]
        again = np.stack([o.data for o in pipe.embed(texts, use_tqdm=False)])
    assert second["conversion"] == "cached" and second["conversion_cache"] == first["conversion_cache"]
    assert np.abs(again - want).max() < TOL
    # Poison the entry: the other model's conversion in its place, its checksums rewritten to claim this
    # model's key (a copied entry alone is seen as written for another key, removed and rebuilt:
    # tests/test_conversion_cache.py); what is left to catch it is the start-up check.
    with Pipeline(model=other, backend="openvino") as pipe:
        foreign = pipe.stats()["engine"]["conversion_cache"]
    shutil.rmtree(first["conversion_cache"])
    shutil.copytree(foreign, first["conversion_cache"])
    checksums = os.path.join(first["conversion_cache"], "checksums.json")
    with open(checksums) as f:
        entry = json.load(f)
    with open(checksums, "w") as f:
        json.dump({**entry, "key": os.path.basename(first["conversion_cache"])}, f)
    with pytest.raises(Exception, match="cannot run model .*differs from the torch module|gives shape"):
        Pipeline(backend="openvino")
    with Pipeline(backend="auto") as pipe:
        engine = pipe.stats()["engine"]
        fallback = np.stack([o.data for o in pipe.embed(texts, use_tqdm=False)])
    assert engine["backend"] == "torch" and "gives shape" in engine["openvino_refused"], engine
    assert np.abs(fallback - want).max() < TOL


def test_cache_keeps_the_most_recently_used_entries(tmp_path):
    from pooling_pipeline.core.engine.openvino_model import prune_cache

    for i in range(5):
        (tmp_path / f"m{i}").mkdir()
        os.utime(tmp_path / f"m{i}", (1000 + i, 1000 + i))
    os.utime(tmp_path / "m0", (5000, 5000))  # used last
    assert sorted(prune_cache(str(tmp_path), keep=2)) == ["m1", "m2", "m3"]
    assert sorted(os.listdir(tmp_path)) == ["m0", "m4"]


@pytest.mark.slow
def test_int8_is_opt_in_close_to_float32_and_reported(pipe, model_path):
    texts = corpus.sentences(64, seed=73)
    full = np.stack([o.data for o in pipe.embed(texts, use_tqdm=False)])
    with Pipeline(quantize="int8") as q:
        engine = q.stats()["engine"]
        low = np.stack([o.data for o in q.embed(texts, use_tqdm=False)])
    assert engine["backend"] == "torch" and engine["quantize"] == "int8"
    assert "quantize int8" in describe_backend(engine)
    cosine = (full * low).sum(1)  # both unit vectors
    assert cosine.min() > 0.85, cosine.min()  # measured 0.92-0.96 (ST + ONNX int8: 0.94-0.98)
    assert np.abs(full - low).max() > 1e-4  # it did quantize: not float32's vectors


@pytest.mark.slow
def test_start_up_says_what_precision_runs(model_path, caplog):
    """Start-up names the backend and precision (a log line at INFO, stats()["engine"]); on a CPU with
    bfloat16 units running float32 it says once that dtype='bfloat16' is faster and what it changes,
    without changing the default (issue 37, item 7)."""
    import logging

    from pooling_pipeline import api
    from pooling_pipeline.backends import cpu_has_bfloat16_units

    api._said_once.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"), Pipeline(num_render_workers=1) as pipe:
        engine = pipe.stats()["engine"]
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline"]
    assert engine["dtype"] == "float32" and engine["device"] == "cpu"
    assert any(line.startswith(f"backend {engine['backend']}") and "float32" in line for line in lines), lines
    hinted = [line for line in lines if "dtype='bfloat16'" in line and "1 - cos" in line]
    assert len(hinted) == (1 if cpu_has_bfloat16_units() else 0), lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"), Pipeline(num_render_workers=1):
        pass
    assert not [r for r in caplog.records if "dtype='bfloat16'" in r.getMessage()]  # said once a process


def _spec(input_module="transformer", trust_remote_code=False):
    from types import SimpleNamespace

    return SimpleNamespace(input_module=input_module, trust_remote_code=trust_remote_code, path="model")


def test_torch_threads_sleep_after_a_loop_only_where_openvino_runs_the_transformer():
    """torch's OpenMP threads spinning after the pooling took the cores OpenVINO's next forward
    needed (0.90-0.95x the pipeline's speed); on the torch backend, spinning is what keeps its own
    forward fast (passive measured 0.95-0.98x). See the transformer family's engine_environment
    (core/families/transformer.py)."""
    from pooling_pipeline.core.families import family_of

    def engine_openmp_env(backend, device, spec, environ):
        return family_of(spec).engine_environment(backend, device, spec, environ)

    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_openmp_env("openvino", "cpu", _spec(), environ={}) == passive
    assert engine_openmp_env("auto", "cpu", _spec(), environ={}) == (passive if HAVE_OPENVINO else {})
    assert engine_openmp_env("openvino", "cpu", _spec(), environ={"OMP_WAIT_POLICY": "ACTIVE"}) == {
        "OMP_WAIT_POLICY": "ACTIVE"}, "the caller's own setting is kept"
    for backend, device, spec in [("torch", "cpu", _spec()), ("auto", "cuda", _spec()), ("auto", "sim", _spec()),
                                  ("auto", "cpu", _spec(trust_remote_code=True)),  # "auto" keeps torch for its code
                                  ("auto", "cpu", _spec("dual_encoder")),  # the text tower runs on torch
                                  ("torch", "cpu", _spec("static_embedding"))]:
        assert engine_openmp_env(backend, device, spec, environ={}) == {}, (backend, device, spec)


def _process_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if item)


@pytest.mark.slow
def test_the_engine_process_gets_the_wait_policy_of_its_backend(pipe, model_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    engine = pipe.stats()["engine"]  # the session's default: "auto", OpenVINO where it is installed
    if HAVE_OPENVINO:
        assert engine["backend"] == "openvino" and engine["omp_wait_policy"] == "PASSIVE", engine
        assert _process_environ(pipe.pids["engine"]).get("OMP_WAIT_POLICY") == "PASSIVE"
    with Pipeline(model=model_path, backend="torch", num_render_workers=1) as torch_pipe:
        assert "OMP_WAIT_POLICY" not in _process_environ(torch_pipe.pids["engine"])
        assert torch_pipe.stats()["engine"]["backend"] == "torch"
