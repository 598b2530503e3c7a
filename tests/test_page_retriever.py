"""ColPali page retrieval through the whole pipeline: text queries and page images as one vector per
token, equal to sentence-transformers 6's MultiVectorEncoder (`encode_query`, `encode_document`)
within 1e-5 -- ST's save and a plain transformers folder, a MultiVectorMask that keeps only a
document's image tokens -- and `score` / `rank` by MaxSim equal to ST's `similarity`; what the model
cannot take is a clear error naming the request or the option."""

from __future__ import annotations

import numpy as np
import pytest
from model_zoo import build_colpali

TOL = 1e-5
QUERIES = ["what is a cat?", "the revenue page of the report", "a dog"]


def pages() -> list:
    """Three RGB pages, and an RGBA, a palette and a grey one (ColPaliProcessor converts each to RGB)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = [Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)),
           Image.fromarray(rng.integers(0, 256, (100, 30, 3), dtype=np.uint8)),
           Image.fromarray(np.linspace(0, 255, 64 * 64 * 3).astype(np.uint8).reshape(64, 64, 3))]
    rgba = Image.fromarray(rng.integers(0, 256, (50, 50, 4), dtype=np.uint8), mode="RGBA")
    return rgb + [rgba, rgb[0].convert("P"), rgb[1].convert("L")]


def token_vectors(pipe, inputs, route=None) -> list[np.ndarray]:
    return [o.data for o in pipe.encode(inputs, task="token_embed", route=route, use_tqdm=False)]


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.shape == w.shape, (g.shape, w.shape)
        assert np.abs(g - w).max() <= TOL


@pytest.mark.parametrize("layout", ["st", pytest.param("plain", marks=pytest.mark.slow),
                                    pytest.param("keep only image tokens", marks=pytest.mark.slow)])
def test_queries_pages_and_maxsim_equal_st(layout, tmp_path):
    from sentence_transformers import MultiVectorEncoder

    from pooling_pipeline import Pipeline

    path = build_colpali(tmp_path, layout="plain" if layout == "plain" else "st",
                         keep_only_image_tokens=layout == "keep only image tokens")
    st = MultiVectorEncoder(path, device="cpu")
    images = pages()
    query_ref, page_ref = st.encode_query(QUERIES), st.encode_document(images)
    assert np.abs(np.asarray(page_ref[0]) - np.asarray(page_ref[1])).max() > 1e-3
    if layout == "keep only image tokens":
        assert all(np.asarray(p).shape[0] == 4 for p in page_ref)  # (the 4 image tokens alone)
    with Pipeline(model=path, num_render_workers=1) as pipe:
        assert_same(token_vectors(pipe, QUERIES, "query"), query_ref)
        assert_same(token_vectors(pipe, images, "document"), page_ref)
        mixed = token_vectors(pipe, [QUERIES[0], images[2], QUERIES[1]], "query")
        assert_same(mixed, [query_ref[0], st.encode_query(images[2:])[0], query_ref[1]])
        scores = np.array([[s.score for s in pipe.score(q, images, use_tqdm=False)] for q in QUERIES])
        np.testing.assert_allclose(scores, st.similarity(query_ref, page_ref).numpy(), atol=1e-4, rtol=1e-5)
        ranked = pipe.rank(QUERIES[0], images)
        assert [r.index for r in ranked] == list(np.argsort(-scores[0], kind="stable"))


@pytest.mark.slow
def test_what_a_page_retriever_cannot_do_is_refused(tmp_path):
    import json

    from pooling_pipeline import Pipeline
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    path = build_colpali(tmp_path)
    with pytest.raises(ValueError, match="backend='openvino' cannot run a page retriever"):
        Pipeline(model=path, backend="openvino")
    with pytest.raises(ValueError, match="quantize='int8' is not supported for a page retriever"):
        Pipeline(model=path, quantize="int8")
    config = tmp_path / "colpali" / "st" / "config_sentence_transformers.json"
    saved = json.loads(config.read_text())
    config.write_text(json.dumps({**saved, "prompts": {"query": "Find: ", "document": ""}}))
    with pytest.raises(ValueError, match="prompts .* on a page retriever are not supported"):
        load_model_spec(path)
    config.write_text(json.dumps(saved))
    with Pipeline(model=path, num_render_workers=1) as pipe:
        outs = pipe.encode([QUERIES[0], {"prompt_token_ids": [2, 5, 6]}, QUERIES[1]], task="token_embed",
                           use_tqdm=False, errors="return")
        assert outs[0].error is None and outs[2].error is None
        assert "request 1" in outs[1].error and "takes texts and images only" in outs[1].error, outs[1].error
        with pytest.raises(ValueError, match="token_embed"):
            pipe.embed(QUERIES[:1], use_tqdm=False)


@pytest.mark.slow
def test_rerank_with_page_images_over_http_equals_st(tmp_path):
    """pipeline-serve: /v1/rerank with a text query and page images as documents, in Jina's shape
    ({"image": base64}) and vLLM's (`{"content": [image_url parts]}`), and /v1/embeddings' chat form
    do not apply (token vectors); the scores are ST's MaxSim, best first."""
    import base64
    import io

    import httpx
    from sentence_transformers import MultiVectorEncoder
    from serve_helpers import started_server

    path = build_colpali(tmp_path)
    st = MultiVectorEncoder(path, device="cpu")
    images = pages()
    encoded, files = [], []
    for k, image in enumerate(images):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode())
        files.append(str(tmp_path / f"page{k}.png"))
        (tmp_path / f"page{k}.png").write_bytes(buffer.getvalue())
    # (ST opens a file with load_image: an RGBA page's alpha dropped, where its processor composites a
    # PIL image's on white -- so the reference is of the same files)
    want = st.similarity(st.encode_query(QUERIES[:1]), st.encode_document(files)).numpy()[0]
    with started_server("--model", path, "--num-render-workers", "1") as srv:
        jina = [{"image": b} for b in encoded]
        vllm = {"content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}} for b in encoded]}
        for documents in (jina, vllm, [{"text": "a dog"}, jina[0]]):
            response = httpx.post(srv.url + "/v1/rerank", json={"query": QUERIES[0], "documents": documents},
                                  timeout=120)
            assert response.status_code == 200, response.text
            results = response.json()["results"]
            got = {r["index"]: r["relevance_score"] for r in results}
            if documents is not jina and documents is not vllm:  # (a text and an image)
                text = st.similarity(st.encode_query(QUERIES[:1]), st.encode_query(["a dog"])).numpy()[0, 0]
                np.testing.assert_allclose([got[0], got[1]], [text, want[0]], atol=1e-4, rtol=1e-5)
                assert results[[r["index"] for r in results].index(1)]["document"]["multi_modal"] == jina[0]
                continue
            np.testing.assert_allclose([got[i] for i in range(len(images))], want, atol=1e-4, rtol=1e-5)
            assert [r["index"] for r in results] == list(np.argsort(-want, kind="stable"))
        bad = httpx.post(srv.url + "/v1/rerank", json={"query": "q", "documents": [{"image": "https://x/a.png"}]})
        assert bad.status_code == 400 and "not fetched" in bad.text


@pytest.mark.slow
def test_pipeline_run_embeds_a_folder_of_pages_as_token_vectors(tmp_path):
    """pipeline-run --task token_embed --route document on a folder of page images: each page's
    token vectors, ST's encode_document; --task embed is refused for a page retriever."""
    from sentence_transformers import MultiVectorEncoder

    from pooling_pipeline import load_results
    from pooling_pipeline.jobs.launcher import main

    path = build_colpali(tmp_path)
    folder = tmp_path / "pages"
    folder.mkdir()
    images = pages()
    for k, image in enumerate(images):
        image.save(folder / f"p{k}.png")
    want = MultiVectorEncoder(path, device="cpu").encode_document([str(folder / f"p{k}.png") for k in range(len(images))])
    out = tmp_path / "out"
    assert main(["--quiet", "--model", path, "--input", str(folder), "--task", "token_embed", "--route", "document",
                 "--output", str(out)]) == 0
    ids, rows = load_results(out)
    assert ids == [f"p{k}.png" for k in range(len(images))]
    for got, ref in zip(rows, want):
        assert got.shape == tuple(ref.shape) and np.abs(got - np.asarray(ref)).max() <= TOL
    assert main(["--quiet", "--model", path, "--input", str(folder), "--output", str(tmp_path / "o2")]) != 0
