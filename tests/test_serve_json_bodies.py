"""pipeline-serve reading a request body's JSON: arrays or objects nested past what the reader takes, a
lone UTF-16 surrogate escape, a token-id list with a float or a bool in it. Each is a 4xx that names the
problem, on every JSON route, and nothing is logged as an internal error."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import started_server

from pooling_pipeline.serve.routes import ROUTE_MODULES

pytestmark = pytest.mark.slow

JSON_ROUTES = [(route.path, route.dialect) for module in ROUTE_MODULES for route in module.ROUTES
               if route.method == "POST"]


@pytest.fixture(scope="module")
def server():
    """The bundled model's tokenizer on the simulated device: every refusal here comes before the engine."""
    with started_server("--device", "sim") as srv:
        yield srv


def post(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def message(answer: httpx.Response, dialect: str) -> str:
    body = answer.json()
    return body["error"] if dialect == "tei" else body["error"]["message"]


def nested(depth: int, key: str) -> bytes:
    return b'{"%s": %s1%s}' % (key.encode(), b"[" * depth, b"]" * depth)


@pytest.mark.parametrize("body", [nested(1000, "unknown_field"), nested(100_000, "unknown_field"),
                                  b'{"unknown_field": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}"],
                         ids=["arrays 1000 deep", "arrays 100k deep", "objects 5000 deep"])
def test_json_nested_past_the_readers_depth_is_a_400_naming_it_on_every_route(server, body):
    """msgspec reads a level per stack frame (an unknown field's value too, to skip it) and raised
    RecursionError: a 500 and a logged traceback on every JSON route."""
    for path, dialect in JSON_ROUTES:
        answer = post(server, path, body)
        assert answer.status_code == 400, (path, answer.text)
        assert "nested more than about 1000 levels deep" in message(answer, dialect), (path, answer.text)
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log


@pytest.mark.parametrize("depth", [900, 1000])
def test_json_nested_deep_in_a_field_is_refused_by_its_depth_or_its_shape_never_a_500(server, depth):
    """In a field a route reads (`{"input": [[[...]]]}`): its depth where the field takes any JSON, its
    shape where the field's type refuses the second `[` already (TEI's /similarity: 422); 501 where the
    route does not serve this model."""
    for path, _ in JSON_ROUTES:
        for key in ("input", "inputs", "ids", "query", "documents", "text_1"):
            answer = post(server, path, nested(depth, key))
            assert 400 <= answer.status_code < 500 or answer.status_code == 501, (path, key, answer.text)
    assert "nested more than about" in message(post(server, "/v1/embeddings", nested(1000, "input")), "openai")
    assert "nested more than about" in message(post(server, "/embed", nested(1000, "inputs")), "tei")
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log


@pytest.mark.parametrize("path, field", [("/v1/embeddings", "input"), ("/embed", "inputs"), ("/tokenize", "inputs")])
def test_a_lone_surrogate_escape_is_a_400_naming_it_and_a_pair_is_read(server, path, field):
    """msgspec calls a lone surrogate escape "Input data was truncated"."""
    body = b'{"%s": ["fine \\ud83d\\ude00", "a\\ud800b"]}' % field.encode()
    answer = post(server, path, body)
    assert answer.status_code == 400, answer.text
    dialect = "openai" if path.startswith("/v1") else "tei"
    at = body.index(b"\\ud800")
    assert message(answer, dialect) == (
        f"the body is not valid JSON: invalid \\u escape at byte {at}: \\ud800 is a lone "
        "surrogate (half of a UTF-16 pair without its other half), which is no Unicode character")
    low_first = post(server, path, b'{"%s": "\\ude00\\ud83d"}' % field.encode())
    assert "\\ude00 is a lone surrogate" in message(low_first, dialect)
    paired = post(server, path, b'{"%s": ["fine \\ud83d\\ude00"]}' % field.encode())
    assert paired.status_code == 200, paired.text


TOKEN_ID_LISTS = [
    # (path, body, status, the message); a float or a bool among ids was "`input`[0] ... got int"
    ("/v1/embeddings", b'{"input": [101, 2.5]}', 400, "`input`[1]: token ids must be integers, got float 2.5"),
    ("/v1/embeddings", b'{"input": [[101, 102], [101, 1e3]]}', 400,
     "`input`[1][1]: token ids must be integers, got float 1000.0"),
    ("/v1/embeddings", b'{"input": [101, true]}', 400, "`input`[1]: token ids must be integers, got boolean true"),
    ("/pooling", b'{"input": [101, 2.5]}', 400, "`input`[1]: token ids must be integers, got float 2.5"),
    ("/embed", b'{"inputs": [101, 2.5]}', 422, "`inputs`[1]: token ids must be integers >= 0, got float 2.5"),
    ("/embed", b'{"inputs": ["a text", [101, -1]]}', 422, "`inputs`[1][1]: token ids must be integers >= 0, got -1"),
    ("/decode", b'{"ids": [101, 2.5]}', 422, "`ids`[1]: token ids must be integers >= 0, got float 2.5"),
]


@pytest.mark.parametrize("path, body, status, says", TOKEN_ID_LISTS, ids=[f"{p} {b.decode()}" for p, b, _, _ in TOKEN_ID_LISTS])
def test_a_token_id_that_is_no_integer_is_named_by_its_position(server, path, body, status, says):
    answer = post(server, path, body)
    assert answer.status_code == status, answer.text
    assert message(answer, "tei" if status == 422 else "openai") == says
