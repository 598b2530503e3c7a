"""pipeline-serve's rerank, score, classify and pooling routes (vLLM's shapes, Jina / Cohere rerank)
against sentence-transformers and transformers: a tiny cross-encoder for /v1/rerank and /score (vs
CrossEncoder), a 3-label classifier for /classify (vs transformers' softmax), the bundled embedding
model for rerank by cosine (vs ST's similarity) and /pooling; and every refusal with vLLM's status and
error body, each followed by a request that still works."""

from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import pytest
from serve_helpers import started_server

pytestmark = pytest.mark.slow

QUERY = "what is a cat?"
DOCS = ["a cat is a feline", "a dog", "cars", "the quick brown fox", "x", "Émile's café — 東京"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TOL = 1e-5  # float32


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A cross-encoder (one label) and a 3-label classifier with named labels. A wide initializer
    spreads their outputs (the default's scores differ in the 6th digit, too close to order)."""
    from tiny_models import build_bert
    from transformers import BertForSequenceClassification

    root = tmp_path_factory.mktemp("serve-rerank")
    return {"cross": build_bert(root / "cross", BertForSequenceClassification, num_labels=1, initializer_range=0.5),
            "classify3": build_bert(root / "classify3", BertForSequenceClassification, num_labels=3,
                                    initializer_range=0.5, id2label=LABELS,
                                    label2id={v: k for k, v in LABELS.items()})}


@pytest.fixture(scope="module")
def cross(models):
    with started_server("--model", models["cross"], "--served-model-name", "ce") as srv:
        yield srv


@pytest.fixture(scope="module")
def classifier(models):
    with started_server("--model", models["classify3"], "--served-model-name", "cls") as srv:
        yield srv


@pytest.fixture(scope="module")
def bundled():
    with started_server("--served-model-name", "minilm") as srv:
        yield srv


@pytest.fixture(scope="module")
def cross_encoder(models):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(models["cross"], device="cpu")


def post(srv, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(srv.url + path, json=body, timeout=60)


def assert_error(response: httpx.Response, status: int, words: str, type_: str = "BadRequestError") -> None:
    """vLLM's error body: {"error": {"message", "type", "param", "code"}}, the message naming the problem."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == type_ and error["param"] is None
    assert words in error["message"], error["message"]


def pair_tokens(tokenizer, query: str, docs: list[str]) -> int:
    return sum(len(tokenizer(query, d)["input_ids"]) for d in docs)


# ---- rerank ------------------------------------------------------------------------------------------

def test_rerank_is_cross_encoder_rank_best_first(cross, cross_encoder):
    expected = cross_encoder.predict([(QUERY, d) for d in DOCS], convert_to_numpy=True)
    ranked = [r["corpus_id"] for r in cross_encoder.rank(QUERY, DOCS)]
    body = post(cross, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS}).json()
    assert body["id"].startswith("rerank-") and body["model"] == "ce"
    assert [r["index"] for r in body["results"]] == ranked == list(np.argsort(-expected, kind="stable"))
    got = np.array([r["relevance_score"] for r in body["results"]], dtype=np.float32)
    np.testing.assert_allclose(got, expected[ranked], atol=TOL, rtol=0)
    assert [r["document"] for r in body["results"]] == [{"text": DOCS[i], "multi_modal": None} for i in ranked]
    tokens = pair_tokens(cross_encoder.tokenizer, QUERY, DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_top_n_return_documents_and_v2(cross, cross_encoder):
    ranked = [r["corpus_id"] for r in cross_encoder.rank(QUERY, DOCS)]
    top = post(cross, "/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == ranked[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
    every = post(cross, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}).json()  # vLLM: 0 is all
    assert [r["index"] for r in every["results"]] == ranked
    beyond = post(cross, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 50}).json()
    assert len(beyond["results"]) == len(DOCS)
    one = post(cross, "/v1/rerank", {"query": QUERY, "documents": DOCS[0]}).json()  # a string is one document
    assert [r["index"] for r in one["results"]] == [0]


def test_rerank_use_activation_false_is_the_raw_logit(cross, cross_encoder):
    import torch

    raw = cross_encoder.predict([(QUERY, d) for d in DOCS], activation_fn=torch.nn.Identity(), convert_to_numpy=True)
    body = post(cross, "/v1/rerank", {"query": QUERY, "documents": DOCS, "use_activation": False}).json()
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], raw, atol=TOL, rtol=0)


def test_rerank_by_cosine_on_an_embedding_model(bundled, st_model):
    expected = st_model.similarity(st_model.encode([QUERY]), st_model.encode(DOCS)).numpy()[0]
    body = post(bundled, "/v1/rerank", {"model": "minilm", "query": QUERY, "documents": DOCS, "top_n": 3}).json()
    order = list(np.argsort(-expected, kind="stable"))[:3]
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], expected[order], atol=TOL, rtol=0)
    assert_error(post(bundled, "/v1/rerank", {"query": QUERY, "documents": DOCS, "use_activation": True}), 400,
                 "use_activation")
    assert post(bundled, "/v1/rerank", {"query": QUERY, "documents": DOCS}).status_code == 200


# ---- score -------------------------------------------------------------------------------------------

def test_score_one_to_n_and_n_to_n_match_cross_encoder(cross, cross_encoder):
    one_to_n = post(cross, "/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS}).json()
    assert one_to_n["id"].startswith("score-") and one_to_n["object"] == "list" and one_to_n["model"] == "ce"
    assert isinstance(one_to_n["created"], int)
    assert [(d["index"], d["object"]) for d in one_to_n["data"]] == [(i, "score") for i in range(len(DOCS))]
    np.testing.assert_allclose([d["score"] for d in one_to_n["data"]],
                               cross_encoder.predict([(QUERY, d) for d in DOCS]), atol=TOL, rtol=0)
    tokens = pair_tokens(cross_encoder.tokenizer, QUERY, DOCS)
    assert one_to_n["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                 "prompt_tokens_details": None}
    queries, docs = ["a cat", "a dog", "a car"], DOCS[:3]
    expected = cross_encoder.predict(list(zip(queries, docs)))
    for names, path in ((("text_1", "text_2"), "/score"), (("data_1", "data_2"), "/v1/score"),
                        (("queries", "documents"), "/score"), (("queries", "items"), "/v1/score")):
        got = post(cross, path, {names[0]: queries, names[1]: docs}).json()
        np.testing.assert_allclose([d["score"] for d in got["data"]], expected, atol=TOL, rtol=0, err_msg=str(names))
    single = post(cross, "/score", {"text_1": QUERY, "text_2": DOCS[0]}).json()  # 1:1 as two strings
    np.testing.assert_allclose([single["data"][0]["score"]], cross_encoder.predict([(QUERY, DOCS[0])]), atol=TOL)


# ---- over-long inputs: refused unless a cut is asked for (vLLM's, Cohere's rules) ----------------------

LONG = " ".join(["word"] * 2000)  # 2,000 words, one WordPiece token each: far past any model's length here


@pytest.fixture(scope="module")
def cross_128(models):
    """ST's CrossEncoder at the length the server keeps for the tiny model (its 128 positions; ST would
    take the tokenizer's 512 and fail past the table)."""
    from sentence_transformers import CrossEncoder

    return CrossEncoder(models["cross"], device="cpu", max_length=128)


def test_over_long_pairs_are_refused_unless_a_cut_is_asked_for(cross, cross_128):
    """/v1/rerank, /v2/rerank, /score and /v1/score refuse a pair over the model's length, naming it
    and its token count (before: all four cut it in silence, a 200); truncate_prompt_tokens cuts the
    pair as ST's CrossEncoder does, max_tokens_per_doc (Cohere's) the document, and the rerank answer
    says what was cut (Cohere's meta.warnings)."""
    assert httpx.get(cross.url + "/v1/models").json()["data"][0]["max_model_len"] == 128
    docs = [DOCS[0], DOCS[1], LONG]
    for path, body in (("/v1/rerank", {"query": QUERY, "documents": docs}),
                       ("/v2/rerank", {"query": QUERY, "documents": docs}),
                       ("/score", {"text_1": QUERY, "text_2": docs}),
                       ("/v1/score", {"queries": QUERY, "documents": docs})):
        response = post(cross, path, body)
        assert_error(response, 400, "request 2: the pair (`")
        assert "tokens, more than this model's maximum context length of 128 tokens" in response.text, path
    cut = post(cross, "/v1/rerank", {"query": QUERY, "documents": docs, "truncate_prompt_tokens": 128}).json()
    expected = cross_128.predict([(QUERY, d) for d in docs])
    got = {r["index"]: r["relevance_score"] for r in cut["results"]}
    np.testing.assert_allclose([got[i] for i in range(3)], expected, atol=TOL, rtol=0)
    [warning] = cut["meta"]["warnings"]
    assert warning.startswith("request 2: the pair (`query`, `documents`[2]) was cut from at least") and "to 128" in warning
    scored = post(cross, "/score", {"text_1": QUERY, "text_2": docs, "truncate_prompt_tokens": 128}).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=TOL, rtol=0)
    # max_tokens_per_doc: the document alone, to 50 of its tokens ("word" is one token)
    fifty = " ".join(["word"] * 50)
    assert len(cross_128.tokenizer(fifty, add_special_tokens=False)["input_ids"]) == 50
    per_doc = post(cross, "/v2/rerank", {"query": QUERY, "documents": docs, "max_tokens_per_doc": 50}).json()
    got = {r["index"]: r["relevance_score"] for r in per_doc["results"]}
    np.testing.assert_allclose([got[i] for i in range(3)], cross_128.predict([(QUERY, d) for d in docs[:2] + [fifty]]),
                               atol=TOL, rtol=0)
    assert per_doc["meta"]["warnings"] == ["`documents`[2] was cut to 50 tokens (max_tokens_per_doc)"]
    assert "meta" not in post(cross, "/v1/rerank", {"query": QUERY, "documents": DOCS[:2]}).json()  # nothing cut
    # the document's cut is not the pair's: a query too long for any document is still refused
    assert_error(post(cross, "/v1/rerank", {"query": LONG, "documents": DOCS[:2], "max_tokens_per_doc": 50}), 400,
                 "request 0: the pair (`query`, `documents`[0]) has at least")


def test_an_embedding_models_rerank_and_score_refuse_over_long_texts_unless_cut(bundled, st_model):
    """Scored by cosine, each text is embedded alone: one over max_seq_length is refused by name (before:
    cut to 256 in silence); with truncate_prompt_tokens it is ST's vector of the text cut at 256."""
    docs = [DOCS[0], LONG]
    response = post(bundled, "/v1/rerank", {"query": QUERY, "documents": docs})
    assert_error(response, 400, "request 1: `documents`[1] has at least")
    assert_error(post(bundled, "/score", {"text_1": LONG, "text_2": DOCS[:2]}), 400, "request 0: `text_1`[0] has at least")
    assert_error(post(bundled, "/v1/rerank", {"query": LONG, "documents": DOCS[:2]}), 400, "`query` has at least")
    cut = post(bundled, "/v1/rerank", {"query": QUERY, "documents": docs, "truncate_prompt_tokens": 256}).json()
    expected = st_model.similarity(st_model.encode([QUERY]), st_model.encode(docs)).numpy()[0]  # (ST cuts at 256)
    got = {r["index"]: r["relevance_score"] for r in cut["results"]}
    np.testing.assert_allclose([got[0], got[1]], expected, atol=TOL, rtol=0)
    [warning] = cut["meta"]["warnings"]
    assert warning.startswith("request 1: `documents`[1] was cut from at least") and warning.endswith("to 256 tokens")
    assert_error(post(bundled, "/v1/rerank", {"query": QUERY, "documents": docs, "max_tokens_per_doc": 50}), 400,
                 "max_tokens_per_doc applies to a cross-encoder's pairs")


@pytest.fixture(scope="module")
def llm_reranker(tmp_path_factory) -> str:
    """A Qwen3-Reranker-shaped LLM reranker (max 256 tokens): each pair goes through its chat template,
    whose own text is ~130 tokens of the tiny BPE."""
    import model_zoo as zoo

    return zoo.build_llm_reranker(tmp_path_factory.mktemp("serve-llm"), "qwen3")


@pytest.fixture(scope="module")
def llm(llm_reranker):
    with started_server("--model", llm_reranker, "--served-model-name", "llm") as srv:
        yield srv


def cats(n: int) -> str:
    return " ".join(["cat"] * n)


def test_an_llm_rerankers_pairs_are_measured_as_its_chat_template_renders_them(llm, llm_reranker):
    """An LLM reranker's pair is the chat template's render of it: 100 to 120 "cat"s with "what is a cat"
    render to 336-376 tokens (ST's own count), over the model's 256. Each is refused naming that count (before:
    the server measured the bare pair, 208-228 tokens, and the worker cut every one to 256 in silence, the
    same score for all three); truncate_prompt_tokens=-1 gives ST's CrossEncoder scores and meta.warnings
    names the cut; TEI's /rerank refuses with its 413 Validation."""
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(llm_reranker, device="cpu")
    assert ce.max_seq_length == 256
    query, counts = "what is a cat", {}
    ce.max_seq_length = 4096  # (the whole render's length, as ST tokenizes it)
    for n in (100, 110, 120):
        counts[n] = int(ce.preprocess([(query, cats(n))])["attention_mask"].sum())
    ce.max_seq_length = 256
    assert counts == {100: 336, 110: 356, 120: 376}  # (over 256; the pair alone would fit)
    for n, tokens in counts.items():
        assert_error(post(llm, "/v1/rerank", {"query": query, "documents": ["a cat", cats(n)]}), 400,
                     f"request 1: the pair (`query`, `documents`[1]) as the model's chat template renders it has "
                     f"{tokens} tokens, more than this model's maximum context length of 256 tokens")
    refused = post(llm, "/v1/rerank", {"query": query, "documents": [cats(100)]})
    assert "max_tokens_per_doc" not in refused.text  # (which the model refuses: its pair is one render)
    docs = ["a cat", cats(100), cats(120)]
    cut = post(llm, "/v2/rerank", {"query": query, "documents": docs, "truncate_prompt_tokens": -1}).json()
    got = {r["index"]: r["relevance_score"] for r in cut["results"]}
    np.testing.assert_allclose([got[i] for i in range(3)], ce.predict([(query, d) for d in docs]), atol=TOL, rtol=0)
    assert cut["meta"]["warnings"] == [
        f"request {i}: the pair (`query`, `documents`[{i}]) as the model's chat template renders it was cut from "
        f"{counts[n]} to 256 tokens" for i, n in ((1, 100), (2, 120))]
    tei = post(llm, "/rerank", {"query": query, "texts": ["a cat", cats(110)]})
    assert tei.status_code == 413 and tei.json()["error_type"] == "Validation", tei.text
    assert "request 1" in tei.json()["error"] and "356 tokens" in tei.json()["error"]


def inputs_served(srv) -> float:
    """pipeline_inputs_total: the inputs of every call the server's window admitted."""
    line = next(line for line in httpx.get(srv.url + "/metrics").text.splitlines()
                if line.startswith("pipeline_inputs_total "))
    return float(line.split()[1])


@pytest.mark.parametrize("kind", ["cross", "bundled", "llm"])
def test_over_long_pairs_are_refused_by_the_render_workers_inside_the_window(kind, request, st_model):
    """The server tokenizes nothing before a call is admitted (before: every document was tokenized in the
    server process ahead of the window -- 0.47 s of CPU for 2,048 documents -- and tokenized again by the
    workers): the render workers refuse an over-long pair (or scored text) as they render it, so the refused
    call went through the window (its inputs counted), and its count is the reference tokenizer's."""
    srv = request.getfixturevalue(kind)
    if kind == "cross":
        tokenizer, limit, doc = request.getfixturevalue("cross_encoder").tokenizer, 128, " ".join(["word"] * 200)
        tokens, words = len(tokenizer(QUERY, doc)["input_ids"]), "request 1: the pair (`query`, `documents`[1]) has"
    elif kind == "bundled":
        limit, doc = 256, " ".join(["word"] * 300)
        tokens, words = len(st_model.tokenizer(doc)["input_ids"]), "request 1: `documents`[1] has"
    else:
        limit, doc, tokens = 256, cats(110), 356
        words = "request 1: the pair (`query`, `documents`[1]) as the model's chat template renders it has"
    inputs = 2 if kind != "bundled" else 3  # (an embedding model embeds the query too)
    before = inputs_served(srv)
    response = post(srv, "/v1/rerank", {"query": QUERY if kind != "llm" else "what is a cat",
                                        "documents": [DOCS[0], doc]})
    assert_error(response, 400, f"{words} {tokens} tokens, more than this model's maximum context length of {limit}")
    assert inputs_served(srv) - before == inputs
    assert post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCS[:2]}).status_code == 200


