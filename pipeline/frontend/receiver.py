"""The receiver thread of one process group, and the registry of the calls it routes to.

`Dispatcher` owns the only reader of the results socket: a thread that decodes each message and
routes it to its call by the call's id, an explicit field of every message (a request is named by
its call's id and its index; a step's outputs that served several calls are split by their
`call_of` column). Between messages it checks the group's health (engine cores and render workers
that died or wedged, restarted with back-off: every call re-sends what a lost worker held, and a
call that had requests towards a lost engine core fails) and settles the calls that were aborted
(queued by `abort`, which takes no lock).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import zmq

from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.errors import EngineDeadError, PipelineError
from pooling_pipeline.frontend.ledger import Ledger
from pooling_pipeline.process_group import ProcessGroup

if TYPE_CHECKING:
    from pooling_pipeline.frontend.call import Call

log = logging.getLogger("pipeline")

RECEIVE_POLL_MS = 100  # the receiver thread's longest sleep (the RunClock ticks at least this often)
MAX_MESSAGES_PER_TURN = 256  # then health checks and aborted calls get their turn
HEALTH_CHECK_INTERVAL_S = 0.5


class LostWorker:
    """To every call: worker `index` lost its process; requests sent to it up to generation `gen`
    are gone and must be re-sent."""

    __slots__ = ("index", "gen")

    def __init__(self, index: int, gen: int) -> None:
        self.index, self.gen = index, gen


class LostEngine:
    """To every call: engine core `index` lost its process and is being restarted; requests sent
    towards it up to generation `gen` are gone, and a call that had any fails with `error` (the
    group's account of the death). Delivered before anything the new process sends, so such a
    call never hands back an output computed from what the workers had queued for the dead one."""

    __slots__ = ("index", "gen", "error")

    def __init__(self, index: int, gen: int, error: str) -> None:
        self.index, self.gen, self.error = index, gen, error


class Dispatcher:
    """What the calls of one process group share: the receiver thread, the registry of running
    calls (`lock`), the credit ledger (`ledger`, its own lock) and the group's failure."""

    def __init__(self, group: ProcessGroup, *, max_inflight: int, batch_items: int) -> None:
        self.group = group
        self.max_inflight = max_inflight
        self.batch_items = batch_items
        self.num_engines = group.num_engines
        self.ledger = Ledger(max_inflight, len(group.workers), group.num_engines, batch_items)
        self.lock = threading.Lock()  # guards the registry
        self.calls: dict[str, Call] = {}  # prefix -> running call (under lock)
        self.routes: dict[str, Call] = {}  # a copy of `calls` for the receiver, replaced (never changed) under lock
        self.failure: BaseException | None = None  # set once the group cannot serve: every call raises it
        self.aborted: deque[tuple] = deque()  # calls ended by `abort`, settled by the receiver thread
        # Group-wide counters (stats()["group"]).
        self.stray_outputs = 0  # outputs of no running call (aborted or ended calls), dropped
        self.calls_started = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._connecting = False  # a worker is ready but its work socket was not connected yet (m.Probe)
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
                if self.aborted:
                    self._settle_aborted()
                if self._connecting:  # a worker said Ready before its work socket connected
                    self._connect_workers()
                if time.monotonic() >= next_health and not self._stopping:
                    next_health = time.monotonic() + HEALTH_CHECK_INTERVAL_S
                    self._check_health()
        except EngineDeadError as e:
            self._fail_all(e)
        except BaseException as e:  # a bug: say so in every call rather than leave them waiting
            if not self._stopping:
                log.exception("the frontend's receiver thread failed")
                self._fail_all(PipelineError(f"the frontend's receiver thread failed: {type(e).__name__}: {e}"))

    def _connect_workers(self) -> None:
        """Probes the ready workers (and restarted engine cores) not connected yet; wakes the calls
        when a worker connected."""
        group = self.group
        if group.held_aborts:
            group.connect_restarted_engines()
        if group.connect_ready_workers():
            self._wake_all()
        self._connecting = bool(group.unconnected_workers() or group.held_aborts)

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
            if msg.role == "engine":  # a restarted engine core (raises EngineDeadError when it failed to start)
                self.group.engine_started(msg)
            # a restarted worker: calls with work held back can send it once it connects; a restarted
            # engine core: the aborts held for it are sent once its control socket connects
            self._connecting = True
            self._connect_workers()
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
                call.deliver(msg if len(indices) == len(msg.indices) else m.StepFailed(calls=[name] * len(indices),
                                                                                        indices=indices, error=msg.error))

    def _check_health(self) -> None:
        """Tells every call about a lost engine core (each that had requests towards it fails) or
        worker (each settles and re-sends what it had sent there), and restarts them when due.
        Raises EngineDeadError when an engine core keeps dying or cannot start again."""
        group = self.group
        for k, death in group.lost_engines():
            lost_gen, error = group.engine_lost(k, death)  # raises EngineDeadError
            self._tell_calls(LostEngine(k, lost_gen, error))
        if group.engines_down:
            group.start_due_engines()  # (its Ready, later, starts connecting it)
        for index in group.dead_workers():
            lost_gen, error = group.worker_lost(index)
            with self.lock:
                calls = list(self.calls.values())
            notice = LostWorker(index, lost_gen)
            for call in calls:
                call.deliver(notice)
                if error is not None:
                    call.fail(PipelineError(error))
        if group.down and group.start_due_workers():
            self._wake_all()

    def _tell_calls(self, notice) -> None:
        with self.lock:
            calls = list(self.calls.values())
        for call in calls:
            call.deliver(notice)

    def _settle_aborted(self) -> None:
        while self.aborted:
            call, engines, chars, per_worker, per_engine = self.aborted.popleft()
            self.unregister(call, chars, per_worker, per_engine)
            for engine in engines:  # every request of the call, waiting or still on its way
                self.group.abort(call.prefix, None, engine)

    def _fail_all(self, error: BaseException) -> None:
        """The group cannot serve: every call raises `error` from its next turn."""
        if self.failure is None:
            self.failure = error
        self._wake_all()

    def _wake_all(self) -> None:
        with self.lock:
            calls = list(self.calls.values())
        for call in calls + list(self.ledger.take_waiters()):
            call.wake()

    # ---- what calls use ---------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.failure is not None:
            raise copy.copy(self.failure)
        if not self.thread.is_alive() and self.thread.ident is not None:
            raise PipelineError("the frontend's receiver thread is not running")

    def register(self, call: Call) -> None:
        """A call's first turn: its messages are routed to it, and it shares the free slots."""
        with self.lock:
            self.check_usable()
            self.calls[call.prefix] = call
            self.routes = dict(self.calls)
            self.calls_started += 1
        self.ledger.join(call)

    def unregister(self, call: Call, chars: int = 0, per_worker: dict | None = None,
                   per_engine: dict | None = None) -> None:
        """A call has ended (every result handed back, or aborted: then with what it still had
        out): it is routed nothing more, and its slots and credits are settled."""
        with self.lock:
            if self.calls.get(call.prefix) is call:
                del self.calls[call.prefix]
                self.routes = dict(self.calls)
        self.ledger.settle(call, chars=chars, workers=per_worker, engines=per_engine, leaving=True)

    def abort(self, call: Call, engines: list[int], chars: int, per_worker: dict, per_engine: dict) -> None:
        """A call that ended early: the receiver thread aborts its requests (the whole call) in the
        engine cores it sent to and unregisters it with what it still had out. Takes no lock: it
        may run inside the garbage collector."""
        self.aborted.append((call, engines, chars, per_worker, per_engine))
        self.wake_receiver()

    def stats(self) -> dict:
        ledger = self.ledger.stats()
        with self.lock:
            calls_running = len(self.calls)
        return {"inflight": ledger["inflight"], "max_inflight": ledger["max_inflight"],
                "max_inflight_seen": ledger["max_inflight_seen"], "calls_running": calls_running,
                "calls_started": self.calls_started, "stray_outputs_dropped": self.stray_outputs,
                "retried_sends": ledger["retried_sends"], "batches_per_worker": ledger["batches_per_worker"],
                "data_parallel_size": self.num_engines, "requests_per_engine": ledger["requests_per_engine"],
                "inflight_per_engine": ledger["inflight_per_engine"],
                "worker_restarts": self.group.total_restarts, "engine_restarts": self.group.total_engine_restarts,
                "stopped_s": round(self.group.clock.skipped_s, 3)}

    # ---- tear-down ----------------------------------------------------------------------

    def close(self) -> None:
        """Ends every call (they raise "closed"), stops the receiver thread and the group."""
        if os.getpid() != self.group.owner_pid:
            self.group.close()  # a forked child: leaves the parent's group alone
            return
        self._fail_all(PipelineError("this Pipeline is closed"))
        self._stopping = True
        self.wake_receiver()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        self.group.close()
        # Forgotten before they are closed: an abort after close (a stream collected later)
        # must not write into whatever file reuses the descriptor's number.
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
