"""ColQwen2 page retrieval through the whole pipeline (a tiny ColQwen2ForRetrieval saved by
sentence-transformers 6.3's MultiVectorEncoder): text queries and page images of any size as one
vector per token, equal to ST's `encode_query` / `encode_document` within 1e-5 -- with ST's default
mask and one keeping only a page's image tokens -- and `score` / `rank` by MaxSim equal to ST's
`similarity`; what the model cannot take is a clear error. transformers 5 loads the Qwen2-VL image
processor only where torchvision is installed."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchvision", reason="transformers 5 loads a Qwen-VL image processor only with torchvision")

TOL = 1e-5
QUERIES = ["What is the capital of France?", "cat", "the revenue page of the report"]


def pages(tmp_path) -> list:
    """Pages of several sizes (fewer pixels than the processor's least, between, more than its most),
    an RGBA and a grey one (converted to RGB as ST's processor converts them), a PNG by path."""
    from image_samples import photo
    from PIL import Image

    rng = np.random.default_rng(0)
    small = Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8))
    middle = photo(56, 40, seed=2)
    large = photo(300, 200, seed=3)
    rgba = Image.fromarray(rng.integers(0, 256, (50, 50, 4), dtype=np.uint8), mode="RGBA")
    path = tmp_path / "page.png"
    photo(90, 120, seed=4).convert("RGBA").save(path)
    return [small, middle, large, rgba, middle.convert("L"), str(path)]


def token_vectors(pipe, inputs, route=None) -> list[np.ndarray]:
    return [o.data for o in pipe.encode(inputs, task="token_embed", route=route, use_tqdm=False)]


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.shape == w.shape, (g.shape, w.shape)
        assert not g.size or np.abs(g - w).max() <= TOL  # (a text document keeps no image token: none)


@pytest.mark.parametrize("keep_only_image_tokens", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_queries_pages_and_maxsim_equal_st(keep_only_image_tokens, tmp_path):
    from sentence_transformers import MultiVectorEncoder
    from vlm_models import build_colqwen2

    from pooling_pipeline import Pipeline

    path = build_colqwen2(str(tmp_path / "colqwen2"), keep_only_image_tokens=keep_only_image_tokens)
    st = MultiVectorEncoder(path, device="cpu")
    images = pages(tmp_path)
    query_ref, page_ref = st.encode_query(QUERIES), st.encode_document(images)
    assert len({np.asarray(p).shape[0] for p in page_ref}) > 1  # (pages of their own sizes)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_same(token_vectors(pipe, QUERIES, "query"), query_ref)
        assert_same(token_vectors(pipe, images, "document"), page_ref)
        mixed = token_vectors(pipe, [QUERIES[0], images[2], QUERIES[1]], "document")
        assert_same(mixed, [st.encode_document(QUERIES[:1])[0], page_ref[2], st.encode_document(QUERIES[1:2])[0]])
        scores = np.array([[s.score for s in pipe.score(q, images, use_tqdm=False)] for q in QUERIES])
        np.testing.assert_allclose(scores, st.similarity(query_ref, page_ref).numpy(), atol=1e-4, rtol=1e-5)
        ranked = pipe.rank(QUERIES[0], images)
        assert [r.index for r in ranked] == list(np.argsort(-scores[0], kind="stable"))


@pytest.mark.slow
def test_what_a_colqwen2_retriever_cannot_do_is_refused(tmp_path):
    from vlm_models import build_colqwen2

    from pooling_pipeline import Pipeline

    path = build_colqwen2(str(tmp_path / "colqwen2"))
    with pytest.raises(ValueError, match="backend='openvino' cannot run a page retriever \\(ColQwen2\\)"):
        Pipeline(model=path, backend="openvino")
    with pytest.raises(ValueError, match="quantize='int8' is not supported for a page retriever \\(ColQwen2\\)"):
        Pipeline(model=path, quantize="int8")
    with pytest.raises(ValueError, match="image_decode='draft' applies to CLIP"):
        Pipeline(model=path, image_decode="draft")
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.encode(["a query", [1, 2, 3], {"text": "a", "image": pages(tmp_path)[0]}], task="token_embed",
                           use_tqdm=False, errors="return")
        assert outs[0].error is None
        assert "request 1" in outs[1].error and "request 2" in outs[2].error, [o.error for o in outs]