def test_teis_rerank_with_documents_refuses_an_over_long_pair_with_its_413(cross):
    """TEI's /rerank answering the Jina / Cohere shape: an over-long pair is TEI's 413 "Validation", as its
    own `texts` shape answers (before: a 400 "Empty")."""
    response = post(cross, "/rerank", {"query": QUERY, "documents": [DOCS[0], LONG]})
    assert response.status_code == 413 and response.json()["error_type"] == "Validation", response.text
    assert "request 1: the pair (`query`, `documents`[1]) has at least" in response.json()["error"]
    assert post(cross, "/rerank", {"query": QUERY, "documents": DOCS[:2]}).status_code == 200


def test_token_ids_over_the_length_are_refused_on_embeddings_pooling_and_classify(bundled, cross):
    """Token ids are measured as texts are (before: 600 or 10^6 ids were cut to the model's length, a 200)."""
    million = [101] + [2773] * 1_000_000 + [102]
    assert_error(post(bundled, "/v1/embeddings", {"input": million}), 400, "request 0: `input` has 1000002 tokens")
    six_hundred = [101] + [2773] * 600 + [102]
    assert_error(post(bundled, "/pooling", {"input": [[101, 102], six_hundred]}), 400, "request 1: `input` has 602 tokens")
    assert_error(post(cross, "/classify", {"input": [six_hundred[:200]]}), 400, "request 0: `input` has 200 tokens")
    kept = post(bundled, "/pooling", {"input": [six_hundred], "truncate_prompt_tokens": 256}).json()
    direct = post(bundled, "/pooling", {"input": [six_hundred[:256]]}).json()
    np.testing.assert_allclose(kept["data"][0]["data"], direct["data"][0]["data"], atol=1e-6, rtol=0)
    assert kept["usage"]["prompt_tokens"] == 256


