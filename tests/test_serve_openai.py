"""pipeline-serve's OpenAI routes and its behaviour as a server, with the clients people point at it:
the `openai` client (float and base64), LangChain's OpenAIEmbeddings, many concurrent clients, the
window's 429, a client that leaves (its work aborted in the engine), SIGTERM's drain, authentication,
and every kind of bad request answered with the status vLLM gives and a body naming the problem."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import threading
import time

import corpus
import httpx
import numpy as np
import pytest
from helpers import wait_gone
from serve_helpers import start_server, started_server, stop_server

pytestmark = pytest.mark.slow

KEY = "test-key-123"
NAME = "minilm"
TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "Émile's café — 東京 🙂",
         "Embeddings map text to vectors.", "x"]


@pytest.fixture(scope="module")
def server():
    """The bundled model behind an API key, with a small body and batch bound (the tests of those
    bounds share it)."""
    with started_server("--api-key", KEY, "--served-model-name", NAME, "other-name",
                        "--max-body-bytes", str(1 << 20), "--max-client-batch-size", "64") as srv:
        yield srv


@pytest.fixture(scope="module")
def auth():
    return {"Authorization": f"Bearer {KEY}"}


def slow_server(*extra: str):
    """A server on the simulated device whose every step takes 1.5 s, with room for 4 inputs: its window
    stays full long enough to be seen full, whatever the machine's load."""
    return started_server("--device", "sim", "--sim-device", "1.5,0", "--max-num-seqs", "2", "--max-inflight", "4",
                          "--engine-window", "4", "--max-client-batch-size", "4", *extra)


def embed(st_model, texts, **kwargs) -> np.ndarray:
    return st_model.encode(texts, convert_to_numpy=True, batch_size=64, **kwargs)


# ---- fidelity with the real clients -----------------------------------------------------------------

