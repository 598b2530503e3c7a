"""pipeline-serve's own HTTP/1.1 connection (pipeline/serve/protocol.py), spoken to over raw sockets:
pipelined requests answered in order, keep-alive and its idle timeout, HTTP/1.0 and `Connection: close`,
`Expect: 100-continue`, chunked bodies, a body over the limit refused before it is sent and the
connection still usable after, HEAD, malformed requests and oversized heads; read deadlines, the
connection cap and the body budget; clients that stop reading (--timeout-send) and refusals that close
(the rest of the body read first). And the same app served through uvicorn's own protocol
(`--http-protocol uvicorn`) answers alike."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import httpx
import psutil
import pytest
from serve_helpers import started_server

from pooling_pipeline.serve.cli import build_parser

pytestmark = pytest.mark.slow

KEY = "k-123"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def server():
    with started_server("--device", "sim", "--api-key", KEY, "--max-body-bytes", str(LIMIT),
                        "--timeout-keep-alive", "1") as srv:
        yield srv


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def connect(server) -> socket.socket:
    return socket.create_connection(address(server), timeout=60)  # (the bound is for a hung server)


def request(path: str, body: bytes | None = None, method: str = "POST", extra: str = "", version: str = "1.1",
            auth: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: test"]
    if auth:
        lines.append(f"Authorization: Bearer {KEY}")
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    head = "\r\n".join(lines) + "\r\n" + extra + "\r\n"
    return head.encode() + (body or b"")


def embed_body(texts: list[str]) -> bytes:
    return json.dumps({"input": texts}).encode()


class Reader:
    """HTTP responses off a socket, one at a time (Content-Length framed, as this server answers)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def _fill(self) -> bool:
        data = self.sock.recv(1 << 16)
        self.buffer += data
        return bool(data)

    def response(self, head_request: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"the connection closed before a whole response head: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        length = 0 if head_request else int(headers.get("content-length", 0))
        while len(self.buffer) < length:
            assert self._fill(), "the connection closed inside a response body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def closed(self) -> bool:
        """True when the server closes the connection with nothing more sent."""
        try:
            return not self._fill() and not self.buffer
        except ConnectionResetError:
            return True


# (The simulated device's vectors are rows of a fixed table picked by a hash of each input's tokens: the
# same input gets the same floats whatever it is batched with, so answers are compared exactly.)
def vectors(body: bytes) -> list[list[float]]:
    return [item["embedding"] for item in json.loads(body)["data"]]


def test_pipelined_requests_are_answered_in_order_each_with_its_own_vectors(server):
    batches = [["one"], ["two", "three", "four"], [f"text {i}" for i in range(9)], ["five", "six"]]
    expected = [vectors(httpx.post(server.url + "/v1/embeddings", content=embed_body(texts),
                                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60).content)
                for texts in batches]
    with connect(server) as sock:
        sock.sendall(b"".join(request("/v1/embeddings", embed_body(texts)) for texts in batches))
        reader = Reader(sock)
        for want in expected:
            status, _, body = reader.response()
            assert status == 200
            assert vectors(body) == want
        # keep-alive: the same connection takes another request
        sock.sendall(request("/v1/models", method="GET"))
        status, _, body = reader.response()
        assert status == 200 and json.loads(body)["object"] == "list"


def test_http_1_0_connection_close_and_an_upgrade_are_answered_then_closed(server):
    # (no websockets: an upgrade request is answered as plain HTTP, and nothing after it is read)
    for raw in (request("/v1/models", method="GET", version="1.0"),
                request("/v1/models", method="GET", version="1.0", extra="Connection: keep-alive\r\n"),
                request("/v1/models", method="GET", extra="Connection: close\r\n"),
                request("/v1/models", method="GET", extra="Connection: Upgrade\r\nUpgrade: websocket\r\n")
                + b"\x81\x85not-http"):
        with connect(server) as sock:
            sock.sendall(raw)
            reader = Reader(sock)
            status, headers, _ = reader.response()
            assert status == 200 and headers["connection"] == "close"
            assert reader.closed()


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(server):
    with connect(server) as sock:
        sock.sendall(request("/health", method="GET", auth=False))
        reader = Reader(sock)
        assert reader.response()[0] == 200
        assert reader.closed()  # (--timeout-keep-alive 1; recv's own bound is 60 s)


def test_expect_100_continue_gets_its_interim_answer_and_a_refusal_gets_none(server):
    body = embed_body(["hello"])
    with connect(server) as sock:
        head = request("/v1/embeddings", body, extra="Expect: 100-continue\r\n")[:-len(body)]
        sock.sendall(head)
        reader = Reader(sock)
        assert reader.response()[0] == 100
        sock.sendall(body)
        status, _, answer = reader.response()
        assert status == 200 and len(vectors(answer)) == 1
    with connect(server) as sock:  # no API key: the final answer at once, and the connection closed
        sock.sendall(request("/v1/embeddings", body, extra="Expect: 100-continue\r\n", auth=False)[:-len(body)])
        reader = Reader(sock)
        status, headers, answer = reader.response()
        assert status == 401 and headers["connection"] == "close"
        assert "Bearer" in json.loads(answer)["error"]["message"]
        assert reader.closed()


def test_a_pipelined_expect_100_continue_gets_its_interim_answer_after_the_answers_before_it(server):
    body = embed_body(["hello"])
    with connect(server) as sock:
        sock.sendall(request("/v1/models", method="GET")
                     + request("/v1/embeddings", body, extra="Expect: 100-continue\r\n")[:-len(body)])
        reader = Reader(sock)
        assert reader.response()[0] == 200  # the models list first
        assert reader.response()[0] == 100  # then the pending request's 100 Continue
        sock.sendall(body)
        status, _, answer = reader.response()
        assert status == 200 and len(vectors(answer)) == 1


def test_a_body_over_the_limit_is_refused_before_it_is_sent_and_the_connection_stays_usable(server):
    big = embed_body(["y" * 1000] * 100)  # ~100 KB > 64 KB
    with connect(server) as sock:
        sock.sendall(request("/v1/embeddings", big)[:-len(big)])  # the head alone
        reader = Reader(sock)
        status, headers, answer = reader.response()
        assert status == 413 and "connection" not in headers
        assert "larger than" in json.loads(answer)["error"]["message"]
        sock.sendall(big)  # sent anyway: read and dropped
        sock.sendall(request("/v1/embeddings", embed_body(["after"])))
        status, _, answer = reader.response()
        assert status == 200 and len(vectors(answer)) == 1


def chunked(body: bytes, piece: int) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece]) for i in range(0, len(body), piece))
    return out + b"0\r\n\r\n"