# ---- the clients people point at a rerank server: cohere, litellm ------------------------------------

def _litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (else importing it fetches a price list)
    import litellm

    return litellm


def _no_connection_left_to(srv) -> None:
    """This process holds no TCP connection to the test's server once its client is closed: a pooled
    keep-alive connection to a server stopped later stays in CLOSE_WAIT here, and test_reliability
    (run next in the same xdist worker) checks that the process has no TCP connection."""
    import psutil

    port = int(srv.url.rsplit(":", 1)[1].split("/")[0])
    held = [c for c in psutil.Process().net_connections(kind="inet") if c.raddr and c.raddr.port == port]
    assert held == [], held


def _close_litellms_clients(litellm) -> None:
    """litellm keeps its HTTP clients for the process (a module-level one and a cache by provider),
    with their keep-alive connections: closed, and a fresh module-level client put back."""
    from litellm.llms.custom_httpx.http_handler import HTTPHandler

    cached = list(litellm.in_memory_llm_clients_cache.cache_dict.values())
    for client in [litellm.module_level_client, *cached]:
        if callable(getattr(client, "close", None)):
            client.close()
    litellm.in_memory_llm_clients_cache.flush_cache()
    litellm.module_level_client = HTTPHandler()


@pytest.fixture(scope="module")
def infinity(models):
    """The cross-encoder with POST /rerank answering Infinity's shape (each document a string)."""
    with started_server("--model", models["cross"], "--served-model-name", "ce", "--rerank-dialect", "infinity") as srv:
        yield srv