@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_client_returns_sentence_transformers_vectors(server, st_model, encoding_format):
    """None: the client's default, which asks for base64 and decodes it itself; "base64" asked for
    explicitly is handed back as the string."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    asked = {"encoding_format": encoding_format} if encoding_format else {}
    result = client.embeddings.create(model=NAME, input=TEXTS, **asked)
    if encoding_format == "base64":
        got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in result.data])
    else:
        got = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(got, embed(st_model, TEXTS), atol=1e-5, rtol=0)
    tokens = sum(len(st_model.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens
    assert result.model == NAME


def test_base64_is_the_float32_bytes_and_float_round_trips(server, auth):
    body = {"model": NAME, "input": "one text"}
    floats = httpx.post(server.url + "/v1/embeddings", json=body, headers=auth).json()["data"][0]["embedding"]
    raw = httpx.post(server.url + "/v1/embeddings", json=body | {"encoding_format": "base64"},
                     headers=auth).json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert vector.shape == (384,)
    assert np.array_equal(np.asarray(floats, dtype=np.float32), vector)  # the JSON numbers are the float32 values


def test_token_id_inputs_equal_their_texts(server, st_model, auth):
    ids = [st_model.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    url = server.url + "/v1/embeddings"
    many = httpx.post(url, json={"input": ids}, headers=auth).json()
    one = httpx.post(url, json={"input": ids[1]}, headers=auth).json()
    got = np.array([d["embedding"] for d in many["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, embed(st_model, TEXTS[:3]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(one["data"][0]["embedding"], got[1], atol=1e-6, rtol=0)


def test_dimensions_keep_the_first_values_renormalized(server, st_model, auth):
    out = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[:2], "dimensions": 64}, headers=auth).json()
    got = np.array([d["embedding"] for d in out["data"]], dtype=np.float32)
    full = embed(st_model, TEXTS[:2])[:, :64]
    np.testing.assert_allclose(got, full / np.linalg.norm(full, axis=1, keepdims=True), atol=1e-5, rtol=0)


def test_langchain_openai_embeddings_retrieve_what_sentence_transformers_retrieves(server, st_model):
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import OpenAIEmbeddings

    docs = corpus.sentences(60, seed=21)
    queries = corpus.sentences(5, seed=22)
    embeddings = OpenAIEmbeddings(model=NAME, base_url=server.url + "/v1", api_key=KEY,
                                  check_embedding_ctx_length=False, max_retries=0)
    store = InMemoryVectorStore.from_texts(docs, embeddings)
    doc_vectors = embed(st_model, docs)
    for query in queries:
        found = [d.page_content for d in store.similarity_search(query, k=3)]
        scores = doc_vectors @ embed(st_model, [query])[0]
        assert found == [docs[i] for i in np.argsort(-scores)[:3]]


def test_truncation_when_asked_equals_sentence_transformers(server, st_model, auth):
    long_text = " ".join(corpus.sentences(80, seed=3))
    out = httpx.post(server.url + "/v1/embeddings", headers=auth,
                     json={"input": [long_text], "truncate_prompt_tokens": st_model.max_seq_length})
    assert out.status_code == 200, out.text
    np.testing.assert_allclose(out.json()["data"][0]["embedding"], embed(st_model, [long_text])[0], atol=1e-5, rtol=0)
    assert out.json()["usage"]["prompt_tokens"] == st_model.max_seq_length


def test_token_ids_over_the_models_length_are_refused_unless_truncation_is_asked(server, st_model, auth):
    """A list of token ids is measured as a text is: over max_seq_length (256) it is vLLM's 400 naming
    the input and its count (before: 300 or 600 ids were cut to 256 in silence, a 200); with
    truncate_prompt_tokens it is cut to that many ids, as the same ids cut by the client."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    long_ids = st_model.tokenizer(" ".join(corpus.sentences(80, seed=5)))["input_ids"]
    assert len(long_ids) > 600
    for n in (257, 300, 600):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=NAME, input=[long_ids[:n]])
        assert f"request 0: `input` has {n} tokens" in str(refused.value)
        assert "maximum context length of 256 tokens" in str(refused.value)
    batch = [long_ids[:10], long_ids[:300]]
    assert "request 1: `input` has 300 tokens" in error_of(
        httpx.post(server.url + "/v1/embeddings", json={"input": batch}, headers=auth), 400)
    at_limit = client.embeddings.create(model=NAME, input=[long_ids[:256]], encoding_format="float")
    assert at_limit.usage.prompt_tokens == 256
    for keep in (256, -1):  # -1: the model's length, max_model_len
        cut = client.embeddings.create(model=NAME, input=[long_ids[:600]], encoding_format="float",
                                       extra_body={"truncate_prompt_tokens": keep})
        assert cut.usage.prompt_tokens == 256
        np.testing.assert_allclose(cut.data[0].embedding, at_limit.data[0].embedding, atol=1e-6, rtol=0)
    with pytest.raises(openai.BadRequestError) as refused:  # vLLM: no more than max_model_len
        client.embeddings.create(model=NAME, input="x", extra_body={"truncate_prompt_tokens": 300})
    assert "truncate_prompt_tokens=300 is greater than max_model_len (256)" in str(refused.value)


