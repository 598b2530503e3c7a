"""The ASGI primitives every route shares: a request body read under a byte bound, a JSON answer, and
the error bodies of each dialect (OpenAI / vLLM, text-embeddings-inference).

JSON is read and written with msgspec (already a dependency), except the rows of floats: orjson writes
a float32 array as float32's shortest form (`0.019155025`, which reads back as the same float32) in half
msgspec's time and 60% of its bytes, where msgspec writes the widened float64 (`0.019155025482177734`).
Base64 rows are written by pybase64 (SIMD: 32 rows of 384 floats in ~7 us, where binascii takes ~28).
docs/serving-stack.md has the measurements.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np
import orjson

try:
    from pybase64 import b64encode
except ImportError:  # (the `serve` extra brings it; the standard library's is the same bytes, slower)
    from base64 import b64encode

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

_encoder = msgspec.json.Encoder()
JSON = b"application/json"

# Reason phrases of the status codes this server answers with (the error bodies name them too).
REASONS = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 413: "Payload Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Entity",
           424: "Failed Dependency", 429: "Too Many Requests", 500: "Internal Server Error",
           501: "Not Implemented", 503: "Service Unavailable"}
# vLLM's error `type` per status (its OpenAI-compatible server names the exception class).
OPENAI_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
                408: "BadRequestError", 413: "BadRequestError", 415: "BadRequestError", 422: "BadRequestError",
                429: "RateLimitError", 500: "InternalServerError", 501: "NotImplementedError",
                503: "ServiceUnavailableError"}
# text-embeddings-inference's `error_type` per status, as its server writes it (serde's default for its
# ErrorType enum: "Validation", not the lower case of its OpenAPI examples).
TEI_TYPES = {400: "Empty", 413: "Validation", 422: "Tokenizer", 424: "Backend", 429: "Overloaded",
             503: "Unhealthy"}


class HTTPError(Exception):
    """A request answered with an error status and a JSON body naming the problem. `headers`: extra
    response headers (Retry-After on a 429, WWW-Authenticate on a 401)."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class BodyTooLarge(HTTPError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(--max-body-bytes)")


def error_body(dialect: str, status: int, message: str) -> bytes:
    """The JSON error body a peer server gives: vLLM's for the OpenAI-shaped routes, TEI's for its own."""
    if dialect == "tei":
        return _encoder.encode({"error": message, "error_type": TEI_TYPES.get(status, "Validation")})
    return _encoder.encode({"error": {"message": message, "type": OPENAI_TYPES.get(status, "BadRequestError"),
                                      "param": None, "code": status}})


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:  # ASGI servers give header names lower-cased
            return value
    return None


