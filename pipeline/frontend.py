"""The frontend: calls from any number of threads (or coroutines) over one process group.

`Dispatcher` (one per group) is what the calls share:

* one receiver thread, the only reader of the results socket: it decodes each message and routes
  it to its call by the call's id, an explicit field of every message (a request is named by
  its call's id and its index; a step's outputs that served several calls are split by their
  `call_of` column), and it watches the group: heartbeats, the engine, dead render workers
  (restarted with back-off; every call re-sends what the lost worker held);
* the in-flight bound: at most `max_inflight` requests issued and not yet handed to their caller,
  over all calls together, shared fairly among the calls still reading input; and the text held
  for them (kept for re-sending) bounded too;
* least-loaded dispatch to the render workers that are up (a restarting worker gets nothing),
  and with data-parallel engine cores, to the engine core with the fewest requests in flight
  (named in each RenderBatch; the call's ticket for the batch records it, and answers or
  failures settle it).

A `Call` is one embed/encode/... call. It draws its requests lazily in blocks (a message's worth:
`inputs.RequestSource`), sends each block as one RenderBatch, keeps what is in flight by index in
arrays, and hands results back in input order (the reorder buffer counts against the bound, so
memory stays bounded however long the input is). It is driven by `pump()`
in the caller's thread -- by a plain generator (`outputs`) or an async one (`aoutputs`, which
awaits the receiver's wake-ups on its event loop). A failure, a stop by the caller (generator
closed or collected, KeyboardInterrupt, task cancelled) or a bad input found on the way aborts
that call's requests (the whole call, by its id) and returns its slots; no other call is touched.

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
from pooling_pipeline.core.vectors import ChunkSum
from pooling_pipeline.errors import EngineDeadError, PipelineError, StepError
from pooling_pipeline.inputs import Block, CallOptions, FailedRequest
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
# A call's id: random (unguessable: 64 bits); a request's external id is the call's id then its index.
# A call holds back a partial message while this many full messages' worth of its requests are in
# flight (the pipeline stays fed) and waits for slots to fill a whole one.
FULL_BATCH_WAIT_MIN_MESSAGES = 4


def new_call_prefix() -> str:
    return secrets.token_hex(8) + "-"


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
            if msg.call_of is None:  # one call's outputs, as usual
                call = calls.get(msg.calls[0]) if msg.calls else None
                if call is None:
                    self.stray_outputs += len(msg.indices)
                else:
                    call.deliver(msg)
                return
            for position, name in enumerate(msg.calls):  # a step that served several calls
                call = calls.get(name)
                if call is None:
                    self.stray_outputs += int(np.count_nonzero(msg.call_of == position))
                else:
                    call.deliver(msg.part(position))  # the step's cost, split by requests
            return
        if kind is m.RenderFailed:
            call = calls.get(msg.call)
            if call is not None:
                call.deliver(msg)
            return
        # StepFailed: a few requests, maybe of several calls; each call gets its own.
        per_call: dict[str, list[int]] = {}
        for name, index in zip(msg.calls, msg.indices):
            per_call.setdefault(name, []).append(index)
        for name, indices in per_call.items():
            call = calls.get(name)
            if call is not None:
                call.deliver(msg if len(indices) == len(msg.indices) else m.StepFailed([name] * len(indices), indices,
                                                                                        msg.error))

    def _check_health(self) -> None:
        group = self.group
        for index in group.check_alive():  # raises EngineDeadError
            lost_gen, error = group.worker_lost(index)
            with self.lock:  # (each call settles what it had sent there when it handles the notice)
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
            call, engines, per_worker, chars, per_engine = self.retiring.popleft()
            self._unregister(call, per_worker, chars, per_engine)
            for engine in engines:  # every request of the call, waiting or still on its way
                self.group.abort(call.prefix, None, engine)

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

    def dispatch(self, call: Call, block: Block, chat_template: str | None, chars: int) -> tuple[int, int, int] | None:
        """Sends a batch to the least-loaded worker that is up, for the engine core with the fewest
        requests in flight; (worker, its generation, engine), or None when no worker can take it
        now (the call keeps it and is woken when one can)."""
        group = self.group
        # The generations before the check: a worker lost after it is a generation this send
        # belongs to, so its notice re-sends the block.
        gens = list(group.worker_gen)
        with self.lock:
            up = [i for i in range(len(self.outstanding)) if group.worker_up(i)]
            if not up:
                self.waiters.add(call)
                return None
            worker = min(up, key=self.outstanding.__getitem__)
            n = len(block)
            self.outstanding[worker] += n
            loads = self.engine_outstanding
            engine = 0 if len(loads) == 1 else min(range(len(loads)), key=loads.__getitem__)
            loads[engine] += n
            gen = gens[worker]
        try:
            group.send_work(worker, block.render_batch(call.prefix, chat_template, engine))
        except zmq.Again:  # gone since it was checked: the block stays with the call
            with self.lock:
                self.outstanding[worker] = max(0, self.outstanding[worker] - n)
                loads[engine] = max(0, loads[engine] - n)
                self.retried_sends += 1
                self.waiters.add(call)
            return None
        with self.lock:
            self.chars += chars
            self.batches_per_worker[worker] += 1
            self.requests_per_engine[engine] += n
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

    def retire(self, call: Call, engines: list[int], per_worker: Counter, chars: int, per_engine: Counter) -> None:
        """A call that ended abnormally: the receiver thread aborts its requests (the whole call)
        in the engine cores it sent to and returns its slots. Takes no lock: it may run inside
        the garbage collector."""
        self.retiring.append((call, engines, per_worker, chars, per_engine))
        self.wake_receiver()

    def _unregister(self, call: Call, per_worker, chars: int, per_engine=None) -> None:
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


class Ticket:
    """A Block sent to a worker: where it went, and how many of its requests are still out."""

    __slots__ = ("block", "worker", "gen", "engine", "pending")

    def __init__(self, block: Block, worker: int, gen: int, engine: int) -> None:
        self.block, self.worker, self.gen, self.engine = block, worker, gen, engine
        self.pending = len(block)


class Call:
    """One call: its requests drawn in blocks, sent, answered and handed back in input order.

    Its state is kept by index in rings of numpy arrays, one entry per request in flight or
    answered and not yet handed back (the bound keeps them within `capacity` of each other, so
    `index & mask` is a slot of its own): which index a slot holds while it is out (answers for
    anything else are duplicates), its ticket (the Block it was sent in), its size in characters,
    whether it is answered, its token count and -- for the usual outputs, one vector each -- its
    vector, written for a whole OutputBatch with one fancy assignment. Other answers (errors,
    per-token arrays, sparse vectors, pooled chunks) are result objects in `special`."""

    def __init__(self, dispatcher: Dispatcher, prefix: str, source, opts: CallOptions, *,
                 progress=None, default_normalize: bool = True, loop: asyncio.AbstractEventLoop | None = None,
                 keep_all: bool = False) -> None:
        self.dispatcher = dispatcher
        self.prefix = prefix
        self.source = source
        self.batch_items = dispatcher.batch_items
        self.progress = progress
        self.chat_template = opts.chat_template
        self.default_normalize = default_normalize
        self.result_type = OUTPUT_TYPES.get(opts.task, PoolingRequestOutput)  # what the caller gets back
        self.errors = opts.errors  # "raise": the first failure ends the call; "return": it becomes an output
        # keep_all (a list call: every result is kept): the results of one answer share one
        # array; in a stream each result gets a copy of its own row, so that keeping a few of
        # them does not keep their neighbours' memory too.
        self.keep_all = keep_all
        self.stats = CallStats(engines=dispatcher.num_engines)
        capacity = 1 << max(4, (dispatcher.max_inflight - 1).bit_length())
        self.mask = capacity - 1
        self.out_index = np.full(capacity, -1, np.int64)  # slot -> the index sent and not answered
        self.ticket_of = np.zeros(capacity, np.int64)
        self.size_of = np.zeros(capacity, np.int64)
        self.answered = np.zeros(capacity, dtype=bool)  # slot -> answered, not handed back yet
        self.tokens = np.zeros(capacity, np.int64)
        self.scratch = np.zeros(capacity, np.int64)  # (for _live_rows)
        self.vectors: list = [None] * capacity  # slot -> its answer's own vector (the usual outputs)
        self.special: dict[int, PoolingRequestOutput] = {}  # answered otherwise, by index
        self.tickets: dict[int, Ticket] = {}
        self.next_ticket = 0
        self.engines_used: set[int] = set()
        self.chunks: dict[int, ChunkSum] = {}  # chunk mode: documents with chunks still out, by index
        self.backlog: deque[Block] = deque()  # blocks to (re)send when a worker can take them
        self.inbox: deque = deque()  # messages routed here by the receiver thread
        self.inflight_chars = 0
        self.ready_count = 0  # answered and not handed back (the reorder buffer)
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
        out = self._hand_back() if self.ready_count else []
        self.stats.frontend_busy_s += time.perf_counter() - started
        done = self.exhausted and self.next_index == self.issued
        if done:
            self._complete()
        return out, done

    def _hand_back(self) -> list[PoolingRequestOutput]:
        """The answered results from `next_index` on, up to the first still out, in order."""
        first, count, mask = self.next_index, self.issued - self.next_index, self.mask
        start = first & mask
        answered = self.answered
        window = answered[start:start + count]
        if len(window) < count:  # the range wraps around the ring
            window = np.concatenate([window, answered[:count - len(window)]])
        run = count if window.all() else int(window.argmin())
        if not run:
            return []
        slots = np.arange(first, first + run) & mask
        answered[slots] = False
        make, prefix, special = self.result_type, self.prefix, self.special
        tokens = self.tokens.take(slots).tolist()
        # The vectors of slots start .. start + run, the ring's end and start when it wraps.
        stored, end = self.vectors, start + run
        vectors = stored[start:end] + stored[:max(0, end - len(stored))]
        stored[start:end] = [None] * (min(end, len(stored)) - start)  # (the results hold them now)
        if end > len(stored):
            stored[:end - len(stored)] = [None] * (end - len(stored))
        if not special:
            out = [make(prefix, index, row, num_tokens)
                   for index, row, num_tokens in zip(range(first, first + run), vectors, tokens)]
        else:
            out = [special.pop(index, None) or make(prefix, index, row, num_tokens)
                   for index, row, num_tokens in zip(range(first, first + run), vectors, tokens)]
        self.next_index = first + run
        self.ready_count -= run
        self.dispatcher.release(self, run)
        return out

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
        per_worker, per_engine = Counter(), Counter()
        for ticket in self.tickets.values():
            per_worker[ticket.worker] += ticket.pending
            per_engine[ticket.engine] += ticket.pending
        chars = self.inflight_chars
        self.tickets.clear()
        self.chunks.clear()
        self.special.clear()
        self.inflight_chars = 0
        self.backlog.clear()
        self.inbox.clear()
        self.dispatcher.retire(self, sorted(self.engines_used), per_worker, chars, per_engine)

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
            blocks = list(self.backlog)
            self.backlog.clear()
            for block in blocks:  # what cannot be sent goes back
                self._send(block)
        if self.exhausted:
            return
        dispatcher = self.dispatcher
        source, batch_items = self.source, self.batch_items
        while True:
            if not self.granted:
                # Checked before every grant, not once a turn: while this loop sends, results
                # free a few slots at a time, and each grant would become a small message.
                if self._can_wait_for_a_full_batch():
                    break
                self.granted = dispatcher.acquire(self, batch_items)
                if not self.granted:
                    break
            room = MAX_INFLIGHT_CHARS - dispatcher.chars
            if room <= 0:  # the text held for requests in flight is at its bound
                with dispatcher.lock:
                    dispatcher.waiters.add(self)
                break
            pieces = source.take(self.granted, room)  # validation errors surface here, in the caller
            for piece in pieces:
                failed = type(piece) is FailedRequest
                if (piece.index if failed else piece.indices[0]) != self.issued:
                    # The ring of slots counts on requests drawn in input order.
                    raise PipelineError(f"requests were drawn out of order (this is a bug): {self.issued} expected")
                if failed:  # refused in the caller (errors="return")
                    self._refused(piece)
                    drawn = 1
                else:
                    self._send(piece)
                    drawn = len(piece)
                self.granted -= drawn
                self.issued += drawn
            if source.exhausted:
                self.exhausted = True
                break
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

    def _send(self, block: Block) -> None:
        """One block to a worker, or into the backlog when none can take it."""
        chars = sum(block.sizes)
        sent = self.dispatcher.dispatch(self, block, self.chat_template, chars)
        if sent is None:  # no worker can take it now: kept for the next turn
            self.backlog.append(block)
            return
        worker, gen, engine = sent
        number = self.next_ticket
        self.next_ticket += 1
        self.tickets[number] = Ticket(block, worker, gen, engine)
        self.engines_used.add(engine)
        indices = np.asarray(block.indices, dtype=np.int64)
        slots = indices & self.mask
        self.out_index[slots] = indices
        self.ticket_of[slots] = number
        self.size_of[slots] = block.sizes
        self.inflight_chars += chars

    def _refused(self, failed: FailedRequest) -> None:
        self._answer_special(failed.index, self.result_type(self.prefix, failed.index, None, 0, 1, failed.error))
        self.stats.errors += 1

    def _answer_special(self, index: int, result: PoolingRequestOutput) -> None:
        self.special[index] = result
        self.answered[index & self.mask] = True
        self.ready_count += 1

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
        depths["batch_size"].add(len(msg.indices))
        depths["frontend_inflight"].add(self.issued - self.next_index)
        depths["reorder_buffer"].add(self.ready_count)
        data = msg.data
        if not len(msg.indices):  # (the engine sends none; a well-formed empty one changes nothing)
            return
        if data is not None and msg.chunks is None and msg.sparse_ids is None:
            self._on_vectors(msg, data)  # the usual case: one vector each, in array operations
        else:
            self._on_special_outputs(msg)

    def _on_vectors(self, msg: m.OutputBatch, data: np.ndarray) -> None:
        indices = msg.indices
        slots = indices & self.mask
        num_tokens = msg.num_prompt_tokens
        rows = _live_rows(self.out_index, self.scratch, indices, slots)
        if rows is not None:  # some are not (or no longer) out: re-sent, aborted or forged
            self.stats.duplicates_dropped += len(indices) - len(rows)
            indices, slots, data, num_tokens = indices[rows], slots[rows], data[rows], num_tokens[rows]
            if not len(indices):
                return
        # Each answer's own vector (the frame they came in is released): for a list call one copy
        # of the message's rows, each a view of it (every result is kept anyway); in a stream a
        # copy per row, so that a caller keeping a few results keeps no neighbours' memory.
        rows = list(data.copy()) if self.keep_all else [row.copy() for row in data]
        vectors = self.vectors
        for slot, row in zip(slots.tolist(), rows):
            vectors[slot] = row
        self.tokens[slots] = num_tokens
        self.out_index[slots] = -1
        self.answered[slots] = True
        self.ready_count += len(slots)
        self._settle(slots, int(num_tokens.sum()), msg.busy_s)

    def _settle(self, slots: np.ndarray, tokens: int, busy_s: float | None = None) -> None:
        """Counts these answered requests and gives their workers, engines and text budget back."""
        tickets = self.ticket_of[slots]
        chars = int(self.size_of[slots].sum())
        per_worker: dict[int, int] = {}
        per_engine: dict[int, int] = {}
        low = int(tickets.min())
        if low == int(tickets.max()):
            counts = [(low, len(slots))]
        else:  # (ticket numbers in flight are a short range: a bincount, no sort)
            sizes = np.bincount(tickets - low)
            numbers = np.flatnonzero(sizes)
            counts = zip((numbers + low).tolist(), sizes[numbers].tolist())
        for number, count in counts:
            ticket = self.tickets[number]
            ticket.pending -= count
            per_worker[ticket.worker] = per_worker.get(ticket.worker, 0) + count
            per_engine[ticket.engine] = per_engine.get(ticket.engine, 0) + count
            if not ticket.pending:
                del self.tickets[number]
        stats = self.stats
        accepted = len(slots)
        stats.requests += accepted
        stats.prompt_tokens += tokens
        for engine, count in per_engine.items():
            stats.requests_per_engine[engine] = stats.requests_per_engine.get(engine, 0) + count
        if busy_s is not None and stats.engines > 1 and len(per_engine) == 1:  # (a batch comes from one engine)
            (engine,) = per_engine
            stats.engine_busy_per_engine[engine] = stats.engine_busy_per_engine.get(engine, 0.0) + busy_s
            stats.batches_per_engine[engine] = stats.batches_per_engine.get(engine, 0) + 1
        self.inflight_chars -= chars
        self.dispatcher.settled(per_worker, chars, per_engine)
        if self.progress is not None:
            self.progress.update(accepted)
            wall = time.perf_counter() - stats.start
            self.progress.set_postfix_str(f"{stats.prompt_tokens / max(wall, 1e-9):,.0f} tok/s", refresh=False)

    def _on_special_outputs(self, msg: m.OutputBatch) -> None:
        """Outputs that are not one vector each in the ring: chunks of long documents (pooled back
        into one vector when the last arrives), sparse vectors (their token ids), per-token arrays."""
        arrays = list(msg.data) if msg.data is not None else msg.arrays
        chunk_of = None if msg.chunks is None else msg.chunks.tolist()
        sparse_ids = msg.sparse_ids
        mask, out_index = self.mask, self.out_index
        settled: list[int] = []
        tokens = 0
        for i, (index, num_tokens) in enumerate(zip(msg.indices.tolist(), msg.num_prompt_tokens.tolist())):
            slot = index & mask
            if index < 0 or out_index[slot] != index:
                self.stats.duplicates_dropped += 1  # re-sent, aborted or from an earlier call
                continue
            data, num_chunks = arrays[i], 1
            if msg.data is not None:
                data = data.copy()  # (a row of the received frame)
            if chunk_of is not None and chunk_of[i][0] >= 0:
                chunk, num_chunks = chunk_of[i]
                chunks = self.chunks.get(index)
                if chunks is None:
                    chunks = self.chunks[index] = ChunkSum(num_chunks)
                if not chunks.add(chunk, data, num_tokens):
                    self.stats.duplicates_dropped += 1
                if not chunks.complete:
                    continue
                params = self._options_of(index).params
                normalize = params.normalize if params.normalize is not None else self.default_normalize
                data, num_tokens = chunks.finish(params.dimensions, normalize), chunks.tokens
                del self.chunks[index]
            result = self.result_type(self.prefix, index, data, num_tokens, num_chunks)
            if sparse_ids is not None:
                result.indices = sparse_ids[i]
            out_index[slot] = -1
            self._answer_special(index, result)
            settled.append(slot)
            tokens += num_tokens
        if settled:
            self._settle(np.asarray(settled, dtype=np.int64), tokens, msg.busy_s)

    def _options_of(self, index: int) -> m.RenderOptions:
        block = self.tickets[int(self.ticket_of[index & self.mask])].block
        return block.options_of(block.indices.index(index))

    def _on_render_failed(self, msg: m.RenderFailed) -> None:
        for index, error in zip(msg.indices, msg.errors):
            if self._owns(index):
                if self.errors != "return":
                    raise ValueError(f"request {index}: {error}")
                self._fail(index, f"request {index}: {error}")

    def _on_step_failed(self, msg: m.StepFailed) -> None:
        # One request appears once however many of its chunks the failed step held.
        mine = [index for index in dict.fromkeys(msg.indices) if self._owns(index)]
        if mine and self.errors != "return":
            # The call ends: `abort` (on the way out) drops these and every other request still
            # in flight, other chunks of a failed document included.
            ids = [f"{self.prefix}{index}" for index in mine]
            raise StepError(f"the engine core failed a step for requests {mine} (ids {ids}): {msg.error}", ids, mine)
        for index in mine:
            self._fail(index, f"request {index}: the model failed on it: {msg.error}")

    def _on_lost_worker(self, notice: LostWorker) -> None:
        """A worker lost its process: what this call had sent to it is settled and comes again
        from the others."""
        self.stats.worker_restarts += 1
        lost = [number for number, t in self.tickets.items() if t.worker == notice.index and t.gen <= notice.gen]
        chars, count, per_engine = 0, 0, Counter()
        for number in lost:
            ticket = self.tickets.pop(number)
            indices = np.asarray(ticket.block.indices, dtype=np.int64)
            slots = indices & self.mask
            out = (self.out_index[slots] == indices) & (self.ticket_of[slots] == number)
            positions = np.flatnonzero(out).tolist()
            if not positions:
                continue
            self.out_index[slots[out]] = -1
            chars += int(self.size_of[slots[out]].sum())
            count += len(positions)
            per_engine[ticket.engine] += len(positions)
            for index in indices[out].tolist():
                self.chunks.pop(index, None)  # its chunks come again, whole
            self.backlog.append(ticket.block.select(positions))
        if lost:
            self.inflight_chars -= chars
            self.dispatcher.settled({notice.index: count}, chars, per_engine)

    def _owns(self, index: int) -> bool:
        return index >= 0 and self.out_index[index & self.mask] == index

    def _fail(self, index: int, error: str) -> None:
        """errors="return": this request's output carries the error; the call goes on."""
        slot = index & self.mask
        number = int(self.ticket_of[slot])
        ticket = self.tickets[number]
        options = ticket.block.options_of(ticket.block.indices.index(index))
        size = int(self.size_of[slot])
        self.out_index[slot] = -1
        ticket.pending -= 1
        if not ticket.pending:
            del self.tickets[number]
        self.inflight_chars -= size
        self.dispatcher.settled({ticket.worker: 1}, size, {ticket.engine: 1})
        if options.long_inputs == "chunk":  # its other chunks would be computed for nothing
            self.chunks.pop(index, None)
            self.dispatcher.group.abort(self.prefix, [index], ticket.engine)
        self._answer_special(index, self.result_type(self.prefix, index, None, 0, 1, error))
        self.stats.errors += 1
        if self.progress is not None:
            self.progress.update(1)


def _live_rows(out_index: np.ndarray, scratch: np.ndarray, indices: np.ndarray, slots: np.ndarray) -> np.ndarray | None:
    """The rows of an answer to accept -- those whose index is out (a stale index may share its
    slot with a live one: only the live one counts), each index once -- or None for all.
    `scratch` (one entry per slot) finds a slot named twice without a sort: each row writes its
    position there, and only the last writer of a slot reads its own back."""
    live = out_index[slots] == indices
    positions = np.arange(len(slots))
    scratch[slots] = positions
    once = scratch[slots] == positions
    if live.all() and once.all():
        return None
    rows = np.flatnonzero(live)
    scratch[slots[rows[::-1]]] = rows[::-1]  # the first live row of each slot writes last: it is kept
    return rows[scratch[slots[rows]] == rows]