def test_models_report_the_length_served_and_one_model_is_retrieved_by_name(server, st_model, auth):
    """max_model_len is the length the server keeps and refuses past (ST's max_seq_length, 256), not
    the position table's 512; GET /v1/models/{model} is the openai client's models.retrieve, a name
    not served its 404."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.model_extra["max_model_len"] for m in client.models.list()] == [st_model.max_seq_length] * 2
    for name in (NAME, "other-name"):
        card = client.models.retrieve(name)
        assert (card.id, card.object, card.model_extra["max_model_len"]) == (name, "model", st_model.max_seq_length)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert "The model `gpt-4` does not exist." in str(missing.value)
    bare = httpx.get(server.url + "/models/" + NAME, headers=auth)  # (without /v1 too, as /models)
    assert bare.status_code == 200 and bare.json()["id"] == NAME
    assert httpx.get(server.url + "/v1/models/" + NAME).status_code == 401  # the key is asked for
    assert "not allowed" in error_of(httpx.post(server.url + "/v1/models/" + NAME, json={}, headers=auth), 405)
    text = httpx.get(server.url + "/metrics", headers=auth).text
    assert 'route="/v1/models/{model}",status="404"' in text and "gpt-4" not in text  # one label for every name


def test_the_routes_without_v1_serve_an_openai_client_given_the_bare_address(server, st_model):
    """/embeddings and /models, as TEI and Infinity serve them: what the client asks for when its
    base_url is the server's address alone."""
    import openai

    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    result = client.embeddings.create(model=NAME, input=TEXTS)
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    np.testing.assert_allclose(got, embed(st_model, TEXTS), atol=1e-5, rtol=0)
    assert [m.id for m in client.models.list()] == [NAME, "other-name"]


def test_models_health_and_metrics(server, auth):
    assert server.url.startswith("http://127.0.0.1:")  # loopback unless --host says otherwise
    models = httpx.get(server.url + "/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == [NAME, "other-name"]
    assert models["data"][0]["max_model_len"] == 256  # ST's max_seq_length: what the server keeps
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    httpx.post(server.url + "/v1/embeddings", json={"input": "counted"}, headers=auth)
    text = httpx.get(server.url + "/metrics", headers=auth).text
    assert 'pipeline_requests_total{route="/v1/embeddings",status="200"}' in text
    assert "pipeline_request_duration_seconds_bucket" in text and "pipeline_prompt_tokens_total" in text
    # /health is counted, but only the model's routes are timed (a health probe every second would
    # bury the latencies that matter)
    assert 'pipeline_requests_total{route="/health",status="200"}' in text
    assert 'pipeline_request_duration_seconds_count{route="/v1/embeddings"}' in text
    assert 'pipeline_request_duration_seconds_count{route="/health"}' not in text
    counted = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert counted["pipeline_inputs_total"] >= 1 and counted["pipeline_healthy"] == 1


# ---- many clients at once ------------------------------------------------------------------------------

def test_64_concurrent_clients_each_get_their_own_exact_answers(server, st_model, auth):
    clients, per_client = 64, 20
    texts = corpus.sentences(clients * per_client, seed=31)
    texts = [f"{i}: {t}" for i, t in enumerate(texts)]  # every request's text is its own
    reference = embed(st_model, texts)

    async def client(k: int, http: httpx.AsyncClient) -> list[tuple[int, list]]:
        got = []
        for j in range(per_client):
            i = k * per_client + j
            r = await http.post("/v1/embeddings", json={"input": texts[i], "encoding_format": "base64",
                                                        "truncate_prompt_tokens": 256})  # (ST's max_seq_length)
            assert r.status_code == 200, r.text
            got.append((i, r.json()["data"][0]["embedding"]))
        return got

    async def run() -> list:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, headers=auth, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(client(k, http) for k in range(clients)))

    answers = [a for per in asyncio.run(run()) for a in per]
    assert len(answers) == clients * per_client
    got = np.stack([np.frombuffer(base64.b64decode(e), dtype="<f4") for _, e in answers])
    np.testing.assert_allclose(got, reference[[i for i, _ in answers]], atol=1e-5, rtol=0)


# ---- bad requests: vLLM's status codes and error bodies ---------------------------------------------------