async def read_body(headers: list[tuple[bytes, bytes]], receive: Receive, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it would pass `limit` bytes: by its Content-Length
    before a byte is read, else (chunked) when the bytes read pass it -- never held whole first."""
    length = header(headers, b"content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise HTTPError(400, f"Content-Length {length.decode('latin-1')!r} is not a number") from None
        if declared > limit:
            raise BodyTooLarge(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class ClientGone(Exception):
    """The client closed its connection before its answer: nothing is sent."""


def decode_json(body: bytes, type_: Any, dialect: str) -> Any:
    """The body as `type_`: malformed JSON is a 400; well-formed JSON of the wrong shape a 422 for TEI's
    routes (axum's Json extractor) and a 400 for the OpenAI-shaped ones (vLLM's validation errors)."""
    if not body:
        raise HTTPError(400, "the request has no body; a JSON object is expected")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise HTTPError(422 if dialect == "tei" else 400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"the body is not valid JSON: {_json_problem(body, e)}") from None
    except RecursionError:  # (msgspec reads a level of nesting per stack frame, unknown fields included)
        raise HTTPError(400, f"the body's JSON is nested more than about {sys.getrecursionlimit()} levels deep "
                             "(arrays or objects inside each other), more than this server reads") from None


# A \u escape of a UTF-16 surrogate: after an odd number of backslashes (`\\ud800` is a backslash and text).
_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89a-fA-F][0-9a-fA-F]{2})")
_LOW_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _json_problem(body: bytes, error: msgspec.DecodeError) -> str:
    """msgspec's words, except for a lone surrogate escape (`"\\ud800"`), which it calls "Input data was
    truncated": that escape and where it is, found only on this error path."""
    message = str(error)
    if message != "Input data was truncated" and "surrogate" not in message:
        return message
    paired_low = -1
    for match in _SURROGATE_ESCAPE.finditer(body):
        start, escape = match.start(1), match.group(1).decode()
        if escape[3] in "89abAB" and _LOW_SURROGATE_ESCAPE.match(body, start + 6):
            paired_low = start + 6  # a high surrogate and its low one: one character
        elif start != paired_low:
            return (f"invalid \\u escape at byte {start}: {escape} is a lone surrogate (half of a UTF-16 pair "
                    "without its other half), which is no Unicode character")
    return message


def encode_json(obj: Any) -> bytes:
    return _encoder.encode(obj)


_F32 = np.dtype("<f4")


def _f32(array: np.ndarray) -> np.ndarray:
    """The array as contiguous little-endian float32 (no copy when it is already)."""
    return array if array.dtype == _F32 and array.flags.c_contiguous else np.ascontiguousarray(array, dtype=_F32)


def base64_string(array: np.ndarray) -> msgspec.Raw:
    """A float32 array's little-endian bytes as a JSON base64 string (OpenAI's `encoding_format:
    "base64"`), ready to sit in a msgspec-encoded body."""
    return msgspec.Raw(b'"' + b64encode(_f32(array)) + b'"')


def float_rows(array: np.ndarray) -> msgspec.Raw:
    """A float32 array (a vector, or rows of them) as JSON numbers, ready to sit in a msgspec-encoded body."""
    return msgspec.Raw(orjson.dumps(_f32(array), option=orjson.OPT_SERIALIZE_NUMPY))


class ItemParts(NamedTuple):
    """A JSON list's items written ahead as byte pieces, commas included: the response body is then one
    join. (A 150 KB answer copied once more -- into msgspec's buffer, or by `b"[" + ... + b"]"` -- costs
    ~10-90 us; buffers that size come from fresh pages.)"""

    parts: list[bytes]


def _item_heads(n: int, embedding_open: bytes) -> list[bytes]:
    """`{"object":"embedding","index":i,"embedding":` + `embedding_open` for i < n: written once for the
    usual batch sizes (formatting them per request cost ~3 us for 32 items)."""
    cached = _HEADS[embedding_open]
    if n > len(cached):
        return cached + [b'{"object":"embedding","index":%d,"embedding":%s' % (i, embedding_open)
                         for i in range(len(cached), n)]
    return cached[:n]


_HEADS = {opening: [b'{"object":"embedding","index":%d,"embedding":%s' % (i, opening) for i in range(1024)]
          for opening in (b'"', b"")}


def _encoded_rows(rows: list[np.ndarray], encode: Callable[[np.ndarray], bytes]) -> list[bytes]:
    if all([row.dtype is _F32 and row.flags.c_contiguous for row in rows]):  # (the pipeline's own rows)
        return list(map(encode, rows))
    return [encode(_f32(row)) for row in rows]


def _orjson_row(row: np.ndarray) -> bytes:
    return orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY)


def embedding_items(rows: list[np.ndarray], encoding_format: str) -> ItemParts:
    """OpenAI's `data` items, `{"object": "embedding", "index": i, "embedding": ...}`: each vector as the
    base64 of its float32 little-endian bytes, or as float32's shortest JSON numbers. (By hand, as slices
    of one list: a dict and a msgspec.Raw a row cost more than the 32 base64 strings themselves.)"""
    n = len(rows)
    if n == 0:
        return ItemParts([])
    parts: list = [None] * (3 * n)
    if encoding_format == "base64":
        parts[0::3] = _item_heads(n, b'"')
        parts[1::3] = _encoded_rows(rows, b64encode)
        parts[2::3] = [b'"},'] * n
        parts[-1] = b'"}'  # (no comma after the last item)
    else:
        parts[0::3] = _item_heads(n, b"")
        parts[1::3] = _encoded_rows(rows, _orjson_row)
        parts[2::3] = [b"},"] * n
        parts[-1] = b"}"
    return ItemParts(parts)


async def send_response(send: Send, status: int, body: bytes, content_type: bytes = JSON,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
