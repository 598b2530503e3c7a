"""The credits the calls of one process group share, charged as calls send and settled in one place.

A call is granted slots of the in-flight bound (`max_inflight`, shared fairly among the calls still
drawing input) before it draws requests. A few slots (`reserve`: one message's worth, at most a
quarter of the bound) go only to a call that holds none: a call holds its slots until its results
are handed out, so one whose caller is busy elsewhere -- drawing its input from a generator that
itself runs another call, or waits for one in another thread -- could otherwise hold them all while
that other call waits for one. Each block a call sends is charged to the least-loaded render
worker that is up, to the engine core with the fewest requests in flight, and its text to the text
budget (the text is kept for re-sending). Every request charged is settled exactly once -- answered,
failed, lost with its worker, dropped with its aborted call, or its send refused -- through
`settle`. A count that would go negative is an accounting bug: `settle` raises rather than clamp
it, since a clamped count lets the bound drift silently.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pooling_pipeline.frontend.call import Call


def _give_back(loads: list[int], counts: dict[int, int], what: str) -> None:
    """Takes `counts` (by index) back from `loads`; a load below 0 is a broken ledger."""
    for k, count in counts.items():
        loads[k] -= count
        if loads[k] < 0:
            raise _bug(f"{what} {k}'s requests in flight")


def _bug(what: str) -> RuntimeError:
    return RuntimeError(f"the frontend's ledger: {what} went negative (this is a bug)")


class Ledger:
    """Slots, text and per-worker / per-engine loads of one group, under `lock` (see the module
    docstring). A call's own slot count is `call.held` (granted and not yet handed back), changed
    only here."""

    def __init__(self, max_inflight: int, num_workers: int, num_engines: int, batch_items: int = 1) -> None:
        self.lock = threading.Lock()
        self.max_inflight = max_inflight
        self.reserve = min(batch_items, max(1, max_inflight // 4))  # free slots kept for a call holding none
        self.free = max_inflight  # slots not held by any call
        self.chars = 0  # text held for requests sent and not yet settled, all calls
        self.worker_load = [0] * num_workers  # requests charged to each render worker, not yet settled
        self.engine_load = [0] * num_engines  # requests charged to each engine core, not yet settled
        self.drawing: set[Call] = set()  # calls still reading their input: they share the free slots
        self.waiters: set[Call] = set()  # calls that found no slot, text budget or worker: woken by a settle
        # Group-wide counts (stats()["group"]).
        self.peak_inflight = 0
        self.retried_sends = 0  # batches a worker could not take (gone); sent again elsewhere
        self.batches_per_worker = [0] * num_workers
        self.requests_per_engine = [0] * num_engines  # requests sent to each engine core

    # ---- slots ------------------------------------------------------------------------------

    def join(self, call: Call) -> None:
        """A call starts: it shares the free slots while it draws input."""
        with self.lock:
            self.drawing.add(call)

    def stop_drawing(self, call: Call) -> None:
        """A call's input is exhausted: the free slots are shared among the others."""
        with self.lock:
            self.drawing.discard(call)

    def grantable(self, call: Call) -> int:
        """How many more slots `call` could be granted now: its share (max_inflight / calls
        drawing) less what it holds, within the free slots (less the reserve, unless it holds
        none). (The caller holds the lock, or reads a value that may be stale by the time it
        acts on it.)"""
        share = max(1, self.max_inflight // max(1, len(self.drawing)))
        free = self.free if call.held == 0 else self.free - self.reserve
        return min(free, share - call.held)

    def grant(self, call: Call, want: int) -> int:
        """Up to `want` slots for `call` (0: none now; the call is woken when some come back)."""
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

    def wait(self, call: Call, *, retried_send: bool = False) -> None:
        """`call` waits for credits (woken by the next settle that returns slots or text)."""
        with self.lock:
            self.waiters.add(call)
            if retried_send:
                self.retried_sends += 1

    def take_waiters(self) -> set[Call]:
        with self.lock:
            waiters, self.waiters = self.waiters, set()
        return waiters

    # ---- workers and engine cores ---------------------------------------------------------------

    def route(self, call: Call, up: list[int], count: int, restarting: frozenset[int] = frozenset()
              ) -> tuple[int, int] | None:
        """Charges `count` requests to the least-loaded worker of `up` and the engine core with
        the fewest in flight, among those not `restarting` when there are any (a batch for an engine
        core being restarted would wait for it): (worker, engine), or None when no worker is up (the
        call waits)."""
        with self.lock:
            if not up:
                self.waiters.add(call)
                return None
            worker = min(up, key=self.worker_load.__getitem__)
            self.worker_load[worker] += count
            loads = self.engine_load
            engines = [k for k in range(len(loads)) if k not in restarting] or range(len(loads))
            engine = 0 if len(loads) == 1 else min(engines, key=loads.__getitem__)
            loads[engine] += count
            return worker, engine

    def sent(self, worker: int, engine: int, count: int, chars: int) -> None:
        """A routed batch went out: its text is held until its requests are settled."""
        with self.lock:
            self.chars += chars
            self.batches_per_worker[worker] += 1
            self.requests_per_engine[engine] += count

    # ---- settling ---------------------------------------------------------------------------------

    def settle(self, call: Call, slots: int = 0, chars: int = 0, workers: dict | None = None,
               engines: dict | None = None, *, leaving: bool = False) -> None:
        """Credits come back: `slots` of `call`'s (results handed back, or a grant not used),
        `chars` of text, and requests per worker and per engine core ({index: count}: answered,
        failed, lost, aborted, or a send refused). `leaving`: the call has ended; it stops sharing
        and returns every slot it holds. The calls waiting (other than `call`, which is running)
        are woken when slots, text or a share came back."""
        with self.lock:
            if leaving:
                self.drawing.discard(call)
                self.waiters.discard(call)
                slots = call.held
            if slots:
                call.held -= slots
                self.free += slots
                if call.held < 0 or self.free > self.max_inflight:
                    raise _bug(f"call {call.prefix}'s slots")
            if chars:
                self.chars -= chars
                if self.chars < 0:
                    raise _bug("the text held in flight")
            if workers:
                _give_back(self.worker_load, workers, "render worker")
            if engines:
                _give_back(self.engine_load, engines, "engine core")
            waiters = None
            if (slots or chars or leaving) and self.waiters:
                waiters, self.waiters = self.waiters, set()
        if waiters:
            for waiter in waiters:
                if waiter is not call:
                    waiter.wake()

    def stats(self) -> dict:
        with self.lock:
            return {"inflight": self.max_inflight - self.free, "max_inflight": self.max_inflight,
                    "max_inflight_seen": self.peak_inflight, "retried_sends": self.retried_sends,
                    "batches_per_worker": list(self.batches_per_worker),
                    "requests_per_engine": list(self.requests_per_engine),
                    "inflight_per_engine": list(self.engine_load)}