def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error["message"]


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "no body"),
    (json.dumps({"input": 5}).encode(), 400, "`input` must be"),
    (json.dumps({"model": NAME}).encode(), 400, "input"),
    (json.dumps({"input": []}).encode(), 400, "empty"),
    (json.dumps({"input": ["ok", 3.5]}).encode(), 400, "`input`[1]"),
    (json.dumps({"input": "x", "encoding_format": "hex"}).encode(), 400, "encoding_format"),
    (json.dumps({"input": "x", "dimensions": 0}).encode(), 400, "dimensions"),
    (json.dumps({"input": "x", "dimensions": 4096}).encode(), 400, "dimensions"),
    (json.dumps({"input": "x", "model": "gpt-4"}).encode(), 404, "does not exist"),
    (json.dumps({"input": ["t"] * 65}).encode(), 413, "batch size 65"),
    (json.dumps({"input": [[101, 999999, 102]]}).encode(), 400, "token id 999999"),
    (json.dumps({"input": "word " * 600}).encode(), 400, "602 tokens"),
])
def test_a_bad_request_gets_vllms_status_and_a_message_naming_it(server, auth, body, status, says):
    response = httpx.post(server.url + "/v1/embeddings", content=body, headers=auth | {"content-type": "application/json"})
    assert says in error_of(response, status)
    assert httpx.post(server.url + "/v1/embeddings", json={"input": "fine"}, headers=auth).status_code == 200