def test_the_cohere_client_ranks_and_sees_refusals_and_cuts(cross, cross_encoder):
    import cohere

    with httpx.Client(timeout=120) as http:  # (closed after the test: no pooled connection left in this process)
        _cohere_ranks(cohere.ClientV2(base_url=cross.url, api_key="unused", httpx_client=http), cohere, cross_encoder)
    _no_connection_left_to(cross)


def _cohere_ranks(client, cohere, cross_encoder) -> None:
    ranked = [r["corpus_id"] for r in cross_encoder.rank(QUERY, DOCS)]
    answer = client.rerank(model="ce", query=QUERY, documents=DOCS, top_n=3)
    assert [r.index for r in answer.results] == ranked[:3]
    np.testing.assert_allclose([r.relevance_score for r in answer.results],
                               cross_encoder.predict([(QUERY, DOCS[i]) for i in ranked[:3]]), atol=TOL, rtol=0)
    with pytest.raises(cohere.errors.BadRequestError) as refused:  # (Cohere would cut at its 4,096 in silence)
        client.rerank(model="ce", query=QUERY, documents=[DOCS[0], LONG])
    assert "request 1: the pair" in str(refused.value.body) and "max_tokens_per_doc" in str(refused.value.body)
    cut = client.rerank(model="ce", query=QUERY, documents=[DOCS[0], LONG], max_tokens_per_doc=50)
    assert cut.meta.warnings == ["`documents`[1] was cut to 50 tokens (max_tokens_per_doc)"]


