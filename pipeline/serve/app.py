"""The application: routing, authentication, the body bound, disconnect-abort, the mapping of the
pipeline's exceptions to status codes, and the metrics every request feeds. pipeline-serve's own HTTP
protocol (protocol.py) calls its parts directly; `App.__call__` is the same app as an ASGI callable.

A route is a `Route` (method, path, handler, dialect); each dialect's module lists its own
(`openai_routes.ROUTES`, `tei_routes.ROUTES`, `rerank_routes.ROUTES`). A handler is
`async def handler(request: Request) -> Response` and raises `HTTPError` for what it refuses; a
`ValueError` / `TypeError` from the Pipeline (bad input, naming the request) becomes that dialect's
4xx. While a handler runs, the client's connection is watched: a client that leaves has its handler
cancelled, which aborts its pipeline call by id (the engine drops what it has not run).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NamedTuple

import msgspec

from pooling_pipeline.core.shared.options import TOO_LONG_MARK
from pooling_pipeline.errors import EngineDeadError, PipelineError, StepError
from pooling_pipeline.serve.admission import Admission, BodyBudget
from pooling_pipeline.serve.http import (
    ClientGone,
    HTTPError,
    ItemParts,
    decode_json,
    encode_json,
    error_body,
    header,
    read_body,
    send_response,
)
from pooling_pipeline.serve.metrics import Metrics

log = logging.getLogger("pipeline.serve")


class ServeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the operator chose for the HTTP side (the pipeline's own options are `PipelineOptions`)."""

    served_model_names: tuple[str, ...]  # what `model` may say in a request; the first is the one listed
    api_key: str | None = None  # Bearer token every route but /health asks for
    max_body_bytes: int = 64 << 20  # a larger body is a 413 before it is read whole
    max_client_batch_size: int = 2048  # inputs in one request (TEI's --max-client-batch-size; OpenAI takes 2,048)
    max_queue_wait_s: float = 10.0  # how long a request waits for room in the window before its 429
    auto_truncate: bool = False  # truncate over-long inputs where the request does not say (TEI's --auto-truncate)
    allowed_local_media_path: str | None = None  # a directory image inputs may name files in (vLLM's flag)
    rerank_dialect: Literal["vllm", "infinity"] = "vllm"  # POST /rerank's answer to a `documents` body
    # What one connection may hold, and for how long (pipeline-serve's own protocol; docs/serving.md):
    timeout_header_s: float = 60.0  # a request's head must arrive within this of its first byte (nginx's)
    timeout_body_s: float = 60.0  # a body with no byte for this long is a 408 (nginx's client_body_timeout)
    min_body_rate: int = 16 << 10  # bytes/s a body must average after its first timeout_body_s (Apache's MinRate)
    timeout_send_s: float = 60.0  # a client that takes no byte of its answers for this long is aborted (nginx's send_timeout)
    max_connections: int = 1024  # a request on a connection opened past this many is a 503 (uvicorn's limit)
    max_held_body_bytes: int = 256 << 20  # request bodies held at once, all connections together; past it a 503


class Response(NamedTuple):
    body: bytes
    status: int = 200
    content_type: bytes = b"application/json"
    headers: list[tuple[bytes, bytes]] = []


class Request:
    """One HTTP request as a handler sees it: its headers (names lower-cased), its body, what every
    handler shares (`server`), and the path's last segment where its route ends in `{name}` (`param`)."""

    __slots__ = ("headers", "body", "server", "dialect", "param")

    def __init__(self, headers: list[tuple[bytes, bytes]], body: bytes, server: Server, dialect: str,
                 param: str | None = None) -> None:
        self.headers, self.body, self.server, self.dialect, self.param = headers, body, server, dialect, param

    def json(self, type_: Any) -> Any:
        return decode_json(self.body, type_, self.dialect)


Handler = Callable[[Request], Awaitable[Response]]

# Response ids: this process's random prefix and a counter -- unique as uuid4's, at a tenth of its cost.
_ID_PREFIX = uuid.uuid4().hex[:16]
_id_counter = itertools.count()


def response_id(kind: str) -> str:
    """A response's `id`, as vLLM names them ("embd-...", "score-...")."""
    return f"{kind}-{_ID_PREFIX}{next(_id_counter):016x}"