def test_chunked_bodies_are_read_and_one_over_the_limit_is_refused_once_it_passes_it(server):
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    with connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(head + chunked(embed_body(["a", "b", "c"]), 7))
        status, _, answer = reader.response()
        assert status == 200 and len(vectors(answer)) == 3
        sock.sendall(head + chunked(embed_body(["z" * 1000] * 100), 4096))
        status, _, answer = reader.response()
        assert status == 413 and "larger than" in json.loads(answer)["error"]["message"]
        sock.sendall(request("/v1/embeddings", embed_body(["next"])))  # the rest was dropped; the stream goes on
        status, _, answer = reader.response()
        assert status == 200 and len(vectors(answer)) == 1


def test_a_chunked_bodys_trailers_are_ignored_and_bounded_like_a_head(server):
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    body = chunked(embed_body(["a"]), 5)[:-2]  # (the last chunk, its trailers to follow)
    with connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(head + body + b"X-Trailer: one\r\n\r\n")
        status, _, answer = reader.response()
        assert status == 200 and len(vectors(answer)) == 1
        sock.sendall(head + body)
        for _ in range(10):  # 80 KB of trailer fields, sent as a client would stream them
            sock.sendall(b"X-Trailer: b\r\n" * 600)
        status, headers, answer = reader.response()
        assert status == 431 and headers["connection"] == "close"
        assert reader.closed()


def test_head_gets_no_body_and_the_stream_stays_in_step(server):
    with connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(request("/v1/models", method="HEAD") + request("/v1/models", method="GET"))
        status, headers, _ = reader.response(head_request=True)
        assert status == 405 and int(headers["content-length"]) > 0
        status, _, body = reader.response()
        assert status == 200 and json.loads(body)["object"] == "list"


