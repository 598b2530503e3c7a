"""One embed/encode/... call: its requests drawn lazily and sent, what comes back for them, its end.

A `Call` draws its prompts a message at a time (`inputs.RequestSource`), sends each batch as one
RenderBatch to a render worker (a `Ticket` records where it went), files the receiver's messages
(answers into its ring, `reorder.Ring`; per-request failures; a lost worker's requests re-sent) and
hands results back in input order. It runs in the caller's thread, a turn at a time (`pump`), from
a plain generator (`turns`: each turn's results, which a `ResultStream` hands out one by one), an
async one (`aoutputs`, which awaits the receiver's wake-ups) or, for an async list call, a
coroutine (`acollect`) that gathers the turns.

Lifecycle, one verb per step:

* register -- its first turn: the dispatcher routes its messages to it; it shares the free slots.
* stop_drawing -- its input is exhausted: the others share the free slots (its unused grant goes back).
* unregister -- every result handed back: routed nothing more, its slots settled in the ledger.
* abort -- it ends early: a failure (`fail`: the whole call, from the receiver; errors="raise"),
  the caller stopping (generator closed or collected, KeyboardInterrupt, task cancelled) or a bad
  input. Its state is dropped; the receiver thread aborts its requests in the engine cores and
  unregisters it. It takes no lock: the garbage collector may end a call in any thread.
* finish -- its generator has exited: wall time taken, progress bar closed.

With errors="return", `fail_request` fails one request (its output carries the error) and the call
goes on; no other call is ever touched. A call that had requests towards an engine core that died
(in it, in a worker, on their way) fails as a whole with EngineRestartedError, errors="return" too:
some of its results would be missing, and the engine core is restarted for the calls after it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import secrets
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Generator, Iterator
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zmq

from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.messages import RenderBatch
from pooling_pipeline.errors import EngineRestartedError, PipelineError, StepError
from pooling_pipeline.frontend.receiver import LostEngine, LostWorker
from pooling_pipeline.frontend.reorder import Ring
from pooling_pipeline.inputs import FailedRequest
from pooling_pipeline.options import CallOptions
from pooling_pipeline.outputs import OUTPUT_TYPES, PoolingRequestOutput

if TYPE_CHECKING:
    from pooling_pipeline.frontend.receiver import Dispatcher

CALL_WAIT_S = 0.5  # a call re-checks the dispatcher at least this often while it waits
# Besides the request count, the text held for requests in flight is bounded (kept for re-sending
# if a worker dies): a window of 100 MB web pages must not hold gigabytes.
MAX_INFLIGHT_CHARS = 64 * 1024 * 1024
# A call holds back a partial message while this many full messages' worth of its requests are in
# flight (the pipeline stays fed) and waits for slots to fill a whole one.
FULL_BATCH_WAIT_MIN_MESSAGES = 4


# Per thread: the ledgers of the calls whose input this thread is drawing now, innermost last. A
# call started from inside one call's input gets the ledger's reserve; from inside the input of a
# call that was itself started that way, the two suspended calls may hold every slot: it refuses.
_drawing = threading.local()
MAX_NESTED_CALLS = 1


def _drawing_stack() -> list:
    stack = getattr(_drawing, "ledgers", None)
    if stack is None:
        stack = _drawing.ledgers = []
    return stack


def _release(waiter: asyncio.Future) -> None:
    """A waiting call's timer: its turn comes (a wake-up may have come first)."""
    if not waiter.done():
        waiter.set_result(None)


class _Driving:
    """Around a call's driving loop (`outputs`, `aoutputs`, `acollect`): whatever ends it early --
    an error, KeyboardInterrupt, a cancelled task, a generator or coroutine closed or collected
    unfinished (GeneratorExit) -- aborts the call; every end finishes it."""

    __slots__ = ("call",)

    def __init__(self, call: Call) -> None:
        self.call = call

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, traceback) -> bool:
        try:
            if kind is not None:
                self.call.abort()
        finally:
            self.call.finish()
        return False  # (the exception goes on)