def usage(tokens: int) -> dict:
    """vLLM's UsageInfo as its responses dump it."""
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def list_response(kind: str, model: str, data: list | ItemParts, tokens: int) -> Response:
    """vLLM's list envelope (embeddings, score, classify, pooling): id, object, created, model, data, usage.
    `data`: the items, or their JSON written ahead (`ItemParts`), which the body is joined around."""
    if isinstance(data, ItemParts):  # (the same bytes msgspec writes for the dict below, by hand)
        parts = [b'{"id":"%s","object":"list","created":%d,"model":%s,"data":['
                 % (response_id(kind).encode(), int(time.time()), encode_json(model))]
        parts += data.parts
        parts.append(b'],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":0,'
                     b'"prompt_tokens_details":null}}' % (tokens, tokens))
        return Response(b"".join(parts))
    return Response(encode_json({"id": response_id(kind), "object": "list", "created": int(time.time()),
                                 "model": model, "data": data, "usage": usage(tokens)}))


class Route(NamedTuple):
    method: str
    path: str  # exact, or ending in "/{name}": the rest of the path, slashes too, is the handler's `param`
    handler: Handler
    dialect: str  # "openai" (vLLM's error body) or "tei"
    inference: bool = True  # runs the model: its latencies feed the histogram (/health, /metrics, /info do not)


class Server:
    """What every handler shares: the pipeline, the operator's settings, the admission bound and the
    metrics. `pipe` is a started `Pipeline`; the server never closes it (its owner does)."""

    def __init__(self, pipe, settings: ServeSettings) -> None:
        self.pipe = pipe
        self.settings = settings
        self.spec = pipe.model_spec
        self.admission = Admission(pipe.max_inflight, settings.max_queue_wait_s)
        if settings.max_held_body_bytes < settings.max_body_bytes:
            raise ValueError(f"max_held_body_bytes={settings.max_held_body_bytes} is less than max_body_bytes="
                             f"{settings.max_body_bytes}: a body of the largest size could never be read")
        self.bodies = BodyBudget(settings.max_held_body_bytes)
        self.metrics = Metrics()
        self.started = time.time()

    def check_model(self, model: str | None) -> None:
        """vLLM's rule: a request naming a model this server does not serve is a 404."""
        if model is not None and model not in self.settings.served_model_names:
            raise HTTPError(404, f"The model `{model}` does not exist.")

    def model_name(self, requested: str | None) -> str:
        """The `model` a response names: the request's (checked by check_model), else the first served name."""
        return requested or self.settings.served_model_names[0]

    def check_batch(self, n: int, what: str = "inputs") -> None:
        if n == 0:
            raise HTTPError(400, f"{what} cannot be empty")
        if n > self.settings.max_client_batch_size:
            raise HTTPError(413, f"batch size {n} > maximum allowed batch size "
                                 f"{self.settings.max_client_batch_size} (--max-client-batch-size)")

    async def run(self, n: int, call: Awaitable, client_inputs: int | None = None) -> Any:
        """Awaits a pipeline call of `n` requests once the window has room for them (or 429).
        `client_inputs`: what the client sent, checked against --max-client-batch-size (default `n`;
        a rerank of an embedding model sends its query too). A call larger than the window (OpenAI's
        2,048 inputs in a window of 1,024) takes the whole window: the pipeline feeds its requests
        through its own window of that size, so no more than that are in flight either way."""
        slots = min(n, self.admission.capacity)
        try:
            self.check_batch(n if client_inputs is None else client_inputs)
            if not self.admission.try_acquire(slots):
                await self.admission.acquire(slots)
        except BaseException:
            call.close()  # (the coroutine never started)
            raise
        try:
            return await call
        finally:
            self.admission.release(slots)
            self.metrics.inputs += n

    def count_tokens(self, outs) -> int:
        tokens = sum([out.num_prompt_tokens for out in outs])  # (every output type has it: an int)
        self.metrics.prompt_tokens += tokens
        return tokens

    def healthy(self) -> bool:
        return self.pipe.healthy()

    def gauges(self) -> dict[str, tuple[str, float]]:
        whole = self.pipe.stats() if self.healthy() else {}
        stats, engines = whole.get("group", {}), whole.get("engine_cores", [])
        return {
            "pipeline_healthy": ("1 when the process group is serving.", float(self.healthy())),
            "pipeline_queue_waiting_requests": ("HTTP requests waiting for room in the window.",
                                                float(self.admission.waiting)),
            "pipeline_inputs_in_flight": ("Inputs admitted and not yet answered.", float(self.admission.inflight)),
            "pipeline_requests_rejected_total": ("Requests answered 429 (no room in time).",
                                                 float(self.admission.rejected)),
            "pipeline_request_body_bytes_held": ("Bytes of request bodies read or being answered (--max-held-body-bytes).",
                                                 float(self.bodies.held)),
            "pipeline_group_inflight": ("Requests issued to the workers and engines, not yet handed back.",
                                        float(stats.get("inflight", 0))),
            "pipeline_worker_restarts_total": ("Render workers replaced after a crash.",
                                               float(stats.get("worker_restarts", 0))),
            "pipeline_engine_restarts_total": ("Engine cores restarted after a crash or a hang.",
                                               float(stats.get("engine_restarts", 0))),
            "pipeline_engine_busy_seconds_total": ("Seconds the engine cores spent in steps (their rate: engine busy).",
                                                   sum(float(e.get("busy_total_s", 0.0)) for e in engines)),
            "pipeline_engine_aborted_requests_total": ("Requests the engine cores dropped on an abort.",
                                                       sum(float(e.get("aborted_requests", 0.0)) for e in engines)),
        }


