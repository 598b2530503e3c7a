"""pipeline-serve's HTTP/1.1 connection: httptools' C parser (llhttp, as uvicorn's) under a protocol
that hands each request to the `App` directly instead of through ASGI.

Why not uvicorn's protocol: on the simulated device its per-request Python -- the ASGI scope, the
request-response cycle, `receive` and `send` with their event dicts, a watcher task per request for
the disconnect -- cost ~25 us of CPU a request at full rate and ~2.5 times that when the loop wakes for
one request at a time, as a server's does (docs/benchmarks.md, "Serving"). uvicorn still runs the
server: the listening socket, the signals, the graceful shutdown, the Date header; its `http=` option
takes this class. `--http-protocol uvicorn` serves the same App through uvicorn's own protocol and ASGI.

What a connection does, in order:

- requests are answered in the order they came (HTTP/1.1 pipelining): one runs at a time; the next one
  read whole waits, and reading pauses while it does (bounded memory whatever the client sends);
- a request the App refuses from its head (no route, wrong method, no API key, a Content-Length over
  the body limit) is answered before its body is read, and the body is read and dropped, so that the
  connection stays usable and the client is not reset while it still sends; a chunked body that passes
  the limit is refused the same way once it does; a refusal that closes the connection (`Connection:
  close`, past `max_connections`) reads and drops the rest of its body before closing (nginx's lingering
  close: LINGER_S);
- a head (request line and headers) over MAX_HEAD_BYTES is a 431 and the connection is closed; bytes
  that are not HTTP are a 400 and the connection is closed;
- `Expect: 100-continue` gets its interim answer when the request is admitted, its declared body's
  bytes reserved in the server's budget first (a body the budget cannot hold is a 503 before the 100);
- a client that closes its connection has its request's task cancelled, which aborts its pipeline call
  by id;
- each connection has one clock (`_check_time`): one idle between requests for uvicorn's
  `timeout_keep_alive` is closed; a head must arrive whole within `timeout_header_s` of its first byte
  (of the connection's open for its first request) and a body must not stall for `timeout_body_s` nor
  average under `min_body_rate` bytes/s after its first `timeout_body_s`, else 408 and the connection is
  closed (nginx's client_header_timeout and client_body_timeout, Apache's MinRate); the clock starts
  again when an answer is written (a pipelined request's time waiting for its turn is not counted); a
  client that takes no byte of its answers for `timeout_send_s` is aborted, whatever the connection
  does, closing included (nginx's send_timeout): what it held -- a request read behind the answer, with
  its body's bytes, a place under `max_connections` -- goes with it;
- the bytes of bodies held, all connections together, are bounded (`Server.bodies`): a body that would
  pass the bound is a 503 and dropped as it comes; a request on a connection opened while
  `max_connections` were open is a 503 (uvicorn's limit_concurrency), the health checks and /metrics
  excepted;
- when uvicorn shuts down, an idle connection is closed at once and a busy one after its answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections import deque
from typing import NamedTuple

import httptools

from pooling_pipeline.serve.admission import BodiesFull, TooManyConnections
from pooling_pipeline.serve.app import App, Head, Response, health, metrics
from pooling_pipeline.serve.http import REASONS, BodyTooLarge, HTTPError

log = logging.getLogger("pipeline.serve")
access_log = logging.getLogger("pipeline.serve.access")

MAX_HEAD_BYTES = 64 << 10  # the request line and headers together (nginx's default large buffers: 4 x 8 KB)

_STATUS_LINES = {status: b"HTTP/1.1 %d %s\r\n" % (status, reason.encode()) for status, reason in
                 {200: "OK", 431: "Request Header Fields Too Large", **REASONS}.items()}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# A refusal that closes its connection while its body still arrives reads and drops the rest first: a
# socket closed with bytes unread is reset, and the reset overtakes the answer (http.client sending 4 MB
# past --max-connections got ECONNRESET, never its 503). At most LINGER_S after the answer and
# LINGER_READ_S (or --timeout-body, if shorter) between reads: nginx's lingering_time and lingering_timeout.
LINGER_S, LINGER_READ_S = 30.0, 5.0

# What a request on a connection opened past max_connections may still ask: a supervisor's checks.
_UNCAPPED = (health, metrics)

# What a connection's clock times: nothing started (between requests, or a new connection), a head
# being read, a body being read; and a connection closing, whose last answers the send clock bounds.
_IDLE, _HEAD, _BODY, _CLOSING = range(4)


class Exchange(NamedTuple):
    """A request read (or refused) and waiting for its turn on the connection."""

    head: Head
    headers: list[tuple[bytes, bytes]]
    body: bytes
    method: str
    keep_alive: bool
    started: float  # perf_counter at its head, for the latency histogram
    refused: Response | None = None  # answered without running a handler
    held: int = 0  # its body's bytes reserved in the server's BodyBudget, given back once it is answered


def protocol_factory(app: App, access_log: bool = False):
    """What uvicorn's `Config(http=...)` takes: a callable building one connection's protocol.
    `access_log`: a line per request on the `pipeline.serve.access` logger, as uvicorn's."""

    def create(config, server_state, app_state=None, _loop=None, **_ignored) -> HttpConnection:
        return HttpConnection(app, server_state, config.timeout_keep_alive, _loop, access_log)

    return create


