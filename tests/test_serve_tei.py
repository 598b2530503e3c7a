"""pipeline-serve's text-embeddings-inference routes (/embed, /embed_sparse, /embed_all, /rerank,
/predict, /similarity, /tokenize, /decode, /info, and POST / as huggingface_hub's client calls it) against real
servers: TEI's request and response shapes, values equal to
sentence-transformers' (transformers' for a single text classified) within 1e-5, TEI's truncation
rules, and every bad request answered with TEI's status and error body -- the next request unharmed."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from serve_helpers import started_server

from pooling_pipeline.serve.http import TEI_TYPES

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "Émile's café — 東京 🙂",
         "Embeddings map text to vectors.", "x"]
QUERY = "what does a cat do?"
DOCS = ["The cat sat on the mat.", "Stocks fell sharply today.", "A cat sleeps most of the day.", "x"]
LONG = "word " * 300  # 302 tokens with [CLS] and [SEP]: over MiniLM's 256 and the zoo models' 128
NLI_LABELS = {"0": "contradiction", "1": "entailment", "2": "neutral"}
ATOL = 1e-5


# ---- servers ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    """The bundled model; no --auto-truncate; at most 8 inputs a request."""
    with started_server("--max-client-batch-size", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def zoo_models(tmp_path_factory):
    import model_zoo as zoo

    root = tmp_path_factory.mktemp("tei-models")
    nli = zoo.build_cross_encoder(root, num_labels=3, name="nli")
    zoo.set_config(nli, id2label=NLI_LABELS, label2id={v: int(k) for k, v in NLI_LABELS.items()})
    return {"cross": zoo.build_cross_encoder(root, num_labels=1), "nli": nli, "splade": zoo.build_splade(root)}


@pytest.fixture(scope="module")
def cross(zoo_models):
    """A one-label cross-encoder (a reranker), with --auto-truncate: `truncate` left out cuts."""
    with started_server("--model", zoo_models["cross"], "--auto-truncate") as srv:
        yield srv


@pytest.fixture(scope="module")
def nli(zoo_models):
    with started_server("--model", zoo_models["nli"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def splade(zoo_models):
    with started_server("--model", zoo_models["splade"]) as srv:
        yield srv


def post(srv, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=120)
    return httpx.post(srv.url + path, json=body, timeout=120)


def ok(srv, path: str, body) -> object:
    response = post(srv, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, status: int, *phrases: str) -> str:
    """TEI's error body: {"error": message, "error_type": its kind}, the message naming the problem."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}, body
    assert body["error_type"] == TEI_TYPES[status]
    for phrase in phrases:
        assert phrase in body["error"], body["error"]
    return body["error"]


def close(got, want, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64),
                               atol=ATOL, rtol=0, err_msg=what)


# ---- /embed ----------------------------------------------------------------------------------------