def test_a_percent_encoded_or_absolute_form_target_is_routed_by_its_path(server):
    with connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(request("/v1/embedding%73", embed_body(["x"])))
        status, _, body = reader.response()
        assert status == 200 and len(vectors(body)) == 1
        sock.sendall(request("http://example.com/v1/models", method="GET") + request("http://example.com", method="GET"))
        status, _, body = reader.response()
        assert status == 200 and json.loads(body)["object"] == "list"
        status, _, body = reader.response()  # (no path: the root, GET / being TEI's health check)
        assert status == 200 and body == b""
        sock.sendall(request("http://example.com?x=1", method="GET") + request("http://example.com/nothing", method="GET"))
        assert reader.response()[0] == 200
        status, _, body = reader.response()
        assert status == 404 and "no route /nothing" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("raw, status, says", [
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "not valid HTTP"),
    (b"POST /v1/embeddings HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello", 400, "not valid HTTP"),
    (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n", 431, "larger than"),
    (b"GET /health HTTP/1.1\r\n" + b"X-Many: b\r\n" * 8000 + b"\r\n", 431, "larger than"),
    (b"GET http://[bad HTTP/1.1\r\nHost: x\r\n\r\n", 400, "not a valid URL"),
], ids=["not-http", "two-lengths", "one-huge-header", "many-headers", "bad-target"])
def test_a_malformed_or_oversized_head_is_answered_then_the_connection_closed(server, raw, status, says):
    with connect(server) as sock:
        sock.sendall(raw)
        reader = Reader(sock)
        got, headers, body = reader.response()
        assert got == status and headers["connection"] == "close"
        assert says in json.loads(body)["error"]["message"]
        assert reader.closed()
    assert httpx.get(server.url + "/health").status_code == 200  # the server is unharmed


def test_a_request_after_an_oversized_head_is_not_read_and_nothing_fails_in_the_server(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n"
                     + request("/v1/models", method="GET"))
        reader = Reader(sock)
        assert reader.response()[0] == 431
        assert reader.closed()
    assert "Traceback" not in server.log() and "this is a bug" not in server.log()


def test_sigterm_answers_a_request_whose_body_is_still_arriving():
    body = embed_body(["hello"])
    with started_server("--device", "sim") as srv:
        with connect(srv) as idle, connect(srv) as upload:
            idle.sendall(request("/health", method="GET"))
            assert Reader(idle).response()[0] == 200
            upload.sendall(request("/v1/embeddings", body)[:-len(body) + 10])  # the head and 10 bytes
            wait_for_connections(srv, 2)
            srv.proc.send_signal(signal.SIGTERM)
            assert Reader(idle).closed()  # an idle connection is closed at once
            upload.sendall(body[10:])
            status, headers, answer = Reader(upload).response()
            assert status == 200 and headers["connection"] == "close" and len(vectors(answer)) == 1
        assert srv.proc.wait(60) == 0


def wait_for_connections(server, n: int) -> None:
    """Until the server process holds n established connections (a bound for a hung server)."""
    deadline = time.monotonic() + 30
    port = address(server)[1]
    while sum(1 for c in psutil.Process(server.proc.pid).net_connections("tcp")
              if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED) < n:
        assert time.monotonic() < deadline, "the connections never reached the server"
        time.sleep(0.02)


def test_uvicorns_own_protocol_serves_the_same_answers_and_the_access_log_names_requests():
    texts = ["alpha", "beta gamma"]
    with started_server("--device", "sim", "--http-protocol", "uvicorn") as srv:
        theirs = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=60)
        refused = httpx.post(srv.url + "/v1/embeddings", json={"input": 3}, timeout=60)
        missing = httpx.get(srv.url + "/v1/nothing", timeout=60)
    with started_server("--device", "sim", "--access-log") as srv:
        ours = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=60)
        deadline = time.monotonic() + 30  # (the line is written just after the answer: a bound for a lost one)
        while '"POST /v1/embeddings HTTP/1.1" 200' not in srv.log():  # --access-log: a line per request
            assert time.monotonic() < deadline, srv.log()[-2000:]
            time.sleep(0.02)
    assert theirs.status_code == ours.status_code == 200
    assert vectors(theirs.content) == vectors(ours.content)
    assert refused.status_code == 400 and "input" in refused.json()["error"]["message"]
    assert missing.status_code == 404