def test_litellms_infinity_and_cohere_providers_parse_the_rerank_answers(infinity, cross_encoder):
    """litellm's infinity/ posts to /rerank and reads each document as a string; its cohere/ posts to
    /v1/rerank and reads {"text": ...}: one server answers both (--rerank-dialect infinity)."""
    litellm = _litellm()
    ranked = [r["corpus_id"] for r in cross_encoder.rank(QUERY, DOCS)]
    expected = cross_encoder.predict([(QUERY, DOCS[i]) for i in ranked])
    try:
        for model in ("infinity/ce", "cohere/ce"):
            answer = litellm.rerank(model=model, api_base=infinity.url, api_key="unused", query=QUERY, documents=DOCS,
                                    return_documents=True)
            assert [r["index"] for r in answer.results] == ranked, model
            assert [r["document"]["text"] for r in answer.results] == [DOCS[i] for i in ranked], model
            np.testing.assert_allclose([r["relevance_score"] for r in answer.results], expected, atol=TOL, rtol=0)
    finally:
        _close_litellms_clients(litellm)
    _no_connection_left_to(infinity)
    raw = post(infinity, "/rerank", {"model": "ce", "query": QUERY, "documents": DOCS[:2]}).json()
    assert raw["object"] == "rerank" and {r["document"] for r in raw["results"]} == {None}  # Infinity: no documents
    assert isinstance(raw["created"], int) and raw["usage"]["prompt_tokens"] == raw["usage"]["total_tokens"] > 0
    assert post(infinity, "/v1/rerank", GOOD).json()["results"][0]["document"]["text"] in DOCS  # vLLM's, as before


