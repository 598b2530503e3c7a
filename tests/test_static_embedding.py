"""Static embeddings (issue 34, item 7): ST's StaticEmbedding -- model2vec / potion models, ST's
static-retrieval models -- served as a whole model and as a Router's query route, equal to
sentence-transformers within 1e-5: its tokenizer.json as `tokenizers` loads it (no special tokens,
its own saved truncation or none), the mean of the tokens' rows, then Dense / Normalize /
truncate_dim as for any model."""

from __future__ import annotations

import json
from pathlib import Path

import corpus
import model_zoo as zoo
import numpy as np
import pytest

from pooling_pipeline import Pipeline, PoolingParams, SentenceEncoder

TOL = 1e-5


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Sentences, docstrings, long documents (thousands of tokens: no truncation in ST unless the
    tokenizer saves one), the empty string (a zero vector in ST), non-ASCII text."""
    out = corpus.sentences(20, seed=81) + corpus.medium_texts(5, seed=82) + corpus.long_documents(2, 5_000, 30_000, seed=83)
    return out + ["", "a", "Émile's café: naïve façade — 東京 and emoji 🙂🚀", "word " * 700]


def st_model(path: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def assert_close(got, ref, what: str) -> None:
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, sentence-transformers gives {ref.shape}"
    assert got.dtype == np.float32
    diff = float(np.abs(got.astype(np.float64) - ref).max())
    assert diff <= TOL, f"{what}: max |diff| {diff:.3g} vs sentence-transformers"


def embed(pipe, texts, **kwargs) -> np.ndarray:
    return np.stack([o.embedding for o in pipe.embed(texts, use_tqdm=False, **kwargs)])


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, {"normalize": True, "truncation": 16, "dense": True},
                                    {"normalize": True, "truncate_dim": 8}],
                         ids=["plain-untruncated", "truncated16-dense-normalize", "normalize-truncate_dim"])
def test_static_embedding_as_sentence_transformers(tmp_path, texts, kwargs):
    path = zoo.build_static(tmp_path, **kwargs)
    st = st_model(path)
    ref = st.encode(texts)
    assert np.abs(ref - ref.mean(axis=0)).max() > 1e-3
    assert np.abs(ref[texts.index("")]).max() == 0 or kwargs.get("dense")  # ST: an empty text is a zero mean
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, texts), ref, f"static {kwargs}")
        outs = pipe.embed(texts, use_tqdm=False)
        # ST's own count: its tokenizer with its saved truncation, no special tokens
        counts = [len(st[0].tokenizer.encode(t, add_special_tokens=False).ids) for t in texts]
        assert [o.num_prompt_tokens for o, t in zip(outs, texts) if t] == [c for c, t in zip(counts, texts) if t]
        info = pipe.stats()["engine"]
        assert "static" in info.get("model", ""), info
        if kwargs.get("truncation") is None:  # the long documents are kept whole, as in ST
            assert max(o.num_prompt_tokens for o in outs) > 1000
        # The options every model takes: a prompt, dimensions, normalize
        assert_close(embed(pipe, texts[:6], prompt="query: "), st.encode(texts[:6], prompt="query: "), "prompt")
        assert_close(embed(pipe, texts[:6], pooling_params=PoolingParams(normalize=True)),
                     st.encode(texts[:6], normalize_embeddings=True), "normalize=True")
    with SentenceEncoder(path, num_render_workers=1) as enc:
        assert enc.get_sentence_embedding_dimension() == st.get_embedding_dimension()
        assert_close(enc.encode(texts, truncate_dim=4), st.encode(texts, truncate_dim=4), "encoder truncate_dim=4")
        scores = enc.similarity(enc.encode(texts[:3]), enc.encode(texts[3:9]))
        assert_close(scores.numpy(), st.similarity(ref[:3], ref[3:9]).numpy(), "similarity")


def test_model2vec_layout(tmp_path, texts):
    """model2vec's own folder (embeddings + mapping + per-token weights, config.json of model_type
    model2vec), loaded as ST loads it through its modules.json."""
    path = zoo.build_model2vec(tmp_path)
    st = st_model(path)
    ref = st.encode(texts)
    assert np.allclose(np.linalg.norm(ref[:5], axis=1), 1.0, atol=1e-5)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_close(embed(pipe, texts), ref, "model2vec")
        docs = texts[:8]
        scores = [o.score for o in pipe.score(texts[8], docs, use_tqdm=False)]
        assert_close(np.asarray(scores, np.float32), st.similarity(st.encode([texts[8]]), st.encode(docs)).numpy()[0],
                     "model2vec score")


@pytest.mark.slow
def test_router_with_a_static_query_route(tmp_path, texts):
    """An inference-free dense retriever: queries through a StaticEmbedding route (its tokenizer
    truncates at 128, as saved), documents through BERT; both then Normalize."""
    path = zoo.build_router_static_query(tmp_path)
    st = st_model(path)
    queries, docs = texts[:12] + [""], texts[12:]
    with SentenceEncoder(path, num_render_workers=1) as enc:
        ref_q = st.encode_query(queries)
        assert_close(enc.encode_query(queries), ref_q, "static query route")
        assert_close(enc.encode_document(docs), st.encode_document(docs), "transformer document route")
        assert np.abs(ref_q - st.encode_document(queries)).max() > 1e-3  # the two routes differ


def test_static_embedding_refusals(tmp_path):
    """What cannot be honoured is refused in the caller, naming it: another precision or backend,
    and a table that is not float32 (ST would compute it in float16)."""
    path = zoo.build_static(tmp_path, name="static-refusals")
    for kwargs in ({"dtype": "bfloat16"}, {"backend": "openvino"}, {"quantize": "int8"}):
        with pytest.raises(ValueError, match="static embedding"):
            Pipeline(model=path, num_render_workers=1, **kwargs)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(path) / "model.safetensors"))
    save_file({k: v.half() for k, v in weights.items()}, str(Path(path) / "model.safetensors"))
    with pytest.raises(ValueError, match="F16"):
        Pipeline(model=path, num_render_workers=1)
    (Path(path) / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.StaticEmbedding"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    with pytest.raises(ValueError, match="Pooling module after StaticEmbedding"):
        Pipeline(model=path, num_render_workers=1)