class HttpConnection(asyncio.Protocol):
    def __init__(self, app: App, server_state, keep_alive_s: float, loop=None, access_log: bool = False) -> None:
        self.app = app
        self.state = server_state  # uvicorn's: its set of connections and tasks, its default headers
        self.keep_alive_s = keep_alive_s
        self.loop = loop or asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[Exchange] = deque()  # read whole, after the one running
        self.task: asyncio.Task | None = None  # the request being answered
        self.gone = False  # the client closed the connection
        self.closing = False  # answer what runs, then close (shutdown, Connection: close, a broken stream)
        self.write_paused = False
        self.access_log = access_log
        settings = app.server.settings
        self.header_s, self.body_s, self.min_body_rate, self.send_s = (
            settings.timeout_header_s, settings.timeout_body_s, settings.min_body_rate, settings.timeout_send_s)
        self.max_connections = settings.max_connections
        self.bodies = app.server.bodies  # the bytes of bodies held, all connections together
        self.held = 0  # of those, the bytes of the body being read
        self.over_limit = False  # opened while max_connections were: its request is a 503
        # The clock (one timer a connection, checked when it fires; see _check_time). It looks at least
        # every poll_s, so a phase begun since it was armed (each lasts at least poll_s) is never late.
        self.timer: asyncio.TimerHandle | None = None
        self.poll_s = min(keep_alive_s, self.header_s, self.body_s, self.send_s, LINGER_READ_S)
        self.phase = _IDLE
        self.phase_since = 0.0  # loop time the phase began (a new connection's first head: its open)
        self.first = True  # no request begun yet on this connection
        self.last_read = 0.0  # loop time of the last bytes read
        self.body_base = 0  # body bytes read before the body's clock (re)started
        self.lingering = False  # answered and closing: the refused body still arriving is read and dropped first
        # The send clock: bytes written, of those the bytes the client had taken when the clock last
        # looked, and the loop time it last saw the client take some (or nothing left to take).
        self.written = self.taken = 0
        self.sent_at = 0.0
        self._dated: tuple[list, bytes] = ([], b"")  # uvicorn's default headers (Date) and their bytes
        self.in_head = True  # between messages or inside a head
        # What arrives while a head or a chunked body's trailers are read counts toward MAX_HEAD_BYTES:
        # llhttp holds their pieces until each field ends, so the bound has to be on the bytes read.
        self.counting = True
        self.head_bytes = 0
        self.continue_owed = False  # an admitted `Expect: 100-continue` waits for the requests before it
        self._new_message()

    def _new_message(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []  # as llhttp gives them; cleaned at the end of the head
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.current: Head | None = None
        self.discarding = False  # the message was answered from its head: its body is dropped
        self.reserved = False  # its body's declared length is held in the budget already (Expect: 100-continue)
        self.expects = False  # it has an Expect field: refused, its body is not waited for (the client holds it back)

    # -- asyncio's callbacks --

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.over_limit = len(self.state.connections) >= self.max_connections
        self.state.connections.add(self)
        self.phase_since = self.last_read = self.sent_at = self.loop.time()
        self._arm(self.poll_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        self.gone = True
        self._drop_body()
        self._drop_waiting()  # (never started: nothing of theirs is in the pipeline)
        if self.task is not None:
            self.task.cancel()  # its pipeline call is aborted by id
        self.parser = None

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        if self.parser is None:  # (after a broken stream: the rest is not read)
            return
        if self.counting:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # (no protocol upgrades: the request was answered as plain HTTP; nothing after it is read)
            self._stop_reading()
            return
        except httptools.HttpParserCallbackError as e:  # (raised in one of this class's callbacks)
            cause = e.__context__
            if isinstance(cause, _Stopped):  # (a callback refused the stream: nothing after it is parsed)
                return
            self._stop_reading()
            if isinstance(cause, httptools.HttpParserInvalidURLError):
                self._refuse(self.app.head("", ""), 400, "the request target is not a valid URL")
            else:
                log.error("reading a request failed: this is a bug", exc_info=cause)
                self._refuse(self.current or self.app.head("", ""), 500, "internal error reading the request")
            return
        except httptools.HttpParserError as e:
            self._stop_reading()
            self._refuse(self.current or self.app.head("", ""), 400, f"the request is not valid HTTP/1.1: {e}")
            return
        if self.counting and self.head_bytes > MAX_HEAD_BYTES:
            self._refuse_large_head()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._next()

    def eof_received(self) -> bool | None:
        # Close (as uvicorn does): a client that closed its socket and one that only half-closed it look
        # the same here, and the first must have its request aborted. A half-closing client gets no answer.
        return None

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now if idle, else after the answer in progress."""
        self.closing = True
        self._drop_waiting()
        if self.task is None and (self.in_head or self.discarding):  # (not while a body is on its way)
            self._end()

    # -- httptools' callbacks --

    def on_message_begin(self) -> None:
        self._new_message()
        self.phase = _HEAD
        if self.first:  # (the first head's clock runs from the connection's open)
            self.first = False
        else:
            self.phase_since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            self.headers.append((name, value))
            return
        # A chunked body's trailers: nothing here reads them, but they are bounded as a head is (the
        # bytes read count too, for a field that never ends).
        self.trailer_bytes += len(name) + len(value) + 4
        if self.trailer_bytes > MAX_HEAD_BYTES:
            self._refuse_large_head()
            raise _Stopped()

    def on_chunk_header(self) -> None:
        self.counting, self.head_bytes = True, 0  # (the last chunk's header is followed by the trailers)

    def on_headers_complete(self) -> None:
        parser = self.parser
        started = time.perf_counter()
        self.in_head = self.counting = False
        self.trailer_bytes = 0
        method = parser.get_method().decode("ascii")
        if self.head_bytes > MAX_HEAD_BYTES and _head_size(self.url, self.headers) > MAX_HEAD_BYTES:
            # (head_bytes counts whole reads, which may run past the head: measured exactly only then)
            self._refuse_large_head()
            raise _Stopped()
        # Names lower-cased; llhttp keeps a value's trailing whitespace, which is not part of it (RFC 9110 5.5).
        headers = self.headers = [(name.lower(), value.rstrip(b" \t")) for name, value in self.headers]
        fields = dict(headers)  # (for the single-valued fields read here)
        # (an absolute-form target with no path, `http://host`, is the root: RFC 9112 3.2.2)
        path = (httptools.parse_url(self.url).path or b"/").decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        head = self.current = self.app.head(method, path)
        keep_alive = parser.should_keep_alive()
        if keep_alive and (b"connection" in fields or method == "CONNECT"):
            # No upgrades; HTTP/1.0 is answered once, as uvicorn does (its keep-alive would need a header
            # of its own). (Both need a Connection field, or CONNECT, to be asked for.)
            keep_alive = not parser.should_upgrade() and parser.get_http_version() != "1.0"
        expect = fields.get(b"expect")
        self.expects = expect is not None
        self.phase, self.phase_since, self.body_base = _BODY, self.loop.time(), 0
        try:
            if self.over_limit and (head.route is None or head.route.handler not in _UNCAPPED):
                keep_alive = False  # (the connection closes after its refusal: it is past the cap)
                raise TooManyConnections(self.max_connections)
            self.app.admit(head, method, path, headers)
            length = fields.get(b"content-length")
            if length is not None and int(length) > self.app.max_body_bytes:  # (llhttp checked the digits)
                raise BodyTooLarge(self.app.max_body_bytes)
            continuing = expect is not None and expect.lower() == b"100-continue" and parser.get_http_version() == "1.1"
            if continuing and length is not None:
                # The 100 asks for the body: its bytes are reserved first, so that a body the budget
                # cannot hold is refused before it is sent, not once it was (a chunked one: as it comes).
                if not self.bodies.take(int(length)):
                    raise BodiesFull(self.bodies.capacity)
                self.held, self.reserved = int(length), True
        except HTTPError as e:
            # A client that waits for 100 Continue may never send the body it announced: close after.
            self._dispatch(Exchange(head, headers, b"", method, keep_alive and expect is None, started,
                                    self.app.refusal(e, head.dialect)))
            self.discarding = True
            return
        self._started, self._method, self._keep_alive = started, method, keep_alive
        if continuing:
            if self.task is None and not self.waiting:
                self.transport.write(_CONTINUE)
                self.written += len(_CONTINUE)
            else:  # (written once the answers before it are: the 100 must not come between them)
                self.continue_owed = True

    def on_body(self, body: bytes) -> None:
        self.counting = False
        n = len(body)
        self.body_bytes += n  # (a dropped body's bytes too: its rate is timed as well)
        if self.discarding:
            return
        if self.body_bytes > self.app.max_body_bytes:  # (a chunked body: no length was declared)
            self._refuse_body(BodyTooLarge(self.app.max_body_bytes))
        elif self.reserved or self.bodies.take(n):
            self.held += 0 if self.reserved else n
            self.body.append(body)
        else:
            self._refuse_body(BodiesFull(self.bodies.capacity))

    def _refuse_body(self, error: HTTPError) -> None:
        """Answers the request whose body is being read now; the rest of the body is dropped as it comes."""
        self._drop_body()
        head = self.current
        self._dispatch(Exchange(head, self.headers, b"", self._method, self._keep_alive, self._started,
                                self.app.refusal(error, head.dialect)))

    def on_message_complete(self) -> None:
        self.in_head = self.counting = True
        self.head_bytes, self.continue_owed = 0, False
        self.phase = _IDLE  # (its clock starts once the answer is written: _answer)
        if self.discarding:
            # Answered already (from its head): the idle clock runs from the dropped body's end, not from the
            # answer -- a body longer in coming than keep_alive_s had its connection closed as idle at once.
            self.phase_since = self.loop.time()
            if self.lingering:  # (read to its end: the close resets nobody now; nothing after it is parsed)
                self._close()
                self.parser = None
                raise _Stopped()
            return
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []  # (the pieces go now, not at the next request: the body is held once while answered)
        held, self.held = self.held, 0  # (the exchange gives them back)
        self._dispatch(Exchange(self.current, self.headers, body, self._method, self._keep_alive, self._started,
                                held=held))

    # -- answering, one request at a time, in order --

    def _dispatch(self, exchange: Exchange) -> None:
        if self.task is None and not self.waiting and not self.write_paused:
            self._start(exchange)
        else:
            self.waiting.append(exchange)
            self.transport.pause_reading()  # (one read ahead at most: memory stays bounded)

    def _start(self, exchange: Exchange) -> None:
        # (in uvicorn's set of tasks, which its shutdown waits for; _answer takes itself out)
        self.task = self.loop.create_task(self._answer(exchange))
        self.state.tasks.add(self.task)

    async def _answer(self, exchange: Exchange) -> None:
        try:
            response = exchange.refused
            if response is None:
                try:
                    response = await self.app.respond(exchange.head, exchange.headers, exchange.body)
                except asyncio.CancelledError:
                    # The client's leaving, when nothing else (the server's shutdown timeout) cancelled too.
                    # (Python 3.10's tasks keep no count of cancellations: there the client's is taken.)
                    uncancel = getattr(asyncio.current_task(), "uncancel", None)
                    if not self.gone or (uncancel is not None and uncancel() > 0):
                        raise
                    self.app.client_left(exchange.head, exchange.started)
                    return
            if not self.gone:
                self._write(response, exchange)
            self.app.answered(exchange.head, response.status, exchange.started)
            if self.access_log:
                self._log_access(exchange, response.status)
        except Exception:  # (a bug: the connection is closed rather than left waiting)
            log.exception("internal error answering %s %s", exchange.method, exchange.head.label)
            if self.transport is not None:
                self.closing = True  # (closed by _next, below)
        finally:
            self.state.tasks.discard(self.task)
            self.task = None
            self.state.total_requests += 1
            if not self.gone:
                # The clock starts now: for the idle time after the answer, or for a head or body read
                # behind it, whose time waiting for its turn is not counted against it.
                self.phase_since = self.last_read = self.loop.time()
                self.body_base = self.body_bytes
                self._next()
            if exchange.held:  # (last: a broken count raises, loudly, with the connection already moving on)
                self.bodies.give_back(exchange.held)

    def _next(self) -> None:
        if self.task is not None or self.gone:
            return
        if self.closing:
            self._end()
            return
        if self.waiting:
            if not self.write_paused:
                self._start(self.waiting.popleft())
                if not self.waiting and self.parser is not None:
                    self.transport.resume_reading()
            return
        if self.continue_owed:
            self.continue_owed = False
            self.transport.write(_CONTINUE)
            self.written += len(_CONTINUE)

    def _write(self, response: Response, exchange: Exchange) -> None:
        dated, date_bytes = self._dated
        if self.state.default_headers is not dated:  # (uvicorn renews the Date header once a second)
            dated = self.state.default_headers
            date_bytes = b"".join([b"%s: %s\r\n" % pair for pair in dated])
            self._dated = (dated, date_bytes)
        body = response.body
        lines = [_STATUS_LINES.get(response.status) or b"HTTP/1.1 %d \r\n" % response.status, date_bytes,
                 b"content-type: %s\r\ncontent-length: %d\r\n" % (response.content_type, len(body))]
        for name, value in response.headers:
            lines.append(b"%s: %s\r\n" % (name, value))
        if not exchange.keep_alive or self.closing:  # (closing: the server is shutting down)
            self.closing = True
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        if exchange.method == "HEAD" or not body:
            self.transport.write(head)
            self.written += len(head)
        else:  # (one writev: the body is not copied into a joined buffer)
            self.transport.writelines([head, body])
            self.written += len(head) + len(body)

    def _log_access(self, exchange: Exchange, status: int) -> None:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "-"
        access_log.info('%s - "%s %s HTTP/1.1" %d', client, exchange.method, exchange.head.label, status)

    # -- refusals that end the stream --

    def _refuse(self, head: Head, status: int, message: str) -> None:
        """A head that cannot be read on: answered (after what runs) and the connection closed."""
        self._drop_body()
        self._dispatch(Exchange(head, [], b"", "GET", False, time.perf_counter(),
                                self.app.refusal(HTTPError(status, message), head.dialect)))

    def _refuse_large_head(self) -> None:
        self._stop_reading()
        self._refuse(self.app.head("", ""), 431,
                     f"the request line and headers are larger than this server's {MAX_HEAD_BYTES} bytes")

    def _stop_reading(self) -> None:
        self.parser = None
        self.transport.pause_reading()

    def _drop_body(self) -> None:
        """The body being read is not kept (refused, timed out, or its client gone): its bytes go back."""
        self.discarding = True
        self.body.clear()
        if self.held:
            self.bodies.give_back(self.held)
            self.held = 0

    def _drop_waiting(self) -> None:
        for exchange in self.waiting:
            if exchange.held:
                self.bodies.give_back(exchange.held)
        self.waiting.clear()

    # -- the connection's clock: one timer a connection, not one a request --

    def _arm(self, delay: float) -> None:
        self.timer = self.loop.call_later(delay, self._check_time)

    def _check_time(self) -> None:
        """Aborts a connection whose client takes none of its answers for `send_s` (_send_stalled), closes
        one idle for `keep_alive_s`, answers 408 to one whose head or body is late (_deadline), and looks
        again when it could be (at least every poll_s) until the connection is gone."""
        self.timer = None
        if self.gone:
            return
        now = self.loop.time()
        if self._send_stalled(now):
            # nginx's send_timeout. Without it such a client kept the connection for ever -- a close waits
            # for the answer to be taken, a request read behind it waits for room to write -- with that
            # request's body bytes and its place under max_connections. connection_lost gives them back.
            self.transport.abort()
            return
        left = self.poll_s  # (answering or closing: the read clocks start again after an answer, in _answer)
        if self.phase != _CLOSING and self.task is None and not self.waiting:
            left = self._deadline() - now
            if left <= 0:
                self._time_out()
                left = self.poll_s
        self._arm(min(left, self.poll_s))

    def _send_stalled(self, now: float) -> bool:
        """True once the client has taken no byte of what was written for `send_s` (a look at the
        transport's buffer, each time the clock looks: nothing per write but a count)."""
        unsent = self.transport.get_write_buffer_size()
        taken = self.written - unsent
        if unsent == 0 or taken != self.taken:
            self.taken, self.sent_at = taken, now
            return False
        return now - self.sent_at >= self.send_s

    def _deadline(self) -> float:
        if self.lingering:  # (answered: the refused body's rest gets a bound of its own)
            return min(self.last_read + min(LINGER_READ_S, self.body_s), self.phase_since + LINGER_S)
        if self.phase == _IDLE:  # (a new connection that sends nothing: the head's bound, if shorter)
            return self.phase_since + (min(self.keep_alive_s, self.header_s) if self.first else self.keep_alive_s)
        if self.phase == _HEAD:
            return self.phase_since + self.header_s
        # A body: no byte for body_s, or under min_body_rate bytes/s on average after its first body_s.
        rate_bound = self.phase_since + self.body_s + (self.body_bytes - self.body_base) / self.min_body_rate
        return min(self.last_read + self.body_s, rate_bound)

    def _time_out(self) -> None:
        if self.phase == _IDLE or self.discarding or self.parser is None:
            # Nothing begun, or its answer given already (refused from its head): closed without one.
            self._close()
            return
        late = "request line and headers" if self.phase == _HEAD else "body"
        bound = (f"{self.header_s:g} s (--timeout-header)" if self.phase == _HEAD else
                 f"{self.body_s:g} s without a byte, or under {self.min_body_rate} bytes/s "
                 "(--timeout-body, --min-body-rate)")
        head = self.current if self.phase == _BODY else self.app.head("", "")
        self.phase, self.phase_since = _CLOSING, self.loop.time()
        # Nothing more is parsed, but what still comes is read and dropped: a socket closed with unread
        # bytes is reset, and a reset can overtake the 408 on its way.
        self.parser = None
        self._refuse(head, 408, f"the request's {late} did not arrive in time: this server waits {bound}")

    # -- the end of a connection --

    def _end(self) -> None:
        """Closes the connection, once the rest of a refused body still arriving is read and dropped
        (lingering: LINGER_S says why; on_message_complete closes at its end, _deadline bounds it)."""
        if self.discarding and not self.in_head and not self.expects and self.parser is not None:
            if not self.lingering:  # (its bounds run from the first call: _next comes again on resume_writing)
                self.lingering = True
                self.phase_since = self.last_read = self.loop.time()
        else:
            self._close()

    def _close(self) -> None:
        """Closes once what was written is taken; the clock runs on, to abort a client that does not take
        it (_check_time)."""
        self.phase, self.lingering = _CLOSING, False
        self.transport.close()


class _Stopped(Exception):
    """Raised in a parser callback once the stream was refused: llhttp stops there, rather than parse
    what follows with no parser state to put it in."""


def _head_size(url: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """The head's bytes on the wire, near enough: the target, and each field with its ": " and CRLF."""
    return len(url) + sum([len(name) + len(value) + 4 for name, value in headers])