# ---- classify and pooling ----------------------------------------------------------------------------

def test_classify_matches_transformers_softmax_with_named_labels(classifier, models):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["classify3"])
    model = AutoModelForSequenceClassification.from_pretrained(models["classify3"]).eval()
    with torch.no_grad():
        batch = tokenizer(DOCS, padding=True, return_tensors="pt")
        expected = torch.softmax(model(**batch).logits, dim=-1).numpy()
    body = post(classifier, "/classify", {"model": "cls", "input": DOCS}).json()
    assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == "cls"
    np.testing.assert_allclose([d["probs"] for d in body["data"]], expected, atol=TOL, rtol=0)
    assert [d["label"] for d in body["data"]] == [LABELS[int(i)] for i in expected.argmax(axis=1)]
    assert {d["num_classes"] for d in body["data"]} == {3}
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    tokens = int(batch["attention_mask"].sum())
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    one = post(classifier, "/v1/classify", {"input": DOCS[2]}).json()
    np.testing.assert_allclose(one["data"][0]["probs"], expected[2], atol=TOL, rtol=0)
    pooled = post(classifier, "/pooling", {"input": DOCS}).json()  # the model's task: classify
    assert pooled["id"].startswith("pooling-") and pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], expected, atol=TOL, rtol=0)


