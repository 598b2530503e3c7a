"""The server's in-flight bound: inputs admitted to the pipeline, all requests together, never more
than its window. A request whose inputs do not fit waits, first come first served, up to a bound and
is then answered 429 with Retry-After (TEI's "model is overloaded") -- so a burst costs a bounded
queue of waiting requests, never an unbounded one inside the pipeline.

And the bounds on what connections hold before a request reaches the window: the bytes of request
bodies held at once, all connections together (`BodyBudget`), and the refusals past them and past the
cap on open connections (both 503 with Retry-After, as uvicorn's --limit-concurrency answers)."""

from __future__ import annotations

import asyncio
import math
from collections import deque

from pooling_pipeline.serve.http import HTTPError


class Overloaded(HTTPError):
    def __init__(self, waited_s: float, retry_after_s: float) -> None:
        super().__init__(429, f"Model is overloaded: no room in the pipeline's window within {waited_s:g} s; "
                              "retry later", headers=[(b"retry-after", str(max(1, math.ceil(retry_after_s))).encode())])


class BodiesFull(HTTPError):
    def __init__(self, capacity: int) -> None:
        super().__init__(503, f"the server holds its limit of {capacity} bytes of request bodies being read or "
                              "answered (--max-held-body-bytes); retry later", headers=[(b"retry-after", b"1")])


class TooManyConnections(HTTPError):
    def __init__(self, capacity: int) -> None:
        super().__init__(503, f"the server has its limit of {capacity} open connections (--max-connections); "
                              "retry later", headers=[(b"retry-after", b"1")])


class BodyBudget:
    """Bytes of request bodies held at once, all connections together: a body reserves its bytes as
    they arrive and gives them back once its request is answered (or dropped). Without it 20 clients
    sending 64 MiB bodies at once took the server past 2.5 GB."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the body byte budget must be at least 1, got {capacity}")
        self.capacity = capacity
        self.held = 0
        self.refused = 0  # requests answered 503 for it

    def take(self, n: int) -> bool:
        """Reserves `n` more bytes if they fit."""
        if self.held + n > self.capacity:
            self.refused += 1
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n
        if self.held < 0:
            raise RuntimeError(f"body bytes given back that were never taken (held {self.held}): this is a bug")


class Admission:
    """`capacity` inputs in flight; `max_wait_s`: how long a request may wait for room."""

    def __init__(self, capacity: int, max_wait_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"the admission capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self.free = capacity
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self.rejected = 0  # requests answered 429

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def inflight(self) -> int:
        return self.capacity - self.free

    def try_acquire(self, n: int) -> bool:
        """Room for `n` inputs now, if there is some and nobody waits before (no coroutine: the usual case)."""
        if not 1 <= n <= self.capacity:
            raise RuntimeError(f"admission of {n} inputs with capacity {self.capacity}: this is a bug")
        if not self._waiters and self.free >= n:
            self.free -= n
            return True
        return False

    async def acquire(self, n: int) -> None:
        """Room for `n` inputs (1 <= n <= capacity, checked by the caller), or Overloaded."""
        if self.try_acquire(n):
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait({entry[1]}, timeout=self.max_wait_s)  # (does not cancel the future)
        except asyncio.CancelledError:  # the client went away while waiting
            self._leave(entry)
            raise
        if not entry[1].done():
            self._leave(entry)
            self.rejected += 1
            raise Overloaded(self.max_wait_s, self.max_wait_s)

    def release(self, n: int) -> None:
        self.free += n
        if self.free > self.capacity:
            raise RuntimeError(f"admission released more than it admitted ({self.free} > {self.capacity}): this is a bug")
        self._grant()

    def _leave(self, entry: tuple[int, asyncio.Future]) -> None:
        if entry[1].done():  # granted just as it gave up: the room goes back
            self.release(entry[0])
        else:
            entry[1].cancel()
            self._waiters.remove(entry)
            self._grant()  # a large request that left may have held smaller ones back

    def _grant(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            n, future = self._waiters.popleft()
            self.free -= n
            future.set_result(None)
