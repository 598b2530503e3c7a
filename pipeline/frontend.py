"""The frontend: calls from any number of threads (or coroutines) over one process group.

`Dispatcher` (one per group) is what the calls share:

* one receiver thread, the only reader of the results socket: it decodes each message and routes
  it to its call by the call's id prefix (every external id is `<call prefix><index>`; a message
  that belongs to one call -- always so while one call runs -- goes to it whole, without looking
  at its requests), and it watches the group: heartbeats, the engine, dead render workers
  (restarted with back-off; every call re-sends what the lost worker held);
* the in-flight bound: at most `max_inflight` requests issued and not yet handed to their caller,
  over all calls together, shared fairly among the calls still reading input; and the text held
  for them (kept for re-sending) bounded too;
* least-loaded dispatch to the render workers that are up (a restarting worker gets nothing),
  and with data-parallel engine cores, to the engine core with the fewest requests in flight
  (named in each RenderBatch; the call's in-flight entry records it, and an answer or failure
  settles it).

A `Call` is one embed/encode/... call. It pulls RenderParams lazily from its request generator,
sends them in small batches, and hands results back in input order (the reorder buffer counts
against the bound, so memory stays bounded however long the input is). It is driven by `pump()`
in the caller's thread -- by a plain generator (`outputs`) or an async one (`aoutputs`, which
awaits the receiver's wake-ups on its event loop). A failure, a stop by the caller (generator
closed or collected, KeyboardInterrupt, task cancelled) or a bad input found on the way aborts
that call's requests by external id and returns its slots; no other call is touched.

Lock discipline: `Dispatcher.lock` guards the shared counters and the registry; the group's
`send_lock` guards its sockets. A call that ends abnormally never takes a lock (it may be ended by
the garbage collector in any thread, at any point): it queues itself and the receiver thread
settles it (`_flush_retired`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator

import numpy as np
import zmq

from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.core import messages as m
from pooling_pipeline.core.vectors import finish_embeddings
from pooling_pipeline.errors import EngineDeadError, PipelineError, StepError
from pooling_pipeline.inputs import CallOptions, FailedRequest, token_id_errors
from pooling_pipeline.outputs import OUTPUT_TYPES, PoolingRequestOutput
from pooling_pipeline.process_group import ProcessGroup

log = logging.getLogger("pipeline")

RECEIVE_POLL_MS = 100  # the receiver thread's longest sleep (the RunClock ticks at least this often)
MAX_MESSAGES_PER_TURN = 256  # then health checks and retired calls get their turn
HEALTH_CHECK_INTERVAL_S = 0.5
CALL_WAIT_S = 0.5  # a call re-checks the dispatcher at least this often while it waits
# Besides the request count, the text held for requests in flight is bounded (kept for re-sending
# if a worker dies): a window of 100 MB web pages must not hold gigabytes.
MAX_INFLIGHT_CHARS = 64 * 1024 * 1024
# External ids: a random call prefix (unguessable: 64 bits) then the request's index.
PREFIX_LEN = 17
# A call holds back a partial message while this many full messages' worth of its requests are in
# flight (the pipeline stays fed) and waits for slots to fill a whole one.
FULL_BATCH_WAIT_MIN_MESSAGES = 4


def new_call_prefix() -> str:
    return secrets.token_hex(8) + "-"


def request_size(request: m.RenderParams) -> int:
    """Roughly the characters (or token ids) held for a request."""
    prompt = request.prompt
    if prompt and request.pair is None:  # the usual case, first
        return len(prompt)
    size = len(prompt or "") + len(request.pair or "")
    if request.token_ids is not None:
        size += request.token_ids.size
    if request.conversation is not None:
        size += sum(len(turn["content"]) for turn in request.conversation)
    return max(size, 1)


class ChunkSum:
    """Chunk mode: a document's chunk vectors pooled back into one (token-weighted mean)."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self.seen: set[int] = set()
        self.total: np.ndarray | None = None
        self.tokens = 0

    def add(self, chunk: int, vector: np.ndarray, num_tokens: int) -> bool:
        """Adds a chunk; False for a duplicate (a re-sent request's chunk seen before)."""
        if chunk in self.seen:
            return False
        self.seen.add(chunk)
        weighted = vector.astype(np.float64) * num_tokens
        self.total = weighted if self.total is None else self.total + weighted
        self.tokens += num_tokens
        return True

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.num_chunks

    def finish(self, params: m.PoolingParams, default_normalize: bool) -> np.ndarray:
        """The document's vector: the chunks' token-weighted mean, finished as the call asked."""
        mean = (self.total / max(self.tokens, 1)).astype(np.float32)
        normalize = params.normalize if params.normalize is not None else default_normalize
        return finish_embeddings(mean, params.dimensions, normalize)


