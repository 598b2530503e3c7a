"""pipeline-serve with a CLIP model: images as base64 or data: URIs equal sentence-transformers' vectors;
a local file only under the directory the operator allowed; no URL fetched; a text is always a text,
even one naming an existing image file (request content never chooses a file to read)."""

from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import pytest
from image_samples import build_image_files
from serve_helpers import started_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """The server's allowed media directory: its own (a test adds a symlink to it), not conftest's."""
    return build_image_files(tmp_path_factory.mktemp("allowed"))


@pytest.fixture(scope="module")
def server(clip_dir, images):
    allowed = os.path.dirname(images["photo.jpg"])
    with started_server("--model", clip_dir, "--num-render-workers", "1", "--allowed-local-media-path", allowed) as srv:
        yield srv


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def test_images_as_base64_data_uris_and_allowed_files_equal_st(server, clip_st, images):
    names = ["photo.jpg", "palette.png"]
    raw = [base64.b64encode(images[n].read_bytes()).decode() for n in names]
    mime = {"photo.jpg": "image/jpeg", "palette.png": "image/png"}
    uris = [f"data:{mime[n]};base64,{b}" for n, b in zip(names, raw)]
    reference = clip_st.encode([str(images[n]) for n in names])
    for inputs in (raw, uris, [str(images[n]) for n in names], [f"file://{images[n]}" for n in names]):
        np.testing.assert_allclose(vectors(post(server, {"input": inputs, "modality": "image"})), reference,
                                   atol=1e-5, rtol=0)


def test_texts_are_texts_even_when_they_name_an_image_file(server, clip_st, images):
    texts = ["a photo of a cat", str(images["photo.jpg"])]
    got = vectors(post(server, {"input": texts}))
    np.testing.assert_allclose(got[0], clip_st.encode(texts[:1])[0], atol=1e-5, rtol=0)
    # ST would open the file; the server embeds the string: the text tower's vector, not the image's
    assert not np.allclose(got[1], clip_st.encode([texts[1]])[0], atol=1e-3)
    np.testing.assert_allclose(got[1], clip_st.encode([{"text": texts[1]}])[0], atol=1e-5, rtol=0)


def test_files_outside_the_allowed_directory_and_urls_are_refused(server, images, tmp_path):
    outside = tmp_path / "secret.png"
    outside.write_bytes(images["palette.png"].read_bytes())
    link = images["photo.jpg"].parent / "link-out.png"
    if not link.exists():
        link.symlink_to(outside)
    for value, says in ((str(outside), "outside the allowed media directory"),
                        (str(link), "outside the allowed media directory"),
                        ("/etc/passwd", "outside the allowed media directory"),
                        ("http://example.com/cat.png", "not fetched"),
                        ("not base64 at all!", "must be base64")):
        response = post(server, {"input": [value], "modality": "image"})
        assert response.status_code == 400, response.text
        assert says in response.json()["error"]["message"]
    assert post(server, {"input": [base64.b64encode(b"not an image").decode()], "modality": "image"}).status_code == 400
    assert post(server, {"input": "still serving"}).status_code == 200


def test_images_on_a_text_model_are_refused():
    with started_server("--backend", "torch") as srv:
        response = httpx.post(srv.url + "/v1/embeddings", json={"input": ["aGVsbG8="], "modality": "image"})
        assert response.status_code == 400 and "takes no images" in response.json()["error"]["message"]


def test_vllm_chat_messages_with_an_image_url_or_a_text_equal_st(server, clip_st, images):
    """vLLM's chat form of /v1/embeddings: one conversation, one embedding -- an image_url part
    (a data URI, or a file under the allowed directory) or a text; more than one part is a 400."""
    raw = base64.b64encode(images["photo.jpg"].read_bytes()).decode()
    reference = clip_st.encode([str(images["photo.jpg"])])[0]
    for url in (f"data:image/jpeg;base64,{raw}", f"file://{images['photo.jpg']}"):
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        np.testing.assert_allclose(vectors(post(server, body))[0], reference, atol=1e-5, rtol=0)
    got = vectors(post(server, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a cat"}]}]}))
    np.testing.assert_allclose(got[0], clip_st.encode(["a cat"])[0], atol=1e-5, rtol=0)
    two = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a cat"},
                                                       {"type": "image_url", "image_url": {"url": url}}]}]}
    response = post(server, two)
    assert response.status_code == 400 and "holds 2 parts" in response.text, response.text
    both = post(server, {"input": ["a"], "messages": [{"role": "user", "content": "a"}]})
    assert both.status_code == 400 and "not both" in both.text


def test_rerank_with_image_documents_equals_st(server, clip_st, images):
    """/v1/rerank with a text query and image documents (Jina's {"image": base64}, vLLM's content
    parts, a text among them): ST's cosine similarity of the vectors, best first."""
    names = ["photo.jpg", "palette.png"]
    raw = [base64.b64encode(images[n].read_bytes()).decode() for n in names]
    query = clip_st.encode(["a photo of a cat"])
    want = clip_st.similarity(query, clip_st.encode([str(images[n]) for n in names])).numpy()[0]
    text = float(clip_st.similarity(query, clip_st.encode(["a dog"]))[0, 0])
    documents = [{"image": raw[0]}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{raw[1]}"}},
                 {"text": "a dog"}]
    response = httpx.post(server.url + "/v1/rerank", json={"query": "a photo of a cat", "documents": documents},
                          timeout=120)
    assert response.status_code == 200, response.text
    got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    np.testing.assert_allclose([got[0], got[1], got[2]], [*want, text], atol=1e-5, rtol=0)
    assert [r["index"] for r in response.json()["results"]] == sorted(got, key=lambda i: -got[i])