def test_pooling_embed_and_token_embed(bundled, st_model):
    expected = st_model.encode(DOCS[:3], convert_to_numpy=True)
    body = post(bundled, "/pooling", {"input": DOCS[:3], "task": "embed"}).json()
    np.testing.assert_allclose([d["data"] for d in body["data"]], expected, atol=TOL, rtol=0)
    raw = post(bundled, "/pooling", {"input": DOCS[0], "encoding_format": "base64"}).json()["data"][0]["data"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), expected[0], atol=TOL, rtol=0)
    # token_embed: each token's vector normalized (the API's and vLLM's default); use_activation=false: ST's raw ones
    tokens = st_model.encode(DOCS[0], output_value="token_embeddings").cpu().numpy()  # (a tensor, as ST gives it)
    got = post(bundled, "/pooling", {"input": DOCS[0], "task": "token_embed"}).json()["data"][0]["data"]
    np.testing.assert_allclose(np.asarray(got), tokens / np.linalg.norm(tokens, axis=1, keepdims=True), atol=TOL, rtol=0)
    got = post(bundled, "/pooling", {"input": DOCS[0], "task": "token_embed", "use_activation": False}).json()
    np.testing.assert_allclose(np.asarray(got["data"][0]["data"]), tokens, atol=TOL, rtol=0)


# ---- refusals ----------------------------------------------------------------------------------------

GOOD = {"query": QUERY, "documents": DOCS[:2]}


@pytest.mark.parametrize("path, body, content, status, words", [
    ("/v1/rerank", None, b'{"query": "q", "documents": [', 400, "not valid JSON"),
    ("/score", None, b"not json", 400, "not valid JSON"),
    ("/v1/rerank", {"query": QUERY, "documents": 5}, None, 400, "`documents` must be a string or a list"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", 3]}, None, 400, "`documents[1]` must be a string"),
    ("/v1/rerank", {"query": 7, "documents": DOCS}, None, 400, "`query` must be a string"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": "two"}, None, 400, "$.top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, None, 400, "$.top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, None, 400, "`documents` cannot be empty"),
    ("/v1/rerank", {"query": QUERY}, None, 400, "documents"),
    ("/v1/rerank", {"query": {"content": [{"type": "text", "text": "q"}]}, "documents": DOCS}, None, 400,
     "multi-modal"),
    ("/v1/rerank", {"model": "nope", **GOOD}, None, 404, "The model `nope` does not exist."),
    ("/v1/rerank", {"truncation_side": "left", **GOOD}, None, 400, "`truncation_side` is not supported"),
    ("/v1/rerank", {"truncate_prompt_tokens": 100000, **GOOD}, None, 400, "truncate_prompt_tokens=100000"),
    ("/score", {"text_1": QUERY, "data_2": DOCS}, None, 400, "one pair of"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, None, 400, "1:1, 1:N or N:N"),
    ("/score", {"text_1": QUERY, "text_2": []}, None, 400, "`text_2` cannot be empty"),
    ("/classify", {"input": DOCS, "normalize": True}, None, 400, "Parameter `normalize` was removed"),
    ("/classify", {"input": 5}, None, 400, "`input` must be a string"),
    ("/pooling", {"input": DOCS, "task": "score"}, None, 400, "$.task"),
    ("/pooling", {"input": DOCS, "task": "token_embed"}, None, 400, "token_embed"),
])
def test_bad_requests_are_named_and_the_next_request_works(cross, cross_encoder, path, body, content, status, words):
    type_ = "NotFoundError" if status == 404 else "BadRequestError"
    assert_error(post(cross, path, body, content), status, words, type_)
    after = post(cross, "/v1/rerank", GOOD)
    assert after.status_code == 200
    np.testing.assert_allclose(sorted(r["relevance_score"] for r in after.json()["results"]),
                               sorted(cross_encoder.predict([(QUERY, d) for d in DOCS[:2]])), atol=TOL, rtol=0)


def test_a_route_the_model_cannot_serve_is_vllm_501(classifier, bundled):
    """vLLM: NotImplementedError("The model does not support ... API"), answered 501."""
    assert_error(post(classifier, "/score", {"text_1": QUERY, "text_2": DOCS}), 501,
                 "The model does not support Score API", "NotImplementedError")
    assert_error(post(classifier, "/v1/rerank", GOOD), 501, "The model does not support Rerank (Score) API",
                 "NotImplementedError")
    assert_error(post(bundled, "/classify", {"input": DOCS}), 501, "The model does not support Classification API",
                 "NotImplementedError")
    assert post(classifier, "/classify", {"input": DOCS}).status_code == 200
    assert post(bundled, "/v1/rerank", GOOD).status_code == 200