class LostWorker:
    """To every call: worker `index` lost its process; requests sent to it up to generation `gen`
    are gone and must be re-sent."""

    __slots__ = ("index", "gen")

    def __init__(self, index: int, gen: int) -> None:
        self.index, self.gen = index, gen


class Dispatcher:
    """What the calls of one process group share (see the module docstring)."""

    def __init__(self, group: ProcessGroup, *, max_inflight: int, batch_items: int) -> None:
        self.group = group
        self.max_inflight = max_inflight
        self.batch_items = batch_items
        self.lock = threading.Lock()
        self.calls: dict[str, Call] = {}  # prefix -> running call (under lock)
        self.routes: dict[str, Call] = {}  # a copy of `calls` for the receiver, replaced (never changed) under lock
        self.drawing: set[Call] = set()  # calls still reading their input: they share the free slots
        self.free = max_inflight  # slots not held by any call
        self.chars = 0  # text held for requests sent and not yet answered, all calls
        self.waiters: set[Call] = set()  # calls that found no slot, text budget or worker
        num_workers = len(group.workers)
        self.outstanding = [0] * num_workers  # requests per worker not yet answered
        self.num_engines = group.num_engines
        self.engine_outstanding = [0] * self.num_engines  # requests per engine core not yet answered
        self.requests_per_engine = [0] * self.num_engines  # requests sent to each engine core (group-wide)
        self.failure: BaseException | None = None  # set once the group cannot serve: every call raises it
        self.retiring: deque[tuple] = deque()  # calls ended abnormally, settled by the receiver thread
        # Group-wide counters (stats()["group"]).
        self.peak_inflight = 0
        self.stray_outputs = 0  # outputs of no running call (aborted or ended calls), dropped
        self.retried_sends = 0  # batches a worker could not take (gone); sent again elsewhere
        self.batches_per_worker = [0] * num_workers
        self.calls_started = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="pipeline-receiver", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # ---- the receiver thread --------------------------------------------------------------

    def _run(self) -> None:
        group = self.group
        poller = zmq.Poller()
        poller.register(group.results, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_health = 0.0
        try:
            while not self._stopping:
                events = dict(poller.poll(RECEIVE_POLL_MS))
                group.clock.tick()
                if self._wake_r in events:
                    self._drain_wake_pipe()
                if group.results in events:
                    results = group.results
                    for turn in range(MAX_MESSAGES_PER_TURN):
                        if turn and not results.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break  # (cheaper than a recv that raises zmq.Again)
                        msg = group.recv(zmq.NOBLOCK)
                        if msg is not None:
                            self._route(msg)
                if self.retiring:
                    self._flush_retired()
                if time.monotonic() >= next_health and not self._stopping:
                    next_health = time.monotonic() + HEALTH_CHECK_INTERVAL_S
                    self._check_health()
        except EngineDeadError as e:
            self._fail(e)
        except BaseException as e:  # a bug: say so in every call rather than leave them waiting
            if not self._stopping:
                log.exception("the frontend's receiver thread failed")
                self._fail(PipelineError(f"the frontend's receiver thread failed: {type(e).__name__}: {e}"))

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def wake_receiver(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def _route(self, msg) -> None:
        kind = type(msg)
        if kind is m.Heartbeat:
            return
        if kind is m.Ready:
            if msg.role == "worker":  # a restarted worker: calls with work held back can send it now
                self._wake_all()
            return
        calls = self.routes
        if kind is m.OutputBatch:
            ids = msg.request_ids
            if len(calls) == 1:  # one call running: the message is its (it drops strays by id)
                for call in calls.values():
                    call.deliver(msg)
                return
            prefixes = [rid[:PREFIX_LEN] for rid in ids]
            first = prefixes[0] if prefixes else ""
            if prefixes.count(first) == len(prefixes):
                call = calls.get(first)
                if call is None:
                    self.stray_outputs += len(ids)
                else:
                    call.deliver(msg)
                return
            parts: dict[str, list[int]] = {}
            for position, prefix in enumerate(prefixes):
                parts.setdefault(prefix, []).append(position)
            for prefix, positions in parts.items():
                call = calls.get(prefix)
                if call is None:
                    self.stray_outputs += len(positions)
                    continue
                call.deliver(msg.select(positions, len(positions) / len(ids)))  # the step's cost, split by requests
            return
        # RenderFailed / StepFailed: a few ids; each goes to its call.
        per_call: dict[str, list[int]] = {}
        for i, rid in enumerate(msg.request_ids):
            per_call.setdefault(rid[:PREFIX_LEN], []).append(i)
        for prefix, positions in per_call.items():
            call = calls.get(prefix)
            if call is None:
                continue
            if len(positions) == len(msg.request_ids):
                call.deliver(msg)
            elif kind is m.RenderFailed:
                call.deliver(m.RenderFailed([msg.request_ids[i] for i in positions], [msg.indices[i] for i in positions],
                                            [msg.errors[i] for i in positions]))
            else:
                call.deliver(m.StepFailed([msg.request_ids[i] for i in positions], [msg.indices[i] for i in positions],
                                          msg.error))

    def _check_health(self) -> None:
        group = self.group
        for index in group.check_alive():  # raises EngineDeadError
            lost_gen, error = group.worker_lost(index)
            with self.lock:
                self.outstanding[index] = 0
                calls = list(self.calls.values())
            notice = LostWorker(index, lost_gen)
            for call in calls:
                call.deliver(notice)
                if error is not None:
                    call.fail(PipelineError(error))
        if group.down and group.start_due_workers():
            self._wake_all()

    def _flush_retired(self) -> None:
        while self.retiring:
            call, ids_per_engine, per_worker, chars = self.retiring.popleft()
            self._unregister(call, per_worker, chars, {k: len(ids) for k, ids in ids_per_engine.items()})
            for engine, ids in ids_per_engine.items():
                self.group.abort(ids, engine)

    def _fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
        self._wake_all()

    def _wake_all(self) -> None:
        with self.lock:
            calls = list(self.calls.values()) + list(self.waiters)
            self.waiters.clear()
        for call in calls:
            call.wake()

    # ---- what calls use ---------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.failure is not None:
            raise copy.copy(self.failure)
        if not self.thread.is_alive() and self.thread.ident is not None:
            raise PipelineError("the frontend's receiver thread is not running")

    def register(self, call: Call) -> None:
        with self.lock:
            self.check_usable()
            self.calls[call.prefix] = call
            self.routes = dict(self.calls)
            self.drawing.add(call)
            self.calls_started += 1

    def acquire(self, call: Call, want: int) -> int:
        """Up to `want` slots for `call` (0: none now; the call is woken when some come back).
        Each call drawing input may hold its share, max_inflight / calls drawing."""
        with self.lock:
            granted = min(want, self.grantable(call))
            if granted <= 0:
                self.waiters.add(call)
                return 0
            self.free -= granted
            call.held += granted
            inflight = self.max_inflight - self.free
            if inflight > self.peak_inflight:
                self.peak_inflight = inflight
            return granted

    def grantable(self, call: Call) -> int:
        """How many more slots `call` could be granted now: its share (max_inflight / calls
        drawing) less what it holds, within the free slots. (The caller holds the lock, or
        reads a value that may be stale by the time it acts on it.)"""
        share = max(1, self.max_inflight // max(1, len(self.drawing)))
        return min(self.free, share - call.held)

    def release(self, call: Call, count: int) -> None:
        with self.lock:
            self.free += count
            call.held -= count
            waiters, self.waiters = self.waiters, set()
        for waiter in waiters:
            if waiter is not call:
                waiter.wake()

    def done_drawing(self, call: Call) -> None:
        with self.lock:
            self.drawing.discard(call)

    def dispatch(self, call: Call, batch: list[m.RenderParams], chat_template: str | None,
                 chars: int) -> tuple[int, int, int] | None:
        """Sends a batch to the least-loaded worker that is up, for the engine core with the fewest
        requests in flight; (worker, its generation, engine), or None when no worker can take it
        now (the call keeps it and is woken when one can)."""
        group = self.group
        with self.lock:
            up = [i for i in range(len(self.outstanding)) if group.worker_up(i)]
            if not up:
                self.waiters.add(call)
                return None
            worker = min(up, key=self.outstanding.__getitem__)
            self.outstanding[worker] += len(batch)
            loads = self.engine_outstanding
            engine = 0 if len(loads) == 1 else min(range(len(loads)), key=loads.__getitem__)
            loads[engine] += len(batch)
            gen = group.worker_gen[worker]
        try:
            group.send_work(worker, batch, chat_template, engine)
        except zmq.Again:  # gone since it was checked: the batch stays with the call
            with self.lock:
                self.outstanding[worker] = max(0, self.outstanding[worker] - len(batch))
                loads[engine] = max(0, loads[engine] - len(batch))
                self.retried_sends += 1
                self.waiters.add(call)
            return None
        with self.lock:
            self.chars += chars
            self.batches_per_worker[worker] += 1
            self.requests_per_engine[engine] += len(batch)
        return worker, gen, engine

    def settled(self, per_worker: Counter | dict, chars: int, per_engine: Counter | dict | None = None) -> None:
        """Requests answered (or failed, or lost with a worker): their workers, engine cores and
        text budget are free again."""
        with self.lock:
            for worker, count in per_worker.items():
                self.outstanding[worker] = max(0, self.outstanding[worker] - count)
            if per_engine:
                loads = self.engine_outstanding
                for engine, count in per_engine.items():
                    loads[engine] = max(0, loads[engine] - count)
            self.chars -= chars
            waiters = None
            if chars and self.waiters:
                waiters, self.waiters = self.waiters, set()
        if waiters:
            for waiter in waiters:
                waiter.wake()

    def unregister(self, call: Call) -> None:
        """A call that ended normally (nothing in flight): its slots come back now."""
        self._unregister(call, {}, 0)

    def retire(self, call: Call, ids_per_engine: dict[int, list[str]], per_worker: Counter, chars: int) -> None:
        """A call that ended abnormally: the receiver thread aborts its requests by external id
        in the engine cores that hold them and returns its slots. Takes no lock: it may run inside
        the garbage collector."""
        self.retiring.append((call, ids_per_engine, per_worker, chars))
        self.wake_receiver()

    def _unregister(self, call: Call, per_worker, chars: int, per_engine: dict | None = None) -> None:
        with self.lock:
            if self.calls.get(call.prefix) is call:
                del self.calls[call.prefix]
                self.routes = dict(self.calls)
            self.drawing.discard(call)
            self.waiters.discard(call)
            self.free += call.held
            call.held = 0
            for worker, count in per_worker.items():
                self.outstanding[worker] = max(0, self.outstanding[worker] - count)
            for engine, count in (per_engine or {}).items():
                self.engine_outstanding[engine] = max(0, self.engine_outstanding[engine] - count)
            self.chars -= chars
            waiters, self.waiters = self.waiters, set()
        for waiter in waiters:
            waiter.wake()

    def stats(self) -> dict:
        with self.lock:
            return {"inflight": self.max_inflight - self.free, "max_inflight": self.max_inflight,
                    "max_inflight_seen": self.peak_inflight, "calls_running": len(self.calls),
                    "calls_started": self.calls_started, "stray_outputs_dropped": self.stray_outputs,
                    "retried_sends": self.retried_sends, "batches_per_worker": list(self.batches_per_worker),
                    "data_parallel_size": self.num_engines, "requests_per_engine": list(self.requests_per_engine),
                    "inflight_per_engine": list(self.engine_outstanding),
                    "worker_restarts": self.group.total_restarts,
                    "stopped_s": round(self.group.clock.skipped_s, 3)}

    # ---- tear-down ----------------------------------------------------------------------

    def close(self) -> None:
        """Ends every call (they raise "closed"), stops the receiver thread and the group."""
        if os.getpid() != self.group.owner_pid:
            self.group.close()  # a forked child: leaves the parent's group alone
            return
        self._fail(PipelineError("this Pipeline is closed"))
        self._stopping = True
        self.wake_receiver()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        self.group.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


class Call:
    def __init__(self, dispatcher: Dispatcher, prefix: str, requests: Iterator[m.RenderParams | FailedRequest],
                 opts: CallOptions, *, vocab_size: int, progress=None, default_normalize: bool = True,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.dispatcher = dispatcher
        self.prefix = prefix
        self.requests = requests
        self.batch_items = dispatcher.batch_items
        self.progress = progress
        self.chat_template = opts.chat_template
        self.default_normalize = default_normalize
        self.result_type = OUTPUT_TYPES.get(opts.task, PoolingRequestOutput)  # what the caller gets back
        # Token ids are range-checked a message at a time, when sent (before that, wide ones are
        # int64: only a checked message may be narrowed to int32 for the wire).
        self.vocab_size = vocab_size
        self.errors = opts.errors  # "raise": the first failure ends the call; "return": it becomes an output
        self.chunks: dict[str, ChunkSum] = {}  # chunk mode: documents with chunks still out
        self.stats = CallStats(engines=dispatcher.num_engines)
        # external id -> (request, worker, worker generation it was sent to, its size in characters,
        # the engine core its inputs went to)
        self.inflight: dict[str, tuple[m.RenderParams, int, int, int, int]] = {}
        self.backlog: deque[tuple[m.RenderParams, int]] = deque()  # (request, size) to (re)send when a worker can
        self.ready: dict[int, PoolingRequestOutput] = {}  # reorder buffer: index -> result
        self.inbox: deque = deque()  # messages routed here by the receiver thread
        self.inflight_chars = 0
        self.held = 0  # slots held (granted + issued and not handed back); changed under dispatcher.lock
        self.granted = 0  # slots held for requests not drawn yet
        self.issued = 0
        self.next_index = 0  # outputs before it are handed back (their slots returned)
        self.exhausted = False
        self.started = False
        self.finished = False
        self.retired = False
        self.failure: BaseException | None = None  # set by the receiver for this call alone
        self.handlers = {m.OutputBatch: self._on_outputs, m.RenderFailed: self._on_render_failed,
                         m.StepFailed: self._on_step_failed, LostWorker: self._on_lost_worker}
        # Waking up: a thread's event, or (async calls) a future on the caller's event loop.
        self.loop = loop
        self._event = threading.Event()
        self._waiter: asyncio.Future | None = None
        self._signaled = False
        self._wake_pending = False

    # ---- driving the call ------------------------------------------------------------------

    def outputs(self) -> Iterator[PoolingRequestOutput]:
        """Results in input order, in the calling thread."""
        try:
            while True:
                self._event.clear()
                ready, done = self.pump()
                yield from ready
                if done:
                    return
                if not ready:
                    self._event.wait(CALL_WAIT_S)
        except BaseException:
            self.abort()
            raise
        finally:
            self._finish()

    async def aoutputs(self) -> AsyncIterator[PoolingRequestOutput]:
        """Results in input order, on the caller's event loop (never blocking it to wait)."""
        try:
            while True:
                self._signaled = False
                ready, done = self.pump()
                for out in ready:
                    yield out
                if done:
                    return
                if ready or self._signaled:
                    # Never hold the event loop: the loop's other tasks run (and a cancellation
                    # lands) between two turns, even while results keep coming.
                    await asyncio.sleep(0)
                    continue
                self._waiter = self.loop.create_future()
                try:
                    await asyncio.wait_for(self._waiter, CALL_WAIT_S)
                except asyncio.TimeoutError:
                    pass
                finally:
                    self._waiter = None
        except BaseException:
            self.abort()
            raise
        finally:
            self._finish()

    def pump(self) -> tuple[list[PoolingRequestOutput], bool]:
        """One turn: handles what the receiver routed here, sends what the bound allows, and
        returns the outputs now ready in order (their slots go back at once: a thread that reads
        several streams in turn must not leave one waiting for slots the other holds) and whether
        the call is complete. Raises the call's failure."""
        dispatcher = self.dispatcher
        if not self.started:
            dispatcher.register(self)
            self.started = True
        failure = self.failure or dispatcher.failure
        if failure is not None:
            raise copy.copy(failure)
        started = time.perf_counter()
        inbox = self.inbox
        handlers = self.handlers
        while inbox:
            msg = inbox.popleft()
            handlers[type(msg)](msg)
        self._issue()
        ready = self.ready
        out = []
        index = self.next_index
        while index in ready:
            out.append(ready.pop(index))
            index += 1
        if out:
            self.next_index = index
            dispatcher.release(self, len(out))
        self.stats.frontend_busy_s += time.perf_counter() - started
        done = self.exhausted and index == self.issued
        if done:
            self._complete()
        return out, done

    def deliver(self, msg) -> None:
        """From the receiver thread: a message (or notice) for this call."""
        self.inbox.append(msg)
        self.wake()

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.wake()

    def wake(self) -> None:
        if self.loop is None:
            if not self._event.is_set():  # (set() takes a lock and notifies: skip it when pending)
                self._event.set()
        elif not self._wake_pending:
            self._wake_pending = True
            try:
                self.loop.call_soon_threadsafe(self._on_wake)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                self._wake_pending = False

    def _on_wake(self) -> None:  # on the call's event loop
        self._wake_pending = False
        self._signaled = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- ending ------------------------------------------------------------------------------

    def abort(self) -> None:
        """Drops every request of this call still in flight, in the engine too, and returns its
        slots (through the receiver thread: this may run inside the garbage collector)."""
        if self.retired:
            return
        self.retired = True
        self.exhausted = True
        if not self.started:
            return
        per_worker = Counter(entry[1] for entry in self.inflight.values())
        ids_per_engine: dict[int, list[str]] = {}
        for rid, entry in self.inflight.items():
            ids_per_engine.setdefault(entry[4], []).append(rid)
        chars = self.inflight_chars
        self.inflight.clear()
        self.chunks.clear()
        self.inflight_chars = 0
        self.backlog.clear()
        self.ready.clear()
        self.inbox.clear()
        self.dispatcher.retire(self, ids_per_engine, per_worker, chars)

    def _complete(self) -> None:
        if not self.retired:
            self.retired = True
            self.dispatcher.unregister(self)

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.stats.wall_s = time.perf_counter() - self.stats.start
            if self.progress is not None:
                self.progress.close()

    # ---- sending -------------------------------------------------------------------------

    def _issue(self) -> None:
        if self.backlog:
            backlog = list(self.backlog)
            self.backlog.clear()
            for start in range(0, len(backlog), self.batch_items):  # what cannot be sent goes back
                part = backlog[start:start + self.batch_items]
                self._send([r for r, _ in part], [size for _, size in part])
        if self.exhausted:
            return
        dispatcher = self.dispatcher
        if self._can_wait_for_a_full_batch():
            return
        pending: list[m.RenderParams] = []
        sizes: list[int] = []
        pending_chars = 0
        requests, batch_items = self.requests, self.batch_items
        granted, issued = self.granted, self.issued  # (locals in the loop; written back below)
        try:
            while True:
                if not granted:
                    self._send(pending, sizes)
                    pending, sizes, pending_chars = [], [], 0
                    granted = dispatcher.acquire(self, batch_items)
                    if not granted:
                        break
                if dispatcher.chars + pending_chars >= MAX_INFLIGHT_CHARS:
                    with dispatcher.lock:
                        dispatcher.waiters.add(self)
                    break
                try:
                    request = next(requests)  # validation errors surface here, in the caller
                except StopIteration:
                    self.exhausted = True
                    break
                granted -= 1
                issued += 1
                if type(request) is FailedRequest:  # refused in the caller (errors="return")
                    self.ready[request.index] = self.result_type(request.request_id, request.index, None, 0, 1,
                                                                 request.error)
                    self.stats.errors += 1
                    continue
                prompt = request.prompt  # (request_size's usual cases, inline: this runs per request)
                if prompt and request.pair is None:
                    size = len(prompt)
                elif prompt is None and request.token_ids is not None:
                    size = request.token_ids.size
                else:
                    size = request_size(request)
                pending.append(request)
                sizes.append(size)
                pending_chars += size
                if len(pending) == batch_items:
                    self._send(pending, sizes)
                    pending, sizes, pending_chars = [], [], 0
        finally:
            self.granted, self.issued = granted, issued
        self._send(pending, sizes)
        if self.exhausted:
            dispatcher.done_drawing(self)
            if self.granted:
                dispatcher.release(self, self.granted)
                self.granted = 0
        inflight = self.issued - self.next_index
        if inflight > self.stats.max_inflight_seen:
            self.stats.max_inflight_seen = inflight

    def _can_wait_for_a_full_batch(self) -> bool:
        """Whether to send nothing this turn: fewer slots are free than one full message and
        enough requests are in flight to keep the workers and the engine busy meanwhile.
        Results come back a step at a time (a fast device: a dozen requests); refilling each
        step's slots at once would send as many small messages, and every process pays per
        message. (Unlocked reads: a stale value only delays or hastens one send.)"""
        dispatcher = self.dispatcher
        inflight = self.issued - self.next_index
        if inflight < FULL_BATCH_WAIT_MIN_MESSAGES * self.batch_items:
            return False
        if self.granted + dispatcher.grantable(self) >= self.batch_items:
            return False
        with dispatcher.lock:  # woken when slots come back (release wakes the waiters)
            dispatcher.waiters.add(self)
        return True

    def _send(self, batch: list[m.RenderParams], sizes: list[int]) -> None:
        """One batch (at most batch_items) to a worker, or into the backlog when none can take it."""
        if not batch:
            return
        if bad := token_id_errors(batch, self.vocab_size):
            batch, sizes = self._refuse(batch, sizes, bad)
            if not batch:
                return
        chars = sum(sizes)
        sent = self.dispatcher.dispatch(self, batch, self.chat_template, chars)
        if sent is None:  # no worker can take it now: kept for the next turn
            self.backlog.extend(zip(batch, sizes))
            return
        worker, gen, engine = sent
        inflight = self.inflight
        for request, size in zip(batch, sizes):
            inflight[request.request_id] = (request, worker, gen, size, engine)
        self.inflight_chars += chars

    def _refuse(self, batch: list[m.RenderParams], sizes: list[int], bad: list[tuple[int, str]]
                ) -> tuple[list[m.RenderParams], list[int]]:
        """Requests whose token ids leave the vocabulary (found when their message is sent):
        the call's error (errors="raise") or error outputs; the batch without them."""
        if self.errors != "return":
            raise ValueError(bad[0][1])
        for position, error in bad:
            request = batch[position]
            self.ready[request.index] = self.result_type(request.request_id, request.index, None, 0, 1, error)
            self.stats.errors += 1
        gone = {position for position, _ in bad}
        kept = [i for i in range(len(batch)) if i not in gone]
        return [batch[i] for i in kept], [sizes[i] for i in kept]

    # ---- receiving ------------------------------------------------------------------------

    def _on_outputs(self, msg: m.OutputBatch) -> None:
        stats = self.stats
        stats.engine_busy_s += msg.busy_s
        stats.engine_admit_s += msg.admit_s
        for worker, seconds in msg.render_s.items():
            stats.render_busy_s[worker] = stats.render_busy_s.get(worker, 0.0) + seconds
        stats.padded_tokens += msg.padded_tokens
        stats.batches += 1
        stats.max_in_core_seen = max(stats.max_in_core_seen, msg.in_core)
        depths = stats.depths
        depths["engine_window"].add(msg.in_core)
        depths["batch_size"].add(len(msg.request_ids))
        depths["frontend_inflight"].add(self.issued - self.next_index)
        depths["reorder_buffer"].add(len(self.ready))
        accepted = tokens = chars = 0
        workers: list[int] = []  # of each request settled (counted once at the end)
        engine_of: list[int] = []
        inflight, ready, make = self.inflight, self.ready, self.result_type
        columns = zip(msg.request_ids, msg.indices.tolist(), msg.num_prompt_tokens.tolist(), msg.arrays)
        if msg.chunks is None and msg.sparse_ids is None:  # the usual case, in a lean loop
            for rid, index, num_tokens, data in columns:
                entry = inflight.pop(rid, None)
                if entry is None or entry[0].index != index:
                    if entry is not None:
                        inflight[rid] = entry
                    stats.duplicates_dropped += 1  # re-sent, aborted or from an earlier call
                    continue
                workers.append(entry[1])
                engine_of.append(entry[4])
                chars += entry[3]
                ready[index] = make(rid, index, data, num_tokens)
                tokens += num_tokens
            accepted, engine = len(workers), engine_of[0] if engine_of else -1
        else:
            accepted, tokens, chars, engine = self._on_special_outputs(msg, columns, workers, engine_of)
        self._settle_outputs(msg, accepted, tokens, chars, workers, engine_of, engine)

    def _on_special_outputs(self, msg: m.OutputBatch, columns, workers: list[int], engine_of: list[int]
                            ) -> tuple[int, int, int, int]:
        """`_on_outputs` for chunks of long documents (pooled back into one vector when the last
        arrives) and sparse vectors (their token ids)."""
        stats, inflight, ready, make = self.stats, self.inflight, self.ready, self.result_type
        accepted = tokens = chars = 0
        engine = -1  # which engine core computed this batch (a batch comes from one): from its requests
        chunk_of = None if msg.chunks is None else msg.chunks.tolist()
        sparse_ids = msg.sparse_ids
        for i, (rid, index, num_tokens, data) in enumerate(columns):
            entry = inflight.get(rid)
            if entry is None or entry[0].index != index:
                stats.duplicates_dropped += 1  # re-sent, aborted or from an earlier call
                continue
            if engine < 0:
                engine = entry[4]
            num_chunks = 1
            if chunk_of is not None and chunk_of[i][0] >= 0:
                chunk, num_chunks = chunk_of[i]
                chunks = self.chunks.get(rid)
                if chunks is None:
                    chunks = self.chunks[rid] = ChunkSum(num_chunks)
                if not chunks.add(chunk, data, num_tokens):
                    stats.duplicates_dropped += 1
                if not chunks.complete:
                    continue
                data, num_tokens = chunks.finish(entry[0].params, self.default_normalize), chunks.tokens
                del self.chunks[rid]
            del inflight[rid]
            workers.append(entry[1])
            engine_of.append(entry[4])
            chars += entry[3]
            result = ready[index] = make(rid, index, data, num_tokens, num_chunks)
            if sparse_ids is not None:
                result.indices = sparse_ids[i]
            tokens += num_tokens
            accepted += 1
        return accepted, tokens, chars, engine

    def _settle_outputs(self, msg: m.OutputBatch, accepted: int, tokens: int, chars: int, workers: list[int],
                        engine_of: list[int], engine: int) -> None:
        """Counts what `_on_outputs` accepted and gives their workers, engines and text budget back."""
        stats = self.stats
        stats.requests += accepted
        stats.prompt_tokens += tokens
        settled, engines = Counter(workers), Counter(engine_of)
        if engine >= 0 and stats.engines > 1:
            stats.engine_busy_per_engine[engine] = stats.engine_busy_per_engine.get(engine, 0.0) + msg.busy_s
            stats.batches_per_engine[engine] = stats.batches_per_engine.get(engine, 0) + 1
        for k, count in engines.items():
            stats.requests_per_engine[k] = stats.requests_per_engine.get(k, 0) + count
        if accepted:
            self.inflight_chars -= chars
            self.dispatcher.settled(settled, chars, engines)
        if self.progress is not None and accepted:
            self.progress.update(accepted)
            wall = time.perf_counter() - stats.start
            self.progress.set_postfix_str(f"{stats.prompt_tokens / max(wall, 1e-9):,.0f} tok/s", refresh=False)

    def _on_render_failed(self, msg: m.RenderFailed) -> None:
        for rid, index, error in zip(msg.request_ids, msg.indices, msg.errors):
            if self._owns(rid, index):
                if self.errors != "return":
                    raise ValueError(f"request {index}: {error}")
                self._fail(rid, index, f"request {index}: {error}")

    def _on_step_failed(self, msg: m.StepFailed) -> None:
        # One request appears once however many of its chunks the failed step held.
        mine = dict.fromkeys((rid, index) for rid, index in zip(msg.request_ids, msg.indices)
                             if self._owns(rid, index))
        if mine and self.errors != "return":
            # The call ends: `abort` (on the way out) drops these and every other request still
            # in flight by external id, other chunks of a failed document included.
            raise StepError(
                f"the engine core failed a step for requests {[i for _, i in mine]} "
                f"(ids {[r for r, _ in mine]}): {msg.error}",
                [r for r, _ in mine], [i for _, i in mine])
        for rid, index in mine:
            self._fail(rid, index, f"request {index}: the model failed on it: {msg.error}")

    def _on_lost_worker(self, notice: LostWorker) -> None:
        """A worker lost its process: what this call had sent to it comes again from the others."""
        self.stats.worker_restarts += 1
        lost = [(req, size, engine) for req, worker, gen, size, engine in self.inflight.values()
                if worker == notice.index and gen <= notice.gen]
        for req, size, _ in lost:
            del self.inflight[req.request_id]
            self.inflight_chars -= size
            self.chunks.pop(req.request_id, None)  # its chunks come again, whole
        if lost:
            self.dispatcher.settled({}, sum(size for _, size, _ in lost), Counter(engine for _, _, engine in lost))
            self.backlog.extend((req, size) for req, size, _ in lost)

    def _owns(self, request_id: str, index: int) -> bool:
        entry = self.inflight.get(request_id)
        return entry is not None and entry[0].index == index

    def _fail(self, request_id: str, index: int, error: str) -> None:
        """errors="return": this request's output carries the error; the call goes on."""
        request, worker, _, size, engine = self.inflight.pop(request_id)
        self.inflight_chars -= size
        self.dispatcher.settled({worker: 1}, size, {engine: 1})
        if request.long_inputs == "chunk":  # its other chunks would be computed for nothing
            self.chunks.pop(request_id, None)
            self.dispatcher.group.abort([request_id], engine)
        self.ready[index] = self.result_type(request_id, index, None, 0, 1, error)
        self.stats.errors += 1
        if self.progress is not None:
            self.progress.update(1)