def test_unknown_route_wrong_method_and_authentication(server, auth):
    assert "no route" in error_of(httpx.post(server.url + "/v1/nothing", json={}, headers=auth), 404)
    assert "not allowed" in error_of(httpx.get(server.url + "/v1/embeddings", headers=auth), 405)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/v1/embeddings", "/embeddings", "/", "/invocations"):
            response = httpx.post(server.url + path, json={"input": "x"}, headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
        error_of(httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, headers=headers), 401)
    for path in ("/health", "/", "/ping"):  # the health checks (TEI's three) ask for no key
        assert httpx.get(server.url + path).status_code == 200, path


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole(server, auth):
    big = json.dumps({"input": ["y" * 1000] * 1100}).encode()  # ~1.1 MB > 1 MB
    assert "larger than" in error_of(httpx.post(server.url + "/v1/embeddings", content=big, headers=auth), 413)

    def chunked():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"input": ["'
        for _ in range(2000):
            yield b"z" * 1024
        yield b'"]}'
    response = httpx.post(server.url + "/v1/embeddings", content=chunked(), headers=auth)
    assert "larger than" in error_of(response, 413)


# ---- load and faults ----------------------------------------------------------------------------------

def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(url: str, name: str, at_least: float, failure: str, timeout_s: float = 120.0) -> None:
    """Until a metric reaches a value (a bound for a hung server, with room for a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while metric(url, name) < at_least:
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def test_an_openai_request_of_2048_inputs_is_served_through_a_smaller_window(st_model):
    """OpenAI takes 2,048 inputs a request: so does the default --max-client-batch-size, whatever the
    window (here 64: before, the batch bound was cut to the window and such a request was a 413); the
    pipeline feeds them through its window, and each input gets ST's vector in its place (every 8th is
    compared: ST's own 2,048 would double the test's time)."""
    import openai

    texts = [f"{i}: {t[:40]}" for i, t in enumerate(corpus.sentences(2048, seed=51))]  # (short: 2,048 of them)
    with started_server("--max-inflight", "64") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        result = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
        assert httpx.get(srv.url + "/info").json()["max_client_batch_size"] == 2048
        assert [d.index for d in result.data] == list(range(len(texts)))
        got = np.array([d.embedding for d in result.data], dtype=np.float32)
        np.testing.assert_allclose(got[::8], embed(st_model, texts[::8]), atol=1e-5, rtol=0)
        too_many = httpx.post(srv.url + "/v1/embeddings", json={"input": ["x"] * 2049}, timeout=60)
        assert "batch size 2049" in error_of(too_many, 413)
        assert metric(srv.url, "pipeline_inputs_in_flight") == 0  # the window's room is all back


def test_a_full_window_answers_429_with_retry_after_then_serves():
    with slow_server("--max-queue-wait-s", "0.2") as srv:
        url = srv.url + "/v1/embeddings"
        results = {}
        first = threading.Thread(target=lambda: results.update(
            first=httpx.post(url, json={"input": ["a", "b", "c", "d"]}, timeout=120)))
        first.start()
        wait_for(srv.url, "pipeline_inputs_in_flight", 4, "the first request was never admitted")  # the window is full
        refused = httpx.post(url, json={"input": "e"}, timeout=60)
        assert "overloaded" in error_of(refused, 429)
        assert int(refused.headers["retry-after"]) >= 1
        first.join()
        assert results["first"].status_code == 200
        assert httpx.post(url, json={"input": "e"}, timeout=60).status_code == 200  # room again
        assert metric(srv.url, "pipeline_requests_rejected_total") == 1


def test_a_client_that_leaves_has_its_requests_aborted_in_the_engine():
    with started_server("--device", "sim", "--sim-device", "1.5,0", "--max-num-seqs", "2", "--max-inflight", "16",
                        "--engine-window", "16") as srv:
        url = srv.url + "/v1/embeddings"
        # Two inputs run in each 1.5 s step (and a step may be launched ahead): most of the twelve wait in
        # the engine when the client leaves.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={"input": [f"text {i}" for i in range(12)]}, timeout=httpx.Timeout(60, read=0.5))
        # (the engine's counters come with its heartbeats: once a second)
        wait_for(srv.url, "pipeline_engine_aborted_requests_total", 1, "the engine never dropped the left requests")
        assert metric(srv.url, "pipeline_client_disconnects_total") == 1
        assert metric(srv.url, "pipeline_inputs_in_flight") == 0  # their room is back
        ok = httpx.post(url, json={"input": ["a", "b"]}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["data"]) == 2


def test_sigterm_drains_what_is_in_flight_then_exits_cleanly():
    srv = start_server("--device", "sim", "--sim-device", "1.0,0", "--max-num-seqs", "2")
    try:
        url = srv.url + "/v1/embeddings"
        results = {}
        worker = threading.Thread(target=lambda: results.update(
            answer=httpx.post(url, json={"input": ["a", "b", "c", "d"]}, timeout=120)))
        worker.start()
        wait_for(srv.url, "pipeline_inputs_in_flight", 4, "the request was never admitted")
        children = srv.children()
        srv.proc.send_signal(signal.SIGTERM)
        worker.join()
        answer = results["answer"]
        assert answer.status_code == 200 and len(answer.json()["data"]) == 4  # (two 1 s steps after the signal)
        assert srv.proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.post(url, json={"input": "late"}, timeout=5)
        assert children and not wait_gone(children, 30.0)  # the group was closed on the way out
    finally:
        stop_server(srv.proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_drains_every_request_in_flight(st_model, sig):
    """systemd's KillMode=control-group and supervisord's stopasgroup send SIGTERM, a terminal's Ctrl-C
    SIGINT, to every process of the group: the render workers and the engine leave it to the server,
    which drains. The 50 requests in flight are all answered with ST's vectors, then the server ends its
    children and exits 0. (Before: the children died with the signal and 49 of 50 got a 503.)"""
    requests, per_request = 50, 2
    # ~80-160 tokens each: on this 2-core machine ~7 s of the engine's work, in flight when the signal comes
    texts = corpus.medium_texts(requests * per_request, seed=7, min_chars=400, max_chars=800)
    srv = start_server("--max-num-seqs", "16", new_session=True)
    answers: dict[int, httpx.Response] = {}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300,
                                     limits=httpx.Limits(max_connections=requests)) as http:
            async def one(k: int) -> None:
                body = {"input": texts[k * per_request:(k + 1) * per_request], "truncate_prompt_tokens": 256}
                answers[k] = await http.post("/v1/embeddings", json=body)
            await asyncio.gather(*(one(k) for k in range(requests)))

    client = threading.Thread(target=asyncio.run, args=(run(),))
    try:
        client.start()
        deadline = time.monotonic() + 120
        while (metric(srv.url, "pipeline_inputs_in_flight") / per_request
               + metric(srv.url, "pipeline_queue_waiting_requests") + len(answers)) < requests:
            assert time.monotonic() < deadline, "the requests never reached the server"
            time.sleep(0.01)
        answered_before = len(answers)
        children = srv.children()
        os.killpg(srv.proc.pid, sig)
        client.join(300)
        assert answered_before < requests  # (requests were in flight at the signal: else this proves nothing)
        assert sorted(answers) == list(range(requests))
        assert [answers[k].status_code for k in range(requests)] == [200] * requests
        got = np.array([d["embedding"] for k in range(requests) for d in answers[k].json()["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, st_model.encode(texts, convert_to_numpy=True, batch_size=64), atol=1e-5, rtol=0)
        assert srv.proc.wait(120) == 0
        assert children and not wait_gone(children, 30.0)  # ended by the server, after the drain
        assert "Traceback" not in srv.log()
    finally:
        client.join(300)
        stop_server(srv.proc)


def test_a_render_worker_killed_under_load_loses_no_request_and_mixes_none_up(server, st_model, auth):
    """Requests in flight when a worker dies are re-sent (as the API does) or answered 5xx: never a
    wrong or misplaced vector; the worker is replaced and the server goes on."""
    import os

    import psutil

    texts = [f"{i}: {t}" for i, t in enumerate(corpus.sentences(400, seed=41))]
    reference = embed(st_model, texts)
    workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "pooling_pipeline.workers" in " ".join(p.cmdline())]
    assert workers

    async def client(k: int, http: httpx.AsyncClient, answers: list) -> None:
        for i in range(k, len(texts), 16):
            if i == 80 and k == 0:
                os.kill(workers[0].pid, signal.SIGKILL)
            r = await http.post("/v1/embeddings", json={"input": texts[i], "truncate_prompt_tokens": 256})
            answers.append((i, r))

    async def run() -> list:
        answers: list = []
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=120) as http:
            await asyncio.gather(*(client(k, http, answers) for k in range(16)))
        return answers

    answers = asyncio.run(run())
    assert len(answers) == len(texts)
    served = [(i, r) for i, r in answers if r.status_code == 200]
    assert all(r.status_code >= 500 for _, r in answers if r.status_code != 200), \
        [r.text for _, r in answers if r.status_code != 200][:3]
    assert len(served) >= len(texts) // 2
    got = np.array([r.json()["data"][0]["embedding"] for _, r in served], dtype=np.float32)
    np.testing.assert_allclose(got, reference[[i for i, _ in served]], atol=1e-5, rtol=0)
    assert metric(server.url, "pipeline_worker_restarts_total") >= 1
    assert httpx.post(server.url + "/v1/embeddings", json={"input": "after"}, headers=auth).status_code == 200


def test_an_engine_that_keeps_dying_makes_health_and_requests_503_not_a_hang():
    """A killed engine core is restarted (tests/test_engine_restart.py); one that keeps dying -- more
    than MAX_ENGINE_RESTARTS_PER_MINUTE restarts in a minute, or dying again before its restart is
    ready -- fails the group: /health and every request then answer 503, never a hang."""
    import psutil

    with started_server("--backend", "torch") as srv:
        killed: set[int] = set()
        deadline = time.monotonic() + 240
        while httpx.get(srv.url + "/health").status_code == 200:  # (noticed by the next call or heartbeat check)
            for engine in [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                           if "pooling_pipeline.core.engine.main" in " ".join(p.cmdline()) and p.pid not in killed]:
                engine.kill()
                killed.add(engine.pid)
            httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=120)
            assert time.monotonic() < deadline, "the dead engine was never noticed"
            time.sleep(0.2)
        assert len(killed) >= 2  # (the first one was restarted: the server stayed healthy)
        response = httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=120)
        assert "not available" in error_of(response, 503)
        assert metric(srv.url, "pipeline_healthy") == 0