class ResultStream(itertools.chain):
    """A stream's results in input order, taken from its call's turns (a generator of lists, the
    results of each turn) and handed out one by one by C code (`itertools.chain`): no Python frame
    is resumed per result (the generators that yielded each result cost a stream ~0.15 us a result).
    `close()` ends it early, as closing a generator does (the call is aborted); so does dropping it."""

    @classmethod
    def of(cls, turns: Generator[list, None, None]) -> ResultStream:
        stream = cls.from_iterable(turns)
        stream._turns = turns
        return stream

    def close(self) -> None:
        self._turns.close()


def new_call_prefix() -> str:
    """A call's id: random (unguessable: 64 bits); a request's external id is the call's id then its index."""
    return secrets.token_hex(8) + "-"


class Ticket:
    """A RenderBatch sent to a worker: where it went (the worker's and the engine core's slot and
    generation), and how many of its requests are still out."""

    __slots__ = ("batch", "worker", "gen", "engine", "engine_gen", "pending")

    def __init__(self, batch: RenderBatch, worker: int, gen: int, engine: int, engine_gen: int) -> None:
        self.batch, self.worker, self.gen, self.engine, self.engine_gen = batch, worker, gen, engine, engine_gen
        self.pending = len(batch)


class Call:
    """One call (see the module docstring)."""

    def __init__(self, dispatcher: Dispatcher, prefix: str, source, opts: CallOptions, *,
                 progress=None, default_normalize: bool = True, truncate_dim: int | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 keep_all: bool = False) -> None:
        self.dispatcher = dispatcher
        self.ledger = dispatcher.ledger
        self.group = dispatcher.group
        self.prefix = prefix
        self.source = source
        self.batch_items = dispatcher.batch_items
        self.progress = progress
        self.result_type = OUTPUT_TYPES.get(opts.task, PoolingRequestOutput)  # what the caller gets back
        self.errors = opts.errors  # "raise": the first failure ends the call; "return": it becomes an output
        self.stats = CallStats(engines=dispatcher.num_engines)
        self.ring = Ring(dispatcher.max_inflight, prefix, self.result_type, self.stats,
                         default_normalize=default_normalize, truncate_dim=truncate_dim, keep_all=keep_all)
        self.tickets: dict[int, Ticket] = {}
        self.next_ticket = 0
        self.engines_used: set[int] = set()
        self.backlog: deque[RenderBatch] = deque()  # batches to (re)send when a worker can take them
        self.inbox: deque = deque()  # messages routed here by the receiver thread
        self.inflight_chars = 0
        self.held = 0  # slots held (granted + issued and not handed back); changed by the ledger
        self.granted = 0  # slots held for requests not drawn yet
        self.issued = 0
        self.exhausted = False
        self.registered = False
        self.ended = False  # unregistered, or aborted
        self.finished = False
        self.failure: BaseException | None = None  # set by the receiver for this call alone
        # Waking up: a thread's event, or (async calls) a future on the caller's event loop.
        self.loop = loop
        self._event = threading.Event() if loop is None else None  # (a lock and a condition: sync calls only)
        self._waiter: weakref.ref[asyncio.Future] | None = None
        self._signaled = False
        self._wake_pending = False

    # ---- driving the call ------------------------------------------------------------------

    def turns(self) -> Iterator[list[PoolingRequestOutput]]:
        """Results in input order, in the calling thread: each turn's as a list (`ResultStream`
        hands them out one by one)."""
        ready: list[PoolingRequestOutput] = []
        with _Driving(self):
            try:
                while True:
                    self._event.clear()
                    ready, done = self.pump()
                    if ready:
                        yield ready
                    if done:
                        return
                    if not ready:
                        self._event.wait(CALL_WAIT_S)
            finally:
                # Closed early: what is left of the turn being handed out is not handed out (a
                # list is only resumed from once it was read to its end: this clears nothing else).
                ready.clear()

    async def aoutputs(self) -> AsyncIterator[PoolingRequestOutput]:
        """Results in input order, on the caller's event loop (never blocking it to wait)."""
        with _Driving(self):
            while True:
                self._signaled = False
                ready, done = self.pump()
                for out in ready:
                    yield out
                if done:
                    return
                await self._next_turn(bool(ready))

    async def acollect(self) -> list[PoolingRequestOutput]:
        """Every result in input order, on the caller's event loop: a list call's `aoutputs`,
        gathered a turn at a time (an async generator step per result cost a 32-text call ~30 us).
        A coroutine closed unfinished (its task cancelled, or collected with its event loop
        closed) aborts the call, as a closed stream does."""
        outs: list[PoolingRequestOutput] = []
        with _Driving(self):
            while True:
                self._signaled = False
                ready, done = self.pump()
                outs += ready
                if done:
                    return outs
                # Straight to the wake-up even after results: nothing ran since the receiver's
                # last one was handled, so a bare pass of the loop would only find the inbox as
                # it was (a turn more a request). Awaiting it yields to the loop's other tasks.
                await self._next_turn(had_results=False)

    def _next_turn(self, had_results: bool) -> Awaitable[None]:
        """What a turn awaits before the next: a bare pass of the event loop when results came or
        a wake-up is pending -- the loop's other tasks run (and a cancellation lands) between two
        turns, even while results keep coming -- else the receiver's wake-up."""
        if had_results or self._signaled:
            return asyncio.sleep(0)
        return self._wait_for_wake()

    async def _wait_for_wake(self) -> None:
        # Held weakly here (the awaiting task holds it): the dispatcher holds this call, and a
        # strong reference would keep the task, its coroutine and its stream alive after their
        # event loop was closed, so the stream's finalizer (the abort) never ran.
        # The timer re-checks the dispatcher after CALL_WAIT_S (not asyncio.wait_for: its second
        # future, done callback and partial cost a turn ~5 us).
        waiter = self.loop.create_future()
        self._waiter = weakref.ref(waiter)
        timer = self.loop.call_later(CALL_WAIT_S, _release, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def pump(self) -> tuple[list[PoolingRequestOutput], bool]:
        """One turn: handles what the receiver routed here, sends what the bound allows, and
        returns the outputs now ready in order (their slots go back at once: a thread that reads
        several streams in turn must not leave one waiting for slots the other holds) and whether
        the call is complete. Raises the call's failure."""
        dispatcher = self.dispatcher
        if not self.registered:
            self._check_nesting()
            dispatcher.register(self)
            self.registered = True
        failure = self.failure or dispatcher.failure
        if failure is not None:
            raise copy.copy(failure)
        started = time.perf_counter()
        inbox = self.inbox
        handlers = _HANDLERS
        while inbox:
            msg = inbox.popleft()
            handlers[type(msg)](self, msg)
        self._issue()
        ring = self.ring
        out = ring.hand_back(self.issued) if ring.ready_count else []
        if out:
            self.ledger.settle(self, slots=len(out))
        self.stats.frontend_busy_s += time.perf_counter() - started
        done = self.exhausted and ring.next_index == self.issued
        if done and not self.ended:
            self.ended = True
            dispatcher.unregister(self)
        return out, done

    def _check_nesting(self) -> None:
        """Refuses, at once, a call that would wait forever: started on a thread that is drawing
        the input of more than MAX_NESTED_CALLS calls of this group (nested input generators)."""
        depth = _drawing_stack().count(self.ledger)
        if depth > MAX_NESTED_CALLS:
            raise PipelineError(
                f"a call started from inside the input generators of {depth} nested calls of this Pipeline on the "
                "same thread would deadlock: those calls are suspended while this thread draws their input, and "
                "hold the slots it would wait for. Start it from another thread, or nest calls one level deep")

    def deliver(self, msg) -> None:
        """From the receiver thread: a message (or notice) for this call."""
        self.inbox.append(msg)
        self.wake()

    def fail(self, error: BaseException) -> None:
        """From the receiver thread: the whole call fails with `error` (raised from its next turn)."""
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
        waiter = self._waiter() if self._waiter is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- ending ------------------------------------------------------------------------------

    def abort(self) -> None:
        """Drops every request of this call still in flight, in the engine too, and returns its
        slots (through the receiver thread: this may run inside the garbage collector)."""
        if self.ended:
            return
        self.ended = True
        self.exhausted = True
        if not self.registered:
            return
        per_worker, per_engine = Counter(), Counter()
        for ticket in self.tickets.values():
            per_worker[ticket.worker] += ticket.pending
            per_engine[ticket.engine] += ticket.pending
        chars = self.inflight_chars
        self.tickets.clear()
        self.ring.clear()
        self.inflight_chars = 0
        self.backlog.clear()
        self.inbox.clear()
        self.dispatcher.abort(self, sorted(self.engines_used), chars, per_worker, per_engine)

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.stats.wall_s = time.perf_counter() - self.stats.start
            if self.progress is not None:
                self.progress.close()

    # ---- sending -------------------------------------------------------------------------

    def _issue(self) -> None:
        self._resend_backlog()
        if self.exhausted:
            return
        ledger, ring = self.ledger, self.ring
        source, batch_items = self.source, self.batch_items
        while True:
            if not self.granted:
                # Checked before every grant, not once a turn: while this loop sends, results
                # free a few slots at a time, and each grant would become a small message.
                if self._can_wait_for_a_full_batch():
                    break
                self.granted = ledger.grant(self, batch_items)
                if not self.granted:
                    break
                # The ring holds what the call holds: its slots issued and those just granted.
                ring.make_room(self.issued, self.issued + self.granted)
            room = MAX_INFLIGHT_CHARS - ledger.chars
            if room <= 0:  # the text held for requests in flight is at its bound
                ledger.wait(self)
                break
            self._hand_on(self._draw(room))
            if source.exhausted:
                self.exhausted = True
                break
        if self.exhausted:
            ledger.stop_drawing(self)
            if self.granted:
                ledger.settle(self, slots=self.granted)
                self.granted = 0
        inflight = self.issued - ring.next_index
        if inflight > self.stats.max_inflight_seen:
            self.stats.max_inflight_seen = inflight

    def _resend_backlog(self) -> None:
        """The batches no worker could take last turn, tried again (what cannot be sent goes back)."""
        if self.backlog:
            batches = list(self.backlog)
            self.backlog.clear()
            for batch in batches:
                self._send(batch)

    def _hand_on(self, pieces: list) -> None:
        """What `_draw` gave, in input order: each batch sent, each request refused in the caller
        (errors="return") recorded in its slot; each one spends a granted slot."""
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

    def _draw(self, room: int) -> list:
        """Up to `granted` requests from the caller's input (validation errors surface here, in
        the caller), noting that this thread is inside it (its code may start another call)."""
        stack = _drawing_stack()
        stack.append(self.ledger)
        try:
            return self.source.take(self.granted, room)
        finally:
            stack.pop()

    def _can_wait_for_a_full_batch(self) -> bool:
        """Whether to send nothing this turn: fewer slots are free than one full message and
        enough requests are in flight to keep the workers and the engine busy meanwhile.
        Results come back a step at a time (a fast device: a dozen requests); refilling each
        step's slots at once would send as many small messages, and every process pays per
        message. (Unlocked reads: a stale value only delays or hastens one send.)"""
        inflight = self.issued - self.ring.next_index
        if inflight < FULL_BATCH_WAIT_MIN_MESSAGES * self.batch_items:
            return False
        if self.granted + self.ledger.grantable(self) >= self.batch_items:
            return False
        self.ledger.wait(self)  # woken when slots come back
        return True

    def _send(self, batch: RenderBatch) -> None:
        """One batch to the least-loaded worker that is up, for the engine core with the fewest
        requests in flight; into the backlog when no worker can take it now (the call is woken
        when one can)."""
        group, ledger = self.group, self.ledger
        count = len(batch)
        # The generations before the check: a worker lost after it is a generation this send
        # belongs to, so its notice re-sends the batch.
        gens = list(group.worker_gen)
        up = [i for i in range(len(gens)) if group.worker_up(i)]
        route = ledger.route(self, up, count, group.restarting_engines())
        if route is None:
            self.backlog.append(batch)
            return
        worker, engine = route
        engine_gen = group.engine_gen[engine]  # (before the send, as the workers' generations)
        try:
            group.send_work(worker, batch if batch.engine == engine else msgspec.structs.replace(batch, engine=engine))
        except zmq.Again:  # gone since it was checked (or its queue is full): the batch stays with the call
            group.refused(worker)
            ledger.settle(self, workers={worker: count}, engines={engine: count})
            ledger.wait(self, retried_send=True)
            self.backlog.append(batch)
            return
        sizes = batch.sizes
        chars = int(sizes.sum())
        ledger.sent(worker, engine, count, chars)
        number = self.next_ticket
        self.next_ticket += 1
        self.tickets[number] = Ticket(batch, worker, gens[worker], engine, engine_gen)
        self.engines_used.add(engine)
        ring = self.ring
        indices = batch.indices
        slots = indices & ring.mask
        ring.out_index[slots] = indices
        ring.ticket_of[slots] = number
        ring.size_of[slots] = sizes
        self.inflight_chars += chars

    def _refused(self, failed: FailedRequest) -> None:
        self.ring.answer(failed.index, self.result_type(self.prefix, failed.index, None, 0, 1, failed.error))
        self.stats.errors += 1

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
        ring = self.ring
        depths = stats.depths
        depths["engine_window"].add(msg.in_core)
        depths["batch_size"].add(len(msg.indices))
        depths["frontend_inflight"].add(self.issued - ring.next_index)
        depths["reorder_buffer"].add(ring.ready_count)
        data = msg.data
        if not len(msg.indices):  # (the engine sends none; a well-formed empty one changes nothing)
            return
        if data is not None and msg.chunks is None and msg.sparse_ids is None:
            # The usual case: one vector each, in array operations.
            accepted = ring.accept_vectors(msg.indices, data, msg.num_prompt_tokens)
        else:
            accepted = ring.accept_special(msg, self._options_of)
        if accepted is not None:
            self._settle_answered(*accepted, msg.busy_s)

    def _settle_answered(self, slots: np.ndarray, tokens: int, busy_s: float | None = None) -> None:
        """Counts these answered requests and settles their workers, engines and text budget."""
        ring = self.ring
        tickets = ring.ticket_of[slots]
        chars = int(ring.size_of[slots].sum())
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
        self.ledger.settle(self, chars=chars, workers=per_worker, engines=per_engine)
        if self.progress is not None:
            self.progress.update(accepted)
            wall = time.perf_counter() - stats.start
            self.progress.set_postfix_str(f"{stats.prompt_tokens / max(wall, 1e-9):,.0f} tok/s", refresh=False)

    def _options_of(self, index: int) -> m.RenderOptions:
        batch = self.tickets[int(self.ring.ticket_of[index & self.ring.mask])].batch
        return batch.options_of(batch.position_of(index))

    def _owns(self, index: int) -> bool:
        return self.ring.owns(index)

    def _on_render_failed(self, msg: m.RenderFailed) -> None:
        for index, error in zip(msg.indices, msg.errors):
            if self._owns(index):
                if self.errors != "return":
                    raise ValueError(f"request {index}: {error}")
                self.fail_request(index, f"request {index}: {error}")

    def _on_step_failed(self, msg: m.StepFailed) -> None:
        # One request appears once however many of its chunks the failed step held.
        mine = [index for index in dict.fromkeys(msg.indices) if self._owns(index)]
        if mine and self.errors != "return":
            # The call ends: `abort` (on the way out) drops these and every other request still
            # in flight, other chunks of a failed document included.
            ids = [f"{self.prefix}{index}" for index in mine]
            raise StepError(f"the engine core failed a step for requests {mine} (ids {ids}): {msg.error}", ids, mine)
        for index in mine:
            self.fail_request(index, f"request {index}: the model failed on it: {msg.error}")

    def fail_request(self, index: int, error: str) -> None:
        """errors="return": request `index`'s output carries `error`; the call goes on."""
        ring = self.ring
        slot = index & ring.mask
        number = int(ring.ticket_of[slot])
        ticket = self.tickets[number]
        options = ticket.batch.options_of(ticket.batch.position_of(index))
        size = int(ring.size_of[slot])
        ring.out_index[slot] = -1
        ticket.pending -= 1
        if not ticket.pending:
            del self.tickets[number]
        self.inflight_chars -= size
        self.ledger.settle(self, chars=size, workers={ticket.worker: 1}, engines={ticket.engine: 1})
        if options.long_inputs == "chunk":  # its other chunks would be computed for nothing
            ring.chunks.pop(index, None)
            self.group.abort(self.prefix, [index], ticket.engine)
        ring.answer(index, self.result_type(self.prefix, index, None, 0, 1, error))
        self.stats.errors += 1
        if self.progress is not None:
            self.progress.update(1)

    def _on_lost_worker(self, notice: LostWorker) -> None:
        """A worker lost its process: what this call had sent to it is settled and comes again
        from the others."""
        self.stats.worker_restarts += 1
        lost = [number for number, t in self.tickets.items() if t.worker == notice.index and t.gen <= notice.gen]
        if not lost:
            return
        ring = self.ring
        chars, count, per_engine = 0, 0, Counter()
        for number in lost:
            ticket = self.tickets.pop(number)
            indices = ticket.batch.indices
            slots = indices & ring.mask
            out = (ring.out_index[slots] == indices) & (ring.ticket_of[slots] == number)
            positions = np.flatnonzero(out).tolist()
            if not positions:
                continue
            ring.out_index[slots[out]] = -1
            chars += int(ring.size_of[slots[out]].sum())
            count += len(positions)
            per_engine[ticket.engine] += len(positions)
            for index in indices[out].tolist():
                ring.chunks.pop(index, None)  # its chunks come again, whole
            self.backlog.append(msgspec.structs.replace(ticket.batch.select(positions), resent=True))
        self.inflight_chars -= chars
        self.ledger.settle(self, chars=chars, workers={notice.index: count}, engines=per_engine)

    def _on_lost_engine(self, notice: LostEngine) -> None:
        """An engine core lost its process: this call fails if it had requests towards it (the
        abort on the way out settles them; what the new process computes for them is dropped)."""
        self.stats.engine_restarts += 1
        lost = sum([t.pending for t in self.tickets.values() if t.engine == notice.index and t.engine_gen <= notice.gen])
        if lost:
            raise EngineRestartedError(f"{notice.error}\n({lost} request(s) of this call were lost with it)")


# What a call's turn does with each message the receiver routed to it. Plain functions in a module
# table, not bound methods in each call: a call holding its own bound methods is a reference cycle,
# and every finished call would wait for the garbage collector (~30 objects a call).
_HANDLERS = {m.OutputBatch: Call._on_outputs, m.RenderFailed: Call._on_render_failed,
             m.StepFailed: Call._on_step_failed, LostWorker: Call._on_lost_worker,
             LostEngine: Call._on_lost_engine}
