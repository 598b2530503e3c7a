"""A multimodal reranker (Qwen3-VL-Reranker's layout on a tiny Qwen2-VL, saved by sentence-transformers
6.3's CrossEncoder: a Transformer with transformer_task "any-to-any" and LogitScore(yes, no)):
(query, document) pairs whose documents -- or queries -- are texts or images score as ST's
`predict` scores them (float32, CPU, within 1e-5), with prompts, and `rank` orders documents as ST's;
what it cannot take is refused naming the request. transformers 5 loads a Qwen-VL processor only
where torchvision is installed."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("torchvision", reason="transformers 5 loads a Qwen-VL processor only with torchvision")

TOL = 1e-5


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """(the model folder, ST's CrossEncoder of it, a Pipeline on it, test images)."""
    from image_samples import photo
    from sentence_transformers import CrossEncoder
    from vlm_models import build_qwen2vl_reranker

    from pooling_pipeline import Pipeline

    work = tmp_path_factory.mktemp("reranker")
    folder = build_qwen2vl_reranker(str(work / "model"))
    png = work / "chart.png"
    photo(90, 120, seed=4).save(png)
    images = {"small": photo(20, 33, seed=1), "middle": photo(56, 40, seed=2), "large": photo(300, 200, seed=3),
              "png": str(png)}
    with Pipeline(model=folder, num_render_workers=1) as pipe:
        yield folder, CrossEncoder(folder, device="cpu"), pipe, images


def scores(pipe, pairs, **kwargs) -> np.ndarray:
    return np.array([o.score for o in pipe.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False,
                                                  **kwargs)])


def test_text_and_image_pairs_score_as_st_predicts(reranker):
    folder, ce, pipe, images = reranker
    pairs = [("what is a cat?", "a cat is a small animal"), ("what is a cat?", images["middle"]),
             ("find the revenue chart", images["png"]), ("a photo of a street", images["large"]),
             (images["small"], "a tiny picture"), ("both", {"text": "a caption", "image": images["small"]})]
    reference = ce.predict(pairs)
    assert np.abs(scores(pipe, pairs) - reference).max() <= TOL
    assert np.ptp(reference) > 1e-3  # (the pairs score apart)
    prompted = ce.predict(pairs[:3], prompt_name="web_search")
    assert np.abs(scores(pipe, pairs[:3], prompt_name="web_search") - prompted).max() <= TOL
    assert np.abs(prompted - reference[:3]).max() > 1e-5  # (the prompt is a system message: it counts)


def test_rank_orders_image_documents_as_st(reranker):
    folder, ce, pipe, images = reranker
    documents = [images["middle"], "a text about cats", images["png"], images["large"]]
    want = ce.rank("what is a cat?", documents)
    got = pipe.rank("what is a cat?", documents)
    assert [r.index for r in got] == [r["corpus_id"] for r in want]
    assert np.abs(np.array([r.score for r in got]) - np.array([r["score"] for r in want])).max() <= TOL


def test_what_it_cannot_take_is_refused(reranker):
    from pooling_pipeline import Pipeline

    folder, ce, pipe, images = reranker
    outs = pipe.score(["q", "q", "q"], ["a text", {"text": "x", "video": [images["small"]]}, images["middle"]],
                      use_tqdm=False, errors="return")
    assert outs[0].error is None and outs[2].error is None and "request 1" in outs[1].error, [o.error for o in outs]
    with pytest.raises(ValueError, match="max_tokens_per_query / max_tokens_per_doc do not apply"):
        pipe.score(["q"], ["a text"], max_tokens_per_doc=5, use_tqdm=False)
    with pytest.raises(ValueError, match="(?i)embed"):
        pipe.embed(["a text"], use_tqdm=False)
    with pytest.raises(ValueError, match="backend='openvino' cannot run a multimodal reranker"):
        Pipeline(model=folder, backend="openvino")
    with pytest.raises(ValueError, match="quantize='int8' is not supported for a multimodal reranker"):
        Pipeline(model=folder, quantize="int8")


@pytest.mark.slow
def test_pipeline_serve_reranks_image_documents(reranker):
    """/v1/rerank with image documents, Jina's shape ({"image": base64}) and vLLM's (content parts
    with image_url): the scores ST's rank gives (its Sigmoid)."""
    import httpx
    from serve_helpers import started_server

    folder, ce, pipe, images = reranker
    with open(images["png"], "rb") as f:
        raw = base64.b64encode(f.read()).decode()
    want = ce.predict([("find the chart", images["png"]), ("find the chart", "a text document")])
    with started_server("--model", folder, "--num-render-workers", "1") as server:
        jina = [{"image": raw}, "a text document"]
        vllm = {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + raw}},
                            {"type": "text", "text": "a text document"}]}
        for documents in (jina, vllm):
            body = {"query": "find the chart", "documents": documents}
            response = httpx.post(server.url + "/v1/rerank", json=body, timeout=120)
            assert response.status_code == 200, response.text
            got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
            assert abs(got[0] - want[0]) <= TOL and abs(got[1] - want[1]) <= TOL
        # A string is a text over HTTP, even one naming a local image file: the server reads no file
        # a request names (ST, in its own process, would open it).
        body = {"query": images["png"], "documents": ["a text document"]}
        response = httpx.post(server.url + "/v1/rerank", json=body, timeout=120)
        assert response.status_code == 200, response.text
        as_text = ce.predict([({"text": images["png"]}, "a text document")])[0]
        assert abs(response.json()["results"][0]["relevance_score"] - as_text) <= TOL
