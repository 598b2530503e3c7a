"""The OpenVINO conversion cache never serves anything but the model on disk, and never stops a run
(issue 35, items 1, 2, 4, 5): a damaged or truncated entry is removed and rebuilt, naming it; a
model rewritten in place (size and modification time kept) gets a conversion of its own; a cache
that cannot be written serves the conversion from memory; OpenVINO failing under `auto` runs torch.
With the openvino extra absent there is no cache: what holds then is asserted instead (no skips)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import corpus
import numpy as np
import pytest
from helpers import rewrite_in_place
from tiny_models import build_bert

from pooling_pipeline import Pipeline

HAVE_OPENVINO = importlib.util.find_spec("openvino") is not None
TOL = 1e-5
TEXTS = corpus.sentences(16, seed=101) + corpus.medium_texts(3, seed=102)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("POOLING_PIPELINE_CACHE", str(root))
    return root


@pytest.fixture
def model(tmp_path) -> Path:
    return Path(build_bert(tmp_path / "model"))


def reference(model: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model), device="cpu").encode(TEXTS)


def run(model: Path, backend: str = "auto") -> tuple[dict, np.ndarray]:
    with Pipeline(model=str(model), backend=backend, num_render_workers=1) as pipe:
        vectors = np.stack([o.embedding for o in pipe.embed(TEXTS, use_tqdm=False)])
        return pipe.stats()["engine"], vectors


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert float(np.abs(got - want).max()) <= TOL


@pytest.mark.slow
def test_without_openvino_auto_runs_torch(cache, model):
    if HAVE_OPENVINO:
        engine, _ = run(model)
        assert engine["backend"] == "openvino" and engine["conversion"] == "converted"
        assert (Path(engine["conversion_cache"]) / "checksums.json").is_file()
        return
    engine, got = run(model)
    assert engine["backend"] == "torch"
    assert_close(got, reference(model))
    assert not cache.exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["changed", "truncated"])
def test_a_damaged_entry_is_removed_and_rebuilt(cache, model, caplog, damage):
    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match="openvino"):
            Pipeline(model=str(model), backend="openvino")
        return
    first, want = run(model, "openvino")
    entry = Path(first["conversion_cache"])
    weights = entry / "model.bin"
    if damage == "changed":  # the same size, some weights altered
        rewrite_in_place(weights)
    else:
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        second, got = run(model, "openvino")
    err = caplog.text
    assert second["conversion"] == "converted", second  # rebuilt, not served
    assert f"cached OpenVINO conversion {entry} is damaged" in err and "converting the model again" in err, err
    assert_close(got, want)
    assert_close(got, reference(model))
    third, _ = run(model, "openvino")  # the rebuilt entry serves the next start
    assert third["conversion"] == "cached"


@pytest.mark.slow
def test_a_model_rewritten_in_place_is_converted_anew(cache, model):
    """Weights changed in place with their size and modification time kept: the key covers the
    content, so the old model's conversion is not served; the results are the new model's."""
    if not HAVE_OPENVINO:
        engine, got = run(model)
        rewrite_in_place(model / "model.safetensors")
        assert_close(run(model)[1], reference(model))
        return
    first, before = run(model)
    rewrite_in_place(model / "model.safetensors")
    want = reference(model)
    assert float(np.abs(want - before).max()) > 1e-3  # the rewrite changed the model
    second, got = run(model)
    assert second["conversion"] == "converted" and second["conversion_cache"] != first["conversion_cache"]
    assert_close(got, want)


@pytest.mark.slow
def test_the_same_transformer_under_another_name_pooling_and_prompts_reuses_its_checked_conversion(cache, tmp_path):
    """The key covers what shapes the transformer's graph -- its config, weights, model_args, the
    module class -- not the folder's name, the tokenizer files, the prompts or the other modules'
    own folders: the same weights under another pooling, with prompts, in a folder of another name,
    start from the cached conversion and its remembered check (the torch module is not even built),
    and give their own results (ST's, prompt included)."""
    import model_zoo as zoo

    first_model = zoo.build_bert_pooling(tmp_path / "a", "cls")
    other = zoo.build_bert_prompts(tmp_path / "b", pooling_mode="max")
    for name in ("config.json", "model.safetensors"):  # the same transformer (the zoo's seeded backbone)
        assert (Path(first_model) / name).read_bytes() == (Path(other) / name).read_bytes()
    assert Path(first_model).name != Path(other).name
    first, _ = run(Path(first_model))
    second, got = run(Path(other))
    if not HAVE_OPENVINO:
        assert first["backend"] == second["backend"] == "torch"
    else:
        assert first["conversion"] == "converted" and second["conversion"] == "cached"
        assert second["conversion_cache"] == first["conversion_cache"] and second["torch_module"] == "not built"
    assert_close(got, reference(Path(other)))
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(other, device="cpu")
    name = "passage"  # (the default prompt is "query")
    with Pipeline(model=other, num_render_workers=1) as pipe:
        prompted = np.stack([o.embedding for o in pipe.embed(TEXTS, prompt_name=name, use_tqdm=False)])
    want = st.encode(TEXTS, prompt_name=name)
    assert float(np.abs(want - reference(Path(other))).max()) > 1e-3  # the prompt matters
    assert_close(prompted, want)


@pytest.mark.parametrize("how", ["cache is a file", "openvino folder is a file"])
def test_an_unwritable_cache_never_stops_the_run(cache, model, caplog, how):
    if how == "cache is a file":
        cache.write_text("not a folder\n")
    else:
        cache.mkdir()
        (cache / "openvino").write_text("not a folder\n")
    with caplog.at_level(logging.WARNING):
        engine, got = run(model)
    assert_close(got, reference(model))
    if HAVE_OPENVINO:
        assert engine["backend"] == "openvino" and engine["conversion"] == "converted"
        assert engine["conversion_cache"] == "not cached (see the warning)"
        assert "could not cache the OpenVINO conversion" in caplog.text and str(cache) in caplog.text


def test_a_failing_write_is_a_warning_not_a_failure(tmp_path, caplog):
    """What a full disk or a file-size limit gives OpenVINO's writer (a RuntimeError, not an OSError)."""
    from pooling_pipeline.core import openvino_model

    class FailingWriter:
        @staticmethod
        def save_model(*args, **kwargs):
            raise RuntimeError("basic_ios::clear: iostream error")

    assert openvino_model.save_entry(FailingWriter, object(), str(tmp_path / "openvino" / "entry"), "key") is False
    assert "basic_ios::clear" in caplog.text
    assert not (tmp_path / "openvino" / "entry").exists()
    assert not [p for p in (tmp_path / "openvino").iterdir() if p.name.startswith(".converting-")]


def test_auto_runs_torch_when_openvino_itself_fails(model, monkeypatch):
    """Not only a refused conversion: any failure of OpenVINO under auto leaves the torch module
    running, with the reason; backend='openvino' refuses, naming it."""
    from pooling_pipeline.core import model_runner, openvino_model
    from pooling_pipeline.core.model_folder.load import load_model_spec

    def broken(*args, **kwargs):
        raise RuntimeError("Exception from src/inference/src/cpp/core.cpp: out of memory")

    monkeypatch.setattr(openvino_model, "to_openvino", broken)
    spec = load_model_spec(str(model))
    runner = model_runner.ModelRunner(spec, "cpu", "auto", backend="auto")
    assert runner.backend_info["backend"] == "torch"
    assert "OpenVINO failed: RuntimeError" in runner.backend_info["openvino_refused"]
    if HAVE_OPENVINO:
        with pytest.raises(ValueError, match="cannot run model .*out of memory"):
            model_runner.ModelRunner(spec, "cpu", "auto", backend="openvino")


@pytest.mark.slow
def test_the_check_of_a_cached_entry_is_remembered_for_its_files_and_versions(cache, model):
    """A start from a cached entry does not repeat the check against the torch module that the
    entry passed (the results stay the model's); a check recorded for other files, other library
    versions or another CPU is made again."""
    if not HAVE_OPENVINO:
        with pytest.raises(ValueError, match="openvino"):
            Pipeline(model=str(model), backend="openvino")
        return
    import json

    first, want = run(model, "openvino")
    assert first["verification"] == "checked" and "torch_module" not in first
    second, got = run(model, "openvino")
    assert second["conversion"] == "cached" and second["verification"] == "remembered", second
    assert second["verified_max_diff"] == first["verified_max_diff"] and second["verify_s"] == 0
    # Nothing needed the torch module's weights: it was not built (the entry told the token-type input).
    assert second["torch_module"] == "not built"
    assert_close(got, reference(model))
    auto, got = run(model, "auto")
    assert auto["backend"] == "openvino" and auto["torch_module"] == "not built"
    assert_close(got, want)
    verified = Path(first["conversion_cache"]) / "verified.json"
    record = json.loads(verified.read_text())
    for field, other in (("cpu", "another-cpu"), ("files", {"model.xml": "0", "model.bin": "0"}), ("torch", "0.0")):
        verified.write_text(json.dumps({**record, "identity": {**record["identity"], field: other}}))
        again, got = run(model, "openvino")
        assert again["verification"] == "checked" and "torch_module" not in again, (field, again)
        assert_close(got, want)
