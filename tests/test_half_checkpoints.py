"""Checkpoints stored in bfloat16 (issue 34, item 5): Qwen3-Embedding and most LLM-based embedders.

ST 6 (transformers 5) loads such a checkpoint in bfloat16 and computes in bfloat16 on a CPU. The
pipeline's `dtype="auto"` runs it in float32 on a CPU (the project's CPU default: more exact, equal
to ST with `model_kwargs={"dtype": torch.float32}` within 1e-5) and says so at start-up with the
measured distance to bfloat16 arithmetic; `dtype="bfloat16"` gives ST's bfloat16 result within
bfloat16's own tolerance, measured here as ST's own spread (one text at a time against batches).
"""

from __future__ import annotations

import logging

import corpus
import model_zoo as zoo
import numpy as np
import pytest

from pooling_pipeline import Pipeline

TOL = 1e-5


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus.sentences(30, seed=91) + corpus.medium_texts(5, seed=92) + ["a"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = zoo.build_decoder_embedder(tmp_path_factory.mktemp("half"), "qwen3")
    return zoo.to_half_checkpoint(path, "bfloat16")


@pytest.fixture(scope="module")
def st_refs(model, texts) -> dict[str, np.ndarray]:
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu")
    assert st[0].auto_model.dtype == torch.bfloat16  # what the test is about: ST computes in bfloat16
    st32 = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": torch.float32})
    return {"bf16": st.encode(texts, batch_size=16), "bf16_single": np.stack([st.encode([t])[0] for t in texts]),
            "f32": st32.encode(texts, batch_size=16)}


def embed(pipe, texts) -> np.ndarray:
    return np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False)])


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


@pytest.mark.slow
def test_auto_runs_float32_and_says_how_far_st_is(model, texts, st_refs, caplog):
    assert np.abs(st_refs["bf16"] - st_refs["f32"]).max() > 1e-4  # the two precisions really differ
    with caplog.at_level(logging.WARNING), Pipeline(model=model, num_render_workers=1) as pipe:
        got = embed(pipe, texts)
        engine = pipe.stats()["engine"]
    assert engine["dtype"] == "float32" and engine["checkpoint_dtype"] == "bfloat16", engine
    assert 1e-5 < engine["checkpoint_dtype_max_diff"] < 5e-2, engine
    assert np.abs(got - st_refs["f32"]).max() <= TOL  # ST's float32 result
    notice = [r.getMessage() for r in caplog.records if "stored in bfloat16" in r.getMessage()]
    assert notice and "dtype='bfloat16'" in notice[0] and "max |diff|" in notice[0], notice


def _bfloat16_backends() -> list[str]:
    from pooling_pipeline.core.shared.devices import openvino_cpu_has_bfloat16

    try:
        return ["torch", "auto"] if openvino_cpu_has_bfloat16() else ["torch"]
    except ImportError:  # (no openvino: auto is torch, which the first case covers)
        return ["torch"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", _bfloat16_backends())
def test_dtype_bfloat16_is_sts_bfloat16_within_its_own_spread(model, texts, st_refs, backend):
    spread = 1 - min_cosine(st_refs["bf16"], st_refs["bf16_single"])  # ST against itself, in bfloat16
    assert spread > 0  # bfloat16 results depend on the batch: the tolerance is measured, not zero
    with Pipeline(model=model, num_render_workers=1, dtype="bfloat16", backend=backend) as pipe:
        got = embed(pipe, texts)
        assert pipe.stats()["engine"]["dtype"] == "bfloat16"
    distance = 1 - min_cosine(got, st_refs["bf16"])
    assert distance <= max(2 * spread, 1e-4), f"1 - cos to ST's bfloat16: {distance:.2e}, ST's own spread {spread:.2e}"