def test_embed_equals_sentence_transformers(minilm, st_model):
    ref = st_model.encode(TEXTS, convert_to_numpy=True)
    got = ok(minilm, "/embed", {"inputs": TEXTS})
    assert len(got) == len(TEXTS) and all(len(v) == 384 for v in got)
    close(got, ref, "a batch of texts")
    one = ok(minilm, "/embed", {"inputs": TEXTS[0]})  # one input: still a list of lists
    assert len(one) == 1
    close(one, ref[:1], "one text")
    ids = [st_model.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    close(ok(minilm, "/embed", {"inputs": ids[0]}), ref[:1], "token ids, one input")
    close(ok(minilm, "/embed", {"inputs": [ids[0], TEXTS[1]]}), ref[:2], "token ids and a text in a batch")


def test_embed_normalize_false_and_dimensions(minilm, st_model):
    """normalize=false: the vector before the model's Normalize module (ST's without it);
    dimensions: its first k values, renormalized unless normalize=false (TEI's order)."""
    from sentence_transformers import SentenceTransformer

    raw = SentenceTransformer(modules=[st_model[0], st_model[1]], device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).max() > 0.1  # (so normalization is seen)
    close(ok(minilm, "/embed", {"inputs": TEXTS, "normalize": False}), raw, "normalize=false")
    cut = raw[:, :128] / np.linalg.norm(raw[:, :128], axis=1, keepdims=True)
    close(ok(minilm, "/embed", {"inputs": TEXTS, "dimensions": 128}), cut, "dimensions=128")
    close(ok(minilm, "/embed", {"inputs": TEXTS, "dimensions": 128, "normalize": False}), raw[:, :128],
          "dimensions=128, normalize=false")
    refused(post(minilm, "/embed", {"inputs": "a", "dimensions": 385}), 413, "dimensions", "384")
    refused(post(minilm, "/embed", {"inputs": "a", "dimensions": 0}), 422, "dimensions")


def test_embed_truncation(minilm, st_model):
    """truncate left out (no --auto-truncate) or false: an over-long input is a 413 naming its token
    count, text or token ids; true: cut as ST cuts, from the side truncation_direction names."""
    refused(post(minilm, "/embed", {"inputs": ["short", LONG]}), 413, "request 1", "302 tokens", "256", '"truncate": true')
    refused(post(minilm, "/embed", {"inputs": LONG, "truncate": False}), 413, "302 tokens")
    ids = st_model.tokenizer(LONG)["input_ids"]
    refused(post(minilm, "/embed", {"inputs": [ids]}), 413, "request 0", "302 tokens", "truncate=false")
    close(ok(minilm, "/embed", {"inputs": TEXTS[:1]}), st_model.encode(TEXTS[:1]), "the next request")

    right = st_model.encode([LONG, TEXTS[0]], convert_to_numpy=True)
    close(ok(minilm, "/embed", {"inputs": [LONG, TEXTS[0]], "truncate": True}), right, "truncate=true")
    close(ok(minilm, "/embed", {"inputs": [LONG], "truncate": True, "truncation_direction": "Right"}), right[:1],
          "Right")
    left_text = "tail words at the end " + "word " * 300 + "but here is how it ends"
    st_model.tokenizer.truncation_side = "left"
    try:
        left = st_model.encode([left_text], convert_to_numpy=True)
    finally:
        st_model.tokenizer.truncation_side = "right"
    for direction in ("Left", "left"):  # (TEI takes either capitalisation)
        close(ok(minilm, "/embed", {"inputs": [left_text], "truncate": True, "truncation_direction": direction}),
              left, f"truncation_direction={direction}")
    assert np.abs(left - st_model.encode([left_text])).max() > 1e-3  # (the side changes the vector)
    refused(post(minilm, "/embed", {"inputs": "a", "truncation_direction": "up"}), 422, "truncation_direction")


def test_embed_all_gives_sentence_transformers_token_embeddings(minilm, st_model):
    """Every token's vector, special tokens included, not pooled and not normalized: ST's
    output_value="token_embeddings"."""
    ref = [t.numpy() for t in st_model.encode(TEXTS[:3], output_value="token_embeddings")]
    got = ok(minilm, "/embed_all", {"inputs": TEXTS[:3]})
    assert [len(tokens) for tokens in got] == [len(r) for r in ref] and len(got[0][0]) == 384
    for i, (tokens, want) in enumerate(zip(got, ref)):
        close(tokens, want, f"input {i}")
    assert len(ok(minilm, "/embed_all", {"inputs": TEXTS[0]})) == 1  # one input: still a list of inputs
    refused(post(minilm, "/embed_all", {"inputs": [TEXTS[0], LONG]}), 413, "request 1", "302 tokens")
    cut = ok(minilm, "/embed_all", {"inputs": LONG, "truncate": True})
    assert len(cut[0]) == 256
    close(cut[0], st_model.encode([LONG], output_value="token_embeddings")[0].numpy(), "truncate=true")


# ---- /tokenize ---------------------------------------------------------------------------------------

def test_tokenize_gives_the_pipelines_ids_with_tei_offsets(minilm, st_model):
    """The ids the model sees (transformers' tokenizer; as many as /v1/embeddings counts), TEI's
    offsets in UTF-8 bytes, special tokens without offsets."""
    got = ok(minilm, "/tokenize", {"inputs": TEXTS})
    assert len(got) == len(TEXTS)
    for text, tokens in zip(TEXTS, got):
        assert [t["id"] for t in tokens] == st_model.tokenizer(text)["input_ids"]
        assert set(tokens[0]) == {"id", "text", "special", "start", "stop"}
        assert [t["special"] for t in tokens] == [True] + [False] * (len(tokens) - 2) + [True]
        assert tokens[0]["text"] == "[CLS]" and tokens[0]["start"] is None and tokens[0]["stop"] is None
        raw = text.encode()
        for token in tokens[1:-1]:
            assert raw[token["start"]:token["stop"]].decode() == token["text"]
        usage = httpx.post(minilm.url + "/v1/embeddings", json={"input": text}, timeout=60).json()["usage"]
        assert usage["prompt_tokens"] == len(tokens)
    cafe = next(t for t in got[2] if t["text"] == "café")
    assert (cafe["start"], cafe["stop"]) == (9, 14)  # bytes: "Émile" is 6 of them, "café" 5

    bare = ok(minilm, "/tokenize", {"inputs": TEXTS[0], "add_special_tokens": False})
    assert [t["id"] for t in bare[0]] == st_model.tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    refused(post(minilm, "/tokenize", {"inputs": "a", "prompt_name": "nope"}), 413, "nope")
    refused(post(minilm, "/tokenize", {"inputs": []}), 400, "cannot be empty")
    refused(post(minilm, "/tokenize", {"inputs": ["a"] * 9}), 413, "batch size 9", "8")


def test_decode_gives_the_tokenizers_text(minilm, st_model):
    """One list of ids is one text (in a list), a batch a text each; special tokens skipped unless
    asked for, as TEI's (the tokenizers library's own decoder)."""
    ids = [st_model.tokenizer(text)["input_ids"] for text in TEXTS[:3]]
    want = [st_model.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    assert ok(minilm, "/decode", {"ids": ids[0]}) == want[:1]
    assert ok(minilm, "/decode", {"ids": ids}) == want
    assert ok(minilm, "/decode", {"ids": ids[0], "skip_special_tokens": False}) == [
        st_model.tokenizer.decode(ids[0], skip_special_tokens=False)]
    assert ok(minilm, "/decode", {"ids": ids[0], "skip_special_tokens": False})[0].startswith("[CLS]")
    assert ok(minilm, "/decode", {"ids": []}) == [""]


# ---- /similarity, and TEI's POST / as huggingface_hub calls it -----------------------------------------

@pytest.fixture
def hub_client(monkeypatch):
    """huggingface_hub's InferenceClient for a server's address. HF_HUB_OFFLINE (set for the whole
    suite: nothing may reach a hub) makes it refuse every request, a local address's too: it is lifted
    for the test's own server alone -- the client reaches nothing else. Its process-wide keep-alive
    session is closed after the test: a pooled connection to a server stopped later would stay open
    (CLOSE_WAIT) in this process, which test_reliability checks has no TCP connection."""
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient
    from huggingface_hub.utils import close_session

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield lambda srv: InferenceClient(model=srv.url)
    close_session()


def test_similarity_equals_sentence_transformers(minilm, st_model, hub_client):
    source, others = TEXTS[0], TEXTS[1:]
    vectors = st_model.encode([source, *others], convert_to_tensor=True)
    want = st_model.similarity(vectors[:1], vectors[1:])[0].numpy()
    got = ok(minilm, "/similarity", {"inputs": {"source_sentence": source, "sentences": others}})
    assert len(got) == len(others)
    close(got, want, "/similarity")
    close(hub_client(minilm).sentence_similarity(source, other_sentences=others), want,
          "huggingface_hub's sentence_similarity (POST /)")
    cut = ok(minilm, "/similarity", {"inputs": {"source_sentence": source, "sentences": [LONG]},
                                      "parameters": {"truncate": True}})
    long_vectors = st_model.encode([source, LONG], convert_to_tensor=True)
    close(cut, st_model.similarity(long_vectors[:1], long_vectors[1:])[0].numpy(), "truncate=true")


def test_post_root_is_the_models_own_route_as_tei_picks_it(minilm, cross, nli, splade, st_model, hub_client):
    """huggingface_hub's InferenceClient given the server's address posts to `/` (so does LangChain's
    HuggingFaceEndpointEmbeddings through it): /embed for an embedding model, /rerank for a reranker,
    /predict for a classifier, /embed_sparse for SPLADE; SageMaker's /invocations the same. The health
    checks TEI answers on GET / and /ping."""
    got = hub_client(minilm).feature_extraction(TEXTS[1])
    assert got.shape == (1, 384) and got.dtype == np.float32
    close(got, st_model.encode(TEXTS[1:2]), "feature_extraction (POST /)")
    for path in ("/", "/invocations"):
        close(ok(minilm, path, {"inputs": TEXTS, "normalize": False}), ok(minilm, "/embed", {"inputs": TEXTS,
              "normalize": False}), f"{path} on an embedding model")
        rerank = {"query": QUERY, "texts": DOCS, "return_text": True}
        _same_by_key(ok(cross, path, rerank), ok(cross, "/rerank", rerank), "index", "score", f"{path}: rerank")
        assert all(r["text"] == DOCS[r["index"]] for r in ok(cross, path, rerank))
        _same_by_key(ok(nli, path, {"inputs": TEXTS[0]}), ok(nli, "/predict", {"inputs": TEXTS[0]}), "label", "score",
                     f"{path}: predict")
        for got, want in zip(ok(splade, path, {"inputs": TEXTS[:2]}), ok(splade, "/embed_sparse", {"inputs": TEXTS[:2]})):
            _same_by_key(got, want, "index", "value", f"{path}: embed_sparse")
    for path in ("/", "/ping", "/health"):
        response = httpx.get(minilm.url + path, timeout=60)
        assert response.status_code == 200 and response.text == ""


def _same_by_key(got: list, want: list, key: str, value: str, what: str) -> None:
    """Two answers' entries matched by `key` (a rank's index, a label, a sparse weight's token id), their
    `value`s within ATOL: the two requests may be batched differently. A key one of them lacks counts
    as 0 (a sparse weight at the edge of zero)."""
    mine, theirs = {e[key]: e[value] for e in got}, {e[key]: e[value] for e in want}
    keys = sorted(mine.keys() | theirs.keys(), key=str)
    close([mine.get(k, 0.0) for k in keys], [theirs.get(k, 0.0) for k in keys], what)
    assert len(mine) == len(got) and len(theirs) == len(want)  # (each key once)


# ---- /info -------------------------------------------------------------------------------------------

def test_info_gives_teis_fields(minilm, cross, nli, splade):
    info = httpx.get(minilm.url + "/info", timeout=60).json()
    assert set(info) == {"model_id", "model_sha", "model_dtype", "served_model_name", "model_type",
                         "max_concurrent_requests", "max_input_length", "max_batch_tokens", "max_batch_requests",
                         "max_client_batch_size", "auto_truncate", "tokenization_workers", "version", "sha",
                         "docker_label"}
    assert info["model_id"] == "sentence-transformers/all-MiniLM-L6-v2" and info["model_dtype"] == "float32"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert (info["max_input_length"], info["max_client_batch_size"], info["auto_truncate"]) == (256, 8, False)
    assert info["max_concurrent_requests"] >= 8 and info["max_batch_tokens"] >= 256
    assert info["max_batch_requests"] >= 1 and info["tokenization_workers"] >= 1
    reranker = httpx.get(cross.url + "/info", timeout=60).json()
    assert reranker["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    assert (reranker["max_input_length"], reranker["auto_truncate"]) == (128, True)
    classifier = httpx.get(nli.url + "/info", timeout=60).json()["model_type"]
    assert classifier == {"classifier": {"id2label": NLI_LABELS, "label2id": {"contradiction": 0, "entailment": 1,
                                                                              "neutral": 2}}}
    assert httpx.get(splade.url + "/info", timeout=60).json()["model_type"] == {"embedding": {"pooling": "splade"}}


# ---- bad requests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, phrase", [
    ("/embed", b'{"inputs": ["a",', 400, "not valid JSON"),
    ("/embed", b"", 400, "no body"),
    ("/embed", {"inputs": 5}, 422, "`inputs`"),
    ("/embed", {"inputs": [1, "a"]}, 422, "`inputs`[0]"),
    ("/embed", {"inputs": [[1, -2]]}, 422, "`inputs`[0]"),
    ("/embed", {"inputs": "a", "normalize": "yes"}, 422, "normalize"),
    ("/embed", {"texts": ["a"]}, 422, "inputs"),
    ("/embed", {"inputs": []}, 400, "cannot be empty"),
    ("/embed", {"inputs": ["a", ""]}, 400, "request 1"),
    ("/embed", {"inputs": ["a"] * 9}, 413, "batch size 9 > maximum allowed batch size 8"),
    ("/embed", {"inputs": [[999_999]]}, 400, "request 0"),
    ("/embed", {"inputs": "a", "prompt_name": "nope"}, 413, "nope"),
    ("/rerank", {"query": "q", "texts": ["a"]}, 424, "not a re-ranker"),
    ("/rerank", {"query": "q", "texts": []}, 400, "`texts` cannot be empty"),
    ("/predict", {"inputs": "a"}, 424, "not a classifier"),
    ("/embed_sparse", {"inputs": "a"}, 424, "SPLADE"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "`inputs.sentences` cannot be empty"),
    ("/similarity", {"inputs": {"source_sentence": "", "sentences": ["a"]}}, 400, "request 0"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 8}}, 413, "batch size 9"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": [LONG]}}, 413, "request 1"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]},
                     "parameters": {"prompt_name": "nope"}}, 413, "nope"),
    ("/similarity", {"inputs": ["a", "b"]}, 422, "inputs"),
    ("/decode", {"ids": [101, -1]}, 422, "`ids`"),
    ("/decode", {"ids": [[101], [30522]]}, 422, "request 1"),
    ("/decode", {"ids": "abc"}, 422, "`ids`"),
    ("/decode", {"ids": [[1]] * 9}, 413, "batch size 9"),
    ("/", {"inputs": 5}, 422, "`inputs`"),
])
def test_bad_requests_get_teis_status_and_the_next_one_is_served(minilm, st_model, path, body, status, phrase):
    response = post(minilm, path, content=body) if isinstance(body, bytes) else post(minilm, path, body)
    refused(response, status, phrase)
    close(ok(minilm, "/embed", {"inputs": TEXTS[0]}), st_model.encode(TEXTS[:1]), "the next request")