def test_many_connections_at_once_each_get_their_own_answer(server):
    socks = [connect(server) for _ in range(40)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(request("/v1/embeddings", embed_body([f"c{i}"] * (1 + i % 5))))
        for i, sock in enumerate(socks):
            status, _, body = Reader(sock).response()
            assert status == 200 and len(vectors(body)) == 1 + i % 5
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("flag", ["--timeout-keep-alive", "--max-queue-wait-s", "--graceful-shutdown-s", "--timeout-header",
                                  "--timeout-body", "--timeout-send"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_duration_flag_that_is_not_a_positive_number_is_a_usage_error(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err


# -- what a connection may hold, and for how long --


@pytest.fixture(scope="module")
def deadlines():
    # (a keep-alive of 30 s: only the head and body deadlines can close what these tests trickle)
    with started_server("--device", "sim", "--timeout-header", "2", "--timeout-body", "2", "--min-body-rate", "1000",
                        "--timeout-keep-alive", "30") as srv:
        yield srv


def trickle(sock: socket.socket, more: bytes, every_s: float = 0.2, bound_s: float = 60.0) -> int:
    """Sends `more` a byte at a time, one every `every_s` (the idle clock's restart on each byte kept such
    a client for ever), until the server answers or closes; returns the bytes sent. `bound_s` is for a
    server that never does."""
    start, sent = time.monotonic(), 0
    while not select.select([sock], [], [], every_s)[0]:
        assert time.monotonic() - start < bound_s, f"the server still waits after {sent} bytes trickled"
        try:
            sock.sendall(more[sent % len(more):sent % len(more) + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 1
    return sent


def test_a_head_trickled_a_byte_at_a_time_is_408_at_the_header_deadline_and_others_are_served(deadlines):
    with connect(deadlines) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        trickle(sock, b"X-Slow: 1\r\n")
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 408 and headers["connection"] == "close"
        assert "request line and headers did not arrive in time" in json.loads(body)["error"]["message"]
        assert reader.closed()
    assert httpx.get(deadlines.url + "/health", timeout=60).status_code == 200


@pytest.mark.parametrize("sent, more", [
    (b"", b""),  # a Content-Length and no body at all
    (b'{"input": ', b" "),  # a body trickled: each byte within the stall bound, the average far under the rate
], ids=["no-body", "trickled"])
def test_a_body_that_stalls_or_trickles_is_408_and_others_are_served(deadlines, sent, more):
    with connect(deadlines) as sock:
        sock.sendall(request("/v1/embeddings", b"x" * 100_000)[:-100_000] + sent)
        if more:
            assert trickle(sock, more) > 0
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 408 and headers["connection"] == "close"
        assert "body did not arrive in time" in json.loads(body)["error"]["message"]
        assert reader.closed()
    answer = httpx.post(deadlines.url + "/v1/embeddings", json={"input": ["after"]}, timeout=60)
    assert answer.status_code == 200 and len(vectors(answer.content)) == 1


def test_a_request_on_a_connection_opened_past_max_connections_is_503_but_a_health_check_is_answered():
    with started_server("--device", "sim", "--max-connections", "3", "--timeout-keep-alive", "60") as srv:
        held = [connect(srv) for _ in range(3)]
        try:
            for sock in held:  # three open connections, each answered
                sock.sendall(request("/v1/models", method="GET", auth=False))
                assert Reader(sock).response()[0] == 200
            with connect(srv) as sock:
                sock.sendall(request("/v1/embeddings", embed_body(["over"]), auth=False))
                reader = Reader(sock)
                status, headers, body = reader.response()
                assert status == 503 and headers["connection"] == "close" and headers["retry-after"] == "1"
                assert "--max-connections" in json.loads(body)["error"]["message"]
                assert reader.closed()
            assert httpx.get(srv.url + "/health", timeout=60).status_code == 200  # (a supervisor's check)
            assert httpx.get(srv.url + "/metrics", timeout=60).status_code == 200  # (and its scraper)
            sock = held.pop()
            sock.sendall(request("/v1/embeddings", embed_body(["held"]), auth=False))  # the three still served
            assert Reader(sock).response()[0] == 200
            sock.close()
            deadline = time.monotonic() + 30  # (the server sees the close soon: a bound for one it never sees)
            while (answer := httpx.post(srv.url + "/v1/embeddings", json={"input": ["in"]}, timeout=60)).status_code == 503:
                assert time.monotonic() < deadline, "a closed connection's room never came back"
                time.sleep(0.05)
            assert answer.status_code == 200 and len(vectors(answer.content)) == 1
        finally:
            for sock in held:
                sock.close()


BUDGET = 100_000  # --max-held-body-bytes: one 60 KB body fits, two do not


@pytest.fixture(scope="module")
def budget():
    with started_server("--device", "sim", "--max-body-bytes", str(64 << 10), "--max-held-body-bytes", str(BUDGET)) as srv:
        yield srv


def padded(texts: list[str], size: int) -> bytes:
    """An embeddings request of exactly `size` bytes (JSON's trailing whitespace)."""
    body = embed_body(texts)
    return body + b" " * (size - len(body))


def bytes_held(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("pipeline_request_body_bytes_held ")))


def wait_held(server, check) -> None:
    deadline = time.monotonic() + 30  # (a bound for a server that never gets there)
    while not check(held := bytes_held(server)):
        assert time.monotonic() < deadline, f"the server holds {held} body bytes"
        time.sleep(0.02)


def test_bodies_held_at_once_are_bounded_and_one_past_the_budget_is_503_while_the_first_is_answered(budget):
    first, second = padded(["first"], 60_000), padded(["second"], 60_000)
    with connect(budget) as a, connect(budget) as b:
        a.sendall(request("/v1/embeddings", first, auth=False)[:-10_000])  # 50 KB of its body
        wait_held(budget, lambda held: held == 50_000)
        b.sendall(request("/v1/embeddings", second, auth=False))
        reader_b = Reader(b)
        status, headers, body = reader_b.response()
        assert status == 503 and headers["retry-after"] == "1"
        assert "--max-held-body-bytes" in json.loads(body)["error"]["message"]
        a.sendall(first[-10_000:])
        status, _, body = Reader(a).response()
        assert status == 200 and len(vectors(body)) == 1
        wait_held(budget, lambda held: held == 0)  # given back once answered
        b.sendall(request("/v1/embeddings", second, auth=False))  # the refused body was dropped: b goes on
        status, _, body = reader_b.response()
        assert status == 200 and len(vectors(body)) == 1


def test_a_body_whose_client_leaves_gives_its_bytes_back(budget):
    body = padded(["leaves"], 60_000)
    with connect(budget) as sock:
        sock.sendall(request("/v1/embeddings", body, auth=False)[:-1000])
        wait_held(budget, lambda held: held == 59_000)
    wait_held(budget, lambda held: held == 0)
    answer = httpx.post(budget.url + "/v1/embeddings", content=padded(["full"], 60_000), timeout=60)
    assert answer.status_code == 200 and len(vectors(answer.content)) == 1


def test_a_body_budget_under_the_largest_body_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "pooling_pipeline.serve.cli", "--device", "sim", "--port", "0",
                           "--max-body-bytes", "2000", "--max-held-body-bytes", "1000"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert "max_held_body_bytes=1000 is less than max_body_bytes=2000" in done.stderr


def test_an_expect_100_continue_body_the_budget_cannot_hold_is_503_before_the_100(budget):
    """The 100 asks the client for its body: a Content-Length the budget cannot hold now is refused with the
    503 instead of the 100 (it was a 100, then the 503 once the whole body had come), and one it can hold is
    reserved whole with its 100, before a byte of it is sent."""
    first, second = padded(["first"], 60_000), padded(["second"], 60_000)
    with connect(budget) as a, connect(budget) as b:
        a.sendall(request("/v1/embeddings", first, auth=False)[:-10_000])  # 50 KB of the 100 KB budget
        wait_held(budget, lambda held: held == 50_000)
        b.sendall(request("/v1/embeddings", second, auth=False, extra="Expect: 100-continue\r\n")[:-len(second)])
        reader_b = Reader(b)
        status, headers, body = reader_b.response()
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert "--max-held-body-bytes" in json.loads(body)["error"]["message"]
        assert reader_b.closed()  # (the body it holds back is not waited for)
        a.sendall(first[-10_000:])
        assert Reader(a).response()[0] == 200
    wait_held(budget, lambda held: held == 0)
    with connect(budget) as c:
        c.sendall(request("/v1/embeddings", second, auth=False, extra="Expect: 100-continue\r\n")[:-len(second)])
        reader = Reader(c)
        assert reader.response()[0] == 100
        assert bytes_held(budget) == 60_000  # reserved with its 100
        c.sendall(second)
        status, _, body = reader.response()
        assert status == 200 and len(vectors(body)) == 1
    wait_held(budget, lambda held: held == 0)


# -- clients that stop reading, and refusals that close --


@pytest.fixture(scope="module")
def stalls():
    # (--timeout-header 1: the clock looks every second; a keep-alive of 5 s that these tests outlast)
    with started_server("--device", "sim", "--max-connections", "2", "--timeout-send", "2", "--timeout-keep-alive", "5",
                        "--timeout-header", "1", "--max-body-bytes", str(64 << 10), "--max-held-body-bytes",
                        str(BUDGET)) as srv:
        yield srv


# 2,048 texts: an answer of ~10 MB, more than the kernel's socket buffers hold for a client that reads nothing
MANY = embed_body([f"word {i}" for i in range(2048)])


def not_reading(server) -> socket.socket:
    """A client that reads nothing (a 4 KB receive buffer, set before it connects)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(address(server))
    return sock


def test_a_client_that_stops_reading_is_aborted_after_the_send_timeout_with_the_body_it_sent_next(stalls):
    """It held its connection and its pipelined request's body bytes for ever (nothing is started while the
    answer before cannot be written): the budget's 60 KB stayed taken and other clients' bodies got 503."""
    with not_reading(stalls) as sock:
        sock.sendall(request("/v1/embeddings", MANY, auth=False) + request("/v1/embeddings", padded(["next"], 60_000),
                                                                            auth=False))
        wait_held(stalls, lambda held: held >= 60_000)  # the second read whole, behind the first's answer
        wait_held(stalls, lambda held: held == 0)  # --timeout-send 2: aborted, its bytes back
    answer = httpx.post(stalls.url + "/v1/embeddings", content=padded(["after"], 60_000), timeout=60)
    assert answer.status_code == 200 and len(vectors(answer.content)) == 1


def test_a_client_that_reads_its_answer_slowly_is_not_aborted(stalls):
    """--timeout-send bounds a time without progress, not an answer's whole time: 10 MB taken a megabyte at
    a time with a quarter of a second between (each pause well under the 2 s bound, with room for a busy machine)."""
    texts = [f"slow {i}" for i in range(2048)]
    with connect(stalls) as sock:
        sock.sendall(request("/v1/embeddings", embed_body(texts), auth=False))
        reader = Reader(sock)
        while b"\r\n\r\n" not in reader.buffer:
            assert reader._fill()
        length = int(next(line.split(b":")[1] for line in reader.buffer.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        assert length > 6 << 20  # (more than the sockets' buffers hold: the server's own buffer is what waits)
        while len(reader.buffer) < length:
            time.sleep(0.25)
            before = len(reader.buffer)
            while len(reader.buffer) < min(before + (1 << 20), length):
                assert reader._fill(), "the connection was closed under a client that reads"
        status, _, body = reader.response()
        assert status == 200 and len(vectors(body)) == len(texts)


def test_connections_whose_clients_stop_reading_give_their_places_back_after_the_send_timeout(stalls):
    """Two clients that read nothing held --max-connections 2 for ever (an idle close waits for the answer to
    be taken): every later connection got 503."""
    with not_reading(stalls) as one, not_reading(stalls) as two:
        for sock in (one, two):
            sock.sendall(request("/v1/embeddings", MANY, auth=False))
        deadline = time.monotonic() + 60  # (a bound for places that never come back, not a timing)
        while (status := post_status(stalls, embed_body(["in"]))) == 503:
            assert time.monotonic() < deadline, "the connections of clients that read nothing were never aborted"
            time.sleep(0.1)
        assert status == 200


def post_status(server, body: bytes) -> int:
    with connect(server) as sock:
        sock.sendall(request("/v1/embeddings", body, auth=False))
        return Reader(sock).response()[0]


def test_after_a_body_dropped_behind_its_refusal_the_idle_clock_runs_from_the_bodys_end(stalls):
    """A 404 answered from its head, its body taking longer to come than --timeout-keep-alive (5 s): the
    connection was closed as idle as soon as the body ended (its keep-alive counted from the 404)."""
    body = b" " * 6000
    with connect(stalls) as sock:
        sock.sendall(request("/v1/nothing", body, auth=False)[:-len(body)])
        reader = Reader(sock)
        assert reader.response()[0] == 404
        for k in range(6):  # the body over 6 s
            time.sleep(1.0)
            sock.sendall(body[k * 1000:(k + 1) * 1000])
        time.sleep(2.5)  # idle, half the keep-alive (the clock looks every second)
        sock.sendall(request("/health", method="GET", auth=False))
        assert reader.response()[0] == 200


def test_a_refusal_that_closes_the_connection_reads_the_body_first_so_that_the_client_sees_it(server):
    """urllib sends `Connection: close`: its 8 MB body over --max-body-bytes (more than the sockets' buffers
    take) got a reset (BrokenPipeError) where the 413 was written, the connection closed with the body coming."""
    big = padded(["big"], 8 << 20)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(server.url + "/v1/embeddings", data=big, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}), timeout=60)
    assert refused.value.code == 413 and "body" in json.loads(refused.value.read())["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200


def test_a_client_past_max_connections_that_sends_a_body_reads_its_503():
    """http.client sends its whole body before it reads: a 4 MB POST past the cap got ECONNRESET, never its 503."""
    with started_server("--device", "sim", "--max-connections", "1", "--timeout-keep-alive", "60") as srv:
        with connect(srv) as holder:
            holder.sendall(request("/health", method="GET", auth=False))
            assert Reader(holder).response()[0] == 200
            client = http.client.HTTPConnection(*address(srv), timeout=60)
            try:
                client.request("POST", "/v1/embeddings", body=padded(["over"], 4 << 20),
                               headers={"Content-Type": "application/json"})
                answer = client.getresponse()
                assert answer.status == 503 and answer.getheader("retry-after") == "1"
                assert "--max-connections" in json.loads(answer.read())["error"]["message"]
            finally:
                client.close()


def test_a_refused_body_that_stops_coming_is_not_waited_for_past_its_bound(deadlines):
    """The rest of a refused body is read before the close, but not for ever: one that stops coming is closed
    after --timeout-body (2 s here; 5 s at most: nginx's lingering_timeout)."""
    with connect(deadlines) as sock:
        sock.sendall(request("/v1/nothing", b"x" * 100_000, extra="Connection: close\r\n")[:-100_000] + b"x" * 10)
        reader = Reader(sock)
        status, headers, _ = reader.response()
        assert status == 404 and headers["connection"] == "close"
        assert reader.closed()


def test_a_broken_body_count_is_raised_and_the_connection_still_answers_the_request_behind(monkeypatch):
    """A give-back of body bytes that raises (a broken count: "this is a bug") was the first step after an
    answer: the rest was skipped and the pipelined request behind waited for ever. Now it comes last: raised
    (reported by the loop) and the next request answered. In-process: the budget is made to fail."""
    from uvicorn.server import ServerState

    from pooling_pipeline.api import Pipeline
    from pooling_pipeline.serve.app import ServeSettings
    from pooling_pipeline.serve.protocol import protocol_factory
    from pooling_pipeline.serve.routes import make_app

    with Pipeline(device="sim") as pipe:
        app = make_app(pipe, ServeSettings(served_model_names=("m",)))
        give_back = app.server.bodies.give_back

        def broken(n: int) -> None:
            give_back(n)
            raise RuntimeError(f"{n} body bytes given back twice: this is a bug")

        monkeypatch.setattr(app.server.bodies, "give_back", broken)
        statuses, reported = asyncio.run(_two_pipelined_requests(protocol_factory(app), ServerState()))
    assert statuses == [200, 200]
    assert any(isinstance(error, RuntimeError) and "this is a bug" in str(error) for error in reported)


async def _two_pipelined_requests(make, state) -> tuple[list[int], list]:
    loop = asyncio.get_running_loop()
    reported: list = []
    loop.set_exception_handler(lambda loop, context: reported.append(context.get("exception")))
    listening = await loop.create_server(lambda: make(SimpleNamespace(timeout_keep_alive=5.0), state, _loop=loop),
                                         "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*listening.sockets[0].getsockname()[:2])
    writer.write(request("/v1/embeddings", embed_body(["a"]), auth=False) + request("/health", method="GET", auth=False))
    statuses = []
    for _ in range(2):  # (the bound is for a connection left waiting)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        statuses.append(int(head.split(b" ")[1]))
    writer.close()
    listening.close()
    await listening.wait_closed()
    gc.collect()  # (the task's unretrieved exception is reported as it is collected)
    return statuses, reported