class Head(NamedTuple):
    """What a request's method and path name: its route (None: no such route or method), the dialect of
    its errors, its label in the metrics and whether its latency is timed."""

    route: Route | None
    dialect: str
    label: str  # the route's path ("/v1/models/{model}" for every model: a bounded set of labels)
    timed: bool
    param: str | None = None  # what a route ending in "/{name}" matched


class App:
    """The ASGI callable: `App(server, routes)`. pipeline-serve's own HTTP protocol (protocol.py) calls
    its parts directly -- `head`, `admit`, `respond`, `refusal`, `answered`, `client_left` -- and the
    ASGI entry (`__call__`, for uvicorn's protocol or any ASGI server) is built from the same parts."""

    def __init__(self, server: Server, routes: list[Route]) -> None:
        self.server = server
        self.routes: dict[str, dict[str, Route]] = {}
        self.templates: dict[str, str] = {}  # a route ending in "/{name}": its path up to the "{" -> its path
        for route in routes:
            if route.method in self.routes.get(route.path, {}):
                raise RuntimeError(f"two handlers for {route.method} {route.path}: this is a bug")
            self.routes.setdefault(route.path, {})[route.method] = route
            if route.path.endswith("}"):
                self.templates[route.path[: route.path.index("{")]] = route.path
        key = server.settings.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self.max_body_bytes = server.settings.max_body_bytes

    # -- the parts --

    def head(self, method: str, path: str) -> Head:
        by_method, label, param = self.routes.get(path), path, None
        if by_method is None:
            for prefix, template in self.templates.items():
                if path.startswith(prefix) and len(path) > len(prefix):
                    by_method, label, param = self.routes[template], template, path[len(prefix):]
                    break
        route = by_method.get(method) if by_method else None
        if route is None:
            return Head(None, "openai", label if by_method else "unmatched", False)
        return Head(route, route.dialect, label, route.inference, param)

    def admit(self, head: Head, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        """Raises the HTTPError that refuses a request before its body is read: no route (404), a method
        the path does not take (405), a missing or wrong API key (401)."""
        if head.route is None:
            by_method = self.routes.get(path) or self.routes.get(head.label)
            if by_method is None:
                raise HTTPError(404, f"no route {path}")
            raise HTTPError(405, f"{method} is not allowed on {path}; use {', '.join(by_method)}")
        if self._expected is not None and head.route.handler is not health:  # (health checks need no key)
            given = header(headers, b"authorization") or b""
            if not hmac.compare_digest(given, self._expected):  # constant time: no prefix leaks by timing
                raise HTTPError(401, "Unauthorized: a valid 'Authorization: Bearer <api key>' header is required",
                                headers=[(b"www-authenticate", b"Bearer")])

    async def respond(self, head: Head, headers: list[tuple[bytes, bytes]], body: bytes) -> Response:
        """An admitted request's answer; what its handler raises becomes the dialect's error response.
        (Cancellation -- the client left, the server stops -- is the caller's to handle.)"""
        try:
            return await head.route.handler(Request(headers, body, self.server, head.dialect, head.param))
        except Exception as e:
            return self.refusal(e, head.dialect)

    def refusal(self, e: Exception, dialect: str) -> Response:
        """The error response for `e`, counted by kind."""
        status, message, headers = self._failure(e, dialect)
        self.server.metrics.errors[_error_kind(status)] += 1
        return Response(error_body(dialect, status, message), status, headers=headers)

    def answered(self, head: Head, status: int, started: float) -> None:
        self.server.metrics.observe(head.label, status, time.perf_counter() - started, head.timed)

    def client_left(self, head: Head, started: float) -> None:
        self.server.metrics.disconnects += 1
        self.answered(head, 499, started)  # (nginx's "client closed request")

    # -- ASGI --

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # (no websockets)
        started = time.perf_counter()
        method, path, headers = scope["method"], scope["path"], scope["headers"]
        head = self.head(method, path)
        try:
            self.admit(head, method, path, headers)
            body = await read_body(headers, receive, self.max_body_bytes)
            response = await self._watched(head, headers, body, receive)
        except ClientGone:
            self.client_left(head, started)
            return
        except Exception as e:
            response = self.refusal(e, head.dialect)
        await send_response(send, response.status, response.body, response.content_type, response.headers)
        self.answered(head, response.status, started)

    async def _watched(self, head: Head, headers: list, body: bytes, receive) -> Response:
        """Runs the handler while a watcher task waits on the connection: a client that leaves has
        this task cancelled (its pipeline call is aborted by id) and ClientGone is raised. (One
        watcher task and the handler inline: a second task and `asyncio.wait` cost ~10 us a request.)"""
        task = asyncio.current_task()
        left: list[bool] = []
        watch = asyncio.ensure_future(_cancel_when_gone(receive, task, left))
        try:
            return await self.respond(head, headers, body)
        except asyncio.CancelledError:
            # Ours only when the client left and nothing else (the server stopping) cancelled too.
            # (Python 3.10's tasks keep no count of cancellations: there the client's is taken.)
            uncancel = getattr(task, "uncancel", None)
            if not left or (uncancel is not None and uncancel() > 0):
                raise
            raise ClientGone() from None
        finally:
            watch.cancel()

    def _failure(self, e: Exception, dialect: str) -> tuple[int, str, list]:
        if isinstance(e, HTTPError):
            return e.status, e.message, e.headers
        if isinstance(e, (ValueError, TypeError)):  # the caller's input, named by the pipeline
            message = str(e)
            too_long = TOO_LONG_MARK in message
            return (413 if too_long and dialect == "tei" else 400), message, []
        if isinstance(e, StepError):
            return (424 if dialect == "tei" else 500), f"the model failed on this request: {e}", []
        if isinstance(e, (EngineDeadError, PipelineError)):
            return 503, f"the model is not available: {e}", []
        log.exception("internal error")
        return 500, f"internal error: {type(e).__name__}: {e}", []


def _error_kind(status: int) -> str:
    return {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 408: "timeout",
            413: "too_large", 422: "invalid", 424: "model", 429: "overloaded", 501: "not_implemented",
            503: "unavailable"}.get(status, "internal")


async def _cancel_when_gone(receive, task: asyncio.Task, left: list[bool]) -> None:
    """Waits for the client's disconnect (the body was read whole: nothing else comes) and then
    cancels the request's task, noting in `left` that the cancellation is the client's."""
    while (await receive())["type"] != "http.disconnect":
        pass
    left.append(True)
    task.cancel()


async def _lifespan(receive, send) -> None:
    """The pipeline is started before the server binds and closed after it stops (cli.py): nothing to do."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def health(request: Request) -> Response:
    if not request.server.healthy():
        raise HTTPError(503, "the process group is not serving")
    return Response(b"", content_type=b"text/plain")


async def metrics(request: Request) -> Response:
    server = request.server
    text = server.metrics.render(server.gauges())
    return Response(text.encode(), content_type=b"text/plain; version=0.0.4; charset=utf-8")


# TEI answers its health check on / (the Inference API's) and /ping (SageMaker's) too.
ROUTES = [Route("GET", "/health", health, "tei", inference=False),
          Route("GET", "/", health, "tei", inference=False),
          Route("GET", "/ping", health, "tei", inference=False),
          Route("GET", "/metrics", metrics, "tei", inference=False)]
__all__ = ["App", "Head", "Route", "Request", "Response", "Server", "ServeSettings", "ROUTES", "encode_json", "list_response",
           "response_id", "usage"]