def test_routes_a_reranker_cannot_serve(cross):
    refused(post(cross, "/embed", {"inputs": "a"}), 424, "not an embedding model")
    refused(post(cross, "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}), 424,
            "not an embedding model")
    refused(post(cross, "/embed_all", {"inputs": "a"}), 424, "not an embedding model")
    refused(post(cross, "/embed_sparse", {"inputs": "a"}), 424, "SPLADE")
    assert len(ok(cross, "/rerank", {"query": "q", "texts": ["a"]})) == 1


# ---- /rerank -------------------------------------------------------------------------------------------

def test_rerank_equals_cross_encoder(cross, zoo_models):
    """Scores are ST CrossEncoder's (its activation; raw_scores: the logits), best first;
    return_text adds each text; truncate left out takes the server's --auto-truncate (cut as ST cuts)."""
    from sentence_transformers import CrossEncoder
    from torch.nn import Identity

    ce = CrossEncoder(zoo_models["cross"], device="cpu")
    docs = DOCS + [LONG]
    pairs = [(QUERY, d) for d in docs]
    want = ce.predict(pairs)
    got = ok(cross, "/rerank", {"query": QUERY, "texts": docs})
    assert [r["index"] for r in got] == list(np.argsort(-want, kind="stable"))
    assert all(set(r) == {"index", "score"} for r in got)
    close([r["score"] for r in sorted(got, key=lambda r: r["index"])], want, "rerank scores")
    raw = ok(cross, "/rerank", {"query": QUERY, "texts": docs, "raw_scores": True, "return_text": True})
    close([r["score"] for r in sorted(raw, key=lambda r: r["index"])], ce.predict(pairs, activation_fn=Identity()),
          "raw_scores")
    assert all(r["text"] == docs[r["index"]] for r in raw)
    assert np.ptp(want) > 1e-3  # (the order is not a tie)


def test_rerank_truncation(cross, zoo_models):
    """truncate=false: a pair over the model's 128 tokens is a 413 naming its count (the pipeline
    would cut it); a pair cut from the left is refused by name (ST cuts pairs from the right)."""
    refused(post(cross, "/rerank", {"query": QUERY, "texts": ["short", LONG], "truncate": False}), 413,
            "request 1", "tokens", "128", "truncate=false")
    refused(post(cross, "/rerank", {"query": QUERY, "texts": [LONG], "truncation_direction": "Left"}), 400,
            "request 0", "truncation_direction")
    fits = ok(cross, "/rerank", {"query": QUERY, "texts": DOCS, "truncate": False,
                                 "truncation_direction": "Left"})  # (nothing is cut: the side is moot)
    assert sorted(r["index"] for r in fits) == list(range(len(DOCS)))


def test_rerank_with_documents_is_the_jina_shape(cross):
    """A body with `documents` instead of `texts` is answered in the Jina / Cohere shape (vLLM's /rerank)."""
    tei = ok(cross, "/rerank", {"query": QUERY, "texts": DOCS})
    jina = ok(cross, "/rerank", {"query": QUERY, "documents": DOCS})
    assert [r["index"] for r in jina["results"]] == [r["index"] for r in tei]
    close([r["relevance_score"] for r in jina["results"]], [r["score"] for r in tei], "Jina shape")


# ---- /predict ------------------------------------------------------------------------------------------

def _transformers_logits(path: str, inputs: list) -> np.ndarray:
    """A sequence classifier's logits as transformers computes them (truncated to 128 as ST does)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for item in inputs:
        args = item if isinstance(item, tuple) else (item,)
        with torch.no_grad():
            out.append(model(**tokenizer(*args, truncation=True, max_length=128, return_tensors="pt")).logits[0].numpy())
    return np.stack(out)


def test_predict_classifies_as_cross_encoder(nli, zoo_models):
    """A batch of pairs and single texts: each input's classes by score, named by id2label, equal
    to ST CrossEncoder.predict(apply_softmax=True) (transformers' softmax for a single text);
    raw_scores: the logits. One input (a string or a [text, text_pair] pair): one list."""
    from sentence_transformers import CrossEncoder

    pairs = [(QUERY, d) for d in DOCS]
    ce = CrossEncoder(zoo_models["nli"], device="cpu")
    logits = np.concatenate([ce.predict(pairs), _transformers_logits(zoo_models["nli"], [TEXTS[0]])])
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    close(probs[:-1], ce.predict(pairs, apply_softmax=True), "(the reference's own softmax)")
    inputs = [[q, d] for q, d in pairs] + [[TEXTS[0]]]
    for raw_scores, want in ((False, probs), (True, logits)):
        got = ok(nli, "/predict", {"inputs": inputs, "raw_scores": raw_scores})
        assert len(got) == len(inputs)
        for predictions, row in zip(got, want):
            assert [p["score"] for p in predictions] == sorted((p["score"] for p in predictions), reverse=True)
            assert all(set(p) == {"score", "label"} for p in predictions)
            by_label = {p["label"]: p["score"] for p in predictions}
            close([by_label[NLI_LABELS[str(k)]] for k in range(3)], row, f"predict, raw_scores={raw_scores}")
    one_pair = ok(nli, "/predict", {"inputs": list(pairs[0])})
    assert isinstance(one_pair[0], dict)
    close(sorted(p["score"] for p in one_pair), sorted(probs[0]), "one pair")
    one_text = ok(nli, "/predict", {"inputs": TEXTS[0]})
    close(sorted(p["score"] for p in one_text), sorted(probs[-1]), "one text")


def test_predict_bad_inputs(nli):
    refused(post(nli, "/predict", {"inputs": ["a", "b", "c"]}), 422, "`inputs`")
    refused(post(nli, "/predict", {"inputs": [["a"], ["b", "c", "d"]]}), 422, "`inputs`[1]")
    refused(post(nli, "/predict", {"inputs": []}), 422, "`inputs`")
    refused(post(nli, "/predict", {"inputs": [["a"], [""]]}), 400, "request 1", "cannot be empty")
    refused(post(nli, "/predict", {"inputs": [["a"], [QUERY, LONG]]}), 413, "request 1", "128", "truncate=false")
    refused(post(nli, "/rerank", {"query": "q", "texts": ["a"]}), 424, "not a re-ranker")
    assert len(ok(nli, "/predict", {"inputs": [QUERY, LONG], "truncate": True})) == 3


def test_predict_on_a_reranker(cross, zoo_models):
    """TEI's /predict serves a reranker too: its one label, scored as CrossEncoder scores."""
    from sentence_transformers import CrossEncoder

    want = CrossEncoder(zoo_models["cross"], device="cpu").predict([(QUERY, DOCS[0])])
    got = ok(cross, "/predict", {"inputs": [QUERY, DOCS[0]]})
    assert [p["label"] for p in got] == ["LABEL_0"]
    close([got[0]["score"]], want, "predict on a reranker")


# ---- /embed_sparse -------------------------------------------------------------------------------------

def test_embed_sparse_equals_sparse_encoder(splade, zoo_models):
    from sentence_transformers import SparseEncoder

    ref = SparseEncoder(zoo_models["splade"], device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    got = ok(splade, "/embed_sparse", {"inputs": TEXTS})
    assert len(got) == len(TEXTS)
    for vector, want in zip(got, ref):
        indices = [entry["index"] for entry in vector]
        assert indices == sorted(indices) and all(set(e) == {"index", "value"} for e in vector)
        assert indices == np.flatnonzero(want).tolist()
        close([entry["value"] for entry in vector], want[indices], "SPLADE weights")
    refused(post(splade, "/embed", {"inputs": "a"}), 424, "not an embedding model")
    refused(post(splade, "/embed_sparse", {"inputs": LONG}), 413, "302 tokens", "128")
    assert len(ok(splade, "/embed_sparse", {"inputs": LONG, "truncate": True})) == 1
